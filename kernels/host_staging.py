"""Host staging of a :class:`dmi.kernels.kernel_ring.KernelRing`: the drain copies ended steps'
blocks from the payload ring into a byte ring of host memory (adjacent steps as one copy), which
the exporter frees in step order; the parts of a streamed step go to recycled part buffers.
"""
from __future__ import annotations

import threading

import numpy as np

from ..errors import CaptureError
from ..ring.bytering import ByteRing
from ..ring.layout import StepControl
from ..stall import Stall


ALIGN_GAP = 64 << 10          # steps this close in the payload ring are copied as one span


# a streamed step's parts are held until its last part: in recycled host buffers, pinned up to this
# much in all (a D2H copy into fresh pageable memory ran at about 2 GB/s on an H100 host, and the
# model waits for it to free the ring; perf/offline.py --headline), pageable past it
PART_PINNED_BYTES = 4 << 30


class HostStaging:
    """The kernel ring's drain side (a mixin of :class:`dmi.kernels.kernel_ring.KernelRing`): where
    the payload goes on the host. The ring subclass copies (:meth:`_copy`, :meth:`_copies_done`)
    and may pin part buffers (:meth:`_pinned_buffer`); the ring's ``stats``, ``error``, ``bytes``
    and ``stall_timeout`` are read here."""

    def _init_staging(self, staging: np.ndarray) -> None:
        """Host staging: a byte ring over ``staging`` that the drain reserves in step order and the
        exporter frees in order (:meth:`release_host`)."""
        self._staging = staging
        self._stage = ByteRing(len(staging))
        self._stage_cond = threading.Condition()
        self._stage_ends: dict[int, int] = {}
        self._copy_lock = threading.Lock()     # who copies a step: the model's thread or the drain
        self._part_free: list[np.ndarray] = []         # host buffers for streamed parts, free to reuse
        self._part_held: dict[int, np.ndarray] = {}    # id(ctrl) -> the buffer its part (copy group) lies in
        self._part_pinned: set[int] = set()            # ids of the pinned ones
        self.part_buffer_bytes = 0                     # allocated for parts: grows to the largest streamed step
        self.part_pinned_bytes = 0                     # of which pinned

    def enter_thread(self) -> None:
        """A thread's device setup before it touches the ring (CudaRing)."""

    def _copy(self, host: int, lo: int, nbytes: int, pinned: bool = True) -> None:
        """Payload ``[lo, lo + nbytes)`` to host address ``host`` (CudaRing: async, on the drain stream)."""
        raise NotImplementedError

    def _copies_done(self) -> None:
        """Wait until every copy :meth:`_copy` queued has landed."""

    # --- drain: the payload to host staging -----------------------------------------------------
    def fetch_steps(self, ctrls: list[StepControl], recs: list[np.ndarray]) -> list[list[np.ndarray]]:
        """Copy several steps' records to host staging: one async copy (:meth:`_copy`) per run of steps
        that are adjacent in the payload ring (up to a quarter of staging), one event wait for all
        (which also covers steps the model's thread copied out already: same stream, queued earlier)."""
        self.enter_thread()
        bases: dict[int, tuple[np.ndarray, int]] = {}     # step index -> (buffer, buffer index of ring offset 0)
        with self._copy_lock:                  # claim the steps not copied out yet, reserving in order
            for i, ctrl in enumerate(ctrls):
                if isinstance(ctrl.copied, tuple):
                    bases[i] = ctrl.copied
                else:
                    ctrl.copied = "drain"
            # each step's reserved block (its records lie in it): no per-step reductions over records
            spans = [(c.base, c.base + c.nbytes) if c.nbytes and len(r) and i not in bases else None
                     for i, (c, r) in enumerate(zip(ctrls, recs))]
            groups: list[list[int]] = []           # indices of steps copied together
            lo = hi = 0
            for i, span in enumerate(spans):
                if span is None:
                    continue
                if groups and 0 <= span[0] - hi <= ALIGN_GAP and span[1] - lo <= self._stage.capacity // 4:
                    groups[-1].append(i)
                    hi = span[1]
                else:
                    groups.append([i])
                    lo, hi = span
            copies, upto = [], len(ctrls)
            for k, group in enumerate(groups):
                lo, hi = spans[group[0]][0], spans[group[-1]][1]
                # only the batch's first copy may wait for staging: the exporter frees it, and it gets
                # this batch's steps only once they are all copied (waiting for a later one: deadlock)
                got = self._stage_for(ctrls[group[-1]], hi - lo, wait=not k)
                if got is None:
                    upto = group[0]                # the rest stays pending for the next batch
                    for i in range(upto, len(ctrls)):
                        if ctrls[i].copied == "drain":
                            ctrls[i].copied = None
                    break
                buf, dst = got
                pinned = buf is self._staging or id(buf) in self._part_pinned
                copies.append((buf.ctypes.data + dst, lo, hi - lo, pinned))
                for i in group:
                    bases[i] = (buf, dst - lo)
        for host, lo, nbytes, pinned in copies:    # outside the lock: the model's thread may copy its next step meanwhile
            self._copy(host, lo, nbytes, pinned)
        if bases:
            self._copies_done()
        out = []
        for i, r in enumerate(recs[:upto]):
            if i not in bases:
                out.append([])
                continue
            buf, shift = bases[i]
            self.stats.bytes_captured += int(r["nbytes"].sum())
            out.append([buf[a:a + n] for a, n in zip((r["offset"] + shift).tolist(), r["nbytes"].tolist())])
        return out

    def _stage_for(self, ctrl: StepControl, span: int, wait: bool = True) -> tuple[np.ndarray, int] | None:
        """(buffer, byte index) for ``span`` bytes: host staging, freed when the exporter is done
        with ``ctrl`` (the last step of the copy); for a part of a streamed step, a part buffer
        (the run holds parts until the step's last: in staging they could leave nothing for the
        parts still to come, and they never wait); pageable memory for a span larger than staging.
        ``wait``: else None when staging is full."""
        if ctrl.stream is not None:
            buf = self._part_buffer(span)
            self._part_held[id(ctrl)] = buf
            return buf, 0
        if span > self._stage.capacity:
            return np.empty(span, np.uint8), 0
        with self._stage_cond:
            stall = None
            while (got := self._stage.try_reserve(span)) is None:
                if self.error is not None:
                    raise CaptureError("drain stopped") from self.error
                if not wait:
                    return None
                if stall is None:
                    stall = Stall(f"the drain waiting for host staging (step {ctrl.step})", self.stall_timeout,
                                  lambda: f"needs {span:,} bytes; staging {self._stage.used:,} of "
                                          f"{self._stage.capacity:,} bytes held by steps the store has not "
                                          f"written yet")
                self._stage_cond.wait(0.05)
                stall.check(self._stage.tail)
        base, end = got
        self._stage_ends[id(ctrl)] = end
        return self._staging, base

    def _part_buffer(self, span: int) -> np.ndarray:
        """The smallest free part buffer of at least ``span`` bytes, else a new one of at least half
        the ring (a part's most): pinned while those stay within ``PART_PINNED_BYTES``."""
        with self._stage_cond:
            fits = [i for i, b in enumerate(self._part_free) if len(b) >= span]
            if fits:
                return self._part_free.pop(min(fits, key=lambda i: len(self._part_free[i])))
        size = max(span, self.bytes.capacity // 2)
        buf = self._pinned_buffer(size) if self.part_pinned_bytes + size <= PART_PINNED_BYTES else None
        if buf is None:
            buf = np.empty(size, np.uint8)
        else:
            self._part_pinned.add(id(buf))
            self.part_pinned_bytes += size
        self.part_buffer_bytes += size
        return buf

    def _pinned_buffer(self, nbytes: int) -> np.ndarray | None:
        """Pinned host memory for part buffers, freed at close (None: this ring has none)."""
        return None

    def release_host(self, ctrl: StepControl) -> None:
        buf = self._part_held.pop(id(ctrl), None)
        if buf is not None:
            with self._stage_cond:
                self._part_free.append(buf)
        end = self._stage_ends.pop(id(ctrl), None)
        if end is not None:
            with self._stage_cond:
                self._stage.release(end)
                self._stage_cond.notify_all()
