"""vLLM on the GPU with CUDA graphs on (``enforce_eager=False``): the CUDA ring inside vLLM's
piecewise-compiled, graph-captured model, against HF Transformers on the same weights.

What is pinned (issue #4, GPU part):

* every captured site equals HF's row at the same (request, position), both engines on the GPU in
  float32 (tolerance below), for a small Qwen3 and Llama-3.1, and for Qwen3-MoE and Mixtral once
  vLLM's MoE kernels are staged (the H200's Triton MoE kernel is modular: the router runs, so the
  routing sites are captured too);
* greedy tokens are identical with and without dmi (the same engine configuration, CUDA graphs on);
* CUDA-graph padding rows are never copied: vLLM pads steps to a captured size (the store records
  how many rows it skipped), yet every (request, position) is stored exactly once;
* steps that replay a captured graph (decode: FULL graphs; small mixed steps: PIECEWISE graphs)
  produce their own, correct records: the only capture made from Python in those steps is the
  eager ``logits`` site (``compute_logits`` runs outside the graph), every other site's rows come
  from kernels the replay ran, and they equal HF's; steps larger than any graph run the compiled
  model without a graph (every site from Python under ``engine.traced: off``);
* what cannot work inside a graph replay is refused at load (``attn.pattern``, ``engine.ring: cpu``).
* steps above the largest graph run a compile range of their own (the default, ``engine.traced`` left out:
  ``range``) in which every plain site's op was rewritten into a traced scatter: no capture from
  Python there but the ops left (head selections, the logits); with ``engine.traced: all`` the plain
  sites are scattered by the compiled code in every step; both equal HF's.

Engine: vLLM 0.25.1 (the H200 machine: ``source .vbundle/tools/env.sh``, docs/vllm.md), the V1
model runner, float32 through the Triton attention backend (FlashAttention has no float32),
CUDA graphs for 1..32 tokens; steps of 33..48 tokens run the compiled model without a graph, so
the eager capture path (``qwen3-op``) or the rewritten range runs in the same engine. Run: ``pytest -m gpu tests/gpu/test_vllm_gpu.py``.

Tolerance (float32): atol 1e-4, rtol 1e-3. HF (SDPA, one unpadded forward per request) and vLLM
(Triton paged attention, flat continuous batches, inductor-fused norms) sum in different orders;
on the CPU build the same comparison stays below 1e-6. A row of another token or request differs
by O(1) of the values' scale, so the tolerance still pins the row mapping.
"""
from __future__ import annotations

import collections
import importlib
import os

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (GPU machine: source .vbundle/tools/env.sh)")

import dmi  # noqa: E402
from dmi.adapters.vllm import save_builtin  # noqa: E402
from dmi.adapters.vllm.compat import external_request_id, shutdown_llm  # noqa: E402
from test_vllm import (MOE, all_sites, assert_accounting, assert_matches_hf, generate, hf_reference,  # noqa: E402
                       positions_by_request)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine (and the run) in this process
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")         # dmi reads the V1 runner: vanilla runs it too
# float32 means float32 in both engines: Triton's fp32 dots (vLLM's Triton attention) default to TF32
# on this GPU, and so may cuBLAS; either alone moves values by ~1e-3, which is not what is tested
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

GRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32]
ENGINE = dict(kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.5, dtype="float32", enforce_eager=False,
              attention_backend="TRITON_ATTN",
              max_model_len=256, max_num_seqs=8, max_num_batched_tokens=48, enable_prefix_caching=False,
              compilation_config={"cudagraph_capture_sizes": GRAPH_SIZES}, seed=0)
ATOL, RTOL = 1e-4, 1e-3


def workload():
    """Prompts of several lengths (one longer than a step: chunked prefill) and output lengths, so
    the decode batch shrinks 5 -> 1 (padded 5 -> 8, 3 -> 4) and prefill chunks mix with decodes;
    the longest request decodes alone for 18 steps, so its logits tensor comes back often enough
    for the logits capture to be replayed as a graph (``SEEN_TO_CAPTURE``)."""
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(3, 300, size=n).tolist()} for n in (5, 11, 2, 70, 23)]
    params = [vllm.SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (6, 9, 12, 7, 30)]
    return prompts, params


def tokens(llm, prompts, params) -> dict[str, list[int]]:
    """Greedy tokens of a plain vllm.LLM, by request id."""
    return {o.request_id: list(map(int, o.outputs[0].token_ids)) for o in llm.generate(prompts, params, use_tqdm=False)}


def logits_rows(tree, seqs) -> dict[str, np.ndarray]:
    """Each request's captured logits rows, one per generated token (the step that sampled it)."""
    lg = tree["logits"].dataset
    at = {(external_request_id(str(r)), int(p)): i for i, (r, p) in enumerate(zip(lg.request.values, lg.position.values))}
    return {rid: lg.logits.values[[at[(rid, len(p) - 1 + k)] for k in range(len(o))]] for rid, (p, o) in seqs.items()}


def _capture_recorder(monkeypatch):
    """Record every capture made from Python (a replayed graph makes none): (capturing a graph?,
    site, the open step or None, made inside vLLM's MoE op?), and for each capture chained onto the
    side stream while a graph is captured, whether vLLM was capturing a full graph.

    vLLM runs its MoE layers through a custom op its compile keeps opaque (``vllm::moe_forward``
    -> ``MoERunner._forward_impl``): the sites read in there (the router's top-k; the gate where the
    layer routes internally, Qwen3-MoE) are ops no graph pass of dmi sees."""
    from dmi.adapters.vllm.compat import capturing_full_graph
    from dmi.kernels.kernel_ring import KernelRing
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    events, marked_in_graphs, inside = [], [], [0]
    inner, inner_moe = KernelRing.capture, MoERunner._forward_impl

    def capture(self, site, x, addend=None, side=False):
        cur = self.current if self.current is not None and not self.current.ended else None
        capturing = torch.cuda.is_current_stream_capturing()
        events.append((capturing, site.index, cur.step if cur is not None else None, inside[0] > 0))
        if side and capturing:
            marked_in_graphs.append(capturing_full_graph())
        return inner(self, site, x, addend, side)

    def moe_forward_impl(self, *args, **kwargs):
        inside[0] += 1
        try:
            return inner_moe(self, *args, **kwargs)
        finally:
            inside[0] -= 1
    monkeypatch.setattr(KernelRing, "capture", capture)
    monkeypatch.setattr(MoERunner, "_forward_impl", moe_forward_impl)
    return events, marked_in_graphs


def _moe_kernels() -> bool:
    """vLLM's MoE kernels are there (the H200: staged by ``.vbundle/tools/stage.sh 3``)."""
    for name in ("vllm._moe_C_stable_libtorch", "vllm._moe_C"):
        try:
            importlib.import_module(name)
            return True
        except ImportError:
            pass
    return False


NEEDS_MOE_KERNELS = pytest.mark.skipif(not _moe_kernels(), reason="vLLM's MoE kernels are not staged (.vbundle/tools/stage.sh 3)")


@pytest.mark.parametrize("family,traced,side_mode", [
    ("qwen3", None, "1"), ("llama3_1", None, None), ("qwen3", "0", "1"), ("qwen3", "1", "1"),
    pytest.param("qwen3_moe", None, "1", marks=NEEDS_MOE_KERNELS), pytest.param("mixtral", None, "1", marks=NEEDS_MOE_KERNELS)],
    ids=["qwen3", "llama3_1-side-default", "qwen3-op", "qwen3-traced", "qwen3_moe", "mixtral"])
def test_cuda_graphs_every_site_equals_hf(family, traced, side_mode, tmp_path, monkeypatch):
    """``traced`` (the hook spec's ``engine.traced``: ``0`` off, ``1`` all) None: the default, ``range``: the steps above the largest graph
    (33-48 tokens) run a compile range of their own whose plain sites' ops were rewritten into
    traced scatters (dmi.kernels.traced.rewrite_captures), no op call there; graph-replayed steps
    keep the op. ``0``: the op in every step. ``1``: traced scatters in every step
    (dmi.kernels.traced). The other sites through the site op; the same numbers. In every mode the
    graphed ranges' captures are chained onto a side stream (``engine.side``, dmi.kernels.side):
    each capture kernel of a replayed graph runs beside the model's (``side_mode`` ``1``: all);
    ``side_mode`` None (left out:
    the default, ``full``): in vLLM's full graphs only, the pieces of piecewise graphs keep them
    inline."""
    options = {}                                        # side left out: the default, full graphs only
    if side_mode is not None:
        options["side"] = {"0": "off", "1": "all"}.get(side_mode, side_mode)
    if traced is not None:
        options["traced"] = {"0": "off", "1": "all"}.get(traced, traced)
    mode = traced or "range"
    path = save_builtin(f"tiny-{family}")
    prompts, params = workload()
    plain = vllm.LLM(path, **ENGINE)
    try:
        want = tokens(plain, prompts, params)
    finally:
        shutdown_llm(plain)
        del plain

    events, marked_in_graphs = _capture_recorder(monkeypatch)
    spec = {"capture": [{"sites": all_sites(family)}], "policy": {"ring_bytes": "32MiB"}}
    run = dmi.load(path, hook_spec={**spec, "engine": options}, store=tmp_path / "v.zarr", backend="vllm", **ENGINE)
    try:
        assert type(run.run.ring).__name__ == "CudaRing"
        n_setup = len(events)
        seqs = generate(run, prompts, params)
        serving = events[n_setup:]
        plan = run.plan
        ring = run.run.ring
        copies, replays, graphs_made = ring.eager_time["copy"][0], ring.eager_replays, dict(ring._graphs_made)
        traced_sites = set(ring.traced)
        assert ring.trace_mode == mode and bool(traced_sites) == (mode != "0"), (ring.trace_mode, ring.traced)
        assert ring.traced_steps == (mode == "1") and ring.traced_above == (GRAPH_SIZES[-1] if mode == "range" else None)
        # the graphs' captures ran on the side stream (dmi.kernels.side), each fork joined; under
        # full, only those made while vLLM captured a full graph (never more forks than those)
        side = dict(ring.side_counts)
        assert ring.side_streams and side["joined"] == side["forked"], side
        assert side["forked"] > 0 or mode == "1", side
        assert (ring.side_when is not None) == (side_mode in ("full", None))
        if ring.side_when is not None:
            assert side["forked"] <= sum(marked_in_graphs) < len(marked_in_graphs), (side, len(marked_in_graphs))
    finally:
        run.shutdown()

    # tokens: identical with and without dmi
    assert {rid: out for rid, (_, out) in seqs.items()} == want
    # the logits, captured outside the graphs every step: every request's row is one range of the logits
    # tensor, copied by one async copy (ring.copy_rows); other selections replay their launch as a
    # graph once their tensor comes back (ring.replay_eager, set by the worker): the rows checked below
    logits_index = next(s.index for s in plan.sites if s.canonical == "logits")
    assert copies > 0 and set(graphs_made) <= {logits_index}, (copies, replays, graphs_made)

    tree = dmi.open(tmp_path / "v.zarr")
    assert tree.attrs["dmi_status"] == "closed"
    # rows stored == real tokens: each computed position exactly once, no padding row
    expect = {rid: list(range(len(p) + len(o) - 1)) for rid, (p, o) in seqs.items()}
    assert positions_by_request(tree["layers/resid_post"].dataset) == expect
    # logits: each request's last scheduled row of every step: each decode, the prompt's end, and under
    # chunked prefill (70 prompt tokens, 48 per step) each earlier chunk's end, which vLLM computes and
    # whose sample it discards; HF's row at that position is what it holds (checked below)
    logits_pos = positions_by_request(tree["logits"].dataset)
    for rid, (p, o) in seqs.items():
        tail = list(range(len(p) - 1, len(p) + len(o) - 1))
        assert logits_pos[rid][-len(tail):] == tail, rid
        assert all(q < len(p) - 1 for q in logits_pos[rid][:-len(tail)]), rid
    assert any(len(logits_pos[rid]) > len(o) for rid, (_, o) in seqs.items()), "no chunked prefill happened"
    stats = tree.attrs["vllm"]
    assert stats["padded_steps"] > 0 and stats["padding_rows_skipped"] > 0, stats    # graphs padded, never copied
    assert_accounting(tree)
    # the greedy token is the argmax of the captured logits row (the sampled row of each step)
    for rid, rows in logits_rows(tree, seqs).items():
        np.testing.assert_array_equal(rows.argmax(-1), seqs[rid][1], err_msg=rid)

    # graphs: sites were captured into CUDA graphs at start-up, and replays wrote the decode steps
    logits_site = next(s.index for s in plan.sites if s.canonical == "logits")
    captured = {site for capturing, site, _, _ in events[:n_setup] if capturing}
    # (a traced site is no op call: its scatter is in the compiled code the graphs replay; under
    # range the graphs keep the op and only the steps above them run the rewritten graph)
    every = {s.index for s in plan.sites}
    through_op = every - traced_sites if mode == "1" else every
    above_op = every - traced_sites           # the sites an op captures in steps above the graphs
    assert mode != "1" or not captured & traced_sites, "a traced site went through the op"
    assert captured >= through_op - {logits_site}, "sites missing from the graphs"
    assert not any(capturing for capturing, _, _, _ in serving), "a graph was captured while serving"
    eager = collections.defaultdict(set)             # step -> sites captured from Python (not by a replay)
    in_moe_op = set()                                # sites captured inside vLLM's opaque MoE op
    for _, site, step, inside in serving:
        eager[step].add(site)
        if inside:
            in_moe_op.add(site)
    assert bool(in_moe_op) == (family in MOE), sorted(in_moe_op)
    fin = tree["final_norm"].dataset
    steps = collections.defaultdict(list)
    for step, phase in zip(fin.step.values.tolist(), fin.phase.values.tolist()):
        steps[step].append(phase)
    decode = [s for s, ph in steps.items() if all(p == "decode" for p in ph)]
    assert len(decode) >= 8
    for s in decode:          # <= 5 rows: a graph replay; only compute_logits captured from Python
        assert eager[s] <= {logits_site}, (s, sorted(eager[s]))
    mixed = [s for s, ph in steps.items() if s not in decode and len(ph) <= GRAPH_SIZES[-1]]
    assert mixed and all(eager[s] <= {logits_site} for s in mixed), [(s, len(eager[s])) for s in mixed]
    big = [s for s, ph in steps.items() if len(ph) > GRAPH_SIZES[-1]]       # larger than any graph: eager
    # ... and the sites read inside vLLM's MoE op: no graph pass sees their ops, so every step without a
    # graph calls them from Python (they are plain sites the ring may trace: their records are the same)
    from_python = above_op | in_moe_op
    name = {s.index: s.name for s in plan.sites}
    off = {s: (sorted(name[i] for i in eager[s] - from_python), sorted(name[i] for i in from_python - eager[s])) for s in big}

    # every site equals HF (both on the GPU, float32) at every stored (request, position)
    ref = hf_reference(family, seqs, spec, tmp_path / "hf.zarr", device="cuda")
    assert assert_matches_hf(tree, ref, atol=ATOL, rtol=RTOL) > 0
    # (checked after the values, so that a failure here still says whether they hold)
    assert big and not any(a or b for a, b in off.values()), {s: ("extra", a, "missing", b) for s, (a, b) in off.items()}


def test_cuda_graphs_bfloat16_flash_attention(tmp_path, monkeypatch):
    """The default GPU path (bfloat16, FlashAttention 3, CUDA graphs): tokens unchanged by dmi, every
    captured logits row holds the greedy token at its maximum, final_norm close to HF in bfloat16."""
    path = save_builtin("tiny-qwen3")
    prompts, params = workload()
    engine = dict(ENGINE, dtype="bfloat16", attention_backend=None)
    spec = {"capture": [{"sites": ["resid_post", "final_norm", "logits"]}]}
    run = dmi.load(path, hook_spec=spec, store=tmp_path / "b.zarr", backend="vllm", **engine)
    try:
        seqs = generate(run, prompts, params)
    finally:
        run.shutdown()
    plain = vllm.LLM(path, **engine)
    try:
        want = tokens(plain, prompts, params)
    finally:
        shutdown_llm(plain)
    assert {rid: out for rid, (_, out) in seqs.items()} == want
    tree = dmi.open(tmp_path / "b.zarr")
    assert tree.attrs["vllm"]["padding_rows_skipped"] > 0
    for rid, rows in logits_rows(tree, seqs).items():
        o = seqs[rid][1]
        np.testing.assert_array_equal(rows[np.arange(len(o)), o], rows.max(-1), err_msg=rid)   # ties allowed
    # bfloat16: one rounding of values of order 1 is 2^-8 relative; HF and vLLM round at different points
    ref = hf_reference("qwen3", seqs, {"capture": [{"sites": ["final_norm"]}]}, tmp_path / "hf.zarr", device="cuda",
                       dtype=torch.bfloat16)
    mine, theirs = tree["final_norm"].dataset, ref["final_norm"].dataset
    key = lambda ds: {(external_request_id(str(r)), int(p)): i for i, (r, p) in enumerate(zip(ds.request.values, ds.position.values))}
    km, kt = key(mine), key(theirs)
    # HF ran each whole sequence, so it also holds the last sampled token's row, which vLLM never computes
    assert set(kt) - set(km) == {(rid, len(p) + len(o) - 1) for rid, (p, o) in seqs.items()}
    assert set(km) <= set(kt)
    a = mine.final_norm.values[[km[k] for k in km]]
    b = theirs.final_norm.values[[kt[k] for k in km]]
    np.testing.assert_allclose(a, b, atol=0.1, rtol=0.05)
    assert np.median(np.abs(a - b)) < 0.03


def test_refused_with_cuda_graphs(tmp_path, monkeypatch):
    """What a graph replay would silently skip is refused at load, naming the fix."""
    path = save_builtin("tiny-qwen3")
    engine = dict(ENGINE, max_model_len=64)
    with pytest.raises(dmi.DmiError, match="enforce_eager=True"):
        dmi.load(path, hook_spec={"capture": [{"sites": ["attn.pattern"], "layers": [0], "max_keys": 64}]},
                 store=tmp_path / "p.zarr", backend="vllm", **engine)
    with pytest.raises(dmi.DmiError, match="engine.ring: cpu"):
        dmi.load(path, hook_spec={"capture": [{"sites": ["resid_post"]}], "engine": {"ring": "cpu"}},
                 store=tmp_path / "c.zarr", backend="vllm", **engine)
    assert not (tmp_path / "p.zarr").exists() and not (tmp_path / "c.zarr").exists()


def test_cuda_graphs_read_each_requests_own_intervention_values():
    """Requests' own intervention values (``client:`` bounds, per-request slots) inside vLLM's CUDA
    graphs: in one continuous batch, each request's sampled logprobs equal HF's with a forward hook
    doing what it asked (tests/test_vllm_interventions.py on the CPU build, here graph-replayed)."""
    from test_interventions import hook
    from test_vllm_interventions import PROMPTS as PROMPT_IDS, _client_spec
    import transformers as tf
    hidden = 64
    g = torch.Generator().manual_seed(7)
    vec, own = torch.randn(hidden, generator=g), torch.randn(hidden, generator=g) * 2
    asks = [None, {"steer": {"scale": 6.0}}, {"steer": {"scale": -4.0, "vector": own.tolist()}},
            {"steer": {"scale": 6.0}, "clip": {"min": -0.5, "max": 0.25}}]
    path = save_builtin("tiny-qwen3")
    run = dmi.load(path, hook_spec=_client_spec(vec), backend="vllm", **ENGINE)
    try:
        params = [vllm.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0,
                                      extra_args={"dmi": {"interventions": a}} if a else None) for a in asks]
        outs = run.llm.generate(PROMPT_IDS, params, use_tqdm=False)
    finally:
        run.shutdown()
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda")
    for a, o, p in zip(asks, outs, PROMPT_IDS):
        prompt, out = p["prompt_token_ids"], list(o.outputs[0].token_ids)
        fn = None
        if a:
            s = a["steer"].get("scale", 1.0)
            v = (torch.tensor(a["steer"]["vector"]) if "vector" in a["steer"] else vec).cuda()
            lo, hi = (a["clip"]["min"], a["clip"]["max"]) if "clip" in a else (-np.inf, np.inf)
            fn = lambda x, s=s, v=v, lo=lo, hi=hi: (x + s * v).clamp(lo, hi)      # noqa: E731
        h = hook(ref, "qwen3", "mlp.out", 1, fn) if fn else None
        try:
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([prompt + out], device="cuda")).logits[0].double()
        finally:
            if h:
                h.remove()
        lp = torch.log_softmax(logits, -1)
        want = np.array([lp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(out)])
        got = np.array([o.outputs[0].logprobs[t][tok].logprob for t, tok in enumerate(out)])
        np.testing.assert_allclose(got, want, atol=1e-3, err_msg=str(a))
