"""Tensor parallelism on vLLM's CPU build (issue #6): the ranks' captures merged into one store.

Fast: ``dmi.load(backend="vllm")`` refuses the parallel layouts dmi cannot merge before any engine
starts (no vLLM needed for most of them). Slow (one engine at TP=1, one at TP=2, same tiny model,
same prompts, greedy): the merged TP=2 store equals the TP=1 store site by site, replicated sites
are written by rank 0 only, tokens are identical, and the store opens with dmi.open / xarray.

The TP=2 engine runs its two workers as processes (``VLLM::Worker_TP``, gloo); on a machine with one
NUMA node vLLM's CPU backend needs ``VLLM_CPU_OMP_THREADS_BIND`` (one core list per rank), which the
test sets. The slow test takes 45-76 s on a 2-core machine (both engines).
"""
from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import numpy as np
import pytest

import dmi
from dmi.errors import DmiError

SPEC = {"capture": [{"sites": ["resid_pre"]}]}


@pytest.mark.parametrize("kwargs, key", [
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size"),
    (dict(tensor_parallel_size=2, data_parallel_size=2), "data_parallel_size"),
    (dict(enable_expert_parallel=True, tensor_parallel_size=2), "enable_expert_parallel"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
])
def test_parallel_layouts_dmi_cannot_merge_are_refused_before_the_engine_starts(kwargs, key, tmp_path):
    with pytest.raises(DmiError) as e:
        dmi.load("/nonexistent-model", hook_spec=SPEC, store=tmp_path / "s.zarr", backend="vllm", **kwargs)
    msg = str(e.value)
    assert key in msg and "Fix:" in msg and "dmi.load(backend='vllm')" in msg
    assert not (tmp_path / "s.zarr").exists()


def test_cpu_tensor_parallel_without_thread_binding_is_refused_on_one_numa_node(tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from dmi.adapters.vllm import compat
    if not compat.is_cpu_platform() or compat.cpu_numa_nodes() >= 2:
        pytest.skip("needs vLLM's CPU backend on a machine with one NUMA node")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with pytest.raises(DmiError, match="VLLM_CPU_OMP_THREADS_BIND"):
        dmi.load("/nonexistent-model", hook_spec=SPEC, store=tmp_path / "s.zarr", backend="vllm",
                 tensor_parallel_size=2)


SITES = ["embed", "resid_pre", "attn.q", "attn.k", "attn.k_rot", "attn.v", "attn.out", "resid_mid",
         "mlp.in", "mlp.act", "mlp.out", "resid_post", "final_norm", "logits"]
HEADS = [3, 0, 1]          # attn.z keeps these heads in this order: rank 1 holds head 3, rank 0 heads 0 and 1
SPLIT = {"layers/attn/q", "layers/attn/k", "layers/attn/k_rot", "layers/attn/v", "layers/attn/z", "layers/mlp/act"}
PROMPTS = ["Hello world! How are you", "Paris", "The quick brown fox jumps over the lazy dog today"]
ENGINE = dict(kv_cache_memory_bytes=128 << 20, dtype="float32", enforce_eager=True)


def _capture(tmp_path: Path, name: str, tp: int):
    import vllm
    from dmi.adapters.vllm import save_builtin
    spec = {"capture": [{"sites": SITES}, {"sites": ["attn.z"], "layers": [1, 2], "heads": HEADS}],
            "policy": {"ring_bytes": "16MiB"}}
    run = dmi.load(save_builtin("tiny-qwen3"), hook_spec=spec, store=tmp_path / name, backend="vllm",
                   tensor_parallel_size=tp, **ENGINE)
    try:
        outs = run.llm.generate(PROMPTS, vllm.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                                use_tqdm=False)
        tokens = {o.request_id: list(map(int, o.outputs[0].token_ids)) for o in outs}
    finally:
        run.shutdown()
    return tokens, dmi.open(tmp_path / name)


def _keyed(ds) -> dict:
    from dmi.adapters.vllm.compat import external_request_id
    keys = [(external_request_id(str(r)), int(p)) for r, p in zip(ds.request.values, ds.position.values)]
    assert len(set(keys)) == len(keys)
    return {k: i for i, k in enumerate(keys)}


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor parallel CPU ranks need two cores")
def test_tp2_store_equals_tp1_store(tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import xarray as xr
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    tokens1, one = _capture(tmp_path, "tp1.zarr", 1)
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
        n = os.cpu_count() or 2
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if n < 4 else f"0-{n // 2 - 1}|{n // 2}-{n - 1}")
    tokens2, two = _capture(tmp_path, "tp2.zarr", 2)
    assert tokens2 == tokens1

    store = tmp_path / "tp2.zarr"
    assert two.attrs["dmi_status"] == "closed" and two.attrs["tp"]["world_size"] == 2
    checked = collections.Counter()
    for node in one.subtree:
        ds = node.dataset
        if not ds.data_vars or "request" not in ds.coords:
            continue
        path = node.path.strip("/")
        other = two[path].dataset
        a, b = _keyed(ds), _keyed(other)
        assert a.keys() == b.keys(), path
        for name in ds.data_vars:
            assert other[name].shape == ds[name].shape, (path, name)
            want = ds[name].values[[a[k] for k in a]]
            got = other[name].values[[b[k] for k in a]]
            assert not np.isnan(got).any(), (path, name)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3, err_msg=f"{path}/{name}")
            checked[path] += len(a)
    assert len(checked) == len(SITES) + 1 and all(checked.values())
    np.testing.assert_array_equal(two["layers/attn/z"].dataset["head"].values, HEADS)

    # split arrays: chunked at the shard boundaries, each rank wrote its own chunk files; replicated
    # sites and token coordinates: rank 0 only
    notes = [json.loads((store / "tp" / f"rank{r}" / "zarr.json").read_text())["attributes"] for r in (0, 1)]
    assert [n["status"] for n in notes] == ["closed", "closed"]
    arrays = {f"{g}/{g.rsplit('/', 1)[1]}" for g in SPLIT}
    assert {k for k, v in notes[1]["chunks_written"].items() if v} == arrays
    assert arrays < {k for k, v in notes[0]["chunks_written"].items() if v}
    q = two["layers/attn/q"].attrs
    assert q["tp"]["kind"] == "split" and q["tp"]["ranks"] == {"0": [0, 2], "1": [2, 4]}
    z = json.loads((store / "layers/attn/z/z/zarr.json").read_text())
    assert z["chunk_grid"]["configuration"]["chunk_shape"][2] == 1          # gcd of the ranks' runs of HEADS
    assert z["attributes"]["tp"]["rank"] == {"0": [[1, 3]], "1": [[0, 1]]}
    assert two.attrs["tp"]["sites"]["resid_pre"] == {"kind": "replicated", "writer": 0}
    xr.open_datatree(str(store), engine="zarr")        # plain xarray opens the merged store too
