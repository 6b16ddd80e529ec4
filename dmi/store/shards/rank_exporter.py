"""The exporter of one tensor parallel rank (``dmi.run.Run(..., tp=TPContext)``): the store
exporter's step assembly and commit clock over a :class:`dmi.store.shards.rank_writer.ShardWriter`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import DmiError, StoreError
from ..exporter import ZarrExporter
from ..location import is_remote
from ..preflight import writer_info
from ..rows import PHASE_NAMES, copy_rows
from .merge import commit, finalize, wait_closed
from .merged_store import create_store
from .rank_writer import ShardWriter
from .sharding import TPLayout


@dataclass
class TPContext:
    """What a rank's :class:`dmi.run.Run` needs to write its part of the merged store."""
    plan: Any                        # the unsharded plan: the store's layout (the Run gets the rank's local plan)
    layout: TPLayout
    rank: int
    barrier: Any                     # () -> None over every rank (vLLM: the TP group's CPU group)
    close_timeout_s: float = 300.0   # rank 0 waits this long for the other ranks' writers to close


class ShardedExporter(ZarrExporter):
    """:class:`dmi.store.exporter.ZarrExporter` for one tensor parallel rank: ``plan`` is the rank's local
    plan (:meth:`TPLayout.local_plan`), ``tp.plan`` the store's. Rank 0 lays the store out
    (:func:`create_store`), every rank waits at ``tp.barrier``, then writes its rows through a
    :class:`ShardWriter` (chunk files of its own region, synchronously on the exporter thread). The
    commit clock checkpoints the writer (rows on disk noted in ``tp/rank<r>``); rank 0 also
    :func:`commit`\\ s (extents = the minimum over the ranks). Close: every rank closes its writer;
    rank 0 waits for the others' notes (:func:`wait_closed`) and :func:`finalize`\\ s.

    Row alignment: a group's rows of a step are the rows the control selected after the keep filter
    (as the exporter stores them); a group none of whose layers has a record this step writes
    ``len(slot.sel)`` NaN rows when the ring dropped them (best_effort), and nothing when the engine
    did not compute them (deterministic, the same on every rank). Drops are noted per rank in
    ``tp/rank<r>`` (the merged ``drops`` table stays empty)."""

    def __init__(self, path, plan, capture_dtype: str, attrs: dict, overwrite: bool = False, resume: bool = False,
                 *, tp: TPContext):
        if resume:
            raise DmiError("dmi: resume=True is not supported with tensor parallelism (each rank's open chunk would "
                           "have to be reloaded). Fix: capture into a new store")
        if is_remote(path):
            raise StoreError(f"store {str(path)!r}: tensor parallelism writes its merged store in a local directory "
                             f"only (its ranks meet in the store's files). Fix: capture into a local path (a shared "
                             f"file system mounted on every rank's host) and copy the store to the object store")
        self.tp = tp
        self.writer: ShardWriter | None = None
        self.rank_drops: list = []
        super().__init__(path, plan, capture_dtype, attrs, overwrite=overwrite)

    # --- layout -----------------------------------------------------------------------------------
    def _create(self, path, attrs: dict, overwrite: bool) -> None:
        tp = self.tp
        self.path = Path(path)
        if tp.rank == 0:
            try:
                self.root = create_store(path, tp.plan, tp.layout, self.capture_dtype,
                                         dict(attrs) | {"dmi_writer": writer_info()}, overwrite=overwrite)
            except BaseException:
                tp.barrier()           # the other ranks wait there: let them go (they fail reading the store)
                raise
        tp.barrier()
        self.writer = ShardWriter(self.path, tp.plan, tp.layout, tp.rank)

    # --- writing ------------------------------------------------------------------------------------
    def _label(self) -> str:
        return f"{self.path}: rank {self.tp.rank}"

    def _write_rows(self, ctrl, records, request_ids, ring_drops, entry) -> None:
        """Each rank writes its rows straight to its shard (ShardWriter), and a group the ring
        dropped on this rank gets NaN rows, so every rank holds the same rows of the step."""
        dropped = {d.site for d in ring_drops[self._ring_pos:] if d.step == ctrl.step}
        self._take_ring_drops(ring_drops, ctrl.step, entry)
        seen = set()
        for g, sel, n, got in self._rows(ctrl, records, entry):
            seen.add(g.name)
            self._ingest(g, ctrl, sel, n, got, request_ids, entry)
        for g in self.groups.values():
            if g.name in seen or not any(s.index in dropped for s in g.sites):
                continue
            slot = next((ctrl.slots[s.index] for s in g.sites if s.index in ctrl.slots), None)
            if slot is not None and len(slot.sel):      # dropped by the ring: NaN rows keep ranks aligned
                self._ingest(g, ctrl, slot.sel, len(slot.sel), [None] * len(g.sites), request_ids, entry)

    def _ingest(self, g, ctrl, sel, n: int, got, request_ids, entry) -> None:
        tokens = ctrl.tokens
        req = tokens.request[sel]
        ids = np.asarray(request_ids[: int(req.max()) + 1], dtype=object)
        coords = {"request": ids[req], "position": tokens.position[sel], "step": np.full(n, ctrl.step, np.int64),
                  "phase": PHASE_NAMES[tokens.phase[sel]], "token_id": tokens.token_ids(sel)}
        outputs = g.sites[0].outputs
        per_layer = g.per_layer
        blocks = {}
        for o in outputs:
            dt = self._stored(o.kind)
            shape = (n, len(g.sites), *o.shape) if per_layer else (n, *o.shape)
            blocks[o.name] = np.full(shape, -1 if o.kind == "int32" else np.nan, dt)
        for li, arrays in self._records(g, n, got, entry):    # dropped / not computed: rows stay NaN / -1
            for o in outputs:
                copy_rows(blocks[o.name][:, li] if per_layer else blocks[o.name], arrays[o.name])
        entry.reqs[g.name] = req
        w = self.writer
        w.write(g.name, w.groups[g.name].rows, blocks, coords if w.writes_coords(g.name) else None)
        g.rows += n

    def _append_drops(self, drops) -> None:
        self.rank_drops.extend(drops)           # noted in tp/rank<r> at close

    # --- commit -------------------------------------------------------------------------------------
    def checkpoint(self, wait_all: bool = False) -> None:
        self._last_commit = time.monotonic()
        if self.error is not None:
            self._on_failure()
            return
        try:
            self.writer.checkpoint()
            if self.tp.rank == 0:
                commit(self.path)
        except OSError as e:
            with self._lock:
                if self.error is None:
                    self.error = StoreError(f"{self._label()}: checkpoint failed: {e}")
            self._on_failure()
            return
        last = None
        while self._log:
            last = self._log.popleft()
            self._fold(last)
        if last is not None:
            self.committed_step = last.step

    def finish(self, ring_drops=()) -> None:
        if self._finished:
            return
        self._finished = True
        self._take_ring_drops(ring_drops, None, None)
        if self.error is None:
            self.checkpoint()
        if self.error is not None:
            self._on_failure()

    def close(self, summary: dict, clean: bool = True) -> None:
        try:
            self.finish()
        except StoreError:
            clean = False
        self._shutdown(wait=True)
        names = [s.name for s in self.plan.sites]
        notes = {"rows_stored": summary.get("rows_stored"), "rows_dropped": summary.get("rows_dropped"),
                 "sites": names, "store_error": None if self.error is None else str(self.error),
                 "drops": [{"step": d.step, "site": names[d.site], "requests": self.request_names(d), "rows": d.rows,
                            "reason": d.reason}
                           for d in self.rank_drops + self.drops]}
        if self.error is None:
            self.writer.close(notes)
        else:                                   # its rows on disk stay as checkpointed
            self.writer.note(notes | {"status": "failed"})
            clean = False
        if self.tp.rank != 0:
            return
        still = wait_closed(self.path, self.tp.close_timeout_s)
        rows = commit(self.path)
        marker = {"step": self.committed_step, "next_step": summary.get("steps", self.committed_step + 1),
                  "rows": rows}
        finalize(self.path, dict(summary) | {"dmi_committed": marker, "tp_ranks_not_closed": still or None,
                                             "store_error": None if self.error is None else str(self.error)},
                 clean=clean and not still)
