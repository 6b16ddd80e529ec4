"""Where the cost of hidden-states capture goes, in one process on the GPU: each row removes one
part of dmi's per-step work and reports the step time against vanilla (dmi runs on a twin of
the model sharing its weights; every timed run follows a timed vanilla run, so drift cancels).

    python perf/ablate.py [--model qwen3-8b] [--batch 32] [--new 96] [--repeats 3]

Rows (compiled: static cache + reduce-overhead, store writes skipped as in perf/offline.py):

* ``null``: sites patched, nothing begun (the floor of the patched graph);
* ``no sites``: steps begun and ended (control block, end marker), no site selected;
* ``drain gated``: every capture runs, the drain thread is held off until generate returns
  (a ring large enough for the whole run), so copies to the host never overlap decoding;
* ``full``: everything, as in perf/offline.py's "hidden+logits -> host";
* ``copy at step`` (CUDA ring): each step's copy queued by the model's thread as the next begins,
  the drain's own copies paced (``DMI_COPY_AT_STEP``); then the same with the drain gated, and
  with a 0.1 ms GIL switch interval (a drain thread holding the GIL delays the model's thread by
  up to the interval each time the model thread's torch calls hand the GIL back).

Each row also reports CPU time per step of the model's thread (``time.thread_time``) and of dmi's
drain and export threads (their POSIX CPU clocks): wall time above the model thread's CPU time is time
it waited, for the GPU or for the GIL.

``--stores thread,process:none,process:lz4:4`` adds rows that write the Zarr store (default
policy, no copy at step), each from its own ``dmi.load``: ``WRITER[:COMPRESSION[:THREADS[:DTYPE]]]``
(DTYPE: ``store.dtype``, e.g. ``process:none::float32`` for bf16 widened as before).
``--only-stores`` skips the rows above (vanilla and the host row stay, for reference).

Also per step: host time in ``begin_step``/``end_step``, steps whose token bookkeeping read the
mask from the device (slow path), and GPU time of dmi's kernels (torch.profiler).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dmi            # noqa: E402
import dmi.run.steps  # noqa: E402
import pyspy         # noqa: E402
from gpuclock import CpuClock, Stopwatch   # noqa: E402
from offline import GiB, Skip, build, gen_kwargs, hidden_spec, prompts, store_dir, timed, twin   # noqa: E402


class HostClock(Stopwatch):
    """Wall time spent in the run's step begin (token bookkeeping, reservation, control block)
    and the ring's step end."""

    def __init__(self, run):
        super().__init__()
        self.run = run
        self.saved = run._begin, run.ring.end_step
        self.slow = 0
        self.saved_st = dmi.run.steps.step_tokens

    def __enter__(self):
        begin, end = self.saved

        def counting_step_tokens(*a, **k):
            self.slow += 1
            return self.saved_st(*a, **k)

        self.run._begin, self.run.ring.end_step = self.wrap(begin), self.wrap(end)
        dmi.run.steps.step_tokens = counting_step_tokens
        return self

    def __exit__(self, *exc):
        self.run._begin, self.run.ring.end_step = self.saved
        dmi.run.steps.step_tokens = self.saved_st


def host_text(hc: HostClock, steps: int) -> str:
    """Wall and CPU time per step in step begin/end: wall above CPU is time waited (mostly the GIL)."""
    return (f"host {hc.seconds / steps * 1e6:.0f} us/step in step begin/end "
            f"({hc.cpu_seconds / steps * 1e6:.0f} us of it CPU)")


def writer_cpu(run) -> float | None:
    """The writer process's CPU seconds (all its threads, from /proc); None without one."""
    proc = getattr(run.exporter, "_proc", None)
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (AttributeError, OSError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def writer_text(run, since: float | None, steps: int) -> str:
    now = writer_cpu(run)
    return "" if now is None or since is None else f"writer process CPU {(now - since) / steps * 1e6:.0f} us/step, "


def host_profile(fn, steps: int) -> dict:
    """cProfile of the calling thread over ``fn()``: {function: (own us/step, with callees us/step,
    calls/step)}."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.runcall(fn)
    out = {}
    for (file, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
        out[f"{name}  {where}"] = (own / steps * 1e6, cum / steps * 1e6, calls / steps)
    return out


def profile_diff(ours: dict, base: dict, top: int = 30) -> str:
    """The functions whose own time per step grew most from ``base`` (vanilla) to ``ours`` (dmi):
    what a CUDA-graph replay waits for, that vanilla does not do."""
    zero = (0.0, 0.0, 0.0)
    rows = sorted(set(ours) | set(base), key=lambda k: base.get(k, zero)[0] - ours.get(k, zero)[0])[:top]
    lines = ["host profile, model thread, us/step: own time dmi - vanilla (dmi own, dmi with callees, "
             "calls/step dmi / vanilla):"]
    for k in rows:
        o, b = ours.get(k, zero), base.get(k, zero)
        lines.append(f"  {o[0] - b[0]:+8.1f}  ({o[0]:8.1f} {o[1]:8.1f}  {o[2]:5.1f} / {b[2]:5.1f})  {k}")
    return "\n".join(lines)


def profiled(fn, steps: int) -> str:
    """GPU time of dmi's kernels and CUDA graph launches, per step (a partitioned graph launches
    several graphs per step, with host work between them)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    ka = p.key_averages()
    dmi_us = sum(e.device_time_total for e in ka if "capture_kernel" in e.key or "end_kernel" in e.key)
    graphs = sum(e.count for e in ka if e.key in ("cudaGraphLaunch", "cuGraphLaunch"))
    return f"dmi kernels {dmi_us / steps:.1f} us/step, graph launches {graphs / steps:.2f}/step"


def kernel_times(run, dgen, steps: int) -> None:
    """The GPU time of dmi's kernels per step, capturing and in null mode."""
    print(f"dmi hidden ({len(run.plan.sites)} sites): {profiled(dgen, steps)}", flush=True)
    run.set_enabled(False)
    print(f"dmi null: {profiled(dgen, steps)}", flush=True)
    run.set_enabled(True)


def sampled_against_vanilla(gen, fn, seconds: float, name: str) -> None:
    """py-spy on the model's thread running vanilla's ``gen``, then ``fn``, each ``seconds`` long:
    per-thread growth by function (perf/pyspy.py; raw files in $OUT or the temp directory)."""
    out = Path(os.environ.get("OUT", tempfile.gettempdir()))
    a, b = out / "pyspy-vanilla.txt", out / f"pyspy-{name}.txt"
    if pyspy.sample_while(gen, seconds, a) and pyspy.sample_while(fn, seconds, b):
        print(pyspy.compare(a, b), flush=True)
    else:
        print("py-spy: no profile (not found: carry its wheel in .whl, see perf/fetch_wheels.sh; or it failed, "
              "above)", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    ap.add_argument("--writer", default="thread", choices=["thread", "process"], help="store.writer of the Zarr row")
    ap.add_argument("--stores", default="", help="Zarr rows: WRITER[:COMPRESSION[:THREADS[:DTYPE]]],... (see the module doc)")
    ap.add_argument("--only-stores", action="store_true", help="skip the ablation rows (vanilla and host stay)")
    ap.add_argument("--pyspy", type=float, default=0, help="seconds: py-spy samples vanilla, then the host row, "
                    "each that long, and prints per-thread growth (perf/pyspy.py; files in $OUT or /tmp)")
    ap.add_argument("--pyspy-null", type=float, default=0, help="seconds: py-spy samples vanilla, then the null "
                    "row (patched, nothing begun), each that long: where the patched graph's floor goes")
    ap.add_argument("--profile", action="store_true", help="cProfile one run of the host row: dmi's functions, "
                    "per step, by own time")
    args = ap.parse_args(argv)
    model = build(args.model)
    enc, lengths = prompts(args.batch, 16, 192, model.config.vocab_size)
    kw = gen_kwargs(args.mode, args.new)
    dmodel = twin(model)              # dmi patches this instance; `model` stays vanilla

    def gen():
        model.generate(**enc, **kw)

    def dgen():
        dmodel.generate(**enc, **kw)

    def paired(fn, before=lambda: None, after=lambda: None, run=None):
        """Timed runs of fn, each right after a timed vanilla run (drift cancels in the ratio)."""
        times, vtimes = [], []
        with CpuClock(run, args.repeats * args.new) as cpu:
            for _ in range(args.repeats):
                vtimes.append(timed(gen))
                before()
                times.append(timed(fn))
                after()
        return times, vtimes, cpu.text     # (the model thread's CPU includes the vanilla runs)

    def report(label, runs, extra=""):
        times, vtimes, cpu = runs
        extra = f"{cpu}; {extra}"
        t = statistics.median(times)
        v = statistics.median(vtimes) if vtimes else t
        print(f"{label:34s} {t * 1e3 / args.new:7.3f} ms/step  ratio {v / t:.3f} (paired vanilla {v * 1e3 / args.new:.3f})"
              f"  runs {[round(x, 3) for x in times]} {extra}", flush=True)

    with torch.no_grad():
        gen(), gen()
        report("vanilla", paired(gen))   # (CpuClock without a run: the model thread only)
        if torch.cuda.is_available():
            print(f"vanilla: {profiled(gen, args.new)}", flush=True)
        sd = store_dir()
        run = dmi.load(dmodel, hook_spec=hidden_spec(8 * GiB, 8 * GiB, args.writer), store=sd / "a.zarr", overwrite=True)

        def flushed():
            dgen()
            run.flush()

        try:
            with Skip(run):
                if args.only_stores:
                    flushed(), flushed()
                    report("dmi hidden (full, -> host)", paired(flushed, run=run))
                    if args.pyspy:
                        sampled_against_vanilla(gen, flushed, args.pyspy, "dmi-host")
                    if args.profile:
                        base = host_profile(gen, args.new)
                        print(profile_diff(host_profile(flushed, args.new), base), flush=True)
                    if torch.cuda.is_available():
                        kernel_times(run, dgen, args.new)
                else:
                    run.set_enabled(False)
                    dgen(), dgen()
                    report("dmi null", paired(dgen, run=run))
                    if args.pyspy_null:
                        sampled_against_vanilla(gen, dgen, args.pyspy_null, "dmi-null")
                    run.set_enabled(True)

                    run._index_sites([])       # what a step selects from: no site
                    run.forget_layouts()       # (a layout laid out before selects every site)
                    flushed(), flushed()
                    report("dmi no sites (steps only)", paired(flushed, run=run))
                    run._index_sites(run.plan.sites)
                    run.forget_layouts()

                    ready = run.ring.drain_ready

                    def hold():
                        run.ring.drain_ready = lambda *a: []

                    def release():
                        run.ring.drain_ready = ready
                        run.flush()
                    flushed(), flushed()
                    report("dmi hidden, drain gated", paired(dgen, hold, release, run=run))
                    with HostClock(run) as hc:
                        runs = paired(flushed, run=run)
                    steps = args.repeats * args.new
                    st = run.stats()
                    report("dmi hidden (full)", runs,
                           f"{host_text(hc, steps)}, slow-path steps {hc.slow}/{steps}, "
                           f"stall {st['stall_seconds']:.3f}s")
                    if hasattr(run.ring, "copy_at_step"):
                        run.ring.copy_at_step = True
                        flushed()
                        with HostClock(run) as hc:
                            runs = paired(flushed, run=run)
                        report("dmi hidden, copy at step", runs, f"{host_text(hc, steps)}, "
                               f"{run.ring.steps_copied_at_step} steps copied at step")
                        report("dmi hidden, copy at step, gated", paired(dgen, hold, release, run=run))
                        interval = sys.getswitchinterval()
                        sys.setswitchinterval(1e-4)
                        try:
                            report("dmi hidden, copy at step, switch 0.1ms", paired(flushed, run=run))
                        finally:
                            sys.setswitchinterval(interval)
                        run.ring.copy_at_step = False
                    if torch.cuda.is_available():
                        kernel_times(run, dgen, args.new)
            if hasattr(run.ring, "copy_at_step") and not args.only_stores:      # the exporter writing the store, beside decoding
                run.ring.copy_at_step = True
                flushed()
                with HostClock(run) as hc:
                    runs = paired(flushed, run=run)
                report(f"dmi hidden -> zarr ({args.writer}), copy at step", runs, host_text(hc, args.repeats * args.new))
                run.ring.copy_at_step = False
        finally:
            run.close()
        for k, variant in enumerate(v for v in args.stores.split(",") if v):
            writer, compression, threads, dtype = (variant.split(":") + [None] * 3)[:4]
            store = ({"compression": compression or "lz4"} | ({"threads": int(threads)} if threads else {})
                     | ({"dtype": dtype} if dtype else {}))
            run = dmi.load(dmodel, hook_spec=hidden_spec(8 * GiB, 8 * GiB, writer, **store), store=sd / f"s{k}.zarr",
                           overwrite=True)
            try:
                flushed(), flushed()
                st0, c0 = run.stats(), writer_cpu(run)
                with HostClock(run) as hc:
                    runs = paired(flushed, run=run)
                st = run.stats()
                report(f"dmi hidden -> zarr ({variant})", runs,
                       f"{host_text(hc, args.repeats * args.new)}, {writer_text(run, c0, args.repeats * args.new)}stall {st['stall_seconds'] - st0['stall_seconds']:.3f}s, "
                       f"drops {st['dropped_bytes'] - st0['dropped_bytes']}")
            finally:
                run.close()


if __name__ == "__main__":
    main()
