"""Capture under a device-to-host bandwidth cap below the capture rate: ``best_effort`` must keep
the model at vanilla speed (dropping, and recording what it dropped), ``full`` must slow it down
smoothly (stalling, losing nothing). One process on the GPU, ratios against vanilla.

    python perf/budget.py [--model qwen3-8b] [--batch 32] [--new 128] [--caps 0.25,0.5,1.0]

``--caps`` are fractions of the uncapped run's measured capture rate (bytes per second of
generate). Store writes are skipped (as perf/offline.py's "-> host" rows): the cap is on the
copies to the host. One run, one compiled graph: the policy changes between configurations with
``Run.set_limits`` (no reload, no recompile). Every timed run follows a timed vanilla run of the
unpatched twin (ratio = median vanilla / median configuration); each configuration is also
profiled once for its GPU busy time per step (GPU ratio), which the host-bound wall time of
compiled generate does not show reliably (perf/RESULTS.md).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dmi      # noqa: E402
from gpuclock import gpu_profile   # noqa: E402
from offline import DEV, GiB, Skip, build, gen_kwargs, hidden_spec, prompts, store_dir, timed, twin   # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--caps", default="0.25,0.5,1.0")
    ap.add_argument("--copy-at-step", action="store_true", help="the CUDA ring copies each step out as the next "
                    "begins (DMI_COPY_AT_STEP=1)")
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
        run = dmi.load(dmodel, hook_spec=spec, store=sd / "budget.zarr", overwrite=True)
        if hasattr(run.ring, "copy_at_step"):
            run.ring.copy_at_step = args.copy_at_step
        print("| policy | cap GB/s | ratio | GPU ratio | compute ratio | s (median) | stall s/run | captured GB/run "
              "| dropped GB/run | drop fraction |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        configs = [("null", None), ("full", None)] + [(m, c) for c in map(float, args.caps.split(","))
                                                      for m in ("best_effort", "full")]
        rate = None
        try:
            with Skip(run):
                def go():
                    dmodel.generate(**enc, **kw)
                    run.flush()
                for mode, cap in configs:
                    run.set_enabled(mode != "null")
                    if mode != "null":
                        run.set_limits(mode=mode, d2h_bytes_per_s=None if cap is None else int(cap * rate))
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


if __name__ == "__main__":
    main()
