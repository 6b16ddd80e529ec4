"""What one capture costs inside a CUDA graph: dmi's capture kernel launched for N sites, replayed
as one graph, against the same graph with one site (no model, no ring bookkeeping).

    python perf/sitecost.py [--sites 37] [--rows 1,16,64] [--features 4096] [--replays 200]

Per row count (a decode batch copies that many rows of ``features`` bf16 per site), µs per site
(graph replay time of N sites less that of 1, over N - 1; median of 5 timings of ``--replays``
replays each) for:

* ``host meta``: the record goes to the meta ring in mapped pinned host memory, an ordinary launch
  (as shipped before programmatic dependent launch; ``DMI_PDL=0``);
* ``device meta``: the record goes to device memory instead (what publishing records from the end
  kernel alone would leave each capture);
* ``disarmed``: the step is not armed (null mode): the kernel reads its flags and exits;
* ``memcpy node``: a plain device-to-device copy of the same rows per site (the floor for a
  graph node that moves the bytes);
* ``PDL``, ``disarmed PDL``: the capture launched as a programmatic dependent of the kernel before
  it (the default on Hopper and later: its launch and control-word read overlap that kernel's end);
* ``sum in kernel``: a site held as two tensors (vLLM's residual stream), the kernel copying the
  rows of their sum (``dmi::capture_sum``), against ``add, then capture``: the sum made by an
  elementwise op first (what a compiled graph ran before; the engine's own graph fuses that add
  into its next norm, so the whole add is dmi's cost there).

``--evict-mb M`` puts before each site what a model layer does there: a kernel reading M MiB of
its own (that layer's weights streaming through L2 and the TLBs: a Qwen3-8B layer is ~420 MiB)
and one rewriting the site's rows (the layer's last op), so each capture finds its control words
and ring slot cold, as in serving; µs per site is then the graph with captures less the same graph
without them, over N. (Serving's forward grew by 2.5-4.9 µs a site, not the 1.8-2.2 measured back
to back; cold, an ordinary launch took 2.4-3.3 µs and a programmatic dependent 1.6-1.8: H200,
perf/RESULTS.md, fifteenth GPU session.) ~37 x M MiB of GPU memory; each
replay streams all of it, so take fewer replays (``--evict-mb 400 --replays 40``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dmi.kernels import capture as K   # noqa: E402
from dmi.kernels.cudart import DevicePointer   # noqa: E402


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn()``, replayed once (Triton compiles and loads outside the capture)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    return g


def graph_time_us(fn, replays: int) -> float:
    """Median µs per replay of a CUDA graph of ``fn()``."""
    g = graph_of(fn)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / replays)
    return statistics.median(times)


def site_blocks(n_sites: int, rows: int, row_bytes: int, dev) -> tuple:
    """(payload ring, control words armed, the same disarmed, block bytes): a block of the ring for
    each site, every site copying ``rows`` rows of ``row_bytes`` into its own, as one step."""
    block = (rows * row_bytes + 255) // 256 * 256
    ring = torch.zeros(block * n_sites, dtype=torch.uint8, device=dev)
    ctrl = torch.zeros(K.G_WORDS + K.S_WORDS * n_sites, dtype=torch.int64)
    ctrl[K.G_ARMED], ctrl[K.G_STEP], ctrl[K.G_SEQ] = 1, 1, rows
    for i in range(n_sites):
        h = K.G_WORDS + K.S_WORDS * i
        ctrl[h + K.S_OFFSET], ctrl[h + K.S_SEQ], ctrl[h + K.S_ROWS] = i * block, i, rows
        ctrl[h + K.S_ENABLED] = K.ENABLED_ARANGE
    armed = ctrl.to(dev)
    disarmed = armed.clone()
    disarmed[K.G_ARMED] = 0
    return ring, armed, disarmed, block


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=37)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--features", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--evict-mb", type=int, default=0, help="MiB read before each site (0: sites back to back)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    F, n_sites, meta_records = args.features, args.sites, 4096
    row_bytes = F * 2
    # --evict-mb: each site's "layer" reads its own buffer, as each layer reads its own weights
    evict = [torch.ones(args.evict_mb << 19, dtype=torch.bfloat16, device=dev) for _ in range(n_sites)] \
        if args.evict_mb else None
    evict_sum = torch.zeros((), dtype=torch.float32, device=dev)
    has_pdl = K.pdl_possible(torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name()}; {n_sites} sites, {F} bf16 features a row; µs per site in a graph"
          + (f", each after a read of its own {args.evict_mb} MiB and a rewrite of its rows" if evict else "") + "\n")
    print("| rows | host meta | device meta | disarmed | memcpy node | PDL | disarmed PDL | sum in kernel | add, then capture |\n"
          "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows in [int(r) for r in args.rows.split(",")]:
        src = torch.randn(rows, F, dtype=torch.bfloat16, device=dev)
        other = torch.randn(rows, F, dtype=torch.bfloat16, device=dev)
        ring, armed, disarmed, block = site_blocks(n_sites, rows, row_bytes, dev)
        host_meta = torch.zeros(meta_records * 7, dtype=torch.int64, pin_memory=True)
        dev_meta = torch.zeros(meta_records * 7, dtype=torch.int64, device=dev)
        metas = {"host": DevicePointer(host_meta.data_ptr(), torch.int64), "device": dev_meta}

        def layer(i):                      # --evict-mb: the model's work before site i
            torch.sum(evict[i], dim=0, dtype=torch.float32, out=evict_sum)
            src.mul_(1)

        def captures(n, ctrl_t, meta, how=None, pdl=False):
            def fn():
                for i in range(n):
                    if evict:
                        layer(i)
                    x = src + other if how == "add" else src
                    K.launch(x, ring, ctrl_t, meta, site_index=i, meta_records=meta_records, K=rows, src_seq=rows,
                             geometry=(rows * F, F, F, F, 0, 1), mode=K.DIRECT, row_bytes0=row_bytes, seq_arg=rows,
                             addend=other if how == "sum" else None, pdl=pdl)
            return fn

        def copies(n):
            def fn():
                for i in range(n):
                    if evict:
                        layer(i)
                    ring.narrow(0, i * block, rows * row_bytes).copy_(src.view(-1).view(torch.uint8))
            return fn

        def layers_only():
            for i in range(n_sites):
                layer(i)

        layers_us = graph_time_us(layers_only, args.replays) if evict else 0.0

        def per_site(make):
            if evict:                          # the same layers with and without the captures
                return (graph_time_us(make(n_sites), args.replays) - layers_us) / n_sites
            return (graph_time_us(make(n_sites), args.replays) - graph_time_us(make(1), args.replays)) / (n_sites - 1)

        host = per_site(lambda n: captures(n, armed, metas["host"]))
        got = torch.from_numpy(host_meta.numpy()[: n_sites * 7].reshape(n_sites, 7).copy())
        assert (got[:, 0] == torch.arange(n_sites)).all() and (got[:, 4] == rows * row_bytes).all(), got[:3]
        assert torch.equal(ring[: rows * row_bytes], src.view(-1).view(torch.uint8)), "capture copied wrong bytes"
        device = per_site(lambda n: captures(n, armed, metas["device"]))
        null = per_site(lambda n: captures(n, disarmed, metas["host"]))
        copy = per_site(copies)
        ring.zero_()
        pdl = per_site(lambda n: captures(n, armed, metas["host"], pdl=True)) if has_pdl else float("nan")
        assert not has_pdl or torch.equal(ring[: rows * row_bytes], src.view(-1).view(torch.uint8)), "PDL copied wrong"
        null_pdl = per_site(lambda n: captures(n, disarmed, metas["host"], pdl=True)) if has_pdl else float("nan")
        summed = per_site(lambda n: captures(n, armed, metas["host"], "sum"))
        assert torch.equal(ring[: rows * row_bytes], (src + other).view(-1).view(torch.uint8)), "sum copied wrong"
        added = per_site(lambda n: captures(n, armed, metas["host"], "add"))
        print(f"| {rows} | {host:.2f} | {device:.2f} | {null:.2f} | {copy:.2f} | {pdl:.2f} | {null_pdl:.2f} | {summed:.2f} "
              f"| {added:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
