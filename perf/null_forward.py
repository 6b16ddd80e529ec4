"""What a patched HF model costs per eager forward when it captures nothing (null mode): the floor
of every dmi row of perf/offline.py's eager mode, measured without a GPU.

    python perf/null_forward.py [--layers 36] [--batch 4] [--rounds 60] [--full]

A Qwen3 of tiny widths (``--layers`` layers: the cost follows the number of sites, not their
size) and two twins sharing its weights: one carries dmi (perf/offline.py's hidden+logits spec,
``resid_post`` of every layer, ``final_norm``, last-token ``logits``; store writes skipped), the
other is unpatched (A/A: what alternating two instances costs). Each round times 20 decode-shaped
forwards ([batch, 1] tokens) of vanilla, then the dmi twin, then the A/A twin; the medians of the
per-round differences are printed in µs a forward. ``--full``: also with the run enabled (the CPU
ring's copies: not the GPU's cost). Pinned to one CPU thread, so that the host work is not hidden
by parallel kernels.
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

import dmi      # noqa: E402
from offline import MODELS, Skip, build, hidden_spec, store_dir, twin   # noqa: E402


def per_forward_us(model, ids, n: int = 20) -> float:
    t = time.perf_counter()
    for _ in range(n):
        model(input_ids=ids)
    return (time.perf_counter() - t) / n * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--full", action="store_true", help="also time the enabled run")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    name = f"tiny-{args.layers}"
    MODELS[name] = (MODELS["tiny"][0], dict(MODELS["tiny"][1], num_hidden_layers=args.layers))
    model = build(name)
    dmodel, aa = twin(model), twin(model)
    run = dmi.load(dmodel, hook_spec=hidden_spec(256 << 20, 512 << 20), store=store_dir() / "null_forward.zarr",
                   overwrite=True)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, 1))
    try:
        with torch.no_grad(), Skip(run):
            vanilla = per_forward_us(model, ids)
            print(f"{name}, batch {args.batch}, {len(run.plan.sites)} sites, {args.rounds} rounds; "
                  f"vanilla {vanilla:.0f} µs a forward")
            print("| run | dmi - vanilla (µs a forward) | A/A twin - vanilla |")
            print("| --- | ---: | ---: |")
            for mode in ("null", "full") if args.full else ("null",):
                run.set_enabled(mode == "full")
                extra, same = [], []
                for _ in range(args.rounds):
                    v = per_forward_us(model, ids)
                    extra.append(per_forward_us(dmodel, ids) - v)
                    same.append(per_forward_us(aa, ids) - v)
                    run.flush()
                print(f"| {mode} | {statistics.median(extra):+.0f} | {statistics.median(same):+.0f} |")
    finally:
        run.close()


if __name__ == "__main__":
    main()
