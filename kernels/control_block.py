"""The control block of a :class:`dmi.kernels.kernel_ring.KernelRing`: each step's control words
(armed flag, offsets, sequence numbers, row counts, row indices, padding), written on the host
into one of a few pinned buffers and copied with one async H2D on the current stream, ahead of the
forward's kernels. A step whose layout the device already holds sends only its global words.
The word layout is :mod:`dmi.kernels.words`'.
"""
from __future__ import annotations

import numpy as np
import torch

from . import capture as K
from ..errors import PolicyError
from ..ring.layout import StepControl
from .cudart import NoEvent
from .site_launch import is_arange


CTRL_BUFFERS = 4              # pinned control buffers in flight


HEAD_SLOTS = 64               # pinned slots of a steady step's global words (publish_control)


class ControlBlock:
    """Publishing a step's control words (a mixin of :class:`dmi.kernels.kernel_ring.KernelRing`,
    whose ``ctrl`` tensor, sites, traced sites and meta ring it reads)."""

    def _init_control_buffers(self, n_sites: int) -> None:
        """The host side of the control block: pinned buffers for whole blocks and head slots."""
        self._host_ctrl = [torch.zeros(self.ctrl_words, dtype=torch.int64, pin_memory=self.is_cuda)
                           for _ in range(CTRL_BUFFERS)]
        self._host_ctrl_np = [t.numpy() for t in self._host_ctrl]
        # the global words' views, made once: a steady step copies only them (no slicing per step)
        self._ctrl_head = self.ctrl[:K.G_WORDS]
        self._host_heads = [t[:K.G_WORDS] for t in self._host_ctrl]
        self._host_sites = [a[K.G_WORDS:self.site_words].reshape(n_sites, K.S_WORDS) for a in self._host_ctrl_np]
        self._ctrl_events = [self._new_event() for _ in range(CTRL_BUFFERS)]
        self._ctrl_next = 0
        # a step whose layout the device holds needs only its global words: each step takes the next
        # of these slots, reused once the step that last took it has ended on the device (its end
        # marker is in the meta ring, so the copy queued before its forward has run): no event per step
        self._heads = torch.zeros((HEAD_SLOTS, K.G_WORDS), dtype=torch.int64, pin_memory=self.is_cuda)
        self._heads_np = self._heads.numpy()
        self._head_next = 0
        self._head_seq = [-1] * HEAD_SLOTS     # end seq of the step that last took each slot
        self._on_device: tuple = (None, None)   # (layout, pad) whose words the device's ctrl holds
        self.pinned_bytes += CTRL_BUFFERS * self.ctrl_words * 8 + self._heads.numel() * 8

    # --- host: per step -----------------------------------------------------------------------------
    def publish_control(self, ctrl: StepControl) -> None:
        tok = ctrl.tokens
        batch, seq = tok.batch, tok.seq
        self.geometry = (batch, seq)
        pad_start = pos = self.site_words
        pad, layout = ctrl.pad, ctrl.layout
        laid = layout.cache.get("ctrl") if layout is not None else None
        if laid is not None and laid[4] != batch * seq:
            laid = None                        # (the inverse maps of traced sites are per step geometry)
        ctrl.dev_pad_start = pad_start
        # the end kernel publishes traced sites' records in steps that ran traced code (compiled)
        self._traced_word = traced = int(bool(self.traced) and (self.traced_steps or (
            self.traced_above is not None and batch * seq > self.traced_above)))
        words = (1, ctrl.step, batch, seq, ctrl.end_seq, pad_start, ctrl.base, ctrl.first_seq, traced, ctrl.keys)
        steady = laid is not None and layout is self._on_device[0] and (
            pad is self._on_device[1] or np.array_equal(pad, self._on_device[1]))
        if steady:
            # the last full publish put this layout's site words, rows and pad on the device: they
            # are relative to the global words, which are all that changes (64 bytes, not the block)
            ctrl.dev_rows_start = laid[2]
            if self._publish_head(words, ctrl.end_seq):
                return
        k = self._ctrl_next
        self._ctrl_next = (k + 1) % CTRL_BUFFERS
        self._ctrl_events[k].synchronize()     # that buffer's previous H2D has been consumed
        h = self._host_ctrl_np[k]
        if steady:
            pos = K.G_WORDS
        else:
            if pos + len(pad) > self.ctrl_words:
                raise PolicyError(f"batch of {len(pad)} rows exceeds the CUDA ring's control buffer "
                                  f"(policy.max_step_tokens={self.max_rows}). Fix: raise policy.max_step_tokens")
            h[pos:pos + len(pad)] = pad
            pos += len(pad)
            if laid is not None:               # a reused layout: its words, relative to the step's block
                rows_at, f, rows_start, pos, _ = laid
                for at, rows in rows_at:
                    h[at:at + len(rows)] = rows
            else:
                f, rows_start, pos = self._site_words(ctrl, h, pos)
            if traced and (f[:, 1 + K.S_INV] < 0).any():
                # a selection's inverse map did not fit: no traced records
                words = words[:K.G_TRACED] + (0,) + words[K.G_TRACED + 1:]
                self._traced_word = 0
            hs = self._host_sites[k]
            hs[:, K.S_ENABLED] = K.OFF
            hs[f[:, 0]] = f[:, 1:]
            ctrl.dev_rows_start = rows_start
            self._on_device = (layout, pad)    # (layout None: the next step publishes in full too)
        h[:K.G_WORDS] = words
        self._copy_block(k, pos)

    def _new_event(self):
        """An event a control buffer's copy records (its next use waits for it)."""
        return torch.cuda.Event() if self.is_cuda else NoEvent()

    def _copy_block(self, k: int, words: int) -> None:
        """The first ``words`` of host control buffer ``k`` to the device's control block, then
        that buffer's event (the next use of the buffer waits for it)."""
        self.ctrl[:words].copy_(self._host_ctrl[k][:words], non_blocking=True)
        self._ctrl_events[k].record()

    def _publish_head(self, words: tuple, end_seq: int) -> bool:
        """A steady step's global words through the next head slot; False while that slot's last
        step has not ended on the device (the host far ahead: the buffered path waits instead)."""
        j = self._head_next
        prev = self._head_seq[j]
        if prev >= self.freed_seq and int(self.meta_view()["seq"][prev % self.meta_records]) != prev:
            return False
        self._head_next = (j + 1) % HEAD_SLOTS
        self._head_seq[j] = end_seq
        self._heads_np[j] = words
        self._copy_head(j)
        return True

    def _copy_head(self, j: int) -> None:
        self._ctrl_head.copy_(self._heads[j], non_blocking=True)

    def _site_words(self, ctrl: StepControl, h: np.ndarray, pos: int):
        """Per site: (site, offset from base, seq from first_seq, rows, rows_start, enabled) words,
        the rows written at ``pos`` on (sites sharing a token filter share its rows); remembered
        for a reused layout."""
        if ctrl.layout is not None:
            return self._layout_words(ctrl, h, pos)
        slots = list(ctrl.slots.values())
        start_of, _, pos, enabled = self._place_rows(ctrl, h, pos, [(slot.site, slot.rows) for slot in slots])
        inv_of, _, pos = self._place_inverses(ctrl, h, pos, [slot.rows for slot in slots], enabled)
        fields = np.array([(slot.site, slot.offset - ctrl.base, slot.seq - ctrl.first_seq, len(slot.rows), start, on, inv)
                           for slot, start, on, inv in zip(slots, start_of, enabled, inv_of)],
                          np.int64).reshape(len(slots), K.S_WORDS + 1)
        return fields, {slot.site: start for slot, start in zip(slots, start_of)}, pos

    def _place_inverses(self, ctrl: StepControl, h: np.ndarray, pos: int, arrays: list, enabled: list):
        """For traced captures: each listed rows array's inverse map (per step row b*seq+s, its
        place in the array or -1) at ``pos`` on, once per array: (each array's start, [(start,
        map)], next pos). -1 where the map does not fit (the step then publishes no traced records);
        0 for arrays of every row (traced code needs no map) or with no traced sites."""
        if not self.traced or (self.trace_mode == "range" and not self._traced_word):
            return [0] * len(arrays), [], pos      # (range: a step's geometry decides its word, and keys its layout)
        n = ctrl.tokens.batch * ctrl.tokens.seq
        placed: dict[int, int] = {}
        at = []
        for rows, on in zip(arrays, enabled):
            if on != K.ENABLED or not len(rows) or id(rows) in placed:
                continue
            if pos + n > self.ctrl_words:
                placed[id(rows)] = -1
                continue
            inv = np.full(n, -1, np.int64)
            inv[rows] = np.arange(len(rows))
            h[pos:pos + n] = inv
            placed[id(rows)] = pos
            at.append((pos, inv))
            pos += n
        return [placed.get(id(rows), 0) for rows in arrays], at, pos

    def _layout_words(self, ctrl: StepControl, h: np.ndarray, pos: int):
        """:meth:`_site_words` of a laid-out step, as whole-array operations over its sites (an
        engine step lays out a fresh layout each step, with up to hundreds of sites): the rows of
        each of the layout's distinct row arrays once, then every site's words from its array's."""
        layout = ctrl.layout
        starts, flags, lens, rows_at, placed = [], [], [], [], []
        used = np.zeros(len(layout.arrays), bool)
        used[layout.src] = True            # (a filter whose every site reads an engine-held tensor's rows)
        for j, (_, rows) in enumerate(layout.arrays):
            if not used[j]:                # placed nowhere, read by no site
                rows = rows[:0]
            n = len(rows)
            if n > self.max_rows or pos + n > self.ctrl_words:
                raise self._too_many_rows(ctrl, n, layout.ids[int(np.argmax(layout.src == j))])
            h[pos:pos + n] = rows
            starts.append(pos)
            flags.append(K.ENABLED_ARANGE if is_arange(rows) else K.ENABLED)
            lens.append(n)
            rows_at.append((pos, rows))
            placed.append(rows)
            pos += n
        inv_of, inv_at, pos = self._place_inverses(ctrl, h, pos, placed, flags)
        rows_at += inv_at
        src, n_sites = layout.src, len(layout)
        rel = np.empty((n_sites, K.S_WORDS + 1), np.int64)   # relative to the block's base and first seq
        rel[:, 0] = layout.site_ids
        rel[:, 1] = layout.rel
        rel[:, 2] = self._site_order[:n_sites]
        rel[:, 3] = np.array(lens, np.int64)[src]
        rel[:, 4] = np.array(starts, np.int64)[src]
        rel[:, 5] = np.array(flags, np.int64)[src]
        rel[:, 6] = np.array(inv_of, np.int64)[src]
        rows_start = dict(zip(layout.ids, rel[:, 4].tolist()))
        layout.cache["ctrl"] = (rows_at, rel, rows_start, pos, ctrl.tokens.batch * ctrl.tokens.seq)
        return rel, rows_start, pos

    def _place_rows(self, ctrl: StepControl, h: np.ndarray, pos: int, site_rows: list):
        """Each capture's row indices into the control words at ``pos`` on, once per rows array
        (sites of one token filter share it): (start of each capture's rows, [(start, rows)], next
        pos, each capture's enabled word: ENABLED_ARANGE where its rows are 0 .. n-1)."""
        placed: dict[int, tuple[int, int]] = {}       # id(rows) -> (start, enabled word)
        rows_at = []
        for site, rows in site_rows:                  # each distinct rows array once
            if id(rows) in placed:
                continue
            n = len(rows)
            if n > self.max_rows or pos + n > self.ctrl_words:
                raise self._too_many_rows(ctrl, n, site)
            h[pos:pos + n] = rows
            placed[id(rows)] = (pos, K.ENABLED_ARANGE if is_arange(rows) else K.ENABLED)
            rows_at.append((pos, rows))
            pos += n
        got = [placed[id(rows)] for _, rows in site_rows]
        return [g[0] for g in got], rows_at, pos, [g[1] for g in got]

    def _too_many_rows(self, ctrl: StepControl, n: int, site: int) -> PolicyError:
        """The refusal of a step whose ``n`` rows for ``site`` do not fit the control words."""
        return PolicyError(f"step {ctrl.step} selects {n} rows for {self.plan.sites[site].name}, "
                           f"more than policy.max_step_tokens={self.max_rows}. Fix: raise policy.max_step_tokens")

