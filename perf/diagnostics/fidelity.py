"""Question: does dmi's compiled decode compute what vanilla's compiled decode computes?

The first decode steps' logits (same prompts, same prefill token) of the unpatched model against an
unpatched twin (A/A) and against the dmi twin in several configurations, transformers' compiled
generate (reduce-overhead). perf/RESULTS.md's "Open" section gives the figure.

    python perf/diagnostics/fidelity.py [--model qwen3-0.6b] [--batch 32] [--emulate]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's dmi
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # perf/: common

import dmi   # noqa: E402
from common import HEADLINE_SPEC, build, gen_kwargs, prompts, twin   # noqa: E402


def decode_logits(model, enc, kw) -> torch.Tensor:
    out = model.generate(**enc, **kw, output_logits=True, return_dict_in_generate=True)
    return torch.stack([x.float() for x in out.logits[:3]]), out.sequences


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--emulate", action="store_true", help="inductor's emulate_precision_casts on for every model")
    args = ap.parse_args(argv)
    if args.emulate:
        torch._inductor.config.emulate_precision_casts = True
    torch._dynamo.config.cache_size_limit = 64
    model = build(args.model)
    enc, _ = prompts(args.batch, 16, 192, model.config.vocab_size)
    kw = gen_kwargs("compiled", 4)
    tmp = Path(tempfile.mkdtemp())
    with torch.no_grad():
        ref, ref_seq = decode_logits(model, enc, kw)
        ref, ref_seq = decode_logits(model, enc, kw)          # (after its compile's warm-up runs)
        rows = {}
        aa = twin(model)
        decode_logits(aa, enc, kw)
        rows["A/A twin"] = decode_logits(aa, enc, kw)
        del aa
        configs = {"dmi null": ({}, False), "dmi capture (op)": ({}, True),
                   "dmi capture, engine.traced: all": ({"traced": "all"}, True)}
        for name, (engine, on) in configs.items():
            t = twin(model)
            with dmi.load(t, hook_spec=HEADLINE_SPEC | {"engine": engine}, store=tmp / f"{len(rows)}.zarr") as run:
                run.set_enabled(on)
                decode_logits(t, enc, kw)
                rows[name] = decode_logits(t, enc, kw)
            del t
    print(f"{args.model} batch {args.batch}, emulate_precision_casts={args.emulate}")
    print("| against vanilla | prefill logits max diff | decode 1 max diff | decode 2 max diff | tokens equal (4 new) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (lg, seq) in rows.items():
        d = (lg - ref).abs().amax(dim=(1, 2)).tolist()
        same = int((seq == ref_seq).all(dim=1).sum())
        print(f"| {name} | {d[0]:.4g} | {d[1]:.4g} | {d[2]:.4g} | {same}/{args.batch} |")


if __name__ == "__main__":
    main()
