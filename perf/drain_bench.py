"""Drain microbenchmark: sustained D2H throughput of Ring²'s drain on one GPU.

A producer thread runs steps of the real protocol (reserve, capture kernel per site, end-marker
kernel) as fast as the ring lets it; the drain loop (the same ``Ring.drain_ready``/``drain_step``
the run's drain thread calls: meta-ring polling, one ``cudaMemcpyAsync`` per step into pinned
staging on the drain stream, event sync, release) consumes them; the "exporter" frees staging at
once. The ring is far smaller than the data moved, so the producer is throttled by the drain
(backpressure) and the rate measured is the drain's. For reference, the same process times a
plain pinned ``cudaMemcpyAsync`` D2H of the same size (the PCIe ceiling) and the capture kernel's
device-to-device copy.

``--hol`` also measures what a drain copy does to the engine's own small D2H copies (a sampled
token, a stop check) on another stream: their latency while a large D2H copy is in flight, issued
whole, in 8 MiB pieces queued back to back, or in 64 MiB pieces each queued once the one before
it is done (head-of-line blocking on the copy engine: the engine serves queued copies in order, so
splitting a copy that is queued at once does not help; perf/RESULTS.md has the table).

    python perf/drain_bench.py [--gib 8] [--ring-mib 1024] [--repeats 3] [--hol]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dmi.kernels.cuda_ring import DRAIN_PIECE, PACED_PIECE, CudaRing   # noqa: E402
from dmi.kernels.cudart import check_call as _ok, cudart   # noqa: E402
from dmi.plan import Output, Plan, Policy, SitePlan, TokenFilter   # noqa: E402
from dmi.tokens import StepTokens   # noqa: E402


def _plan(n_sites: int, hidden: int) -> Plan:
    sites = [SitePlan(index=i, name=f"layers.{i}.resid_post", canonical="resid_post", layer=i, group="layers/resid_post",
                      dims=("hidden",), shape=(hidden,), anchor={"layout": ["batch", "seq", "hidden"]},
                      tokens=TokenFilter(), outputs=(Output("resid_post", ("hidden",), (hidden,), "float"),))
             for i in range(n_sites)]
    return Plan(family="bench", sites=sites, policy=Policy(), layers=n_sites)


def pinned_copy_gbs(nbytes: int, repeats: int = 5) -> float:
    """A plain D2H cudaMemcpyAsync into cudaHostAlloc memory: the ceiling."""
    rt = cudart()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = _ok(rt.cudaHostAlloc(nbytes, rt.cudaHostAllocPortable))
    stream = _ok(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        _ok(rt.cudaMemcpyAsync(dst, src.data_ptr(), nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream))
        _ok(rt.cudaStreamSynchronize(stream))
        times.append(time.perf_counter() - t)
    rt.cudaFreeHost(dst)
    rt.cudaStreamDestroy(stream)
    return nbytes / statistics.median(times[1:]) / 1e9


def drain_gbs(step_mib: int, total_gib: float, ring_mib: int, staging_mib: int, n_sites: int = 8,
              hidden: int = 4096) -> dict:
    """Producer: steps of ``n_sites`` captures (bf16 [rows, hidden]) of ``step_mib`` in all."""
    row_bytes = hidden * 2
    rows = max(1, step_mib * 2**20 // (n_sites * row_bytes))
    step_bytes = rows * row_bytes * n_sites
    steps = max(4, int(total_gib * 2**30 // step_bytes))
    plan = _plan(n_sites, hidden)
    ring = CudaRing(ring_mib << 20, 4096, "full", host_bytes=staging_mib << 20, max_step_tokens=rows,
                    device="cuda")
    ring.setup(plan, torch.bfloat16, torch.device("cuda"))
    x = torch.randn(1, rows, hidden, dtype=torch.bfloat16, device="cuda")
    sel = np.arange(rows, dtype=np.int64)
    toks = StepTokens(step=0, batch=1, seq=rows, rows=sel, request=np.zeros(rows, np.int64),
                      position=sel, phase=np.zeros(rows, np.int8), local=sel)
    pad = np.zeros(1, np.int64)
    wanted = [(i, sel, sel, rows * row_bytes, 0) for i in range(n_sites)]
    drained = [0]
    err = []

    def drain():
        try:
            done = 0
            while done < steps:
                ctrls = ring.drain_ready(64)
                if not ctrls:
                    time.sleep(2e-5)
                    continue
                for ctrl, recs in zip(ctrls, ring.drain_steps(ctrls)):
                    drained[0] += sum(len(r[2]) for r in recs)
                    ring.release_host(ctrl)
                    done += 1
        except BaseException as e:     # pragma: no cover
            err.append(e)
            ring.error = e

    # warm-up: compile the kernels, touch the memory
    th = threading.Thread(target=drain)
    torch.cuda.synchronize()
    th.start()
    t0 = time.perf_counter()
    for step in range(steps):
        ring.begin_step(step, toks, pad, wanted)
        for s in plan.sites:
            ring.capture(s, x)
        ring.device_end()
        ring.end_step(device=True)
        if step == 0:
            t_first = time.perf_counter()
    th.join()
    elapsed = time.perf_counter() - t0
    if err:
        raise err[0]
    stall = ring.stats.stall_seconds
    ring.close()
    first = t_first - t0
    return {"step_mib": step_bytes / 2**20, "steps": steps, "bytes": drained[0], "seconds": elapsed,
            "gbs": drained[0] / elapsed / 1e9, "gbs_after_first": drained[0] * (steps - 1) / steps / (elapsed - first) / 1e9,
            "producer_stall_s": stall}


def kernel_copy_gbs(rows: int = 8192, hidden: int = 4096, repeats: int = 20) -> float:
    """The capture kernel alone (device to device), bytes read + written per second."""
    plan = _plan(1, hidden)
    ring = CudaRing(1 << 30, 4096, "full", host_bytes=1 << 20, max_step_tokens=rows, device="cuda")
    ring.setup(plan, torch.bfloat16, torch.device("cuda"))
    x = torch.randn(1, rows, hidden, dtype=torch.bfloat16, device="cuda")
    sel = np.arange(rows, dtype=np.int64)
    toks = StepTokens(step=0, batch=1, seq=rows, rows=sel, request=np.zeros(rows, np.int64), position=sel,
                      phase=np.zeros(rows, np.int8), local=sel)
    times = []
    for step in range(repeats):
        ring.begin_step(step, toks, np.zeros(1, np.int64), [(0, sel, sel, rows * hidden * 2, 0)])
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        ring.capture(plan.sites[0], x)
        b.record()
        ring.device_end()
        ring.end_step(device=True)
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
        ctrls = ring.drain_ready()
        while not ctrls:
            ctrls = ring.drain_ready()
        ctrl, = ctrls
        ring.drain_step(ctrl)
        ring.release_host(ctrl)
    ring.close()
    return 2 * rows * hidden * 2 / statistics.median(times[2:]) / 1e9


def small_copy_latency(big_bytes: int, chunk: int | None, probes: int = 200, paced: bool = False) -> dict:
    """µs of a 4-byte D2H copy + sync on the current stream, issued back to back while the drain
    stream copies ``big_bytes`` to pinned memory (``chunk`` None: no big copy; 0: one copy; else
    pieces of ``chunk`` bytes, all queued at once, or with ``paced`` each queued by another thread
    once the one before it is done, as the CUDA ring's drain does with ``copy_at_step``)."""
    rt = cudart()
    big = torch.empty(max(big_bytes, 1), dtype=torch.uint8, device="cuda")
    dst = _ok(rt.cudaHostAlloc(max(big_bytes, 1), rt.cudaHostAllocPortable))
    stream = _ok(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
    event = _ok(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming | rt.cudaEventBlockingSync))
    flag = torch.ones(1, dtype=torch.int32, device="cuda")
    out = torch.empty(1, dtype=torch.int32, pin_memory=True)
    torch.cuda.synchronize()
    spent = {}

    def copy():
        t = time.perf_counter()
        step = chunk or big_bytes
        for at in range(0, big_bytes, step):
            if paced and at:
                _ok(rt.cudaEventRecord(event, stream))
                _ok(rt.cudaEventSynchronize(event))
            _ok(rt.cudaMemcpyAsync(dst + at, big.data_ptr() + at, min(step, big_bytes - at),
                                   rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream))
        _ok(rt.cudaStreamSynchronize(stream))
        spent["s"] = time.perf_counter() - t

    mover = threading.Thread(target=copy) if chunk is not None else None
    if mover is not None:
        mover.start()
        time.sleep(0.001)                  # the first piece is under way
    lat = []
    while True:                            # probe until the big copy is done (or `probes` times alone)
        t = time.perf_counter()
        out.copy_(flag, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        lat.append((time.perf_counter() - t) * 1e6)
        if (len(lat) >= probes) if mover is None else not mover.is_alive():
            break
    if mover is not None:
        mover.join()
    rt.cudaFreeHost(dst)
    rt.cudaEventDestroy(event)
    rt.cudaStreamDestroy(stream)
    gbs = big_bytes / spent["s"] / 1e9 if "s" in spent else None
    return {"median_us": statistics.median(lat), "max_us": max(lat), "probes": len(lat), "copy_gbs": gbs}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0, help="GiB drained per measurement")
    ap.add_argument("--ring-mib", type=int, default=1024)
    ap.add_argument("--staging-mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps-mib", default="16,64,256")
    ap.add_argument("--hol", action="store_true", help="only the head-of-line latency table")
    args = ap.parse_args(argv)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    ceiling = pinned_copy_gbs(256 << 20)
    print(f"pinned cudaMemcpyAsync D2H, 256 MiB: {ceiling:.1f} GB/s (ceiling)")
    if args.hol:
        big = 1 << 30
        print("\n4-byte D2H copy + sync on the compute stream while the drain stream copies 1 GiB to pinned memory:\n")
        print("| drain copy | probe µs (median) | probe µs (max) | probes | drain copy GB/s |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for label, chunk, paced in (("none", None, False), ("1 GiB in one copy", 0, False),
                                    ("8 MiB pieces, queued at once", 8 << 20, False),
                                    ("16 MiB pieces, one at a time (the drain's default)", DRAIN_PIECE, True),
                                    ("64 MiB pieces, one at a time (copy_at_step's drain)", PACED_PIECE, True)):
            r = small_copy_latency(big, chunk, paced=paced)
            gbs = f"{r['copy_gbs']:.1f}" if r["copy_gbs"] else ""
            print(f"| {label} | {r['median_us']:.0f} | {r['max_us']:.0f} | {r['probes']} | {gbs} |")
        return {}
    kern = kernel_copy_gbs()
    print(f"capture kernel D2D copy (8192 x 4096 bf16 rows): {kern:.0f} GB/s read+write")
    rows = []
    for mib in (int(m) for m in args.steps_mib.split(",")):
        runs = [drain_gbs(mib, args.gib, args.ring_mib, args.staging_mib) for _ in range(args.repeats)]
        med = statistics.median(r["gbs"] for r in runs)
        rows.append((mib, runs[0]["steps"], med, [round(r["gbs"], 1) for r in runs],
                     statistics.median(r["producer_stall_s"] for r in runs)))
    print()
    print("| step size | steps | drain GB/s (median) | runs | producer stalled (s, median) |")
    print("| ---: | ---: | ---: | --- | ---: |")
    for mib, steps, med, runs, stall in rows:
        print(f"| {mib} MiB | {steps} | {med:.1f} | {runs} | {stall:.2f} |")
    best = max(r[2] for r in rows)
    print(f"\ndrain sustained: {best:.1f} GB/s = {best / ceiling:.0%} of the pinned-copy ceiling ({ceiling:.1f} GB/s)")
    return {"ceiling_gbs": ceiling, "kernel_gbs": kern, "rows": rows, "best_gbs": best}


if __name__ == "__main__":
    main()
