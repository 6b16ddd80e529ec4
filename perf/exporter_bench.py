"""Exporter throughput: how fast drained steps become Zarr chunks (CPU only, no model).

Feeds the real ZarrExporter synthetic drained steps shaped like Qwen3-8B hidden-states capture
(36 x resid_post + final_norm, bf16 captured; stored as bf16, ``store.dtype: native``, or widened,
``--dtypes float32``) and prints GB/s of captured bytes for each compression setting, stored dtype
and ``store.writer`` (thread: the exporter in this process; process:
in its own; pool: chunks encoded and written by ``store.writers`` processes, ``--pool-writers``),
from the first step to the store closed (every chunk on disk and committed), and the
CPU time per step of the thread that hands the steps over: what the model's process pays (the
run's exporter thread, holding the GIL the model's thread needs), the CPU time per step of this
whole process (every store thread in it: the GIL's other holders), and how late a thread that
wakes every 200 us gets the GIL back meanwhile (:class:`GilProbe`). The payload is bf16
activations (``--payload random``: uniform random bits, which blosc stores through its
incompressible fast path and so flatter lz4). The exporter writes chunk files from a pool of
``store.threads`` threads (``--threads``): run it on the machine that captures. ``--dir`` picks the
file system (``/dev/shm/eb``, or a directory on a local disk); the table's "of raw write" column
divides by that directory's raw sequential write speed (one file, 16 MiB writes, fsync), printed
above it.

    python perf/exporter_bench.py [--steps 24] [--tokens 64] [--dir /dev/shm/eb]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's dmi

from common import config, raw_write_gbs   # noqa: E402


class GilProbe:
    """A stand-in for a GPU model's thread: it sleeps (GIL released, as while a CUDA call waits)
    for 200 us, then needs the GIL for a moment, over and over. The time it waits for the GIL on
    waking is what a busy exporter adds to every host step of the model (mean us per wake-up)."""

    def __init__(self):
        self.waits: list[float] = []
        self._stop = threading.Event()

    def _loop(self):
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(200e-6)
            self.waits.append(time.perf_counter() - t - 200e-6)

    def __enter__(self):
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def mean_us(self) -> float:
        return statistics.fmean(self.waits) * 1e6 if self.waits else float("nan")


def payload(kind: str, n_bytes: int, seed: int) -> np.ndarray:
    """A record's bytes: bf16 activations (normal values, a log-normal scale per hidden channel, as
    residual streams have), or uniform random 16-bit words (incompressible; NaN and inf bit patterns
    included), as uint8."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 2**16, n_bytes // 2, dtype=np.uint16).view(np.uint8)
    import ml_dtypes
    hidden = 4096
    scale = np.exp(rng.standard_normal(hidden, dtype=np.float32))
    x = rng.standard_normal((n_bytes // 2 // hidden, hidden), dtype=np.float32) * scale
    return x.astype(ml_dtypes.bfloat16).view(np.uint8).reshape(-1)


def bench(compression: str, steps: int, tokens: int, out: Path, writer: str = "thread",
          dtype: str = "native", threads: int | None = None, chunk_bytes: int | None = None,
          kind: str = "activations", pool_writers: int | None = None) -> dict:
    """One run: captured GB/s from the first step to the store closed, CPU ms per step of the
    calling thread, the store's bytes over the captured bytes, and the store threads used."""
    from dmi.store.chunks import default_threads
    from dmi.store.exporter import ZarrExporter
    from dmi.store.preflight import disk_usage
    from dmi.plan import build_plan
    from dmi.ring.layout import SiteSlot, StepControl
    from dmi.ring.records import META_DTYPE
    from dmi.spec import builtin_spec_dir, load_arch_spec, load_hook_spec
    from dmi.tokens import StepTokens
    from dmi.store.pool import PoolExporter, default_writers
    from dmi.store.writer import ProcessExporter

    cfg = config("qwen3-8b")
    store = {"compression": compression, "dtype": dtype}
    if threads:
        store["threads"] = threads
    if chunk_bytes:
        store["chunk_bytes"] = chunk_bytes
    if writer == "pool":
        store["writer"] = "pool"
        if pool_writers:
            store["writers"] = pool_writers
    hook = load_hook_spec({"capture": [{"sites": ["resid_post", "final_norm"]}],
                           "store": store, "policy": {"ring_bytes": "4GiB"}})
    plan = build_plan(load_arch_spec(builtin_spec_dir() / "qwen3.yaml"), hook, cfg, model_dtype_itemsize=2)
    shutil.rmtree(out, ignore_errors=True)
    exporter = {"thread": ZarrExporter, "process": ProcessExporter, "pool": PoolExporter}[writer]
    exp = exporter(out, plan, "bfloat16", {}, overwrite=True)
    payloads = {s.index: payload(kind, tokens * s.row_bytes(2), s.index) for s in plan.sites}
    st = StepTokens(0, 1, tokens, np.arange(tokens), np.zeros(tokens, np.int64), np.arange(tokens),
                    np.zeros(tokens, np.int8), np.arange(tokens))
    sel = np.arange(tokens)
    captured = 0
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    for step in range(steps):
        slots = {s.index: SiteSlot(s.index, 0, 0, sel, sel, 1) for s in plan.sites}
        ctrl = StepControl(step, st, np.zeros(1, np.int64), slots, 0, 0, 0)
        records = []
        for s in plan.sites:
            rec = np.zeros((), META_DTYPE)
            rec["rows"], rec["src_seq"], rec["nbytes"] = tokens, tokens, len(payloads[s.index])
            records.append((slots[s.index], rec, payloads[s.index]))
            captured += len(payloads[s.index])
        exp.write_step(ctrl, records, ["r0"])
    exp.close({})
    wall = time.perf_counter() - t0
    return {"gbs": captured / wall / 1e9, "cpu_ms": (time.thread_time() - c0) / steps * 1e3,
            "proc_ms": (time.process_time() - p0) / steps * 1e3, "ratio": disk_usage(out) / captured,
            "threads": threads or default_threads(),
            "writers": (pool_writers or default_writers()) if writer == "pool" else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=64, help="rows per step (batch x seq)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir); e.g. /dev/shm/eb or a "
                                                "directory on a local disk")
    ap.add_argument("--writers", default="thread,process,pool", help="store.writer settings to time")
    ap.add_argument("--pool-writers", type=int, default=None,
                    help="store.writers of store.writer pool (default: the pool's default)")
    ap.add_argument("--compressions", default="lz4,none,zstd")
    ap.add_argument("--dtypes", default="native", help="store.dtype settings to time (native: bf16 as bf16)")
    ap.add_argument("--threads", default="", help="store.threads settings to time, comma-separated "
                                                  "(default: the exporter's default)")
    ap.add_argument("--chunk-bytes", type=int, default=None, help="store.chunk_bytes (default: the hook spec's)")
    ap.add_argument("--payload", choices=("activations", "random"), default="activations",
                    help="captured bytes: bf16 activations (compress like real ones) or random 16-bit words")
    ap.add_argument("--raw-bytes", type=int, default=1 << 30,
                    help="size of the raw sequential write probe of --dir (0: skip it)")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="dmi-exporter-bench-"))
    raw = raw_write_gbs(base, args.raw_bytes) if args.raw_bytes else None
    with GilProbe() as idle:
        time.sleep(1.0)
    step_mb = 37 * args.tokens * 4096 * 2 / 1e6
    print(f"{os.cpu_count()} CPUs; store in {base}; {args.steps} steps x {args.tokens} rows "
          f"({step_mb:.1f} MB captured a step, {args.payload} payload)")
    if raw is not None:
        print(f"raw sequential write of {base}: {raw:.2f} GB/s ({args.raw_bytes / 2**30:g} GiB in 16 MiB writes "
              f"+ fsync)")
    print(f"GIL probe, idle: {idle.mean_us():.0f} us late per wake-up (sleep granularity)")
    print()
    print("| writer | compression | stored | threads | processes | captured GB/s (median) | of raw write | "
          "store bytes / captured | caller CPU ms/step | process CPU ms/step | probe us late | runs (GB/s) |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for writer in args.writers.split(","):
        for dtype in args.dtypes.split(","):
            for comp in args.compressions.split(","):
                for threads in [int(t) if t else None for t in args.threads.split(",")]:
                    runs, late = [], []
                    for _ in range(args.repeats):
                        with GilProbe() as probe:
                            runs.append(bench(comp, args.steps, args.tokens, base / f"{comp}.zarr", writer, dtype,
                                              threads, args.chunk_bytes, args.payload, args.pool_writers))
                        late.append(probe.mean_us())
                    gbs = statistics.median(r["gbs"] for r in runs)
                    cpu = statistics.median(r["cpu_ms"] for r in runs)
                    proc = statistics.median(r["proc_ms"] for r in runs)
                    of_raw = f"{gbs / raw:.2f}" if raw else ""
                    each = ", ".join(f"{r['gbs']:.2f}" for r in runs)
                    print(f"| {writer} | {comp} | {dtype} | {runs[0]['threads']} | {runs[0]['writers']} | {gbs:.2f} | "
                          f"{of_raw} | {runs[0]['ratio']:.3f} | {cpu:.2f} | {proc:.2f} | {statistics.median(late):.0f} | "
                          f"{each} |", flush=True)
    for comp in args.compressions.split(","):
        shutil.rmtree(base / f"{comp}.zarr", ignore_errors=True)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
