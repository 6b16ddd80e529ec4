"""Ring² protocol on the CPU backend: wrap-around, backpressure, best-effort drops, accounting."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dmi
from dmi.ring.bytering import ByteRing
from dmi.ring.cpu import CpuRing
from dmi.ring.layout import StepLayout, LaidOutSlots
from dmi.ring.budget import TokenBucket
from dmi.ring.records import align_up
from conftest import model_pair


def test_byte_ring_wraps_and_refuses_when_full():
    ring = ByteRing(1024)
    assert ring.try_reserve(512) == (0, 512)
    assert ring.try_reserve(256) == (512, 768)
    assert ring.try_reserve(512) is None              # 256 free at the end, 0 at the start
    ring.release(512)
    off, end = ring.try_reserve(512)                   # skips the 256 at the end, wraps to 0
    assert off == 0 and end == 1024 + 512
    assert ring.used == 1024 + 512 - 512
    assert ring.try_reserve(1) is None
    ring.release(end)
    assert ring.used == 0 and ring.try_reserve(1024) == (512, 1024 + 512 + 1024) or True
    assert ByteRing(1024).try_reserve(2048) is None
    assert align_up(1) == 256


def _generate(model, encoded, spec, store, new_tokens=12):
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=store) as run:
        out = run.model.generate(**encoded, max_new_tokens=new_tokens, do_sample=False)
    return out, run


def test_a_laid_out_steps_single_slot_equals_the_one_the_drain_builds():
    """The model's thread reads one site's slot (vLLM's logits, eagerly, every step) without
    building the others; the drain builds them all: both agree on every field."""
    rng = np.random.default_rng(0)
    wanted = [(site, np.sort(rng.choice(40, 8, replace=False)), np.arange(8) + site, 1000 + 37 * site, 0)
              for site in (7, 2, 30, 11)]
    layout = StepLayout(wanted)
    single = LaidOutSlots(layout, base=4096, first=50)
    drained = LaidOutSlots(layout, base=4096, first=50)._built()
    for site in (7, 2, 30, 11):
        a, b = single[site], drained[site]
        assert (a.site, a.offset, a.capacity, a.seq) == (b.site, b.offset, b.capacity, b.seq)
        assert np.array_equal(a.sel, b.sel) and np.array_equal(a.rows, b.rows)
    assert single[2].seq == 51 and single[2].offset == 4096 + align_up(1000 + 37 * 7)
    with pytest.raises(KeyError):
        single[3]


def test_a_step_begun_ahead_is_given_back_as_if_never_begun_and_never_waits_or_drops():
    """Ring.begin_step(ahead=True), the HF adapter's next decode step begun before its forward is
    known to come: retract_ahead restores ring space, meta seqs, step count, open step and bucket,
    so the step begun in its place gets the same block and seqs. Where the step would wait (ring
    full, bucket empty) it is not begun at all: no stall, no drop, nothing to give back."""
    ring = CpuRing(64 << 10, 64)
    ring.bucket = TokenBucket(1e6, clock=lambda: 0.0)     # (a frozen clock: no refill meanwhile)
    layout = StepLayout([(site, np.arange(4), np.arange(4), 6000, 0) for site in range(3)])   # 3 x 6144 bytes
    pad = np.zeros(4, np.int64)
    ring.begin_step(0, None, pad, layout)
    ring.end_step()

    def state():
        return ring.bytes.head, ring.next_seq, ring.stats.steps, ring.current, list(ring.pending)

    before, level = state(), ring.bucket.level
    ahead = ring.begin_step(1, None, pad, layout, ahead=True)
    assert ahead is not None and ring.current is ahead and ring.bucket.level < level
    assert ring.retract_ahead() and state() == before and ring.bucket.level == level
    assert not ring.retract_ahead()                       # once
    taken = ring.begin_step(1, None, pad, layout)
    assert (taken.base, taken.first_seq, taken.end_seq) == (ahead.base, ahead.first_seq, ahead.end_seq)
    ring.end_step()
    assert [c.step for c in ring.drain_ready(8)] == [0, 1]
    ring.begin_step(2, None, pad, layout)            # 3 x 18 KiB pending: a 4th step does not fit now
    ring.end_step()
    assert ring.begin_step(3, None, pad, layout, ahead=True) is None
    ring.bucket = TokenBucket(1000, clock=lambda: 0.0)
    ring.bucket.spend(1000)                          # an empty bucket: the step would wait for it
    ring.drain_steps(ring.drain_ready(8))
    assert ring.begin_step(3, None, pad, layout, ahead=True) is None and not ring.retract_ahead()
    assert ring.stats.stall_seconds == 0 and not ring.stats.drops and ring.stats.steps == 3


def test_a_capped_laid_out_step_drops_what_the_per_capture_path_drops():
    """best_effort under policy.d2h_bytes_per_s: a laid-out step the bucket has no room for keeps
    the fast path with the captures that fit (the same victims as the per-capture path: lowest
    priority first, the later capture first among equals), every victim in the drops table with
    its requests, rows and bytes, the kept ones laid out as the general path lays them out."""
    from dmi.tokens import StepTokens
    rng = np.random.default_rng(1)
    tokens = StepTokens(0, 6, 1, np.arange(6), np.array([0, 0, 1, 2, 2, 3]), np.arange(6), np.ones(6, np.int8),
                        np.zeros(6, np.int64))
    sels = [np.array([0, 2, 5]), np.array([1, 3])]
    wanted = [(site, sels[site % 2], sels[site % 2], int(rng.integers(200, 3000)), int(rng.integers(0, 3)))
              for site in range(12)]
    pad = np.zeros(6, np.int64)
    partial = 0
    for level in (0, 700, 5000, 9000, 14000, 10 ** 9):
        got = {}
        for path in ("laid_out", "per_capture"):
            ring = CpuRing(1 << 20, 256, "best_effort")
            ring.bucket = TokenBucket(1e6, burst=1e9, clock=lambda: 0.0)   # (frozen: the level stays put)
            ring.bucket.level = level
            ctrl = ring.begin_step(0, tokens, pad, StepLayout(wanted) if path == "laid_out" else wanted)
            slots = [(s.site, s.offset - ctrl.base, s.capacity, s.seq - ctrl.first_seq, s.sel.tolist())
                     for s in ctrl.slots.values()]
            got[path] = (slots, [tuple(vars(d).values()) for d in ring.stats.drops], ctrl.nbytes, ring.bucket.level)
            if path == "laid_out":
                assert ctrl.layout is not None, "a capped laid-out step left the fast path"
        assert got["laid_out"] == got["per_capture"], level
        partial += 0 < len(got["laid_out"][1]) < 12
        assert len(got["laid_out"][1]) == {0: 12, 10 ** 9: 0}.get(level, len(got["laid_out"][1]))
    assert partial >= 2


def test_a_capped_best_effort_step_begun_ahead_drops_as_its_forward_would_and_only_once_taken():
    """best_effort under a bandwidth cap, a step begun ahead of its forward (the HF adapter's next
    decode step): the bucket's victims are dropped there as the step's own begin would drop them,
    so the capped step keeps the host work off the GPU's critical path. Its drops enter the table
    only when the forward takes it (``take_ahead``); a retracted one leaves no drop, and the bucket,
    ring and seqs as they were."""
    from dmi.tokens import StepTokens
    tokens = StepTokens(0, 6, 1, np.arange(6), np.array([0, 0, 1, 2, 2, 3]), np.arange(6), np.ones(6, np.int8),
                        np.zeros(6, np.int64))
    sel = np.array([0, 2, 5])
    wanted = [(site, sel, sel, 1000 + 100 * site, site % 3) for site in range(8)]
    pad = np.zeros(6, np.int64)

    def capped(level):
        ring = CpuRing(1 << 20, 256, "best_effort")
        ring.bucket = TokenBucket(1e6, burst=1e9, clock=lambda: 0.0)
        ring.bucket.level = level
        return ring

    def seen(ring, ctrl):
        return ([(s.site, s.offset - ctrl.base, s.seq - ctrl.first_seq) for s in ctrl.slots.values()],
                [tuple(vars(d).values()) for d in ring.stats.drops], ring.bucket.level)

    layout = StepLayout(wanted)
    at_forward = capped(5000)
    want = seen(at_forward, at_forward.begin_step(0, tokens, pad, layout))
    assert 0 < len(want[1]) < 8 and all(d[-1] == "bandwidth" for d in want[1])

    ring = capped(5000)
    state = (ring.bytes.head, ring.next_seq, ring.stats.steps, ring.current)
    ahead = ring.begin_step(0, tokens, pad, layout, ahead=True)
    assert ahead is not None and ahead.layout is not None and not ring.stats.drops
    assert ring.retract_ahead() and not ring.stats.drops and ring.bucket.level == 5000
    assert (ring.bytes.head, ring.next_seq, ring.stats.steps, ring.current) == state
    ahead = ring.begin_step(0, tokens, pad, layout, ahead=True)
    ring.take_ahead()
    assert seen(ring, ahead) == want
    assert not ring.retract_ahead()                       # taken: nothing to give back


def test_backpressure_with_tiny_ring_is_lossless_and_bit_identical(encoded, write_spec, tmp_path):
    model, ref = model_pair("qwen3")
    big = write_spec("capture: [{sites: [resid_post, mlp.out, final_norm]}]\npolicy: {ring_bytes: 64MiB}\n", "big.yaml")
    # the prefill step of this batch needs ~100 KiB: the ring holds about one step at a time
    small = write_spec("capture: [{sites: [resid_post, mlp.out, final_norm]}]\npolicy: {ring_bytes: 112KiB, meta_records: 32}\n",
                       "small.yaml")
    out_big, run_big = _generate(ref, encoded, big, tmp_path / "big.zarr", new_tokens=30)
    out_small, run_small = _generate(model, encoded, small, tmp_path / "small.zarr", new_tokens=30)
    assert torch.equal(out_big, out_small)
    assert run_small.ring.bytes.head > 2 * run_small.ring.bytes.capacity      # wrapped around twice
    assert run_small.ring.next_seq > 2 * 32                                       # meta ring wrapped too
    stats = run_small.stats()
    assert stats["dropped_captures"] == 0
    assert stats["stall_bandwidth_seconds"] == 0          # no cap: any wait was for ring space
    a, b = dmi.open(tmp_path / "big.zarr"), dmi.open(tmp_path / "small.zarr")
    for group, var in (("layers/resid_post", "resid_post"), ("layers/mlp/out", "out"), ("final_norm", "final_norm")):
        np.testing.assert_array_equal(a[group].dataset[var].values, b[group].dataset[var].values)
        assert list(a[group].dataset.request.values) == list(b[group].dataset.request.values)
    assert b.attrs["dmi_status"] == "closed"


STREAM_CAPTURE = [{"sites": ["resid_post", "mlp.out", "final_norm"]}, {"sites": ["logits"], "tokens": "last"}]


def _bounded(fn, seconds: float = 240.0):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it has not returned in time."""
    import threading
    out: dict = {}

    def go():
        try:
            out["value"] = fn()
        except BaseException as e:     # noqa: BLE001 - re-raised on the test's thread
            out["error"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: a hang"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_steps_larger_than_the_ring_stream_through_it_losslessly(encoded, write_spec, tmp_path, monkeypatch):
    """Under full a step larger than the ring is never refused: it goes through the ring in parts,
    several generate() calls in a row, and the store equals a run whose ring holds every step."""
    import dmi.ring.protocol as ring_mod
    parts = []
    monkeypatch.setattr(ring_mod.Ring, "_open_part", lambda self, *a, _f=ring_mod.Ring._open_part: parts.append(1)
                        or _f(self, *a))
    stores = {}
    for name, policy in (("big", {"ring_bytes": "8MiB"}),
                         ("small", {"ring_bytes": "24KiB", "host_bytes": "16KiB", "meta_records": 32,
                                    "stall_timeout_s": 30})):
        model, _ = model_pair("qwen3")
        spec = {"capture": STREAM_CAPTURE, "policy": policy}

        def three_generates():
            with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / f"{name}.zarr") as run:
                outs = [run.model.generate(**encoded, max_new_tokens=12, do_sample=False) for _ in range(3)]
            return outs, run
        outs, run = _bounded(three_generates)
        stores[name] = (outs, run.stats())
    assert len(parts) > 3                                  # the prefills went through in parts
    assert all(torch.equal(a, b) for a, b in zip(stores["big"][0], stores["small"][0]))
    small = stores["small"][1]
    assert small["dropped_captures"] == 0 and small["steps"] == stores["big"][1]["steps"]
    a, b = dmi.open(tmp_path / "big.zarr"), dmi.open(tmp_path / "small.zarr")
    for group, var in (("layers/resid_post", "resid_post"), ("layers/mlp/out", "out"), ("final_norm", "final_norm"),
                       ("logits", "logits")):
        x, y = a[group].dataset, b[group].dataset
        assert x.sizes == y.sizes
        np.testing.assert_array_equal(x[var].values, y[var].values)
        for coord in ("request", "position", "step", "phase"):
            assert list(x[coord].values) == list(y[coord].values), (group, coord)
    assert b.attrs["dmi_status"] == "closed"


def test_a_capture_larger_than_the_ring_is_refused_naming_the_site_and_the_fix(encoded, write_spec, tmp_path):
    model, _ = model_pair("qwen3")
    spec = write_spec("capture: [{sites: [resid_post]}]\npolicy: {ring_bytes: 4KiB}\n")
    run = dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr")
    with pytest.raises(dmi.PolicyError, match=r"one capture of layers.0.resid_post .*policy.ring_bytes.*Fix: raise "
                                              r"policy.ring_bytes to at least"):
        with torch.no_grad():
            run.model(**encoded)
    run.close()


def test_a_wait_without_progress_is_an_error_naming_the_stage_and_its_figures():
    """No silent hang: a full step waiting for ring room that the drain never frees raises a
    CaptureError once policy.stall_timeout_s passes without progress."""
    from dmi.errors import CaptureError
    from dmi.tokens import StepTokens
    ring = CpuRing(4096, 64)
    ring.stall_timeout = 0.3
    tokens = StepTokens.__new__(StepTokens)
    layout = StepLayout([(0, np.arange(4), np.arange(4), 3000, 0)])
    ring.begin_step(0, tokens, np.zeros(1, np.int64), layout)
    ring.end_step()                                         # ended, never drained: the ring stays full
    with pytest.raises(CaptureError, match=r"step 1 waiting for ring space \(drain\): no progress for .* s "
                                           r"\(needs 3,072 bytes .*ring 3,072 of 4,096 bytes used.*1 step\(s\) pending"):
        ring.begin_step(1, tokens, np.zeros(1, np.int64), layout)


def test_best_effort_drops_low_priority_first_and_accounts_every_row(encoded, write_spec, tmp_path):
    model, ref = model_pair("qwen3")
    # one forward of the whole batch: resid_post (3 layers) fits the ring, adding any mlp.out does not
    n_tokens = int(encoded["attention_mask"].sum())
    per_site = -(-n_tokens * 64 * 4 // 256) * 256
    spec = write_spec(f"""
        capture:
          - sites: [resid_post]
            priority: 1
          - sites: [mlp.out]
            priority: 0
        policy: {{mode: best_effort, ring_bytes: {3 * per_site + per_site // 2}}}
    """)
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr") as run:
        run.set_request_ids(["req-a", "req-b", "req-c"])
        out = run.model(**encoded)
    torch.testing.assert_close(out.logits, ref(**encoded).logits, rtol=0, atol=0)
    tree = dmi.open(tmp_path / "o.zarr")
    drops = tree["drops"].dataset
    assert sorted(drops.site.values) == [f"layers.{i}.mlp.out" for i in range(3)]
    assert set(drops.reason.values) == {"ring_full"}
    assert drops.rows.values.tolist() == [n_tokens] * 3
    # the drops table names requests as the store's request coordinate does
    assert drops.requests.values.tolist() == ["req-a req-b req-c"] * 3
    assert set(tree["layers/resid_post"].dataset.request.values) == {"req-a", "req-b", "req-c"}
    assert tree["layers/resid_post"].dataset.sizes["token"] == n_tokens
    assert "layers/mlp/out" not in tree or tree["layers/mlp/out"].dataset.sizes["token"] == 0
    _check_accounting(tree)


def test_best_effort_generate_never_changes_outputs(encoded, write_spec, tmp_path):
    model, ref = model_pair("qwen3")
    spec = write_spec("""
        capture: [{sites: [resid_post, mlp.out, attn.q]}]
        policy: {mode: best_effort, ring_bytes: 64KiB}
    """)
    out, run = _generate(model, encoded, spec, tmp_path / "o.zarr", new_tokens=8)
    assert torch.equal(out, ref.generate(**encoded, max_new_tokens=8, do_sample=False))
    tree = dmi.open(tmp_path / "o.zarr")
    assert tree["drops"].dataset.sizes["drop"] > 0         # the prefill cannot fit whole
    _check_accounting(tree)


def _check_accounting(tree):
    attrs = tree.attrs
    for site in attrs["sites"]:
        assert attrs["rows_stored"][site] + attrs["rows_dropped"][site] + attrs["rows_not_computed"][site] \
            == attrs["rows_selected"][site], site
    assert sum(attrs["rows_dropped"].values()) == int(tree["drops"].dataset.rows.sum())


def test_token_filters(encoded, write_spec, tmp_path):
    model, _ = model_pair("qwen3")
    spec = write_spec("""
        capture:
          - sites: [embed]
            tokens: prefill
          - sites: [final_norm]
            tokens: {phase: decode, every_n_steps: 2}
          - sites: [resid_post]
            layers: [-1]
            tokens: {positions: [2, 5]}
          - sites: [resid_pre]
            layers: [0]
            tokens: {max_per_request: 3}
          - sites: [logits]
            tokens: last
            reduce: {topk: 5}
    """)
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr") as run:
        run.set_request_ids(["a", "b", "c"])
        run.model.generate(**encoded, max_new_tokens=6, do_sample=False)
    t = dmi.open(tmp_path / "o.zarr")
    mask = encoded["attention_mask"]
    lengths = mask.sum(1).tolist()
    embed = t["embed"].dataset
    assert set(embed.phase.values) == {"prefill"} and embed.sizes["token"] == sum(lengths)
    fin = t["final_norm"].dataset
    assert set(fin.phase.values) == {"decode"} and sorted(set(fin.step.values)) == [2, 4]
    rp = t["layers/resid_post"].dataset
    assert rp.layer.values.tolist() == [2]
    assert set(rp.position.values) <= {2, 3, 4} and rp.sizes["token"] == sum(min(max(n - 2, 0), 3) for n in lengths) \
        + sum(1 for n in lengths for p in range(n, n + 5) if 2 <= p < 5)
    pre = t["layers/resid_pre"].dataset
    for rid in ("a", "b", "c"):
        assert (pre.request.values == rid).sum() == 3
    logits = t["logits"].dataset
    assert logits.topk_values.shape == (3 * 6, 5) and logits.topk_indices.dtype == np.int32
    assert list(logits.request.values[:3]) == ["a", "b", "c"]
    # top-k values are sorted and the indices point at them
    assert np.all(np.diff(logits.topk_values.values, axis=1) <= 0)


def test_store_opens_with_open_zarr_and_datatree(encoded, write_spec, tmp_path):
    import xarray as xr
    model, _ = model_pair("qwen3")
    spec = write_spec("capture: [{sites: [resid_post, attn.q], layers: [0, 2]}, {sites: [logits], tokens: last}]\n")
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr") as run:
        run.model.generate(**encoded, max_new_tokens=2, do_sample=False)
    ds = xr.open_zarr(tmp_path / "o.zarr", group="layers/attn/q")
    assert ds.q.dims == ("token", "layer", "head", "head_dim")
    assert set(ds.coords) >= {"request", "position", "step", "phase", "layer"}
    # (open_zarr gives dask arrays, where where(request == "r1", drop=True) is refused: dmi.request)
    sel = dmi.request(ds.q.sel(layer=2), "r1")
    assert sel.sizes["token"] == int(encoded["attention_mask"][1].sum()) + 1 and sel.chunks is not None
    tree = xr.open_datatree(tmp_path / "o.zarr", engine="zarr")
    assert tree.attrs["family"] == "qwen3" and tree.attrs["dmi_status"] == "closed"
    assert tree["layers/resid_post"].dataset.sizes["token"] != tree["logits"].dataset.sizes["token"]


def test_eager_replay_captures_a_tensor_once_it_came_back_and_keeps_the_graphs_of_recent_ones(monkeypatch):
    """KernelRing._replayed's bookkeeping (the CUDA graphs themselves: tests/gpu): a tensor seen
    ``SEEN_TO_CAPTURE`` times is launched graph-mode and captured, later sightings replay that
    graph; at most one capture every ``CAPTURE_GAP`` steps per site; a site keeps the graphs of its
    ``SITE_KEYS`` most recently seen tensors (the least recent goes first)."""
    from types import SimpleNamespace

    import torch

    from dmi.kernels import kernel_ring as C
    monkeypatch.setattr(C, "SEEN_TO_CAPTURE", 3)
    monkeypatch.setattr(C, "CAPTURE_GAP", 8)
    monkeypatch.setattr(C, "SITE_KEYS", 2)

    class Graph:                               # stands for a captured CUDA graph: counts its replays
        def __init__(self, launch):
            self.launch, self.replays = launch, 0

        def replay(self):
            self.replays += 1

    launched = []
    ring = SimpleNamespace(_site_graphs={}, _capture_after={}, _graphs_made={}, geometry=(1, 8),
                           current=SimpleNamespace(step=0), _capture=Graph,
                           sites={0: SimpleNamespace(launch=lambda r, x, eager: launched.append((x.data_ptr(), eager)))})
    site = SimpleNamespace(index=0)
    a, b, c = torch.zeros(4, 2), torch.zeros(5, 2), torch.zeros(6, 2)

    def see(x, step):
        ring.current.step = step
        return C.KernelRing._replayed(ring, site, x)

    assert [see(a, s) for s in range(5)] == [None, None, "capture", "replay", "replay"]
    assert launched == [(a.data_ptr(), None)]            # the capturing step's own copy: graph-mode, once
    graph_a = ring._site_graphs[0][(a.data_ptr(), a.shape, a.stride(), a.dtype, (1, 8))]
    assert graph_a.replays == 2 and ring._graphs_made == {0: 1}
    # b comes back at once, but a capture happened 3 steps ago: eager until step 2 + CAPTURE_GAP
    assert [see(b, s) for s in (5, 6, 7, 9)] == [None, None, None, None]
    assert see(b, 10) == "capture" and ring._graphs_made == {0: 2}
    ring.geometry = (1, 9)                     # another step geometry: another key, even for a's block
    assert see(a, 11) is None
    # two keys kept: a's (1, 8) graph was the least recently seen, it is gone; b's stays
    ring.geometry = (1, 8)
    assert see(b, 12) == "replay"
    assert [see(a, s) for s in (13, 14)] == [None, None]
    assert see(c, 15) is None and len(ring._site_graphs[0]) == 2
