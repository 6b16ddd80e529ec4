"""Policy on the CUDA ring: the D2H cap and per-request opt-in behave as on the CPU ring (the
bookkeeping is the shared ``dmi.ring.protocol.Ring``'s), including the decode fast path that only a device
mask takes. Run on a CUDA machine: ``pytest -m gpu tests/gpu``."""
from __future__ import annotations

import pytest
import torch

import dmi
from conftest import model_pair
from engine_spec import with_engine
from storecheck import assert_stores_equal

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CAP = """
capture:
  - sites: [resid_post]
    priority: 1
  - sites: [mlp.out]
    priority: 0
policy: {{mode: {mode}, ring_bytes: 1MiB{cap}}}
"""


def _capture(spec, store, encoded, new, ring, monkeypatch, device="cuda", ids=None, capture=None):
    model, _ = model_pair("qwen3", attn="sdpa")
    model = model.to(device)
    enc = {k: v.to(device) for k, v in encoded.items()}
    with torch.no_grad(), dmi.load(model, hook_spec=with_engine(spec, ring=ring), store=store) as run:
        if ids is not None or capture is not None:
            run.set_request_ids(ids, capture=capture)
        out = run.model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out.cpu(), run


def _accounting(tree):
    a = tree.attrs
    for s in a["sites"]:
        assert a["rows_stored"][s] + a["rows_dropped"][s] + a["rows_not_computed"][s] == a["rows_selected"][s], s


def test_cuda_ring_bandwidth_cap(encoded, write_spec, tmp_path, monkeypatch):
    free = write_spec(CAP.format(mode="full", cap=""), "free.yaml")
    capped = write_spec(CAP.format(mode="full", cap=", d2h_bytes_per_s: 64KiB"), "capped.yaml")
    out_free, _ = _capture(free, tmp_path / "free.zarr", encoded, 20, "cuda", monkeypatch)
    out_cap, run = _capture(capped, tmp_path / "capped.zarr", encoded, 20, "cuda", monkeypatch)
    assert type(run.ring).__name__ == "CudaRing"
    assert torch.equal(out_free, out_cap)
    assert run.stats()["stall_seconds"] > 0 and run.stats()["dropped_captures"] == 0
    assert_stores_equal(tmp_path / "free.zarr", tmp_path / "capped.zarr")

    be = write_spec(CAP.format(mode="best_effort", cap=", d2h_bytes_per_s: 32KiB"), "be.yaml")
    _, run = _capture(be, tmp_path / "be.zarr", encoded, 24, "cuda", monkeypatch)
    tree = dmi.open(tmp_path / "be.zarr")
    drops = tree["drops"].dataset
    assert drops.sizes["drop"] > 0 and set(drops.reason.values) == {"bandwidth"}
    _accounting(tree)


def test_cuda_opt_in_on_the_decode_fast_path(encoded, write_spec, tmp_path, monkeypatch):
    spec = write_spec("capture: [{sites: [resid_post], layers: [1]}, {sites: [logits], tokens: last, reduce: {topk: 2}}]\n")
    kw = dict(ids=["a", "b", "c"], capture=[True, False, True])
    _capture(spec, tmp_path / "host.zarr", encoded, 6, "cpu", monkeypatch, device="cpu", **kw)     # slow path
    _capture(spec, tmp_path / "cuda.zarr", encoded, 6, "cuda", monkeypatch, **kw)                  # device mask
    _capture(spec, tmp_path / "ref.zarr", encoded, 6, "cpu", monkeypatch, **kw)                    # CPU ring, CUDA model
    assert_stores_equal(tmp_path / "ref.zarr", tmp_path / "cuda.zarr")
    host, cuda = dmi.open(tmp_path / "host.zarr"), dmi.open(tmp_path / "cuda.zarr")
    for group in ("layers/resid_post", "logits"):
        h, c = host[group].dataset, cuda[group].dataset
        for coord in ("request", "position", "step", "phase"):
            assert h[coord].values.tolist() == c[coord].values.tolist(), (group, coord)
        assert "b" not in set(map(str, c.request.values))
    _accounting(cuda)
