"""The capture kernel behind ``dmi::capture`` on CUDA, and the end-marker kernel behind ``dmi::step_end``.

One launch per site and step, inside CUDA graphs (eager steps copy with torch ops instead:
``CudaRing``'s ``SiteLaunch._eager``). It copies the selected rows of a site tensor into the GPU
payload ring at the step's reserved offset, and its first program writes the site's meta record
into the host meta ring (mapped pinned memory), ``seq`` last. The drain trusts a step's records
only after the step's end marker: the end kernel runs after every capture of the step (stream
order) and fences at system scope before its ``seq``, so one fence per step covers every record
and payload byte (no per-site fence, no wait for a kernel's last program). Everything that
changes per step is read from ``ctrl``, a small int64 device tensor the host updates with one
async H2D copy before the step (``CudaRing.publish_control``), so a CUDA graph that captured
these launches writes fresh slots on every replay, and copies exactly the step's row count
(padding rows of a graph-padded batch are never copied):

``ctrl`` layout (int64 words)::

    [0, G_WORDS)                 armed, step, batch, seq, end_seq, pad_start, base, first_seq, traced,
                                 keys (the step's key columns: dmi.gather.key_shift)
    [G_WORDS + S_WORDS*site, +6) offset (bytes from base), seq (from first_seq), rows, rows_start,
                                 enabled, inv_start   (one per site)
    [pad_start, +batch)          left-padding columns per batch row (key-aligned sites)
    [rows_start, +rows)          flat step rows b*seq+s of a token filter's selection
    [inv_start, +batch*seq)      per step row, its place in that selection or -1 (traced sites,
                                 listed selections: dmi.siteop's traced capture reads it)

Site offsets and seqs are relative to the step's block (``base``) and first record
(``first_seq``), so the site words and rows of a step that reuses the last step's layout are
already on the device: the host then copies only the global words.

``armed`` is set by the host at each step and cleared by the end-marker kernel, so a graph replayed
without a new step captures nothing (and null mode never arms it). ``enabled`` is 0 for sites with
no rows this step and for captures dropped by the policy, 1 for rows read from ``rows_start``,
and 2 where the rows are ``0 .. rows-1`` (every token of a decode batch, or of an unpadded step):
the kernel then takes row ``r`` as ``r`` without reading it (the rows are still written, for
eager steps). The kernel loads every word it needs in one round trip, before the flags are
known: a capture in a CUDA graph costs a few dependent memory reads, not its bytes.

Two copy modes:

* ``DIRECT`` (plain sites: no head selection, key alignment, reduction or dtype change): rows are
  read straight from the engine tensor through its strides (any layout with at most two feature
  dims), no intermediate tensor.
* ``IDENTITY``: the site's outputs were first computed by :func:`dmi.gather.select_rows` on the
  device (the same torch ops as the reference path, so the bytes match); the kernel copies their
  rows as raw words.

A site whose value is the sum of two engine tensors (vLLM's residual stream, ``hidden_states +
residual``) is copied as the sum of their rows (``SUM``, DIRECT only): in a compiled graph the sum
as a tensor of its own would take an elementwise kernel per layer that the engine fuses away.

Rows whose position the engine tensor does not hold (``logits`` under ``logits_to_keep``) are
compacted with ``drow`` (destination row per candidate row, -1 to skip).

Programmatic dependent launch (Hopper and later, on by default; the hook spec's ``engine.pdl: false``
turns it off): the
capture kernel may start while the kernel before it finishes. It loads its control
words first (the host's H2D copy wrote them before the step, never the kernel just before; the end
kernel, which disarms, is always followed by the next forward's own kernels or dmi's copy), then
waits (``gdc_wait``) before reading anything a kernel wrote: the site's rows, ``drow`` and
``cnt``. A capture's launch latency and its cold control-word read then overlap the kernel before
it. It waits even when it captures nothing, so a kernel after it still finds every kernel before it
complete. (``perf/online.py``'s ``dmi-hidden-nopdl`` configuration serves without it.)

Under ``TRITON_INTERPRET=1`` both kernels run on the CPU (tests/test_kernels_interpret.py).
"""
from __future__ import annotations

import functools
import math

import triton
import triton.language as tl

from .words import (ENABLED, ENABLED_ARANGE, G_ARMED, G_BASE, G_BATCH, G_END_SEQ, G_FIRST_SEQ, G_KEYS,
                    G_PAD_START, G_SEQ, G_STEP, G_TRACED, G_WORDS, OFF, S_ENABLED, S_INV, S_OFFSET, S_ROWS,
                    S_ROWS_START, S_SEQ, S_WORDS, TRACED_WORDS)

__all__ = ["capture_kernel", "end_kernel", "launch", "launch_end", "blocks", "word_dtype", "direct_geometry",
           "pdl_possible", "DIRECT", "IDENTITY", "END_SITE_WORD",
           # the control words (dmi.kernels.words), read by callers as this module's
           "ENABLED", "ENABLED_ARANGE", "G_ARMED", "G_BASE", "G_BATCH", "G_END_SEQ", "G_FIRST_SEQ", "G_KEYS",
           "G_PAD_START", "G_SEQ", "G_STEP", "G_TRACED", "G_WORDS", "OFF", "S_ENABLED", "S_INV", "S_OFFSET", "S_ROWS",
           "S_ROWS_START", "S_SEQ", "S_WORDS", "TRACED_WORDS"]

END_SITE_WORD = 0xFFFFFFFF   # site -1 (END_MARKER) as the low 32 bits, flags 0
DIRECT, IDENTITY = 0, 1

# the same offsets as kernel constants (jit functions read only constexpr globals)
_ARMED, _STEP, _SEQ, _END_SEQ = tl.constexpr(G_ARMED), tl.constexpr(G_STEP), tl.constexpr(G_SEQ), tl.constexpr(G_END_SEQ)
_BASE, _FIRST_SEQ, _TRACED = tl.constexpr(G_BASE), tl.constexpr(G_FIRST_SEQ), tl.constexpr(G_TRACED)
_G_WORDS, _S_WORDS, _TW = tl.constexpr(G_WORDS), tl.constexpr(S_WORDS), tl.constexpr(TRACED_WORDS)
_OFFSET, _RSEQ, _ROWS, _ROWS_START, _ENABLED = (tl.constexpr(S_OFFSET), tl.constexpr(S_SEQ), tl.constexpr(S_ROWS),
                                                tl.constexpr(S_ROWS_START), tl.constexpr(S_ENABLED))
_LISTED, _ARANGE = tl.constexpr(ENABLED), tl.constexpr(ENABLED_ARANGE)


@triton.jit
def _publish(meta, fence, meta_records, seq, step, site_word, offset, nbytes, rows, src_seq, FENCE: tl.constexpr):
    """Write one meta record, ``seq`` last; with FENCE, a system-scope fence (acq_rel atomic on
    device memory) before it, so everything the step wrote reaches the host first."""
    base = meta + (seq % meta_records) * 7      # dmi.ring.records.META_WORDS int64 words per record
    tl.store(base + 1, step)
    tl.store(base + 2, site_word)
    tl.store(base + 3, offset)
    tl.store(base + 4, nbytes)
    tl.store(base + 5, rows)
    tl.store(base + 6, src_seq)
    tl.debug_barrier()
    if FENCE:
        tl.atomic_add(fence, 0, sem="acq_rel", scope="sys")
        tl.debug_barrier()
    tl.store(base, seq)


@triton.jit
def _rounded(v, dtype: tl.constexpr, HOST: tl.constexpr):
    """float32 ``v`` as ``dtype``, rounded to nearest even as torch rounds on the tensors' device.
    On a GPU that is the hardware conversion; Triton's interpreter (HOST: the CPU tests) truncates
    to bfloat16, so there it is done on the bits, NaN as torch's CPU conversion writes it."""
    if HOST and dtype == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        u = tl.where(v != v, 0x7FC00000, u + 0x7FFF + ((u >> 16) & 1))
        return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)


@triton.jit
def _copy_rows(src, dst_base, roff, dst, rmask, f, F, F2, stride_f1, stride_f2, CONTIG: tl.constexpr,
               addend=None, SUM: tl.constexpr = False, HOST: tl.constexpr = False):
    fmask = f < F
    if CONTIG:      # one unit-stride feature dim: no per-element div/mod, so loads vectorize
        foff = f.to(tl.int64)
    else:
        foff = (f // F2).to(tl.int64) * stride_f1 + (f % F2).to(tl.int64) * stride_f2
    m = rmask[:, None] & fmask[None, :]
    v = tl.load(src + roff[:, None] + foff[None, :], mask=m)
    if SUM:         # src + addend (same strides), as torch adds: in float32, rounded once
        w = tl.load(addend + roff[:, None] + foff[None, :], mask=m)
        v = _rounded(v.to(tl.float32) + w.to(tl.float32), src.dtype.element_ty, HOST)
    out = dst_base.to(src.dtype)
    tl.store(out + dst[:, None] * F + f[None, :], v, mask=m)


@triton.jit(do_not_specialize=["hdr", "site_word", "cnt_idx", "K", "src_seq", "seq_arg"])
def capture_kernel(src0, src1, ring, ctrl, meta, drow, cnt,
                   hdr, site_word, cnt_idx, K, src_seq, seq_arg,
                   stride_b, stride_s, F0, F2, stride_f1, stride_f2, F1, stride_r1,
                   row_bytes0, row_bytes1, meta_records,
                   MODE: tl.constexpr, HAS_DROW: tl.constexpr, NOUT: tl.constexpr, CONTIG: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, SUM: tl.constexpr = False,
                   HOST: tl.constexpr = False, PDL: tl.constexpr = False):
    """Copy rows of ``src0`` (and ``src1``) into ``ring`` and publish the site's record. SUM
    (DIRECT only): the rows of ``src0 + src1``, two tensors of one layout. PDL: launched as a
    programmatic dependent of the kernel before it (module doc).

    Candidate rows come from ``ctrl``, output rows from ``cnt[cnt_idx]``. seq_arg: the step's seq
    when known at launch (the graph's geometry), else -1 (read from ``ctrl``)."""
    # every control word in one round trip: none of these loads waits for another
    armed = tl.load(ctrl + _ARMED)
    enabled = tl.load(ctrl + hdr + _ENABLED)
    offset = tl.load(ctrl + hdr + _OFFSET) + tl.load(ctrl + _BASE)
    c = tl.minimum(tl.load(ctrl + hdr + _ROWS), K)
    start = tl.load(ctrl + hdr + _ROWS_START)
    if not (PDL and HAS_DROW):             # (with drow, cnt is a kernel's output: read after the wait)
        n = tl.load(cnt + cnt_idx)
    seq = tl.load(ctrl + _SEQ)
    seq_no = tl.load(ctrl + hdr + _RSEQ) + tl.load(ctrl + _FIRST_SEQ)
    step = tl.load(ctrl + _STEP)
    if PDL:
        tl.extra.cuda.gdc_wait()           # the kernel before this one has completed: its outputs are readable
        if HAS_DROW:
            n = tl.load(cnt + cnt_idx)
    if (armed != 0) & (enabled != 0):
        pid_r = tl.program_id(0)
        pid_f = tl.program_id(1)
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        rmask = r < c
        if HAS_DROW:
            dst = tl.load(drow + r, mask=rmask, other=-1)
            rmask = rmask & (dst >= 0)
        else:
            dst = r.to(tl.int64)
        if MODE == 0:
            if seq_arg >= 0:
                seq = seq_arg.to(tl.int64)
            # rows 0 .. c-1 (enabled 2): the row is its own index, no read (a masked-off load waits for nothing)
            listed = tl.where(enabled == _LISTED, c, 0)      # rows to read: none when flagged 0 .. c-1
            rr = tl.load(ctrl + start + r, mask=r < listed, other=0)
            rr = tl.where(enabled == _ARANGE, r.to(tl.int64), rr)
            b = rr // seq
            s = rr % seq - (seq - src_seq)
            roff = b * stride_b + s * stride_s
        else:
            roff = r.to(tl.int64) * stride_b
        if NOUT == 1:
            _copy_rows(src0, ring + offset, roff, dst, rmask, f, F0, F2, stride_f1, stride_f2, CONTIG, src1, SUM, HOST)
        else:
            if tl.program_id(2) == 0:
                _copy_rows(src0, ring + offset, roff, dst, rmask, f, F0, F2, stride_f1, stride_f2, CONTIG)
            else:
                roff1 = r.to(tl.int64) * stride_r1
                _copy_rows(src1, ring + offset + n * row_bytes0, roff1, dst, rmask, f, F1, F1, 0, 1, True)
        # The first program writes the record. No fence and no wait for the other programs: the
        # drain reads a step's records only after its end marker, whose kernel runs after this one
        # has finished (stream order) and fences at system scope before publishing.
        if (pid_r == 0) & (pid_f == 0) & (tl.program_id(2) == 0):
            _publish(meta, meta, meta_records, seq_no, step, site_word, offset,
                     n * (row_bytes0 + row_bytes1), n, src_seq.to(tl.int64), False)


@triton.jit(do_not_specialize=["fence_idx", "n_traced"])
def end_kernel(ctrl, meta, counters, fence_idx, meta_records, site_word, traced, n_traced, BLOCK_T: tl.constexpr):
    """Publish the armed step's end marker and disarm ``ctrl``; first, in a step whose sites ran as
    traced torch ops (``traced`` word set), the records of those sites: ``traced`` is a table of
    ``n_traced`` rows (site index, site word, row bytes). Such a site holds every step row, so its
    record is the host's reservation: ``rows`` rows from ``offset``, ``seq`` positions held."""
    armed = tl.load(ctrl + _ARMED)
    if armed != 0:
        seq = tl.load(ctrl + _END_SEQ)
        step = tl.load(ctrl + _STEP)
        if tl.load(ctrl + _TRACED) != 0:
            t = tl.arange(0, BLOCK_T)
            m = t < n_traced
            site = tl.load(traced + t * _TW, mask=m, other=0)
            hdr = _G_WORDS + _S_WORDS * site
            m = m & (tl.load(ctrl + hdr + _ENABLED, mask=m, other=0) != 0)
            rows = tl.load(ctrl + hdr + _ROWS, mask=m, other=0)
            rseq = tl.load(ctrl + hdr + _RSEQ, mask=m, other=0) + tl.load(ctrl + _FIRST_SEQ)
            rec = meta + (rseq % meta_records) * 7
            tl.store(rec + 1, step + t * 0, mask=m)
            tl.store(rec + 2, tl.load(traced + t * _TW + 1, mask=m, other=0), mask=m)
            tl.store(rec + 3, tl.load(ctrl + hdr + _OFFSET, mask=m, other=0) + tl.load(ctrl + _BASE), mask=m)
            tl.store(rec + 4, rows * tl.load(traced + t * _TW + 2, mask=m, other=0), mask=m)
            tl.store(rec + 5, rows, mask=m)
            tl.store(rec + 6, tl.load(ctrl + _SEQ) + t * 0, mask=m)
            tl.debug_barrier()
            tl.store(rec, rseq, mask=m)      # (the drain reads them only after the fenced end marker)
        tl.store(ctrl + _ARMED, 0)
        zero = step * 0
        # every earlier kernel of the step (payload and records) reaches the host before this seq
        _publish(meta, counters + fence_idx, meta_records, seq, step, site_word, zero, zero, zero, zero, True)


# --- launch geometry --------------------------------------------------------------------------------
def blocks(F: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_F): about 4096 elements per program."""
    bf = min(1024, triton.next_power_of_2(max(F, 1)))
    br = max(1, min(64, 4096 // bf))
    return br, bf


def word_dtype(*row_bytes: int):
    """The widest of int32 / int16 / uint8 whose size divides every row size (IDENTITY copies)."""
    import torch
    for w, dt in ((4, torch.int32), (2, torch.int16), (1, torch.uint8)):
        if all(rb % w == 0 for rb in row_bytes):
            return w, dt
    raise AssertionError(row_bytes)


def direct_geometry(x, layout: list[str], batch: int):
    """(src_seq, stride_b, stride_s, F, F2, stride_f1, stride_f2) of x's token rows, or None when x
    has more than two feature dims (then the IDENTITY path copies a prepared tensor)."""
    if layout[0] == "token":
        src_seq = x.shape[0] // batch
        stride_s = x.stride(0)
        stride_b = src_seq * stride_s
        feat = list(range(1, x.ndim))
    else:
        bi, si = layout.index("batch"), layout.index("seq")
        src_seq, stride_b, stride_s = x.shape[si], x.stride(bi), x.stride(si)
        feat = [i for i in range(x.ndim) if i not in (bi, si)]
    if len(feat) > 2:
        return None
    if not feat:
        return src_seq, stride_b, stride_s, 1, 1, 0, 0
    if len(feat) == 1:
        return src_seq, stride_b, stride_s, x.shape[feat[0]], x.shape[feat[0]], 0, x.stride(feat[0])
    a, b = feat
    return src_seq, stride_b, stride_s, x.shape[a] * x.shape[b], x.shape[b], x.stride(a), x.stride(b)


@functools.lru_cache(maxsize=None)
def pdl_possible(device_index: int) -> bool:
    """Programmatic dependent launch possible: a Hopper or later GPU and a Triton that has it (3.3+)."""
    if not hasattr(getattr(tl.extra, "cuda", None), "gdc_wait"):
        return False
    import torch
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch(src0, ring, ctrl, meta, *, site_index: int, meta_records: int, K: int,
           src_seq: int, geometry, mode: int, row_bytes0: int, src1=None, row_bytes1: int = 0,
           cnt=None, cnt_idx: int = -1, drow=None, seq_arg: int = -1, addend=None, pdl: bool | None = None) -> None:
    """Launch :func:`capture_kernel` for one site. ``geometry``: DIRECT: (stride_b, stride_s, F, F2,
    stride_f1, stride_f2) of ``src0``; IDENTITY: (row stride, F) of ``src0`` [rows, F] and (row
    stride, F) of ``src1``. ``cnt``/``cnt_idx`` default to the site's row count in ``ctrl``.
    ``addend`` (DIRECT): a tensor of ``src0``'s shape, strides and dtype; the rows of the sum are
    copied (the sum is never materialized: in a compiled graph that would take a kernel of its own).
    ``pdl``: launch as a programmatic dependent (None: on a GPU that has it; a kernel ring passes its
    own, which ``engine.pdl: false`` turns off)."""
    if addend is not None:
        assert mode == DIRECT and src1 is None and addend.shape == src0.shape and addend.stride() == src0.stride() \
            and addend.dtype == src0.dtype, "a summed capture needs two tensors of one layout"
    hdr = G_WORDS + S_WORDS * site_index
    if cnt is None:
        cnt, cnt_idx = ctrl, hdr + S_ROWS
    if mode == DIRECT:
        stride_b, stride_s, F0, F2, sf1, sf2 = geometry
        F1, sr1 = 1, 0
    else:
        (stride_b, F0), (sr1, F1) = geometry[0], geometry[1] if src1 is not None else (0, 1)
        stride_s, F2, sf1, sf2 = 0, F0, 0, 1
    BR, BF = blocks(max(F0, F1))
    nout = 2 if src1 is not None else 1
    contig = F2 == F0 and sf2 == 1
    grid = (max(1, math.ceil(K / BR)), max(1, math.ceil(max(F0, F1) / BF)), nout)
    second = addend if addend is not None else src1 if src1 is not None else src0
    if pdl is None:
        pdl = src0.is_cuda and pdl_possible(src0.device.index)
    capture_kernel[grid](src0, second, ring, ctrl, meta,
                         drow if drow is not None else ctrl, cnt,
                         hdr, site_index & 0xFFFFFFFF, cnt_idx, K, src_seq, seq_arg,
                         stride_b, stride_s, F0, F2, sf1, sf2, F1, sr1,
                         row_bytes0, row_bytes1, meta_records,
                         MODE=mode, HAS_DROW=drow is not None, NOUT=nout, CONTIG=contig, BLOCK_R=BR, BLOCK_F=BF,
                         SUM=addend is not None, HOST=not src0.is_cuda, PDL=pdl, num_warps=4,
                         **({"launch_pdl": True} if pdl else {}))


def launch_end(ctrl, meta, counters, *, meta_records: int, fence_idx: int, traced=None) -> None:
    """``traced``: the run's traced sites (an int64 ``[n, TRACED_WORDS]`` tensor) or None."""
    n = 0 if traced is None else traced.shape[0]
    end_kernel[(1,)](ctrl, meta, counters, fence_idx, meta_records, END_SITE_WORD,
                     traced if n else ctrl, n, BLOCK_T=max(16, triton.next_power_of_2(max(n, 1))), num_warps=1)
