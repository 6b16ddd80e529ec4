"""Question: where does the host time of Dynamo's cache lookup that dmi adds to each compiled decode step go?

The cache lookup (guard evaluation) before each compiled decode step of generate(), vanilla against
dmi: the host time a patched model adds to every call of its compiled forward. perf/RESULTS.md's
"Open" section gives the figure: the lookup grows more than the guard check it contains.

    python perf/diagnostics/guardcost.py [--layers 36] [--batch 32] [--new 32] [--backend eager]

A Qwen3 of tiny widths (``--layers`` layers: guards follow the model's structure, not its sizes)
and twins sharing its weights: vanilla, an unpatched A/A twin, one carrying dmi (the headline's
hidden+logits spec) in null mode and capturing, and one carrying dmi with its sites named through
their handles (``engine.constant_sites: false``, where the default names them as constants). Each runs generate() with
a static cache and its compiled forward (``reduce-overhead`` on a GPU, ``default`` on the CPU),
twice to compile and record. Then, per row:

* profiled: one more generate() under torch.profiler, the mean CPU time of its "TorchDynamo Cache
  Lookup" events (the profiler's own cost included, alike for every row);
* guard check: the compiled frame's guards evaluated directly (``guard_manager.check`` on the
  locals of the row's last decode call) in blocks of 100, the rows' blocks interleaved; the median
  µs of a check. No profiler and no other thread's time in it: the cleaner figure for a change to
  what is guarded;
* guard lines: the size of that guard tree.

Then each compiled frame's cache entries and their guards by kind.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's dmi
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # perf/: common

import dmi   # noqa: E402
from dmi.siteop import constant_sites   # noqa: E402
from common import cache_lookups_us, hidden_spec, twin   # noqa: E402

KINDS = re.compile(r"\b([A-Z_]*(?:MATCH|GUARD|CHECK|ALIASING|CONTAINS|STATE|DEVICE)[A-Z_]*)\b")


def tiny_setup(args):
    """(config, model, hook spec): a tiny-width Qwen3 of ``--layers`` layers and ``--sites`` of every layer."""
    import transformers as tf
    cfg = tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    spec = hidden_spec(64 << 20, 64 << 20)
    spec["capture"] = [{"sites": args.sites.split(",")}]
    return cfg, model, spec


def lookups_us(fn) -> tuple[int, float]:
    """(cache lookups, their mean CPU µs) in one call of ``fn`` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    ev = cache_lookups_us(p)
    return len(ev), (sum(ev) / len(ev) if ev else 0.0)


def _entries(model) -> list:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    fwd = model.forward
    return list(_debug_get_cache_entry_list(getattr(fwd, "__code__", None) or fwd.__func__.__code__))


def guard_kinds(model) -> list[tuple[int, collections.Counter]]:
    """Per cache entry of the model's compiled forward: (guard tree lines, lines by guard kind)."""
    out = []
    for entry in _entries(model):
        lines = str(entry.guard_manager).splitlines()
        kinds = collections.Counter(m.group(1) for ln in lines for m in [KINDS.search(ln)] if m)
        out.append((len(lines), kinds))
    return out


def record_calls(model) -> dict:
    """Wraps ``model.get_compiled_call`` so that the returned dict holds the last compiled call's
    (args, kwargs) under ``"call"``."""
    seen: dict = {}
    get = model.get_compiled_call

    def get_compiled_call(*args, **kwargs):
        compiled = get(*args, **kwargs)

        def call(*a, **k):
            seen["call"] = (a, k)
            return compiled(*a, **k)
        return call
    model.get_compiled_call = get_compiled_call
    return seen


def guard_check(model, call) -> tuple[callable, int]:
    """(a function evaluating the guards of the cache entry of ``model``'s compiled forward that
    ``call`` (args, kwargs) passes, its guard lines). The locals are the compiled frame's at entry:
    its arguments and its closure's cells."""
    fwd = model.forward
    fn = getattr(fwd, "__func__", fwd)
    bound = inspect.signature(fn, follow_wrapped=False).bind(*([fwd.__self__] if fn is not fwd else []), *call[0],
                                                             **call[1])
    bound.apply_defaults()
    local = dict(bound.arguments)
    local.update((name, cell.cell_contents) for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    check = constant_sites(lambda gm: gm.check(local))       # (the flag generate()'s compiled call runs under)
    for entry in _entries(model):
        if check(entry.guard_manager):
            return (lambda gm=entry.guard_manager: check(gm)), len(str(entry.guard_manager).splitlines())
    raise RuntimeError(f"no cache entry of {type(model).__name__}'s compiled forward passes its last call's locals")


BLOCKS, PER_BLOCK = 30, 100      # direct guard checks per row: interleaved blocks of evaluations


def checks_us(checks: dict) -> dict[str, float]:
    """Median µs of each row's guard check, the rows' blocks of ``PER_BLOCK`` interleaved."""
    times: dict = {k: [] for k in checks}
    for _ in range(BLOCKS):
        for label, check in checks.items():
            for _ in range(PER_BLOCK):
                t = time.perf_counter_ns()
                check()
                times[label].append(time.perf_counter_ns() - t)
    return {k: statistics.median(v) / 1e3 for k, v in times.items()}


def main(argv=None) -> None:
    import transformers as tf
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--sites", default="resid_post,final_norm")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", help="torch.compile backend (default: inductor, reduce-overhead on a GPU); "
                                      "Dynamo's guards are the same under any backend, `eager` compiles fastest")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    cfg, model, spec = tiny_setup(args)
    model = model.to(dev, torch.bfloat16 if cuda else torch.float32)
    enc = {"input_ids": torch.randint(3, cfg.vocab_size, (args.batch, 16), device=dev),
           "attention_mask": torch.ones(args.batch, 16, dtype=torch.long, device=dev)}
    config = (tf.CompileConfig(backend=args.backend, mode=None) if args.backend else
              tf.CompileConfig(mode="reduce-overhead" if cuda else "default"))
    config._compile_all_devices = True
    kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, cache_implementation="static",
              compile_config=config)
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        models = {"vanilla": model, "A/A twin": twin(model)}
        run = dmi.load(twin(model), hook_spec=spec, store=Path(tmp) / "g.zarr")
        hrun = dmi.load(twin(model), hook_spec=spec | {"engine": {"constant_sites": False}}, store=Path(tmp) / "h.zarr")
        try:
            models["dmi"], models["dmi, handles"] = run.model, hrun.model
            calls = {name: record_calls(m) for name, m in models.items()}
            hrun.set_enabled(False)
            for m in models.values():
                m.generate(**enc, **kw), m.generate(**enc, **kw)
            rows = [("vanilla", "vanilla", None), ("A/A twin", "A/A twin", None),
                    ("dmi null", "dmi", False), ("dmi capturing", "dmi", True),
                    ("dmi null, handles", "dmi, handles", None)]
            got = {label: [] for label, *_ in rows}
            for _ in range(args.repeats):
                for label, name, enabled in rows:
                    if enabled is not None:
                        run.set_enabled(enabled)
                    n, us = lookups_us(lambda: models[name].generate(**enc, **kw))
                    got[label].append((n, us))
                    run.flush()
            run.set_enabled(False)
            checks = {name: guard_check(m, calls[name]["call"]) for name, m in models.items()}
            check_us = checks_us({name: c for name, (c, _) in checks.items()})
            base = statistics.median(us for _, us in got["A/A twin"])
            print(f"{args.layers} layers, {len(run.plan.sites)} sites, batch {args.batch}, {dev}: Dynamo cache lookup "
                  f"per compiled call, CPU µs (profiled: median of {args.repeats} generate() calls; guard check: "
                  f"median of {BLOCKS * PER_BLOCK:,} direct evaluations)")
            print("| model | lookups/generate | profiled µs/lookup | - A/A | guard check µs | - A/A | guard lines |")
            print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
            for label, name, _ in rows:
                us = statistics.median(u for _, u in got[label])
                check = (f"{check_us[name]:.1f} | {check_us[name] - check_us['A/A twin']:+.1f} | {checks[name][1]}"
                         if label != "dmi capturing" else " |  | ")
                print(f"| {label} | {got[label][0][0]} | {us:.0f} | {us - base:+.0f} | {check} |")
            for name in ("vanilla", "dmi"):
                for i, (lines, kinds) in enumerate(guard_kinds(models[name])):
                    print(f"{name} cache entry {i}: {lines} guard lines; {dict(kinds.most_common(14))}")
        finally:
            run.close()
            hrun.close()


if __name__ == "__main__":
    main()
