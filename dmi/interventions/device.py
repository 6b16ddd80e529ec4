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


class Buffers:
    """Every intervention's device state, packed into a few tensors per run: row ``k`` of ``masks``
    is intervention ``k``'s per-row mask, ``values`` holds each one's vector or table at its own
    offset, ``scalars`` row ``k`` its (scale, min, max), ``heads`` each head mask at its offset,
    ``index`` a replacement table's per-row index and ``slot`` a client intervention's per-row
    slot of values. Compiled code reads each of them through one path (one graph input and one
    guard however many interventions there are: a whole-model graph pays Dynamo's guards and the
    graph's input handling for every input before each call); each :class:`Intervention` holds
    views of its rows, at the place ``places`` gives it. All at static addresses (CUDA graphs read
    them in place)."""

    def __init__(self, plans: list[InterventionPlan], device, dtype, rows: int):
        self.device, self.dtype = device, dtype
        self.n = len(plans)
        # each plan's place: its offset in values, (offset, length) in heads, its row of index
        # and of slot (-1: none)
        self.places: list[dict] = []
        values, heads = [torch.zeros(0, dtype=dtype, device=device)], [np.zeros(0, bool)]
        at = {"value": 0, "heads": 0, "table": 0, "client": 0}
        for p in plans:
            hm = head_mask(p) if p.heads is not None else None
            self.places.append({"value": at["value"], "heads": None if hm is None else (at["heads"], len(hm)),
                                "table": at["table"] if is_table(p) else -1,
                                "client": at["client"] if p.client is not None else -1})
            if p.value is not None:
                values.append(stored_value(p.value, p, device, dtype).reshape(-1))
                at["value"] += p.value.size
            if hm is not None:
                heads.append(hm)
                at["heads"] += len(hm)
            at["table"] += is_table(p)
            at["client"] += p.client is not None
        self.n_tables, self.n_clients = at["table"], at["client"]
        self.masks = self.index = self.slot = None
        self._alloc_rows(rows)
        scalars = [[p.scale, -math.inf if p.lo is None else p.lo, math.inf if p.hi is None else p.hi] for p in plans]
        self.scalars = torch.tensor(scalars, dtype=torch.float64).reshape(self.n, 3).to(device=device, dtype=dtype)
        self.values = torch.cat(values)
        self.heads = torch.tensor(np.concatenate(heads), device=device)
        static_inputs(self.scalars, self.values, self.heads)

    @property
    def rows(self) -> int:
        return self.masks.shape[1]

    def _alloc_rows(self, rows: int) -> None:
        """Per-row buffers of ``rows`` rows, all false / zero."""
        self.masks = torch.zeros(self.n, rows, dtype=torch.bool, device=self.device)
        self.index = torch.zeros(self.n_tables, rows, dtype=torch.int64, device=self.device) if self.n_tables else None
        self.slot = torch.zeros(self.n_clients, rows, dtype=torch.int64, device=self.device) if self.n_clients else None
        static_inputs(self.masks, self.index, self.slot)

    def fit(self, rows: int) -> bool:
        """Per-row buffers of at least ``rows`` rows (True: new ones, all false), at static
        addresses as those made at load: a CUDA graph recorded after a large eager step
        (generate()'s prefill, then its compiled decode) reads them in place instead of copying
        each one in per replay."""
        if rows <= self.rows:
            return False
        self._alloc_rows(rows)
        return True


def stored_value(value, p: InterventionPlan, device, dtype) -> torch.Tensor:
    """What an intervention's buffer holds for ``value``: in the run's dtype, an ``add``'s vector
    times its scale (multiplied in that dtype)."""
    v = torch.tensor(np.asarray(value), dtype=torch.float64).to(device=device, dtype=dtype)
    return v * p.scale if p.kind == "add" else v


def is_table(p: InterventionPlan) -> bool:
    """A replacement table: one row of values per position of its token window."""
    return p.kind == "replace" and p.value is not None and p.value.ndim == len(p.shape) + 1


def head_mask(p: InterventionPlan) -> np.ndarray:
    """Bool over the site's head axis: the heads ``p`` writes."""
    axis = next(k for k, d in enumerate(p.dims) if d in ("head", "kv_head"))
    hm = np.zeros(p.shape[axis], bool)
    hm[list(p.heads)] = True
    return hm


class Intervention:
    """One entry's device state (its rows of the run's :class:`Buffers`: values shared by its
    layers) and the rows it applies to this step. ``entry``: the constants its site call needs,
    a literal of plain values (:func:`apply_entry`)."""

    def __init__(self, plan: InterventionPlan, buffers: Buffers, k: int, layouts: dict, slots: int = 1):
        self.plan = plan
        self.name = plan.name
        self.buffers = buffers
        self.k = k
        self.enabled = plan.enabled
        self.requests = None if plan.requests is None else set(plan.requests)
        self.on_request = plan.on_request
        self._last_mask: np.ndarray | None = None
        self._cleared = True               # the mask is all false
        self.idle = True                   # no row this step (eager forwards skip its ops)
        self.filter_id = k                 # its token filter's number among the run's (Interventions sets it)
        self._last_index: np.ndarray | None = None
        at = buffers.places[k]
        self.table, self.client = at["table"], at["client"]
        value = (at["value"], tuple(plan.value.shape)) if plan.value is not None else None
        heads = None if at["heads"] is None else (*at["heads"], tuple(layouts["head_shape"]))
        self.entry = (plan.kind, k, self.table, value, heads, tuple(layouts["feature_shape"]), tuple(layouts["perm"]),
                      tuple(plan.shape))
        # requests' own values (``client:``): one slot of values per request that set some, slot 0
        # the operator's; each row reads its request's slot (a per-row index, like a table's)
        self.slots = None
        self._last_slot: np.ndarray | None = None
        if plan.client is not None:
            held = {"value": self.value, "scale": self.scale, "lo": self.lo, "hi": self.hi}
            self.slots = {name: t.unsqueeze(0).repeat(slots, *([1] * t.ndim)) for name, t in held.items() if t is not None}
            static_inputs(*self.slots.values())
        self._vector = self._vector_on_device = None
        if plan.value is not None:
            self.keep_vector(np.asarray(plan.value))

    # -- views of its rows of the run's buffers (slot 0's values for a client intervention) --------
    @property
    def mask(self) -> torch.Tensor:
        return self.buffers.masks[self.k]

    @property
    def index(self) -> torch.Tensor | None:
        return None if self.table < 0 else self.buffers.index[self.table]

    @property
    def slot(self) -> torch.Tensor | None:
        return None if self.client < 0 else self.buffers.slot[self.client]

    @property
    def value(self) -> torch.Tensor | None:
        if self.entry[3] is None:
            return None
        if self.slots is not None:
            return self.slots["value"][0]
        return _value(self.buffers, self.entry[3])

    @property
    def scale(self) -> torch.Tensor:
        return self.slots["scale"][0] if self.slots is not None else self.buffers.scalars[self.k, 0]

    @property
    def lo(self) -> torch.Tensor:
        return self.slots["lo"][0] if self.slots is not None else self.buffers.scalars[self.k, 1]

    @property
    def hi(self) -> torch.Tensor:
        return self.slots["hi"][0] if self.slots is not None else self.buffers.scalars[self.k, 2]

    def keep_vector(self, arr: np.ndarray) -> None:
        """The operator's vector (an add's before its scale). A client intervention also keeps it on
        the device, in float64: requests' slots are loaded from it there (:meth:`load_slot`)."""
        self._vector = arr
        if self.slots is not None:
            self._vector_on_device = torch.as_tensor(arr, dtype=torch.float64, device=self.buffers.device)

    def load_slot(self, k: int, values: dict) -> None:
        """Write a request's values (:func:`client_values`) into slot ``k`` (between steps, on the
        step's stream). No host sync: a copy from pageable host memory would wait for the GPU's
        queued steps each time a request joins."""
        scale = values["scale"]
        if "value" in self.slots:
            vec = self._vector_on_device
            if values["vector"] is not None:
                vec = torch.tensor(np.asarray(values["vector"]), dtype=torch.float64)
                if self.buffers.device.type == "cuda":
                    vec = vec.pin_memory().to(self.buffers.device, non_blocking=True)
            self.slots["value"][k].copy_(vec * scale if self.plan.kind == "add" else vec)
        self.slots["scale"][k].fill_(scale)
        self.slots["lo"][k].fill_(-math.inf if values["lo"] is None else values["lo"])
        self.slots["hi"][k].fill_(math.inf if values["hi"] is None else values["hi"])

    # -- per step (host) ------------------------------------------------------------------------
    def rows_for(self, st, ids: list[str], extra: np.ndarray | None, picked: dict | None = None) -> np.ndarray:
        """Bool over ``st``'s rows: the rows this intervention touches this step. ``extra``: rows
        of requests that asked for an ``on_request`` intervention (vLLM's per-request options).
        ``picked``: the step's rows per token filter, shared by the interventions of one step
        (many of them name the same filter: each one's selection is computed once)."""
        if not self.enabled:
            return np.zeros(len(st), bool)
        tokens = self.plan.tokens
        chosen = None if picked is None else picked.get(self.filter_id)
        if chosen is None:
            chosen = select(st, tokens, FilterState())
            if picked is not None:
                picked[self.filter_id] = chosen
        keep = np.zeros(len(st), bool)
        keep[chosen] = True
        if self.on_request or self.requests is not None:
            named = np.zeros(len(st), bool)
            if self.requests:
                hit = [r for r in np.unique(st.request).tolist() if ids[r] in self.requests]
                named = np.isin(st.request, hit)
            if self.on_request and extra is not None:      # rows of requests that asked for it (vLLM)
                named |= extra
            keep &= named
        return keep

    def forget_rows(self) -> None:
        """The per-row buffers were made anew (all false): the next step writes its rows again."""
        self._last_mask = self._last_index = self._last_slot = None

    def clear(self) -> None:
        """The whole mask false (no row touched), written once while disabled."""
        self.idle = True
        if not self._cleared:
            self.mask.zero_()
            self._last_mask = None
            self._cleared = True

    def write_rows(self, st, n_rows: int, keep: np.ndarray, slots: np.ndarray | None = None) -> None:
        """The step's mask (and table index, and each row's slot of values: ``slots`` over
        ``st``'s rows) over its ``n_rows`` engine rows, copied to the device when it differs from
        the last step's."""
        self._cleared = False
        if self.client >= 0:
            slot = np.zeros(n_rows, np.int64)
            if slots is not None:
                slot[st.rows] = slots
            if self._last_slot is None or len(self._last_slot) != n_rows or not np.array_equal(self._last_slot, slot):
                self.slot[:n_rows].copy_(torch.from_numpy(slot), non_blocking=True)
                self._last_slot = slot
        mask = row_mask(st, n_rows, keep)
        index = None
        if self.table >= 0:
            start = self.plan.tokens.positions[0] if self.plan.tokens.positions else 0
            rel = st.position - start
            inside = keep & (rel >= 0) & (rel < self.plan.value.shape[0])
            mask[:] = False
            mask[st.rows[inside]] = True
            index = np.zeros(n_rows, np.int64)
            index[st.rows[inside]] = rel[inside]
        self.write_mask(mask, n_rows)
        if index is not None and (self._last_index is None or not np.array_equal(self._last_index, index)):
            self.index[:n_rows].copy_(torch.from_numpy(index), non_blocking=True)
            self._last_index = index

    def write_mask(self, mask: np.ndarray, n_rows: int, idle: bool | None = None) -> None:
        """The step's mask over its ``n_rows`` engine rows, copied to the device when it differs
        from the last one written (the same array: no comparison). ``idle``: ``not mask.any()``,
        where the caller knows it."""
        self._cleared = False
        self.idle = not mask.any() if idle is None else idle
        last = self._last_mask
        if mask is not last and (last is None or len(last) != n_rows or not np.array_equal(last, mask)):
            self.mask[:n_rows].copy_(torch.from_numpy(mask), non_blocking=True)
        self._last_mask = mask

    # -- in the forward (traced) ----------------------------------------------------------------
    def apply(self, x: torch.Tensor, layout: tuple) -> torch.Tensor:
        """``x`` (in ``layout``, its row dims first among batch/seq/token) with this intervention
        applied on the masked rows; the other rows keep their bits."""
        if self.slots is None:
            return apply_entry(x, layout, self.entry, self.buffers)
        rows = [k for k, d in enumerate(layout) if d in ROW_DIMS]
        n = _count([x.shape[k] for k in rows])
        bshape = [x.shape[k] if d in ROW_DIMS else 1 for k, d in enumerate(layout)]
        m = _mask(x, layout, self.entry, self.buffers)
        slot = self.slot[:n]
        kind = self.plan.kind
        if kind == "scale":
            return torch.where(m, x * self.slots["scale"][slot].view(bshape), x)
        if kind == "clamp":
            return torch.where(m, torch.clamp(x, self.slots["lo"][slot].view(bshape), self.slots["hi"][slot].view(bshape)), x)
        table = self.slots["value"][slot]          # [rows, *shape] in row order
        table = table.view(*[x.shape[k] for k in rows], *self.plan.shape).permute(self.entry[6])
        return torch.where(m, x + table if kind == "add" else table, x)


def _count(sizes) -> int:
    """The product of ``sizes`` (a plain loop: traced code, where Dynamo takes no generator)."""
    n = 1
    for size in sizes:
        n *= size
    return n


def _value(buffers: Buffers, value: tuple) -> torch.Tensor:
    """An entry's vector or table: its (offset, shape) in ``buffers.values``."""
    offset, shape = value
    return buffers.values[offset:offset + _count(shape)].view(shape)


def row_mask(st, n_rows: int, keep: np.ndarray) -> np.ndarray:
    """Bool over a step's ``n_rows`` engine rows: ``st``'s rows that ``keep`` keeps."""
    mask = np.zeros(n_rows, bool)
    mask[st.rows[keep]] = True
    return mask


def _mask(x: torch.Tensor, layout: tuple, entry: tuple, buffers: Buffers) -> torch.Tensor:
    """The entry's mask over ``x``'s rows (and heads), broadcastable to ``x``."""
    bshape = [x.shape[k] if d in ROW_DIMS else 1 for k, d in enumerate(layout)]
    m = buffers.masks[entry[1], :_count(bshape)].view(bshape)
    heads = entry[4]
    if heads is not None:
        offset, n, shape = heads
        m = m & buffers.heads[offset:offset + n].view(shape)
    return m


def apply_entry(x: torch.Tensor, layout: tuple, entry: tuple, buffers: Buffers) -> torch.Tensor:
    """``x`` with one intervention applied on its masked rows (the others keep their bits).
    ``entry``: (kind, k, table, value, heads, feature shape, perm, shape), :attr:`Intervention.entry`:
    plain values, so that code with it written in (``dmi.siteop.site_at``) guards none of them."""
    kind, k, table, value, _, feature_shape, perm, shape = entry
    m = _mask(x, layout, entry, buffers)
    if kind == "zero":
        return x.masked_fill(m, 0)
    if kind == "scale":
        return torch.where(m, x * buffers.scalars[k, 0], x)
    if kind == "clamp":
        return torch.where(m, torch.clamp(x, buffers.scalars[k, 1], buffers.scalars[k, 2]), x)
    v = _value(buffers, value)
    if kind == "add":
        return torch.where(m, x + v.view(feature_shape), x)
    if table < 0:                          # mean, replace with one vector
        return torch.where(m, v.view(feature_shape).expand_as(x), x)
    rows = [x.shape[i] for i, d in enumerate(layout) if d in ROW_DIMS]
    t = v[buffers.index[table, :_count(rows)]]          # [rows, *shape] in row order
    return torch.where(m, t.view(*rows, *shape).permute(perm), x)


class WriteSite:
    """What a site handle of one (site, layer) holds when interventions write there: the
    interventions in hook-spec order, the tensor's layout (its trailing dims spelled out), and
    whether a capture of the site sees the value before them. :meth:`apply` is traced into
    compiled graphs."""
    __slots__ = ("interventions", "layout", "lead", "shape", "capture_first", "key")

    def __init__(self, interventions: list, layout: tuple, shape: tuple, capture_first: bool, key: tuple):
        self.interventions, self.layout, self.shape = tuple(interventions), layout, shape
        self.lead = sum(1 for d in layout if d in ROW_DIMS)
        self.capture_first = capture_first
        self.key = key                   # (site, layer): the run's interventions.sites key

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        live = self.interventions
        if not (torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            # eager code decides each call: one switched off, or with no row this step (a token
            # window passed, a request filter, nobody asked), changes no bit (its mask is all
            # false), so its ops are skipped; traced code keeps them, to be switched without a recompile
            live = [iv for iv in live if iv.enabled and not iv.idle]
            if not live:
                return x
        flat = x.ndim < len(self.layout)        # [.., heads * head_dim] held flat by the engine
        y = x.reshape(*x.shape[:self.lead], *self.shape) if flat else x
        for iv in live:
            y = iv.apply(y, self.layout)
        return y.reshape(x.shape) if flat else y

    def literal(self) -> tuple | None:
        """(key, capture first, (layout, lead, shape, entries)): this write site in plain values
        that code can have written in (``dmi.siteop.site_at``; the last item is what
        :func:`apply_literal` takes), or None where an intervention reads per-request slots of
        values (vLLM's, through the handle)."""
        if any(iv.slots is not None for iv in self.interventions):
            return None
        return _plain((self.key, self.capture_first, (self.layout, self.lead, self.shape,
                                                      [iv.entry for iv in self.interventions])))


def _plain(value):
    """``value`` as Python literals only (tuples, ints, floats, strings, bools, None), so that its
    ``repr`` is code that rebuilds it (numpy's ints are not)."""
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, (np.bool_, np.integer, np.floating)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"not a plain literal: {value!r}")


def apply_literal(x: torch.Tensor, literal: tuple, buffers: Buffers) -> torch.Tensor:
    """:meth:`WriteSite.apply` of traced code, from the last item of :meth:`WriteSite.literal`:
    every intervention of the site, on or off (a mask of zeros), so that switching one needs no
    recompile."""
    layout, lead, shape, entries = literal
    flat = x.ndim < len(layout)
    y = x.reshape(*x.shape[:lead], *shape) if flat else x
    for entry in entries:
        y = apply_entry(y, layout, entry, buffers)
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
        self.buffers = Buffers(plans, self.device, dtype, rows or DEFAULT_ROWS)
        self.by_name: dict[str, Intervention] = {}
        self.sites: dict[tuple, WriteSite] = {}
        self._masks: dict = {}          # the last step's plain masks (begin_step)
        filters: dict = {}              # token filter -> a small int (a cheap key per step)
        for k, p in enumerate(plans):
            layout = full_layout(p.anchors[p.layers[0]].get("layout"), p.dims)
            iv = Intervention(p, self.buffers, k, _layout_info(layout, p.dims, p.shape), slots=slots)
            self.by_name[p.name] = iv
            iv.filter_id = filters.setdefault(p.tokens, len(filters))
        for p in plans:
            for lay in p.layers:
                key = (p.canonical, lay)
                layout = full_layout(p.anchors[lay].get("layout"), p.dims)
                ivs = [self.by_name[q.name] for q in plans if key in [(q.canonical, la) for la in q.layers]]
                self.sites[key] = WriteSite(ivs, layout, p.shape, p.capture_first, key)

    @property
    def rows(self) -> int:
        """Rows a step may carry before the per-row buffers grow."""
        return self.buffers.rows

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
        if self.buffers.fit(n_rows):
            for iv in self.by_name.values():
                iv.forget_rows()
        picked: dict = {}
        shared: dict = {}
        for iv in self.by_name.values():
            asked = None if extra is None else extra.get(iv.name)
            if not iv.enabled or (iv.on_request and not iv.requests and asked is not None and not asked.any()):
                iv.clear()      # off, or no request of the step asked for it: its mask cleared once, no host work
                continue
            if iv.table >= 0 or iv.client >= 0:
                keep = iv.rows_for(st, ids, asked, picked)
                iv.write_rows(st, n_rows, keep, None if slots is None else slots.get(iv.name))
                continue
            # a plain mask depends only on the rows kept: one per (token filter, request filter,
            # rows asking), shared by the interventions that have the same, and the same array as
            # the last step's where equal (each intervention's comparison is then an identity)
            key = (iv.filter_id, id(iv.requests), id(asked) if iv.on_request else 0)
            got = shared.get(key)
            if got is None:
                mask = row_mask(st, n_rows, iv.rows_for(st, ids, asked, picked))
                last = self._masks.get(key)
                if last is not None and len(last[0]) == n_rows and np.array_equal(last[0], mask):
                    got = last
                else:
                    got = (mask, not mask.any())
                shared[key] = got
            iv.write_mask(got[0], n_rows, got[1])
        self._masks = shared

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
            iv.keep_vector(arr)
        if scale is not None:
            p.scale = float(scale)
            iv.scale.fill_(p.scale)
        if vector is not None or (scale is not None and p.kind == "add"):
            iv.value.copy_(stored_value(iv._vector, p, self.device, self.dtype))
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
