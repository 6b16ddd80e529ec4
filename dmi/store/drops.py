"""What the store loses (:class:`dmi.store.exporter.ZarrExporter`): the ring's drops and the
store's own (reason ``sink``) into the ``drops`` table, and a failed store under
``policy.on_store_error``.
"""
from __future__ import annotations

import logging

import numpy as np

from ..plan import Plan
from ..ring.budget import Drop
from .commits import PendingStep


log = logging.getLogger("dmi")


def sink_policy(plan: Plan) -> str:
    """What a failed store write does: policy.on_store_error (the plan defaults it from
    policy.mode: full raises, the model stops; best_effort drops, the model runs on)."""
    return plan.policy.on_store_error


class Drops:
    """Drops and failures (a mixin of :class:`dmi.store.exporter.ZarrExporter`)."""

    def _take_ring_drops(self, ring_drops, step: int, entry: PendingStep | None) -> None:
        """The ring's drops up to ``step``: counted with the step and appended to the drops table."""
        new = []
        while self._ring_pos < len(ring_drops) and (step is None or ring_drops[self._ring_pos].step <= step):
            new.append(ring_drops[self._ring_pos])
            self._ring_pos += 1
        for d in new:
            if entry is not None:
                entry.dropped[d.site] += d.rows
            else:
                self._acc["dropped"][d.site] += d.rows
        self._append_drops(new)
        release = getattr(ring_drops, "release", None)     # (dmi.ring.budget.DropLog: written, so forgotten there)
        if release is not None:
            release(self._ring_pos)

    def _append_drops(self, drops: list[Drop]) -> None:
        if not drops:
            return
        names = [s.name for s in self.plan.sites]
        cols = {"step": np.array([d.step for d in drops], np.int64),
                "site": np.array([names[d.site] for d in drops], object),
                "requests": np.array([self.request_names(d) for d in drops], object),
                "rows": np.array([d.rows for d in drops], np.int64),
                "bytes": np.array([d.bytes for d in drops], np.int64),
                "reason": np.array([d.reason for d in drops], object)}
        self._append(self.drops_group, len(drops), cols)
        self._flush_jobs()

    def request_names(self, d: Drop) -> str:
        """The dropped capture's requests as the store names them (its ``request`` coordinate's ids),
        space-separated."""
        ids = self._request_ids
        return " ".join(ids[i] if i < len(ids) else str(i) for i in d.requests)

    def _drop(self, d: Drop, entry: PendingStep) -> None:
        self.drops.append(d)
        entry.dropped[d.site] += d.rows

    def _sink_drops(self, e: PendingStep) -> None:
        """A step whose rows will never be committed: its stored rows become drops (reason sink)."""
        names = {s.index: s for s in self.plan.sites}
        for i in np.flatnonzero(e.stored).tolist():
            rows = int(e.stored[i])
            reqs = tuple(np.unique(e.reqs.get(names[i].group, np.zeros(0, np.int64))).tolist())
            self.drops.append(Drop(e.step, i, reqs, rows, int(e.bytes[i]), "sink"))
            e.dropped[i] += rows
            e.stored[i] = 0
        self._fold(e)

    def _on_failure(self) -> None:
        """The store failed: steps not committed are accounted as dropped (reason sink) and nothing
        more is written to the site groups; policy.on_store_error raise: raise it (once)."""
        if not self._failed:
            self._failed = True
            while self._log:
                self._sink_drops(self._log.popleft())
            if self.on_error == "drop":
                log.warning("dmi: %s; policy.on_store_error is drop: the model keeps running and every later "
                            "capture is dropped (reason sink)", self.error)
        if self.on_error == "raise" and not self._raised:
            self._raised = True
            raise self.error
