"""Interventions (write sites) on transformers: each kind equals a forward hook doing the same on
the unpatched model, bit for bit in float32, for every family; per-request rows; capture order;
values changed between generate() calls reach the same compiled graph; bad specs refused."""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dmi
from conftest import FAMILIES, SPECS, model_pair
from dmi.errors import SpecError

# (kind, candidate sites in order, extra entry keys); a site whose hf anchor is an input or output
# of a module, so that a plain forward hook on the unpatched model can do the same
KINDS = [
    ("add", ["resid_post"], {"scale": 1.5, "tokens": "all"}),
    ("scale", ["attn.z"], {"scale": -0.5, "heads": [1], "tokens": "last"}),
    ("zero", ["mlp.act", "mlp.in", "mlp.out"], {"tokens": {"positions": [2, 5]}}),
    ("mean", ["mlp.out", "attn.out"], {}),
    ("replace", ["attn.out", "resid_post"], {"tokens": {"positions": [1, 4]}}),
    ("clamp", ["resid_mid", "mlp.in"], {"min": -0.05, "max": 0.02}),
]
LAYER = 1


def _site_for(family: str, model, candidates: list[str]) -> str:
    """The first candidate anchored at a module's input or output that exists at LAYER of ``model``
    (DeepSeek-V3's MoE layers have no mlp.act)."""
    sites = SPECS[family]["sites"]

    def exists(c):
        try:
            model.get_submodule(sites[c]["hf"]["module"].format(i=LAYER))
            return True
        except AttributeError:
            return False
    return next(c for c in candidates if c in sites and "hf" in sites[c]
                and ("input" in sites[c]["hf"] or "output" in sites[c]["hf"]) and exists(c))


def _trailing(model, family: str, site: str) -> tuple[int, ...]:
    cfg, dims = model.config, SPECS[family]["dims"]
    out = []
    for d in SPECS[family]["sites"][site]["dims"][1:]:
        v = getattr(cfg, dims[d], None)
        if v is None and d == "head_dim":
            v = cfg.hidden_size // cfg.num_attention_heads
        out.append(v)
    return tuple(out)


def _entry(family: str, model, kind: str, candidates: list[str], extra: dict, gen: torch.Generator) -> dict:
    site = _site_for(family, model, candidates)
    shape = _trailing(model, family, site)
    entry = {"name": kind, "site": site, "layers": [LAYER], "kind": kind, **extra}
    if kind in ("add", "mean"):
        entry["vector"] = torch.randn(shape, generator=gen).tolist()
    if kind == "replace":
        entry["vector"] = torch.randn((3, *shape), generator=gen).tolist()     # one row per position 1..3
    return entry


def _rows(attention_mask: torch.Tensor, tokens) -> torch.Tensor:
    """[batch, seq] bool: the rows of one left-padded prefill forward an entry's tokens select."""
    real = attention_mask.bool()
    pos = attention_mask.cumsum(1) - 1
    if tokens == "last":
        keep = torch.zeros_like(real)
        keep[:, -1] = True
        return keep & real
    if isinstance(tokens, dict) and "positions" in tokens:
        a, b = tokens["positions"]
        return real & (pos >= a) & (pos < b)
    return real


def reference(entry: dict, shape: tuple, rows: torch.Tensor, positions: torch.Tensor):
    """What the entry does, written by hand on [batch, seq, *shape] (x as the module sees it)."""
    def fn(x):
        b, s = x.shape[:2]
        y = x.reshape(b, s, *shape).clone()
        sel = y[rows]
        part = sel[:, entry["heads"]] if "heads" in entry else sel
        kind = entry["kind"]
        if kind == "add":
            part = part + entry["scale"] * torch.tensor(entry["vector"])
        elif kind == "scale":
            part = part * entry["scale"]
        elif kind == "zero":
            part = torch.zeros_like(part)
        elif kind == "mean":
            part = torch.tensor(entry["vector"]).expand_as(part)
        elif kind == "replace":
            start = entry["tokens"]["positions"][0]
            part = torch.tensor(entry["vector"])[positions[rows] - start]
        elif kind == "clamp":
            part = part.clamp(min=entry["min"], max=entry["max"])
        if "heads" in entry:
            sel[:, entry["heads"]] = part
        else:
            sel = part
        y[rows] = sel
        return y.reshape(x.shape)
    return fn


def hook(model, family: str, site: str, layer: int, fn):
    """A forward (pre-)hook applying ``fn`` at the site's hf anchor of the unpatched ``model``."""
    anchor = SPECS[family]["sites"][site]["hf"]
    module = model.get_submodule(anchor["module"].format(i=layer))
    if "input" in anchor:
        params = [p for p in inspect.signature(type(module).forward).parameters if p != "self"]
        pos = anchor["input"] if isinstance(anchor["input"], int) else params.index(anchor["input"])
        name = params[pos]

        def pre(m, args, kwargs):
            if len(args) > pos:
                return args[:pos] + (fn(args[pos]),) + args[pos + 1:], kwargs
            return args, {**kwargs, name: fn(kwargs[name])}
        return module.register_forward_pre_hook(pre, with_kwargs=True)
    index = anchor["output"]

    def post(m, args, out):
        if isinstance(out, tuple):
            return out[:index] + (fn(out[index]),) + out[index + 1:]
        return fn(out)
    return module.register_forward_hook(post)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_kind_equals_a_forward_hook_on_the_unpatched_model(family, encoded, tmp_path):
    model, ref = model_pair(family, attn="eager")
    gen = torch.Generator().manual_seed(1)
    entries = [dict(_entry(family, model, kind, cands, extra, gen), enabled=False) for kind, cands, extra in KINDS]
    spec = {"capture": [{"sites": ["final_norm"]}], "interventions": entries}
    mask = encoded["attention_mask"]
    real = mask.bool()
    with torch.no_grad():
        base = ref(**encoded).logits
        with dmi.load(model, hook_spec=spec, store=tmp_path / "out.zarr") as run:
            assert torch.equal(run.model(**encoded).logits[real], base[real])     # all disabled: the model's bits
            for entry in entries:
                run.set_intervention(entry["name"], enabled=True)
                got = run.model(**encoded).logits
                run.set_intervention(entry["name"], enabled=False)
                shape = _trailing(model, family, entry["site"])
                h = hook(ref, family, entry["site"], LAYER,
                         reference(entry, shape, _rows(mask, entry.get("tokens", "all")), mask.cumsum(1) - 1))
                try:
                    want = ref(**encoded).logits
                finally:
                    h.remove()
                assert torch.equal(got[real], want[real]), (family, entry["kind"], entry["site"])
                assert not torch.equal(got[real], base[real]), f"{entry['kind']} changed nothing"


def test_per_request_rows_and_capture_order(encoded, tmp_path):
    """An intervention for request "b" touches its rows only; a capture of the same site stores the
    value after it (default) or before it (capture: before)."""
    model, ref = model_pair("qwen3", attn="eager")
    hidden = model.config.hidden_size
    vec = torch.randn(hidden, generator=torch.Generator().manual_seed(2))
    spec = {"capture": [{"sites": ["resid_post", "mlp.out"], "layers": [0]}],
            "interventions": [
                {"name": "steer", "site": "resid_post", "layers": [0], "kind": "add", "vector": vec.tolist(),
                 "requests": ["b"]},
                {"name": "ablate", "site": "mlp.out", "layers": [0], "kind": "zero", "requests": ["b"],
                 "capture": "before"}]}
    with torch.no_grad():
        run = dmi.load(model, hook_spec=spec, store=tmp_path / "out.zarr")
        with run:
            run.set_request_ids(["a", "b", "c"])
            got = run.model(**encoded).logits
        seen = {}
        batch_row = torch.tensor([False, True, False])[:, None].expand_as(encoded["attention_mask"])

        def keep(name, fn):
            def wrapped(x):
                seen[name + ".before"] = x.clone()
                y = fn(x)
                seen[name] = y.clone()
                return y
            return wrapped
        rows = batch_row & encoded["attention_mask"].bool()
        hs = [hook(ref, "qwen3", "resid_post", 0, keep("resid_post", lambda x: torch.where(rows[..., None], x + vec, x))),
              hook(ref, "qwen3", "mlp.out", 0, keep("mlp.out", lambda x: x.masked_fill(rows[..., None], 0)))]
        want = ref(**encoded).logits
        for h in hs:
            h.remove()
    real = encoded["attention_mask"].bool()
    assert torch.equal(got[real], want[real])
    base = ref(**encoded).logits
    for b in (0, 2):        # unsteered requests: the model's own bits
        assert torch.equal(got[b][real[b]], base[b][real[b]])
    tree = dmi.open(tmp_path / "out.zarr")
    np.testing.assert_array_equal(tree["layers/resid_post"].dataset.resid_post.sel(layer=0).values,
                                  seen["resid_post"][real].numpy())          # after the add
    np.testing.assert_array_equal(tree["layers/mlp/out"].dataset.out.sel(layer=0).values,
                                  seen["mlp.out.before"][real].numpy())      # before the ablation


def _compiled(backend="aot_eager"):
    from transformers import CompileConfig
    config = CompileConfig(backend=backend, fullgraph=True, mode=None)
    config._compile_all_devices = True          # (transformers compiles for CUDA devices only unless told)
    return dict(do_sample=False, cache_implementation="static", compile_config=config)


def test_compiled_generate_takes_new_vectors_without_recompiling(encoded, tmp_path):
    """generate()'s compiled forward reads the steering vector from a buffer: a vector changed
    between generate() calls changes the tokens, as the eager reference does, with no new compile
    (Dynamo's counters); a disabled intervention gives the unsteered tokens."""
    from torch._dynamo.utils import counters
    model, ref = model_pair("qwen3", attn="sdpa")
    hidden = model.config.hidden_size
    g = torch.Generator().manual_seed(3)
    v1, v2 = torch.randn(hidden, generator=g) * 4, torch.randn(hidden, generator=g) * 4
    spec = {"capture": [{"sites": ["final_norm"], "tokens": "last"}],
            "interventions": [{"name": "steer", "site": "resid_post", "layers": [1], "kind": "add",
                               "vector": v1.tolist()}]}
    kw = dict(max_new_tokens=5)

    def reference_tokens(vec):
        rows = encoded["attention_mask"].bool()

        def fn(x):
            r = rows if x.shape[1] == rows.shape[1] else torch.ones(x.shape[:2], dtype=torch.bool)
            return x if vec is None else torch.where(r[..., None], x + vec, x)
        h = hook(ref, "qwen3", "resid_post", 1, fn)
        try:
            return ref.generate(**encoded, **kw, do_sample=False)
        finally:
            h.remove()

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "out.zarr") as run:
        first = run.model.generate(**encoded, **kw, **_compiled())
        frames = counters["stats"]["unique_graphs"]
        assert frames >= 1
        run.set_intervention("steer", vector=v2)
        second = run.model.generate(**encoded, **kw, **_compiled())
        run.set_intervention("steer", enabled=False)
        third = run.model.generate(**encoded, **kw, **_compiled())
        assert counters["stats"]["unique_graphs"] == frames, "a changed vector or flag recompiled"
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(first, reference_tokens(v1))
        assert torch.equal(second, reference_tokens(v2))
        assert torch.equal(third, reference_tokens(None))
    assert not torch.equal(first, second)


@pytest.mark.parametrize("entry, key, words", [
    ({"site": "resid_postt", "kind": "add", "vector": [0.0]}, "site", "not a site"),
    ({"site": "resid_post", "kind": "add", "vector": [0.0, 1.0]}, "vector", "does not match"),
    ({"site": "attn.pattern", "kind": "zero"}, "site", "never materializes"),
    ({"site": "logits", "kind": "zero"}, "site", "some rows only"),
    ({"site": "resid_post", "kind": "add"}, "interventions[0]", "needs `vector`"),
    ({"site": "resid_post", "kind": "zero", "scale": 2.0}, "scale", "takes no 'scale'"),
    ({"site": "resid_post", "kind": "clamp", "min": 1.0, "max": 0.0}, "min", "above max"),
    ({"site": "attn.z", "kind": "zero", "heads": [99]}, "heads", "out of range"),
    ({"site": "final_norm", "kind": "zero", "layers": [0]}, "layers", "not per-layer"),
    ({"site": "resid_post", "kind": "zero", "tokens": {"every_n_steps": 2}}, "every_n_steps", "unknown key"),
    ({"site": "resid_post", "kind": "wipe"}, "kind", "wipe"),
    ({"site": "resid_post", "kind": "scale", "client": {"scale": [0, 1]}}, "client", "requests: on_request"),
    ({"site": "resid_post", "kind": "zero", "requests": "on_request", "client": {"scale": [0, 1]}}, "client.scale",
     "takes no 'scale'"),
    ({"site": "resid_post", "kind": "scale", "requests": "on_request", "client": {"scale": [1, 0]}}, "client.scale",
     "is empty"),
    ({"site": "resid_post", "kind": "replace", "vector": [[0.0] * 64] * 2, "requests": "on_request",
      "client": {"vector": {"max_norm": 1}}}, "client.vector", "replacement table"),
])
def test_bad_interventions_are_refused_before_anything_runs(entry, key, words, write_spec, tmp_path):
    import yaml
    spec = write_spec(yaml.safe_dump({"capture": [{"sites": ["final_norm"]}],
                                      "interventions": [{"name": "x", **entry}]}))
    model, _ = model_pair("qwen3")
    with pytest.raises(SpecError) as e:
        dmi.load(model, hook_spec=spec, store=tmp_path / "out.zarr")
    msg = str(e.value)
    assert str(spec) in msg and key in msg and words in msg and "Fix:" in msg, msg
    assert not (tmp_path / "out.zarr").exists()
    assert not any("_dmi_sites" in m.__dict__ for m in model.modules())


def test_set_intervention_refuses_what_the_intervention_cannot_take(tmp_path):
    model, _ = model_pair("qwen3")
    spec = {"capture": [{"sites": ["final_norm"]}],
            "interventions": [{"name": "steer", "site": "resid_post", "layers": [0], "kind": "add",
                               "vector": [0.0] * model.config.hidden_size}]}
    with dmi.load(model, hook_spec=spec, store=tmp_path / "out.zarr") as run:
        with pytest.raises(ValueError, match="no intervention named 'nope'.*Fix"):
            run.set_intervention("nope", enabled=False)
        with pytest.raises(ValueError, match="does not match the site's trailing dims"):
            run.set_intervention("steer", vector=[1.0, 2.0])
        with pytest.raises(ValueError, match="only clamp takes min/max"):
            run.set_intervention("steer", min=0.0)


def test_interventions_without_capture(encoded, tmp_path):
    """A hook spec with interventions and no capture: no store needed (an empty result), or an
    empty store; the model's outputs are those of a forward hook doing the same."""
    model, ref = model_pair("qwen3", attn="eager")
    spec = {"interventions": [{"name": "ablate", "site": "mlp.out", "layers": [0], "kind": "zero"}]}
    h = hook(ref, "qwen3", "mlp.out", 0, torch.zeros_like)
    with torch.no_grad():
        want = ref(**encoded).logits
        h.remove()
        real = encoded["attention_mask"].bool()
        for store in (None, tmp_path / "out.zarr"):
            with dmi.load(model, hook_spec=spec, store=store) as run:
                got = run.model(**encoded).logits
            assert torch.equal(got[real], want[real])
            assert not torch.equal(got[real], ref(**encoded).logits[real])
    tree = dmi.open(tmp_path / "out.zarr")
    assert tree.attrs["dmi_status"] == "closed"
    assert not [n.path for n in tree.subtree if "token" in n.dataset.dims]      # no site's rows: nothing captured


def test_a_step_larger_than_the_mask_buffers_with_interventions_off_then_on(tmp_path):
    """A step of more rows than the intervention buffers were made for (a large prefill): while
    the intervention is declared off it leaves the outputs as they are, switched on it equals a
    forward hook doing the same on every row."""
    from dmi.interventions import DEFAULT_ROWS
    model, ref = model_pair("qwen3", attn="eager")
    ids = torch.randint(3, 100, (2, DEFAULT_ROWS // 2 + 8), generator=torch.Generator().manual_seed(0))
    spec = {"interventions": [{"name": "ablate", "site": "mlp.out", "layers": [0], "kind": "zero", "enabled": False}]}
    with torch.no_grad():
        plain = ref(input_ids=ids).logits
        h = hook(ref, "qwen3", "mlp.out", 0, torch.zeros_like)
        ablated = ref(input_ids=ids).logits
        h.remove()
        with dmi.load(model, hook_spec=spec) as run:
            assert torch.equal(run.model(input_ids=ids).logits, plain)
            run.set_intervention("ablate", enabled=True)
            assert torch.equal(run.model(input_ids=ids).logits, ablated)


class _Ops(TorchDispatchMode):
    """The aten ops a block of code dispatches, by name."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_an_eager_forward_runs_no_op_of_an_intervention_switched_off():
    """Eager code skips an intervention that is off (its mask would change no bit): the patched
    forward dispatches the unpatched model's ops and dmi's step bracket, nothing more; switched
    on, its ops run."""
    model, ref = model_pair("qwen3", attn="eager")
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    spec = {"interventions": [{"name": "ablate", "site": "mlp.out", "layers": [0], "kind": "zero", "enabled": False}]}
    with torch.no_grad():
        with _Ops() as vanilla:
            ref(input_ids=ids)
        with dmi.load(model, hook_spec=spec) as run:
            with _Ops() as off:
                run.model(input_ids=ids)
            run.set_intervention("ablate", enabled=True)
            with _Ops() as on:
                run.model(input_ids=ids)
    bracket = ["dmi.step_begin.default", "dmi.step_end.default"]
    assert [op for op in off.ops if op not in bracket] == vanilla.ops
    assert len(on.ops) > len(off.ops)


def test_an_eager_forward_runs_no_op_of_an_intervention_with_no_row_in_the_step():
    """Eager code also skips an intervention that is on but touches no row of this step: a token
    window the step does not reach, a request filter naming no request of the batch. When the
    step has its rows, its ops run."""
    model, ref = model_pair("qwen3", attn="eager")
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    spec = {"interventions": [
        {"name": "late", "site": "mlp.out", "layers": [0], "kind": "zero", "tokens": {"positions": [40, 50]}},
        {"name": "theirs", "site": "attn.z", "layers": [1], "kind": "zero", "requests": ["b"]}]}
    bracket = ["dmi.step_begin.default", "dmi.step_end.default"]
    with torch.no_grad():
        with _Ops() as vanilla:
            ref(input_ids=ids)
        with dmi.load(model, hook_spec=spec) as run:
            run.set_request_ids(["x", "y"])
            with _Ops() as idle:
                run.model(input_ids=ids)
            run.set_request_ids(["z", "b"])
            with _Ops() as theirs:
                run.model(input_ids=ids)
    assert [op for op in idle.ops if op not in bracket] == vanilla.ops
    assert len(theirs.ops) > len(idle.ops)


def test_interventions_sharing_a_token_filter_follow_it_across_decode_steps():
    """Interventions with the same token filter share one mask a step (computed once); through
    generate()'s decode steps each still touches exactly its rows: a window that ends a few steps
    into decoding, and a request filter beside an intervention on every row. The logits equal
    the unpatched model's over the whole sequence with forward hooks doing the same."""
    model, ref = model_pair("qwen3", attn="eager")
    g = torch.Generator().manual_seed(3)
    vec = torch.randn(model.config.hidden_size, generator=g)
    ids = torch.randint(3, 100, (2, 6), generator=g)
    window = {"positions": [4, 9]}          # the prompt's last two rows and the first three decode steps
    spec = {"interventions": [
        {"name": "steer", "site": "resid_post", "layers": [0], "kind": "add", "vector": vec.tolist(), "scale": 4.0,
         "tokens": window},
        {"name": "ablate", "site": "mlp.out", "layers": [1], "kind": "zero", "tokens": window},
        {"name": "halve", "site": "mlp.out", "layers": [0], "kind": "scale", "scale": 0.5},
        {"name": "theirs", "site": "resid_post", "layers": [1], "kind": "add", "vector": vec.tolist(), "scale": 4.0,
         "requests": ["b"]}]}
    with torch.no_grad():
        with dmi.load(model, hook_spec=spec) as run:
            run.set_request_ids(["a", "b"])
            out = run.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                     min_new_tokens=8, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
        seq = out.sequences
        inside = ((torch.arange(seq.shape[1]) >= 4) & (torch.arange(seq.shape[1]) < 9))[None, :, None]
        b = torch.tensor([False, True])[:, None, None]
        hs = [hook(ref, "qwen3", "resid_post", 0, lambda x: torch.where(inside, x + 4.0 * vec, x)),
              hook(ref, "qwen3", "mlp.out", 1, lambda x: x.masked_fill(inside, 0)),
              hook(ref, "qwen3", "mlp.out", 0, lambda x: x * 0.5),
              hook(ref, "qwen3", "resid_post", 1, lambda x: torch.where(b, x + 4.0 * vec, x))]
        try:
            want = ref(input_ids=seq).logits[:, ids.shape[1] - 1:-1]
        finally:
            for h in hs:
                h.remove()
        base = ref(input_ids=seq).logits[:, ids.shape[1] - 1:-1]
    got = torch.stack(out.logits, 1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, base, atol=1e-2)


def test_patching_from_a_previous_capture(tokenizer, tmp_path):
    """Activation patching from a store: a clean run captures resid_post; a second run replaces
    positions [1, 4) of another prompt with the clean request's rows (values_from_store), bit for
    bit what a forward hook writing those rows does on the unpatched model. A source the store
    has not captured is an error naming it."""
    from dmi.interventions import InterventionError, values_from_store
    model, ref = model_pair("qwen3", attn="eager")
    hidden = model.config.hidden_size
    clean = tokenizer(["Paris is the capital of France"], return_tensors="pt")
    corrupt = tokenizer(["Rome is the capital of Italy!"], return_tensors="pt")
    with torch.no_grad(), dmi.load(model, hook_spec={"capture": [{"sites": ["resid_post"], "layers": [1]}]},
                                   store=tmp_path / "clean.zarr") as run:
        run.set_request_ids(["clean"])
        run.model(**clean)
    tree = dmi.open(tmp_path / "clean.zarr")
    table = values_from_store(tree, "clean", "resid_post", layer=1, positions=(1, 4))
    assert table.shape == (3, hidden)
    spec = {"interventions": [{"name": "patch", "site": "resid_post", "layers": [1], "kind": "replace",
                               "vector": np.zeros((3, hidden)).tolist(), "tokens": {"positions": [1, 4]}}]}
    with torch.no_grad():
        with dmi.load(model, hook_spec=spec) as run:
            run.set_intervention("patch", vector=table)
            got = run.model(**corrupt).logits

        def write(x):
            y = x.clone()
            y[0, 1:4] = torch.from_numpy(table)
            return y
        h = hook(ref, "qwen3", "resid_post", 1, write)
        want = ref(**corrupt).logits
        h.remove()
    assert torch.equal(got, want)
    assert not torch.equal(got, ref(**corrupt).logits)
    for args, words in [(("nope", "resid_post"), "request 'nope' has no rows"),
                        (("clean", "mlp.out"), "holds no site 'mlp.out'"),
                        (("clean", "resid_post"), "not captured at layer 0")]:
        with pytest.raises(InterventionError, match=words):
            values_from_store(tree, *args, layer=0 if words.startswith("not captured") else 1)
    with pytest.raises(InterventionError, match=r"no rows of 'resid_post' at positions \[40, 41\]"):
        values_from_store(tree, "clean", "resid_post", layer=1, positions=(40, 42))
