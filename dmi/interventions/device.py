"""Interventions held on the device: each entry's values in buffers updated in place, the rows
it touches as a per-row mask written before each step, and the site call that applies them
(traced into compiled graphs)."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..graph_inputs import static_inputs
from ..tokens import FilterState, select
from .plan import TAKES, InterventionError, InterventionPlan, fit_value

ROW_DIMS = ("batch", "seq", "token")
DEFAULT_ROWS = 4096       # rows a step may carry before the mask buffers grow (eager steps only)


class Intervention:
    """One entry's device state: its values (shared by its layers) and the rows it applies to this step."""

    def __init__(self, plan: InterventionPlan, device, dtype, rows: int, layouts: dict, slots: int = 1):
        self.plan = plan
        self.name = plan.name
        self.device, self.dtype = device, dtype
        self.enabled = plan.enabled
        self.requests = None if plan.requests is None else set(plan.requests)
        self.on_request = plan.on_request
        self.mask = torch.zeros(rows, dtype=torch.bool, device=device)
        self.index = torch.zeros(rows, dtype=torch.int64, device=device) if self.is_table else None
        self._last_mask: np.ndarray | None = None
        self._cleared = True               # the mask is all false
        self._last_index: np.ndarray | None = None
        shape = plan.shape
        self.value = None
        if plan.value is not None:
            self.value = torch.tensor(plan.value, dtype=torch.float64).to(device=device, dtype=dtype)
            if plan.kind == "add":
                self.value = self.value * plan.scale
        self.scale = torch.tensor(plan.scale, dtype=dtype, device=device)
        self.lo = torch.tensor(-math.inf if plan.lo is None else plan.lo, dtype=dtype, device=device)
        self.hi = torch.tensor(math.inf if plan.hi is None else plan.hi, dtype=dtype, device=device)
        # requests' own values (``client:``): one slot of values per request that set some, slot 0
        # the operator's; each row reads its request's slot (a per-row index, like a table's)
        self.slot = self.slots = None
        self._last_slot: np.ndarray | None = None
        if plan.client is not None:
            self.slot = torch.zeros(rows, dtype=torch.int64, device=device)
            self.slots = {k: t.unsqueeze(0).repeat(slots, *([1] * t.ndim))
                          for k, t in (("value", self.value), ("scale", self.scale), ("lo", self.lo), ("hi", self.hi))
                          if t is not None}
            self.value = self.slots["value"][0] if self.value is not None else None    # views: set() writes slot 0
            self.scale, self.lo, self.hi = self.slots["scale"][0], self.slots["lo"][0], self.slots["hi"][0]
        self._vector = None if plan.value is None else np.asarray(plan.value)     # add: before the scale
        self.head_mask = None
        if plan.heads is not None:
            axis = next(k for k, d in enumerate(plan.dims) if d in ("head", "kv_head"))
            hm = np.zeros(shape[axis], bool)
            hm[list(plan.heads)] = True
            self.head_mask = torch.tensor(hm, device=device)
        self.layouts = layouts
        held = (self.value, self.scale, self.lo, self.hi) if self.slots is None else tuple(self.slots.values())
        static_inputs(self.mask, self.index, self.head_mask, self.slot, *held)     # (not the views of slot 0)

    def load_slot(self, k: int, values: dict) -> None:
        """Write a request's values (:func:`client_values`) into slot ``k`` (between steps)."""
        p = self.plan
        scale = values["scale"]
        if "value" in self.slots:
            vec = values["vector"] if values["vector"] is not None else self._vector
            vec = torch.tensor(vec, dtype=torch.float64)
            self.slots["value"][k].copy_((vec * scale if p.kind == "add" else vec).to(self.device, self.dtype))
        self.slots["scale"][k].fill_(scale)
        self.slots["lo"][k].fill_(-math.inf if values["lo"] is None else values["lo"])
        self.slots["hi"][k].fill_(math.inf if values["hi"] is None else values["hi"])

    @property
    def is_table(self) -> bool:
        return self.plan.kind == "replace" and self.plan.value is not None and self.plan.value.ndim == len(self.plan.shape) + 1

    # -- per step (host) ------------------------------------------------------------------------
    def rows_for(self, st, ids: list[str], extra: np.ndarray | None) -> np.ndarray:
        """Bool over ``st``'s rows: the rows this intervention touches this step. ``extra``: rows
        of requests that asked for an ``on_request`` intervention (vLLM's per-request options)."""
        if not self.enabled:
            return np.zeros(len(st), bool)
        keep = np.zeros(len(st), bool)
        keep[select(st, self.plan.tokens, FilterState())] = True
        if self.on_request or self.requests is not None:
            named = np.zeros(len(st), bool)
            if self.requests:
                hit = [r for r in np.unique(st.request).tolist() if ids[r] in self.requests]
                named = np.isin(st.request, hit)
            if self.on_request and extra is not None:      # rows of requests that asked for it (vLLM)
                named |= extra
            keep &= named
        return keep

    def clear(self, n_rows: int) -> None:
        """The whole mask false (no row touched) over at least ``n_rows`` rows, written once while
        disabled."""
        self._fit(n_rows)
        if not self._cleared:
            self.mask.zero_()
            self._last_mask = None
            self._cleared = True

    def _fit(self, n_rows: int) -> None:
        """Buffers of at least ``n_rows`` rows (fresh ones are all false), at static addresses as
        those made at load: a CUDA graph recorded after a large eager step (generate()'s prefill,
        then its compiled decode) reads them in place instead of copying each one in per replay."""
        if n_rows > self.mask.shape[0]:
            self.mask = torch.zeros(n_rows, dtype=torch.bool, device=self.device)
            if self.index is not None:
                self.index = torch.zeros(n_rows, dtype=torch.int64, device=self.device)
            if self.slot is not None:
                self.slot = torch.zeros(n_rows, dtype=torch.int64, device=self.device)
                self._last_slot = None
            self._last_mask = None
            static_inputs(self.mask, self.index, self.slot)

    def write_rows(self, st, n_rows: int, keep: np.ndarray, slots: np.ndarray | None = None) -> None:
        """The step's mask (and table index, and each row's slot of values: ``slots`` over
        ``st``'s rows) over its ``n_rows`` engine rows, copied to the device when it differs from
        the last step's."""
        self._cleared = False
        self._fit(n_rows)
        if self.slot is not None:
            slot = np.zeros(n_rows, np.int64)
            if slots is not None:
                slot[st.rows] = slots
            if self._last_slot is None or len(self._last_slot) != n_rows or not np.array_equal(self._last_slot, slot):
                self.slot[:n_rows].copy_(torch.from_numpy(slot), non_blocking=True)
                self._last_slot = slot
        mask = np.zeros(n_rows, bool)
        mask[st.rows[keep]] = True
        index = None
        if self.index is not None:
            start = self.plan.tokens.positions[0] if self.plan.tokens.positions else 0
            rel = st.position - start
            inside = keep & (rel >= 0) & (rel < self.value.shape[0])
            mask[:] = False
            mask[st.rows[inside]] = True
            index = np.zeros(n_rows, np.int64)
            index[st.rows[inside]] = rel[inside]
        if self._last_mask is None or len(self._last_mask) != n_rows or not np.array_equal(self._last_mask, mask):
            self.mask[:n_rows].copy_(torch.from_numpy(mask), non_blocking=True)
            self._last_mask = mask
        if index is not None and (self._last_index is None or not np.array_equal(self._last_index, index)):
            self.index[:n_rows].copy_(torch.from_numpy(index), non_blocking=True)
            self._last_index = index

    # -- in the forward (traced) ----------------------------------------------------------------
    def apply(self, x: torch.Tensor, layout: tuple) -> torch.Tensor:
        """``x`` (in ``layout``, its row dims first among batch/seq/token) with this intervention
        applied on the masked rows; the other rows keep their bits."""
        rows = [k for k, d in enumerate(layout) if d in ROW_DIMS]
        n = 1
        for k in rows:
            n *= x.shape[k]
        bshape = [x.shape[k] if d in ROW_DIMS else 1 for k, d in enumerate(layout)]
        m = self.mask[:n].view(bshape)
        if self.head_mask is not None:
            m = m & self.head_mask.view(self.layouts["head_shape"])
        kind = self.plan.kind
        if kind == "zero":
            return x.masked_fill(m, 0)
        if self.slot is not None:
            return self._apply_slots(x, m, rows, n, bshape)
        if kind == "add":
            return torch.where(m, x + self.value.view(self.layouts["feature_shape"]), x)
        if kind == "scale":
            return torch.where(m, x * self.scale, x)
        if kind == "clamp":
            return torch.where(m, torch.clamp(x, self.lo, self.hi), x)
        if self.index is None:                 # mean, replace with one vector
            return torch.where(m, self.value.view(self.layouts["feature_shape"]).expand_as(x), x)
        table = self.value[self.index[:n]]     # [rows, *shape] in row order
        table = table.view(*[x.shape[k] for k in rows], *self.plan.shape).permute(self.layouts["perm"])
        return torch.where(m, table, x)


    def _apply_slots(self, x, m, rows, n, bshape):
        """:meth:`apply` where each row reads its request's slot of values."""
        slot = self.slot[:n]
        kind = self.plan.kind
        if kind == "scale":
            return torch.where(m, x * self.slots["scale"][slot].view(bshape), x)
        if kind == "clamp":
            return torch.where(m, torch.clamp(x, self.slots["lo"][slot].view(bshape), self.slots["hi"][slot].view(bshape)), x)
        table = self.slots["value"][slot]          # [rows, *shape] in row order
        table = table.view(*[x.shape[k] for k in rows], *self.plan.shape).permute(self.layouts["perm"])
        return torch.where(m, x + table if kind == "add" else table, x)


class WriteSite:
    """What a site handle of one (site, layer) holds when interventions write there: the
    interventions in hook-spec order, the tensor's layout (its trailing dims spelled out), and
    whether a capture of the site sees the value before them. :meth:`apply` is traced into
    compiled graphs."""
    __slots__ = ("interventions", "layout", "lead", "shape", "capture_first")

    def __init__(self, interventions: list, layout: tuple, shape: tuple, capture_first: bool):
        self.interventions, self.layout, self.shape = tuple(interventions), layout, shape
        self.lead = sum(1 for d in layout if d in ROW_DIMS)
        self.capture_first = capture_first

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        live = self.interventions
        if not (torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            # eager code decides each call: one switched off changes no bit (its mask is all false),
            # so its ops are skipped; traced code keeps them, to be switched without a recompile
            live = [iv for iv in live if iv.enabled]
            if not live:
                return x
        flat = x.ndim < len(self.layout)        # [.., heads * head_dim] held flat by the engine
        y = x.reshape(*x.shape[:self.lead], *self.shape) if flat else x
        for iv in live:
            y = iv.apply(y, self.layout)
        return y.reshape(x.shape) if flat else y


def full_layout(layout, dims: tuple) -> tuple:
    """An anchor's layout with the site's trailing dims spelled out (vLLM's anchors say only
    ``[token]``: its tensors are [tokens, *features], the features maybe flat)."""
    layout = tuple(layout or ("token",))
    lead = [d for d in layout if d in ROW_DIMS]
    return layout if len(layout) > len(lead) else (*layout, *dims)


class Interventions:
    """Every intervention of a run: device buffers, the per-step masks, the user's setters."""

    def __init__(self, plans: list[InterventionPlan], device, dtype, rows: int | None = None, slots: int = 1):
        self.plans = plans
        self.device, self.dtype = torch.device(device), dtype
        self.rows = rows or DEFAULT_ROWS
        self.by_name: dict[str, Intervention] = {}
        self.sites: dict[tuple, WriteSite] = {}
        for p in plans:
            layout = full_layout(p.anchors[p.layers[0]].get("layout"), p.dims)
            self.by_name[p.name] = Intervention(p, self.device, dtype, self.rows, _layout_info(layout, p.dims, p.shape),
                                                slots=slots)
        for p in plans:
            for lay in p.layers:
                key = (p.canonical, lay)
                layout = full_layout(p.anchors[lay].get("layout"), p.dims)
                ivs = [self.by_name[q.name] for q in plans if key in [(q.canonical, la) for la in q.layers]]
                self.sites[key] = WriteSite(ivs, layout, p.shape, p.capture_first)

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def site(self, canonical: str, layer) -> WriteSite | None:
        return self.sites.get((canonical, layer))

    def begin_step(self, st, n_rows: int, ids: list[str], extra: dict | None = None, slots: dict | None = None) -> None:
        """Write each intervention's mask for a step of ``n_rows`` engine rows whose real rows are
        ``st`` (all of them: rows a capture filter or opt-out leaves out are rows here too).
        ``ids``: the run's request ids (``st.request`` indexes them); ``extra``: {name: bool over
        st's rows} an engine adds (vLLM: requests that asked for it); ``slots``: {name: each of
        st's rows' slot of values} (vLLM: requests that set their own)."""
        for iv in self.by_name.values():
            if not iv.enabled:         # declared off: its mask cleared once, then no host work per step
                iv.clear(n_rows)
                continue
            keep = iv.rows_for(st, ids, None if extra is None else extra.get(iv.name))
            iv.write_rows(st, n_rows, keep, None if slots is None else slots.get(iv.name))

    def set(self, name: str, *, vector=None, scale=None, min=None, max=None, enabled=None, requests="keep") -> None:
        """Change an intervention between steps: values are copied into its buffers in place
        (a captured CUDA graph or compiled graph reads the new ones)."""
        iv = self.by_name.get(name)
        if iv is None:
            raise InterventionError(f"set_intervention: no intervention named {name!r}. "
                                    f"Fix: use one of {sorted(self.by_name)} (the hook spec's interventions)")
        p = iv.plan
        if scale is not None and "scale" not in TAKES[p.kind]:
            raise InterventionError(f"set_intervention({name!r}): kind {p.kind!r} takes no scale. Fix: leave scale out")
        if (min is not None or max is not None) and p.kind != "clamp":
            raise InterventionError(f"set_intervention({name!r}): only clamp takes min/max. Fix: leave them out")
        if vector is not None:
            if p.kind not in ("add", "mean", "replace"):
                raise InterventionError(f"set_intervention({name!r}): kind {p.kind!r} takes no vector")
            arr = vector.detach().double().cpu().numpy() if isinstance(vector, torch.Tensor) else np.asarray(vector, np.float64)
            head_axis = next((k for k, d in enumerate(p.dims) if d in ("head", "kv_head")), None)

            def error(problem, fix):
                return InterventionError(f"set_intervention({name!r}): vector: {problem}. Fix: {fix}")
            arr = fit_value(arr, p.kind, p.shape, p.dims, head_axis, error)
            if tuple(arr.shape) != tuple(iv.value.shape):
                raise error(f"shape {list(arr.shape)} differs from the buffer's {list(iv.value.shape)} allocated "
                            f"at load", "give the same shape (a table keeps its number of positions)")
            iv._vector = arr
        if scale is not None:
            p.scale = float(scale)
            iv.scale.fill_(p.scale)
        if vector is not None or (scale is not None and p.kind == "add"):
            new = torch.tensor(iv._vector, dtype=torch.float64).to(device=iv.device, dtype=iv.dtype)
            iv.value.copy_(new * p.scale if p.kind == "add" else new)
        if min is not None:
            iv.lo.fill_(float(min))
        if max is not None:
            iv.hi.fill_(float(max))
        if enabled is not None:
            iv.enabled = bool(enabled)
            iv._last_mask = None      # the next step rewrites the mask
        if requests != "keep":
            iv.requests = None if requests is None else set(requests)
            iv._last_mask = None


def _layout_info(layout: tuple, dims: tuple, shape: tuple) -> dict:
    """``feature_shape``: the trailing dims' broadcast shape in ``layout`` order (row dims 1);
    ``perm``: from [*row dims, *dims] (a table gathered in row order) to ``layout``."""
    canon = [d for d in layout if d in ROW_DIMS] + list(dims)
    sizes = dict(zip(dims, shape))
    return {"feature_shape": [1 if d in ROW_DIMS else sizes[d] for d in layout],
            "head_shape": [sizes[d] if d in ("head", "kv_head") else 1 for d in layout],
            "perm": [canon.index(d) for d in layout]}
