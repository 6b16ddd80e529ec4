"""Capture under a device-to-host bandwidth cap below the capture rate: ``best_effort`` must keep
the model at vanilla speed (dropping, and recording what it dropped), ``full`` must slow it down
smoothly (stalling, losing nothing). One process on the GPU, ratios against vanilla.

    python perf/budget.py [--model qwen3-8b] [--batch 32] [--new 128] [--caps 0.25,0.5,1.0] [--rounds N]

``--caps`` are fractions of the uncapped run's measured capture rate (bytes per second of
generate). Store writes are skipped (as perf/offline.py's "-> host" rows): the cap is on the
copies to the host. One run, one compiled graph: the policy changes between configurations with
``Run.set_limits`` (no reload, no recompile). Every timed run follows a timed vanilla run of the
unpatched twin (ratio = median vanilla / median configuration); each configuration is also
profiled once for its GPU busy time per step (GPU ratio), which the host-bound wall time of
compiled generate does not show reliably.

``--rounds N``: the configurations and an unpatched twin of the model (A/A) take turns instead,
N rounds, the order rotating each round, every run right after a vanilla run, as perf/offline.py's
``--rounds``: each row meets the same alternation of compiled models and the same drift of the
host, and is also given over the A/A row's median pair (what alternating two models costs the
harness without dmi). The caps are fractions of the capture rate of the last uncapped warm-up run.

``--inline`` (with ``--rounds``): a second dmi run on another twin, loaded with ``engine.side: off``,
adds its null, uncapped ``full`` and first-cap ``best_effort`` rows to the rotation: the capture
kernels on the model's stream in the recorded graph, against the default run's side stream
(dmi.kernels.side; transformers' compiled forward is one full graph). ``--pyspy SECONDS`` (with
``--rounds``): py-spy on the model's thread, vanilla against the first cap's ``best_effort`` row
(perf/common/pyspy.py). With ``--rounds`` on a GPU each row also gives
the host time of Dynamo's cache lookup (guard evaluation) per step in its profiled run: the A/A
twin's in its row (profiled with the dmi runs and their threads open, as theirs are; vanilla's,
profiled before any run was loaded, beside it), each dmi row's over the A/A twin's.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's dmi

import dmi      # noqa: E402
from common import (DEV, GiB, Skip, build, gen_kwargs, gpu_profile, hidden_spec, md_header, prompts, spread,   # noqa: E402
                    rotated, store_dir, timed, twin)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--caps", default="0.25,0.5,1.0")
    ap.add_argument("--rounds", type=int, default=0, help="round-robin with an A/A twin row, this many rounds")
    ap.add_argument("--copy-at-step", action="store_true", help="the CUDA ring copies each step out as the next "
                    "begins (engine.copy_at_step: true)")
    ap.add_argument("--inline", action="store_true", help="with --rounds: rows of a second run with engine.side: off")
    ap.add_argument("--pyspy", type=float, default=0, help="with --rounds: seconds of py-spy, vanilla against the "
                    "first cap's best_effort row")
    args = ap.parse_args(argv)
    model = build(args.model)
    dmodel = twin(model)          # dmi patches this instance; `model` stays vanilla
    enc, _ = prompts(args.batch, 16, 192, model.config.vocab_size)
    kw = gen_kwargs(args.mode, args.new)
    profile = DEV == "cuda"

    def gen():
        model.generate(**enc, **kw)

    with torch.no_grad():
        gen(), gen()
        v_prof = gpu_profile(gen, args.new) if profile else None
        print(f"vanilla: {statistics.median(timed(gen) for _ in range(args.repeats)):.3f} s"
              + (f", GPU {v_prof['busy_ms']:.2f} ms/step" if profile else ""), flush=True)
        sd = store_dir()
        spec = hidden_spec(2 * GiB, 4 * GiB)
        run = dmi.load(dmodel, hook_spec=spec | {"engine": {"copy_at_step": args.copy_at_step}},
                       store=sd / "budget.zarr", overwrite=True)
        configs = [("null", None), ("full", None)] + [(m, c) for c in map(float, args.caps.split(","))
                                                      for m in ("best_effort", "full")]

        def go():
            dmodel.generate(**enc, **kw)
            run.flush()
        if args.rounds:
            runs = [(run, go, "", configs)]
            if args.inline:
                inline = twin(model)
                irun = dmi.load(inline, hook_spec=spec | {"engine": {"side": "off"}}, store=sd / "budget-inline.zarr",
                                overwrite=True)

                def igo():
                    inline.generate(**enc, **kw)
                    irun.flush()
                runs.append((irun, igo, ", inline", configs[:3]))
            try:
                _rounds(model, runs, gen, enc, kw, args, v_prof)
            finally:
                for r, *_ in runs:
                    r.close()
            return
        print(md_header(["policy", "cap GB/s", "ratio", "GPU ratio", "compute ratio", "s (median)", "stall s/run",
                         "captured GB/run", "dropped GB/run", "drop fraction"]))
        rate = None
        try:
            with Skip(run):
                for mode, cap in configs:
                    set_policy(run, mode, cap, rate)
                    go(), go()            # the first compiles and records the graph; then warm
                    before = run.stats()
                    times, vtimes = [], []
                    for _ in range(args.repeats):
                        vtimes.append(timed(gen))
                        times.append(timed(go))
                    after = run.stats()
                    prof = gpu_profile(go, args.new) if profile else None
                    t, v, n = statistics.median(times), statistics.median(vtimes), args.repeats
                    got = (after["bytes_drained"] - before["bytes_drained"]) / n
                    dropped = (after["dropped_bytes"] - before["dropped_bytes"]) / n
                    stall = (after["stall_seconds"] - before["stall_seconds"]) / n
                    if rate is None and mode == "full":
                        rate = got / t          # the uncapped capture rate the caps are fractions of
                    label = "uncapped" if cap is None else f"{cap:.2f} x rate"
                    gpu = (f"{v_prof['busy_ms'] / prof['busy_ms']:.3f} | {v_prof['compute_ms'] / prof['compute_ms']:.3f}"
                           if profile else " | ")
                    print(f"| {mode} ({label}) | {'' if cap is None else f'{cap * rate / 1e9:.2f}'} | {v / t:.3f} | {gpu} | "
                          f"{t:.3f} | {stall:.3f} | {got / 1e9:.2f} | {dropped / 1e9:.2f} | "
                          f"{dropped / max(got + dropped, 1):.3f} |", flush=True)
        finally:
            run.close()


def set_policy(run, mode: str, cap: float | None, rate: float | None) -> None:
    """A configuration on the live run: null mode, or ``mode`` capped at ``cap`` x ``rate`` bytes/s."""
    run.set_enabled(mode != "null")
    if mode != "null":
        run.set_limits(mode=mode, d2h_bytes_per_s=None if cap is None else int(cap * rate))


def _rounds(model, runs, vanilla, enc, kw, args, v_prof) -> None:
    """``--rounds N``: the A/A twin and every run's (mode, cap) configurations round-robin (module
    doc); ``runs``: (dmi run, its generate, label suffix, configurations); ``vanilla`` runs the
    unpatched model."""
    aa = twin(model)
    profile = v_prof is not None
    with contextlib.ExitStack() as skips:
        for r, *_ in runs:
            skips.enter_context(Skip(r))
        aa.generate(**enc, **kw), aa.generate(**enc, **kw)       # compiles the twin
        for r, go, *_ in runs:
            set_policy(r, "full", None, None)
            go()                                                 # compiles dmi's graph
        run, go = runs[0][:2]
        before = run.stats()
        t = timed(go)
        rate = (run.stats()["bytes_drained"] - before["bytes_drained"]) / t
        rows = [("vanilla twin (A/A)", None, lambda: aa.generate(**enc, **kw), None, None)]
        for r, g, suffix, configs in runs:
            rows += [(f"{m} ({'uncapped' if c is None else f'{c:.2f} x rate'}){suffix}", r, g, m, c) for m, c in configs]
        pairs = {label: [] for label, *_ in rows}
        sums = {label: dict.fromkeys(("bytes_drained", "dropped_bytes", "stall_seconds"), 0.0) for label, *_ in rows}
        times = {label: [] for label, *_ in rows}
        for i in range(args.rounds):
            for label, r, fn, mode, cap in rotated(rows, i):
                if r is not None:
                    set_policy(r, mode, cap, rate)
                v = timed(vanilla)
                before = (r or run).stats()
                t = timed(fn)
                after = (r or run).stats()
                pairs[label].append(v / t)
                times[label].append(t)
                for key in sums[label]:
                    sums[label][key] += after[key] - before[key]
        if args.pyspy:
            from common.pyspy import sampled_against_vanilla
            label, r, fn, mode, cap = next(row for row in rows if row[3] == "best_effort")
            set_policy(r, mode, cap, rate)
            print(f"py-spy: vanilla against {label}", flush=True)
            sampled_against_vanilla(vanilla, fn, args.pyspy, "budget-best-effort")
    aa_pair = statistics.median(pairs[rows[0][0]])
    print(f"uncapped capture rate {rate / 1e9:.2f} GB/s; {args.rounds} rounds, each run after a vanilla run; "
          f"the A/A row's median pair {aa_pair:.3f}")
    print(md_header(["policy", "cap GB/s", "pairs (low / median / high)", "over A/A", "GPU ratio", "compute ratio",
                     "cache lookup µs/step", "s (median)", "stall s/run", "captured GB/run", "dropped GB/run",
                     "drop fraction"]))
    n = args.rounds
    aa_lookup = None     # the A/A twin's, profiled while the runs (and their threads) are open, as theirs are
    for label, r, fn, mode, cap in rows:
        p = sorted(pairs[label])
        gpu = " |  | "
        if profile and r is not None:
            set_policy(r, mode, cap, rate)
            with Skip(r):
                prof = gpu_profile(fn, args.new)
            gpu = (f"{v_prof['busy_ms'] / prof['busy_ms']:.3f} | {v_prof['compute_ms'] / prof['compute_ms']:.3f} | "
                   f"{prof['lookup_us'] - aa_lookup:+.0f}")
        elif profile:
            aa_lookup = gpu_profile(fn, args.new)["lookup_us"]
            gpu = f" |  | {aa_lookup:.0f} (vanilla before load: {v_prof['lookup_us']:.0f})"
        got, dropped, stall = (sums[label][k] / n for k in ("bytes_drained", "dropped_bytes", "stall_seconds"))
        over = "" if r is None else f"**{statistics.median(p) / aa_pair:.3f}**"
        print(f"| {label} | {'' if cap is None else f'{cap * rate / 1e9:.2f}'} | {spread(p)} | {over} | {gpu} | {statistics.median(times[label]):.3f} | {stall:.3f} | {got / 1e9:.2f} | "
              f"{dropped / 1e9:.2f} | {dropped / max(got + dropped, 1):.3f} |", flush=True)


if __name__ == "__main__":
    main()
