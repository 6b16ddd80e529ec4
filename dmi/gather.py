"""Row selection of a site tensor, in torch: the reference capture every backend must match.

An engine tensor arrives in the engine's layout (``[batch, head, seq, head_dim]`` for HF's q,
``[token, expert]`` for flattened router logits, ...). ``gather`` turns it into the canonical
``[rows, *site dims]`` of the rows a step selected, applies head selection, key alignment and
on-device reductions, and returns the outputs in the order they are laid out in the payload.
"""
from __future__ import annotations

import numpy as np
import torch

from .errors import CaptureError
from .plan import SitePlan


def token_major(x: torch.Tensor, layout: list[str], batch: int) -> tuple[torch.Tensor, int]:
    """x as [batch * seq', *features] (rows b*seq'+s), and seq': the positions x holds."""
    if layout[0] == "token":
        return x, x.shape[0] // batch
    bi, si = layout.index("batch"), layout.index("seq")
    rest = [i for i in range(x.ndim) if i not in (bi, si)]
    x = x.permute(bi, si, *rest)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), x.shape[1]


def source_rows(rows: torch.Tensor, seq: int, src_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Map step rows b*seq+s to rows of a tensor holding only the last ``src_seq`` positions.

    Returns (row indices into the tensor, mask over ``rows`` of those it holds). Host int64
    arrays work as well (the CUDA ring's eager launches)."""
    b, s = rows // seq, rows % seq - (seq - src_seq)
    held = s >= 0
    return (b * src_seq + s)[held], held


def gather(x: torch.Tensor, site: SitePlan, rows: torch.Tensor, step_seq: int, batch: int,
           pad: torch.Tensor | None, dtype: torch.dtype, keys: int = 0) -> tuple[list[torch.Tensor], int]:
    """Outputs ([n, *output shape] each) for the selected ``rows`` and the seq' x held.
    ``pad``, ``keys``: the step's key columns (:func:`select_rows`)."""
    layout = site.anchor["layout"]
    flat, src_seq = token_major(x, layout, batch)
    rows = rows.to(flat.device)
    idx, held = source_rows(rows, step_seq, src_seq)
    batch_of_row = (rows // step_seq)[held] if "key" in site.dims else None
    return select_rows(x, flat, site, idx, batch_of_row, pad, dtype, keys=keys), src_seq


def select_rows(x: torch.Tensor, flat: torch.Tensor, site: SitePlan, idx: torch.Tensor,
                batch_of_row: torch.Tensor | None, pad: torch.Tensor | None, dtype: torch.dtype, *,
                keys: int | torch.Tensor = 0, heads: torch.Tensor | None = None,
                check_keys: bool = True) -> list[torch.Tensor]:
    """The outputs of rows ``idx`` of ``flat`` (x in token-major order), in payload order.

    Every backend runs this same sequence of torch ops for sites that need more than a row copy
    (head selection, key alignment, dtype change, reductions), so their bytes match. Key sites:
    ``pad`` (per batch row, padding columns before the request's first key) and ``keys`` (the
    step's key columns, past and padding included; an int, or a 1-element tensor on the device)
    place the key axis (:func:`_align_keys`). ``heads``: the site's head indices already on the
    device (graph capture forbids creating them here); ``check_keys=False``: the caller checked
    ``max_keys`` on the host (no device sync here)."""
    layout = site.anchor["layout"]
    feat = [x.shape[layout.index(d)] if d in layout and d == "key" else n for d, n in zip(site.dims, site.shape)]
    sel = flat.index_select(0, idx).reshape(idx.shape[0], *feat)
    if site.heads is not None:
        axis = 1 + next(k for k, d in enumerate(site.dims) if d in ("head", "kv_head"))
        sel = sel.index_select(axis, heads if heads is not None else torch.tensor(site.heads, device=sel.device))
    if "key" in site.dims:
        sel = _align_keys(sel, site, batch_of_row, pad, keys, check=check_keys)
    sel = sel.to(site_dtype(site, dtype))
    if site.reduce and "topk" in site.reduce:
        values, indices = torch.topk(sel, site.reduce["topk"], dim=-1)
        return [values, indices.to(torch.int32)]
    if site.reduce and site.reduce.get("norm"):
        return [torch.linalg.vector_norm(sel.float(), dim=-1).to(dtype)]
    return [sel]


def site_dtype(site: SitePlan, float_dtype: torch.dtype) -> torch.dtype:
    """The dtype a site is captured in: the model's float dtype unless the spec says otherwise."""
    return {"int32": torch.int32, "float32": torch.float32}.get(site.outputs[0].kind, float_dtype)


def key_shift(keys: int | torch.Tensor, width: int) -> int | torch.Tensor:
    """Key columns of the step (``keys``: past and new, padding included) before the first one a
    ``width``-column key tensor holds. A sliding-window cache layer hands attention only the step's
    last keys, in order (transformers' ``DynamicSlidingWindowLayer``: the last ``window - 1`` and
    the step's; ``StaticSlidingWindowLayer``: the last ``window`` once full); a layer with room for
    every key hands them from column 0 (a static one with columns not yet written after them)."""
    return (keys - width).clamp(min=0) if isinstance(keys, torch.Tensor) else max(keys - width, 0)


def check_max_keys(site: SitePlan, keys: int, min_offset: int) -> None:
    """The host-side form of ``_align_keys``' check: ``keys`` key columns minus the smallest
    offset of the selected rows' first key (padding less :func:`key_shift`) must fit ``max_keys``."""
    if keys - min_offset > site.shape[-1]:
        raise CaptureError(f"{site.name}: {keys - min_offset} key positions exceed max_keys={site.shape[-1]}. "
                           f"Fix: raise max_keys in the hook spec entry that captures {site.canonical}")


def over_max_keys(plan, wanted, pad, keys: int, seq: int) -> tuple[list[int], list]:
    """The key-site captures of a step whose rows span more than the site's ``max_keys`` key
    positions, in a step of ``keys`` key columns (past and padding included) with ``pad`` padding
    columns per batch row: what :func:`check_max_keys` would refuse at the forward (for a key
    tensor as wide as the step's key columns). ``best_effort`` drops them before the step begins
    (reason ``max_keys``). ``wanted``: (site, sel, rows, bytes, priority) per capture, or a
    :class:`dmi.ring.layout.StepLayout`. Returns (their indices into the capture list, that list); both
    empty, the list not built, where no site can exceed (keys within the plan's smallest max_keys,
    computed once per plan)."""
    if plan is None:
        return [], []
    floor = plan.__dict__.get("_max_keys_floor")
    if floor is None:
        widths = {s.index: s.shape[-1] for s in plan.sites if "key" in s.dims}
        floor = plan.__dict__["_max_keys_floor"] = (min(widths.values(), default=0), widths)
    least, widths = floor
    if not widths or keys <= least:
        return [], []
    listed = wanted.wanted if hasattr(wanted, "wanted") else wanted
    pad = np.asarray(pad, np.int64)
    over = [i for i, (site, _sel, rows, _n, _p) in enumerate(listed)
            if site in widths and len(rows) and keys - int(pad[np.asarray(rows) // seq].min()) > widths[site]]
    return over, listed


def _align_keys(sel: torch.Tensor, site: SitePlan, batch_of_row: torch.Tensor, pad: torch.Tensor | None,
                keys: int | torch.Tensor = 0, check: bool = True) -> torch.Tensor:
    """Re-index the key axis (last) from cache columns to key positions 0..max_keys-1.

    Left-padded batches keep ``pad[b]`` padding columns before a request's first key; a key tensor
    narrower than the step's ``keys`` columns holds their last ones (:func:`key_shift`). Positions
    it does not hold (outside a sliding window, past the last key) are 0."""
    width = site.shape[-1]
    k = sel.shape[-1]
    offset = pad.to(sel.device)[batch_of_row] if pad is not None else torch.zeros(len(sel), dtype=torch.long, device=sel.device)
    offset = offset - key_shift(keys, k)         # cache column of each row's key position 0 (may be < 0)
    if check and len(sel):
        check_max_keys(site, k, int(offset.min()))
    cols = torch.arange(width, device=sel.device)[None, :] + offset[:, None]     # [rows, max_keys]
    valid = (cols >= 0) & (cols < k)
    shape = [sel.shape[0]] + [1] * (sel.ndim - 2) + [width]
    idx = cols.clamp(0, k - 1).reshape(shape).expand(*sel.shape[:-1], width)
    out = torch.gather(sel, -1, idx)
    return torch.where(valid.reshape(shape), out, torch.zeros((), dtype=out.dtype, device=out.device))
