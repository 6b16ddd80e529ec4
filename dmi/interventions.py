"""Write sites: steering, ablation and activation patching at the sites of the vocabulary.

A hook spec's ``interventions:`` entries (``docs/interventions.md``) are resolved here against the
architecture spec and the model config (:func:`plan_interventions`, before anything is patched or
written), then held as device buffers (:class:`Interventions`) that the patched site call reads on
every forward:

* **values** (the steering vector, the mean, the replacement table, the scale, the clamp bounds)
  live in tensors allocated at load and updated in place (:meth:`Interventions.set`), so a CUDA
  graph or a compiled graph that read them keeps reading the new values: no re-capture, no
  recompile;
* **which rows** an intervention touches is a per-row bool mask (and, for replacement tables, a
  per-row index) the host writes before each step from the step's rows: their requests and
  positions (:meth:`Interventions.begin_step`). A disabled intervention is a mask of zeros, not a
  Python branch: the graph is the same whether it is on or off;
* **applying** is plain torch ops (``torch.where(mask, f(x), x)``), traced into compiled graphs
  like the model's own; rows outside the mask keep their bits.

Order with a capture of the same site: the capture sees the value after the interventions
(``capture: after``, the default) or before them (``capture: before``), per site.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import DmiError
from .plan import TokenFilter, config_dim, layers_of
from .spec import Document
from .tokens import FilterState, select

KINDS = ("add", "scale", "zero", "mean", "replace", "clamp")
ROW_DIMS = ("batch", "seq", "token")
DEFAULT_ROWS = 4096       # rows a step may carry before the mask buffers grow (eager steps only)


class InterventionError(DmiError, ValueError):
    """``set_intervention`` was given something the intervention cannot take."""


@dataclass
class InterventionPlan:
    """One ``interventions:`` entry resolved against the model: what it does and where."""
    name: str
    index: int                       # its position in the hook spec
    canonical: str
    layers: tuple                    # (layer or None, ...)
    kind: str
    dims: tuple                      # the site's trailing canonical dims
    shape: tuple                     # their sizes
    heads: tuple | None
    tokens: TokenFilter
    requests: tuple | None           # request ids it applies to (None: every request)
    on_request: bool                 # applied only to requests that name it
    enabled: bool
    capture_first: bool              # a capture of the same site sees the value before it
    value: np.ndarray | None         # vector [*shape] or replacement table [P, *shape] (per layer: dict)
    scale: float = 1.0
    lo: float | None = None
    hi: float | None = None
    anchors: dict = field(default_factory=dict)    # layer -> the engine anchor it is patched at
    client: dict | None = None       # what a request may set for itself, within bounds (``client:``)


def _load_value(value: Any, hook: Document, path: tuple) -> np.ndarray:
    """A vector given inline (nested lists) or as a file (.npy, or .pt/.pth holding one tensor)."""
    if isinstance(value, str):
        p = Path(value).expanduser()
        if not p.is_absolute() and hook.file and not hook.file.startswith("<"):
            p = Path(hook.file).parent / p
        if not p.exists():
            raise hook.error(path, f"file {str(p)!r} does not exist", fix="give a .npy or .pt file, or the values inline")
        if p.suffix == ".npy":
            return np.load(p).astype(np.float64)
        if p.suffix in (".pt", ".pth"):
            t = torch.load(p, map_location="cpu", weights_only=True)
            if not isinstance(t, torch.Tensor):
                raise hook.error(path, f"{str(p)!r} holds a {type(t).__name__}, not one tensor",
                                 fix="torch.save the vector itself")
            return t.double().numpy()
        raise hook.error(path, f"{str(p)!r}: unknown file type {p.suffix!r}", fix="use a .npy or .pt file")
    try:
        arr = np.asarray(value, np.float64)
    except ValueError:
        raise hook.error(path, "the values are not a rectangular array of numbers",
                         fix="give a list of numbers (nested lists for more dims)") from None
    return arr


def write_problem(anchor: dict | None) -> str | None:
    """Why a site cannot be written at this engine anchor (None: it can). The site call must hand
    its tensor back into the model's data flow, as one tensor the model uses afterwards."""
    if anchor is None:
        return "this engine has no anchor for it"
    if "compute" in anchor:
        return "the engine never materializes it (dmi recomputes it for capture only)"
    if "order_by" in anchor or "method" in anchor:
        return "dmi reads it from a router's return value, which is not fed back to the model"
    if anchor.get("partial") or "rows" in anchor:
        return "the engine computes it for some rows only (logits)"
    for key in ("input", "output"):
        if isinstance(anchor.get(key), list):
            return "the engine holds it as two tensors it never adds (write one of its parts instead)"
    if "output" in anchor and anchor["output"] != 0:
        return ("the engine reads it from a fused op's second output, after that op consumed the value "
                "(vLLM's fused add+RMSNorm): a write there would not reach the layer's norm")
    return None


def plan_interventions(arch: Document, hook: Document, config: Any, *, available: set | None,
                       engine: str, anchor_of) -> list[InterventionPlan]:
    """Resolve and check every ``interventions:`` entry. ``anchor_of(canonical, layer)``: the engine
    anchor the site is patched at. Raises :class:`dmi.errors.SpecError` naming the hook spec's
    file, line and key, with the fix."""
    entries = hook.data.get("interventions") or []
    if not entries:
        return []
    dims = {d: config_dim(config, attr, arch, d) for d, attr in arch.data["dims"].items()}
    n_layers = dims["layer"]
    out: list[InterventionPlan] = []
    names: dict[str, int] = {}
    order: dict[tuple, tuple[bool, int]] = {}       # (canonical, layer) -> (capture_first, entry)
    for i, entry in enumerate(entries):
        path = ("interventions", i)
        name = entry["name"]
        if name in names:
            raise hook.error(path + ("name",), f"intervention name {name!r} is already used by interventions[{names[name]}]",
                             fix="give each intervention its own name")
        names[name] = i
        canonical = entry["site"]
        site = arch.data["sites"].get(canonical)
        if site is None:
            raise hook.error(path + ("site",), f"{canonical!r} is not a site of the {arch.data['family']} architecture",
                             fix=f"use one of {sorted(arch.data['sites'])}")
        per_layer = bool(site.get("per_layer"))
        layers = layers_of(entry, n_layers, hook, path)
        if layers is not None and not per_layer:
            raise hook.error(path + ("layers",), f"site {canonical!r} is not per-layer: `layers` does not apply to it",
                             fix="remove `layers` from this intervention")
        if per_layer and layers is None:
            layers = list(range(n_layers))
        layer_list = tuple(layers) if per_layer else (None,)
        if available is not None:
            missing = [lay for lay in layer_list if (canonical, lay) not in available]
            if missing:
                where = "the model" if missing == [None] else f"layers {missing}"
                raise hook.error(path + ("site",), f"site {canonical!r} does not exist in {where} of this model "
                                 f"on {engine}", fix="pick layers where the site exists (MoE sites: MoE layers only)")
        anchors = {}
        for lay in layer_list:
            anchor = anchor_of(canonical, lay)
            why = write_problem(anchor)
            if why:
                raise hook.error(path + ("site",), f"site {canonical!r} cannot be written on {engine}: {why}",
                                 fix="intervene at another site of the vocabulary (e.g. attn.out, mlp.out, attn.z, "
                                     "resid_post on transformers)")
            anchors[lay] = anchor
        sdims = tuple(site["dims"][1:])
        if "key" in sdims or site.get("dtype", "float") != "float":
            raise hook.error(path + ("site",), f"site {canonical!r} holds no activations to write",
                             fix="intervene at a site of float activations")
        shape = tuple(dims[d] for d in sdims)
        heads = tuple(entry["heads"]) if "heads" in entry else None
        head_axis = next((k for k, d in enumerate(sdims) if d in ("head", "kv_head")), None)
        if heads is not None:
            if head_axis is None:
                raise hook.error(path + ("heads",), f"site {canonical!r} has no head dim", fix="remove `heads`")
            bad = [h for h in heads if h >= shape[head_axis]]
            if bad:
                raise hook.error(path + ("heads",), f"heads {bad} out of range: {canonical} has {shape[head_axis]}",
                                 fix=f"use heads 0..{shape[head_axis] - 1}")
        kind = entry["kind"]
        tokens = _tokens(entry, hook, path)
        value = _value(entry, kind, shape, sdims, heads, head_axis, hook, path)
        if kind == "clamp" and "min" not in entry and "max" not in entry:
            raise hook.error(path, "clamp needs min, max or both", fix="add min: and/or max:")
        if "min" in entry and "max" in entry and entry["min"] > entry["max"]:
            raise hook.error(path + ("min",), f"min {entry['min']} is above max {entry['max']}", fix="swap them")
        extra = sorted(k for k in ("scale", "min", "max", "vector") if k in entry and k not in _TAKES[kind])
        if extra:
            raise hook.error(path + (extra[0],), f"kind {kind!r} takes no {extra[0]!r}",
                             fix=f"remove it (kind {kind!r} takes {sorted(_TAKES[kind]) or 'nothing more'})")
        client = _client(entry, kind, value, shape, hook, path)
        capture_first = entry.get("capture", "after") == "before"
        for lay in layer_list:
            prior = order.get((canonical, lay))
            if prior is not None and prior[0] != capture_first:
                raise hook.error(path + ("capture",), f"interventions[{prior[1]}] at the same site says capture: "
                                 f"{'before' if prior[0] else 'after'}", fix="say the same `capture:` for every "
                                 "intervention of one site (a capture sees the site once)")
            order[(canonical, lay)] = (capture_first, i)
        requests = entry.get("requests", "all")
        out.append(InterventionPlan(
            name=name, index=i, canonical=canonical, layers=layer_list, kind=kind, dims=sdims, shape=shape,
            heads=heads, tokens=tokens, requests=None if requests in ("all", "on_request") else tuple(requests),
            on_request=requests == "on_request", enabled=entry.get("enabled", True), capture_first=capture_first,
            value=value, scale=float(entry.get("scale", 1.0)), lo=entry.get("min"), hi=entry.get("max"), client=client,
            anchors=anchors))
    return out


_TAKES = {"add": {"vector", "scale"}, "scale": {"scale"}, "zero": set(), "mean": {"vector"},
          "replace": {"vector"}, "clamp": {"min", "max"}}


def _client(entry: dict, kind: str, value, shape: tuple, hook: Document, path: tuple) -> dict | None:
    """The entry's ``client:`` bounds, checked: only for ``requests: on_request`` entries, only for
    the values its kind takes, ``low <= high``; a client vector only where one vector is written."""
    client = entry.get("client")
    if client is None:
        return None
    here = path + ("client",)
    if entry.get("requests") != "on_request":
        raise hook.error(here, "client values apply to requests that name the intervention",
                         fix="add `requests: on_request` to this intervention, or remove `client`")
    for key, bounds in client.items():
        if key not in _TAKES[kind]:
            raise hook.error(here + (key,), f"kind {kind!r} takes no {key!r}",
                             fix=f"remove it (kind {kind!r} takes {sorted(_TAKES[kind]) or 'nothing'})")
        if key != "vector" and bounds[0] > bounds[1]:
            raise hook.error(here + (key,), f"the range {bounds} is empty (low above high)", fix="write [low, high]")
    if "vector" in client and value is not None and value.ndim == len(shape) + 1:
        raise hook.error(here + ("vector",), "a replacement table ([positions, ...]) takes no client vector",
                         fix="give one vector of the site's shape, or remove client.vector")
    return dict(client)


def client_values(plan: InterventionPlan, values, error) -> dict:
    """A request's own values for ``plan`` (``{"scale": 2.0, "vector": [...], "min": .., "max": ..}``),
    checked against the operator's ``client:`` bounds: ``{"scale", "lo", "hi", "vector"}`` with the
    operator's value where the request gives none. ``error(key, problem)`` makes the exception
    raised otherwise (a request refused before it runs: HTTP 400 under ``vllm serve``)."""
    bounds = plan.client or {}
    if not isinstance(values, dict):
        raise error("", f"must be an object of values ({sorted(bounds) or 'none allowed'}), not {type(values).__name__}")
    unknown = sorted(set(values) - set(bounds))
    if unknown:
        allowed = ", ".join(f"{k} in {_range_text(k, b)}" for k, b in sorted(bounds.items())) or "none"
        raise error(str(unknown[0])[:40], f"is not a value a request may set (operator hook spec: "
                    f"interventions[{plan.index}].client allows {allowed})")
    out = {"scale": plan.scale, "lo": plan.lo, "hi": plan.hi, "vector": None}
    for key in ("scale", "min", "max"):
        if key not in values:
            continue
        v, (low, high) = values[key], bounds[key]
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                pass
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise error(key, f"must be a finite number in [{low}, {high}], not {str(v)[:40]!r}")
        if not low <= v <= high:
            raise error(key, f"= {v} is outside the allowed range [{low}, {high}] (operator hook spec: "
                        f"interventions[{plan.index}].client.{key})")
        out[{"scale": "scale", "min": "lo", "max": "hi"}[key]] = float(v)
    if out["lo"] is not None and out["hi"] is not None and out["lo"] > out["hi"]:
        raise error("min", f"= {out['lo']} is above max {out['hi']}")
    if "vector" in values:
        limit = bounds["vector"]["max_norm"]
        try:
            arr = np.asarray(values["vector"], np.float64)
        except (TypeError, ValueError):
            raise error("vector", "is not a rectangular array of numbers") from None
        head_axis = next((k for k, d in enumerate(plan.dims) if d in ("head", "kv_head")), None)
        per_head = plan.shape[head_axis + 1:] if head_axis is not None else None
        shapes = [list(plan.shape)] + ([list(per_head)] if per_head is not None else [])
        if list(arr.shape) not in shapes:
            raise error("vector", f"has shape {list(arr.shape)}; allowed: {' or '.join(map(str, shapes))} "
                        f"({', '.join(plan.dims)})")
        if not np.all(np.isfinite(arr)):
            raise error("vector", "holds NaN or infinity")
        norm = float(np.linalg.norm(arr))
        if norm > limit:
            raise error("vector", f"has L2 norm {norm:.6g}, above the allowed {limit} (operator hook spec: "
                        f"interventions[{plan.index}].client.vector.max_norm)")
        out["vector"] = fit_value(arr, plan.kind, plan.shape, plan.dims, head_axis, lambda p, f: error("vector", p))
    return out


def _range_text(key: str, bounds) -> str:
    return f"a vector of L2 norm <= {bounds['max_norm']}" if key == "vector" else f"[{bounds[0]}, {bounds[1]}]"


def _tokens(entry: dict, hook: Document, path: tuple) -> TokenFilter:
    tokens = entry.get("tokens", "all")
    flt = TokenFilter.parse(tokens)      # (the schema allows phase, last and positions only)
    if flt.positions is not None and flt.positions[1] <= flt.positions[0]:
        raise hook.error(path + ("tokens", "positions"), f"empty window {list(flt.positions)}",
                         fix="write [start, stop) with stop > start")
    return flt


def _value(entry, kind, shape, sdims, heads, head_axis, hook, path) -> np.ndarray | None:
    """The entry's vector as an array of the site's trailing shape (a replacement table: with a
    leading positions dim). A per-head vector ([head_dim]) is repeated over the heads."""
    if kind in ("add", "mean", "replace") and "vector" not in entry:
        raise hook.error(path, f"kind {kind!r} needs `vector`", fix="give the values inline or as a .npy/.pt file")
    if "vector" not in entry:
        return None
    arr = _load_value(entry["vector"], hook, path + ("vector",))
    return fit_value(arr, kind, shape, sdims, head_axis,
                     lambda problem, fix: hook.error(path + ("vector",), problem, fix=fix))


def fit_value(arr: np.ndarray, kind: str, shape: tuple, sdims: tuple, head_axis: int | None, error) -> np.ndarray:
    """``arr`` as the site's trailing ``shape`` (a replacement table: [positions, *shape]);
    ``error(problem, fix)`` makes the exception raised otherwise."""
    if not np.all(np.isfinite(arr)):
        raise error("the values hold NaN or infinity", "give finite numbers")
    per_head = shape[head_axis + 1:] if head_axis is not None else None
    if tuple(arr.shape) == tuple(shape):
        return arr
    if per_head is not None and tuple(arr.shape) == tuple(per_head):
        return np.broadcast_to(arr, shape).copy()
    if kind == "replace" and arr.ndim == len(shape) + 1 and tuple(arr.shape[1:]) == tuple(shape):
        return arr
    want = f"{list(shape)} ({', '.join(sdims)})"
    if per_head is not None:
        want += f", or {list(per_head)} (one head, repeated over the heads)"
    if kind == "replace":
        want += f", or [positions, {', '.join(map(str, shape))}] (one row per position)"
    raise error(f"shape {list(arr.shape)} does not match the site's trailing dims: expected {want}",
                "give a vector of the site's trailing shape")


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
        if device.type == "cuda":      # read by CUDA graphs: static addresses, updated in place
            held = (self.value, self.scale, self.lo, self.hi) if self.slots is None else tuple(self.slots.values())
            for t in (self.mask, self.index, self.head_mask, self.slot, *held):     # (not the views of slot 0)
                if t is not None:
                    torch._dynamo.mark_static_address(t)

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

    def clear(self) -> None:
        """The whole mask false (no row touched, at any step size), written once while disabled."""
        if not self._cleared:
            self.mask.zero_()
            self._last_mask = None
            self._cleared = True

    def write_rows(self, st, n_rows: int, keep: np.ndarray, slots: np.ndarray | None = None) -> None:
        """The step's mask (and table index, and each row's slot of values: ``slots`` over
        ``st``'s rows) over its ``n_rows`` engine rows, copied to the device when it differs from
        the last step's."""
        self._cleared = False
        if n_rows > self.mask.shape[0]:
            self.mask = torch.zeros(n_rows, dtype=torch.bool, device=self.device)     # eager steps only
            if self.index is not None:
                self.index = torch.zeros(n_rows, dtype=torch.int64, device=self.device)
            if self.slot is not None:
                self.slot = torch.zeros(n_rows, dtype=torch.int64, device=self.device)
                self._last_slot = None
            self._last_mask = None
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
        flat = x.ndim < len(self.layout)        # [.., heads * head_dim] held flat by the engine
        y = x.reshape(*x.shape[:self.lead], *self.shape) if flat else x
        for iv in self.interventions:
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
                iv.clear()
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
        if scale is not None and "scale" not in _TAKES[p.kind]:
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


def values_from_store(tree, request_id: str, site: str, *, layer: int | None = None,
                      positions: tuple[int, int] | None = None) -> np.ndarray:
    """A replacement table from a closed store (``dmi.open``): request ``request_id``'s rows of
    ``site`` (of ``layer``) at ``positions`` ``[start, stop)`` (default: all its rows), as
    ``[positions, *trailing dims]`` for ``run.set_intervention(name, vector=...)`` of a
    ``replace`` intervention whose ``tokens.positions`` starts at ``start`` (activation patching).
    Raises :class:`InterventionError` naming what is missing when the store has not captured it."""
    group = ("layers/" if layer is not None else "") + site.replace(".", "/")
    try:
        node = tree[group]
    except KeyError:
        raise InterventionError(f"values_from_store: the store holds no site {site!r} (group {group!r}). Fix: "
                                f"capture it in the source run (capture: [{{sites: [{site}]}}]) and read that "
                                f"run's store once it is closed") from None
    ds = node.to_dataset(inherit=False) if hasattr(node, "to_dataset") else node.dataset
    name = site.rsplit(".", 1)[-1]
    if name not in ds.data_vars:
        name = next(iter(ds.data_vars))
    arr = ds[name]
    if layer is not None:
        if "layer" not in arr.dims or layer not in arr.coords["layer"].values.tolist():
            raise InterventionError(f"values_from_store: {site!r} was not captured at layer {layer}. Fix: capture "
                                    f"that layer in the source run")
        arr = arr.sel(layer=layer)
    req = np.asarray(arr.coords["request"].values)       # (object, str or numpy's StringDType)
    idx = np.flatnonzero(req == str(request_id))
    if not len(idx):
        some = sorted(set(map(str, req.tolist())))[:10]
        raise InterventionError(f"values_from_store: request {request_id!r} has no rows of {site!r} in this store "
                                f"(it holds {some}). Fix: run the source request first, with a capture of "
                                f"{site!r}, and read its store once that run is closed")
    pos = np.asarray(arr.coords["position"].values)[idx]
    idx = idx[np.argsort(pos, kind="stable")]
    pos = np.sort(pos)
    if positions is not None:
        want = np.arange(*positions)
        missing = sorted(set(want.tolist()) - set(pos.tolist()))
        if missing:
            raise InterventionError(f"values_from_store: request {request_id!r} has no rows of {site!r} at "
                                    f"positions {missing[:10]} (stored: {pos.min()}..{pos.max()}). Fix: patch "
                                    f"positions the source captured (its capture's tokens filter keeps them)")
        idx = idx[np.searchsorted(pos, want)]
    return np.asarray(arr.isel(token=idx).values)
