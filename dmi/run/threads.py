"""A run's two threads: the drain (ended steps copied out of the ring, or handed to the drain
process under ``policy.drain: process``) and the exporter (steps written to the store and to live
subscribers), the host budget between them, and flush / close waiting for both.
"""
from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time

from ..errors import CaptureError, StoreError
from ..ring.layout import SiteSlot, StepControl
from ..ring.records import EXPORTED
from ..ring.share import StepSender
from ..stall import Stall
from ..store.commits import TICK_S


_STOP = object()
DRAIN_INTERVAL_S = 0.1       # the drain copies ready steps out in batches this far apart ...
DRAIN_FAST_S = 0.0005        # ... or this far apart while a flush or close waits for it
DRAIN_BATCH = 64             # steps per batch at most


class DrainExport:
    """The drain and export threads of one run (started here): ``ring`` to ``exporter``, each
    step's rows named by ``request_ids()``, delivered to ``subscribers`` too."""

    def __init__(self, ring, exporter, plan, request_ids, subscribers, name: str):
        self.ring, self.exporter, self.plan, self.subscribers = ring, exporter, plan, subscribers
        self.request_ids = request_ids         # () -> the run's request ids so far (row i: request i)
        self.remote = plan.policy.drain == "process"     # the drain runs in the writer's child (dmi.ring.share)
        self.store = str(exporter.path)
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._parts: list = []               # the drained parts of a streamed step, until its last
        self.exported = 0                    # steps the exporter thread is done with
        self._queue_cond = threading.Condition()
        self.closed = False
        self.drain_interval = DRAIN_INTERVAL_S
        self.thread_cpu_s: dict[str, float] = {}     # CPU seconds of the drain and export threads, once ended
        if self.remote:                      # what the drain thread has handed to the drain process
            self._sender, self._last_sent = StepSender(), 0
        self.drain = threading.Thread(target=self._drain_loop, name=f"dmi-drain-{name}", daemon=True)
        self.export = threading.Thread(target=self._export_loop, name=f"dmi-export-{name}", daemon=True)
        self.drain.start()
        self.export.start()

    def _drain_loop(self) -> None:
        """The drain thread: a batch of ended steps each time one is due (:meth:`_until_due`),
        copied out here and queued for the exporter, or (``policy.drain: process``) handed to the
        child that drains them."""
        batch = self._hand_over if self.remote else self._copy_out
        try:
            while True:
                self._until_due()
                if batch() or (self.closed and (not self.ring.pending or self.ring.error is not None)):
                    break
        except BaseException as e:    # surfaces in the caller's next step or close
            self.fail(e)
        finally:
            self.thread_cpu_s["drain"] = time.thread_time()
            self._queue.put(_STOP)

    def _until_due(self) -> None:
        """Sleep without the GIL until the next batch is due or the ring needs room now (``urgent``;
        while a step waits for room, ``ring.waiting``, only briefly: the step it needs may still be
        on the GPU)."""
        ring = self.ring
        ring.urgent.wait(DRAIN_FAST_S if self.closed or ring.hurry or ring.waiting else self.drain_interval)
        ring.urgent.clear()

    def _copy_out(self) -> bool:
        """Copy the ready steps out and queue them for the exporter. True: stop (the run failed)."""
        ring, budget = self.ring, self.plan.policy.host_bytes
        while ctrls := ring.drain_ready(DRAIN_BATCH):
            # the steps go to the exporter in chunks, one handover (queue, wake-ups) a chunk,
            # not a step: both threads take the engine's GIL for it
            chunk = []
            for ctrl, records in zip(ctrls, ring.drain_steps(ctrls)):
                nbytes = sum(len(r[2]) for r in records)
                with self._queue_cond:   # host budget: wait for the exporter before staging more
                    if chunk and self._queued_bytes + nbytes > budget:
                        self._queue.put(chunk)    # (what the exporter can free meanwhile)
                        chunk = []
                    stall = None
                    while self._queued_bytes and self._queued_bytes + nbytes > budget:
                        if ring.error:
                            return True
                        stall = stall or Stall(f"the drain waiting for the exporter (step {ctrl.step})",
                                               ring.stall_timeout, lambda: self._queue_figures(nbytes))
                        self._queue_cond.wait(0.05)
                        stall.check(self._queued_bytes)
                    self._queued_bytes += nbytes
                chunk.append((ctrl, records, nbytes))
            if chunk:
                self._queue.put(chunk)
        return False

    def _queue_figures(self, nbytes: int = 0) -> str:
        """The exporter queue's figures for an error."""
        return (f"{nbytes:,} bytes to hand over; {self._queued_bytes:,} bytes queued for the store of "
                f"policy.host_bytes {self.plan.policy.host_bytes:,}; {self.exported} of {self.ring.stats.steps} "
                f"steps exported; store {self.store}")

    def _hand_over(self) -> bool:
        """``policy.drain: process``: send the newly ended steps to the child as descriptors and
        take its progress (freed ring space, steps written) from the shared words. True: stop."""
        ring, exp = self.ring, self.exporter
        if exp.drain_error is not None:
            raise CaptureError(f"the drain process stopped: {exp.drain_error}")
        if ring.error is not None:
            return True
        with ring.cond:
            ring.reclaim()
            new = []                           # pending steps not sent yet: the newest ones
            for ctrl in reversed(ring.pending):
                if ctrl.end_seq <= self._last_sent:
                    break
                new.append(ctrl)
        ended = list(itertools.takewhile(lambda c: c.ended, reversed(new)))
        if ended:
            exp.send_steps([self._sender.describe(c) for c in ended], self.request_ids(), ring.stats.drops)
            self._last_sent = ended[-1].end_seq
        with self._queue_cond:
            exported = int(ring.share.words[EXPORTED])
            if exported != self.exported:
                self.exported = exported
                self._queue_cond.notify_all()
        return False

    def _export_loop(self) -> None:
        exporter = self.exporter
        try:
            self.ring.enter_thread()           # (it waits for steps' token ids copied from the device)
        except BaseException as e:             # surfaces in the caller's next step, flush or close
            self.fail(e)
        while True:
            try:   # wake up now and then: a failed write surfaces, and commits go on while idle
                item = self._queue.get(timeout=TICK_S)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if isinstance(item, list):         # a chunk of drained steps: (step, records, bytes) in step order
                self._export_steps(item)
                continue
            try:
                if item is None:
                    exporter.tick()
                else:                          # flush(): commit what was handed over
                    try:
                        exporter.sync()
                    finally:
                        item.set()
            except BaseException as e:     # surfaces in the caller's next step, flush or close
                self.fail(e)
        self.thread_cpu_s["export"] = time.thread_time()

    def _export_steps(self, steps: list) -> None:
        """Write a chunk of drained steps (after a failure the exporter accounts each as dropped
        instead), freeing each one's staging as it goes. The parts of a streamed step are held
        until its last part and written as one step."""
        whole = 0
        try:
            for drained, records, _ in steps:
                ctrl, held = drained, [drained]
                if ctrl.stream is not None:
                    self._parts.append((ctrl, records))
                    if ctrl.partial:
                        continue
                    held = [c for c, _ in self._parts]       # each part's host buffer, freed in order
                    ctrl, records = merged_parts(self._parts)
                    self._parts = []
                whole += 1
                try:
                    self.exporter.write_step(ctrl, records, self.request_ids(), self.ring.stats.drops)
                    if self.subscribers:
                        self.subscribers.deliver(ctrl, records, self.request_ids())
                except BaseException as e:     # surfaces in the caller's next step, flush or close
                    self.fail(e)
                finally:
                    for part in held:
                        self.ring.release_host(part)
        finally:
            with self._queue_cond:
                self._queued_bytes -= sum(n for *_, n in steps)
                self.exported += whole
                self._queue_cond.notify_all()

    def fail(self, e: BaseException) -> None:
        if self.ring.error is None:
            self.ring.error = e
        with self.ring.cond:
            self.ring.cond.notify_all()

    def flush(self, timeout: float | None) -> bool:
        """Wait until every step begun so far is written and committed (True), or the timeout passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ring = self.ring
        stall = Stall("flush waiting for the drain and the store", ring.stall_timeout,
                      lambda: f"{ring.describe_room()}; {self._queue_figures()}")
        with self._queue_cond:
            while self.exported < ring.stats.steps:
                if ring.error is not None:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._queue_cond.wait(0.01 if left is None else min(left, 0.01))
                stall.check((self.exported, self._queued_bytes, ring.bytes.tail, ring.stats.bytes_drained))
        if ring.error is None and self.export.is_alive():    # and on disk, committed
            done = threading.Event()
            self._queue.put(done)
            stall = Stall("flush waiting for the store's commit", ring.stall_timeout, lambda: f"store {self.store}")
            while not done.wait(0.01):
                if ring.error is not None:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    return False
                stall.check(self.exporter.store_bytes)
        ring.raise_if_failed()
        return True

    def stop(self) -> None:
        """Drain what is left, then stop both threads (close); a failure goes to :meth:`fail`."""
        self.closed = True
        self.ring.urgent.set()
        ring = self.ring
        try:
            self._join(self.drain, "close waiting for the drain",
                       lambda: (ring.bytes.tail, ring.freed_seq, len(ring.pending)), ring.describe_room)
        except CaptureError as e:          # (the drain then stops; the store is closed as failed)
            self.fail(e)
        self._join(self.export, "close waiting for the store's writes",
                   lambda: (self.exported, self.exporter.store_bytes), self._queue_figures)
        if self.remote:
            try:              # (the child lets go of the ring before this process frees it)
                self.exporter.detach_ring()
            except StoreError as e:
                self.fail(e)

    def _join(self, thread: threading.Thread, stage: str, progress, figures) -> None:
        """Join one of the run's threads; a CaptureError once it shows no progress for
        ``policy.stall_timeout_s`` (the thread, a daemon, is left behind)."""
        stall = Stall(stage, self.ring.stall_timeout, figures)
        while thread.is_alive():
            thread.join(0.05)
            if thread.is_alive():
                stall.check(progress())


def merged_parts(parts: list) -> tuple[StepControl, list]:
    """The parts of a streamed step (:class:`dmi.ring.layout.StreamedStep`) as one step: every part's records,
    and as its slots every capture it planned (those that never ran too, so the store counts their
    rows as not computed, as for a whole step)."""
    last = parts[-1][0]
    slots = {}
    for ctrl, _ in parts:
        slots.update(ctrl.slots)
    for site, ((_, sel, rows, *_), _) in last.stream.wanted.items():
        slots[site] = SiteSlot(site, 0, 0, sel, rows, -1)
    records = [r for _, recs in parts for r in recs]
    return dataclasses.replace(last, slots=slots, stream=None, partial=False), records
