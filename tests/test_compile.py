"""torch.compile(fullgraph=True) of a patched model: no graph break, captures equal eager.

CPU CI uses the ``aot_eager`` backend: Dynamo traces the patched forward (site ops, step ops,
rewritten module code) into one graph and AOTAutograd functionalizes the ops' ``ticket``
mutation, which is what a graph break or a lost op would show; the numerics stay eager's, so the
stores compare bit for bit. (Inductor on CPU takes about 90 s here on 2 cores and rounds
differently from eager; the GPU suite runs inductor and CUDA graphs.)
"""
from __future__ import annotations

import copy
import inspect
import re

import numpy as np
import pytest
import torch

import dmi
from conftest import build_tiny_model, model_pair, patched_modules
from engine_spec import with_engine


def _arrays(tree):
    return {(node.path, v): node.dataset[v].values for node in tree.subtree for v in node.dataset.data_vars}


def test_compiled_forward_has_no_graph_break_and_captures_equal_eager(encoded, write_spec, tmp_path):
    spec = write_spec("""
        capture:
          - sites: [resid_post, final_norm, attn.q, attn.z, mlp.out]
          - sites: [attn.pattern]
            layers: [1]
            max_keys: 64
          - sites: [logits]
            tokens: last
            reduce: {topk: 4}
    """)
    model, ref = model_pair("qwen3", attn="sdpa")
    with torch.no_grad():
        model(**encoded)    # transformers' first forward installs its output-capturing hooks (under a lock)
    with torch.no_grad(), dmi.load(ref, hook_spec=spec, store=tmp_path / "eager.zarr") as run:
        want = run.model(**encoded).logits
    torch._dynamo.reset()
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "compiled.zarr") as run:
        explain = torch._dynamo.explain(run.model.forward)(**encoded)
        assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
        torch._dynamo.reset()
        forward = torch.compile(run.model.forward, fullgraph=True, backend="aot_eager")
        first = forward(**encoded).logits
        second = forward(**encoded).logits          # the compiled graph runs again: a second step
        steps = run.stats()["steps"]
    torch._dynamo.reset()
    assert torch.equal(first, want) and torch.equal(second, want)
    assert steps == 3       # explain's trace, then two compiled calls: every call is one fresh step
    eager, compiled = _arrays(dmi.open(tmp_path / "eager.zarr")), _arrays(dmi.open(tmp_path / "compiled.zarr"))
    for key, e in eager.items():
        if key[0] == "/drops":
            continue
        c = compiled[key]
        assert c.shape[0] == 3 * e.shape[0], key
        for k in range(3):
            np.testing.assert_array_equal(c[k * len(e):(k + 1) * len(e)], e, err_msg=str(key))


def test_patched_layers_compile_to_one_graph(encoded, write_spec, tmp_path):
    """A site's identity is a tensor the site op takes (``Run.site_tensors``), not a constant of the
    graph: each decoder layer, compiled on its own, reuses the first layer's graph, as unpatched
    layers do. vLLM relies on the same sameness to compile one piece for all layers (an int site
    made every layer's piece a compile of its own: 94 s against 12 s for Qwen3-8B on the H200);
    the captures still land in each layer's own site."""
    spec = write_spec("""
        capture:
          - sites: [resid_post, attn.q, mlp.out]
    """)
    model, ref = model_pair("qwen3", attn="sdpa")
    with torch.no_grad(), dmi.load(ref, hook_spec=spec, store=tmp_path / "eager.zarr") as run:
        run.model(**encoded, use_cache=False)
    graphs = {"vanilla": [], "dmi": []}

    def compiled_layers(m, key):
        backend = lambda gm, inputs: graphs[key].append(gm) or gm.forward      # noqa: E731 (one for all layers)
        for layer in m.model.layers:
            layer.compile(backend=backend)

    torch._dynamo.reset()
    vanilla, _ = model_pair("qwen3", attn="sdpa")
    compiled_layers(vanilla, "vanilla")
    with torch.no_grad():
        vanilla(**encoded, use_cache=False)
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "compiled.zarr") as run:
        compiled_layers(run.model, "dmi")
        run.model(**encoded, use_cache=False)
    torch._dynamo.reset()
    assert len(model.model.layers) > 1 and len(graphs["vanilla"]) == 1, graphs["vanilla"]
    assert len(graphs["dmi"]) == 1, [g.code for g in graphs["dmi"]]
    assert "torch.ops.dmi.capture" in graphs["dmi"][0].code
    eager, compiled = _arrays(dmi.open(tmp_path / "eager.zarr")), _arrays(dmi.open(tmp_path / "compiled.zarr"))
    assert len(eager) > 3
    for key, e in eager.items():
        np.testing.assert_array_equal(compiled[key], e, err_msg=str(key))


def _compiled_generate_kwargs(new: int) -> dict:
    """generate() with a static cache and its compiled forward (``Run.stepped``): on the CPU with
    the ``aot_eager`` backend, which transformers compiles for on CUDA devices only unless told."""
    from transformers import CompileConfig
    config = CompileConfig(backend="aot_eager", fullgraph=False, mode=None)
    config._compile_all_devices = True
    return dict(max_new_tokens=new, do_sample=False, cache_implementation="static", compile_config=config)


def test_compiled_generate_begins_decode_steps_ahead_and_stores_what_it_would_otherwise(
        encoded, write_spec, tmp_path):
    """generate() syncs on its stop check every step, so the host work before each compiled
    forward is time the GPU waits. ``Run.stepped`` therefore begins the batch's next decode step
    right after launching the current one (``Run._begin_ahead``), and the next forward takes it.
    The store is the same, bit for bit, as with steps begun at their forward (``engine.step_ahead: false``)
    and equals the model's own hidden states; the step begun after each generate's last forward
    is given back (nothing stored, counted or numbered for it), also when a request opts out
    (rows subset) and when generate raises between two forwards."""
    spec = write_spec("""
        capture:
          - sites: [resid_post, final_norm]
          - sites: [logits]
            tokens: last
        policy: {d2h_bytes_per_s: 1GiB}
    """)
    new = 6
    kw = _compiled_generate_kwargs(new)
    model, ref = model_pair("qwen3", attn="sdpa")
    with torch.no_grad():
        want = ref.generate(**encoded, **kw, output_hidden_states=True, return_dict_in_generate=True)

    class Interrupt(Exception):
        pass

    def interrupted(input_ids, scores):            # raises after the 3rd decode step's forward was launched
        if input_ids.shape[1] == encoded["input_ids"].shape[1] + 3:
            raise Interrupt
        return scores

    stores, ahead = {}, {}
    for on in ("1", "0"):
        torch._dynamo.reset()
        store = tmp_path / f"ahead{on}.zarr"
        with torch.no_grad(), dmi.load(model, hook_spec=with_engine(spec, step_ahead=on == "1"), store=store) as run:
            out = run.model.generate(**encoded, **kw)
            run.set_request_ids(capture=[True, False, True])
            run.model.generate(**encoded, **kw)
            with pytest.raises(Interrupt):
                run.model.generate(**encoded, **kw, logits_processor=[interrupted])
            run.model.generate(**encoded, **kw)
            ahead[on], steps = list(run.steps_ahead), run.stats()["steps"]
        torch._dynamo.reset()
        assert torch.equal(out, want.sequences)
        assert steps == 3 * new + 4, steps     # the interrupted generate ran its prefill and 3 decode steps
        stores[on] = _arrays(dmi.open(store))
    # per whole generate, its decode steps after the first were begun ahead, and the last one's given back
    assert ahead == {"1": [3 * (new - 2) + 2, 4], "0": [0, 0]}, ahead
    assert stores["1"].keys() == stores["0"].keys()
    for key, a in stores["1"].items():
        np.testing.assert_array_equal(a, stores["0"][key], err_msg=str(key))
    ds = dmi.open(tmp_path / "ahead1.zarr")["final_norm"].dataset
    steps, fin = ds.step.values, ds.final_norm.values
    assert np.array_equal(np.unique(steps), np.arange(3 * new + 4))       # numbered without gaps
    assert np.array_equal(ds.step.values, dmi.open(tmp_path / "ahead0.zarr")["final_norm"].dataset.step.values)
    mask = encoded["attention_mask"].bool()
    for k, hs in enumerate(want.hidden_states):      # the first generate: the model's own final norm output
        rows = hs[-1][mask] if k == 0 else hs[-1][:, 0]
        np.testing.assert_array_equal(fin[steps == k], rows.numpy(), err_msg=f"step {k}")
    # token_id: the prompt, then each decode step's input, the token the step before generated (begun
    # ahead, a step gets its ids when its forward comes)
    tid, width = ds.token_id.values, encoded["input_ids"].shape[1]
    for k in range(new):
        ids = encoded["input_ids"][mask] if k == 0 else want.sequences[:, width + k - 1]
        np.testing.assert_array_equal(tid[steps == k], ids.numpy(), err_msg=f"token_id, step {k}")


def test_compiled_generate_under_a_best_effort_cap_begins_steps_ahead_and_accounts_every_row(
        encoded, write_spec, tmp_path):
    """A bandwidth cap below the capture rate under best_effort: the next decode step is still begun
    ahead of its forward (its victims dropped there, as its own begin would drop them), so a capped
    run keeps its host work off the GPU's critical path. Outputs are unchanged, every selected row
    is stored or in the drops table (once: a step given back leaves no drop), and every stored
    final-norm row is the model's own."""
    spec = write_spec("""
        capture:
          - sites: [resid_post, final_norm]
          - sites: [logits]
            tokens: last
            priority: 1
        policy: {mode: best_effort, d2h_bytes_per_s: 12KiB}
    """)
    new = 8
    kw = _compiled_generate_kwargs(new)
    model, ref = model_pair("qwen3", attn="sdpa")
    with torch.no_grad():
        want = ref.generate(**encoded, **kw, output_hidden_states=True, return_dict_in_generate=True)
    torch._dynamo.reset()
    store = tmp_path / "capped.zarr"
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=store) as run:
        out = run.model.generate(**encoded, **kw)
        taken, given_back = run.steps_ahead
    torch._dynamo.reset()
    assert torch.equal(out, want.sequences)
    assert (taken, given_back) == (new - 2, 1), run.steps_ahead
    tree = dmi.open(store)
    attrs, drops = tree.attrs, tree["drops"].dataset
    assert drops.sizes["drop"] > 0 and set(drops.reason.values.tolist()) == {"bandwidth"}
    assert int(drops.step.max()) < new                         # none for the step given back
    for site in attrs["sites"]:
        assert attrs["rows_stored"][site] + attrs["rows_dropped"][site] + attrs["rows_not_computed"][site] \
            == attrs["rows_selected"][site], site
    assert sum(attrs["rows_dropped"].values()) == int(drops.rows.sum())
    ds = tree["final_norm"].dataset
    mask = encoded["attention_mask"].bool()
    for k in np.unique(ds.step.values).tolist():
        hs = want.hidden_states[k][-1]
        rows = hs[mask] if k == 0 else hs[:, 0]
        np.testing.assert_array_equal(ds.final_norm.values[ds.step.values == k], rows.numpy(), err_msg=f"step {k}")


def _whole_graph_generate(**options) -> dict:
    """generate() arguments whose compiled forward is the whole model as one graph, compiled with
    the eager backend (Dynamo's guards without inductor) on any device: static cache, 3 tokens.
    ``options``: the compile options (e.g. a ``guard_filter_fn``)."""
    from transformers import CompileConfig
    config = CompileConfig(backend="eager", fullgraph=True, mode=None, options=options or None)
    config._compile_all_devices = True
    return dict(max_new_tokens=3, do_sample=False, cache_implementation="static", compile_config=config)


@pytest.mark.parametrize("constants", ["1", "0"])
def test_generate_compiled_forward_guards_no_site_handle(encoded, write_spec, tmp_path, constants):
    """Every call of a compiled forward evaluates Dynamo's guards first (host time the GPU waits
    for in generate()). generate()'s compiled forward traces the whole model, and there each
    patched module gets a class whose code names its sites (``engine.constant_sites``, default true,
    ``patch.constant_sites_class``): Dynamo guards it by its type, as it does an unpatched
    module, and no handle. With false each site's handle costs its few attributes (~9 guards a
    site). Either way the run's ticket is one graph input guarded once, and no patched module has
    a forward of its own to guard (the instance-level closures before cost ~10 guards a site more)."""
    spec = with_engine(write_spec("""
        capture:
          - sites: [resid_pre, resid_post, attn.q, mlp.out, final_norm]
    """), constant_sites=constants == "1")
    guards: list = []

    def kw():
        keep = lambda entries: guards.append([e.name for e in entries]) or [True] * len(entries)   # noqa: E731
        return _whole_graph_generate(guard_filter_fn=keep)

    model, ref = model_pair("qwen3", attn="sdpa")
    torch._dynamo.reset()
    with torch.no_grad():
        want = ref.generate(**encoded, **kw())
        with dmi.load(model, hook_spec=spec, store=tmp_path / "gen.zarr") as run:
            got = run.model.generate(**encoded, **kw())
            n_sites = len(run.plan.sites)
    torch._dynamo.reset()
    assert torch.equal(got, want) and len(guards) == 2, len(guards)
    vanilla, names = guards
    assert not [n for n in names if re.search(r"\._modules\['[^']+'\]\.forward", n)]     # no instance forward
    assert len([n for n in names if n.endswith(".ticket")]) == 1, [n for n in names if n.endswith(".ticket")]
    # the handles' guards (torch 2.13 names a module's attribute `.__dict__['_dmi_sites']`, 2.11 `._dmi_sites`)
    per_site = {n.replace(".__dict__['_dmi_sites']", "._dmi_sites") for n in names if "_dmi_sites" in n}
    if constants == "1":
        # what is left over vanilla's: the step wrapper and the site functions' globals (13 sites
        # of 7 modules here: 40 guards under torch 2.13, where their handles cost 114)
        assert not per_site and len(names) - len(vanilla) <= 60, (per_site, len(names), len(vanilla))
    else:
        assert 0 < len(per_site) <= 9 * n_sites, (len(per_site), n_sites)
    assert dmi.open(tmp_path / "gen.zarr")["final_norm"].dataset.step.size > 0


def test_generate_compiled_forward_guards_no_intervention(encoded, tmp_path):
    """Interventions declared at sites of every anchor kind (an assignment, a module's output, a
    module's input), on one layer or on every layer: generate()'s compiled forward guards a few
    things more than for the capture alone, the same few for any number of interventions. The
    constant-sites classes have each write site's interventions written
    into their code as plain values, and the masks and values are rows of a few buffers per run,
    read through one path (each one graph input, guarded once), where a tensor per intervention
    cost a graph input and ~60 guard lines each. Switched on between calls, they recompile nothing."""
    from torch._dynamo.utils import counters
    model = build_tiny_model("tiny-qwen3", seed=0, attn_implementation="sdpa")
    n_layers = model.config.num_hidden_layers
    hidden = model.config.hidden_size

    def spec(layers):
        capture = [{"sites": ["final_norm"], "tokens": "last"}]
        if not layers:                       # the baseline: the capture alone
            return {"capture": capture}
        return {"capture": capture, "interventions": [
            {"name": "steer", "site": "resid_post", "layers": layers, "kind": "add", "vector": [0.5] * hidden,
             "enabled": False},
            {"name": "ablate", "site": "attn.z", "layers": layers, "kind": "zero", "heads": [0], "enabled": False},
            {"name": "clip", "site": "mlp.act", "layers": layers, "kind": "clamp", "min": -0.1, "max": 0.1,
             "enabled": False}]}

    sizes, tokens = [], []
    for layers in ([], [0], list(range(n_layers))):
        guards: list = []
        keep = lambda entries: guards.append([e.name for e in entries]) or [True] * len(entries)   # noqa: E731
        torch._dynamo.reset()
        counters.clear()
        twin = copy.deepcopy(model)
        with torch.no_grad(), dmi.load(twin, hook_spec=spec(layers), store=tmp_path / f"{len(layers)}.zarr") as run:
            off = run.model.generate(**encoded, **_whole_graph_generate(guard_filter_fn=keep))
            graphs = counters["stats"]["unique_graphs"]
            for name in run.interventions.by_name:
                run.set_intervention(name, enabled=True)
            on = run.model.generate(**encoded, **_whole_graph_generate(guard_filter_fn=keep))
            assert counters["stats"]["unique_graphs"] == graphs, "switching interventions on recompiled"
        assert not [n for n in guards[0] if "interventions[" in n or ".write" in n], "an intervention's own guards"
        sizes.append(len(guards[0]))
        tokens.append((off, on))
    torch._dynamo.reset()
    # (the rest over the capture alone: the site functions' globals and the packed buffers, ~40
    # guards; layers whose classes became constant-sites classes move a few of vanilla's)
    base, one, every = sizes
    assert one - base <= 60 and abs(every - one) <= 20, sizes
    assert not torch.equal(*tokens[2]), "the interventions switched on changed nothing"


def _tag_safe_roots(model) -> list[str]:
    """The tag-safe roots of the guard tree of ``model``'s compiled forward, as paths below the
    model: subtrees Dynamo skips while their dicts' version tags are unchanged."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    fwd = model.forward
    (entry,) = _debug_get_cache_entry_list(getattr(fwd, "__code__", None) or fwd.__func__.__code__)
    roots, todo = [], [entry.guard_manager.root]
    while todo:
        node = todo.pop()
        if node.is_tag_safe_root():
            # (vanilla's frame names the model L['self'], dmi's step wrapper L['inner'].__self__)
            roots.append(re.sub(r"^L\['(self|inner)'\](\.__self__)?", "", node.get_source()))
            continue
        todo += node.get_child_managers()
        if hasattr(node, "get_key_value_managers"):          # a dict's keys and values
            todo += [m for kv in node.get_key_value_managers().values() for m in kv if m is not None]
    return sorted(roots)


@pytest.mark.parametrize("constants", ["1", "0"])
def test_generate_compiled_forward_keeps_vanillas_tag_safe_roots(encoded, write_spec, tmp_path, constants):
    """Where Dynamo tags dicts recursively (``use_recursive_dict_tags_for_guards``: torch 2.11's
    default, the GPU machine's release), a module whose guards reach only immutable or tag-safe
    values is a tag-safe root, and its whole subtree is skipped on every call whose dicts are
    unchanged. With constant sites each patched module keeps that: dmi's guard tree has exactly
    vanilla's roots. A site handle (``engine.constant_sites: false``) is a ``__slots__`` object, never tag
    safe: each patched module (here the final norm and every MLP) loses its root."""
    spec = with_engine(write_spec("""
        capture:
          - sites: [resid_post, mlp.out, final_norm]
    """), constant_sites=constants == "1")
    kw = _whole_graph_generate()
    model, ref = model_pair("qwen3", attn="sdpa")
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True):
        want = ref.generate(**encoded, **kw)
        vanilla = _tag_safe_roots(ref)
        with dmi.load(model, hook_spec=spec, store=tmp_path / "gen.zarr") as run:
            got = run.model.generate(**encoded, **kw)
            roots = _tag_safe_roots(run.model)
    torch._dynamo.reset()
    assert torch.equal(got, want)
    final_norm = "._modules['model']._modules['norm']"
    assert final_norm in vanilla and len(vanilla) > 4, vanilla      # (every layer's attention, MLP and norms too)
    if constants == "1":
        assert roots == vanilla, (set(vanilla) ^ set(roots))
    else:
        lost = set(vanilla) - set(roots)      # (a patched MLP's own children become roots instead)
        assert final_norm in lost and {r for r in lost if r.endswith("._modules['mlp']")}, lost


_ANCHOR_KINDS = {      # sites of every anchor kind each family's spec has (the MoE ones: the router's)
    "qwen3": "embed, resid_pre, attn.q, attn.k_rot, attn.z, resid_mid, mlp.act, resid_post, final_norm",
    "llama3_1": "embed, resid_pre, attn.q, attn.k_rot, attn.z, mlp.act, mlp.out, resid_post, final_norm",
    "qwen3_moe": "resid_pre, attn.q, mlp.in, mlp.out, moe.router_logits, moe.topk_ids, moe.topk_weights, final_norm",
    "mixtral": "attn.k_rot, attn.z, mlp.out, moe.router_logits, moe.topk_ids, moe.topk_weights, resid_post",
}


@pytest.mark.parametrize("family", list(_ANCHOR_KINDS))
def test_constant_sites_store_what_handles_store_for_every_anchor_kind(family, encoded, write_spec, tmp_path):
    """generate()'s compiled forward with each patched module's sites written into its class's
    code (``engine.constant_sites: true``, the default) stores bit for bit what the same run stores
    through the handles (false), for every kind of anchor: inputs, outputs, rewritten assignments
    and a computed site (attn.pattern), in every built-in family. The classes are the instances'
    own from the first compiled call on, and closing the run gives every module its own class back."""
    spec = write_spec(f"""
        capture:
          - sites: [{_ANCHOR_KINDS[family]}]
          - sites: [attn.pattern]
            layers: [1]
            max_keys: 64
          - sites: [logits]
            tokens: last
    """)
    kw = _compiled_generate_kwargs(4)
    model, ref = model_pair(family, attn="sdpa")
    classes = {id(m): type(m) for m in model.modules()}
    torch._dynamo.reset()
    with torch.no_grad():      # eager: the first compile is the run's, after its classes are made
        want = ref.generate(**encoded, max_new_tokens=4, do_sample=False, cache_implementation="static")
    stores = {}
    for constants in ("1", "0"):
        torch._dynamo.reset()
        with torch.no_grad(), dmi.load(model, hook_spec=with_engine(spec, constant_sites=constants == "1"),
                                       store=tmp_path / f"c{constants}.zarr") as run:
            assert torch.equal(run.model.generate(**encoded, **kw), want)
            patched = patched_modules(model.model)
            assert len(patched) > 2 and (len({type(m) for m in patched}) == len(patched)) == (constants == "1")
            for m in patched:                          # what any attribute resolves to is unchanged
                cls = type(m).__dict__["_dmi_unpatched"]
                assert isinstance(m, cls) and type(m).__name__ == cls.__name__
                assert all(_same_attribute(inspect.getattr_static(type(m), name), inspect.getattr_static(cls, name))
                           for name in dir(cls) if name not in ("forward", "__dict__", "__weakref__", "__doc__")), cls
        assert not patched_modules(model) and {id(m): type(m) for m in model.modules()} == classes
        stores[constants] = _arrays(dmi.open(tmp_path / f"c{constants}.zarr"))
    torch._dynamo.reset()
    assert stores["1"].keys() == stores["0"].keys() and len(stores["1"]) > 10
    for key, a in stores["1"].items():
        np.testing.assert_array_equal(a, stores["0"][key], err_msg=str(key))


def _same_attribute(mine, base) -> bool:
    """The patched class finds ``base``'s attribute: the same object, or Dynamo's wrapper of it
    (a compile watching a module class for mutation wraps that class's ``__setattr__``)."""
    return mine is base or getattr(mine, "__wrapped__", None) is base or getattr(base, "__wrapped__", None) is mine


def test_generate_compiled_forward_names_sites_as_constants(encoded, write_spec, tmp_path):
    """generate()'s compiled forward traces the whole model once, so its sites are constants of the
    graph (``dmi.siteop.constant_sites``): the patched graph takes the unpatched graph's inputs
    and the ticket, nothing per site (each input costs every call Dynamo host time). The same
    patched model compiled layer by layer still names its sites by tensor (one graph for all
    layers: test_patched_layers_compile_to_one_graph)."""
    from transformers import CompileConfig
    spec = write_spec("""
        capture:
          - sites: [resid_post, attn.q, final_norm]
    """)
    inputs: dict = {"vanilla": [], "dmi": []}

    def recording(key):
        from torch._dynamo.backends.common import aot_autograd
        def fw(gm, example_inputs):
            inputs[key].append(len(example_inputs))
            return gm
        return aot_autograd(fw_compiler=fw)

    def kw(key):
        config = CompileConfig(backend=recording(key), fullgraph=True, mode=None)
        config._compile_all_devices = True
        return dict(max_new_tokens=3, do_sample=False, cache_implementation="static", compile_config=config)

    model, ref = model_pair("qwen3", attn="sdpa")
    torch._dynamo.reset()
    with torch.no_grad():
        want = ref.generate(**encoded, **kw("vanilla"))
        with dmi.load(model, hook_spec=spec, store=tmp_path / "gen.zarr") as run:
            got = run.model.generate(**encoded, **kw("dmi"))
            n_sites = len(run.plan.sites)
    torch._dynamo.reset()
    assert torch.equal(got, want)
    assert n_sites == 2 * model.config.num_hidden_layers + 1
    assert inputs["vanilla"] and len(inputs["dmi"]) == len(inputs["vanilla"]), inputs
    assert [d - v for d, v in zip(inputs["dmi"], inputs["vanilla"])] == [1] * len(inputs["vanilla"]), inputs
    steps = dmi.open(tmp_path / "gen.zarr")["final_norm"].dataset.step.values
    assert np.array_equal(np.unique(steps), np.arange(3))       # every step captured under the constant sites
