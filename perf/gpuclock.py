"""Clocks for perf/: GPU busy time per step from one profiled run (a stable measure of what a
configuration costs on the device, where wall time of HF's compiled generate is host-bound and
jitters by several percent between identical runs: perf/RESULTS.md, 2026-11-29 third session),
a stopwatch for host calls, and CPU clocks of a run's threads."""
from __future__ import annotations

import collections
import gc
import time

import torch


class Stopwatch:
    """Wall time, the calling thread's CPU time and number of the calls made through :meth:`wrap`
    (no device sync). Wall time above CPU time is time the calls waited: for the GIL (another
    thread of the process held it) or in a blocking CUDA call."""

    def __init__(self):
        self.seconds, self.cpu_seconds, self.calls = 0.0, 0.0, 0

    def clear(self) -> None:
        self.seconds, self.cpu_seconds, self.calls = 0.0, 0.0, 0

    def wrap(self, fn):
        def call(*args, **kwargs):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.cpu_seconds += time.thread_time() - c
                self.calls += 1
        return call

    def per_call_us(self) -> float:
        """Mean µs per call so far; starts over."""
        us = self.seconds / max(self.calls, 1) * 1e6
        self.seconds, self.calls = 0.0, 0
        return us


def gpu_profile(fn, steps: int) -> dict:
    """One run of ``fn`` under torch.profiler: wall ms, GPU busy ms (union of kernel and copy
    intervals, all streams), the same without copies (compute) and device events per step, and
    device time per step by kernel name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
        t = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t
    events = [e for e in p.events() if e.device_type == DeviceType.CUDA]
    busy = _union_us(events)
    # without the copies: the drain's D2H runs on the copy engine beside the kernels, and counts
    # in "busy" only where it fills a gap the host left
    compute = _union_us([e for e in events if not e.name.startswith(("Memcpy", "Memset"))])
    by_name = collections.defaultdict(float)
    for e in events:
        by_name[e.name[:90]] += e.time_range.end - e.time_range.start
    lookup = sum(cache_lookups_us(p))
    return {"wall_ms": wall * 1e3 / steps, "busy_ms": busy / 1e3 / steps, "compute_ms": compute / 1e3 / steps,
            "kernels": len(events) / steps, "lookup_us": lookup / steps,
            "by_name": {k: v / steps for k, v in by_name.items()}}


def cache_lookups_us(prof) -> list[float]:
    """CPU µs of each Dynamo cache lookup (guard evaluation before a compiled call) a torch.profiler
    run recorded, the profiler's own cost included."""
    return [e.cpu_time_total for e in prof.events() if e.name == "TorchDynamo Cache Lookup"]


def _union_us(events) -> float:
    """Length of the union of the events' intervals (µs)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in events):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def thread_cpu(thread) -> float:
    """CPU seconds of another thread of this process (POSIX thread CPU clock), 0 once it is gone."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, TypeError):
        return 0.0


class GcClock:
    """Seconds the process spent in Python's cyclic garbage collector, and full (generation 2)
    collections, since it was made (``gc.callbacks``). A full collection walks every tracked object:
    after torch.compile has built its graphs that heap is large, and one landing inside a timed run
    slows whichever configuration runs then, vanilla or not."""

    def __init__(self):
        self.seconds, self.full, self._t = 0.0, 0, None
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t
            self.full += info.get("generation") == 2
            self._t = None


class CpuClock:
    """CPU time per step of the model's thread and of the run's drain and export threads."""

    def __init__(self, run, steps: int):
        self.threads = [t for t in (getattr(run, "_drain", None), getattr(run, "_export", None)) if t is not None]
        self.steps = steps

    def __enter__(self):
        self.t0 = time.thread_time()
        self.c0 = [thread_cpu(t) for t in self.threads]
        return self

    def __exit__(self, *exc):
        main = (time.thread_time() - self.t0) / self.steps * 1e6
        rest = [(thread_cpu(t) - c) / self.steps * 1e6 for t, c in zip(self.threads, self.c0)]
        self.text = f"cpu us/step: model thread {main:.0f}, " + ", ".join(
            f"{t.name.split('-')[1]} {r:.0f}" for t, r in zip(self.threads, rest))
