"""The hook spec's ``interventions:`` entries resolved and checked against the architecture spec
and the model config, before anything is patched or written; and a request's own values checked
against the operator's ``client:`` bounds."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import DmiError
from ..plan import TokenFilter, config_dim, layers_of
from ..spec import Document

KINDS = ("add", "scale", "zero", "mean", "replace", "clamp")
TAKES = {"add": {"vector", "scale"}, "scale": {"scale"}, "zero": set(), "mean": {"vector"},
         "replace": {"vector"}, "clamp": {"min", "max"}}     # the values each kind takes


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


def load_values(value: Any, hook: Document, path: tuple) -> np.ndarray:
    """Numbers given inline (nested lists) or as a file (.npy, or .pt/.pth holding one tensor; a
    relative path is the hook spec's folder's), as float64; errors name ``path`` and the fix."""
    if isinstance(value, str):
        p = Path(value).expanduser()
        if not p.is_absolute() and hook.file and not hook.file.startswith("<"):
            p = Path(hook.file).parent / p
        if not p.exists():
            raise hook.error(path, f"file {str(p)!r} does not exist", fix="give a .npy or .pt file (a path relative to the hook spec's folder), or the values inline")
        if p.suffix == ".npy":
            return np.load(p).astype(np.float64)
        if p.suffix in (".pt", ".pth"):
            t = torch.load(p, map_location="cpu", weights_only=True)
            if not isinstance(t, torch.Tensor):
                raise hook.error(path, f"{str(p)!r} holds a {type(t).__name__}, not one tensor",
                                 fix="torch.save the tensor itself")
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
        extra = sorted(k for k in ("scale", "min", "max", "vector") if k in entry and k not in TAKES[kind])
        if extra:
            raise hook.error(path + (extra[0],), f"kind {kind!r} takes no {extra[0]!r}",
                             fix=f"remove it (kind {kind!r} takes {sorted(TAKES[kind]) or 'nothing more'})")
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
        if key not in TAKES[kind]:
            raise hook.error(here + (key,), f"kind {kind!r} takes no {key!r}",
                             fix=f"remove it (kind {kind!r} takes {sorted(TAKES[kind]) or 'nothing'})")
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
    arr = load_values(entry["vector"], hook, path + ("vector",))
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
