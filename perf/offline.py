"""Offline throughput of HF generate with dmi against vanilla, in one process on one GPU.

``--headline`` is the headline figure, end to end: default policy and store settings (the hook
spec names only its sites), the store written to ``--store-dir``, ``--generates`` generate() calls
in a row and ``run.flush()`` per round, ``run.close()`` counted, and every stored row checked
afterwards (``end_to_end``). ``--configs`` adds store configurations beside the default;
``--pyspy DIR`` records each timed round with py-spy (perf/common/pyspy.py reads the files).

    python perf/offline.py --headline --models qwen3-8b --batches 32 --modes compiled --new-tokens 128 --store-dir /tmp

Without ``--headline``, a matrix of diagnostic rows, each leaving out a stage of the pipeline.
Real-size configs with random weights (no downloads): Qwen3-0.6B, Qwen3-8B, Llama-3.1-8B in
bfloat16; batched greedy generation of random prompts (lengths spread evenly over 16..192 tokens,
left-padded); eager (dynamic cache) and compiled (static cache + torch.compile
``reduce-overhead``: CUDA graphs) generate. Rows, per model, batch and mode:

* vanilla: the unpatched model (the denominator of every ratio);
* vanilla twin (A/A) (``--aa-row``): an unpatched twin (below), compiled on its own and timed
  paired with vanilla as the dmi rows are: what the harness's alternation of two models costs;
* ``--rounds N`` (compiled mode): the A/A twin, dmi null and dmi hidden+logits -> host timed
  round-robin instead of one after the other, every run after its own vanilla run, so every row
  meets the same alternation and drift and the A/A row calibrates the others (other rows skipped);
  ``--drain-row`` adds "-> zarr (drain process)": the same capture on a twin of its own whose
  store writer's child drains the ring itself (``policy.drain: process``), written to Zarr;
* dmi null: sites patched, capture disabled by the device flag (``run.set_enabled(False)``);
* dmi hidden+logits: every layer's ``resid_post``, ``final_norm`` and last-token ``logits``,
  full policy (lossless, backpressure), GPU ring <= 1 GiB where one prefill step fits it;
  "-> zarr": written to a Zarr store (timed until the last row is in the store);
  "-> host": the same capture drained to pinned host memory with the store writes skipped
  (timed until the last row is on the host): the capture path without the exporter;
* "-> host + live probe" (``--probe-row``; in ``--rounds`` too): the same with a live subscriber
  (``Run.subscribe``) dotting the middle layer's ``resid_post`` rows with a direction as each step
  drains, on the export thread;
* "-> host, begun at forward" (``--ahead-row``, compiled mode): the same with each decode step
  begun right before its forward (``engine.step_ahead: false``), where generate()'s GPU waits for it,
  instead of while the GPU runs the step before (the default);
* "-> host, drain on timer" (``--timer-row``): the same with no drain window after each step's
  launch (``Run.drain_window``): the drain runs on its 100 ms timer only;
* "-> host, copy at step" (``--no-copy-at-step`` skips it): the same with ``engine.copy_at_step`` on
  (the CUDA ring copies each step out from the model's thread as the next step begins, instead of
  in batches from the drain thread; kernels/cuda_ring.py says why);
* "-> host, traced" (``--traced-row``, compiled mode): the same with the compiled forward capturing
  the plain sites as traced torch ops fused into the kernels computing them (``engine.traced: all``,
  kernels/traced.py), where by default every capture goes through the site op and its kernel;
* dmi internals -> host: q, k, v, z, mlp.in, mlp.out, resid_mid of every layer, drained to host;
* baselines (eager only): ``register_forward_hook`` copying layer outputs, final norm and
  last-token logits to the CPU; ``output_hidden_states`` (+ ``output_logits``), kept on the GPU.

"GC s/run" is the time Python's garbage collector took inside each timed run (median) and the
full collections among them, for the configuration and for the vanilla runs paired with it: after
a compile the heap is large and a full collection would cost a noticeable part of whichever run it
lands in.

Times are medians of ``--repeats`` runs after a warm-up run (which compiles in compiled mode).
dmi runs on a twin of the model sharing its weights, and every timed run of a configuration
follows a timed vanilla run of the unpatched model: ratio = median vanilla time of those pairs /
median time of the configuration, so slow drift of the machine (clocks, temperature) cancels;
"pairs" gives each run's own ratio to the vanilla run before it (lowest, median, highest): with
vanilla's runs spreading by several percent, the ratio of medians can be a lucky draw of them.
Compiled generate on these models is host-bound, so wall ratios move by several percent with no
change on the device. Each configuration is therefore also profiled once (``--no-gpu-busy`` skips
it): "GPU ms/step" is the union of its kernels' and copies' intervals per step, "GPU ratio"
vanilla's over it, which is what dmi costs the device; "compute ratio" the same without the copies
(the drain's D2H runs on the copy engine beside the kernels and counts in GPU ms only where it
fills a gap the host left). Also printed: dmi's GPU memory (ring + control tensors), bytes
captured per run, achieved D2H rate, drops, µs per enabled site per step ((t - t_vanilla) /
(forward steps x sites)).

    python perf/offline.py                      # Qwen3-8B, batch 32, eager + compiled, baselines, one Zarr run
    python perf/offline.py --quick              # small smoke run (Qwen3-0.6B, batch 16, 32 tokens)
    python perf/offline.py --models qwen3-0.6b,qwen3-8b,llama-3.1-8b --batches 16,32,64

Results are printed (``--results FILE``: also as markdown).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's dmi

import dmi   # noqa: E402
from common import (DEV, GiB, HEADLINE_SPEC, GcClock, Skip, build, gen_kwargs, gpu_profile, hidden_spec, raw_write_gbs,   # noqa: E402
                    internals_spec, md_header, md_row, prompts, ring_for, rotated, spread, store_dir, timed, twin)

_MODEL: dict = {}


@functools.cache
def _gc_clock() -> GcClock:
    """The process's one GC clock ("GC s/run"), made by the first matrix, not at import (a
    ``--headline`` run needs no callback on its collections)."""
    return GcClock()


def probed(run, fn):
    """``fn`` with a live linear probe subscribed (``Run.subscribe``): a random direction dotted with
    every row of the middle layer's residual stream, each step as it drains (what a safety team's
    probe does), cancelled after."""
    mid = run.plan.sites[len(run.plan.sites) // 2]
    out = mid.outputs[0].name
    w = np.random.default_rng(0).standard_normal(mid.shape[-1]).astype(np.float32)
    scores = []

    def probe(captures):
        for c in captures.values():
            scores.append(c.values[out].astype(np.float32) @ w)

    def go():
        sub = run.subscribe(probe, sites=mid.name)
        try:
            fn()
        finally:
            sub.cancel()
    return go


def run_matrix(name: str, batch: int, mode: str, args, out: list, log) -> None:
    if name not in _MODEL:
        _MODEL.clear()
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
        _MODEL[name] = build(name)
        _MODEL[name + "/twin"] = twin(_MODEL[name])
    model, dmodel = _MODEL[name], _MODEL[name + "/twin"]
    cfg = model.config
    new = args.new_tokens if mode == "compiled" else args.eager_new_tokens
    enc, lengths = prompts(batch, args.prompt_min, args.prompt_max, cfg.vocab_size)
    kw = gen_kwargs(mode, new)
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    real = int(lengths.sum())
    hid_prefill = real * (L + 1) * H * 2 + batch * V * 2
    hid_bytes = hid_prefill + (new - 1) * batch * ((L + 1) * H * 2 + V * 2)
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    int_row = L * (q_dim * 2 + kv_dim * 2 + 3 * H) * 2
    int_bytes = (real + (new - 1) * batch) * int_row
    reps = args.repeats
    rows = {}
    clocked = clocked_with(_gc_clock())

    def record(label, timed_runs, run=None, sites=0, note=""):
        times, before, vtimes, busy, after, gcs, vgcs = timed_runs
        t = statistics.median(times)
        row = {"model": name, "batch": batch, "mode": mode, "config": label, "seconds": t, "runs": [round(x, 3) for x in times],
               "tok_s": batch * new / t, "note": note}
        row["vanilla_runs"] = [round(x, 3) for x in vtimes]
        row["gc_s"], row["vanilla_gc_s"] = gcs, vgcs     # per run: (GC seconds, full collections)
        if busy is not None:
            row["gpu_ms_step"], row["compute_ms_step"] = busy["busy_ms"], busy["compute_ms"]
            if "vanilla" in rows and "gpu_ms_step" in rows["vanilla"]:
                row["gpu_ratio"] = rows["vanilla"]["gpu_ms_step"] / busy["busy_ms"]
                row["compute_ratio"] = rows["vanilla"]["compute_ms_step"] / busy["compute_ms"]
        if run is not None:
            st = after            # before the profiled run: bytes and drops of the timed runs only
            n = len(times)
            row.update(bytes=(st["bytes_drained"] - before["bytes_drained"]) / max(n, 1),
                       drops=st["dropped_captures"] - before["dropped_captures"],
                       stall=(st["stall_seconds"] - before["stall_seconds"]) / max(n, 1),
                       ring=run.plan.policy.ring_bytes, gpu_bytes=getattr(run.ring, "device_bytes", 0),
                       sites=sites)
            row["d2h_gbs"] = row["bytes"] / t / 1e9
        rows[label] = row
        out.append(row)
        # against vanilla timed alternately with this config (else the vanilla row)
        t_van = statistics.median(vtimes) if vtimes else rows["vanilla"]["seconds"] if "vanilla" in rows else t
        ratio = t_van / t
        row["ratio"], row["vanilla_seconds"] = ratio, t_van
        if vtimes and len(vtimes) == len(times):   # each run against the vanilla run just before it
            row["pair_ratios"] = sorted(v / d for v, d in zip(vtimes, times))
        if label != "vanilla" and sites:
            row["us_site_step"] = (t - t_van) / (new * sites) * 1e6
        log(f"  {name} b{batch} {mode:8s} {label:28s} {t:7.3f}s  ratio {ratio:.3f}  " +
            (f"{row['bytes'] / 1e9:.2f} GB/run {row['d2h_gbs']:.1f} GB/s drops {row['drops']}" if run else "") + f" {note}")

    def vanilla():
        model.generate(**enc, **kw)

    def reps_of(fn, n=reps, run=None, warm=True, paired=True):
        """n timed runs of fn, each after a timed vanilla run when paired."""
        for _ in range(warm * (2 if mode == "compiled" else 1)):
            fn()                          # warm-up (compiles, records CUDA graphs in compiled mode)
        if paired:
            vanilla()
        before = run.stats() if run is not None else None
        times, vtimes, gcs, vgcs = [], [], [], []
        for _ in range(n):
            if paired:
                clocked(vanilla, vtimes, vgcs)
            clocked(fn, times, gcs)
        after = run.stats() if run is not None else None
        busy = gpu_profile(fn, new) if args.gpu_busy and DEV == "cuda" else None
        return times, before, vtimes, busy, after, gcs, vgcs

    with torch.no_grad():
        record("vanilla", reps_of(vanilla, paired=False))
        ring = int(args.ring_gib * GiB) if args.ring_gib else ring_for(hid_prefill)
        if args.rounds and mode == "compiled":
            return _rounds(model, dmodel, enc, kw, hidden_spec(ring, args.host_mib << 20, writer=args.writer),
                           n_sites=L + 2, args=args, record=record, vanilla=vanilla, clocked=clocked)
        if args.aa_row:        # an unpatched twin timed as the dmi rows are: what alternating two models costs
            aa = twin(model)
            record("vanilla twin (A/A)", reps_of(lambda: aa.generate(**enc, **kw)), note="no dmi")
            del aa
        if mode == "eager" and not args.no_baselines:
            record("baseline forward_hook->cpu", reps_of(lambda: _hooked(dmodel, enc, kw), max(1, reps - 1)),
                   note="(sync .to('cpu') of every layer output, final norm, last logits)")
            record("baseline output_hidden_states", reps_of(lambda: dmodel.generate(
                **enc, **kw, output_hidden_states=True, output_logits=True, return_dict_in_generate=True),
                max(1, reps - 1)), note="(kept on the GPU)")

        sd = store_dir()
        n_hidden = L + 2
        run = dmi.load(dmodel, hook_spec=hidden_spec(ring, args.host_mib << 20, args.writer),
                       store=sd / "hidden.zarr", overwrite=True)
        try:
            run.set_enabled(False)
            record("dmi null", reps_of(lambda: dmodel.generate(**enc, **kw), run=run), run, sites=n_hidden)
            run.set_enabled(True)

            def stepped(run, to_store: bool):
                def go():
                    dmodel.generate(**enc, **kw)
                    run.flush()
                if to_store:
                    return go
                def skip():
                    with Skip(run):
                        go()
                return skip
            record("dmi hidden+logits -> host", reps_of(stepped(run, False), run=run), run, sites=n_hidden,
                   note=f"ring {ring / GiB:.2f} GiB, {run.steps_ahead[0]} steps begun ahead")
            if args.probe_row:
                record("dmi hidden+logits -> host + live probe", reps_of(probed(run, stepped(run, False)), run=run),
                       run, sites=n_hidden, note="a subscriber scoring the middle layer's rows")
            if run.step_ahead and args.ahead_row and mode == "compiled":
                run.step_ahead = False             # each decode step begun right before its forward
                record("dmi hidden+logits -> host, begun at forward", reps_of(stepped(run, False), run=run), run,
                       sites=n_hidden, note="engine.step_ahead: false")
                run.step_ahead = True
            if run.drain_paced and args.timer_row:
                run.drain_paced = False            # the drain on its 100 ms timer only (run.drain_window)
                record("dmi hidden+logits -> host, drain on timer", reps_of(stepped(run, False), run=run), run,
                       sites=n_hidden, note="no drain windows")
                run.drain_paced = True
            if args.copy_at_step_row and hasattr(run.ring, "copy_at_step") and not run.ring.copy_at_step:
                run.ring.copy_at_step = True       # each step copied out as the next begins (cuda_ring doc)
                record("dmi hidden+logits -> host, copy at step", reps_of(stepped(run, False), run=run), run,
                       sites=n_hidden, note=f"{run.ring.steps_copied_at_step} steps copied at step")
                run.ring.copy_at_step = False
            if not args.no_zarr and mode in args.zarr_modes.split(","):
                label = "dmi hidden+logits -> zarr" + (f" (writer {args.writer})" if args.writer != "thread" else "")
                record(label, reps_of(stepped(run, True), max(1, min(reps, args.zarr_repeats)), run=run, warm=False), run,
                       sites=n_hidden, note=f"store {sd}")
        finally:
            run.close()
            shutil.rmtree(sd, ignore_errors=True)
        del run
        gc.collect()

        if args.traced_row and mode == "compiled":
            sd = store_dir()
            run = dmi.load(dmodel, hook_spec=hidden_spec(ring, args.host_mib << 20, args.writer)
                           | {"engine": {"traced": "all"}}, store=sd / "traced.zarr", overwrite=True)
            try:
                record("dmi hidden+logits -> host, traced", reps_of(stepped(run, False), run=run), run, sites=n_hidden,
                       note="engine.traced: all")
            finally:
                run.close()
                shutil.rmtree(sd, ignore_errors=True)
            del run
            gc.collect()

        if not args.no_internals:
            sd = store_dir()
            ring = ring_for(real * int_row)
            run = dmi.load(dmodel, hook_spec=internals_spec(ring, args.host_mib << 20), store=sd / "int.zarr",
                           overwrite=True)
            try:
                def go():
                    with Skip(run):
                        dmodel.generate(**enc, **kw)
                        run.flush()
                record("dmi internals -> host", reps_of(go, max(1, reps - 1), run=run), run, sites=7 * L,
                       note=f"ring {ring / GiB:.2f} GiB, {int_bytes / 1e9:.1f} GB/run expected")
            finally:
                run.close()
                shutil.rmtree(sd, ignore_errors=True)
            del run
            gc.collect()
        torch._dynamo.reset()
    log(f"  (bytes expected per run: hidden+logits {hid_bytes / 1e9:.2f} GB, prefill step {hid_prefill / 1e9:.2f} GB)")


def clocked_with(gc_clock: GcClock):
    def clocked(f, into: list, gcs_into: list) -> None:
        """Time f into ``into``, and the GC's seconds and full collections during it into ``gcs_into``."""
        s, full = gc_clock.seconds, gc_clock.full
        into.append(timed(f))
        gcs_into.append((round(gc_clock.seconds - s, 4), gc_clock.full - full))
    return clocked


_COUNTED = ("bytes_drained", "dropped_captures", "stall_seconds")


def _rounds(model, dmodel, enc, kw, spec, n_sites, args, record, vanilla, clocked) -> None:
    """``--rounds N``: the A/A twin, dmi null, dmi hidden+logits -> host and (unless ``--no-zarr``)
    -> zarr (``--writer``) timed round-robin, N rounds, the order rotating each round, every run
    right after a timed vanilla run. Each row then meets the same alternation of compiled models
    (which slows vanilla's own runs too) and the same drift of the host, so the A/A
    row is the others' calibration: a dmi row's cost is its paired ratio against the A/A row's, not
    against 1. The Zarr row's store grows by a run's bytes each round (6 GB for Qwen3-8B batch 32)."""
    aa = twin(model)
    sd = store_dir()
    run = dmi.load(dmodel, hook_spec=spec, store=sd / "hidden.zarr", overwrite=True)

    def null():
        run.set_enabled(False)
        try:
            dmodel.generate(**enc, **kw)
        finally:
            run.set_enabled(True)

    def hidden():
        with Skip(run):
            dmodel.generate(**enc, **kw)
            run.flush()

    def stored():
        dmodel.generate(**enc, **kw)
        run.flush()

    configs = [("vanilla twin (A/A)", lambda: aa.generate(**enc, **kw), None),
               ("dmi null", null, run), ("dmi hidden+logits -> host", hidden, run)]
    if args.probe_row:
        configs.append(("dmi hidden+logits -> host + live probe", probed(run, hidden), run))
    if not args.no_zarr:
        configs.append((f"dmi hidden+logits -> zarr ({args.writer})", stored, run))
    pd_run = None
    if args.drain_row:       # the store writer's child drains the ring itself (policy.drain: process)
        pd_model = twin(model)
        pd_spec = {**spec, "policy": {**spec["policy"], "drain": "process"}, "store": {**spec["store"], "writer": "process"}}
        pd_run = dmi.load(pd_model, hook_spec=pd_spec, store=sd / "pdrain.zarr", overwrite=True)

        def pdrained():
            pd_model.generate(**enc, **kw)
            pd_run.flush()
        configs.append(("dmi hidden+logits -> zarr (drain process)", pdrained, pd_run))
    runs = {label: ([], [], [], [], dict.fromkeys(_COUNTED, 0)) for label, _, _ in configs}
    try:
        for _, fn, _ in configs:
            fn(), fn()            # warm-up: compiles, records CUDA graphs
        vanilla()
        for r in range(args.rounds):
            for label, fn, its_run in rotated(configs, r):
                times, vtimes, gcs, vgcs, counted = runs[label]
                clocked(vanilla, vtimes, vgcs)
                before = (its_run or run).stats()
                clocked(fn, times, gcs)
                after = (its_run or run).stats()
                for k in _COUNTED:
                    counted[k] += after[k] - before[k]
        for label, fn, its_run in configs:
            times, vtimes, gcs, vgcs, counted = runs[label]
            busy = gpu_profile(fn, kw["max_new_tokens"]) if args.gpu_busy and DEV == "cuda" else None
            zero = dict.fromkeys(_COUNTED, 0)
            dmi_row = its_run is not None
            record(label, (times, zero if dmi_row else None, vtimes, busy, counted if dmi_row else None, gcs, vgcs),
                   its_run, sites=n_sites if dmi_row else 0,
                   note=f"{args.rounds} rounds" + (f", {run.steps_ahead[0]} steps begun ahead" if label.endswith("host")
                                                    else ""))
        aa_pairs = statistics.median(v / d for v, d in zip(runs[configs[0][0]][1], runs[configs[0][0]][0]))
        for label, _, _ in configs[1:]:
            times, vtimes = runs[label][:2]
            print(f"  {label}: median pair ratio / the A/A row's = "
                  f"{statistics.median(v / d for v, d in zip(vtimes, times)) / aa_pairs:.3f}", flush=True)
    finally:
        run.close()
        if pd_run is not None:
            pd_run.close()
        shutil.rmtree(sd, ignore_errors=True)
        gc.collect()
        torch._dynamo.reset()


def _hooked(model, enc, kw):
    """The naive baseline: forward hooks that copy to the CPU synchronously."""
    sink = []
    hooks = [layer.register_forward_hook(lambda m, a, o: sink.append(o[0].detach().to("cpu") if isinstance(o, tuple)
                                                                      else o.detach().to("cpu")))
             for layer in model.model.layers]
    hooks.append(model.model.norm.register_forward_hook(lambda m, a, o: sink.append(o.detach().to("cpu"))))
    hooks.append(model.lm_head.register_forward_hook(lambda m, a, o: sink.append(o[:, -1].detach().to("cpu"))))
    try:
        model.generate(**enc, **kw)
    finally:
        for h in hooks:
            h.remove()
    return len(sink)


def _gc_cell(per_run: list | None) -> str:
    """Median GC seconds per run and the full collections of all runs."""
    if not per_run:
        return ""
    return "%.3f (%d)" % (statistics.median(s for s, _ in per_run), sum(f for _, f in per_run))


def table(rows: list[dict]) -> str:
    lines = [md_header(["model", "batch", "mode", "config", "tok/s", "ratio", "pairs (low / median / high)",
                        "s (median)", "GPU ms/step", "GPU ratio", "compute ratio", "GB/run", "D2H GB/s", "drops",
                        "ring GiB", "dmi GPU MiB", "µs/site/step", "GC s/run (full)", "its vanilla's"], text=4)]
    for r in rows:
        dm = r.get("bytes") is not None
        cells = [r["model"], str(r["batch"]), r["mode"], r["config"], "%.0f" % r["tok_s"], "%.3f" % r["ratio"],
                 spread(r["pair_ratios"]) if r.get("pair_ratios") else "",
                 "%.3f" % r["seconds"], "%.2f" % r["gpu_ms_step"] if "gpu_ms_step" in r else "",
                 "%.3f" % r["gpu_ratio"] if "gpu_ratio" in r else "",
                 "%.3f" % r["compute_ratio"] if "compute_ratio" in r else "",
                 "%.2f" % (r["bytes"] / 1e9) if dm else "", "%.1f" % r["d2h_gbs"] if dm else "",
                 str(r["drops"]) if dm else "", "%.2f" % (r["ring"] / GiB) if dm else "",
                 "%.0f" % (r["gpu_bytes"] / 2**20) if dm else "",
                 "%.2f" % r["us_site_step"] if "us_site_step" in r else "",
                 _gc_cell(r.get("gc_s")), _gc_cell(r.get("vanilla_gc_s"))]
        lines.append(md_row(cells))
    return "\n".join(lines)


# the headline's configurations (hook specs); "default" is what a new user runs
HEADLINE_CONFIGS = {"default": HEADLINE_SPEC,
                    "writer-thread": HEADLINE_SPEC | {"store": {"writer": "thread"}},
                    "writer-process": HEADLINE_SPEC | {"store": {"writer": "process"}},
                    "writer-pool": HEADLINE_SPEC | {"store": {"writer": "pool"}},
                    "writer-pool-16mib": HEADLINE_SPEC | {"store": {"writer": "pool", "chunk_bytes": "16MiB"}},
                    "writer-pool-host-256mib": HEADLINE_SPEC | {"store": {"writer": "pool"}, "policy": {"host_bytes": "256MiB"}},
                    "writer-thread-host-256mib": HEADLINE_SPEC | {"store": {"writer": "thread"},
                                                                  "policy": {"host_bytes": "256MiB"}},
                    "host-4gib": HEADLINE_SPEC | {"policy": {"host_bytes": "4GiB"}},
                    "chunks-16mib": HEADLINE_SPEC | {"store": {"chunk_bytes": "16MiB"}},
                    "traced": HEADLINE_SPEC | {"engine": {"traced": "all"}}}


def end_to_end(name: str, batch: int, mode: str, args, log) -> list[dict]:
    """The headline figure: what a user's run costs, store included. Default policy and store
    settings (the hook spec names only its sites), the store on local disk (``--store-dir``).
    ``--rounds`` rounds, each: vanilla's K generate() calls in a row, then each configuration's
    twin's K calls followed by ``run.flush()`` (every row drained, written and committed: the
    backlog a run leaves is paid here); the last round also pays ``run.close()``. Ratio: vanilla's
    total time over the configuration's, and each round's own pair (low / median / high). Each
    store is then opened and every group's rows counted against the tokens generated: 0 drops,
    no row missing."""
    import transformers
    model = build(name)
    enc, lengths = prompts(batch, args.prompt_min, args.prompt_max, model.config.vocab_size)
    new = args.new_tokens if mode == "compiled" else args.eager_new_tokens
    kw = gen_kwargs(mode, new)
    K = args.generates
    root = Path(tempfile.mkdtemp(prefix="dmi-e2e-", dir=args.store_dir))
    configs = args.configs.split(",")
    van, runs = [], {}
    with torch.no_grad():
        model.generate(**enc, **kw)                       # vanilla's warm-up (its compile)
        for c in configs:
            dmodel = twin(model)
            run = dmi.load(dmodel, hook_spec=HEADLINE_CONFIGS[c], store=root / f"{len(runs)}.zarr")
            dmodel.generate(**enc, **kw)                  # its warm-up (its compile), flushed untimed
            run.flush()
            runs[c] = (dmodel, run, [])
        for r in range(args.rounds):
            def vanilla_round():
                for _ in range(K):
                    model.generate(**enc, **kw)
            van.append(timed(sampling(vanilla_round, args.pyspy, f"r{r}-vanilla", gil=args.pyspy_gil or r % 2 == 1)))
            for c, (dmodel, run, times) in runs.items():
                def dmi_round():
                    for _ in range(K):
                        dmodel.generate(**enc, **kw)
                    run.flush()
                times.append(timed(sampling(dmi_round, args.pyspy, f"r{r}-{c}", gil=args.pyspy_gil or r % 2 == 1)))
            log(f"  round {r}: vanilla {van[-1]:.2f} s, " + ", ".join(f"{c} {t[-1]:.2f} s" for c, (_, _, t) in runs.items()))
    rows = []
    generates = K * args.rounds + 1
    tokens = generates * (int(lengths.sum()) + (new - 1) * batch)     # prefill rows + decode rows per generate
    for c, (dmodel, run, times) in runs.items():
        closed = timed(run.close)
        times[-1] += closed
        st = run.stats()
        tree = dmi.open(run.store)
        got = [tree[g].dataset.sizes["token"] for g in ("layers/resid_post", "final_norm")]
        complete = all(v == tokens for v in got) and tree["logits"].dataset.sizes["token"] == generates * new * batch
        rows.append({"model": name, "batch": batch, "mode": mode, "config": c, "K": K, "rounds": args.rounds,
                     "ratio": sum(van) / sum(times), "pairs": spread(v / o for v, o in zip(van, times)),
                     "close_s": closed, "store_gb": st["store_bytes"] / 1e9, "captured_gb": st["bytes_captured"] / 1e9,
                     "drops": st["dropped_captures"], "stall_s": st["stall_seconds"], "rows_complete": complete,
                     "streamed": st["streamed_steps"], "vanilla_s": statistics.median(van) / K,
                     # what the store's disk must sustain for dmi to keep vanilla's pace
                     "store_gbs_needed": st["store_bytes"] / 1e9 / generates / (statistics.median(van) / K),
                     "versions": f"torch {torch.__version__}, transformers {transformers.__version__}"})
        r = rows[-1]
        log(f"  {name} {mode} {c}: {r['ratio']:.3f} of vanilla (pairs {r['pairs']}), "
            f"close {closed:.2f} s, store {r['store_gb']:.2f} GB ({r['store_gbs_needed']:.2f} GB/s at vanilla's pace), "
            f"drops {r['drops']}, rows complete {complete}")
        del tree
        shutil.rmtree(run.store, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return rows


def sampling(fn, where: str | None, name: str, gil: bool):
    """``fn``, or with ``--pyspy DIR`` a call of it that py-spy records into DIR/NAME[-gil].txt
    (perf/common/pyspy.py summary/compare read them): odd rounds sample only the GIL's holder."""
    if not where:
        return fn
    from common import pyspy
    out = Path(where) / f"{name}{'-gil' if gil else ''}.txt"
    return lambda: pyspy.sampled(fn, out, gil=gil)


def headline_table(rows: list[dict]) -> str:
    lines = [md_header(["model", "batch", "mode", "configuration", "K x rounds", "dmi + store / vanilla",
                        "pairs (low / median / high)", "close s", "store GB", "store GB/s at vanilla's pace",
                        "streamed steps", "drops",
                        "rows complete", "vanilla s / generate"], text=4)]
    for r in rows:
        lines.append(md_row([r["model"], r["batch"], r["mode"], r["config"], f"{r['K']} x {r['rounds']}",
                             f"**{r['ratio']:.3f}**", r["pairs"], f"{r['close_s']:.2f}", f"{r['store_gb']:.2f}",
                             f"{r['store_gbs_needed']:.2f}",
                             r["streamed"], r["drops"], r["rows_complete"], f"{r['vanilla_s']:.2f}"]))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headline", action="store_true",
                    help="the end-to-end figure only: default policy, the store written on local disk, "
                         "--generates calls in a row + flush per round, close counted (end_to_end)")
    ap.add_argument("--generates", type=int, default=4, help="--headline: generate() calls in a row per round (K)")
    ap.add_argument("--store-dir", default=None, help="--headline: where the store goes (default: the temp dir)")
    ap.add_argument("--raw-bytes", type=int, default=2 * GiB,
                    help="--headline: size of the raw sequential write probe of the store's directory (0: skip it)")
    ap.add_argument("--pyspy", default=None, metavar="DIR",
                    help="--headline: py-spy records each timed round into DIR (odd rounds: the GIL's holder only)")
    ap.add_argument("--pyspy-gil", action="store_true", help="--pyspy: every round samples only the GIL's holder")
    ap.add_argument("--configs", default="default",
                    help=f"--headline: configurations, comma-separated, of {', '.join(HEADLINE_CONFIGS)}")
    ap.add_argument("--models", default="qwen3-8b")
    ap.add_argument("--batches", default="32")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--new-tokens", type=int, default=256, help="new tokens in compiled mode")
    ap.add_argument("--eager-new-tokens", type=int, default=128, help="new tokens in eager mode")
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--zarr-repeats", type=int, default=1)
    ap.add_argument("--ring-gib", type=float, default=None,
                    help="the hidden-states rows' GPU ring (default: 1 GiB, or above the prefill step where that does "
                         "not fit with room to spare)")
    ap.add_argument("--host-mib", type=int, default=2048, help="policy.host_bytes (pinned staging) in MiB")
    ap.add_argument("--no-zarr", action="store_true")
    ap.add_argument("--writer", default="thread", choices=["thread", "process", "pool"],
                    help="store.writer of the Zarr row: the exporter in this process or in its own")
    ap.add_argument("--zarr-modes", default="compiled", help="modes that also time the Zarr store (slow exporter)")
    ap.add_argument("--no-internals", action="store_true")
    ap.add_argument("--drain-row", action="store_true",
                    help="--rounds: a row whose store writer's child drains the ring (policy.drain: process, "
                         "store.writer: process), on its own twin, into a Zarr store")
    ap.add_argument("--aa-row", action="store_true",
                    help="also an unpatched twin of the model (its own compile), timed paired with vanilla as the "
                         "dmi rows are: the A/A ratio, what alternating two models costs without dmi")
    ap.add_argument("--rounds", type=int, default=0,
                    help="compiled mode: time the A/A twin, dmi null, dmi hidden+logits -> host and (unless --no-zarr) "
                         "-> zarr round-robin, this many rounds, each run paired with a vanilla run (the other rows "
                         "and options are skipped)")
    ap.add_argument("--probe-row", action="store_true",
                    help="also the host row with a live subscriber (Run.subscribe) scoring the middle layer's rows")
    ap.add_argument("--ahead-row", action="store_true",
                    help="compiled: also the host row with each decode step begun before its forward "
                         "(engine.step_ahead: false)")
    ap.add_argument("--timer-row", action="store_true",
                    help="also the host row with the drain on its timer only (no drain window after each step)")
    ap.add_argument("--no-copy-at-step", dest="copy_at_step_row", action="store_false",
                    help="skip the host row with engine.copy_at_step's copy-out")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--traced-row", action="store_true",
                    help="compiled mode: also the hidden capture as traced ops (engine.traced: all)")
    ap.add_argument("--no-gpu-busy", dest="gpu_busy", action="store_false",
                    help="skip the profiled run per configuration (GPU busy ms per step, GPU ratio)")
    ap.add_argument("--quick", action="store_true", help="qwen3-0.6b, batch 16, 32 new tokens, 1 repeat")
    ap.add_argument("--results", default=None, help="write the table here (markdown)")
    ap.add_argument("--json", default=os.environ.get("DMI_PERF_JSON"))
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.batches, args.new_tokens, args.eager_new_tokens, args.repeats = "qwen3-0.6b", "16", 32, 32, 1
        args.zarr_repeats, args.zarr_modes = 1, "eager,compiled"
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.recompile_limit = 64
    t0 = time.perf_counter()
    out: list[dict] = []

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    device_name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    log(f"{device_name} torch {torch.__version__} transformers "
        f"{__import__('transformers').__version__} dmi {dmi.__version__}")
    if args.headline:
        args.rounds = args.rounds or 3
        if args.raw_bytes:       # the bound a store on this disk sets: compare "store GB/s at vanilla's pace"
            where = Path(args.store_dir or tempfile.gettempdir())
            log(f"raw sequential write of {where}: {raw_write_gbs(where, args.raw_bytes):.2f} GB/s "
                f"({args.raw_bytes / GiB:g} GiB in 16 MiB writes, fsync)")
        for name in args.models.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                for mode in args.modes.split(","):
                    log(f"{name} batch {batch} {mode}: {args.generates} generates x {args.rounds} rounds + close")
                    out.extend(end_to_end(name, batch, mode, args, log))
                    if args.json:
                        Path(args.json).write_text(json.dumps(out, indent=1))
        text = headline_table(out)
        print("\n" + text + f"\n\ncommand: python perf/offline.py {' '.join(argv if argv is not None else sys.argv[1:])}")
        return out
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for mode in args.modes.split(","):
                log(f"{name} batch {batch} {mode}")
                run_matrix(name, batch, mode, args, out, log)
                if args.json:
                    Path(args.json).write_text(json.dumps(out, indent=1))
    text = table(out)
    cmd = "python perf/offline.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print("\n" + text)
    print(f"\ncommand: {cmd.strip()}   total {time.perf_counter() - t0:.0f} s")
    if args.results:
        Path(args.results).write_text(
            f"# Offline throughput ({device_name}, torch {torch.__version__}, "
            f"transformers {__import__('transformers').__version__})\n\n`{cmd.strip()}`\n\n{text}\n")
    return out


if __name__ == "__main__":
    main()
