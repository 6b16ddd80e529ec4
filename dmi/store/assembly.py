"""A drained step's rows into the store groups' open chunks (:class:`dmi.store.exporter.ZarrExporter`):
the rows each group keeps, their coordinates, the per-site accounting; a chunk that fills goes to
the chunk writers once the step's row copies are done.
"""
from __future__ import annotations

import time

import numpy as np

from ..errors import StoreError
from ..ring.budget import Drop
from .commits import COMMIT_S, PendingStep
from .layout import GroupBuffer
from .rows import PHASE_NAMES, computed_rows, copy_all, output_views


COPY_PARALLEL_BYTES = 4 << 20   # a step with more rows than this is copied into chunks by several threads


class StepAssembly:
    """Steps in (a mixin of :class:`dmi.store.exporter.ZarrExporter`): ``write_step``, ``drop_step``,
    ``lose_step``."""

    def write_step(self, ctrl, records, request_ids: list[str], ring_drops=()) -> None:
        """records: (slot, meta record, bytes) of one drained step; ring_drops: the ring's list of
        drops (those of this step and earlier ones are recorded with it)."""
        self._request_ids = request_ids
        if self.error is not None:
            self.drop_step(ctrl, records, request_ids, ring_drops)
            self._on_failure()
            return
        entry = PendingStep(ctrl.step, len(self.plan.sites))
        try:
            self._write_rows(ctrl, records, request_ids, ring_drops, entry)
        except Exception as e:     # noqa: BLE001 - a step half written: the store takes nothing more
            with self._lock:
                if self.error is None:
                    self.error = e if isinstance(e, StoreError) else StoreError(
                        f"{self._label()}: exporting step {ctrl.step} failed: {type(e).__name__}: {e}")
            self._jobs.clear()
            self._flush_jobs()        # the drops table's chunks still go out; the site groups' do not
            self._sink_drops(entry)
            self._on_failure()
            return
        self._log.append(entry)
        if time.monotonic() - self._last_commit >= COMMIT_S:
            self.checkpoint()

    def _label(self) -> str:
        """How errors name this writer."""
        return str(self.path)

    def _write_rows(self, ctrl, records, request_ids, ring_drops, entry: PendingStep) -> None:
        """A drained step's rows into the groups' open chunks (and its ring drops into the table)."""
        self._take_ring_drops(ring_drops, ctrl.step, entry)
        for g, sel, n, got in self._rows(ctrl, records, entry):
            self._ingest(g, ctrl, sel, n, got, request_ids, entry)
        self._flush_jobs()
        entry.cum = np.array([g.rows for g in self._all], np.int64)

    def drop_step(self, ctrl, records, request_ids, ring_drops=(), reason: str = "sink") -> None:
        """A step the failed store will not get: every capture of it is accounted as dropped (the
        drops table gets them at close, as far as the store still takes writes)."""
        self._request_ids = request_ids
        entry = PendingStep(ctrl.step, len(self.plan.sites))
        self._take_ring_drops(ring_drops, ctrl.step, entry)
        self._step_drops(ctrl, records, entry, reason)
        self._fold(entry)

    def lose_step(self, ctrl, records, request_ids, ring_drops=(), reason: str = "writer") -> None:
        """A step whose rows were lost before they reached this exporter (the writer process died):
        its captures go into the drops table now and are committed with the steps around them."""
        self._request_ids = request_ids
        entry = PendingStep(ctrl.step, len(self.plan.sites))
        self._take_ring_drops(ring_drops, ctrl.step, entry)
        self._append_drops(self._step_drops(ctrl, records, entry, reason))
        self._flush_jobs()
        entry.cum = np.array([g.rows for g in self._all], np.int64)
        self._log.append(entry)

    def _step_drops(self, ctrl, records, entry: PendingStep, reason: str) -> list[Drop]:
        """Every capture of a step as dropped (``records``' bytes are only counted)."""
        new = []
        for g, sel, n, got in self._rows(ctrl, records, entry):
            reqs = tuple(np.unique(ctrl.tokens.request[sel]).tolist())
            for s, item in zip(g.sites, got):
                if item is not None:
                    new.append(Drop(ctrl.step, s.index, reqs, n, len(item[2]), reason))
                    self._drop(new[-1], entry)
        return new

    def _rows(self, ctrl, records, entry: PendingStep):
        """Per group with rows this step: (group, selected rows, count, per-site record or None);
        counts the selected rows the engine never computed."""
        tokens = ctrl.tokens
        by_site = {slot.site: (slot, rec, data) for slot, rec, data in records}
        for g in self.groups.values():
            got = [by_site.get(s.index) for s in g.sites]
            for s, item in zip(g.sites, got):
                if item is None and s.index in ctrl.slots:
                    entry.nc[s.index] += len(ctrl.slots[s.index].sel)
            present = [x for x in got if x is not None]
            if not present:
                continue
            slot, rec, _ = present[0]
            sel = computed_rows(tokens, slot, rec)
            for s, item in zip(g.sites, got):
                if item is not None:
                    entry.nc[s.index] += len(slot.sel) - len(sel)
            if len(sel):
                yield g, sel, len(sel), got

    def _ingest(self, g: GroupBuffer, ctrl, sel, n: int, got, request_ids, entry: PendingStep) -> None:
        tokens = ctrl.tokens
        req = tokens.request[sel]
        ids = np.asarray(request_ids[: int(req.max()) + 1], dtype=object)
        cols = {"request": ids[req], "position": tokens.position[sel], "step": np.full(n, ctrl.step, np.int64),
                "phase": PHASE_NAMES[tokens.phase[sel]]}
        if "token_id" in g.files:
            cols["token_id"] = tokens.token_ids(sel)
        srcs: dict[str, list] = {o.name: [None] * len(g.sites) for o in g.sites[0].outputs}
        for li, arrays in self._records(g, n, got, entry):    # a dropped layer's rows stay NaN / -1
            for name, a in arrays.items():
                srcs[name][li] = a
        entry.reqs[g.name] = req
        self._append(g, n, cols, srcs)

    def _records(self, g: GroupBuffer, n: int, got, entry: "PendingStep"):
        """(layer index in the group, {output name: [n, *shape] view}) of each record of a group's
        step (dropped or not computed captures skipped), counted as stored."""
        outputs = g.sites[0].outputs
        for li, (s, item) in enumerate(zip(g.sites, got)):
            if item is None:
                continue
            _, rec, data = item
            if int(rec["rows"]) != n:
                raise StoreError(f"site {s.name}: record has {int(rec['rows'])} rows, expected {n}")
            entry.stored[s.index] += n
            entry.bytes[s.index] += len(data)
            yield li, output_views(outputs, n, data, self.capture_dtype)

    def _append(self, g: GroupBuffer, n: int, cols: dict, srcs: dict | None = None) -> None:
        """Copy n rows into the open chunk(s) of a group; a chunk that fills goes to the writers."""
        done, c = 0, g.chunk_rows
        while done < n:
            a = g.fill
            k = min(n - done, c - a)
            for name, v in cols.items():
                g.buf[name][a:a + k] = v[done:done + k]
            for name, layers in (srcs or {}).items():
                buf, fill = g.buf[name], g.files[name].fill
                for li, src in enumerate(layers):
                    dst = buf[a:a + k, li] if g.per_layer else buf[a:a + k]
                    if src is None:
                        dst[...] = fill
                    else:
                        self._jobs.append((dst, src[done:done + k]))
                        self._job_bytes += dst.nbytes
            g.fill += k
            g.rows += k
            done += k
            if g.fill == c:
                self._sealed.append((g, g.chunk, g.buf, g.rows))
                g.buf = self._fresh(g)
                g.chunk, g.fill, g.snap = g.chunk + 1, 0, g.rows

    def _flush_jobs(self) -> None:
        """Run the step's row copies (on several threads when the step is big), then hand the
        chunks it filled to the writers."""
        jobs, self._jobs = self._jobs, []
        if self._copy_pool is not None and self._job_bytes >= COPY_PARALLEL_BYTES and len(jobs) > 1:
            n = min(self._workers, len(jobs))
            list(self._copy_pool.map(copy_all, [jobs[k::n] for k in range(n)]))
        else:
            copy_all(jobs)
        self._job_bytes = 0
        sealed, self._sealed = self._sealed, []
        for g, i, bufs, end in sealed:
            self._submit(g, i, bufs, end, recycle=True)
