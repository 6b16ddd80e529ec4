"""Resolve a hook spec against an architecture spec and a model config into a Plan.

The Plan is the single description every later stage reads: which sites are captured (with their
engine anchor), which tokens, the shape of one captured row, and the policy budgets.
"""
from __future__ import annotations

import difflib
import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import PolicyError
from .settings import EngineOptions
from .spec import Document, format_path, parse_bytes
from .stall import DEFAULT_STALL_TIMEOUT_S

DEFAULT_RING_BYTES = 256 << 20
DEFAULT_MAX_KEYS = 256
RING_ALIGN = 256     # every site's block in the payload ring starts at a multiple of this (dmi.ring.records.ALIGN)


@dataclass(frozen=True)
class TokenFilter:
    """Which rows of a step a site keeps. Applied on the host to build the row selection."""
    phase: str = "all"              # all | prefill | decode
    last: bool = False              # only the last token of each request in the step
    every_n_steps: int = 1          # decode steps of a request: keep every n-th
    positions: tuple[int, int] | None = None   # [start, stop)
    max_per_request: int | None = None

    @classmethod
    def parse(cls, value: Any) -> "TokenFilter":
        if value is None or value == "all":
            return cls()
        if value in ("prefill", "decode"):
            return cls(phase=value)
        if value == "last":
            return cls(last=True)
        return cls(phase=value.get("phase", "all"), last=value.get("last", False),
                   every_n_steps=value.get("every_n_steps", 1),
                   positions=tuple(value["positions"]) if "positions" in value else None,
                   max_per_request=value.get("max_per_request"))


@dataclass(frozen=True)
class Output:
    """One stored array of a site: ``name`` with trailing ``dims``/``shape`` after the token dim."""
    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    kind: str            # 'float' (the model's float dtype), 'float32' or 'int32'

    def itemsize(self, float_itemsize: int) -> int:
        return float_itemsize if self.kind == "float" else 4

    @property
    def row_elems(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SitePlan:
    """One captured site of one layer (or a model-level site)."""
    index: int                  # dense id used by the site op and the meta ring
    name: str                   # full name: 'layers.3.attn.q', 'final_norm'
    canonical: str              # 'attn.q'
    layer: int | None
    group: str                  # store group: 'layers/attn/q'
    dims: tuple[str, ...]       # canonical dims after 'token'
    shape: tuple[int, ...]      # their sizes (before reduction / head selection)
    anchor: dict                # the engine anchor from the architecture spec
    tokens: TokenFilter
    outputs: tuple[Output, ...]
    reduce: dict | None = None
    heads: tuple[int, ...] | None = None
    priority: int = 0

    def row_bytes(self, float_itemsize: int) -> int:
        return sum(o.row_elems * o.itemsize(float_itemsize) for o in self.outputs)


@dataclass
class Policy:
    mode: str = "full"
    ring_bytes: int = DEFAULT_RING_BYTES
    host_bytes: int = 256 << 20
    meta_records: int = 4096
    max_step_tokens: int | None = None
    on_store_error: str = "raise"
    d2h_bytes_per_s: int | None = None   # device-to-host cap on reserved step bytes (None: uncapped)
    drain: str = "thread"                # policy.drain: a thread of this process, or a child process (ringshare)
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S    # a wait without progress this long is an error (dmi.stall)


@dataclass
class Plan:
    family: str
    sites: list[SitePlan]
    policy: Policy
    layers: int
    store_dtype: str = "native"
    chunk_bytes: int = 4 << 20
    compression: str = "lz4"
    max_bytes: int | None = None       # store.max_bytes: cap on chunk bytes on disk
    bytes_per_s: int | None = None     # store.bytes_per_s: write-rate cap of the exporter
    writer: str = "auto"               # store.writer: thread, process, pool, or auto (Run picks: resolve_writer)
    threads: int | None = None         # store.threads: the exporter's encode/copy threads (None: its default)
    writers: int | None = None         # store.writers: store.writer pool's processes (None: its default)
    storage_options: dict | None = None   # store.storage_options: an object store's file system options
    arch_file: str = ""
    hook_file: str = ""
    hook_spec: dict = field(default_factory=dict)
    engine: EngineOptions = field(default_factory=EngineOptions)    # the hook spec's engine section
    unavailable: dict = field(default_factory=dict)   # canonical -> why: sites a pattern named that this engine never computes
    interventions: list = field(default_factory=list)  # dmi.interventions.InterventionPlan per interventions: entry
    probes: list = field(default_factory=list)         # linear probes requests may ask back (vLLM: requests.return.probes)

    def by_layer_site(self) -> dict[tuple[str, int | None], SitePlan]:
        return {(s.canonical, s.layer): s for s in self.sites}

    def step_bytes(self, tokens: int, float_itemsize: int) -> int:
        """Upper bound of one step's payload for ``tokens`` rows (analytic, from the plan)."""
        return sum(tokens * s.row_bytes(float_itemsize) for s in self.sites)

    def reserved_bytes(self, tokens: int, float_itemsize: int, sites: list | None = None) -> int:
        """What the ring reserves for a step of ``tokens`` rows in every site (of ``sites``): each
        site's block is rounded up to ``RING_ALIGN``, so this (not :meth:`step_bytes`) is what must
        fit a budget."""
        return sum(-(-tokens * s.row_bytes(float_itemsize) // RING_ALIGN) * RING_ALIGN
                   for s in (self.sites if sites is None else sites))


def config_dim(config: Any, attr: str, arch: Document, dim: str) -> int:
    value = getattr(config, attr, None)
    if value is None and attr == "head_dim":   # configs that derive head_dim
        value = config.hidden_size // config.num_attention_heads
    if not isinstance(value, int):
        raise arch.error(("dims", dim), f"model config has no integer attribute {attr!r}",
                         fix="point this dim at the config attribute that holds its size")
    return value


_RANGE = re.compile(r"^\s*(-?[0-9]+)\s*-\s*(-?[0-9]+)\s*$")


def layers_of(entry: dict, n_layers: int, doc: Document, path: tuple) -> list[int] | None:
    if "layers" not in entry:
        return None
    out: list[int] = []
    for j, item in enumerate(entry["layers"]):
        if isinstance(item, int):
            lo = hi = item
        else:   # 'a-b', either end may be negative: '1-2', '-3--1', '0 - -1'
            m = _RANGE.match(item)
            if not m:
                raise doc.error(path + ("layers", j), f"{item!r} is not a layer or a layer range",
                                fix="write a layer index (negative counts from the end) or a range such as '2-5'")
            lo, hi = int(m.group(1)), int(m.group(2))
        for v in (lo, hi):
            if not -n_layers <= v < n_layers:
                raise doc.error(path + ("layers", j), f"layer {v} is out of range: the model has {n_layers} layers",
                                fix=f"use layers 0..{n_layers - 1} (or negative from the end)")
        lo, hi = lo % n_layers, hi % n_layers
        if hi < lo:
            raise doc.error(path + ("layers", j), f"empty range {item!r}: it runs from layer {lo} down to layer {hi} "
                            f"(the model has {n_layers} layers)", fix=f"write ranges low-high, e.g. '{hi}-{lo}'")
        out.extend(range(lo, hi + 1))
    return sorted(set(out))


def all_site_names(arch: Document, n_layers: int) -> list[tuple[str, str, int | None]]:
    """Every (full name, canonical, layer) the architecture offers."""
    out = []
    for canonical, site in arch.data["sites"].items():
        if site.get("per_layer"):
            out += [(f"layers.{i}.{canonical}", canonical, i) for i in range(n_layers)]
        else:
            out.append((canonical, canonical, None))
    return out


def match_sites(pattern: str, candidates: list[tuple[str, str, int | None]]) -> list[tuple[str, str, int | None]]:
    # 'resid_post' matches every layer's resid_post; 'layers.*.attn.q' matches by full name
    return [c for c in candidates if fnmatch.fnmatchcase(c[0], pattern) or fnmatch.fnmatchcase(c[1], pattern)]


def build_plan(arch: Document, hook: Document, config: Any, *, model_dtype_itemsize: int = 4,
               available: set[tuple[str, int | None]] | None = None, unavailable: dict[str, str] | None = None,
               engine: str = "hf") -> Plan:
    """Semantic validation + resolution. ``available`` lists (canonical, layer) pairs that exist in
    the loaded model (e.g. MoE sites only on MoE layers); None means all. ``unavailable``: canonical
    sites the engine never computes, and why: named alone they are refused with the reason, matched
    by a glob they are left out and listed in ``Plan.unavailable``. ``engine``: the anchors
    (``hf`` or ``vllm``) ``available`` was found by, named when a site's module path matches nothing."""
    dims = {d: config_dim(config, attr, arch, d) for d, attr in arch.data["dims"].items()}
    n_layers = dims["layer"]
    candidates = all_site_names(arch, n_layers)
    every_site = candidates
    unavailable = unavailable or {}
    absent = _absent_sites(arch, available, unavailable, engine) if n_layers > 0 else set()
    left_out = [c for c in candidates if c[1] in unavailable]
    if available is not None:
        candidates = [c for c in candidates if (c[1], c[2]) in available]
    in_model = candidates
    candidates = [c for c in candidates if c[1] not in unavailable]
    skipped: dict[str, str] = {}
    canonical_names = sorted(arch.data["sites"])
    spec = hook.data
    store = spec.get("store", {})
    store_dtype = store.get("dtype", "native")

    chosen: dict[str, tuple[str, int | None, dict, tuple]] = {}
    chosen_by: dict[str, tuple[int, int]] = {}      # full name -> (entry, pattern) that chose it
    for i, entry in enumerate(spec.get("capture") or []):
        path = ("capture", i)
        layers = layers_of(entry, n_layers, hook, path)
        for j, pattern in enumerate(entry["sites"]):
            matched = match_sites(pattern, candidates)
            skipped.update((c[1], unavailable[c[1]]) for c in match_sites(pattern, left_out))
            dropped = sorted({c[1] for c in match_sites(pattern, every_site) if c[1] in absent},
                             key=list(arch.data["sites"]).index)
            if not matched:
                if _split_layer(pattern)[1] not in unavailable:
                    _check_site_in_model(pattern, arch, hook, path + ("sites", j), n_layers, in_model, engine)
                if dropped:
                    _check_site_in_model(dropped[0], arch, hook, path + ("sites", j), n_layers, in_model, engine)
                where = sorted({c[2] for c in candidates if c[2] is not None and c[1] == _split_layer(pattern)[1]})
                problem, fix = no_match(pattern, arch, canonical_names, n_layers, where, unavailable)
                raise hook.error(path + ("sites", j), problem, fix=fix)
            if layers is not None:
                model_level = sorted({m[1] for m in matched if m[2] is None})
                if model_level:
                    named = (f"site {model_level[0]!r} is" if model_level == [pattern]
                             else f"site pattern {pattern!r} matches model-level site(s) {model_level}, which are")
                    raise hook.error(path + ("layers",), f"{named} not per-layer: `layers` does not apply to "
                                     f"{'it' if model_level == [pattern] else 'them'}",
                                     fix=f"capture {', '.join(model_level)} in an entry without `layers`"
                                         + ("" if model_level == [pattern] else ", or narrow the pattern to per-layer "
                                            "sites"))
                matched = [m for m in matched if m[2] in layers]
                if not matched:
                    raise hook.error(path + ("layers",), f"site pattern {pattern!r} matches nothing in layers {layers}",
                                     fix="widen `layers` or pick a site that exists on those layers")
            for base in dropped:
                _warn_absent(base, pattern, arch, hook, path + ("sites", j), engine)
            for full, canonical, layer in matched:
                if full in chosen:
                    ci, cj = chosen_by[full]
                    by = f"sites[{cj}] of this entry" if ci == i else f"capture[{ci}]"
                    raise hook.error(path + ("sites", j), f"site {full!r} is already captured by {by}",
                                     fix="capture each site once, in one entry (narrow the glob or the layers)")
                chosen[full] = (canonical, layer, entry, path)
                chosen_by[full] = (i, j)
        if "max_keys" in entry and not any("key" in arch.data["sites"][c]["dims"]
                                           for c, _, e, _ in chosen.values() if e is entry):
            raise hook.error(path + ("max_keys",), "max_keys applies only to sites with a key dim (attn.pattern)",
                             fix="remove max_keys from this entry, or capture attn.pattern in it")
    # one store group stacks a site's layers along `layer`: they must keep the same rows
    entries_of: dict[str, set[int]] = {}
    for full, (canonical, _, _, path) in chosen.items():
        entries_of.setdefault(canonical, set()).add(path[1])
    for canonical, idx in entries_of.items():
        if len(idx) > 1:
            a, b = sorted(idx)[:2]
            raise hook.error(("capture", b, "sites"),
                             f"layers of site {canonical!r} are split across capture[{a}] and capture[{b}]",
                             fix=f"capture all layers of {canonical} in one entry (the store stacks them along `layer`)")

    sites: list[SitePlan] = []
    for full, (canonical, layer, entry, path) in sorted(chosen.items(), key=lambda kv: _order(kv[0], arch)):
        site = arch.data["sites"][canonical]
        sdims = tuple(site["dims"][1:])
        max_keys = entry.get("max_keys", DEFAULT_MAX_KEYS)
        shape = tuple(max_keys if d == "key" else dims[d] for d in sdims)
        heads = tuple(entry["heads"]) if "heads" in entry else None
        out_shape = list(shape)
        if heads is not None:
            head_dims = [k for k, d in enumerate(sdims) if d in ("head", "kv_head")]
            if not head_dims:
                raise hook.error(path + ("heads",), f"site {canonical!r} has no head dim", fix="remove `heads` from this entry")
            dup = sorted({h for h in heads if heads.count(h) > 1})
            if dup:
                raise hook.error(path + ("heads",), f"heads {dup} are listed more than once",
                                 fix="list each head once")
            bad = [h for h in heads if h >= shape[head_dims[0]]]
            if bad:
                raise hook.error(path + ("heads",), f"heads {bad} out of range: {canonical} has {shape[head_dims[0]]}",
                                 fix=f"use heads 0..{shape[head_dims[0]] - 1}")
            out_shape[head_dims[0]] = len(heads)
        tokens = entry.get("tokens")
        if isinstance(tokens, dict) and "positions" in tokens and tokens["positions"][1] <= tokens["positions"][0]:
            start, stop = tokens["positions"]
            raise hook.error(path + ("tokens", "positions"), f"empty window [{start}, {stop}): stop must be above start",
                             fix=f"write [start, stop) with stop > start, e.g. [{start}, {start + 1}]")
        reduce = entry.get("reduce")
        leaf = canonical.split(".")[-1]
        kind = site.get("dtype", "float")
        if reduce and kind == "int32":
            raise hook.error(path + ("reduce",), f"site {canonical!r} holds integers: it cannot be reduced",
                             fix=f"capture {canonical} without reduce")
        if reduce and "topk" in reduce:
            k = reduce["topk"]
            if k > out_shape[-1]:
                raise hook.error(path + ("reduce", "topk"), f"topk {k} exceeds the last dim ({sdims[-1]}={out_shape[-1]})",
                                 fix=f"use topk <= {out_shape[-1]}")
            rd = tuple(sdims[:-1]) + ("k",)
            rs = tuple(out_shape[:-1]) + (k,)
            outputs = (Output("topk_values", rd, rs, "float"), Output("topk_indices", rd, rs, "int32"))
        elif reduce and reduce.get("norm"):
            outputs = (Output("norm", tuple(sdims[:-1]), tuple(out_shape[:-1]), "float"),)
        else:
            outputs = (Output(leaf, sdims, tuple(out_shape), kind),)
        group = ("layers/" if layer is not None else "") + canonical.replace(".", "/")
        sites.append(SitePlan(index=len(sites), name=full, canonical=canonical, layer=layer, group=group,
                              dims=sdims, shape=shape, anchor=site.get("hf", {}),
                              tokens=TokenFilter.parse(tokens), outputs=outputs,
                              reduce=reduce, heads=heads, priority=entry.get("priority", 0)))

    policy = _policy(hook)
    plan = Plan(family=arch.data["family"], sites=sites, policy=policy, layers=n_layers, store_dtype=store_dtype,
                chunk_bytes=parse_bytes(store.get("chunk_bytes", 4 << 20)), compression=store.get("compression", "lz4"),
                max_bytes=parse_bytes(store["max_bytes"]) if "max_bytes" in store else None,
                bytes_per_s=parse_bytes(store["bytes_per_s"]) if "bytes_per_s" in store else None,
                writer=store.get("writer", "auto"), threads=store.get("threads"), writers=store.get("writers"),
                storage_options=store.get("storage_options"), arch_file=arch.file,
                hook_file=hook.file, hook_spec=_stored_spec(spec),
                engine=EngineOptions.from_spec(hook.data.get("engine")), unavailable=skipped)
    if "writers" in store and plan.writer not in ("pool", "auto"):
        raise hook.error(("store", "writers"), "store.writers is the number of store.writer pool's processes",
                         fix="set store.writer: pool, or remove store.writers")
    if policy.drain == "process":      # the child that drains the ring writes the store too
        if store.get("writer") in ("thread", "pool"):
            raise hook.error(("store", "writer"), f"store.writer: {store['writer']} cannot go with policy.drain: process (the "
                             "child process that drains the ring writes the store)",
                             fix="remove store.writer or set it to process")
        plan.writer = "process"
    check_policy_fits(plan, model_dtype_itemsize, hook)
    _check_max_bytes(plan, model_dtype_itemsize, hook)
    return plan


def _stored_spec(spec: dict) -> dict:
    """The hook spec as the store's attributes keep it: store.storage_options' credentials masked."""
    store = spec.get("store")
    if not isinstance(store, dict) or "storage_options" not in store:
        return spec
    from .store.location import redact
    return {**spec, "store": {**store, "storage_options": redact(store["storage_options"])}}


def chunk_rows(plan: Plan, sites: list[SitePlan], float_itemsize: int) -> int:
    """Rows per chunk of a store group: about store.chunk_bytes (floats stored ``float_itemsize``
    bytes each), at least 16."""
    return int(max(16, min(65536, plan.chunk_bytes // max(_group_row_bytes(sites, float_itemsize), 1))))


def _group_row_bytes(sites: list[SitePlan], float_itemsize: int) -> int:
    return sum(o.row_elems * o.itemsize(float_itemsize) for o in sites[0].outputs) * len(sites)


def _check_max_bytes(plan: Plan, model_itemsize: int, hook: Document) -> None:
    """A store.max_bytes under one chunk of some group fills the store before that chunk is
    written: refused at load, not as a store failure mid-run."""
    cap = plan.max_bytes
    if cap is None:
        return
    itemsize = model_itemsize if plan.store_dtype == "native" else {"bfloat16": 2, "float16": 2}.get(plan.store_dtype, 4)
    groups: dict[str, list[SitePlan]] = {}
    for s in plan.sites:
        groups.setdefault(s.group, []).append(s)
    sizes = {g: chunk_rows(plan, sites, itemsize) * _group_row_bytes(sites, itemsize) for g, sites in groups.items()}
    if not sizes:
        return
    group, need = max(sizes.items(), key=lambda kv: kv[1])
    if cap < need:
        rows = chunk_rows(plan, groups[group], itemsize)
        raise hook.error(("store", "max_bytes"),
                         f"store.max_bytes {cap:,} bytes is smaller than one chunk of group {group} ({need:,} bytes: "
                         f"{rows} rows of {need // rows:,} bytes, before compression): the store would be full "
                         f"before that chunk is written",
                         fix=f"raise store.max_bytes to at least {_size(need)}, or lower store.chunk_bytes (a chunk "
                             f"holds about that many bytes, at least 16 rows)")


def _order(full: str, arch: Document) -> tuple:
    # model order: embed, layer sites (layer, then spec order), final sites
    names = list(arch.data["sites"])
    parts = full.split(".")
    if parts[0] == "layers":
        return (1, int(parts[1]), names.index(".".join(parts[2:])))
    return (0 if names.index(full) < 1 else 2, 0, names.index(full))


def _split_layer(pattern: str) -> tuple[str | None, str]:
    """'layers.3.attn.q' -> ('3', 'attn.q'); 'attn.q' -> (None, 'attn.q')."""
    if pattern.startswith("layers.") and pattern.count(".") >= 2:
        _, layer, base = pattern.split(".", 2)
        return layer, base
    return None, pattern


def _check_site_in_model(pattern: str, arch: Document, hook: Document, hook_path: tuple, n_layers: int,
                         candidates: list[tuple[str, str, int | None]], engine: str = "hf") -> None:
    """A pattern that names a site of the architecture spec which this model does not have at all:
    a model without layers (for a per-layer site), or a module path of the spec that matches no
    module of the model. Either is the model's or the architecture spec's fault, not the hook spec's."""
    from .errors import SpecError
    layer, base = _split_layer(pattern)
    site = arch.data["sites"].get(base)
    if site is None:
        return
    asked = f"(asked for by {hook.file}"
    line = hook.line_of(hook_path)
    asked += f":{line}" if line is not None else ""
    asked += f" {format_path(hook_path)})"
    if site.get("per_layer") and n_layers < 1:
        attr = arch.data["dims"].get("layer", "num_hidden_layers")
        raise arch.error(("dims", "layer"), f"site {base!r} is per-layer but the model config has {attr}={n_layers}: "
                         f"the model has no layer to capture {asked}",
                         fix=f"load a model with at least one layer, or capture model-level sites only "
                             f"({', '.join(sorted(n for n, s in arch.data['sites'].items() if not s.get('per_layer')))})")
    module = (site.get(engine) or {}).get("module")
    if module is None or any(c[1] == base for c in candidates):
        return
    raise SpecError(f"site {base!r} is in the spec but its module path {module!r} matches nothing in this model "
                    f"{asked}", file=arch.file, key=format_path(("sites", base, engine, "module")),
                    line=arch.line_of(("sites", base, engine)),
                    fix=f"correct the module path of {base} in {arch.file} to this model's module names "
                        f"(print(model) lists them), or pass the architecture spec of this model's family")


def _absent_sites(arch: Document, available: set | None, unavailable: dict, engine: str) -> set[str]:
    """Sites of the spec whose module path matches nothing on any layer of the model."""
    if available is None:
        return set()
    present = {c for c, _ in available}
    return {c for c, site in arch.data["sites"].items()
            if c not in present and c not in unavailable and (site.get(engine) or {}).get("module")}


def _warn_absent(base: str, pattern: str, arch: Document, hook: Document, hook_path: tuple, engine: str) -> None:
    """A glob matched a site of the spec whose module path this model lacks on every layer: it is
    left out, with a warning naming the path (a typo in it would otherwise drop the site unseen;
    a family's sites that some models lack on every layer, such as mlp.act of an all-MoE model,
    are left out the same way)."""
    import warnings
    module = arch.data["sites"][base][engine]["module"]
    line = arch.line_of(("sites", base, engine))
    asked = f"{hook.file}:{hook.line_of(hook_path)}" if hook.line_of(hook_path) is not None else hook.file
    warnings.warn(f"{arch.file}:{line}: sites.{base}.{engine}.module: site {base!r} is in the spec but its module path "
                  f"{module!r} matches nothing in this model, so {pattern!r} ({asked} {format_path(hook_path)}) "
                  f"leaves it out. Fix: if the model should have it, correct the module path to this model's module "
                  f"names (print(model) lists them)", stacklevel=3)


def no_match(pattern: str, arch: Document, canonical: list[str], n_layers: int, where: list[int],
              unavailable: dict[str, str]) -> tuple[str, str]:
    """(problem, fix) for a site pattern that matched nothing."""
    layer, base = _split_layer(pattern)
    known = base in canonical
    if base in unavailable:
        return (f"site {base!r} cannot be captured in this engine: {unavailable[base]}",
                f"drop {base!r} from `sites` (or capture it with another engine or backend)")
    if known and layer is not None and not arch.data["sites"][base].get("per_layer"):
        return (f"site pattern {pattern!r} matches nothing: {base!r} is a model-level site, not a per-layer one",
                f"write {base!r} without 'layers.{layer}.'")
    if known and layer is not None and where and str(layer).isdigit() and int(layer) < n_layers:
        return (f"site {base!r} does not exist on layer {layer} of this model (only on layers {where})",
                f"capture {base} on layers {where} (e.g. layers.{where[0]}.{base}), or {base!r} for all of them")
    if known and layer is not None:
        return (f"site pattern {pattern!r} matches no layer of this model (it has {n_layers} layers: 0..{n_layers - 1})",
                f"use layers.<0..{n_layers - 1}>.{base}, or {base!r} for every layer")
    problem = (f"site pattern {pattern!r} matches no site of this model" if known
               else f"site pattern {pattern!r} matches no site of family {arch.data['family']!r}")
    close = [c for c in difflib.get_close_matches(base, canonical, n=4, cutoff=0.5) if c != base][:3]
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    return problem, f"{hint}sites of this family ({arch.file}): {', '.join(canonical)}"


_BYTE_BUDGETS = ("ring_bytes", "host_bytes", "d2h_bytes_per_s")


def _policy(hook: Document) -> Policy:
    p = hook.data.get("policy", {})
    out = Policy()
    out.mode = p.get("mode", out.mode)
    for key in _BYTE_BUDGETS:
        if key in p:
            try:
                setattr(out, key, parse_bytes(p[key]))
            except ValueError as e:
                raise hook.error(("policy", key), str(e), fix="write a size such as 64MiB") from None
    out.meta_records = p.get("meta_records", out.meta_records)
    out.max_step_tokens = p.get("max_step_tokens")
    out.drain = p.get("drain", out.drain)
    out.stall_timeout_s = float(p.get("stall_timeout_s", out.stall_timeout_s))
    # a failed store write follows the mode unless said: full stops the model, best_effort drops
    out.on_store_error = p.get("on_store_error", "drop" if out.mode == "best_effort" else "raise")
    return out


def _policy_error(plan: Plan, hook: Document | None, key: str, problem: str, fix: str) -> PolicyError:
    """A PolicyError located at ``policy.<key>`` of the hook spec (its line when the document is at hand)."""
    if hook is not None:
        path = ("policy", key) if key in hook.data.get("policy", {}) else ("policy",)
        line = hook.line_of(path) if "policy" in hook.data else None
        return PolicyError(problem, file=hook.file, key=f"policy.{key}", line=line, fix=fix)
    return PolicyError(problem, file=plan.hook_file or None, key=f"policy.{key}", fix=fix)


def _size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{math.ceil(n / scale)}{unit}"
    return f"{n}B"


def check_policy_fits(plan: Plan, itemsize: int, hook: Document | None = None, tokens: int | None = None) -> None:
    """Refuse a policy that cannot be met: a budget of zero bytes, one step (of max_step_tokens
    tokens, else of one token) that cannot go through the ring, or the meta ring. Host staging
    has no minimum: a larger step is copied to pageable host memory instead."""
    n = tokens or plan.policy.max_step_tokens or 1
    _check_nonzero(plan, hook)
    _check_step_fits(plan, itemsize, hook, n, "ring_bytes", "ring")
    _check_meta(plan, hook)
    _check_d2h(plan, itemsize, hook, n)


def _check_d2h(plan: Plan, itemsize: int, hook: Document | None, n: int) -> None:
    """Under ``full`` every step waits for the D2H cap's bucket to refill its bytes: a cap under
    which one step of ``n`` tokens takes longer than ``policy.stall_timeout_s`` would hold the
    model that long at every step (``best_effort`` drops instead of waiting)."""
    rate = plan.policy.d2h_bytes_per_s
    if plan.policy.mode != "full" or not rate or rate < 1:
        return
    need = plan.reserved_bytes(n, itemsize)
    seconds = need / rate
    bound = plan.policy.stall_timeout_s
    if seconds > bound:
        floor = math.ceil(need / bound)
        raise _policy_error(plan, hook, "d2h_bytes_per_s",
                            f"under full one step of {n} token(s) over {len(plan.sites)} site(s) reserves {need:,} bytes: "
                            f"at policy.d2h_bytes_per_s {rate:,} bytes/s every step would wait {seconds:,.0f} s for "
                            f"the cap, more than policy.stall_timeout_s ({bound:g} s)",
                            f"raise policy.d2h_bytes_per_s to at least {floor:,} ({_size(floor)}), capture fewer sites, "
                            f"or use policy.mode: best_effort (drops what the cap does not let through)")


def physical_memory() -> int | None:
    """Total RAM of this host in bytes (None where the OS does not say)."""
    import os
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(plan: Plan, device: Any, hook: Document | None = None) -> None:
    """Refuse, before anything is allocated, a ring larger than the memory it lives in: the
    device's free memory on a GPU (``torch.cuda.mem_get_info``), this host's RAM on the CPU; and
    host staging (``policy.host_bytes``, host memory) larger than this host's RAM."""
    import torch
    device = torch.device(device) if device is not None else torch.device("cpu")
    ram = physical_memory()
    budgets = [("host_bytes", plan.policy.host_bytes, ram, "this host's RAM")]
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budgets.insert(0, ("ring_bytes", plan.policy.ring_bytes, free,
                           f"free memory on {device} ({_size(total)} in all)"))
    else:
        budgets.insert(0, ("ring_bytes", plan.policy.ring_bytes, ram, "this host's RAM"))
    for key, want, have, where in budgets:
        if have is not None and want > have:
            raise _policy_error(plan, hook, key, f"policy.{key} is {want:,} bytes ({_size(want)}) but {where} is "
                                f"{have:,} bytes ({_size(have)})",
                                f"lower policy.{key} below {_size(have)} (the default is "
                                f"{_size(getattr(Policy(), key))})")


def _check_nonzero(plan: Plan, hook: Document | None) -> None:
    # '0MiB' or '0.1B' pass the schema's size pattern but parse to 0 bytes
    what = {"ring_bytes": "no step could ever be reserved", "host_bytes": "no step could ever be staged",
            "d2h_bytes_per_s": "nothing could ever be copied to the host"}
    for key in _BYTE_BUDGETS:
        value = getattr(plan.policy, key)
        if value is not None and value < 1:
            fix = ("remove policy.d2h_bytes_per_s to copy uncapped, or give a rate such as 2GiB"
                   if key == "d2h_bytes_per_s" else "give a size such as 64MiB")
            unit = "bytes/s" if key == "d2h_bytes_per_s" else "bytes"
            raise _policy_error(plan, hook, key, f"policy.{key} is {value} {unit}: {what[key]}", fix)


def _check_step_fits(plan: Plan, itemsize: int, hook: Document | None, n: int, key: str, what: str) -> None:
    """Under ``full`` one capture of ``n`` tokens must fit ``policy.<key>`` (a larger step streams
    through the ring capture by capture); under ``best_effort``, which drops rather than waits, one
    whole step must."""
    have = getattr(plan.policy, key)
    if plan.policy.mode == "full":
        site = max(plan.sites, key=lambda s: s.row_bytes(itemsize), default=None)
        need = plan.reserved_bytes(n, itemsize, [site]) if site is not None else 0
        if need > have:
            raise _policy_error(plan, hook, key, f"one capture of {n} token(s) of {site.name} needs {need:,} bytes "
                                f"of {what} but policy.{key} is {have:,}",
                                f"raise policy.{key} to at least {need:,} ({_size(need)}), or lower "
                                f"policy.max_step_tokens")
        return
    need = plan.reserved_bytes(n, itemsize)
    if need > have:
        msg = (f"one step of {n} token(s) over {len(plan.sites)} site(s) needs {need:,} bytes of {what} but "
               f"policy.{key} is {have:,}")
        fix = (f"raise policy.{key} to at least {need:,} ({_size(need)}), "
               f"capture fewer sites, or lower policy.max_step_tokens")
        raise _policy_error(plan, hook, key, msg, fix)


def _check_meta(plan: Plan, hook: Document | None) -> None:
    per_step_records = len(plan.sites) + 1
    if per_step_records > plan.policy.meta_records:
        raise _policy_error(plan, hook, "meta_records",
                            f"one step publishes {per_step_records} meta records ({len(plan.sites)} sites + 1) but "
                            f"policy.meta_records is {plan.policy.meta_records}",
                            f"raise policy.meta_records to at least {per_step_records}, or capture fewer sites")
