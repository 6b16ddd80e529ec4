"""A drained record's bytes as its site's named output arrays, and rows copied into chunk buffers.
"""
from __future__ import annotations

import numpy as np

from ..tokens import PHASES
from ..zdtype import BF16
from .chunks import ITEMSIZE


PHASE_NAMES = np.asarray(PHASES, dtype=object)


def view_as(raw: np.ndarray, dtype: str) -> np.ndarray:
    return raw.view(np.uint16 if dtype == "bfloat16" else np.dtype(dtype))


def computed_rows(tokens, slot, rec) -> np.ndarray:
    """The step rows a site's record holds: every selected row of ``slot``, or for a tensor the
    engine holds only in part (vLLM's logits: the step's last ``src_seq`` rows) those it computed."""
    return slot.sel[tokens.local[slot.sel] >= tokens.seq - int(rec["src_seq"])]


def output_views(outputs, n: int, data: np.ndarray, capture_dtype: str) -> dict[str, np.ndarray]:
    """A record's bytes as each stored output's ``[n, *shape]`` view (bfloat16 as its uint16 bits)."""
    arrays, offset = {}, 0
    for o in outputs:
        src = capture_dtype if o.kind == "float" else o.kind
        nb = n * o.row_elems * ITEMSIZE[src]
        arrays[o.name] = view_as(data[offset:offset + nb], src).reshape(n, *o.shape)
        offset += nb
    return arrays


def copy_all(jobs) -> None:
    for dst, src in jobs:
        copy_rows(dst, src)


def copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    if src.dtype == np.uint16:     # bfloat16 bits: the upper half of a float32, so widening is exact
        if dst.dtype == BF16:
            np.copyto(dst.view(np.uint16), src)
        elif dst.dtype == np.float32:
            np.left_shift(src, 16, out=dst.view(np.uint32), dtype=np.uint32)
        else:
            dst[...] = (src.astype(np.uint32) << 16).view(np.float32)
    else:
        dst[...] = src
