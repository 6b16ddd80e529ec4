"""Host cost of one compiled decode call with the graph's own work taken out: what dmi's patched
model adds to each call of generate()'s compiled forward in Dynamo and AOTAutograd.

    python perf/callcost.py [--layers 36] [--sites resid_post,final_norm] [--reps 40] [--skip-guards]

Compiled HF generate is host-bound (perf/RESULTS.md: ~2-4 ms of host time a call around ~12 ms
of GPU work on the H200), and dmi's null mode showed a wall cost the GPU did not (GPU ratio 0.996-
1.000): host time in the compiled call. Here a backend stands in for the compiled graph: it runs
the graph once and then returns that output, so what is timed is Dynamo's guards, the prologue
that fetches the graph's inputs, and AOTAutograd's runtime wrappers. Models (tiny widths, CPU;
the host work depends on the number of inputs and sites, not their size):

* vanilla, and an unpatched twin (A/A);
* dmi null, sites named by tensor: as a model compiled layer by layer names them (each site a
  graph input);
* dmi null, constant sites: as generate()'s compiled forward names them (``dmi.siteop.constant_sites``).

Each is timed in rotation (``--reps`` rounds of 200 calls; thread CPU time per call: median, 10th
percentile, minimum). ``--skip-guards`` runs under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``,
which leaves the prologue and wrappers.

``--generate N``: whole ``generate()`` calls instead, of 4 and of 4 + N new tokens (static cache, its
compiled forward on the same replaying backend, so each decode step is generate()'s host work around
a call that computes nothing): vanilla, the A/A twin and dmi null, in rotation; a decode step's
thread CPU and wall time are the median over rounds of the two lengths' difference over N. Beside the compiled call, this counts what dmi adds to generate()'s own loop (its
wrappers of ``generate``, ``prepare_inputs_for_generation`` and the compiled call: ``Run.stepped``).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("DMI_RING", "interpret")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch   # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dmi   # noqa: E402
from dmi.siteop import constant_sites   # noqa: E402
from offline import hidden_spec, twin   # noqa: E402


def replaying_backend():
    """A backend whose graph runs once: later calls return the first call's outputs."""
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm, example_inputs):
        first = []

        def run(*args):
            if not first:
                first.append(gm(*args))
            return first[0]
        run._boxed_call = False
        return run
    return aot_autograd(fw_compiler=fw)


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


def decode_inputs(model, cfg, batch: int, prompt: int) -> dict:
    """A static cache after a prefill of ``prompt`` tokens, and one decode step's arguments."""
    import transformers as tf
    cache = tf.StaticCache(config=cfg, max_cache_len=prompt + 16)
    with torch.no_grad():
        model(input_ids=torch.randint(3, cfg.vocab_size, (batch, prompt)), past_key_values=cache, use_cache=True,
              cache_position=torch.arange(prompt))
    return dict(input_ids=torch.randint(3, cfg.vocab_size, (batch, 1)),
                attention_mask=torch.ones(batch, prompt + 1, dtype=torch.long),
                position_ids=torch.full((batch, 1), prompt), cache_position=torch.tensor([prompt]),
                past_key_values=cache, use_cache=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--sites", default="resid_post,final_norm", help="the dmi rows' sites (every layer)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--skip-guards", action="store_true")
    ap.add_argument("--generate", type=int, default=0, metavar="N", help="time generate() of N new tokens instead")
    args = ap.parse_args(argv)
    if args.generate:
        return generate_cost(args)
    cfg, model, spec = tiny_setup(args)
    runs, calls = [], {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        store = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        models = {"vanilla": model, "A/A twin": twin(model)}
        for label in ("dmi null, site tensors", "dmi null, constant sites"):
            m = twin(model)
            run = stack.enter_context(dmi.load(m, hook_spec=spec, store=store / f"{len(runs)}.zarr"))
            run.set_enabled(False)
            runs.append(run)
            models[label] = m
        for label, m in models.items():
            fn = torch.compile(m.__call__, backend=replaying_backend(), fullgraph=True)
            fn = constant_sites(fn) if label.endswith("constant sites") else fn
            kw = decode_inputs(m, cfg, args.batch, 16)
            fn(**kw), fn(**kw)
            calls[label] = (fn, kw)
        print(f"{args.layers} layers, {len(runs[0].plan.sites)} sites ({args.sites}), "
              f"{'guards skipped' if args.skip_guards else 'guards evaluated'}; thread CPU µs per call")
        stance = (torch.compiler.set_stance(skip_guard_eval_unsafe=True) if args.skip_guards
                  else contextlib.nullcontext())
        times: dict = {label: [] for label in calls}
        with stance:
            for r in range(args.reps):
                order = list(calls)[r % len(calls):] + list(calls)[:r % len(calls)]
                for label in order:
                    fn, kw = calls[label]
                    t = time.thread_time()
                    for _ in range(200):
                        fn(**kw)
                    times[label].append((time.thread_time() - t) / 200 * 1e6)
    base = statistics.median(times["A/A twin"])
    print("| call | median µs | 10th pct | min | median - A/A |\n| --- | ---: | ---: | ---: | ---: |")
    for label, ts in times.items():
        ts = sorted(ts)
        med = statistics.median(ts)
        print(f"| {label} | {med:.0f} | {ts[len(ts) // 10]:.0f} | {ts[0]:.0f} | {med - base:+.0f} |")


def generate_cost(args) -> None:
    """``--generate N`` (module doc): each configuration's generate() of 4 and of 4 + N tokens in
    rotation; a decode step's cost is the median over rounds of their difference over N (the eager
    prefill, the same in both, cancels)."""
    import transformers as tf
    cfg, model, spec = tiny_setup(args)
    enc = {"input_ids": torch.randint(3, cfg.vocab_size, (args.batch, 16)),
           "attention_mask": torch.ones(args.batch, 16, dtype=torch.long)}
    short, n = 4, args.generate
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        # one static graph per cache length (the replayed outputs have the shapes of the first call)
        stack.enter_context(torch._dynamo.config.patch(automatic_dynamic_shapes=False, cache_size_limit=64))
        store = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        models = {"vanilla": model, "A/A twin": twin(model)}
        run = stack.enter_context(dmi.load(twin(model), hook_spec=spec, store=store / "null.zarr"))
        run.set_enabled(False)
        models["dmi null"] = run.model
        configs = {}
        for label, m in models.items():
            config = tf.CompileConfig(backend=replaying_backend(), fullgraph=True, mode=None)
            config._compile_all_devices = True      # (transformers compiles for CUDA devices only unless told)
            configs[label] = config
            for new in (short, short + n):
                m.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           cache_implementation="static", compile_config=config)
        print(f"{args.layers} layers, {len(run.plan.sites)} sites ({args.sites}), batch {args.batch}: generate() of "
              f"{short} and of {short + n} tokens; µs per decode step (median over rounds of the difference / {n})")
        times: dict = {(label, new, clock): [] for label in models for new in (short, short + n)
                       for clock in ("cpu", "wall")}
        for r in range(args.reps):
            order = list(models)[r % len(models):] + list(models)[:r % len(models)]
            for label in order:
                for new in (short, short + n):
                    t, w = time.thread_time(), time.perf_counter()
                    models[label].generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                           cache_implementation="static", compile_config=configs[label])
                    times[label, new, "cpu"].append(time.thread_time() - t)
                    times[label, new, "wall"].append(time.perf_counter() - w)

    def step(label, clock):      # each round's long call less its short call, right before it: the median
        return statistics.median((a - b) / n * 1e6 for a, b in zip(times[label, short + n, clock],
                                                                   times[label, short, clock]))
    base = {clock: step("A/A twin", clock) for clock in ("cpu", "wall")}
    print("| generate | thread CPU | - A/A | wall | - A/A |\n| --- | ---: | ---: | ---: | ---: |")
    for label in models:
        c, w = step(label, "cpu"), step(label, "wall")
        print(f"| {label} | {c:.0f} | {c - base['cpu']:+.0f} | {w:.0f} | {w - base['wall']:+.0f} |")


if __name__ == "__main__":
    main()
