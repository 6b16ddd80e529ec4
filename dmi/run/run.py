"""A capture run as its user sees it: ``dmi.load`` returns one (``run.model``, ``close``, ``flush``,
``stats``, ``subscribe``, ``set_limits``, ``set_enabled``, ``set_request_ids``). Its engine hooks
are :class:`dmi.run.steps.EngineHooks`; its threads :class:`dmi.run.threads.DrainExport`.
"""
from __future__ import annotations

import logging
import warnings
from importlib import metadata

import torch

from ..errors import CaptureError, PolicyError, SpecError, StoreError
from ..interventions import Interventions
from ..plan import Plan, check_policy_fits
from ..ring.factory import make_ring
from ..ring.protocol import Ring
from ..siteop import register_run, unregister_run
from ..spec import parse_bytes
from ..store.exporter import ZarrExporter
from ..store.preflight import choose_writer
from ..subscribers import Subscribers, Subscription
from ..tokens import RequestTable
from .steps import EngineHooks
from .threads import DrainExport


log = logging.getLogger("dmi")


def never_computed(summary: dict) -> list[str]:
    """Sites that selected rows and stored none because none was computed (none dropped): a module
    that never ran, or rows the engine never computed. Nothing was lost, but nothing was captured."""
    sel, stored, dropped, missing = (summary[k] for k in ("rows_selected", "rows_stored", "rows_dropped",
                                                          "rows_not_computed"))
    return [n for n, k in sel.items() if k and not stored.get(n) and not dropped.get(n) and missing.get(n) == k]


class Run(EngineHooks):
    """Returned by :func:`dmi.load`. Use ``run.model`` as usual; ``run.close()`` (or ``with``) flushes."""

    def __init__(self, model: torch.nn.Module, plan: Plan, store: str, *, overwrite: bool = False,
                 attrs: dict | None = None, ring: Ring | None = None, resume: bool = False, tp=None,
                 traced: str | None = None, memory_bytes: int | None = None, write_rows: int | None = None,
                 write_slots: int = 1):
        self.model = model
        self.plan = plan
        self.dtype = next(model.parameters()).dtype
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        check_policy_fits(plan, self.itemsize)
        self.requests = RequestTable()
        device = next(model.parameters()).device
        plan.writer, why = choose_writer(plan.writer, device, store, tp is not None, memory_bytes is not None)
        auto = {"store.writer": {"value": plan.writer, "why": why}} if why else {}
        if why and plan.writer != "pool" and plan.writers:
            warnings.warn(f"dmi: store.writers: {plan.writers} is ignored: store.writer auto chose the {plan.writer} "
                          f"writer ({why}). Fix: remove store.writers, or set store.writer: pool where the pool can "
                          f"run (a CUDA model writing a local directory)", stacklevel=3)
        if plan.writer == "pool" and why and not plan.writers:
            from ..store.pool import default_writers
            auto["store.writers"] = {"value": default_writers(), "why": "half the cores, at least 2 and at most 8"}
        remote = plan.policy.drain == "process"     # the drain runs in the writer's child (dmi.ring.share)
        if remote and tp is not None:
            raise SpecError("policy.drain: process is not supported with tensor parallelism (each rank drains its "
                            "shard in its own process)", file=plan.hook_file or None, key="policy.drain",
                            fix="remove policy.drain or set it to thread")
        if memory_bytes is not None and (remote or plan.writer in ("process", "pool") or tp is not None):
            raise SpecError("an in-memory result (no store path) is written by an exporter thread of this process",
                            file=plan.hook_file or None, key="policy.drain" if remote else "store.writer",
                            fix="remove policy.drain and store.writer, or pass a store path to dmi.load")
        self.ring = ring or make_ring(plan.policy, device, traced=traced, engine=plan.engine)
        self.ring.setup(plan, self.dtype, device)
        self.in_memory = memory_bytes is not None
        self._result = None              # the in-memory result, once closed
        if tp is None:
            exporter = ZarrExporter
            if plan.writer == "process":
                from ..store.writer import ProcessExporter as exporter
            elif plan.writer == "pool":
                from ..store.pool import PoolExporter as exporter
            if self.in_memory:
                from functools import partial

                from ..store.memory import MemoryExporter
                exporter = partial(MemoryExporter, memory_bytes=memory_bytes)
            try:
                self.exporter = exporter(store, plan, str(self.dtype).removeprefix("torch."),
                                         run_attrs(model, plan, auto) | (attrs or {}), overwrite=overwrite,
                                         resume=resume)
            except BaseException:
                if self.ring.share is not None:
                    self.ring.share.unlink()
                raise
        else:      # tensor parallelism (dmi.store.shards.TPContext): plan = this rank's part; the store holds tp.plan
            if plan.writer in ("process", "pool"):
                raise SpecError(f"store.writer: {plan.writer} is not supported with tensor parallelism (each rank writes "
                                "its shard from its own exporter thread)", file=plan.hook_file or None,
                                key="store.writer", fix="remove store.writer or set it to thread")
            from ..store.shards import ShardedExporter
            self.exporter = ShardedExporter(store, plan, str(self.dtype).removeprefix("torch."),
                                            run_attrs(model, tp.plan, auto) | (attrs or {}), overwrite=overwrite,
                                            resume=resume, tp=tp)
        if remote:
            if self.ring.share is None:
                raise PolicyError(f"policy.drain: process: the run was given a {type(self.ring).__name__} not made "
                                  f"for it", key="policy.drain", fix="let dmi make the ring, or use policy.drain: thread")
            try:
                self.exporter.attach_ring(self.ring.drain_info())
            finally:
                self.ring.share.unlink()
        self.store = str(self.exporter.path)
        self._tp = tp is not None
        self.subscribers = Subscribers(plan, str(self.dtype).removeprefix("torch."))
        self.interventions = Interventions(plan.interventions, device, self.dtype, rows=write_rows or plan.policy.max_step_tokens,
                                           slots=write_slots)
        self.id = register_run(self)
        self.requests.intern(self.exporter.stored_request_ids)   # resume: new requests get new ids
        self.policy_changes: list[dict] = []    # set_limits calls: (step, mode, d2h_bytes_per_s) from then on
        self.close_attrs: dict = {}             # root attributes an engine adapter adds to the close summary
        self._on_close: list = []               # what detaches the adapter's patches (on_close)
        self._init_hooks(device, self.itemsize, first_step=self.exporter.next_step)
        self.threads = DrainExport(self.ring, self.exporter, plan, lambda: self.requests.ids, self.subscribers,
                                   str(self.id))

    def set_limits(self, *, mode: str | None = None, d2h_bytes_per_s: int | str | None = "keep") -> None:
        """Change ``policy.mode`` and ``policy.d2h_bytes_per_s`` of a live run, from the next step
        on (an operator throttling capture without reloading the model; a benchmark sweeping caps
        on one compiled graph). ``d2h_bytes_per_s``: bytes per second (int or a size such as
        ``"2GiB"``), None for uncapped; left out, it stays. Budgets that size memory (ring, host
        staging, meta records) are fixed at load. Each change is listed in the store's
        ``policy_changes`` attribute (step, mode, d2h_bytes_per_s); ``policy.on_store_error`` keeps
        what it was at load."""
        policy = self.plan.policy
        mode = policy.mode if mode is None else mode
        if mode not in ("full", "best_effort"):
            raise PolicyError(f"set_limits: mode {mode!r} is not a policy mode", key="policy.mode",
                              fix="use 'full' or 'best_effort'")
        rate = policy.d2h_bytes_per_s if d2h_bytes_per_s == "keep" else d2h_bytes_per_s
        if rate is not None:
            try:
                rate = parse_bytes(rate)
            except ValueError as e:
                raise PolicyError(f"set_limits: {e}", key="policy.d2h_bytes_per_s",
                                  fix="give a rate such as 2GiB, or None for uncapped") from None
            if rate < 1:
                raise PolicyError(f"set_limits: policy.d2h_bytes_per_s is {rate} bytes/s: nothing could ever be "
                                  f"copied to the host", key="policy.d2h_bytes_per_s",
                                  fix="give a rate such as 2GiB, or None for uncapped")
        self.ring.set_limits(mode, rate)
        self.limits_changed()            # (a step begun ahead under the old limits is begun again)
        policy.mode, policy.d2h_bytes_per_s = mode, rate
        self.policy_changes.append({"step": self.next_step, "mode": mode, "d2h_bytes_per_s": rate})

    def set_enabled(self, enabled: bool) -> None:
        """``False``: null mode. Sites stay patched and the site ops still run, but no step is
        begun: inside a CUDA graph their kernels exit on the device flag, which stays off; eager
        calls return on the host. Nothing is copied."""
        self.enabled = bool(enabled)
        self.ring.null = not self.enabled
        self.limits_changed()

    def set_intervention(self, name: str, *, vector=None, scale=None, min=None, max=None, enabled=None,
                         requests="keep") -> None:
        """Change the hook spec's intervention ``name`` from the next step on: its ``vector`` (a
        tensor, array or list of the site's trailing shape), ``scale``, clamp bounds ``min`` /
        ``max``, ``enabled``, or ``requests`` (request ids it applies to; None: every request).
        Values are copied into the buffers the patched model reads, so a compiled model or a
        captured CUDA graph keeps running without a recompile or a re-capture."""
        self.interventions.set(name, vector=vector, scale=scale, min=min, max=max, enabled=enabled,
                               requests=requests)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every step begun so far is drained and handed to the store (True), or the
        timeout passed (False). The run stays open."""
        self.retract_idle_ahead()         # (a step begun ahead outside generate(): stepped() called directly)
        self.ring.hurry = True            # the drain polls fast until this returns
        self.ring.urgent.set()
        try:
            return self.threads.flush(timeout)
        finally:
            self.ring.hurry = False

    def stats(self) -> dict:
        st, exp = self.ring.stats, self.exporter
        # the ring's (best_effort: ring_full, bandwidth; counted whole, written ones released) + the
        # store's (sink: the store failed)
        by_reason = dict(st.drops.by_reason)
        for d in exp.drops:
            by_reason[d.reason] = by_reason.get(d.reason, 0) + 1
        return {"steps": st.steps, "records": st.records, "bytes_captured": st.bytes_captured,
                "bytes_drained": st.bytes_drained, "stall_seconds": round(st.stall_seconds, 6),
                "stall_bandwidth_seconds": round(st.stall_bandwidth_seconds, 6),
                "not_run": st.not_run, "streamed_steps": st.streamed_steps, "stream_parts": st.stream_parts,
                "stream_buffer_bytes": getattr(self.ring, "part_buffer_bytes", 0),
                "dropped_captures": len(st.drops) + len(exp.drops),
                "dropped_bytes": st.drops.bytes + sum(d.bytes for d in exp.drops), "drops_by_reason": by_reason,
                "requests": len(self.requests.ids), "committed_step": exp.committed_step,
                "store_bytes": exp.store_bytes, "store_error": None if exp.error is None else str(exp.error)}

    def subscribe(self, fn, sites: str | list[str] | None = None) -> Subscription:
        """Call ``fn(captures)`` with each drained step's captures of ``sites`` (names, canonical
        names or globs of the captured sites; None: all): ``captures`` maps each site's full name to
        a :class:`dmi.subscribers.Capture` (its rows, their request, position and phase, the values
        as numpy arrays the function may keep). Calls run on the export thread, in step order, each
        step once; an exception stops capture and reaches the caller at its next step, ``flush()``
        or ``close()``. Steps already drained are not replayed. ``.cancel()`` on the returned
        subscription stops it."""
        if self._tp:
            raise CaptureError("subscribe: not supported with tensor parallelism (each rank drains only its "
                               "shard of a site). Fix: subscribe on a run without tensor parallelism")
        if self.threads.closed:
            raise CaptureError(f"subscribe: the run of {self.store} is closed. Fix: subscribe before close()")
        if self.threads.remote:
            raise CaptureError("subscribe: policy.drain: process drains the ring in another process, so no rows "
                               "reach this one. Fix: use policy.drain: thread for live subscribers")
        return self.subscribers.add(fn, sites)

    def set_request_ids(self, ids: list[str] | None = None, *, capture=None) -> None:
        """Name the rows of the next batch this thread starts (else they are r0, r1, ...) and,
        with ``capture`` (one bool per batch row), say which of its requests are captured at all:
        rows of a request with ``False`` are never selected, stored or counted (opt-in per request).
        ``ids=None`` with ``capture`` keeps the made-up ids."""
        self.requests.set_next(None if ids is None else list(ids), capture)

    def close(self, error: BaseException | None = None) -> None:
        """Flush everything captured and close the store. ``error``: the caller failed (the
        store is then marked ``failed``, not ``closed``, though all it holds is consistent)."""
        if self.threads.closed:
            return
        self.end_open_step(aborted=error is not None)
        self.threads.stop()
        self.ring.close()
        for detach in self._on_close:
            detach()
        unregister_run(self.id)
        try:       # tail chunks on disk and every step committed (or, if the store failed, accounted as dropped)
            self.exporter.finish(self.ring.stats.drops)
        except StoreError as e:
            self.threads.fail(e)
        clean = self.ring.error is None and error is None
        acc = self.exporter.accounting()     # per site; a resumed store's earlier runs included
        self.layouts.fold_counts()
        names = [s.name for s in self.plan.sites]
        summary = self.stats() | {"steps": self.next_step,
                                  "error": None if error is None else f"{type(error).__name__}: {error}",
                                  "rows_dropped": dict(zip(names, acc["dropped"].tolist())),
                                  "rows_selected": dict(zip(names, (acc["selected"] + self.layouts.rows_selected).tolist())),
                                  "rows_stored": dict(zip(names, acc["stored"].tolist())),
                                  "rows_not_computed": dict(zip(names, (acc["not_computed"] + self.layouts.not_computed).tolist()))}
        if self.policy_changes:
            summary["policy_changes"] = self.policy_changes
        summary |= self.close_attrs
        never = never_computed(summary)
        if never:
            summary["sites_never_computed"] = never
            log.warning("dmi: %d site(s) of %s stored no row: none of the rows they selected was computed (their "
                        "module never ran, e.g. embed under inputs_embeds, or the engine computed none of those rows, "
                        "e.g. logits under logits_to_keep): %s", len(never), self.store,
                        ", ".join(never[:8]) + (", ..." if len(never) > 8 else ""))
        try:
            self.exporter.close(summary, clean=clean)
            self.ring.raise_if_failed()
        finally:
            if self.in_memory:
                try:
                    self._result = self.exporter.take_result()
                except Exception as e:      # noqa: BLE001 - the run's own error (if any) is what propagates
                    log.warning("dmi: the in-memory result cannot be read back: %s", e)

    def result(self):
        """What the run captured, as an ``xarray.DataTree`` with the groups, variables and
        coordinates ``dmi.open`` gives for a store (closes the run first). An in-memory run (no
        store path) returns its result, held in memory; a store's run opens its store."""
        self.close()
        if not self.in_memory:
            from ..store.read import open_store
            return open_store(self.store, self.plan.storage_options)
        if self._result is None:
            raise StoreError("the run's in-memory result could not be read back (see the warning logged at "
                             "close). Fix: pass a store path to dmi.load to keep the rows on disk")
        return self._result

    def on_close(self, detach) -> None:
        """``detach()`` runs when the run closes, after its threads stopped (an adapter undoing its patches)."""
        if detach is not None:
            self._on_close.append(detach)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(error=exc)

    def __repr__(self) -> str:
        where = "in memory" if self.in_memory else f"store={self.store!r}"
        return f"<dmi.Run {self.plan.family} sites={len(self.plan.sites)} {where}>"


def run_attrs(model, plan: Plan, sized_automatically: dict | None = None) -> dict:
    """The store's root attributes of a run: what produced it. ``sized_automatically``: settings
    the hook spec left to dmi, each as {value, why} (``dmi inspect`` lists them)."""
    versions = {}
    for dist in ("dmi", "torch", "transformers", "zarr", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    cfg = getattr(model, "config", None)
    return {"dmi_format": 1, "family": plan.family, "arch_spec": plan.arch_file, "hook_spec_file": plan.hook_file,
            "hook_spec": plan.hook_spec, "policy": vars(plan.policy), "versions": versions,
            "model": {"name_or_path": getattr(cfg, "_name_or_path", None), "model_type": getattr(cfg, "model_type", None),
                      "dtype": str(next(model.parameters()).dtype), "class": type(model).__name__},
            "sites": [s.name for s in plan.sites], "sized_automatically": sized_automatically or {}}
