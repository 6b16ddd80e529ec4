"""Dynamo's cache lookup (guard evaluation) before each compiled decode step of generate(), vanilla
against dmi: the host time a patched model adds to every call of its compiled forward.

    python perf/guardcost.py [--layers 36] [--batch 32] [--new 32]

A Qwen3 of tiny widths (``--layers`` layers: guards follow the model's structure, not its sizes)
and twins sharing its weights: vanilla, an unpatched A/A twin, and one carrying dmi (perf/
offline.py's hidden+logits spec), in null mode and capturing. Each runs generate() with a static
cache and its compiled forward (``reduce-overhead`` on a GPU, ``default`` on the CPU), twice to
compile and record, then once under torch.profiler: the mean CPU time of the "TorchDynamo Cache
Lookup" events per decode step (the profiler's own cost included, alike for every row). Then each
compiled frame's cache entries and their guards by kind (the guard tree's lines).
"""
from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dmi   # noqa: E402
from callcost import tiny_setup   # noqa: E402
from gpuclock import cache_lookups_us   # noqa: E402
from offline import twin   # noqa: E402

KINDS = re.compile(r"\b([A-Z_]*(?:MATCH|GUARD|CHECK|ALIASING|CONTAINS|STATE|DEVICE)[A-Z_]*)\b")


def lookups_us(fn) -> tuple[int, float]:
    """(cache lookups, their mean CPU µs) in one call of ``fn`` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    ev = cache_lookups_us(p)
    return len(ev), (sum(ev) / len(ev) if ev else 0.0)


def guard_kinds(model) -> list[tuple[int, collections.Counter]]:
    """Per cache entry of the model's compiled forward: (guard tree lines, lines by guard kind)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    fwd = model.forward
    code = getattr(fwd, "__code__", None) or fwd.__func__.__code__
    out = []
    for entry in _debug_get_cache_entry_list(code):
        lines = str(entry.guard_manager).splitlines()
        kinds = collections.Counter(m.group(1) for ln in lines for m in [KINDS.search(ln)] if m)
        out.append((len(lines), kinds))
    return out


def main(argv=None) -> None:
    import transformers as tf
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--sites", default="resid_post,final_norm")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    cfg, model, spec = tiny_setup(args)
    model = model.to(dev, torch.bfloat16 if cuda else torch.float32)
    enc = {"input_ids": torch.randint(3, cfg.vocab_size, (args.batch, 16), device=dev),
           "attention_mask": torch.ones(args.batch, 16, dtype=torch.long, device=dev)}
    config = tf.CompileConfig(mode="reduce-overhead" if cuda else "default")
    config._compile_all_devices = True
    kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, cache_implementation="static",
              compile_config=config)
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        models = {"vanilla": model, "A/A twin": twin(model)}
        run = dmi.load(twin(model), hook_spec=spec, store=Path(tmp) / "g.zarr")
        try:
            models["dmi"] = run.model
            for m in models.values():
                m.generate(**enc, **kw), m.generate(**enc, **kw)
            rows = [("vanilla", "vanilla", None), ("A/A twin", "A/A twin", None),
                    ("dmi null", "dmi", False), ("dmi capturing", "dmi", True)]
            got = {label: [] for label, *_ in rows}
            for _ in range(args.repeats):
                for label, name, enabled in rows:
                    if enabled is not None:
                        run.set_enabled(enabled)
                    n, us = lookups_us(lambda: models[name].generate(**enc, **kw))
                    got[label].append((n, us))
                    run.flush()
            base = statistics.median(us for _, us in got["A/A twin"])
            print(f"{args.layers} layers, {len(run.plan.sites)} sites, batch {args.batch}, {dev}: Dynamo cache lookup "
                  f"per compiled call, CPU µs (median of {args.repeats} profiled generate() calls)")
            print("| model | lookups/generate | µs/lookup | - A/A |\n| --- | ---: | ---: | ---: |")
            for label, _, _ in rows:
                us = statistics.median(u for _, u in got[label])
                print(f"| {label} | {got[label][0][0]} | {us:.0f} | {us - base:+.0f} |")
            for name in ("vanilla", "dmi"):
                for i, (lines, kinds) in enumerate(guard_kinds(models[name])):
                    print(f"{name} cache entry {i}: {lines} guard lines; {dict(kinds.most_common(14))}")
        finally:
            run.close()


if __name__ == "__main__":
    main()
