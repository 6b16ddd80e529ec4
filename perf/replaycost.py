"""What dmi's capture kernels cost the *host* of a piecewise forward: vLLM replays a mixed step
(a prefill chunk in the batch) as one CUDA graph per piece between two attention calls, ~37 of
them for Qwen3-8B, each launched from Python. Served, such a step's launch took ~1 ms longer in a
dmi server that captured nothing (every request opted out) than in vanilla's (perf/RESULTS.md,
seventeenth GPU session), while a decode step (one graph) took 0.02-0.04 ms longer: is that
what a graph with capture nodes costs to launch?

    python perf/replaycost.py [--pieces 37] [--ops 12] [--rows 72] [--features 4096] [--rounds 200]

Each piece is a graph of ``--ops`` small elementwise kernels on ``rows x features`` bf16 (a
layer's non-attention work, shrunk so the host, not the GPU, is the bottleneck), with or without
one capture kernel in the middle: an ordinary launch, a programmatic dependent (PDL, the default on
Hopper) and each of those disarmed (the kernel reads its flag and exits: a request that opted
out). Per variant: host µs per piece replay (each ``g.replay()`` call timed alone, rounds of all pieces
from an idle GPU: what the host spends launching, never a wait for a full queue), median over
``--rounds`` rounds, the variants taking turns round by round; and the GPU µs per round (a
forward's pieces, without the attention between).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dmi.kernels import capture as K   # noqa: E402
from dmi.kernels.cudart import DevicePointer   # noqa: E402
from sitecost import graph_of, site_blocks   # noqa: E402


def timed(variants: dict, rounds: int) -> dict:
    """Per variant (name -> its graphs): (host µs per replay call, GPU µs per round). The variants
    take turns round by round (drift of the host's clocks falls on all alike); each round starts
    from an idle GPU and each call is timed alone, so a queue the GPU has not drained never blocks
    the host (the engine's host, launching a piecewise step, is ahead of nothing: the GPU waits)."""
    host = {name: [] for name in variants}
    gpu = {name: [] for name in variants}
    for _ in range(rounds):
        for name, graphs in variants.items():
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            spent = 0.0
            for g in graphs:
                t = time.perf_counter()
                g.replay()
                spent += time.perf_counter() - t
            b.record()
            host[name].append(spent * 1e6 / len(graphs))
            b.synchronize()
            gpu[name].append(a.elapsed_time(b) * 1e3)
    return {name: (statistics.median(host[name]), statistics.median(gpu[name])) for name in variants}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pieces", type=int, default=37)
    ap.add_argument("--ops", type=int, default=12)
    ap.add_argument("--rows", type=int, default=72)
    ap.add_argument("--features", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows, F, meta_records = args.rows, args.features, 4096
    row_bytes = F * 2
    xs = [torch.randn(rows, F, dtype=torch.bfloat16, device=dev) for _ in range(args.pieces)]
    ring, armed, disarmed, _ = site_blocks(args.pieces, rows, row_bytes, dev)
    host_meta = torch.zeros(meta_records * 7, dtype=torch.int64, pin_memory=True)
    meta = DevicePointer(host_meta.data_ptr(), torch.int64)
    has_pdl = K.pdl_possible(torch.cuda.current_device())

    def piece(i: int, capture: str | None):
        x = xs[i]

        def fn():
            for k in range(args.ops):
                x.mul_(1.0)
                if capture and k == args.ops // 2:
                    K.launch(x, ring, disarmed if "disarmed" in capture else armed, meta, site_index=i,
                             meta_records=meta_records, K=rows, src_seq=rows, geometry=(rows * F, F, F, F, 0, 1),
                             mode=K.DIRECT, row_bytes0=row_bytes, seq_arg=rows, pdl="PDL" in capture)
        return graph_of(fn)

    names = ["no capture", "capture", "disarmed"] + (["capture PDL", "disarmed PDL"] if has_pdl else [])
    variants = {v: [piece(i, None if v == "no capture" else v) for i in range(args.pieces)] for v in names}
    got = host_meta.numpy()[: args.pieces * 7].reshape(args.pieces, 7)
    assert (got[:, 0] == range(args.pieces)).all(), "the captures did not publish their records"
    print(f"{torch.cuda.get_device_name()}; {args.pieces} pieces of {args.ops} elementwise kernels on {rows} x {F} bf16\n")
    print("| pieces hold | host µs a replay | host ms a forward | vs none | GPU µs a forward |\n| --- | ---: | ---: | ---: | ---: |")
    times = timed(variants, args.rounds)
    base = times["no capture"][0]
    for v, (host, gpu) in times.items():
        print(f"| {v} | {host:.2f} | {host * args.pieces / 1e3:.3f} | {host - base:+.2f} | {gpu:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
