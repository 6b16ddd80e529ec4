"""A ring drained in another process (``policy.drain: process``).

In-process, a drain thread copies each ended step out of the ring and an export thread writes it:
both are Python on the model process's GIL, which a serving engine's thread needs between its
kernel launches (a fixed piece of Python on vLLM's engine thread runs slower while they run:
``perf/online.py --probe``). With ``policy.drain: process`` the store writer's child
process (:mod:`dmi.store.writer`) does both: it polls the meta ring, copies each step's block to its own
host memory, writes it, and tells the model's process which ring space is free again.

The model's process keeps everything that decides (reservations, backpressure, ``best_effort``
drops, the bandwidth cap, the device side). What the two processes share:

* a file in /dev/shm mapped by both (:class:`RingShare`): the child's progress words, the meta
  ring (the capture kernels write it through the device mapping the model's process registers
  with ``cudaHostRegister``; the CPU ring writes it from the host), and for the CPU ring the
  payload ring too;
* on CUDA the payload ring itself, through a CUDA IPC handle of its ``cudaMalloc`` memory;
* the writer's socket: step descriptors go to the child in batches (:class:`StepSender`, once per
  drain window or interval, not per step), the child answers only when its state changes.

The progress words are each monotonic and written once the copy they announce is complete, so
the model's process reads them at any moment, in any order, without a lock across processes
(:meth:`dmi.ring.protocol.Ring.reclaim`): a stale word only frees less.
"""
from __future__ import annotations

import mmap
import os

import numpy as np

from ..shared_memory import map_shared, shared_file
from .layout import LaidOutSlots, SiteSlot, StepControl, StepLayout
from .protocol import Ring
from .records import CAPTURED, DRAINED, EXPORTED, FREED_SEQ, META_DTYPE, NOT_RUN, RECORDS, TAIL, WORDS, align_up


HEADER = 4096                  # words, then the meta ring from here, then the CPU ring's payload
LAYOUTS_SENT = 256             # layouts the child remembers by number (an engine's batch shapes come and go)


class RingShare:
    """The shared file: progress words, the meta ring, and (CPU ring) the payload ring."""

    def __init__(self, path: str, mapping: mmap.mmap, meta_records: int, payload_bytes: int):
        self.path, self.map = path, mapping
        self.meta_records, self.payload_bytes = meta_records, payload_bytes
        raw = np.frombuffer(mapping, np.uint8)
        self.words = raw[:WORDS * 8].view(np.int64)
        meta_end = HEADER + meta_records * META_DTYPE.itemsize
        self.meta = raw[HEADER:meta_end].view(META_DTYPE)
        start = align_up(meta_end)
        self.payload = raw[start:start + payload_bytes]
        self.meta_offset = HEADER

    @staticmethod
    def size(meta_records: int, payload_bytes: int) -> int:
        return align_up(HEADER + meta_records * META_DTYPE.itemsize) + payload_bytes

    @classmethod
    def create(cls, meta_records: int, payload_bytes: int = 0) -> "RingShare":
        """A fresh file (zeroed: an empty meta ring, no progress). OSError where no place has room."""
        path, mapping = shared_file(cls.size(meta_records, payload_bytes), "dmi-ring-")
        share = cls(path, mapping, meta_records, payload_bytes)
        share.words[FREED_SEQ] = 1       # (as Ring.freed_seq starts)
        return share

    @classmethod
    def attach(cls, info: dict) -> "RingShare":
        """The child's mapping of the model process's file (``info``: :meth:`describe`)."""
        return cls(info["path"], map_shared(info["path"]), info["meta_records"], info["payload_bytes"])

    def describe(self) -> dict:
        return {"path": self.path, "meta_records": self.meta_records, "payload_bytes": self.payload_bytes}

    def unlink(self) -> None:
        """The file's name goes once the child has mapped it: nothing is left behind if either dies."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# --- step descriptors ------------------------------------------------------------------------------

class StepSender:
    """The model's side: ended steps as small picklable tuples. A laid-out step's layout (its sites
    and row selections, shared by every step of one batch shape) travels once, by number."""

    def __init__(self) -> None:
        self._layouts: dict[int, tuple[int, StepLayout]] = {}    # id(layout) -> (number, layout kept alive)
        self._next = 0

    def describe(self, ctrl: StepControl) -> tuple:
        head = (ctrl.step, ctrl.tokens, ctrl.end_seq, ctrl.block_end, ctrl.first_seq, ctrl.base, ctrl.nbytes)
        slots = ctrl.slots
        if isinstance(slots, LaidOutSlots):
            L = slots.layout
            known = self._layouts.get(id(L))
            if known is not None and known[1] is L:
                return head + (("layout", known[0]),)
            number = self._next % LAYOUTS_SENT
            self._next += 1
            if len(self._layouts) >= LAYOUTS_SENT:             # forget the oldest (numbers are reused in turn)
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[id(L)] = (number, L)
            return head + (("new_layout", number, L.site_ids, L.src, [sel for sel, _ in L.arrays], L.nbytes),)
        return head + (("slots", [(s.site, s.offset, s.capacity, s.sel, s.seq) for s in slots.values()]),)


class StepReceiver:
    """The child's side: descriptors back into :class:`StepControl` objects the drain and the
    exporter read (``slot_views``, ``tokens``, seqs and the step's block)."""

    def __init__(self) -> None:
        self._layouts: dict[int, StepLayout] = {}

    def control(self, desc: tuple) -> StepControl:
        step, tokens, end_seq, block_end, first_seq, base, nbytes, slots = desc
        if slots[0] == "slots":
            empty = np.zeros(0, np.int64)
            built = {site: SiteSlot(site, offset, cap, sel, empty, seq) for site, offset, cap, sel, seq in slots[1]}
        else:
            if slots[0] == "new_layout":
                _, number, site_ids, src, sels, site_bytes = slots
                self._layouts[number] = StepLayout.of_arrays(site_ids, src, [(s, None) for s in sels], site_bytes,
                                                             [0] * len(site_ids))
            built = LaidOutSlots(self._layouts[slots[1]], base, first_seq)
        return StepControl(step, tokens, None, built, end_seq, block_end, first_seq, ended=True, base=base,
                           nbytes=nbytes)


class ChildSide:
    """Mixin of the child's ring readers (a :class:`dmi.ring.protocol.Ring` subclass after it): steps taken
    from descriptors, progress published into the shared words."""

    share: RingShare

    def take(self, descs: list, receiver: StepReceiver) -> None:
        ctrls = [receiver.control(d) for d in descs]
        with self.cond:
            for ctrl in ctrls:
                self.pending.append(ctrl)
                self.bytes.head = max(self.bytes.head, ctrl.block_end)

    def publish_progress(self, exported: int) -> None:
        """After a batch is drained (its ring space free: TAIL and FREED_SEQ) and written (EXPORTED)."""
        w, st = self.share.words, self.stats
        w[RECORDS], w[DRAINED], w[CAPTURED], w[NOT_RUN] = st.records, st.bytes_drained, st.bytes_captured, st.not_run
        w[TAIL] = self.bytes.tail
        w[FREED_SEQ] = self.freed_seq
        w[EXPORTED] = exported

    def batch(self, limit: int) -> list[StepControl]:
        """The oldest ready steps, at most ``limit`` and half the host staging together (at least
        one): the child writes a batch before it copies the next, so a batch must fit staging."""
        ctrls, total, budget = [], 0, self.staging_bytes // 2
        for ctrl in self.drain_ready(limit):
            if ctrls and total + ctrl.nbytes > budget:
                break
            ctrls.append(ctrl)
            total += ctrl.nbytes
        return ctrls


class CpuRingReader(ChildSide, Ring):
    """The child's side of a :class:`dmi.ring.cpu.CpuRing` drained in another process: payload and meta
    ring both in the shared file (CI runs the whole protocol with it)."""

    def __init__(self, info: dict, share: RingShare):
        Ring.__init__(self, info["capacity"], share.meta_records, info["mode"])
        self.share = share
        self.staging_bytes = info["capacity"]

    def meta_view(self) -> np.ndarray:
        return self.share.meta

    def copy_out(self, offset: int, nbytes: int) -> np.ndarray:
        return self.share.payload[offset:offset + nbytes].copy()     # (the space is freed right after)

