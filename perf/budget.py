"""Capture under a device-to-host bandwidth cap below the capture rate: ``best_effort`` must keep
the model at vanilla speed (dropping, and recording what it dropped), ``full`` must slow it down
smoothly (stalling, losing nothing). One process on the GPU, ratios against vanilla.

    python perf/budget.py [--model qwen3-8b] [--batch 32] [--new 128] [--caps 0.25,0.5,1.0]

``--caps`` are fractions of the uncapped run's measured capture rate (bytes per second of
generate). Store writes are skipped (as perf/offline.py's "-> host" rows): the cap is on the
copies to the host.
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
from offline import GiB, Skip, build, gen_kwargs, hidden_spec, prompts, store_dir, timed, twin   # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--caps", default="0.25,0.5,1.0")
    args = ap.parse_args(argv)
    model = build(args.model)
    dmodel = twin(model)          # dmi patches this instance; `model` stays vanilla
    enc, _ = prompts(args.batch, 16, 192, model.config.vocab_size)
    kw = gen_kwargs(args.mode, args.new)

    def gen():
        model.generate(**enc, **kw)

    def dgen():
        dmodel.generate(**enc, **kw)

    with torch.no_grad():
        gen(), gen()
        vanilla = statistics.median(timed(gen) for _ in range(args.repeats))
        print(f"vanilla: {vanilla:.3f} s ({args.batch * args.new / vanilla:.0f} tok/s)", flush=True)
        sd = store_dir()
        rate = None
        print("| policy | cap GB/s | ratio | s (median) | stall s/run | captured GB/run | dropped GB/run | drop fraction |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        configs = [("full", None)] + [(m, c) for c in map(float, args.caps.split(",")) for m in ("best_effort", "full")]
        for mode, cap in configs:
            spec = hidden_spec(2 * GiB, 4 * GiB)
            spec["policy"]["mode"] = mode
            if cap is not None:
                spec["policy"]["d2h_bytes_per_s"] = int(cap * rate)
            run = dmi.load(dmodel, hook_spec=spec, store=sd / f"{mode}-{cap}.zarr", overwrite=True)
            try:
                with Skip(run):
                    def go():
                        dgen()
                        run.flush()
                    go(), go()
                    before = run.stats()
                    t = statistics.median(timed(go) for _ in range(args.repeats))
                    after = run.stats()
            finally:
                run.close()
            n = args.repeats
            got = (after["bytes_drained"] - before["bytes_drained"]) / n
            dropped = (after["dropped_bytes"] - before["dropped_bytes"]) / n
            stall = (after["stall_seconds"] - before["stall_seconds"]) / n
            if rate is None:
                rate = got / t          # the uncapped capture rate the caps are fractions of
            label = "uncapped" if cap is None else f"{cap:.2f} x rate"
            print(f"| {mode} ({label}) | {'' if cap is None else f'{cap * rate / 1e9:.2f}'} | {vanilla / t:.3f} | {t:.3f} | "
                  f"{stall:.3f} | {got / 1e9:.2f} | {dropped / 1e9:.2f} | {dropped / max(got + dropped, 1):.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
