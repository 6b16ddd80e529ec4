"""Does moving captured bytes slow the engine's host? In served steps with capture on, vLLM's own
host code between the pieces of a forward (attention's Python, inductor's wrappers) ran ~20 %
longer on the CPU than in vanilla, also in steps where dmi's threads did not run and dmi's code
was not on the stack (perf/RESULTS.md, nineteenth GPU session), while a server whose requests all
opted out (same patched graphs, nothing captured, nothing drained) did not. What dmi adds there is
traffic: device-to-host copies of the ring into pinned memory (up to the link's ~50 GB/s in
bursts), a thread waiting for them, GPU work on the same stream.

This times two host-bound workloads on the main thread while one interferer runs beside it:

* ``torch``: a loop of small torch ops on small CUDA tensors (the kind of Python + dispatcher +
  launch work vLLM's host does between pieces; the GPU is never the bottleneck),
* ``python``: pure Python (dicts, lists, attributes): the interpreter alone, no CUDA,

and the interferers, each for ``--phase-s`` seconds, taking turns over ``--rounds`` rounds:

* ``none``; ``d2h``: back-to-back device-to-host copies of ``--chunk-mib`` into pinned memory on
  a side stream, waited for with a spinning event (CUDA's default) or ``d2h-block`` a blocking one
  (how dmi's drain waits); ``d2h-paced``: the same at ``--paced-gbs``; ``d2d``: device-to-device
  copies (GPU and HBM busy, no PCIe); ``cpu-mem``: NumPy copies of ``--chunk-mib`` on the CPU (memory
  bandwidth, no GPU); ``gil``: a pure-Python thread (the GIL contended).

    python perf/hostslow.py [--phase-s 1.5] [--rounds 3] [--chunk-mib 256] [--paced-gbs 10]

Per variant: median µs per iteration of each workload (and its ratio to ``none``), the main thread's
CPU / wall in the torch loop (below 1: it waited, for the GIL or blocked in the kernel), and the
interferer's GB/s. If ``d2h`` slows ``python`` too, the cost is the CPU's (memory traffic, caches);
if only ``torch``, the CUDA driver's (launches contending with copies).
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
import torch

TORCH_OPS_PER_ITER = 24


def torch_iteration(t: dict) -> None:
    """~24 small torch ops, each a dispatch and most a kernel launch (attention's host code:
    views, expands, a few elementwise kernels, an index_select, a tiny matmul)."""
    a, b, idx, w, out = t["a"], t["b"], t["idx"], t["w"], t["out"]
    for _ in range(2):
        s = a.narrow(0, 0, 64).view(64, 4, 32)
        e = t["scale"].expand(64, 4)
        torch.add(a, b, out=out)
        out.mul_(1.0001)
        x = a.index_select(0, idx)
        y = x @ w
        y.add_(b.narrow(0, 0, 32))
        z = torch.where(y > 0, y, b.narrow(0, 0, 32))
        z.sum()
        s.permute(1, 0, 2).contiguous()
        e.float()
        out.copy_(a)


def python_iteration(state: dict) -> None:
    """Interpreter work only: the scheduler's and input preparation's kind of Python."""
    reqs = state["reqs"]
    acc = 0
    for r in reqs:
        r["tokens"].append(r["n"])
        r["n"] += 1
        if len(r["tokens"]) > 64:
            del r["tokens"][:32]
        acc += r["n"] + len(r["tokens"])
    blocks = {i: (i, i * 2) for i in range(64)}
    acc += sum(v[1] for k, v in blocks.items() if k % 3)
    state["acc"] = acc


class Interferer(threading.Thread):
    def __init__(self, kind: str, chunk: int, paced_gbs: float, stop: threading.Event):
        super().__init__(daemon=True, name=f"interferer-{kind}")
        self.kind, self.chunk, self.paced, self.stop = kind, chunk, paced_gbs, stop
        self.bytes = 0
        self.seconds = 0.0

    def run(self) -> None:
        t0 = time.perf_counter()
        kind = self.kind
        if kind == "gil":
            x = 0
            while not self.stop.is_set():
                for i in range(1000):
                    x += i
        elif kind == "cpu-mem":
            src = np.ones(self.chunk, np.uint8)
            dst = np.empty_like(src)
            while not self.stop.is_set():
                np.copyto(dst, src)          # releases the GIL
                self.bytes += self.chunk
        elif kind != "none":
            dev = torch.empty(self.chunk, dtype=torch.uint8, device="cuda")
            if kind == "d2d":
                dst = torch.empty_like(dev)
            else:
                dst = torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True)
            stream = torch.cuda.Stream()
            ev = torch.cuda.Event(blocking=kind != "d2h")
            every = self.chunk / (self.paced * 1e9) if kind == "d2h-paced" else 0.0
            nxt = time.perf_counter()
            while not self.stop.is_set():
                with torch.cuda.stream(stream):
                    dst.copy_(dev, non_blocking=True)
                ev.record(stream)
                ev.synchronize()
                self.bytes += self.chunk
                if every:
                    nxt += every
                    pause = nxt - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
        else:
            self.stop.wait()
        self.seconds = time.perf_counter() - t0


def phase(kind: str, args, tensors: dict, state: dict) -> dict:
    stop = threading.Event()
    inter = Interferer(kind, args.chunk_mib << 20, args.paced_gbs, stop)
    inter.start()
    time.sleep(0.05)                        # the interferer under way
    tt, tp, wall, cpu = [], [], 0.0, 0.0
    end = time.perf_counter() + args.phase_s
    while time.perf_counter() < end:
        for _ in range(20):
            w0, c0 = time.perf_counter(), time.thread_time()
            torch_iteration(tensors)
            w1, c1 = time.perf_counter(), time.thread_time()
            tt.append(w1 - w0)
            wall += w1 - w0
            cpu += c1 - c0
        torch.cuda.current_stream().synchronize()     # never ahead of the GPU by more than a batch
        for _ in range(20):
            w0 = time.perf_counter()
            python_iteration(state)
            tp.append(time.perf_counter() - w0)
    stop.set()
    inter.join()
    return {"torch": statistics.median(tt) * 1e6, "python": statistics.median(tp) * 1e6,
            "cpu_wall": cpu / wall if wall else float("nan"),
            "gbs": inter.bytes / inter.seconds / 1e9 if inter.seconds else 0.0}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase-s", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk-mib", type=int, default=256)
    ap.add_argument("--paced-gbs", type=float, default=10.0)
    ap.add_argument("--kinds", default="none,d2h,d2h-block,d2h-paced,d2d,cpu-mem,gil")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("perf/hostslow.py needs a CUDA device")
    dev = "cuda"
    tensors = {"a": torch.randn(256, 128, device=dev, dtype=torch.bfloat16),
               "b": torch.randn(256, 128, device=dev, dtype=torch.bfloat16),
               "idx": torch.arange(0, 256, 8, device=dev), "w": torch.randn(128, 128, device=dev, dtype=torch.bfloat16),
               "out": torch.empty(256, 128, device=dev, dtype=torch.bfloat16),
               "scale": torch.ones(1, 1, device=dev)}
    state = {"reqs": [{"tokens": [], "n": i} for i in range(64)]}
    kinds = args.kinds.split(",")
    for _ in range(200):                     # warm: kernels loaded, allocator primed
        torch_iteration(tensors)
        python_iteration(state)
    torch.cuda.synchronize()
    got = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:
            got[k].append(phase(k, args, tensors, state))
    med = {k: {m: statistics.median(r[m] for r in rows) for m in rows[0]} for k, rows in got.items()}
    base = med.get("none", med[kinds[0]])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; phases of {args.phase_s} s, "
          f"{args.rounds} rounds, chunk {args.chunk_mib} MiB; medians of the rounds' medians")
    print("| interferer | torch µs/iter | ratio | python µs/iter | ratio | torch loop CPU/wall | interferer GB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k, m in med.items():
        print(f"| {k} | {m['torch']:.1f} | {m['torch'] / base['torch']:.3f} | {m['python']:.2f} | "
              f"{m['python'] / base['python']:.3f} | {m['cpu_wall']:.3f} | {m['gbs']:.1f} |")


if __name__ == "__main__":
    main()
