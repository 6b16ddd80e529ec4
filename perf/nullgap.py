"""Why dmi's null mode costs what it costs in compiled generate: GPU work or host work.

    python perf/nullgap.py [--model qwen3-8b] [--batch 32] [--new 48] [--repeats 3]

Null mode (sites patched, nothing captured) ran at ~0.95 of vanilla on Qwen3-8B, batch 32,
compiled, while dmi's kernels took ~46 us of a ~14 ms step. This script splits that gap. Every
configuration runs on its own weight-sharing twin of the model (its own compiled graph), each
timed run right after a timed vanilla run:

* ``null``: dmi as shipped, capture off (the graph launches dmi's kernels, which exit at once);
* ``no kernels``: the site ops patched and compiled into the graph, but they launch nothing (the
  run is unregistered before the first compile): the graph's structure without dmi's kernels;
* ``no kernels, no host``: as above, and generate's compiled call is not wrapped (no step begin/end
  on the host): what is left is only the patched graph's structure.

Per configuration, from one profiled generate: wall ms per step, GPU busy ms per step (union of
kernel intervals), GPU kernels per step, host us per compiled call (dynamo guards + CUDA-graph
replay), and the kernels whose time per step differs most from vanilla.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dmi            # noqa: E402
import dmi.siteop     # noqa: E402
from gpuclock import Stopwatch, gpu_profile   # noqa: E402
from offline import GiB, Skip, build, gen_kwargs, hidden_spec, prompts, store_dir, timed, twin   # noqa: E402


class CallClock(Stopwatch):
    """Host time inside generate's compiled per-step call (no sync: launch cost only)."""

    def __init__(self, model):
        super().__init__()
        inner = model.get_compiled_call
        model.get_compiled_call = lambda *a, **k: self.wrap(inner(*a, **k))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    model = build(args.model)
    enc, _ = prompts(args.batch, 16, 192, model.config.vocab_size)
    kw = gen_kwargs("compiled", args.new)
    vclock = CallClock(model)

    def gen():
        model.generate(**enc, **kw)

    runs, sd = [], store_dir()

    def load(name: str, *, kernels: bool, host: bool):
        m = twin(model)
        run = dmi.load(m, hook_spec=hidden_spec(4 * GiB, 4 * GiB), store=sd / f"{name}.zarr", overwrite=True)
        run.set_enabled(False)
        if not kernels:
            dmi.siteop.unregister_run(run.id)      # the ops stay in the graph and do nothing
        if not host:
            del m.get_compiled_call                # the class's own: no step begin/end around the call
        runs.append(run)
        return m, CallClock(m)

    configs = [("null", dict(kernels=True, host=True)),
               ("no kernels", dict(kernels=False, host=True)),
               ("no kernels, no host", dict(kernels=False, host=False))]
    with torch.no_grad():
        gen(), gen()
        vprof = gpu_profile(gen, args.new)
        vclock.per_call_us()
        vt = [timed(gen) for _ in range(args.repeats)]
        v_us = vclock.per_call_us()
        print(f"{'vanilla':22s} {statistics.median(vt) * 1e3 / args.new:7.3f} ms/step (timed) | profiled: wall "
              f"{vprof['wall_ms']:.3f} busy {vprof['busy_ms']:.3f} ms/step, {vprof['kernels']:.0f} kernels/step, "
              f"host {v_us:.0f} us/call", flush=True)
        try:
            for name, opts in configs:
                m, clock = load(name, **opts)
                with Skip(runs[-1]):
                    def dgen():
                        m.generate(**enc, **kw)
                    dgen(), dgen()
                    prof = gpu_profile(dgen, args.new)
                    clock.per_call_us()
                    times, vtimes = [], []
                    for _ in range(args.repeats):
                        vtimes.append(timed(gen))
                        times.append(timed(dgen))
                    us = clock.per_call_us()
                t, v = statistics.median(times), statistics.median(vtimes)
                print(f"{name:22s} {t * 1e3 / args.new:7.3f} ms/step ratio {v / t:.3f} (paired vanilla "
                      f"{v * 1e3 / args.new:.3f}) | profiled: wall {prof['wall_ms']:.3f} busy {prof['busy_ms']:.3f} "
                      f"ms/step, {prof['kernels']:.0f} kernels/step, host {us:.0f} us/call", flush=True)
                delta = {k: prof["by_name"].get(k, 0.0) - vprof["by_name"].get(k, 0.0)
                         for k in set(prof["by_name"]) | set(vprof["by_name"])}
                for k, d in sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:8]:
                    print(f"    {d:+8.1f} us/step  {k}", flush=True)
        finally:
            for run in runs:
                run.close()


if __name__ == "__main__":
    main()
