"""A site captured as traced torch ops: what compiled code runs instead of the ``dmi::capture`` op.

``dmi::capture`` is opaque to inductor: the kernel computing a site's tensor ends before it (a
residual add is cut off from the RMSNorm it would be fused with), the capture kernel runs after
it, and outside a CUDA graph both are host launches (vLLM's steps above its largest graph). Traced
instead, the capture is a scatter of the site's rows into the payload ring at destinations read
from the ring's control block (``ring.index_put_``): inductor folds it into the kernel that
computes the rows, so a capture adds no kernel, launch or dispatch (``perf/fusion.py`` counts them).

The destinations follow the same control words the capture kernel reads (``dmi.kernels.capture``):
row ``i`` of the tensor in token-major order is step row ``i``; its place in the site's block is
``i`` itself where the selection is every row (``enabled`` 2), else the selection's inverse map
(``inv_start``: per step row, its place or -1). Rows not captured (not selected, padding, a
disarmed or dropped capture) go to scratch rows past the ring's end (row ``i`` to scratch row
``i % scratch_rows``: a prefill's thousands of skipped rows do not all store to one address).

The ops never write a record: the end-marker kernel publishes the records of a step's traced
sites (their row count is the host's reservation: only sites holding every step row are traced,
see :meth:`dmi.kernels.cuda_ring.KernelRing.traced_site`), before its fence.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from . import words as K


@dataclass(frozen=True)
class TracedSite:
    """What a compiled forward needs to capture one site as torch ops."""
    ring_key: int              # the KernelRing's key in _RINGS (told at trace time that traced code exists)
    ctrl: torch.Tensor         # the ring's control block (int64, on the device)
    payload: torch.Tensor      # the payload ring as the site's dtype, scratch row included
    row_elems: int
    scratch: int               # element index of the first scratch row
    scratch_rows: int
    dtype: torch.dtype
    layout: tuple


def token_rows(x: torch.Tensor, layout: tuple, row_elems: int) -> torch.Tensor:
    """x as [rows, row_elems] in token-major order (row b*seq+s)."""
    if layout[0] != "token":
        bi, si = layout.index("batch"), layout.index("seq")
        x = x.permute(bi, si, *[i for i in range(x.ndim) if i not in (bi, si)])
    return x.reshape(-1, row_elems)


_RINGS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def register(ring) -> int:
    """A key for ``ring`` that traced code can pass as a constant."""
    key = next(_KEYS)
    _RINGS[key] = ring
    return key


@torch.compiler.assume_constant_result
def _compiling_for(ring_key: int) -> bool:
    """Tell the ring that a compiled forward captures as traced ops: called once, while Dynamo
    traces (not when the graph runs), so the step being traced already has its records published."""
    ring = _RINGS.get(ring_key)
    if ring is not None:
        ring.traced_steps = True
    return True


def capture(t: TracedSite, x: torch.Tensor, ticket: torch.Tensor, site_id: "torch.Tensor | int") -> None:
    """Scatter the step's selected rows of ``x`` into the payload ring (traced: no op, no launch).
    ``ticket`` is read only to follow the step's begin (``dmi.siteop``'s module doc); ``site_id``
    (the site's index: a tensor where layers compile alike, an int in a whole-model graph) locates
    its control words."""
    _compiling_for(t.ring_key)
    rows = token_rows(x, t.layout, t.row_elems).to(t.dtype)
    ctrl, w = t.ctrl, t.ctrl.shape[0]
    hdr = K.G_WORDS + K.S_WORDS * site_id
    i = torch.arange(rows.shape[0], device=rows.device)
    count, enabled = ctrl[hdr + K.S_ROWS], ctrl[hdr + K.S_ENABLED]
    listed = ctrl[(ctrl[hdr + K.S_INV] + i).clamp(0, w - 1)]
    place = torch.where(enabled == K.ENABLED_ARANGE, torch.where(i < count, i, -1), listed)
    ok = (ctrl[K.G_ARMED] + ticket[0] * 0 != 0) & (enabled != 0) & (place >= 0) & (place < count) \
        & (i < ctrl[K.G_BATCH] * ctrl[K.G_SEQ])
    first = (ctrl[K.G_BASE] + ctrl[hdr + K.S_OFFSET]) // rows.element_size()
    dst = torch.where(ok, first + place * t.row_elems, t.scratch + (i % t.scratch_rows) * t.row_elems)
    t.payload.index_put_((dst[:, None] + torch.arange(t.row_elems, device=rows.device),), rows)
