"""Interventions inside CUDA graphs: transformers' compiled generate (reduce-overhead) reads the
steering vector, the flags and the row masks from device buffers, so new values between generate()
calls change the tokens as the eager reference does, with no recompile and no new graph.

Run on a CUDA machine: ``pytest -m gpu tests/gpu/test_interventions_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch

import dmi
from conftest import model_pair

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = "cuda"


def _reference(ref, enc, kw, vec, ablate_row):
    """Eager generate of the unpatched model with forward hooks doing what the spec says."""
    rows = enc["attention_mask"].bool()

    def steer(m, args, out):
        x = out[0] if isinstance(out, tuple) else out
        r = rows if x.shape[1] == rows.shape[1] else torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        y = x if vec is None else torch.where(r[..., None], x + vec, x)
        return (y,) + out[1:] if isinstance(out, tuple) else y

    def ablate(m, args, out):
        x = out[0] if isinstance(out, tuple) else out
        r = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
        r[ablate_row] = True
        y = x.masked_fill(r[..., None], 0)
        return (y,) + out[1:] if isinstance(out, tuple) else y
    hs = [ref.model.layers[1].register_forward_hook(steer), ref.model.layers[0].mlp.register_forward_hook(ablate)]
    try:
        return ref.generate(**enc, **kw)
    finally:
        for h in hs:
            h.remove()


def test_new_vectors_reach_the_recorded_cuda_graphs(encoded, tmp_path, monkeypatch):
    from torch._dynamo.utils import counters
    from transformers import CompileConfig
    monkeypatch.setenv("DMI_RING", "cuda")
    model, ref = model_pair("qwen3", attn="sdpa")
    model, ref = model.to(CUDA), ref.to(CUDA)
    enc = {k: v.to(CUDA) for k, v in encoded.items()}
    hidden = model.config.hidden_size
    g = torch.Generator().manual_seed(3)
    v1, v2 = (torch.randn(hidden, generator=g) * 4).to(CUDA), (torch.randn(hidden, generator=g) * 4).to(CUDA)
    spec = {"capture": [{"sites": ["resid_post", "final_norm"]}],
            "interventions": [
                {"name": "steer", "site": "resid_post", "layers": [1], "kind": "add", "vector": v1.tolist()},
                {"name": "ablate", "site": "mlp.out", "layers": [0], "kind": "zero", "requests": ["r1"]}],
            "policy": {"ring_bytes": "16MiB"}}
    kw = dict(max_new_tokens=6, do_sample=False)
    graphed = dict(kw, cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "s.zarr") as run:
        run.set_request_ids(["r0", "r1", "r2"])
        first = run.model.generate(**enc, **graphed)          # compile, record
        run.set_request_ids(["s0", "s1", "s2"])
        run.set_intervention("ablate", requests=["s1"])
        again = run.model.generate(**enc, **graphed)          # replay, the same values
        graphs = counters["stats"]["unique_graphs"]
        run.set_request_ids(["t0", "t1", "t2"])
        run.set_intervention("ablate", requests=["t1"])
        run.set_intervention("steer", vector=v2)
        second = run.model.generate(**enc, **graphed)
        run.set_request_ids(["u0", "u1", "u2"])
        run.set_intervention("ablate", requests=["u1"])
        run.set_intervention("steer", enabled=False)
        third = run.model.generate(**enc, **graphed)
        assert counters["stats"]["unique_graphs"] == graphs, "new values recompiled"
        assert counters["inductor"]["cudagraph_skips"] == 0
    with torch.no_grad():
        for got, vec in ((first, v1), (again, v1), (second, v2), (third, None)):
            want = _reference(ref, enc, kw, vec, 1)
            assert torch.equal(got, want), (vec is None, got, want)
    assert not torch.equal(first, second)
