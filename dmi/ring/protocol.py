"""Ring²: a payload ring (where captured rows are written) plus a meta ring of fixed-size records.

Protocol, shared by every backend (CPU here, CUDA in ``dmi.kernels``):

1. ``begin_step`` (host): from the plan's analytic sizes, reserve one contiguous block of the
   payload ring for the step (wrapping to the start when the tail does not fit) and one meta
   sequence number per site plus one for the step's end marker. ``full`` mode waits for the drain
   to free space (backpressure, stall time counted); ``best_effort`` drops whole site captures,
   lowest priority first, and records each drop.
2. ``capture`` (device side, inside the model's forward): copy the selected rows of a site into
   the reserved offset, then publish a meta record whose ``seq`` field is written last.
3. ``end_step`` (device side, after the forward): publish the end marker record.
4. The drain thread polls the meta ring (no CUDA calls) for the oldest open step's end marker,
   then copies each published record's bytes to host staging, frees the block and the meta slots,
   and hands the step to the exporter. A planned record that was never published (its module did
   not run) is counted, never waited for.

Backends implement the hooks marked below: ``CpuRing`` (:mod:`dmi.ring.cpu`: payload and meta in host memory,
the capture runs ``dmi.gather`` in torch) and ``dmi.kernels.cuda_ring.CudaRing`` (payload in
device memory, meta in mapped pinned host memory, a Triton kernel per capture). Both share this
class's reservation, drop and drain bookkeeping.
"""
from __future__ import annotations

import collections
import collections.abc
import itertools
import threading
import time
from typing import NamedTuple

import numpy as np

from ..errors import CaptureError, PolicyError
from ..stall import DEFAULT_STALL_TIMEOUT_S, Stall
from .budget import Drop, Stats, TokenBucket
from .bytering import ByteRing
from .layout import LaidOutSlots, SiteSlot, StepControl, StepLayout, StreamedStep, slot_views
from .records import CAPTURED, DRAINED, FLAG_ABORTED, FREED_SEQ, META_WORDS, NOT_RUN, RECORDS, TAIL, align_up


class _AheadUndo(NamedTuple):
    """A step begun ahead of its forward, and what :meth:`Ring.retract_ahead` restores."""
    ctrl: "StepControl"
    head: int                  # the byte ring's head before it
    before: "StepControl | None"     # the open step before it
    bucket: "TokenBucket | None"     # the bandwidth bucket it spent from, and how much
    spent: int
    drops: tuple | None        # the drops a bandwidth cap made from it (``_record_laid_out_drops`` args)


class Ring:
    """Host side of Ring², independent of where the payload lives."""

    def __init__(self, capacity: int, meta_records: int, mode: str = "full"):
        self.bytes = ByteRing(capacity)
        self.meta_records = meta_records
        self.mode = mode
        self.next_seq = 1               # 0 marks an empty meta slot
        self.freed_seq = 1              # every seq below is consumed by the drain
        self.cond = threading.Condition()
        self.pending: collections.deque[StepControl] = collections.deque()
        self.current: StepControl | None = None
        self.stats = Stats()
        self.error: BaseException | None = None
        self.null = False               # null mode: the run begins no steps (capture kernels still launch)
        self.bucket: TokenBucket | None = None    # policy.d2h_bytes_per_s (set up from the plan)
        # The drain runs in batches, every DRAIN_INTERVAL_S: waking per step would contend for the
        # GIL with the thread that drives the model exactly when the GPU waits for it. ``urgent``
        # wakes it early (ring or meta ring a quarter full, backpressure, flush, close).
        self.urgent = threading.Event()
        self.hurry = False
        # a step waits for room: the drain polls fast until it has it. Woken once, the drain often
        # finds the oldest step still running on the GPU (the model's thread is ahead of it, and the
        # device publishes the step's end), and would otherwise sleep a whole wait (wait_s) before
        # looking again, at every streamed part
        self.waiting = False
        # the last step begun ahead of its forward: what retract_ahead restores, take_ahead records
        self._ahead_undo: _AheadUndo | None = None
        # policy.drain process (dmi.ring.share): the child's progress words, and what was taken of them
        self.share = None
        self._seen = None
        self.stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S    # policy.stall_timeout_s

    # --- backend hooks --------------------------------------------------------------------------
    def setup(self, plan, dtype, device) -> None:
        """Called once by the run: the plan's sites, the capture dtype and the model's device."""
        self.plan, self.dtype, self.device = plan, dtype, device
        self.stall_timeout = getattr(plan.policy, "stall_timeout_s", DEFAULT_STALL_TIMEOUT_S)
        rate = getattr(plan.policy, "d2h_bytes_per_s", None)
        self.bucket = TokenBucket(rate) if rate else None

    def set_limits(self, mode: str, d2h_bytes_per_s: int | None) -> None:
        """Change the policy's mode and D2H cap between steps (a fresh bucket, starting full)."""
        with self.cond:
            self.mode = mode
            self.bucket = TokenBucket(d2h_bytes_per_s) if d2h_bytes_per_s else None
            self.cond.notify_all()             # a step waiting for space re-checks under the new mode

    def meta_view(self) -> np.ndarray:
        raise NotImplementedError

    def publish_control(self, ctrl: StepControl) -> None:
        """Make the step's slots visible to the device side (CPU: a reference; CUDA: async H2D)."""

    def publish_end(self, ctrl: StepControl, flags: int = 0) -> None:
        """The host publishes the step's end marker (CPU always; CUDA only for an aborted step)."""
        raise NotImplementedError

    def publish_record(self, seq: int, step: int, site: int, offset: int, nbytes: int, rows: int,
                       src_seq: int, flags: int = 0) -> None:
        """The host writes one meta record (host-side captures, end markers), ``seq`` last. As the
        kernels do: through the ring's int64 words (one vector write, not eight field writes)."""
        words = self._meta_words
        if words is None:                      # (the meta ring's int64 view, made once)
            words = self._meta_words = self.meta_view().view(np.int64)
        i = (seq % self.meta_records) * META_WORDS
        words[i + 1:i + META_WORDS] = (step, (site & 0xFFFFFFFF) | (flags << 32), offset, nbytes, rows, src_seq)
        words[i] = seq         # written last: the record is published

    def device_end(self) -> None:
        """Called by the ``dmi::step_end`` op (also while a CUDA graph is being captured): the
        device side of the end marker. CUDA: a tiny kernel that publishes it; CPU: nothing."""

    def capture(self, site, x, addend=None, side: bool = False) -> None:
        """Called by the ``dmi::capture`` op: copy the selected rows of ``x`` (of ``x + addend``:
        ``dmi::capture_sum``) into the step's slot. ``side``: the copy may run on a side stream
        until :meth:`join_side` (kernel rings; the others copy at once)."""
        raise NotImplementedError

    def join_side(self) -> None:
        """Called by the ``dmi::join`` op: the current stream waits for a capture left on a side
        stream (kernel rings). Here: nothing is."""

    def copy_out(self, offset: int, nbytes: int) -> np.ndarray:
        """Copy ``nbytes`` at ``offset`` of the payload ring into host memory."""
        raise NotImplementedError

    def fetch(self, ctrl: StepControl, recs: np.ndarray) -> list[np.ndarray]:
        """Bytes of each published record of one step (``recs``: META_DTYPE array): views of one
        ``copy_out`` of the step's block (a step's block is contiguous in the ring), not one copy
        per record."""
        if not len(recs):
            return []
        offsets, sizes = recs["offset"].astype(np.int64), recs["nbytes"].astype(np.int64)
        lo = int(offsets.min())
        span = self.copy_out(lo, int((offsets + sizes).max()) - lo)
        return [span[o:o + n] for o, n in zip((offsets - lo).tolist(), sizes.tolist())]

    def release_host(self, ctrl: StepControl) -> None:
        """The exporter is done with the arrays ``fetch`` returned for ``ctrl`` (staging reuse)."""

    def close(self) -> None:
        """Free backend memory (after the drain and exporter threads have stopped)."""

    def enter_thread(self) -> None:
        """Called once by each of the run's own threads (drain, export) before its first use of
        the ring or of a step's device tensors: what that thread needs of the device (the CUDA
        ring: its device, and a stream-capture mode in which a CUDA graph captured meanwhile on
        the model's thread fails none of this thread's calls)."""

    # --- host: steps ----------------------------------------------------------------------------
    def begin_step(self, step: int, tokens, pad: np.ndarray,
                   wanted: "list[tuple[int, np.ndarray, np.ndarray, int, int]] | StepLayout",
                   ahead: bool = False, keys: int = 0) -> StepControl | None:
        """wanted: (site, sel, rows, bytes, priority) for every site with rows this step, or a
        :class:`StepLayout` of them (the fast path, when it fits as a whole and nothing caps it).
        ``pad``, ``keys``: the step's key columns for key sites (:attr:`StepControl.pad`, ``keys``).

        ahead: the step is begun before its forward is known to come (the HF adapter's next decode
        step, while the GPU runs the current one). Only a layout that fits now is begun (else None:
        nothing waits), and :meth:`retract_ahead` can undo it. Under ``best_effort`` a bandwidth cap
        drops here what it would drop at the forward, as the step's own begin would; those drops
        count once the forward takes the step (:meth:`take_ahead`) and vanish with a retracted one."""
        self._before_step()
        if self.mode == "best_effort" and keys:        # a key site's rows wider than its max_keys: dropped
            from ..gather import over_max_keys
            over, listed = over_max_keys(getattr(self, "plan", None), wanted, pad, keys, tokens.seq)
            if over and ahead:
                return None
            for i in over:
                self._record_drop(step, tokens, listed[i], "max_keys")
            wanted = [w for i, w in enumerate(listed) if i not in over] if over else wanted
        if isinstance(wanted, StepLayout):
            ctrl = self._begin_laid_out(step, tokens, pad, wanted, ahead, keys)
            if ctrl is not None or ahead:
                return ctrl
            wanted, sizes = wanted.wanted, wanted.sizes.tolist()
        elif ahead:
            return None
        else:
            sizes = [align_up(w[3]) for w in wanted]
        self.raise_if_failed()
        if self.current is not None and not self.current.ended:
            self.end_step(aborted=True)          # the previous forward raised before it ended
        total = sum(sizes)
        keep = list(range(len(wanted)))
        if self.bucket is not None:              # policy.d2h_bytes_per_s: wait (full) or drop (best_effort)
            keep = self._within_bandwidth(step, tokens, wanted, sizes, keep)
        if self.mode == "full" and total > self.bytes.capacity:      # through the ring in parts
            return self._begin_stream(step, tokens, pad, [wanted[i] for i in keep], [sizes[i] for i in keep], keys)
        with self.cond:
            t0 = stall = None                        # set when the step first waits for space (full)
            while True:
                self.raise_if_failed()
                need = sum(sizes[i] for i in keep)
                n_meta = len(keep) + 1
                prev_head = self.bytes.head
                block = self.bytes.try_reserve(need) if need else (prev_head % self.bytes.capacity, prev_head)
                if block is not None and self.next_seq + n_meta - self.freed_seq <= self.meta_records:
                    break
                self.bytes.head = prev_head          # give back a byte reservation without meta slots
                if self.reclaim():
                    continue
                if self.mode == "best_effort":
                    if not keep:
                        block = (prev_head % self.bytes.capacity, prev_head)
                        if self.next_seq + 1 - self.freed_seq <= self.meta_records:
                            break
                        self.cond.wait(self.wait_s)  # even an empty step needs its end marker slot
                        continue
                    self.urgent.set()
                    victim = min(keep, key=lambda i: (wanted[i][4], -i))
                    keep.remove(victim)
                    self._record_drop(step, tokens, wanted[victim], "ring_full")
                    continue
                t0 = t0 or time.perf_counter()
                stall = self._wait_for_room(stall, step, need, n_meta)
            if t0 is not None:
                self.stats.stall_seconds += time.perf_counter() - t0
                self.waiting = False
            if self.bucket is not None:
                self.bucket.spend(need)
            base, block_end = block
            slots, off = {}, base
            for i in keep:
                site, sel, rows, nbytes, _ = wanted[i]
                slots[site] = SiteSlot(site, off, sizes[i], sel, rows, self.next_seq)
                off += sizes[i]
                self.next_seq += 1
            ctrl = StepControl(step, tokens, pad, slots, self.next_seq, block_end, first_seq=self.next_seq - len(keep),
                               base=base, nbytes=need, keys=keys)
            self.next_seq += 1
            self._open(ctrl)
        self.publish_control(ctrl)
        return ctrl

    def _before_step(self) -> None:
        """Host hook at the start of each step, before it reserves: the previous step's forward
        has been issued by now (CudaRing copies it out from here)."""

    def _open(self, ctrl: StepControl) -> None:
        """Under ``cond``: ``ctrl`` becomes the open step; the drain is woken early once the ring
        or the meta ring is a quarter full."""
        self.pending.append(ctrl)
        self.current = ctrl
        self.stats.steps += 1
        if 4 * self.bytes.used > self.bytes.capacity or 4 * (self.next_seq - self.freed_seq) > self.meta_records:
            self.urgent.set()

    def _wait_for_room(self, stall: Stall | None, step: int, nbytes: int, n_meta: int) -> Stall:
        """Under ``cond``: one wait of a ``full`` step for ring room (the drain is woken to free
        it); an error once the drain has freed nothing for ``stall_timeout_s``."""
        if stall is None:
            stall = Stall(f"step {step} waiting for ring space (drain)", self.stall_timeout,
                          lambda: self.describe_room(nbytes, n_meta))
        # (a ring whose steps end on the model's thread needs no fast looks: woken once, the drain
        # finds them ended, and a drain polling the GIL every 0.5 ms slowed a host-bound soak by half)
        self.waiting = self.device_publishes_end
        self.urgent.set()
        self.cond.wait(self.wait_s)
        stall.check((self.bytes.tail, self.freed_seq))
        return stall

    def describe_room(self, nbytes: int = 0, n_meta: int = 0) -> str:
        """The ring's figures for an error: what is wanted, used and pending."""
        return (f"needs {nbytes:,} bytes and {n_meta} meta records; ring {self.bytes.used:,} of "
                f"{self.bytes.capacity:,} bytes used, meta {self.next_seq - self.freed_seq} of {self.meta_records} "
                f"records, {len(self.pending)} step(s) pending, oldest "
                f"{self.pending[0].step if self.pending else None}")

    # --- steps larger than the ring (full mode): in parts ---------------------------------------
    def _begin_stream(self, step: int, tokens, pad: np.ndarray, wanted: list, sizes: list[int],
                      keys: int = 0) -> StepControl:
        """begin_step of a step whose captures exceed the ring (:class:`StreamedStep`): its first part."""
        too_big = [(w, z) for w, z in zip(wanted, sizes) if z > self.bytes.capacity]
        if too_big:
            (site, sel, *_), z = too_big[0]
            raise PolicyError(
                f"step {step}: one capture of {self.plan.sites[site].name} ({len(sel)} rows) needs {z:,} bytes of "
                f"ring but policy.ring_bytes is {self.bytes.capacity:,}; a step streams through the ring capture by "
                f"capture, so each capture must fit it", key="policy.ring_bytes",
                fix=f"raise policy.ring_bytes to at least {z:,}, or select fewer rows of that site (tokens: last)")
        if self.share is not None:
            raise PolicyError(f"step {step} needs {sum(sizes):,} bytes of ring but policy.ring_bytes is "
                              f"{self.bytes.capacity:,}, and policy.drain: process drains whole steps only",
                              key="policy.ring_bytes", fix="raise policy.ring_bytes, or use policy.drain: thread "
                                                           "(which streams a larger step through the ring)")
        self.check_streamable(step, tokens)
        self.raise_if_failed()
        if self.current is not None and not self.current.ended:
            self.end_step(aborted=True)
        stream = StreamedStep({w[0]: (w, z) for w, z in zip(wanted, sizes)}, sum(sizes), keys)
        return self._open_part(step, tokens, pad, stream, 0)

    def _open_part(self, step: int, tokens, pad: np.ndarray, stream: StreamedStep, at_least: int) -> StepControl:
        """The next part of a streamed step: a block of half the ring (or what is left of the step,
        and at least ``at_least`` bytes), waiting for the drain to free it."""
        want = max(at_least, min(self.bytes.capacity // 2, stream.left))
        with self.cond:
            t0 = stall = None
            while True:
                self.raise_if_failed()
                head = self.bytes.head
                block = self.bytes.try_reserve(want)
                if block is not None and self.next_seq + 2 - self.freed_seq <= self.meta_records:
                    break
                self.bytes.head = head
                t0 = t0 or time.perf_counter()
                stall = self._wait_for_room(stall, step, want, 2)
            if t0 is not None:
                self.stats.stall_seconds += time.perf_counter() - t0
                self.waiting = False
            base, block_end = block
            ctrl = StepControl(step, tokens, pad, {}, self.next_seq, block_end, self.next_seq, base=base, nbytes=0,
                               stream=stream, block_start=block_end - align_up(want), keys=stream.keys)
            stream.parts += 1
            self.pending.append(ctrl)
            self.current = ctrl
            self.stats.stream_parts += 1
            if stream.parts == 1:
                self.stats.steps += 1
                self.stats.streamed_steps += 1
            self.urgent.set()
        self.publish_control(ctrl)
        return ctrl

    def stream_slot(self, site: int) -> None:
        """Called by the capture of ``site`` in a streamed step, before it copies: give the site its
        place in the open part, ending the part and opening the next where it does not fit."""
        ctrl = self.current
        stream = ctrl.stream
        got = stream.wanted.pop(site, None)
        if got is None:
            return                                 # not selected, or captured already
        (site, sel, rows, _nbytes, _), size = got
        room = ctrl.block_end - ctrl.block_start
        if ctrl.nbytes + size > room or self.next_seq + 2 - self.freed_seq > self.meta_records:
            self._end_part(ctrl)
            ctrl = self._open_part(ctrl.step, ctrl.tokens, ctrl.pad, stream, size)
        ctrl.slots[site] = SiteSlot(site, ctrl.base + ctrl.nbytes, size, sel, rows, self.next_seq)
        self.next_seq += 1
        ctrl.end_seq = self.next_seq               # (taken when the part ends)
        ctrl.nbytes += size
        stream.left -= size
        self.publish_control(ctrl)

    def _end_part(self, ctrl: StepControl) -> None:
        """End a part that is not the step's last: its end marker after its captures, its unused
        reservation given back."""
        ctrl.partial = True
        self._close_part(ctrl)
        ctrl.ended = True
        self.end_part_marker(ctrl)
        with self.cond:
            self.cond.notify_all()

    def _close_part(self, ctrl: StepControl) -> None:
        """A part's seqs and ring block end where its captures ended (it is the newest reservation)."""
        with self.cond:
            self.next_seq = ctrl.end_seq + 1
            end = ctrl.block_start + align_up(ctrl.nbytes) if ctrl.nbytes else ctrl.block_start
            if end < ctrl.block_end and self.bytes.head == ctrl.block_end:
                self.bytes.head = ctrl.block_end = max(end, self.bytes.tail)

    def check_streamable(self, step: int, tokens) -> None:
        """Refuse a step larger than the ring whose captures would not call the host (kernel rings:
        traced captures), rather than let them find no place and lose their rows."""

    def end_part_marker(self, ctrl: StepControl) -> None:
        """Publish the end marker of a part ended inside the forward (CPU: the host writes it)."""
        self.publish_end(ctrl)

    def _begin_laid_out(self, step: int, tokens, pad: np.ndarray, layout: StepLayout,
                        ahead: bool = False, keys: int = 0) -> StepControl | None:
        """begin_step for a reused layout; None where the general path must decide (the bandwidth
        cap has no room for the whole step now, or best_effort has no ring room: it waits or drops
        per site), and for a step begun ahead that would wait. Under best_effort a bandwidth cap
        with no room for the whole step takes the captures it has room for as a layout of its own
        (:meth:`_within_bandwidth_laid_out`), still on this path, begun ahead too."""
        whole, dropped = layout, ()
        if self.bucket is not None and self.bucket.wait_for(layout.total) > 0:
            if self.mode != "best_effort":
                return None
            layout, dropped = self._within_bandwidth_laid_out(whole)
        if layout.total > self.bytes.capacity:
            return None
        self.raise_if_failed()
        if self.current is not None and not self.current.ended:
            self.end_step(aborted=True)
        n = len(layout)
        with self.cond:
            t0 = stall = None
            while True:
                self.raise_if_failed()
                head = self.bytes.head
                block = self.bytes.try_reserve(layout.total) if layout.total else (head % self.bytes.capacity, head)
                if block is not None and self.next_seq + n + 1 - self.freed_seq <= self.meta_records:
                    break
                self.bytes.head = head
                if self.reclaim():
                    continue
                if self.mode == "best_effort" or ahead:
                    return None
                t0 = t0 or time.perf_counter()
                stall = self._wait_for_room(stall, step, layout.total, n + 1)
            if t0 is not None:
                self.stats.stall_seconds += time.perf_counter() - t0
                self.waiting = False
            if self.bucket is not None:
                self.bucket.spend(layout.total)
            drops = (step, tokens, whole, dropped) if len(dropped) else None
            if drops is not None and not ahead:
                self._record_laid_out_drops(*drops)
            base, block_end = block
            first = self.next_seq
            self.next_seq += n + 1
            ctrl = StepControl(step, tokens, pad, LaidOutSlots(layout, base, first), first + n, block_end, first,
                               layout=layout, base=base, nbytes=layout.total, keys=keys)
            if ahead:
                self._ahead_undo = _AheadUndo(ctrl, head, self.current, self.bucket, layout.total, drops)
            self._open(ctrl)
        self.publish_control(ctrl)
        return ctrl

    def retract_ahead(self) -> bool:
        """Undo the last step begun ahead if it is still the open, newest step (its forward never
        came): its ring space, meta seqs, bucket bytes and step count are given back and the device
        flag is disarmed, as if it had never begun. False: nothing to undo."""
        undo, self._ahead_undo = self._ahead_undo, None
        if undo is None:
            return False
        ctrl, head, before, bucket, spent, _ = undo
        with self.cond:
            if ctrl.ended or self.current is not ctrl or not self.pending or self.pending[-1] is not ctrl:
                return False
            self.pending.pop()
            self.bytes.head = head
            self.next_seq = ctrl.first_seq
            self.current = before
            self.stats.steps -= 1
            if bucket is not None and bucket is self.bucket:     # (not one set_limits replaced since)
                bucket.refund(spent)
            self.cond.notify_all()
        self.disarm()
        return True

    def take_ahead(self) -> None:
        """The step begun ahead is taken by its forward: the captures a bandwidth cap dropped from
        it go into the drops table now (before its end: the exporter takes a step's drops with it)."""
        undo, self._ahead_undo = self._ahead_undo, None
        if undo is not None and undo.drops is not None:
            self._record_laid_out_drops(*undo.drops)

    def disarm(self) -> None:
        """The device side captures nothing until the next step is published (kernel rings: the
        control block's enable word; the CPU ring captures for the open step only)."""

    def _within_bandwidth(self, step: int, tokens, wanted: list, sizes: list[int], keep: list[int]) -> list[int]:
        """The captures of ``keep`` the D2H budget lets through now. ``full`` waits for the bucket
        (counted as stall time) and keeps all; ``best_effort`` never waits: it drops whole captures,
        lowest priority first (as for a full ring), with reason ``bandwidth``."""
        need = sum(sizes[i] for i in keep)
        if self.mode == "full":
            t0 = time.perf_counter()
            while (wait := self.bucket.wait_for(need)) > 0:
                self.raise_if_failed()
                time.sleep(min(wait, 0.05))
            waited = time.perf_counter() - t0
            self.stats.stall_seconds += waited
            self.stats.stall_bandwidth_seconds += waited
            return keep
        while keep and self.bucket.wait_for(need) > 0:
            victim = min(keep, key=lambda i: (wanted[i][4], -i))
            keep.remove(victim)
            need -= sizes[victim]
            self._record_drop(step, tokens, wanted[victim], "bandwidth")
        return keep

    def _within_bandwidth_laid_out(self, layout: StepLayout) -> tuple[StepLayout, np.ndarray]:
        """:meth:`_within_bandwidth`'s best_effort choice for a laid-out step, without a loop over
        its captures: the same victims (lowest priority first, the later capture first among
        equals) until the rest fits the bucket, and the rest as a layout, made once per number of
        victims and kept in ``layout.cache``. Returns (that layout, the dropped captures' indices
        into ``layout``). A capped step so keeps the fast path (and the CUDA ring its cached control
        words), where dropping capture by capture cost ~10 times the step's host time."""
        cache = layout.cache
        order = cache.get("drop_order")
        if order is None:
            prio = layout.priority() if callable(layout.priority) else layout.priority
            layout.priority = prio
            idx = np.arange(len(layout))
            order = cache["drop_order"] = np.lexsort((-idx, np.asarray(prio, np.int64)))
            cache["need_after"] = layout.total - np.concatenate(([0], np.cumsum(layout.sizes[order])))
        k = int(np.argmax(self.bucket.fits(cache["need_after"])))      # victims: the fewest that make it fit
        kept = cache.get(("bandwidth", k))
        if kept is None:
            keep = np.sort(order[k:])
            prio = layout.priority
            kept = cache[("bandwidth", k)] = StepLayout.of_arrays(
                layout.site_ids[keep], layout.src[keep], layout.arrays, layout.nbytes[keep],
                [prio[i] for i in keep.tolist()])
        return kept, order[:k]

    def _record_laid_out_drops(self, step: int, tokens, layout: StepLayout, dropped: np.ndarray) -> None:
        """Drops of a laid-out step's captures (``dropped``: indices into ``layout``). Every capped
        decode step of a batch drops the same captures of the same requests, and this runs before
        the step's forward (``take_ahead``): the captures' (site, row selection, bytes) are kept in
        ``layout.cache`` per victim set, and each selection's requests per batch of request ids."""
        cache = layout.cache
        key = ("dropped", dropped.tobytes())
        captures = cache.get(key)
        if captures is None:
            captures = cache[key] = list(zip(layout.site_ids[dropped].tolist(), layout.src[dropped].tolist(),
                                             layout.nbytes[dropped].tolist()))
        ids, requests = cache.get("drop_requests", (None, None))
        if ids is None or not np.array_equal(ids, tokens.request):
            ids, requests = tokens.request.copy(), {}
            cache["drop_requests"] = (ids, requests)
        for _, j, _ in captures:
            if j not in requests:
                sel = layout.arrays[j][0]
                requests[j] = (tuple(np.unique(ids[sel]).tolist()), len(sel))
        self.stats.drops.extend([Drop(step, site, *requests[j], nbytes, "bandwidth") for site, j, nbytes in captures])

    def _record_drop(self, step: int, tokens, want: tuple, reason: str) -> None:
        site, sel, _rows, nbytes, _priority = want
        self.stats.drops.append(Drop(step, site, tuple(np.unique(tokens.request[sel]).tolist()), len(sel), nbytes,
                                     reason))

    def end_step(self, aborted: bool = False, device: bool = False) -> None:
        """Host side of a step's end. ``device``: the step's forward ran its ``dmi::step_end`` op,
        so a backend whose device side publishes the end marker (CUDA) leaves it to the device;
        otherwise (CPU, an aborted step, a forward that never finished) the host publishes it."""
        ctrl = self.current
        if ctrl is None or ctrl.ended:
            return
        if ctrl.stream is not None:                # a streamed step's last part
            self._close_part(ctrl)
            self.stats.not_run += len(ctrl.stream.wanted)
        ctrl.ended = True
        if aborted or not (device and self.device_publishes_end):
            self.publish_end(ctrl, FLAG_ABORTED if aborted else 0)
        with self.cond:
            self.cond.notify_all()

    device_publishes_end = False
    _meta_words: np.ndarray | None = None      # publish_record's int64 view of the meta ring, made once

    def raise_if_failed(self) -> None:
        if self.error is not None:
            err = self.error
            raise CaptureError(f"capture stopped: {type(err).__name__}: {err}") from err

    @property
    def wait_s(self) -> float:
        """How long a step waiting for room sleeps before it looks again: the drain thread wakes it
        (``cond``), a drain in another process cannot, so its progress words are polled."""
        return 0.05 if self.share is None else 0.0005

    def reclaim(self) -> bool:
        """``policy.drain: process`` (:mod:`dmi.ring.share`), under ``cond``: take the child's
        progress: the ring space and meta slots it freed (True if any), the pending steps it is
        done with, its counts. False, and nothing, for a ring drained in this process."""
        if self.share is None:
            return False
        w = self.share.words.copy()
        seen, self._seen = (np.zeros_like(w) if self._seen is None else self._seen), w
        st = self.stats
        st.records += int(w[RECORDS] - seen[RECORDS])
        st.bytes_drained += int(w[DRAINED] - seen[DRAINED])
        st.bytes_captured += int(w[CAPTURED] - seen[CAPTURED])
        st.not_run += int(w[NOT_RUN] - seen[NOT_RUN])
        freed = False
        if int(w[TAIL]) > self.bytes.tail:
            self.bytes.release(int(w[TAIL]))
            freed = True
        if int(w[FREED_SEQ]) > self.freed_seq:
            self.freed_seq = int(w[FREED_SEQ])
            while self.pending and self.pending[0].end_seq < self.freed_seq:
                self.pending.popleft()
            freed = True
        if freed:
            self.cond.notify_all()
        return freed

    # --- drain ---------------------------------------------------------------------------------
    def drain_ready(self, limit: int = 1) -> list[StepControl]:
        """The oldest pending steps (at most ``limit``) whose end markers are published, in order
        (polls host memory only)."""
        with self.cond:
            pending = list(itertools.islice(self.pending, limit))
        seqs = self.meta_view()["seq"]
        ready = []
        for ctrl in pending:
            if ctrl.stream is not None and not ctrl.ended:
                break            # an open part's end seq is the next capture's until the part ends
            end = ctrl.end_seq
            if int(seqs[end % self.meta_records]) != end:
                break
            ready.append(ctrl)
        return ready

    def drain_steps(self, ctrls: list[StepControl]) -> list[list[tuple[SiteSlot, np.void, np.ndarray]]]:
        """Copy out the records of ready steps (the oldest pending ones, in order) and free their
        ring space: per step, ``(slot, record, bytes)`` for each published record."""
        if not ctrls:
            return []
        # consecutive steps hold consecutive seqs (sites, then the end marker): one vectorized read
        first = ctrls[0].first_seq
        seqs = np.arange(first, ctrls[-1].end_seq, dtype=np.uint64)
        meta = self.meta_view()[seqs % self.meta_records]        # a copy
        ok = meta["seq"] == seqs               # seq first: the writer stores it last
        per_step = []
        for ctrl in ctrls:
            a, b = ctrl.first_seq - first, ctrl.end_seq - first
            recs, hit = meta[a:b], ok[a:b]
            slots = slot_views(ctrl.slots)
            if not hit.all():                  # a planned site whose module did not run
                self.stats.not_run += len(slots) - int(hit.sum())
                slots = [s for s, k in zip(slots, hit.tolist()) if k]
                recs = recs[hit]
            per_step.append((slots, recs))
        datas = self.fetch_steps(ctrls, [recs for _, recs in per_step])
        ctrls = ctrls[:len(datas)]             # a backend may copy fewer (its staging filled): the rest waits
        out = []
        for (slots, recs), data in zip(per_step, datas):
            out.append(list(zip(slots, recs, data)))
            self.stats.records += len(recs)
            self.stats.bytes_drained += int(recs["nbytes"].sum())
        with self.cond:
            for _ in ctrls:
                self.pending.popleft()
            self.bytes.release(ctrls[-1].block_end)
            self.freed_seq = ctrls[-1].end_seq + 1
            self.cond.notify_all()
        return out

    def fetch_steps(self, ctrls: list[StepControl], recs: list[np.ndarray]) -> list[list[np.ndarray]]:
        """:meth:`fetch` for several steps (a backend may copy them at once, and only the first
        few of them: at least one)."""
        return [self.fetch(c, r) for c, r in zip(ctrls, recs)]

    def drain_step(self, ctrl: StepControl) -> list[tuple[SiteSlot, np.void, np.ndarray]]:
        """:meth:`drain_steps` of one step."""
        return self.drain_steps([ctrl])[0]

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while self.pending and self.error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(0.05 if left is None else min(left, 0.05))
        return not self.pending
