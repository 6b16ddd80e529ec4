"""The capture session inside a vLLM worker: the process that owns the model.

Started by the ``Worker.load_model`` wrapper (``compat.wrap_worker_load_model``) when the engine's
config carries a dmi section (``additional_config={"dmi": {...}}``, or ``DMI_HOOK_SPEC`` in the
environment): it plans the hook spec against the architecture spec's ``vllm`` anchors, starts a
:class:`dmi.run.Run`, patches the model (before vLLM compiles it), and brackets each engine step
from the runner's batch. ``runner.shutdown`` (engine shutdown) or process exit closes the store.
Before the model is built, :func:`prepare` gives the steps above the largest CUDA graph a compile
range of their own in which the captures are traced ops (the hook spec's ``engine.traced: range``).
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import hashlib
import json
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from . import compat
from ...errors import DmiError, PolicyError, StoreError
from ...pipeline import build_run, find_arch, plan_run
from ...plan import build_plan
from ...run import Run
from ...run.steps import host_ids
from ...settings import EngineOptions
from ...spec import find_arch_spec, load_arch_spec, load_hook_spec
from ...store.location import is_remote
from ...store import shards
from .config import read_config
from .engine import VllmEngine
from .patch import layer_anchor, module_path, resolve
from .pattern import KeyStore, SESSIONS_BY_RUN
from .policy import RequestGate, ServePolicy
from .steps import StepBuilder
from .writes import StepWrites


log = logging.getLogger("dmi.vllm")

_NO_PAD = np.zeros(1, np.int64)           # a flat batch: no request is left-padded (one array: compared by identity)
SESSIONS: dict[str, "Session"] = {}        # session token -> the session of this process
_lock = threading.Lock()


class Session:
    """One run bound to one vLLM model runner."""

    def __init__(self, token: str, run: Run, runner, gate: RequestGate):
        self.token, self.run, self.runner, self.gate = token, run, runner, gate
        # the store's request ids: the caller's (RequestOutput.request_id), not the engine's suffixed ones
        run.requests.name_of = compat.external_request_id
        self.steps = StepBuilder(run.requests)
        self.keys = KeyStore()                  # attn.pattern: keys of the observed layers, per request
        self._batch = None
        self._unwrap = None
        self.closed = False
        self.capturing = True                   # False once capture stopped (stop_capture): the store is closed
        self.error: BaseException | None = None
        self.padded_steps = 0                   # steps run on a CUDA graph padded past their real tokens
        self.padding_rows = 0                   # those padding rows (never selected, never copied)
        self.steps_repeated = 0                 # steady decode steps begun as the last one again (StepBuilder.repeat)
        self.rank = 0                           # tensor parallel rank (0: no tensor parallelism)
        self.stop_on_store_error = False        # policy.on_store_error drop: a failed store stops capture
        self.clock = HookClock()                # host time in the step hooks below
        self.writes = StepWrites(run, runner, compat.request_extra_args) if run.interventions else None
        self.returns = None                     # small captures requests ask back (requests.return: StepReturns)

    # --- per step (called from the runner wrappers) ----------------------------------------------
    def on_batch(self, runner, scheduler_output) -> None:
        t0 = self.clock.now()
        last = self.steps.last_ids if self.capturing else None
        if last is not None and compat.repeats_last_step(runner, scheduler_output, last):
            self._batch = (runner, scheduler_output)      # read only if the step cannot repeat the last
            self.clock.add("batch", t0)
            return
        batch = compat.read_batch(runner, scheduler_output)
        if batch.spec_decode:      # refused at load (_check_engine); a guard against a config that changed
            raise DmiError("dmi: a step with draft tokens (speculative decoding) is not supported")
        self._batch = batch
        self.clock.add("batch", t0)

    def on_forward(self, num_tokens_padded: int, input_ids=None) -> None:
        batch, self._batch = self._batch, None
        if batch is None or self.closed:
            return
        t0 = self.clock.now()
        self.clock.steps += 1
        repeated = self.steps_repeated
        try:
            self._begin(batch, num_tokens_padded, input_ids)
        finally:
            self.clock.add("begin", t0, repeated=self.steps_repeated > repeated)

    def _begin(self, batch, num_tokens_padded: int, input_ids=None) -> None:
        if not self.capturing:      # capture stopped: the interventions and the return channel go on
            if self.writes is not None:
                self.writes.begin(batch, num_tokens_padded)
            if self.returns is not None:
                self.returns.begin(batch)
            return
        if isinstance(batch, tuple):       # on_batch saw the last step's requests decoding again
            got = self.steps.repeat(num_tokens_padded)
            if got is not None:
                if self.writes is not None:
                    self.writes.begin(None, num_tokens_padded)
                if self.returns is not None:
                    self.returns.begin(None)
                self._count_padding(len(self.steps.last_ids), num_tokens_padded)   # (opted-out rows are real too)
                got[0].ids = host_ids(input_ids)
                self.run.begin_tokens(got[0], _NO_PAD, keep=got[1], held=got[2])
                self.steps_repeated += 1
                return
            batch = compat.read_batch(*batch)
        self._count_padding(int(batch.num_scheduled.sum()), num_tokens_padded)
        if self.writes is not None:
            self.writes.begin(batch, num_tokens_padded)
        if self.returns is not None:
            self.returns.begin(batch)
        st, keep, held = self.steps.build(batch, num_tokens_padded, self.gate.want, len(self.run.plan.sites),
                                          wants_all=self.gate.want_all)
        self.gate.forget(batch.finished)
        if batch.finished and self.keys.keys:
            self.keys.forget(set(self.run.requests.intern(sorted(batch.finished))))
        st.ids = host_ids(input_ids)      # the step's input ids (its rows index them): the token_id coordinate
        self.run.begin_tokens(st, _NO_PAD, keep=keep, held=held)

    def _count_padding(self, real: int, num_tokens_padded: int) -> None:
        if num_tokens_padded > real:
            self.padded_steps += 1
            self.padding_rows += num_tokens_padded - real

    @contextlib.contextmanager
    def on_dummy_run(self):
        """Around vLLM's ``_dummy_run`` (profiling, compile warm-up, CUDA-graph warm-up and capture):
        no step is open, so the kernel ring launches as while capturing a graph, with a flat geometry.

        * graph launches (``ring.graph_mode``): the warm-up run vLLM makes before capturing each graph
          launches the same Triton kernels the capture will (they read the disarmed control block and
          exit), so Triton compiles and loads them outside the capture: loading a module while a
          stream is capturing is an error. (Eager launches would not do: eager steps copy with torch.)
        * geometry ``(1, None)``: one flat batch whose token count is the tensor's own. vLLM captures
          one graph per padded token count, so each graph bakes its own size as the row bound (the
          latest step's geometry would bake the wrong one, and without any, a capture raises "the
          step's batch size is unknown"). A replay reads the step's real row count from the control
          block, so padding rows are never copied.
        """
        launching = getattr(self.run.ring, "launching_without_step", None)    # kernel rings only
        if self.closed or not self.capturing or launching is None:
            yield
            return
        with launching():
            yield

    def on_step_end(self) -> None:
        if self.closed:
            return
        t0 = self.clock.now()
        if self.returns is not None:
            self.returns.end()
        if not self.capturing:
            self.clock.add("end", t0)
            return
        # the device side of the end marker (CUDA ring), called directly: this runs after
        # execute_model, outside any graph, where the dmi::step_end op would only add its dispatch
        self.run.step_end_op()
        self.run.end_step()
        if self.stop_on_store_error and self.run.exporter.error is not None:
            self.stop_capture()
            return
        if self.steps.last_ids is not None:
            # a decode step: its forward (one CUDA graph) keeps the GPU busy well past the host's
            # work for the next step, so the drain runs now rather than inside a host-bound step
            self.run.drain_window()
        self.clock.add("end", t0)

    # --- lifecycle --------------------------------------------------------------------------------
    def stop_capture(self) -> None:
        """The store failed (full, disk full, a write error) under ``policy.on_store_error: drop``:
        capture stops here and the engine serves on without it. The store is closed with what it
        committed, and its root attribute ``capture_stopped`` says at which step and why (the
        server's /metrics reads it: ``dmi.adapters.vllm.metrics``)."""
        import datetime
        exp = self.run.exporter
        reason = str(exp.error)
        self.run.close_attrs["capture_stopped"] = {
            "step": self.run._step, "committed_step": exp.committed_step, "reason": reason,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        log.error("dmi: capture stopped at step %d, the engine serves on without it (policy.on_store_error: "
                  "drop): %s", self.run._step, reason)
        if self.writes is None and self.returns is None:
            self.close_quietly()
            return
        # the interventions and the return channel keep serving their requests until the engine
        # shuts down (close): the model stays patched, only the store closes now
        self.capturing = False
        try:
            self._close_run(keep_model=True)
        except BaseException as e:       # the engine serves on: report, as close_quietly does
            self.error = e
            log.error("dmi: closing the capture store %s failed: %s", self.run.store, e)

    def close(self) -> None:
        with _lock:
            if self.closed:
                return
            self.closed = True
            SESSIONS.pop(self.token, None)
            SESSIONS_BY_RUN.pop(self.run.id, None)
        if self._unwrap is not None:
            self._unwrap()
        if self.returns is not None:
            self.returns.close()
        self.clock.stop()
        if not self.capturing:      # the store closed when capture stopped: the model's patches go now
            self.run.close()
            return
        self._close_run()

    def _close_run(self, keep_model: bool = False) -> None:
        """Close the run's store and note the engine's stats in it (``keep_model``: :meth:`Run.close`'s)."""
        try:
            self.run.close(keep_model=keep_model)
        finally:
            if self.rank == 0:      # under tensor parallelism rank 0 finalizes the merged store
                _note_engine_stats(self.run.store, {
                    "recomputed_rows_skipped": self.steps.recomputed_rows,
                    "padded_steps": self.padded_steps, "padding_rows_skipped": self.padding_rows,
                    "steps": self.clock.steps, "steps_repeated": self.steps_repeated,
                    "requests_capped": sorted(map(self.run.requests.stored_id, self.steps.capped)),
                    "requests_refused": dict(self.gate.refused),
                    "host_us_per_step": self.clock.per_step_us(),
                    "begin_us_by_step_kind": self.clock.begin_by_kind_us(self.steps_repeated),
                    "process_gc": self.clock.gc_summary(),
                    **_run_stats(self.run)})

    def close_quietly(self) -> None:
        """At engine shutdown / process exit: close, log instead of raising."""
        try:
            self.close()
        except BaseException as e:       # the engine is going down: report, do not mask its own exit
            self.error = e
            log.error("dmi: closing the capture store %s failed: %s", self.run.store, e)


class HookClock:
    """Host time per engine step in a session's step hooks (batch: reading the runner's batch;
    begin: token bookkeeping, row selection, the control block's H2D; end: the end marker): wall
    time, which includes waits for the GIL, and the engine thread's own CPU time. Also the begin
    time of steps that repeated the last one, and the process's garbage-collection pauses while the
    session is open (every thread's: a pause stops the engine's thread too)."""
    KEYS = ("batch", "begin", "end")

    def __init__(self):
        self.wall = dict.fromkeys(self.KEYS, 0.0)
        self.cpu = dict.fromkeys(self.KEYS, 0.0)
        self.steps = 0
        self.repeat_wall = 0.0                 # begin wall time of the steps that repeated the last one
        self.gc_pauses = [[0, 0.0, 0.0] for _ in range(3)]     # per generation: count, total s, longest s
        self._gc_t0: float | None = None       # when the running collection started (None: not counted)
        gc.callbacks.append(self._on_gc)

    @staticmethod
    def now() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def add(self, key: str, t0: tuple[float, float], repeated: bool = False) -> None:
        """Time since ``t0`` in hook ``key``; ``repeated``: a begin that repeated the last step."""
        dt = time.perf_counter() - t0[0]
        self.wall[key] += dt
        self.cpu[key] += time.thread_time() - t0[1]
        if repeated:
            self.repeat_wall += dt

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":                   # (the engine's start-up, compile and graph capture, is not serving)
            self._gc_t0 = time.perf_counter() if self.steps else None
            return
        if self._gc_t0 is None:
            return
        dt, g = time.perf_counter() - self._gc_t0, self.gc_pauses[min(info.get("generation", 0), 2)]
        g[0] += 1
        g[1] += dt
        g[2] = max(g[2], dt)

    def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)

    def per_step_us(self) -> dict:
        n = max(self.steps, 1)
        return {kind: {k: round(v * 1e6 / n, 1) for k, v in d.items()} for kind, d in (("wall", self.wall), ("cpu", self.cpu))}

    def begin_by_kind_us(self, repeated: int) -> dict:
        """Mean begin wall time of a step that repeated the last one and of any other step."""
        other = self.steps - repeated
        return {"repeat": round(self.repeat_wall * 1e6 / max(repeated, 1), 1),
                "other": round((self.wall["begin"] - self.repeat_wall) * 1e6 / max(other, 1), 1)}

    def gc_summary(self) -> dict:
        """Pauses per generation since the first step, and what the collector tracks now (objects
        frozen by the engine at start-up are not scanned: ``frozen``)."""
        from collections import Counter
        out = {f"gen{i}": {"count": c, "total_ms": round(t * 1e3, 2), "longest_ms": round(m * 1e3, 2)}
               for i, (c, t, m) in enumerate(self.gc_pauses)}
        tracked = gc.get_objects()
        out.update(tracked=len(tracked), frozen=gc.get_freeze_count(),
                   top_types=dict(Counter(type(o).__qualname__ for o in tracked).most_common(8)))
        return out


def _run_stats(run) -> dict:
    """The drain's and exporter's CPU time (threads that share the engine's GIL) and, on a kernel
    ring, the captures outside CUDA graphs by how they ran (the eager path, a graph replay, a
    launch + graph capture): how many and their mean host time."""
    out = {"thread_cpu_s": {k: round(v, 3) for k, v in run.threads.thread_cpu_s.items()}, "drain_windows": run.drain_windows}
    ring = run.ring
    if getattr(ring, "eager_time", None) is not None:
        out["eager_captures"] = {how: {"count": n, "us": round(t * 1e6 / max(n, 1), 1)} for how, (n, t) in ring.eager_time.items()}
        out["replay_graphs"] = ring.eager_time["capture"][0]      # (each capture makes one graph)
    if getattr(ring, "side_counts", None) is not None:        # captures chained onto the side stream (graph captures)
        out["side_captures"] = dict(ring.side_counts, on=ring.side_streams)
    return out


def prepare(worker) -> None:
    """Before ``Worker.load_model`` builds the model, where the engine config asks for a session
    and vLLM captures CUDA graphs of its own compile, install dmi's post-grad pass
    (:func:`compat.install_graph_pass`):

    * where dmi's captures may be traced (:func:`engine_trace_mode` ``range``), the steps above the
      largest CUDA graph compile as a range of their own whose captures are rewritten into traced
      scatters (``dmi.kernels.traced.rewrite_captures``): those steps run without a graph, where
      each site op is a host call per step. ``worker.dmi_traced_above``: the largest graph's token
      count (steps of more tokens run the rewritten graph), or None;
    * unless the hook spec's ``engine.side`` is ``off``, the graphed ranges' captures are chained
      onto a side stream (``dmi.kernels.side.chain_captures``): in a replay each capture kernel runs beside the
      model's instead of between them. ``full`` (the default): only in vLLM's full graphs, the
      uniform decode steps; the pieces of piecewise graphs keep them inline, where forks and joins
      cost more host time than they save (``all``: in every graph; perf/online.py's
      ``dmi-hidden-side`` against ``dmi-hidden``). ``worker.dmi_side``: whether the pass chains them."""
    from ...kernels import side, traced
    vllm_config = worker.vllm_config
    worker.dmi_traced_above, worker.dmi_side = None, False
    cfg = read_config(vllm_config)
    if cfg is None:
        return
    options = engine_options(cfg)
    above = traced.rewrite_captures if engine_trace_mode(vllm_config, options) == "range" else None
    within = side.chain_captures if options.side != "0" else None
    if above is not None or within is not None:
        worker.dmi_traced_above, worker.dmi_side = compat.install_graph_pass(
            vllm_config, f"dmi-{_source_hash(traced, side)}", above=above, within=within)


def engine_options(cfg: dict) -> EngineOptions:
    """The engine section of the hook spec ``cfg`` names; its defaults where the spec does not load
    here (:func:`start` then refuses it with its own error)."""
    try:
        return EngineOptions.from_spec(load_hook_spec(cfg["hook_spec"]).data.get("engine"))
    except Exception:        # noqa: BLE001 - start() refuses the same spec with its own error
        return EngineOptions()


def engine_trace_mode(vllm_config, options: EngineOptions) -> str:
    """Where compiled code captures as traced ops (``KernelRing``'s ``traced``): the hook spec's
    ``engine.traced`` where set, else ``range`` where the engine runs steps above its largest CUDA
    graph through its own compile (:func:`compat.graph_top`) and none of them can outgrow the ring,
    else ``0``: a step larger than the ring streams through it in parts (``policy.mode: full``),
    which takes the site op's host call at each capture, where a traced scatter would find no place
    for its rows."""
    if options.traced:
        return options.traced
    if compat.graph_top(vllm_config) is None:
        return "0"
    if _largest_step_streams(vllm_config):
        log.info("dmi: steps above the largest CUDA graph capture through the site op (not traced): the largest "
                 "engine step can exceed policy.ring_bytes and then streams through the ring")
        return "0"
    return "range"


def _largest_step_streams(vllm_config) -> bool:
    """Under ``policy.mode: full``, whether a step of ``max_num_batched_tokens`` tokens, every site
    selecting every token (an upper bound), needs more than ``policy.ring_bytes``. False where the
    hook spec does not resolve here (:func:`start` then says why)."""
    try:
        cfg = read_config(vllm_config)
        hook = load_hook_spec(cfg["hook_spec"])
        hf_config = vllm_config.model_config.hf_config
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        arch = load_arch_spec(cfg["arch_spec"]) if cfg.get("arch_spec") else find_arch_spec(hf_config.model_type)
        itemsize = _dtype_itemsize(vllm_config)
        plan = build_plan(arch, hook, text, model_dtype_itemsize=itemsize)
    except Exception:        # noqa: BLE001 - start() refuses the same spec with its own error
        return False
    step = vllm_config.scheduler_config.max_num_batched_tokens
    return plan.policy.mode == "full" and plan.reserved_bytes(step, itemsize) > plan.policy.ring_bytes


def start(worker) -> Session | None:
    """``Worker.load_model`` hook: start a session when the engine config asks for one."""
    engine = VllmEngine()
    vllm_config, runner, model = engine.resolve_model(worker)
    cfg = read_config(vllm_config)
    if cfg is None:
        return None
    world = _check_engine(vllm_config)
    hook = load_hook_spec(cfg["hook_spec"])
    hf_config = vllm_config.model_config.hf_config
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    arch = find_arch(cfg.get("arch_spec") or None, getattr(hf_config, "model_type", None),
                     also=getattr(text_config, "model_type", None))
    n_layers = text_config.num_hidden_layers
    plan = plan_run(engine, model, arch, hook, text_config, _dtype_itemsize(vllm_config))
    if cfg.get("serving", True) and "on_store_error" not in (hook.data.get("policy") or {}):
        plan.policy.on_store_error = "drop"     # a server outlives its store: capture stops, serving goes on
    for canonical, why in plan.unavailable.items():
        log.warning("dmi: %s is not captured: %s", canonical, why)
    plan.sites = [replace(s, anchor=_vllm_anchor(arch, s.canonical, s.layer, n_layers)) for s in plan.sites]
    _check_pattern(plan, vllm_config, hook)
    policy = ServePolicy.from_hook(hook)
    if policy.returns:
        from .probes import plan_probes
        plan.probes = plan_probes(hook, plan)        # (checked before anything is written)
    store = cfg.get("store") or hook.data.get("store", {}).get("path")
    if not store and not hook.data.get("capture"):
        store = f"memory://dmi-{cfg['token']}-{time.time_ns()}"     # interventions only: no store needed
    if not store:
        raise DmiError("dmi: no store given. Fix: pass store= to dmi.load, set store.path in the hook spec, "
                       "or DMI_STORE / additional_config.dmi.store")
    attrs = {"engine": "vllm", "vllm_version": compat.vllm_version(), "dmi_session": cfg["token"],
             "request_policy": policy.describe(), **({"sites_unavailable": plan.unavailable} if plan.unavailable else {})}
    if world > 1 and is_remote(store):        # every rank refuses alike, before any waits for another
        raise StoreError(f"store {store!r}: tensor parallelism writes its merged store in a local directory "
                         f"only (its ranks meet in the store's files). Fix: capture into a local path and "
                         f"copy the store to the object store")
    plan, tp = _tensor_parallel(plan, arch, text_config, model, world)
    if tp is not None and plan.probes:
        raise DmiError("dmi: requests.return.probes are not supported with tensor parallelism yet (a rank holds a "
                       "shard of a head- or mlp-split site). Fix: remove requests.return.probes, or run with "
                       "tensor_parallel_size=1")
    if tp is not None and plan.interventions:
        raise DmiError("dmi: interventions are not supported with tensor parallelism yet (a rank holds a shard of "
                       "a head- or mlp-split site). Fix: remove the hook spec's interventions, or run with "
                       "tensor_parallel_size=1")
    if tp is not None and not plan.sites:     # this rank holds nothing the store keeps (e.g. only replicated sites)
        tp.barrier()                          # rank 0 has laid the store out
        shards.ShardWriter(str(store), tp.plan, tp.layout, tp.rank).close({"sites": []})
        log.info("dmi: tensor parallel rank %d captures no site", tp.rank)
        return None
    above = getattr(worker, "dmi_traced_above", None)          # (prepare)
    session_rank = tp.rank if tp is not None else 0
    run = build_run(engine, model, plan, arch, store, keep_store=session_rank != 0,
                    checks=(lambda run: _check_graphs(run, vllm_config), lambda run: _check_step_tokens(run, vllm_config, hook)),
                    overwrite=bool(cfg.get("overwrite")), attrs=attrs, tp=tp,
                    traced=plan.engine.traced or ("range" if above is not None else "0"),
                    write_rows=_write_rows(vllm_config), write_slots=_write_slots(vllm_config))
    if hasattr(run.ring, "replay_eager") and run.ring.is_cuda:
        # sites on engine-held rows (the logits) run outside the graphs every step: where their rows are not
        # one range (copied by one strided copy), their launch replays as a graph. (Mixed steps above the
        # largest graph size capture every site eagerly: not replayed, a step of a new size would pay a
        # capture per site.)
        run.ring.replay_eager = {s.index for s in plan.sites if s.anchor.get("rows")}
    if getattr(run.ring, "traced", None) and run.ring.trace_mode == "1" and compat.compiles_model(vllm_config):
        run.ring.traced_steps = True          # (a cached compiled graph is not traced again: tell the ring here)
    if getattr(run.ring, "traced", None) and run.ring.trace_mode == "range":
        run.ring.traced_above = above         # None: no range rewritten (the op in every step)
    if hasattr(run.ring, "side_streams"):
        run.ring.side_streams = bool(getattr(worker, "dmi_side", False)) and run.ring.is_cuda     # (prepare)
        run.ring.side_when = compat.capturing_full_graph if plan.engine.side == "full" else None
    # vLLM caches compiled graphs under a hash of its config (additional_config included) and the
    # model's forward, not of the patched source: the key must name the graph dmi compiles (its
    # anchors, site indices and run id are baked in), and only that (no store path, no session).
    extra = vllm_config.additional_config
    if isinstance(extra, dict):
        extra["dmi"] = {"graph": _graph_key(plan, arch, run), "hook_spec": cfg["hook_spec"],
                        **({"arch_spec": cfg["arch_spec"]} if cfg.get("arch_spec") else {})}
    session = Session(cfg["token"], run, runner, RequestGate(policy, plan, runner))
    session.rank = session_rank
    if policy.returns and session_rank == 0:       # (one rank answers)
        from .returns import StepReturns
        session.returns = StepReturns(policy, runner, model, compat.return_dir(vllm_config), compat.request_extra_args,
                                      probes=getattr(run, "probes", None))
    # (under tensor parallelism every rank would have to stop at the same step: there drop counts the captures)
    session.stop_on_store_error = plan.policy.on_store_error == "drop" and tp is None
    session._unwrap = compat.wrap_runner(runner, on_batch=session.on_batch, on_forward=session.on_forward,
                                         on_step_end=session.on_step_end, on_shutdown=session.close_quietly,
                                         dummy_run=session.on_dummy_run)
    with _lock:
        SESSIONS[cfg["token"]] = session
        SESSIONS_BY_RUN[run.id] = session
    _at_exit(session.close_quietly)
    log.info("dmi: capturing %d site(s) into %s", len(plan.sites), run.store)
    return session


def _write_rows(vllm_config) -> int:
    """Rows the interventions' masks hold: the most a step carries, CUDA-graph padding included
    (allocated once: a graph reads them at fixed addresses)."""
    sched = vllm_config.scheduler_config.max_num_batched_tokens
    graphs = getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None) or 0
    return max(int(sched), int(graphs))


def _write_slots(vllm_config) -> int:
    """Slots of values an intervention with ``client:`` bounds holds: the operator's, and one per
    request a step may carry (each request that set its own values keeps one while it runs)."""
    return int(vllm_config.scheduler_config.max_num_seqs) + 1


def _dtype_itemsize(vllm_config) -> int:
    import torch
    return torch.empty((), dtype=vllm_config.model_config.dtype).element_size()


def _check_engine(vllm_config) -> int:
    """Engine features the adapter does not map yet: refused at load, not mid-run. Returns the tensor
    parallel size (``dmi.store.shards.check_parallel`` refuses pipeline / data / expert / sequence parallelism)."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise DmiError("dmi: speculative decoding is not supported by the vLLM adapter yet (the logits rows are "
                       "not one per request and draft tokens are not real rows). Fix: run without "
                       "speculative_config while capturing")
    return shards.check_parallel(vllm_config.parallel_config, getattr(vllm_config, "compilation_config", None))


def _tensor_parallel(plan, arch, text_config, model, world: int):
    """(the plan this rank captures, the :class:`dmi.store.shards.TPContext` or None). Under tensor
    parallelism each rank captures its shard of the split sites (``TPLayout.local_plan``) and the
    replicated sites only on rank 0; the store holds the unsharded ``plan``."""
    if world <= 1:
        return plan, None
    pattern = [s.name for s in plan.sites if s.canonical == "attn.pattern"]
    if pattern:
        raise DmiError(f"dmi: {pattern[0]}: attn.pattern is not supported with tensor parallelism yet (its keys "
                       f"are recomputed per rank and not verified). Fix: capture attn.q and attn.k_rot and compute "
                       f"it offline, or capture with tensor_parallel_size=1")
    rank = compat.tp_rank()
    layout = shards.TPLayout.derive(arch, text_config, world)
    layout.check_plan(plan)
    local = layout.local_plan(plan, rank)
    layout.verify_anchors(model, local, resolve)
    return local, shards.TPContext(plan, layout, rank, compat.tp_barrier)


def _check_step_tokens(run, vllm_config, hook) -> None:
    """The GPU ring's control block holds at most ``policy.max_step_tokens`` rows per step (65536 when
    unset) and an engine step carries up to ``max_num_batched_tokens``: refused at load, not mid-serving."""
    limit = getattr(run.ring, "max_rows", None)          # kernel rings only (the CPU ring has no such bound)
    step = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    if limit and step and step > limit:
        path = ("policy", "max_step_tokens") if "max_step_tokens" in hook.data.get("policy", {}) else ()
        raise PolicyError(f"an engine step carries up to max_num_batched_tokens={step} tokens but the capture "
                          f"ring takes at most policy.max_step_tokens={limit} rows per step", file=hook.file,
                          key="policy.max_step_tokens", line=hook.line_of(path) if path else None,
                          fix=f"set policy.max_step_tokens: {step}, or lower max_num_batched_tokens")


def _check_graphs(run, vllm_config) -> None:
    """With CUDA graphs on, only what runs on the device each replay captures: refuse what would
    silently capture nothing in replayed steps."""
    if not compat.cuda_graphs_on(vllm_config):
        return
    from ...ring.cpu import CpuRing
    if isinstance(run.ring, CpuRing):
        raise DmiError("dmi: this engine replays CUDA graphs, but the capture ring is the CPU reference ring "
                       "(engine.ring: cpu), which copies on the host: a replayed step would capture nothing. "
                       "Fix: remove engine.ring from the hook spec (the CUDA ring captures inside graphs), or "
                       "pass enforce_eager=True (serve: --enforce-eager)")
    pattern = [s.name for s in run.plan.sites if s.canonical == "attn.pattern"]
    if pattern:
        raise DmiError(f"dmi: attn.pattern on vLLM is recomputed on the host side of each step ({pattern[0]}, ...), "
                       f"which a CUDA-graph replay skips. Fix: pass enforce_eager=True (serve: --enforce-eager) "
                       f"while capturing attn.pattern, or capture attn.q and attn.k_rot and compute it offline")


def _check_pattern(plan, vllm_config, hook) -> None:
    """attn.pattern needs every key of a request (dmi keeps them): refuse what would lose some."""
    sites = [s for s in plan.sites if s.canonical == "attn.pattern"]
    if not sites:
        return
    if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        raise DmiError("dmi: attn.pattern on vLLM needs enable_prefix_caching=False: a prefix-cache hit skips "
                       "computing the shared positions, whose keys dmi recomputes the pattern from. Fix: pass "
                       "enable_prefix_caching=False to dmi.load / vllm.LLM (serve: --no-enable-prefix-caching)")
    max_len = vllm_config.model_config.max_model_len
    short = [s for s in sites if s.shape[-1] < max_len]
    if short:
        raise hook.error(("capture",), f"attn.pattern keeps max_keys={short[0].shape[-1]} key positions but the "
                         f"engine serves sequences up to max_model_len={max_len}",
                         fix=f"set max_keys: {max_len} in the capture entry of attn.pattern, or pass "
                             f"max_model_len={short[0].shape[-1]} to the engine")


def _note_engine_stats(store: str, stats: dict) -> None:
    """Root attribute ``vllm`` of a closed store: what the engine's scheduling did to capture."""
    import warnings
    import zarr
    try:
        root = zarr.open_group(store, mode="r+")
        root.attrs["vllm"] = json.loads(json.dumps(stats, default=str))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            zarr.consolidate_metadata(store)
    except Exception as e:      # the store itself is closed and valid; this is bookkeeping
        log.warning("dmi: could not record vLLM stats in %s: %s", store, e)


def _source_hash(*modules) -> str:
    """A hash of these modules' code (what dmi compiles into vLLM's graphs): compile caches key on it."""
    return hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in modules)).hexdigest()[:16]


def _graph_key(plan, arch, run) -> str:
    from . import patch
    from ... import siteop
    from ...kernels import side, traced
    # the patch, the site call, the traced capture and the side-stream chain are compiled into the graph
    src = _source_hash(patch, siteop, traced, side).encode()
    tp = getattr(run.exporter, "tp", None)
    key = [plan.hook_spec, arch.data, [s.name for s in plan.sites], run.id, getattr(run.ring, "traced", []),
           getattr(run.ring, "trace_mode", "0"), getattr(run.ring, "traced_above", None),
           getattr(run.ring, "side_streams", False)]
    if tp is not None:          # each rank compiles its own shard shapes
        key.append([tp.rank, tp.layout.world, [(s.shape, s.heads) for s in plan.sites]])
    blob = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode() + src).hexdigest()[:20]


def _at_exit(fn) -> None:
    """Run ``fn`` at interpreter exit *before* concurrent.futures refuses new work (zarr writes
    through an executor): threading's exit hooks run before atexit's."""
    try:
        threading._register_atexit(fn)
    except (AttributeError, RuntimeError):
        atexit.register(fn)


def _vllm_anchor(arch, canonical: str, layer: int | None, n_layers: int) -> dict:
    """A site's anchor for its layer, the module path spelled out (no ``{i}`` / ``{i+1}`` left)."""
    a = dict(layer_anchor(arch.data["sites"][canonical]["vllm"], layer, n_layers))
    a["module"] = module_path(a["module"], layer)
    a.setdefault("layout", ["token"])
    return a


def close_session(token: str | None = None) -> list[str]:
    """Close this process's session(s) (``token`` None: all); returns their store paths.
    Usable as ``llm.collective_rpc`` target when the engine runs in other processes."""
    out = []
    for tok, s in list(SESSIONS.items()):
        if token is None or tok == token:
            s.close()
            out.append(s.run.store)
    return out

