"""The store's commit protocol and row accounting (:class:`dmi.store.exporter.ZarrExporter`): a
step is committed once its rows are on disk in every group; the arrays' shapes then grow to it and
the root attribute ``dmi_committed`` says what the store holds.
"""
from __future__ import annotations

import time

import numpy as np

from ..errors import StoreError
from .chunk_threads import FIX_IO
from .preflight import store_gone


TICK_S = 0.25          # the exporter thread looks at failures and the commit clock at least this often


COMMIT_S = 1.0         # open chunks are written and steps committed at least this often


class PendingStep:
    """One step appended but not yet committed: rows per group after it, and its row accounting."""
    __slots__ = ("step", "cum", "stored", "dropped", "nc", "reqs", "bytes")

    def __init__(self, step: int, n_sites: int):
        self.step = step
        self.cum = None
        self.stored = np.zeros(n_sites, np.int64)
        self.dropped = np.zeros(n_sites, np.int64)
        self.nc = np.zeros(n_sites, np.int64)        # selected rows the engine did not compute
        self.reqs: dict[str, np.ndarray] = {}        # group -> request index of each row
        self.bytes = np.zeros(n_sites, np.int64)


class Commits:
    """Commits (a mixin of :class:`dmi.store.exporter.ZarrExporter`, whose log of pending steps and
    groups it reads)."""

    def tick(self) -> None:
        """The exporter thread, idle (at least every TICK_S): surface a failure, keep commits going."""
        if self.error is not None:
            self._on_failure()
        elif time.monotonic() - self._last_commit >= COMMIT_S:
            self.checkpoint()

    def checkpoint(self, wait_all: bool = False) -> None:
        """Write the open chunks, then commit every step whose rows are all on disk."""
        self._last_commit = time.monotonic()
        if self.error is None:
            for g in self._all:
                self._write_open(g)
        if wait_all:
            self._wait_all()
        if self.error is not None:
            self._on_failure()
            return
        with self._lock:
            durable = np.array([g.durable for g in self._all], np.int64)
        last = None
        while self._log and (self._log[0].cum <= durable).all():
            last = self._log.popleft()
            self._fold(last)
        if last is None:
            return
        self.committed_step = last.step
        try:
            gone = store_gone(self.loc)
            if gone is not None:
                raise gone
            for g, n in zip(self._all, last.cum.tolist()):
                if g.shape_rows != n:
                    for f in g.files.values():
                        f.set_rows(n)
                    g.shape_rows = n
            self.root_attrs.update({"dmi_committed": self._marker()})   # a temp file renamed over zarr.json
        except (OSError, StoreError) as e:
            with self._lock:
                if self.error is None:
                    self.error = e if isinstance(e, StoreError) else (store_gone(self.loc) or StoreError(
                        f"{self.path}: committing step {last.step} failed: {e}. {FIX_IO}"))
            self._on_failure()

    def _marker(self, summary: dict | None = None) -> dict:
        """Root attribute ``dmi_committed``: the last step the store holds, the rows of each group up to
        it, and per site (in ``sites`` order) the row accounting of the steps it covers."""
        acc = self.accounting()
        names = [s.name for s in self.plan.sites]
        summary = summary or {}
        if "rows_selected" in summary:
            acc = {k: [summary[f"rows_{k}"][n] for n in names] for k in ("selected", "stored", "dropped", "not_computed")}
        else:     # committed steps only: their selected rows are exactly what was stored, dropped or not computed
            acc["selected"] = acc["selected"] + self._acc["stored"] + self._acc["dropped"] + self._acc["not_computed"]
        return {"step": self.committed_step, "next_step": summary.get("steps", self.committed_step + 1),
                "rows": {g.name: g.shape_rows for g in self._all},
                **{k: [int(x) for x in v] for k, v in acc.items()}}

    def continue_run(self, prior: dict[str, np.ndarray], ring_drops_done: int) -> None:
        """This exporter resumed a store that the same run was writing (its writer process died):
        what the store committed beyond ``prior`` (the store's accounting when the run opened it)
        is this run's own, and the run's first ``ring_drops_done`` ring drops are in its table."""
        for k in ("stored", "dropped", "not_computed"):
            self._acc[k] = self.prior[k] - prior[k]
        self.prior = {k: np.array(prior[k], np.int64) for k in self.prior}
        self._ring_pos = ring_drops_done

    def accounting(self) -> dict[str, np.ndarray]:
        """Per site, rows accounted so far (earlier runs of a resumed store included): ``stored``,
        ``dropped``, ``not_computed``; ``selected`` holds only the earlier runs' (the run counts its own)."""
        return {"selected": self.prior["selected"].copy(),
                **{k: self.prior[k] + self._acc[k] for k in ("stored", "dropped", "not_computed")}}

    def _fold(self, e: PendingStep) -> None:
        self._acc["stored"] += e.stored
        self._acc["dropped"] += e.dropped
        self._acc["not_computed"] += e.nc
