"""dmi's host work per decode step, without the model: what a CUDA-graph replay waits for.

    python perf/hostcost.py [--layers 36] [--batch 32] [--calls 5000]

A model with ``--layers`` layers (tiny widths: the host work depends on the number of sites, not
their size) captures every layer's ``resid_post``, ``final_norm`` and last-token ``logits`` (the
hidden+logits spec of perf/offline.py) through a few decode steps; then the last decode step's
host calls are repeated in a loop: the control block (``publish_control``: control words + one
async H2D) and the whole step begin of a decode step (``Ring.begin_step`` on the reused layout,
which reserves, opens and publishes; each step is ended and drained as the run would). CPU: the
interpret ring (``DMI_RING=interpret``, the same control-block code as the CUDA ring); GPU: the
CUDA ring.

``--cap F``: the decode step's begin again under ``best_effort`` with a D2H cap of F times the
capture rate (``policy.d2h_bytes_per_s``, its bucket refilled by F x a step's bytes each step:
captures it has no room for are dropped, lowest priority first).

``--in-generate N``: the same calls timed inside a real ``generate()`` of N tokens (static
cache): between two steps the model's forward runs, so dmi's host work meets cold caches, as it
does in a real run (2-core CPU machine: publish_control 28 µs there against 4 µs in the loop).

``--in-generate N --compiled``: generate()'s compiled forward (``Run.stepped``): the host calls
before the forward (what generate()'s GPU waits for: it syncs on its stop check every step), after
its launch (the next decode step begun ahead, ``Run._begin_ahead``) and at its end, with steps begun
ahead and at their forward, alternating (2-core CPU machine: 13 µs before the forward against 63-68).

``--engine vllm``: the host work of one vLLM engine step instead (``Session.on_forward`` and
``on_step_end`` without the engine): a continuous batch of ``--batch`` requests, ``--prefill`` of
them in a chunk of their prompt, the rest decoding, turned into the step's rows
(``StepBuilder.build``), begun (token filters, per-site selection, ring reservation, control
block) and ended. The synthetic batch keeps its requests, so once their phases settle each step
has the last one's rows and reuses its layout, as a steady serving batch does; ``--fresh`` lays
every step out anew, as when the batch changes every step. Each step publishes every graph site's
record as the kernels would (not timed), so the drain's work per step is a serving step's;
``--windows`` opens a drain window after each step (``Run.drain_window``, as vLLM's decode steps
do), so the drain runs in the gap instead of on its timer.
Times of the decode step's begin and end, and of the engine step's calls, are the model thread's CPU
time (``time.thread_time``): the drain thread runs beside it and on a small machine its share of the
GIL would otherwise be counted in whichever call it interrupts.
The drain and export threads' own CPU time per step is printed too (the export thread writes
nothing here: store writes are skipped).

``--engine vllm --eager``: each step also captures its sites as a step above vLLM's largest CUDA
graph does (the site ops run eagerly), timed per site: through ``Run.capture`` by default,
``--sum`` as a sum of two tensors (``dmi::capture_sum``), ``--op`` through the site op as vLLM's
compiled code calls it (dispatcher included), ``--kernel`` launching the capture kernel instead of
the eager path's copies (H200 host, 37 sites, in this loop: 15.4 µs a site, 28.2 summed, 48.6
summed through the op; serving pays ~116 µs a site there: perf/RESULTS.md, thirty-second session).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("DMI_RING", "interpret")
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch   # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dmi   # noqa: E402
from gpuclock import CpuClock, Stopwatch   # noqa: E402
from offline import DEV, Skip, hidden_spec, internals_spec, prompts   # noqa: E402


def per_call_us(fn, n: int) -> float:
    for _ in range(min(n, 100)):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--cap", type=float, default=0.0, metavar="F",
                    help="hf: also the decode step's begin under best_effort with a D2H cap of F x the capture rate")
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--prefill", type=int, default=4, help="vllm: requests of the batch in a prefill chunk")
    ap.add_argument("--chunk", type=int, default=64, help="vllm: tokens of each prefill chunk")
    ap.add_argument("--internals", action="store_true", help="capture the internals spec (7 sites per layer)")
    ap.add_argument("--gap", type=float, default=0.0, metavar="MS",
                    help="vllm: sleep this long between steps, as the engine thread waits for the GPU (caches as "
                         "cold as serving leaves them; the drain thread runs meanwhile)")
    ap.add_argument("--cycle", action="store_true",
                    help="vllm: every other step the last request is out of the batch, so no step repeats the last "
                         "one (a churning batch) while the same two row structures come back")
    ap.add_argument("--breakdown", action="store_true",
                    help="vllm: wall µs per call of the step's main functions (timers around each: their own cost "
                         "is in the figures)")
    ap.add_argument("--fresh", action="store_true", help="vllm: no step reuses the last step's layout")
    ap.add_argument("--eager", action="store_true", help="vllm: each step also captures its sites through the eager "
                    "path (a step run without a CUDA graph: mixed prefill steps above the largest graph size)")
    ap.add_argument("--sum", action="store_true",
                    help="vllm --eager: each site's value is the sum of two tensors (vLLM's residual stream outside "
                         "its graphs: dmi::capture_sum), not one tensor")
    ap.add_argument("--op", action="store_true",
                    help="vllm --eager: through the site op as compiled code calls it (torch.ops.dmi.capture[_sum], "
                         "the site as a tensor, the module's other output as after), dispatcher included")
    ap.add_argument("--kernel", action="store_true",
                    help="vllm --eager: each site launched as in a CUDA graph (the capture kernel through Triton's "
                         "launcher, reading the step from the control block) instead of the eager path's copies")
    ap.add_argument("--no-range-copy", action="store_true",
                    help="vllm: the logits rows (one range) captured through the eager path's torch ops or their "
                         "replayed graph, not by one strided copy (ring.range_copy off): the A/B of copy_rows")
    ap.add_argument("--windows", action="store_true",
                    help="vllm: each step, once ended, opens a drain window (Run.drain_window, as vLLM's decode steps "
                         "do): the drain runs in the gap, not on its timer")
    ap.add_argument("--in-generate", type=int, default=0, metavar="N",
                    help="hf: time the step's host calls inside a real generate() of N new tokens (static cache: "
                         "caches as cold as the model leaves them), not in a loop")
    ap.add_argument("--compiled", action="store_true",
                    help="with --in-generate: generate()'s compiled forward (GPU: reduce-overhead CUDA graphs; CPU: "
                         "backend eager), the host calls around it with decode steps begun ahead of their forward "
                         "and at it (Run.step_ahead), alternating")
    args = ap.parse_args(argv)
    import transformers as tf
    cfg = tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=512, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    enc, _ = prompts(args.batch, 16, 64, cfg.vocab_size)
    spec = (internals_spec if args.internals else hidden_spec)(256 << 20, 256 << 20)
    run = dmi.load(model, hook_spec=spec, store=Path(tempfile.mkdtemp()) / "h.zarr", overwrite=True)
    if args.engine == "vllm":
        return vllm_steps(run, args)
    if args.in_generate:
        return (in_compiled_generate if args.compiled else in_generate)(model, run, enc, args.in_generate)
    ring = run.ring
    steps = []
    publish = ring.publish_control
    ring.publish_control = lambda ctrl: (steps.append(ctrl), publish(ctrl))[1]
    try:
        with Skip(run), torch.no_grad():
            model.generate(**enc, max_new_tokens=8, do_sample=False)
            run.flush()
            last = steps[-1]
            assert last.layout is not None, "the decode steps did not take the laid-out path"
            ring.publish_control = publish
            pub = per_call_us(lambda: publish(last), args.calls)

            spent: dict = {"begin": [], "end": []}

            def decode_step():   # one decode step's host side, as the run does it around a graph replay
                run._owner.claim("a step")
                t = time.thread_time()           # (the thread's CPU: the drain thread's GIL share is not counted)
                ring.begin_step(run._step, last.tokens, last.pad, last.layout)
                spent["begin"].append(time.thread_time() - t)
                run._step += 1
                t = time.thread_time()
                if DEV == "cuda":
                    ring.device_end()            # in a compiled forward this kernel is inside the graph
                else:
                    ring.publish_end(ring.current)
                ring.end_step(device=True)
                spent["end"].append(time.thread_time() - t)
                run._owner.release_step()

            def medians_us() -> tuple[float, float]:
                """Median begin and end (a step's first capped begin builds its layout: ms, once)."""
                return tuple(statistics.median(spent[k]) * 1e6 for k in ("begin", "end"))
            n = max(args.calls // 10, 100)
            per_call_us(decode_step, n)
            begin, end = medians_us()
            capped = ""
            if args.cap:       # best_effort under a D2H cap of args.cap x the loop's own capture rate
                from dmi.ring.budget import TokenBucket
                ring.set_limits("best_effort", None)
                # (the bucket's clock counts steps: each step refills args.cap x a step's bytes, whatever the host's speed)
                ring.bucket = TokenBucket(args.cap * last.layout.total, burst=last.layout.total, clock=lambda: run._step)
                spent.update(begin=[], end=[])
                drops = len(ring.stats.drops)
                per_call_us(decode_step, n)
                done = n + min(n, 100)
                capped = (f"; best_effort capped at {args.cap:g} x a step's bytes per step: begin {medians_us()[0]:.1f} "
                          f"us, {(len(ring.stats.drops) - drops) / done:.1f} captures dropped a step")
            run.flush()
    finally:
        run.close()
    print(f"{DEV}: {len(run.plan.sites)} sites, batch {args.batch}: publish_control {pub:.1f} us/call; decode step: "
          f"begin (reserve, open, control block) {begin:.1f} us, end (end marker, close) {end:.1f} us{capped}")


def _eager_capture(run, x, addend, op: bool):
    """site index -> None: one site's capture in an eager step, as ``Run.capture`` takes it or (``op``)
    as vLLM's compiled code calls the site op (its site a tensor, the module's other output ``after``)."""
    if not op:
        return lambda i: run.capture(i, x, addend)
    ticket, after = run.ticket, [x]
    if addend is None:
        return lambda i: torch.ops.dmi.capture(x, ticket, run.id, -1, run.site_tensors[i], after)
    return lambda i: torch.ops.dmi.capture_sum(x, addend, ticket, run.id, -1, run.site_tensors[i], after)


def in_generate(model, run, enc, new: int) -> None:
    """Thread CPU per decode step of dmi's host calls inside generate() (see --in-generate)."""
    calls = ((run, "_begin"), (run.ring, "begin_step"), (run.ring, "publish_control"), (run.ring, "end_step"))
    clocks = {name: Stopwatch() for _, name in calls}
    kw = dict(do_sample=False, cache_implementation="static")
    try:
        with Skip(run), torch.no_grad():
            model.generate(**enc, max_new_tokens=8, **kw)
            for obj, name in calls:
                setattr(obj, name, clocks[name].wrap(getattr(obj, name)))
            model.generate(**enc, max_new_tokens=new, **kw)
            run.flush()
    finally:
        run.close()
    print(f"{DEV}: {len(run.plan.sites)} sites, batch {enc['input_ids'].shape[0]}, inside generate() ({new} steps, "
          f"thread CPU us/step): " + ", ".join(f"{k.lstrip('_')} {c.cpu_seconds / new * 1e6:.1f}" for k, c in clocks.items()))


def in_compiled_generate(model, run, enc, new: int) -> None:
    """Thread CPU per step of the host calls around generate()'s compiled forward (``Run.stepped``),
    decode steps begun ahead and at their forward (``run.step_ahead``), alternating (see --compiled)."""
    from transformers import CompileConfig
    config = CompileConfig(mode="reduce-overhead") if DEV == "cuda" else CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True         # (CPU: transformers compiles for accelerators only unless told)
    kw = dict(do_sample=False, cache_implementation="static", compile_config=config, max_new_tokens=new)
    calls = {"begin_step": "before the forward", "_begin_ahead": "after its launch", "end_step": "end"}
    clocks = {name: Stopwatch() for name in calls}
    try:
        with Skip(run), torch.no_grad():
            model.generate(**kw, **enc)         # compiles (and records the CUDA graphs)
            model.generate(**kw, **enc)
            for name in calls:
                setattr(run, name, clocks[name].wrap(getattr(run, name)))
            for ahead in (True, False, True, False):
                run.step_ahead = ahead
                for c in clocks.values():
                    c.clear()
                steps, taken = run._step, run.steps_ahead[0]
                model.generate(**kw, **enc)
                run.flush()
                steps = run._step - steps
                print(f"{DEV}: steps {'begun ahead' if ahead else 'begun at their forward'}: {steps} steps, "
                      f"{run.steps_ahead[0] - taken} taken ahead; thread CPU us/step: "
                      + ", ".join(f"{label} {clocks[name].cpu_seconds / steps * 1e6:.1f}" for name, label in calls.items()))
    finally:
        run.close()


def vllm_steps(run, args) -> None:
    """Host µs of a vLLM engine step: rows from the scheduler's batch, begin, end (see the module doc)."""
    import numpy as np
    from dmi.adapters.vllm.compat import Batch
    from dmi.adapters.vllm.policy import Want
    from dmi.adapters.vllm.steps import StepBuilder
    ring, builder, every = run.ring, StepBuilder(run.requests), Want(None, None)
    n, k = args.batch, min(args.prefill, args.batch)
    ids = [f"req-{i}" for i in range(n)]
    sched = np.array([args.chunk] * k + [1] * (n - k), np.int64)
    computed = np.array([0] * k + [200] * (n - k), np.int64)
    prompt = np.full(n, 200 + args.chunk, np.int64)
    spent = {"rows": 0.0, "begin": 0.0, "end": 0.0, "device_end": 0.0, "end_wall": 0.0, "eager": 0.0, "wall": 0.0,
             "logits": 0.0}
    eager_sites = [s for s in run.plan.sites if s.canonical != "logits"] if args.eager else []
    logits_site = next(s for s in run.plan.sites if s.canonical == "logits")
    graph_sites = [s for s in run.plan.sites if s.canonical != "logits"]
    row_bytes = {s.index: s.row_bytes(run.itemsize) for s in run.plan.sites}
    hidden = run.plan.sites[0].shape[-1]
    xs = torch.randn(1, int(sched.sum()), hidden, device=DEV)    # [batch 1, flat tokens, hidden]: HF's site layout
    addend = torch.randn_like(xs) if args.sum else None          # (--sum: the residual added to it)
    eager_capture = _eager_capture(run, xs, addend, args.op)
    if args.kernel:
        plain_capture = eager_capture

        def eager_capture(i):          # (graph_mode: KernelRing.capture launches as while capturing a graph)
            ring.graph_mode = True
            try:
                plain_capture(i)
            finally:
                ring.graph_mode = False
    logits = torch.randn(1, n, logits_site.shape[-1], device=DEV)  # one row per request (the held rows)
    timers = _breakdown(run, builder) if args.breakdown else None
    if DEV == "cuda":
        ring.replay_eager = {logits_site.index}    # as the vLLM worker does (its logits, outside the graphs)
    ring.range_copy = not args.no_range_copy

    no_pad = np.zeros(1, np.int64)
    count = [0]

    def step():
        if args.gap:
            time.sleep(args.gap / 1e3)
        w = time.perf_counter()
        count[0] += 1
        m = n - 1 if args.cycle and count[0] % 2 else n      # --cycle: the last request out of the batch
        computed[:m] += sched[:m]  # the next step's positions (requests never finish: no re-admission)
        t = time.thread_time()
        # a steady batch (every request decoding) repeats the last step, as Session.on_batch finds it
        got = builder.repeat(n) if not (args.fresh or args.cycle) and builder.last_ids == ids else None
        if got is None:
            batch = Batch(ids[:m], sched[:m], computed[:m].copy(), prompt[:m], set(), False)
            got = builder.build(batch, int(sched[:m].sum()), lambda rid: every, len(run.plan.sites))
        st, keep, held = got
        spent["rows"] += time.thread_time() - t
        run._owner.claim("a step")
        if args.fresh:
            run.forget_layouts()           # lay every step out anew
        t = time.thread_time()
        run.begin_tokens(st, no_pad, keep=keep, held=held)
        spent["begin"] += time.thread_time() - t
        w_pub = time.perf_counter()
        if not eager_sites:           # what the graph's kernels publish (not timed): the drain's work per step
            ctrl = ring.current
            for site in graph_sites:
                if site.index in ctrl.slots:
                    slot = ctrl.slots[site.index]
                    n_rows = len(slot.rows)
                    ring.publish_record(slot.seq, ctrl.step, site.index, slot.offset, n_rows * row_bytes[site.index],
                                        n_rows, st.seq)
        w += time.perf_counter() - w_pub
        t = time.thread_time()
        for site in eager_sites:      # what the dmi::capture op does for each site of an eager step
            eager_capture(site.index)
        spent["eager"] += time.thread_time() - t
        t = time.thread_time()
        run.capture(logits_site.index, logits[:, :m])    # every step: vLLM computes logits outside its CUDA graphs
        spent["logits"] += time.thread_time() - t
        t, w0, w = time.thread_time(), w, time.perf_counter()
        if DEV == "cuda":
            ring.device_end()
        else:
            ring.publish_end(ring.current)
        spent["device_end"] += time.thread_time() - t
        run.end_step()
        if args.windows:
            run.drain_window()
        spent["end"] += time.thread_time() - t
        spent["end_wall"] += time.perf_counter() - w
        spent["wall"] += time.perf_counter() - w0

    calls = max(args.calls // 10, 100)
    total = calls + min(calls, 100)
    if DEV == "cuda":     # the end kernel's first launch compiles it: not a step's cost
        ring.device_end()
        torch.cuda.synchronize()
    try:
        with Skip(run), torch.inference_mode(), CpuClock(run, total) as cpu:    # (as vLLM runs its steps)
            for _ in range(total - calls):    # warm-up (Triton compiles, graphs captured): not timed
                step()
            for key in spent:
                spent[key] = 0.0
            for spent_in in (timers or {}).values():
                spent_in.clear()
            for _ in range(calls):
                step()
            run.flush()
        if DEV == "cuda":      # the end marker launched through Triton (before it was a replayed graph), disarmed
            launch = per_call_us(ring.launch_end, 2000)
            graph = per_call_us(ring._end_graph.replay, 2000) if ring._end_graph is not None else float("nan")
            torch.cuda.synchronize()
            print(f"end marker: Triton launch {launch:.1f} us, graph replay {graph:.1f} us (wall, per call)")
    finally:
        run.close()
    rows, begin, end, dev_end, end_wall = (spent[key] / calls * 1e6
                                           for key in ("rows", "begin", "end", "device_end", "end_wall"))
    print(f"{DEV} vllm step: {len(run.plan.sites)} sites, {n} requests ({k} prefill chunks of {args.chunk}, "
          f"{int(sched.sum())} tokens): rows from the batch {rows:.1f} us, begin {begin:.1f} us, end {end:.1f} us "
          f"(end marker {dev_end:.1f}; wall {end_wall:.1f}), logits capture {spent['logits'] / calls * 1e6:.1f} us, "
          f"total {rows + begin + end:.1f} us (wall {spent['wall'] / calls * 1e6:.1f}); {cpu.text.split(', ', 1)[1]} (thread CPU us/step)"
          + (f"; eager captures {spent['eager'] / calls * 1e6 / len(eager_sites):.1f} us/site ({len(eager_sites)} sites"
             f"{', summed' if args.sum else ''}{', through the op' if args.op else ''}"
             f"{', kernel launches' if args.kernel else ''})" if eager_sites else ""))
    print("captures outside graphs (count, mean host us): " + ", ".join(
        f"{how} {n} x {t / max(n, 1) * 1e6:.1f}" for how, (n, t) in ring.eager_time.items() if n))
    if timers is not None:
        print("breakdown (wall us per call, nested calls included in their callers): " + ", ".join(
            f"{name} {sum(v) / len(v) * 1e6:.1f}" for name, v in sorted(timers.items(), key=lambda kv: -sum(kv[1])) if v))


def _breakdown(run, builder) -> dict:
    """Wall-clock timers around the main functions of a vLLM step's host side (instance attributes:
    the run's own objects only)."""
    import functools
    timers: dict = {}

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)
        spent = timers.setdefault(label, [])

        @functools.wraps(fn)
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent.append(time.perf_counter() - t)
        setattr(obj, name, timed)
    ring = run.ring
    for obj, names in ((builder, ("build", "repeat")), (run, ("_wanted", "_same_rows_layout", "_count", "capture")),
                       (ring, ("begin_step", "publish_control", "_publish_head", "_layout_words", "device_end",
                               "end_step", "publish_record"))):
        for name in names:
            if hasattr(obj, name):
                wrap(obj, name, f"{type(obj).__name__}.{name}")
    return timers


if __name__ == "__main__":
    main()
