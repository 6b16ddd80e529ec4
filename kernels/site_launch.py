"""One site's capture launches: its geometry, its eager fast paths (one strided copy, an upload of
the rows an engine tensor holds) and the Triton kernel launch of :mod:`dmi.kernels.capture`.
"""
from __future__ import annotations

import numpy as np
import torch

from . import capture as K
from ..errors import CaptureError
from ..gather import check_max_keys, key_shift, select_rows, site_dtype, source_rows, token_major
from ..ring.layout import StepControl


class SiteLaunch:
    """What one site's launches need, computed once: its mode, geometry rules, head indices. Its
    methods take the :class:`dmi.kernels.kernel_ring.KernelRing` that launches them (``ring``)."""

    def __init__(self, site, dtype: torch.dtype, device: torch.device):
        self.site = site
        self.layout = site.anchor["layout"]
        self.dtype = site_dtype(site, dtype)      # a direct copy needs the engine tensor in this dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.plain = site.heads is None and "key" not in site.dims and not site.reduce
        self.heads = torch.tensor(site.heads, device=device) if site.heads is not None else None
        self.row_bytes = [o.row_elems * o.itemsize(self.itemsize) for o in site.outputs]
        # (step rows, seq, src_seq, rows held, their index on the device) of the last eager launch
        # on a tensor holding only some of the step's rows (vLLM's logits, every step, outside the
        # graph): steady decode repeats them, and the upload is most of that launch's host time
        self._held: tuple | None = None
        # copied_as_range's last (rows array, seq, src_seq, first source row or None, rows held)
        self._range: tuple | None = None
        self._pitches: dict = {}              # (shape, strides) of x -> (src_seq, row pitch) or None (copied_as_range)

    def copied_as_range(self, ring, x: torch.Tensor, st: StepControl, addend: torch.Tensor | None = None) -> bool:
        """An eager capture whose selected rows are consecutive rows of ``x`` (every request's
        logits row; every token of a hidden state), copied by one strided copy (``ring.copy_rows``)
        and published from the host: no torch ops, no index upload. ``addend``: the site's value
        is ``x + addend`` (vLLM's residual stream outside its CUDA graphs), added into the ring by
        one kernel where both tensors share a layout. False: not such a capture."""
        if not self.plain or x.dtype != self.dtype:
            return False
        if addend is not None and not same_layout(x, addend):
            return False
        geometry = self._pitch(x, st.tokens.batch)
        if geometry is None:
            return False
        src_seq, pitch = geometry
        slot, seq = st.slots[self.site.index], st.tokens.seq
        rows, r = slot.rows, self._range
        # a rows array is never written after its step laid it out: a reused layout hands the same
        # one every step (held here, so its id stays its own), and the sites of one token filter
        # share theirs, analysed once a step (a mixed step's thousands of rows, for every layer)
        if r is None or r[0] is not rows or r[1] != seq or r[2] != src_seq:
            key = (id(rows), seq, src_seq)
            got = st.ranges.get(key)
            if got is None:
                held, src = held_source(rows, seq, src_seq)
                got = st.ranges[key] = (int(src[0]) if len(src) and (np.diff(src) == 1).all() else None, len(held))
            r = self._range = (rows, seq, src_seq) + got
        first, n = r[3], r[4]
        if first is None:
            return False
        nbytes = n * self.row_bytes[0]
        if n:
            ring.copy_rows(x, first, n, pitch, self.row_bytes[0], slot.offset, addend)
        ring.publish_record(slot.seq, st.step, self.site.index, slot.offset, nbytes, n, src_seq)
        return True

    def _pitch(self, x: torch.Tensor, batch: int) -> tuple[int, int] | None:
        """(positions x holds, elements from one token-major row of x to the next) when each row's
        features are contiguous and rows are evenly spaced; else None. Cached by shape and strides."""
        key = (x.shape, x.stride())
        if key in self._pitches:
            return self._pitches[key]
        shape, stride, layout = key[0], key[1], self.layout
        got = None
        if layout[0] == "token":
            lead, src_seq, pitch = 1, shape[0] // batch, stride[0]
        elif tuple(layout[:2]) == ("batch", "seq") and (shape[0] == 1 or stride[0] == shape[1] * stride[1]):
            lead, src_seq, pitch = 2, shape[1], stride[1]
        else:
            lead = None
        if lead is not None:
            want = 1
            for d in range(x.ndim - 1, lead - 1, -1):      # the features: one contiguous run
                if shape[d] != 1 and stride[d] != want:
                    break
                want *= shape[d]
            else:
                if want * x.element_size() == self.row_bytes[0]:
                    got = (src_seq, pitch)
        if len(self._pitches) >= 256:          # (token counts of eager steps vary: bounded)
            self._pitches.clear()
        self._pitches[key] = got
        return got

    def _held_rows(self, rows: np.ndarray, seq: int, src_seq: int, device) -> tuple[np.ndarray, torch.Tensor]:
        """The step rows ``x`` holds (its last ``src_seq`` of ``seq`` positions) and their row
        index in ``x``, on x's device: uploaded only when they differ from the last launch's."""
        h = self._held
        if h is not None and h[1] == seq and h[2] == src_seq and np.array_equal(h[0], rows):
            return h[3], h[4]
        held, src = held_source(rows, seq, src_seq)
        idx = upload(src, device)
        self._held = (rows.copy(), seq, src_seq, held, idx)
        return held, idx

    def _batch(self, x, ring):
        """The batch size of a graph launch: from x, or for flat token layouts the latest step's."""
        if self.layout[0] != "token":
            return x.shape[self.layout.index("batch")]
        if ring.geometry is None:
            if ring.null:
                return 1                       # null mode: the kernel exits on the device flag
            raise CaptureError(f"{self.site.name}: the step's batch size is unknown while capturing a CUDA graph. "
                               f"Fix: run one forward of the same shape (or call run.begin_step) before capturing")
        return ring.geometry[0]

    def launch(self, ring, x: torch.Tensor, eager: StepControl | None,
               addend: torch.Tensor | None = None, fork: bool = False) -> None:
        """Copy the step's rows of ``x`` (``+ addend``: summed in the kernel where both tensors share
        one layout and the site copies rows as they are, else added first). ``fork``: a direct copy
        that needs no temporaries launches on the ring's side stream (``ring.launch_on_side``)."""
        if addend is not None and (eager is not None or not self.plain or x.dtype != self.dtype
                                   or not same_layout(x, addend)):
            x, addend = x + addend, None
        if eager is not None:
            self._eager(ring, x, eager)
            return
        site = self.site
        batch = self._batch(x, ring)
        step_seq = ring.geometry[1] if ring.geometry is not None else None
        common = dict(site_index=site.index, meta_records=ring.meta_records, pdl=ring.pdl)
        direct_geo = None
        if self.plain and x.dtype == self.dtype:
            direct_geo = K.direct_geometry(x, self.layout, batch)
        if direct_geo is not None:
            src_seq, *geo = direct_geo
            seq = step_seq if step_seq is not None else src_seq
            k_rows = min(ring.max_rows, batch * seq)
            drow, cnt = None, None
            if src_seq < seq:
                drow, cnt, _ = device_compaction(ring, site, k_rows, seq, src_seq)
            def go():
                K.launch(x, ring.payload, ring.ctrl, ring.meta_dev, K=k_rows, src_seq=src_seq, geometry=geo,
                         mode=K.DIRECT, row_bytes0=self.row_bytes[0], drow=drow, cnt=cnt,
                         cnt_idx=0 if cnt is not None else -1, seq_arg=seq, addend=addend, **common)
            if fork and drow is None:
                ring.launch_on_side(go, x, addend)
            else:
                go()
            return
        if addend is not None:                 # (more than two feature dims: the IDENTITY path below)
            x = x + addend
        # IDENTITY: the reference's torch ops on the device, then a raw row copy
        flat, src_seq = token_major(x, self.layout, batch)
        seq = step_seq if step_seq is not None else src_seq
        hdr = K.G_WORDS + K.S_WORDS * site.index
        k_rows = min(ring.max_rows, batch * seq)
        ar = ring.arange[:k_rows]
        start = ring.ctrl.narrow(0, hdr + K.S_ROWS_START, 1)
        cand = ring.ctrl.index_select(0, (start + ar).clamp_(max=ring.ctrl_words - 1))
        b_of_row = cand // seq
        s = cand % seq - (seq - src_seq)
        idx = (b_of_row * src_seq + s).clamp_(0, max(flat.shape[0] - 1, 0))
        b_of_row = b_of_row.clamp_(0, batch - 1)
        pad = keys = None
        if "key" in site.dims:
            pad_start = ring.ctrl.narrow(0, K.G_PAD_START, 1)
            pad = ring.ctrl.index_select(0, (pad_start + ring.arange[:batch]).clamp_(max=ring.ctrl_words - 1))
            keys = ring.ctrl.narrow(0, K.G_KEYS, 1)
        outs = select_rows(x, flat, site, idx, b_of_row, pad, self.dtype, keys=keys, heads=self.heads,
                           check_keys=False)
        drow = cnt = None
        if src_seq < seq:
            drow, cnt, _ = device_compaction(ring, site, k_rows, seq, src_seq)
        self._copy(ring, outs, k_rows, src_seq, drow=drow, cnt=cnt, cnt_idx=0 if cnt is not None else -1, **common)

    def _eager(self, ring, x: torch.Tensor, st: StepControl) -> None:
        """A step the host knows (eager forwards): torch ops copy the selected rows straight into
        the payload ring (one index_select for a plain site, the reference's ops otherwise) and the
        host writes the record, with no Triton launch (whose Python launcher costs more than the
        copy). No fence is needed: the drain reads the record only after the step's end marker,
        which the device publishes after these copies (stream order)."""
        site = self.site
        slot = st.slots[site.index]
        batch, seq = st.tokens.batch, st.tokens.seq
        flat, src_seq = token_major(x, self.layout, batch)
        rows = slot.rows
        if src_seq < seq:                      # x holds only the last src_seq positions
            rows, idx = self._held_rows(rows, seq, src_seq, x.device)
        else:     # the step's rows on the device; sites of one token filter share them (one view a step)
            start = st.dev_rows_start[site.index]
            idx = st.dev_rows.get(start)
            if idx is None or len(idx) != len(rows):
                idx = st.dev_rows[start] = ring.ctrl.narrow(0, start, len(rows))
        n = len(rows)
        if self.plain and x.dtype == self.dtype:      # one kernel: gather the rows into the ring
            nb = n * self.row_bytes[0]
            if n:
                isz = x.element_size()      # (slot offsets are aligned to ALIGN bytes)
                dst = ring.payload_as(x.dtype).narrow(0, slot.offset // isz, nb // isz).view(n, -1)
                torch.index_select(flat.reshape(flat.shape[0], -1), 0, idx, out=dst)
            ring.publish_record(slot.seq, st.step, site.index, slot.offset, nb, n, src_seq)
            return
        b_of_row = pad = None
        if "key" in site.dims:
            b_of_row = upload(rows // seq, x.device) if src_seq < seq else idx // seq
            pad = ring.ctrl.narrow(0, st.dev_pad_start, batch)
            if n:
                k = x.shape[self.layout.index("key")]
                check_max_keys(site, k, int(np.asarray(st.pad)[rows // seq].min()) - key_shift(st.keys, k))
        outs = select_rows(x, flat, site, idx, b_of_row, pad, self.dtype, keys=st.keys, heads=self.heads,
                           check_keys=False)
        offset = slot.offset
        for o in outs:                         # laid out one after the other, as the kernel does
            nb = o.numel() * o.element_size()
            ring.payload_t.narrow(0, offset, nb).copy_(o.contiguous().view(-1).view(torch.uint8))
            offset += nb
        ring.publish_record(slot.seq, st.step, site.index, slot.offset, offset - slot.offset, n, src_seq)

    def _copy(self, ring, outs, k_rows, src_seq, **kw) -> None:
        w, wdt = K.word_dtype(*self.row_bytes)
        srcs = [o.contiguous().reshape(o.shape[0], -1).view(wdt) for o in outs]
        geometry = [(s.stride(0), s.shape[1]) for s in srcs]
        K.launch(srcs[0], ring.payload, ring.ctrl, ring.meta_dev, K=k_rows, src_seq=src_seq,
                 geometry=geometry, mode=K.IDENTITY, row_bytes0=self.row_bytes[0],
                 src1=srcs[1] if len(srcs) > 1 else None, row_bytes1=self.row_bytes[1] if len(srcs) > 1 else 0, **kw)


def device_compaction(ring, site, k_rows: int, seq: int, src_seq: int):
    """Graph-safe (drow, n) for a tensor holding the last ``src_seq`` of ``seq`` positions: the
    destination row of each candidate row (-1: not held) and the number held, on the device."""
    hdr = K.G_WORDS + K.S_WORDS * site.index
    ar = ring.arange[:k_rows]
    start = ring.ctrl.narrow(0, hdr + K.S_ROWS_START, 1)
    c = ring.ctrl.narrow(0, hdr + K.S_ROWS, 1)
    cand = ring.ctrl.index_select(0, (start + ar).clamp_(max=ring.ctrl_words - 1))
    held = (cand % seq >= seq - src_seq) & (ar < c)
    dst = torch.cumsum(held, 0) - 1
    drow = torch.where(held, dst, torch.full_like(dst, -1))
    n = held.sum().reshape(1)
    return drow, n, held


def same_layout(x: torch.Tensor, addend: torch.Tensor) -> bool:
    """``addend`` can be read through ``x``'s geometry: the same shape, strides and dtype (a summed
    site's rows are then added where they are read, by the capture kernel or one torch add)."""
    return addend.shape == x.shape and addend.stride() == x.stride() and addend.dtype == x.dtype


def is_arange(rows: np.ndarray) -> bool:
    """rows is 0, 1, ..., n-1 (the kernel then needs no row indices: ENABLED_ARANGE)."""
    n = len(rows)
    return bool(n) and rows[0] == 0 and rows[-1] == n - 1 and (n < 3 or bool((np.diff(rows) == 1).all()))


def held_source(rows: np.ndarray, seq: int, src_seq: int) -> tuple[np.ndarray, np.ndarray]:
    """The step rows (b*seq+s) a tensor holding the last ``src_seq`` of ``seq`` positions holds,
    and their rows in it (b*src_seq+s'): :func:`dmi.gather.source_rows` on host arrays."""
    if src_seq == seq:                         # x holds every position: its rows are the step's
        return rows, rows
    src, held = source_rows(rows, seq, src_seq)
    return rows[held], src


def upload(a: np.ndarray, device) -> torch.Tensor:
    """An eager-only H2D of a small host array through pinned memory (no stream sync; torch's
    pinned allocator keeps the source until the copy has run)."""
    t = torch.from_numpy(np.ascontiguousarray(a, np.int64))
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
