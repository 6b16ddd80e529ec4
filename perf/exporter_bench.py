"""Exporter throughput: how fast drained steps become Zarr chunks (CPU only, no model).

Feeds the real ZarrExporter synthetic drained steps shaped like Qwen3-8B hidden-states capture
(36 x resid_post + final_norm, bf16 captured; stored as bf16, ``store.dtype: native``, or widened,
``--dtypes float32``) and prints GB/s of captured bytes for each compression setting, stored dtype
and ``store.writer`` (thread: the exporter in this process; process:
in its own), from the first step to the store closed (every chunk on disk and committed), and the
CPU time per step of the thread that hands the steps over: what the model's process pays (the
run's exporter thread, holding the GIL the model's thread needs), and how late a thread that
wakes every 200 us gets the GIL back meanwhile (:class:`GilProbe`). The exporter writes chunk files from a pool of one thread per core: run it on the
machine that captures. Run: python perf/exporter_bench.py [--steps 64] [--tokens 256] [--dir /dev/shm/eb]

16-core GPU host, --steps 24 --tokens 256, stored float32: none 2.3, lz4 1.9, zstd 0.6 GB/s
(zarr-python writes before: 0.31, 0.30, 0.18).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


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


def bench(compression: str, steps: int, tokens: int, out: Path, writer: str = "thread",
          dtype: str = "native") -> tuple[float, float]:
    """(captured GB/s from the first step to the store closed, CPU ms per step of the calling thread)."""
    import transformers as tf
    from dmi.exporter import ZarrExporter
    from dmi.plan import build_plan
    from dmi.ring import META_DTYPE, SiteSlot, StepControl
    from dmi.spec import builtin_spec_dir, load_arch_spec, load_hook_spec
    from dmi.tokens import StepTokens
    from dmi.writer import ProcessExporter

    cfg = tf.Qwen3Config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=12288, vocab_size=151936)
    hook = load_hook_spec({"capture": [{"sites": ["resid_post", "final_norm"]}],
                           "store": {"compression": compression, "dtype": dtype}, "policy": {"ring_bytes": "4GiB"}})
    plan = build_plan(load_arch_spec(builtin_spec_dir() / "qwen3.yaml"), hook, cfg, model_dtype_itemsize=2)
    shutil.rmtree(out, ignore_errors=True)
    exp = (ZarrExporter if writer == "thread" else ProcessExporter)(out, plan, "bfloat16", {}, overwrite=True)
    rng = np.random.default_rng(0)
    payload = {s.index: rng.integers(0, 2**16, tokens * s.row_bytes(2) // 2, dtype=np.uint16).view(np.uint8)
               for s in plan.sites}
    st = StepTokens(0, 1, tokens, np.arange(tokens), np.zeros(tokens, np.int64), np.arange(tokens),
                    np.zeros(tokens, np.int8), np.arange(tokens))
    sel = np.arange(tokens)
    captured = 0
    t0, c0 = time.perf_counter(), time.thread_time()
    for step in range(steps):
        slots = {s.index: SiteSlot(s.index, 0, 0, sel, sel, 1) for s in plan.sites}
        ctrl = StepControl(step, st, np.zeros(1, np.int64), slots, 0, 0, 0)
        records = []
        for s in plan.sites:
            rec = np.zeros((), META_DTYPE)
            rec["rows"], rec["src_seq"], rec["nbytes"] = tokens, tokens, len(payload[s.index])
            records.append((slots[s.index], rec, payload[s.index]))
            captured += len(payload[s.index])
        exp.write_step(ctrl, records, ["r0"])
    exp.close({})
    return captured / (time.perf_counter() - t0) / 1e9, (time.thread_time() - c0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--writers", default="thread,process", help="store.writer settings to time")
    ap.add_argument("--compressions", default="lz4,none,zstd")
    ap.add_argument("--dtypes", default="native", help="store.dtype settings to time (native: bf16 as bf16)")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="dmi-exporter-bench-"))
    with GilProbe() as idle:
        time.sleep(1.0)
    print(f"GIL probe, idle: {idle.mean_us():.0f} us late per wake-up (sleep granularity)")
    print("| writer | compression | stored | captured GB/s (median) | caller CPU ms/step (median) | "
          "probe us late (median) | runs (GB/s) |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- |")
    for writer in args.writers.split(","):
        for dtype in args.dtypes.split(","):
            for comp in args.compressions.split(","):
                runs, late = [], []
                for _ in range(args.repeats):
                    with GilProbe() as probe:
                        runs.append(bench(comp, args.steps, args.tokens, base / f"{comp}.zarr", writer, dtype))
                    late.append(probe.mean_us())
                gbs, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
                print(f"| {writer} | {comp} | {dtype} | {gbs:.2f} | {cpu:.2f} | {statistics.median(late):.0f} | "
                      f"{[round(r[0], 2) for r in runs]} |", flush=True)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
