"""Tensor parallelism: which canonical sites are sharded across ranks, and one store for all ranks.

Under tensor parallelism (vLLM ``tensor_parallel_size=N``) every rank runs the whole forward on
the same token batch, but holds a slice of some tensors. For the canonical sites of the four
families (vLLM 0.25 - 0.32 model source) the sharding follows from a site's canonical dims:

=========================  ==========================================================================
dim in the site            sharding
=========================  ==========================================================================
``head``                   split: rank r holds query heads ``[r*H/N, (r+1)*H/N)`` (``QKVParallelLinear``
                           q part; ``attn.q``, ``attn.pattern``, ``attn.z`` = ``o_proj``'s input)
``kv_head``                split: rank r holds kv heads ``[r*K/N, (r+1)*K/N)``; when ``K < N`` vLLM
                           replicates them: rank r holds kv head ``r // (N/K)``, and only the first
                           rank of each replica set writes (``attn.k``, ``attn.k_rot``, ``attn.v``)
``mlp``                    split, column parallel: rank r holds columns ``[r*M/N, (r+1)*M/N)``
                           (``MergedColumnParallelLinear`` gate/up, so ``mlp.act`` = down_proj's input)
otherwise                  replicated: written once, by rank 0 (residual stream, ``embed``,
                           ``attn.out`` and ``mlp.out`` — after the all-reduce inside
                           ``RowParallelLinear`` / ``FusedMoE`` (``reduce_results=True``) —, norms,
                           router logits and top-k (a replicated gate), ``logits`` (``LogitsProcessor``
                           gathers the vocab shards: all-gather on CPU/CUDA, gather to rank 0 elsewhere))
=========================  ==========================================================================

Partial sums: the output of a row-parallel layer *before* its all-reduce (``RowParallelLinear``
or ``FusedMoE`` built with ``reduce_results=False``) is neither a shard nor the value: each rank
holds an addend of the whole ``[token, hidden]`` tensor. No canonical site of the shipped specs is
anchored there; :func:`anchor_kind` detects such an anchor on the loaded vLLM module and
:meth:`TPLayout.verify_anchors` refuses it (capture after the all-reduce instead).

The store: every split site's arrays are chunked along the split dim at the shard boundaries
(chunk = the rank's slice, or a divisor of it), so rank r's region is a set of whole chunks no
other rank touches: ranks write their chunk files concurrently (temp file + ``os.replace``, as the
exporter does) without locks and without waiting on each other. Rank 0 creates the layout once
(:func:`create_store`); no rank but rank 0 ever writes an array's ``zarr.json``: each rank notes
the rows it has on disk in its own ``tp/rank<r>`` group and rank 0 grows the extents over the rows
every writer has on disk (:func:`commit`, :func:`finalize`), so a killed run leaves a store that
opens. Rows line up across ranks because every rank sees the same batch and the same token
filters: a step's rows start at the same offset on every rank.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DmiError, StoreError
from .chunks import ArrayFile, storage_dtype, write_atomic
from .location import is_remote
from .exporter import DROP_CHUNK, DROP_COLUMNS, ZarrExporter
from .preflight import check_writable, create_atomically, jsonable, writer_info
from .rows import PHASE_NAMES, copy_rows


SPLIT_DIMS = ("head", "kv_head", "mlp")       # canonical dims vLLM's parallel linears split
COORDS = ("request", "position", "step", "phase", "token_id")


# --- which sites are sharded, and how -----------------------------------------------------------
@dataclass(frozen=True)
class SiteSharding:
    """How one canonical site is laid out across ``world`` ranks."""
    canonical: str
    kind: str                        # 'split' | 'replicated'
    dim: str | None = None           # the split canonical dim ('head', 'kv_head', 'mlp')
    axis: int | None = None          # its index in the site's dims (after `token`)
    size: int = 0                    # unsharded size of that dim
    local: int = 0                   # per-rank size (vLLM's num_heads / num_kv_heads / mlp // N)
    replicas: int = 1                # ranks holding the same slice (kv heads when kv_head < N)
    world: int = 1

    def engine_slice(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the unsharded dim held by ``rank`` in the engine."""
        if self.kind != "split":
            raise ValueError(f"{self.canonical} is {self.kind}, not split")
        start = (rank // self.replicas) * self.local
        return start, start + self.local

    def holders(self) -> tuple[int, ...]:
        """Ranks that write this site: the first of each replica set (rank 0 for replicated sites)."""
        if self.kind == "replicated":
            return (0,)
        return tuple(r for r in range(self.world) if r % self.replicas == 0)

    def describe(self) -> dict:
        if self.kind == "replicated":
            return {"kind": "replicated", "writer": 0}
        return {"kind": "split", "dim": self.dim, "size": self.size, "per_rank": self.local,
                "replicas": self.replicas,
                "ranks": {str(r): list(self.engine_slice(r)) for r in range(self.world)}}


def _split(canonical: str, dims: tuple[str, ...], sizes: dict[str, int], world: int) -> SiteSharding:
    split = [k for k, d in enumerate(dims) if d in SPLIT_DIMS]
    if not split:
        return SiteSharding(canonical, "replicated", world=world)
    axis = split[0]
    dim = dims[axis]
    n = sizes[dim]
    if dim == "kv_head" and n < world:                  # vLLM QKVParallelLinear: num_kv_head_replicas
        if world % n:
            raise DmiError(f"tensor parallel size {world} is not a multiple of {n} kv heads: vLLM refuses this "
                           f"engine too. Fix: choose tensor_parallel_size dividing or divided by {n}")
        return SiteSharding(canonical, "split", dim, axis, n, 1, world // n, world)
    if n % world:
        raise DmiError(f"{canonical}: {dim}={n} is not divisible by tensor parallel size {world} (vLLM splits "
                       f"it evenly). Fix: choose a tensor_parallel_size that divides {n}")
    return SiteSharding(canonical, "split", dim, axis, n, n // world, 1, world)


@dataclass
class TPLayout:
    """Per canonical site, its sharding across ``world`` ranks (derived from the arch spec's dims)."""
    world: int
    sites: dict[str, SiteSharding]
    dims: dict[str, int] = field(default_factory=dict)

    @classmethod
    def derive(cls, arch, config: Any, world: int) -> "TPLayout":
        """From the architecture spec (a :class:`dmi.spec.Document`) and the model config.
        Split dims: those vLLM's parallel linears shard (``SPLIT_DIMS``)."""
        from ..plan import config_dim
        data = arch.data
        if world < 1:
            raise DmiError(f"tensor parallel size must be >= 1, got {world}")
        dims = {d: config_dim(config, attr, arch, d) for d, attr in data["dims"].items()}
        sites = {c: _split(c, tuple(s["dims"][1:]), dims, world) for c, s in data["sites"].items()}
        return cls(world, sites, dims)

    def of(self, canonical: str) -> SiteSharding:
        return self.sites[canonical]

    def describe(self) -> dict:
        """The ``tp`` root attribute of a merged store."""
        split = {s.dim: {"size": s.size, "per_rank": s.local, "replicas": s.replicas}
                 for s in self.sites.values() if s.kind == "split"}
        return {"world_size": self.world, "sharded_dims": split,
                "sites": {c: s.describe() for c, s in self.sites.items()},
                "rank_notes": "split sites: rank r holds sites[site].ranks[r] of the split dim in the engine "
                              "and wrote the stored index runs in its array's tp.rank[r] (whole chunks); "
                              "replicated sites: written once, by rank 0; token coordinates: by the group's "
                              "tp.coord_rank; per-rank accounting in the attributes of the groups tp/rank<r>"}

    # --- a plan under this layout ----------------------------------------------------------------
    def check_plan(self, plan) -> None:
        """Refuse what a rank cannot compute from its shard: a reduction over the split dim."""
        for s in plan.sites:
            sh = self.sites[s.canonical]
            if sh.kind == "split" and s.reduce and sh.axis == len(s.dims) - 1:
                what = "topk" if "topk" in s.reduce else "norm"
                raise DmiError(f"{s.name}: reduce {what} runs over {sh.dim}, which tensor parallelism splits across "
                               f"{self.world} ranks (each rank holds {sh.local} of {sh.size}): a per-rank {what} is "
                               f"not the {what} of the whole row. Fix: capture {s.canonical} without reduce, or with "
                               f"tensor_parallel_size=1")

    def stored_positions(self, site, rank: int) -> list[tuple[int, int]]:
        """(stored index, engine-local index) along the split axis of the heads/columns ``rank``
        writes for ``site`` (a :class:`dmi.plan.SitePlan`), in stored order. Empty: not a writer."""
        sh = self.sites[site.canonical]
        if sh.kind != "split":
            return []
        if rank not in sh.holders():
            return []
        lo, hi = sh.engine_slice(rank)
        if site.heads is None or sh.dim == "mlp":
            return [(i, i - lo) for i in range(lo, hi)]
        return [(j, h - lo) for j, h in enumerate(site.heads) if lo <= h < hi]

    def writes(self, site, rank: int) -> bool:
        sh = self.sites[site.canonical]
        return rank == 0 if sh.kind == "replicated" else bool(self.stored_positions(site, rank))

    def coord_rank(self, site) -> int:
        """The rank that writes a group's token coordinates (its lowest writer)."""
        return min(r for r in range(self.world) if self.writes(site, r))

    def split_chunk(self, site) -> int | None:
        """Chunk length along the split axis: every rank's runs start and end on chunk boundaries."""
        sh = self.sites[site.canonical]
        if sh.kind != "split":
            return None
        stored = len(site.heads) if site.heads is not None and sh.dim != "mlp" else sh.size
        bounds = [stored]
        for r in range(self.world):
            for a, b in _runs([j for j, _ in self.stored_positions(site, r)]):
                bounds += [a, b]
        return math.gcd(*bounds)

    def local_plan(self, plan, rank: int):
        """The plan one rank captures: split sites with this rank's shape (engine-local head
        indices for head selection), sites the rank does not write removed, dense indices again.
        Each site keeps its ``group``, the store group the writer maps it to."""
        sites = []
        for s in plan.sites:
            sh = self.sites[s.canonical]
            if not self.writes(s, rank):
                continue
            if sh.kind == "split":
                pos = self.stored_positions(s, rank)
                shape = tuple(sh.local if k == sh.axis else n for k, n in enumerate(s.shape))
                heads = tuple(li for _, li in pos) if s.heads is not None and sh.dim != "mlp" else None
                outs = tuple(replace(o, shape=tuple(len(pos) if k == sh.axis else n for k, n in enumerate(o.shape)))
                             for o in s.outputs)
                s = replace(s, shape=shape, heads=heads, outputs=outs)
            sites.append(replace(s, index=len(sites)))
        return replace(plan, sites=sites)

    def verify_anchors(self, model, plan, resolve) -> None:
        """Cross-check the derived shardings against the loaded vLLM modules: refuse an anchor whose
        tensor is a partial sum (or a shard the spec's dims do not say). ``resolve(model,
        module_pattern, layer)``: the adapter's resolver (``dmi.adapters.vllm.patch.resolve``)."""
        for s in plan.sites:
            a = s.anchor
            obj = resolve(model, a["module"], s.layer)
            if obj is None or a.get("method"):
                continue
            sh = self.sites[s.canonical]
            kind = anchor_kind(obj) if "output" in a else None
            if kind is None and "input" in a and sh.kind == "replicated":
                kind = input_kind(obj)
            if kind is None:
                continue
            where = "output" if "output" in a else "input"
            raise DmiError(f"{s.name}: its vLLM anchor is the {where} of {type(obj).__name__} "
                           f"({a['module'].format(i=s.layer)}), which under tensor parallelism is {kind}; the spec's "
                           f"dims say {sh.kind}. Fix: anchor the site after the all-reduce (the parent module's "
                           f"output), or capture with tensor_parallel_size=1")


def anchor_kind(module) -> str | None:
    """What a vLLM module's *output* holds per rank when that differs from the full value:
    a partial sum for row-parallel layers / fused MoE that skip their all-reduce, a column shard
    for column-parallel layers that do not gather, a vocab shard for the LM head. None: the full
    value (or not a parallel layer). Duck-typed on vLLM's class names and attributes (0.25 - 0.32:
    ``RowParallelLinear.reduce_results``; FusedMoE ``reduce_results`` (0.25) or
    ``moe_config.skip_final_all_reduce`` (0.32))."""
    if module is None:
        return None
    names = {c.__name__ for c in type(module).__mro__}
    tp = getattr(module, "tp_size", None)
    moe = getattr(module, "moe_config", None)
    if getattr(moe, "skip_final_all_reduce", False) or (
            names & {"FusedMoE"} and getattr(module, "reduce_results", True) is False and (tp or 1) > 1):
        return "a partial sum (each rank's addend, before the all-reduce)"
    if (tp or 1) <= 1:
        return None
    if names & {"RowParallelLinear"} and getattr(module, "reduce_results", True) is False:
        return "a partial sum (each rank's addend, before the all-reduce)"
    if names & {"ColumnParallelLinear"} and getattr(module, "gather_output", True) is False:
        return "a column shard"
    if names & {"ParallelLMHead"}:
        return "a vocab shard"
    return None


def input_kind(module) -> str | None:
    """What a vLLM module's *input* holds per rank: 'a feature shard' for a row-parallel layer
    whose input is parallel (``o_proj``'s input = this rank's heads of ``attn.z``, ``down_proj``'s
    = its columns of ``mlp.act``), else None."""
    names = {c.__name__ for c in type(module).__mro__} if module is not None else set()
    if names & {"RowParallelLinear"} and (getattr(module, "tp_size", 1) or 1) > 1 \
            and getattr(module, "input_is_parallel", True):
        return "a feature shard"
    return None


def check_parallel(parallel_config, compilation_config=None) -> int:
    """The tensor parallel size of an engine whose ranks dmi can merge (vLLM ``ParallelConfig``,
    ``CompilationConfig``); refuses the rest, naming each reason."""
    g = lambda k, d=1: getattr(parallel_config, k, d) or d       # noqa: E731
    problems = []
    if g("pipeline_parallel_size") > 1:
        problems.append(f"pipeline_parallel_size={g('pipeline_parallel_size')} (each stage holds other layers)")
    if g("data_parallel_size") > 1:
        problems.append(f"data_parallel_size={g('data_parallel_size')} (replicas serve other requests)")
    if g("decode_context_parallel_size") > 1:
        problems.append("decode_context_parallel_size > 1 (keys split along tokens)")
    if getattr(parallel_config, "use_sequence_parallel_moe", False):
        problems.append("sequence-parallel MoE (router logits per token chunk)")
    if getattr(parallel_config, "enable_expert_parallel", False):
        problems.append("expert parallel (not verified)")
    passes = getattr(compilation_config, "pass_config", None)
    if getattr(passes, "enable_sequence_parallelism", False) or getattr(passes, "enable_sp", False):
        problems.append("the sequence-parallelism compile pass (the residual stream becomes token shards "
                        "between the reduce-scatter and the all-gather)")
    if problems:
        raise DmiError("dmi merges tensor parallel ranks only; this engine uses " + "; ".join(problems) +
                       ". Fix: capture with tensor parallelism alone")
    return g("tensor_parallel_size")


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs [a, b) of sorted-by-position integers (in the given order)."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


# --- the store -----------------------------------------------------------------------------------
def _groups(plan) -> dict[str, list]:
    groups: dict[str, list] = {}
    for s in plan.sites:
        groups.setdefault(s.group, []).append(s)
    return groups


def _token_chunk(plan, layout: TPLayout, sites: list, chunk_rows: int | None, float_itemsize: int) -> int:
    """Rows per chunk: ``plan.chunk_bytes`` over the bytes of one rank's part of a row (what a rank
    buffers for its open chunk; its chunk files split that along the split dim)."""
    if chunk_rows:
        return int(chunk_rows)
    first = sites[0]
    sh = layout.sites[first.canonical]
    split = max(len(layout.stored_positions(first, r)) for r in range(layout.world)) if sh.kind == "split" else 1
    part = 0                               # bytes of one rank's part of a row
    for o in first.outputs:
        n = o.row_elems * o.itemsize(float_itemsize)
        if sh.kind == "split":
            n = n // o.shape[sh.axis] * split
        part += n
    row_bytes = part * len(sites)
    return int(max(16, min(65536, plan.chunk_bytes // max(row_bytes, 1))))


def create_store(path, plan, layout: TPLayout, capture_dtype: str, attrs: dict, *, overwrite: bool = False,
                 chunk_rows: int | None = None):
    """Rank 0, once, before any rank writes: the merged store's layout — the same groups, arrays,
    dimension names, coordinates and ``drops`` group as :class:`dmi.store.exporter.ZarrExporter` makes for
    the unsharded ``plan``, split arrays chunked at shard boundaries, the ``tp`` layout in the root
    and array attributes, and one ``tp/rank<r>`` group per rank (its notes: only that rank writes
    them). Token extents start at 0 and only :func:`commit` grows them. Returns the root group."""
    import zarr
    layout.check_plan(plan)
    path = check_writable(path, overwrite)
    # built beside the path and renamed into place: a rank 0 killed meanwhile leaves no half store
    create_atomically(path, overwrite, lambda stage: _lay_out(stage, plan, layout, capture_dtype, attrs, chunk_rows))
    return zarr.open_group(str(path), mode="r+", use_consolidated=False)


def _lay_out(path, plan, layout: TPLayout, capture_dtype: str, attrs: dict, chunk_rows: int | None):
    """create_store's layout, in its staging directory."""
    import zarr
    root = zarr.open_group(str(path), mode="w", zarr_format=3)
    root.attrs.update(jsonable(attrs) | {"dmi_status": "open", "tp": layout.describe()})
    float_dtype = storage_dtype(plan, capture_dtype)
    compressors = _compressors(plan)
    for name, sites in _groups(plan).items():
        first = sites[0]
        per_layer = first.layer is not None
        sh = layout.sites[first.canonical]
        rows = _token_chunk(plan, layout, sites, chunk_rows, float_dtype.itemsize)
        grp = root.require_group(name)
        lead, nl = (("token", "layer"), (len(sites),)) if per_layer else (("token",), ())
        coords = list(COORDS) + (["layer"] if per_layer else []) + (["head"] if first.heads else [])
        ranks = {str(r): _runs([j for j, _ in layout.stored_positions(first, r)]) for r in range(layout.world)}
        for o in first.outputs:
            dtype = float_dtype if o.kind == "float" else np.dtype(o.kind)
            chunks = list(o.shape)
            note: dict = {"kind": sh.kind, "writer": 0}
            if sh.kind == "split":
                chunks[sh.axis] = layout.split_chunk(first)
                note = {"kind": "split", "dim": sh.dim, "axis": len(lead) + sh.axis, "chunk": chunks[sh.axis],
                        "rank": {r: [list(x) for x in v] for r, v in ranks.items() if v}}
            arr = grp.create_array(o.name, shape=(0, *nl, *o.shape), chunks=(rows, *nl, *chunks),
                                   dtype=dtype, dimension_names=[*lead, *o.dims], compressors=compressors,
                                   fill_value=-1 if o.kind == "int32" else np.nan)
            arr.attrs.update({"coordinates": " ".join(coords), "site": first.canonical,
                              "description": f"{first.canonical} {o.name}", "tp": note})
        for c, dt in zip(COORDS, (str, "int64", "int64", str, "int64")):
            grp.create_array(c, shape=(0,), chunks=(rows,), dtype=dt, dimension_names=["token"])
        if per_layer:
            grp.create_array("layer", shape=(len(sites),), dtype="int32", dimension_names=["layer"])[:] = \
                np.array([s.layer for s in sites], np.int32)
        if first.heads:
            grp.create_array("head", shape=(len(first.heads),), dtype="int32", dimension_names=["head"])[:] = \
                np.array(first.heads, np.int32)
        grp.attrs.update({"site": first.canonical, "sites": [s.name for s in sites],
                          "tokens": dataclasses.asdict(first.tokens), "reduce": first.reduce or {},
                          "tp": {"coord_rank": layout.coord_rank(first), **sh.describe()}})
    drops = root.require_group("drops")
    for name, dt in DROP_COLUMNS.items():
        drops.create_array(name, shape=(0,), chunks=(DROP_CHUNK,), dtype=dt, dimension_names=["drop"])
    drops.attrs["description"] = "dropped captures; under tensor parallelism each rank's are in tp/rank<r>"
    tp = root.require_group("tp")
    for r in range(layout.world):
        tp.require_group(f"rank{r}").attrs.update({"rank": r, "status": "open", "rows": {}})
    return root


def _compressors(plan):
    from zarr.codecs import BloscCodec
    return {"none": None, "zstd": "auto",
            "lz4": BloscCodec(cname="lz4", clevel=1, shuffle="shuffle")}[plan.compression]


def chunk_key(meta: dict, coords: tuple[int, ...]) -> str:
    """A chunk's key under the array's chunk_key_encoding (zarr v3 default or v2)."""
    enc = meta["chunk_key_encoding"]
    default = enc["name"] == "default"
    sep = enc.get("configuration", {}).get("separator", "/" if default else ".")
    return ("c" + sep if default else "") + sep.join(map(str, coords))


@dataclass
class _Group:
    name: str
    files: dict                                   # array name -> dmi.store.exporter.ArrayFile (codecs, fill)
    buf: dict                                     # array name -> the open token chunk, this rank's part
    runs: list[tuple[int, int, int]]              # split axis: (stored start, stored stop, buffer start)
    axis: int | None                              # split axis in the stored array ([token, (layer,) ...])
    coords: bool                                  # this rank writes the token coordinates
    chunk_rows: int
    rows: int = 0                                 # rows written or buffered
    chunk: int = 0                                # index of the open token chunk
    fill: int = 0                                 # rows in the open chunk
    on_disk: int = 0                              # rows whose chunk files are on disk, from row 0


class ShardWriter:
    """One rank's writer into the merged store that :func:`create_store` laid out.

    ``write(group, start, blocks, coords)``: this rank's part of a step's rows of one group —
    ``blocks[output]`` shaped ``[n, (layer,), *dims]`` where the split dim holds only this rank's
    heads/columns in stored order (what its :meth:`TPLayout.local_plan` captures); ``coords`` the
    token coordinates, only on the group's coordinate rank (:meth:`writes_coords`). Rows fill an
    open token chunk; a full chunk is encoded as zarr-python would store it
    (:class:`dmi.store.exporter.ArrayFile`) and written as whole chunk files — temp file + ``os.replace``
    — of this rank's region only. No rank touches an array's ``zarr.json``: :func:`commit` (rank 0)
    grows the extents over rows every writer has on disk (``checkpoint`` records them)."""

    def __init__(self, path, plan, layout: TPLayout, rank: int):
        self.path, self.layout, self.rank = Path(path), layout, rank
        self.groups: dict[str, _Group] = {}
        self.chunks_written: dict[str, set[tuple[int, ...]]] = {}
        for name, sites in _groups(plan).items():
            first = sites[0]
            if not layout.writes(first, rank):
                continue
            sh = layout.sites[first.canonical]
            lead = 2 if first.layer is not None else 1
            runs, axis, k = [], None, 0
            if sh.kind == "split":
                axis = lead + sh.axis
                for a, b in _runs([j for j, _ in layout.stored_positions(first, rank)]):
                    runs.append((a, b, k))
                    k += b - a
            coords = layout.coord_rank(first) == rank
            names = [o.name for o in first.outputs] + (list(COORDS) if coords else [])
            files = {n: ArrayFile(self.path, f"{name}/{n}") for n in names}
            rows = files[names[0]].chunks[0]
            buf = {}
            for n, f in files.items():
                shape = list(f.meta["shape"][1:])
                if axis is not None and n not in COORDS:
                    shape[axis - 1] = k                  # this rank's heads/columns only
                buf[n] = np.full((rows, *shape), f.fill, f.dtype)
            self.groups[name] = _Group(name, files, buf, runs, axis, coords, rows)

    def owns(self, group: str) -> bool:
        return group in self.groups

    def writes_coords(self, group: str) -> bool:
        """Whether this rank writes ``group``'s token coordinates (pass ``coords`` to ``write``)."""
        g = self.groups.get(group)
        return g is not None and g.coords

    def write(self, group: str, start: int, blocks: dict[str, np.ndarray], coords: dict | None = None) -> None:
        g = self.groups.get(group)
        if g is None:
            raise StoreError(f"rank {self.rank} writes no part of {group!r} (replicated sites: rank 0; split "
                             f"sites: the ranks holding selected heads). Fix: plan with TPLayout.local_plan")
        if start != g.rows:
            raise StoreError(f"rank {self.rank}, {group}: rows must follow each other (got start {start}, "
                             f"expected {g.rows}): every rank must write every selected row of every step, "
                             f"dropped ones as NaN, or the ranks' rows stop lining up")
        cols = dict(blocks)
        if g.coords:
            if coords is None:
                raise StoreError(f"rank {self.rank} writes the token coordinates of {group!r}: pass coords")
            cols.update({c: coords[c] for c in COORDS})
        n = len(next(iter(blocks.values())))
        done = 0
        while done < n:
            k = min(n - done, g.chunk_rows - g.fill)
            for name, v in cols.items():
                g.buf[name][g.fill:g.fill + k] = v[done:done + k]
            g.fill, g.rows, done = g.fill + k, g.rows + k, done + k
            if g.fill == g.chunk_rows:
                self._write_chunk(g)
                g.chunk, g.fill, g.on_disk = g.chunk + 1, 0, g.rows
                for name, f in g.files.items():
                    g.buf[name][...] = f.fill

    def _write_chunk(self, g: _Group) -> None:
        """Chunk files of the open token chunk (padded with the fill value): this rank's only."""
        for name, f in g.files.items():
            data = g.buf[name]
            seen = self.chunks_written.setdefault(f"{g.name}/{name}", set())
            if g.axis is None or name in COORDS:
                parts = [((g.chunk,) + (0,) * (data.ndim - 1), data)]
            else:
                c = f.chunks[g.axis]
                parts = []
                for a, b, off in g.runs:
                    for j in range(a // c, b // c):
                        lo = off + j * c - a
                        idx = (slice(None),) * g.axis + (slice(lo, lo + c),)
                        key = [0] * data.ndim
                        key[0], key[g.axis] = g.chunk, j
                        parts.append((tuple(key), data[idx]))
            for key, block in parts:
                path = f.dir / chunk_key(f.meta, key)
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, bytes(memoryview(f.encode(np.ascontiguousarray(block)))))
                seen.add(key)

    def checkpoint(self, notes: dict | None = None) -> dict:
        """Write every open chunk as it is, then note the rows on disk per group in ``tp/rank<r>``
        (call between steps: a commit then covers whole steps of every group)."""
        for g in self.groups.values():
            if g.fill:
                self._write_chunk(g)
            g.on_disk = g.rows
        return self._note({"rows": {g.name: g.on_disk for g in self.groups.values()}, **(notes or {})})

    def close(self, notes: dict | None = None) -> dict:
        """The last checkpoint; the note says ``closed`` with ``notes`` (e.g. this rank's drops)."""
        return self.checkpoint({"status": "closed",
                                "chunks_written": {k: len(v) for k, v in self.chunks_written.items()},
                                **(notes or {})})

    def _note(self, fields: dict) -> dict:
        meta_path = self.path / "tp" / f"rank{self.rank}" / "zarr.json"
        meta = json.loads(meta_path.read_text())
        meta.setdefault("attributes", {}).update(jsonable(fields))
        write_atomic(meta_path, json.dumps(meta, indent=2).encode())
        return meta["attributes"]


def rank_notes(path) -> list[dict]:
    """Every rank's notes (``tp/rank<r>`` attributes), read from their files."""
    path = Path(path)
    world = json.loads((path / "zarr.json").read_text())["attributes"]["tp"]["world_size"]
    return [json.loads((path / "tp" / f"rank{r}" / "zarr.json").read_text())["attributes"] for r in range(world)]


def commit(path) -> dict[str, int]:
    """Rank 0, at any time (e.g. the exporter's commit clock): each group's arrays get the rows
    every rank writing the group has on disk (the minimum of their notes), so a reader — or a store
    left by a killed run — only ever sees rows all ranks wrote. Only rank 0 writes ``zarr.json``
    of the arrays. Returns rows per group."""
    path = Path(path)
    notes = rank_notes(path)
    rows: dict[str, int] = {}
    for note in notes:
        for g, n in note.get("rows", {}).items():
            rows[g] = min(rows.get(g, n), n)
    for g, n in rows.items():
        for child in sorted((path / g).iterdir()):
            meta = child / "zarr.json"
            if not meta.exists():
                continue
            m = json.loads(meta.read_text())
            if m.get("node_type") == "array" and (m.get("dimension_names") or [None])[0] == "token" \
                    and m["shape"][0] != n:
                ArrayFile(path, f"{g}/{child.name}").set_rows(n)
    return rows


def finalize(path, summary: dict | None = None, clean: bool = True) -> dict[str, int]:
    """Rank 0, after every rank closed its writer: the last :func:`commit`, the run summary and
    ``dmi_status`` in the root, consolidated metadata. The ranks writing a group must agree on its
    rows and every rank must have closed; otherwise the store is marked failed and this raises."""
    import zarr
    notes = rank_notes(path)
    seen: dict[str, int] = {}
    mismatch: dict[str, dict] = {}
    for r, note in enumerate(notes):
        for g, n in note.get("rows", {}).items():
            if seen.setdefault(g, n) != n:
                mismatch.setdefault(g, {})[str(r)] = n
    open_ranks = [r for r, note in enumerate(notes) if note.get("status") != "closed"]
    rows = commit(path)
    ok = clean and not mismatch and not open_ranks
    root = zarr.open_group(str(path), mode="r+")
    extra = {"tp_errors": {"rows": mismatch, "open_ranks": open_ranks}} if mismatch or open_ranks else {}
    root.attrs.update(jsonable(summary or {}) | {"dmi_status": "closed" if ok else "failed"} | extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))
    if mismatch or open_ranks:
        raise StoreError(f"{path}: ranks disagree on the rows of {mismatch} / did not close: {open_ranks}; the store "
                         f"is marked failed")
    return rows


# --- the exporter of one rank (dmi.run.Run(..., tp=TPContext)) ------------------------------------
@dataclass
class TPContext:
    """What a rank's :class:`dmi.run.Run` needs to write its part of the merged store."""
    plan: Any                        # the unsharded plan: the store's layout (the Run gets the rank's local plan)
    layout: TPLayout
    rank: int
    barrier: Any                     # () -> None over every rank (vLLM: the TP group's CPU group)
    close_timeout_s: float = 300.0   # rank 0 waits this long for the other ranks' writers to close


def wait_closed(path, timeout_s: float, poll_s: float = 0.05) -> list[int]:
    """Rank 0 at close: wait until every rank's notes say ``closed`` (or ``failed``); returns the
    ranks still open after ``timeout_s`` (:func:`finalize` then marks the store failed). A file
    poll, not a collective: close runs from ``LLM.collective_rpc``, engine shutdown or process
    exit, and a rank that never closes must not hang the others."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            still = [r for r, n in enumerate(rank_notes(path)) if n.get("status") not in ("closed", "failed")]
        except (OSError, ValueError):      # a note being replaced: read again
            still = [-1]
        if not still or time.monotonic() > deadline:
            return still
        time.sleep(poll_s)


class ShardedExporter(ZarrExporter):
    """:class:`dmi.store.exporter.ZarrExporter` for one tensor parallel rank: ``plan`` is the rank's local
    plan (:meth:`TPLayout.local_plan`), ``tp.plan`` the store's. Rank 0 lays the store out
    (:func:`create_store`), every rank waits at ``tp.barrier``, then writes its rows through a
    :class:`ShardWriter` (chunk files of its own region, synchronously on the exporter thread). The
    commit clock checkpoints the writer (rows on disk noted in ``tp/rank<r>``); rank 0 also
    :func:`commit`\\ s (extents = the minimum over the ranks). Close: every rank closes its writer;
    rank 0 waits for the others' notes (:func:`wait_closed`) and :func:`finalize`\\ s.

    Row alignment: a group's rows of a step are the rows the control selected after the keep filter
    (as the exporter stores them); a group none of whose layers has a record this step writes
    ``len(slot.sel)`` NaN rows when the ring dropped them (best_effort), and nothing when the engine
    did not compute them (deterministic, the same on every rank). Drops are noted per rank in
    ``tp/rank<r>`` (the merged ``drops`` table stays empty)."""

    def __init__(self, path, plan, capture_dtype: str, attrs: dict, overwrite: bool = False, resume: bool = False,
                 *, tp: TPContext):
        if resume:
            raise DmiError("dmi: resume=True is not supported with tensor parallelism (each rank's open chunk would "
                           "have to be reloaded). Fix: capture into a new store")
        if is_remote(path):
            raise StoreError(f"store {str(path)!r}: tensor parallelism writes its merged store in a local directory "
                             f"only (its ranks meet in the store's files). Fix: capture into a local path (a shared "
                             f"file system mounted on every rank's host) and copy the store to the object store")
        self.tp = tp
        self.writer: ShardWriter | None = None
        self.rank_drops: list = []
        super().__init__(path, plan, capture_dtype, attrs, overwrite=overwrite)

    # --- layout -----------------------------------------------------------------------------------
    def _create(self, path, attrs: dict, overwrite: bool) -> None:
        tp = self.tp
        self.path = Path(path)
        if tp.rank == 0:
            try:
                self.root = create_store(path, tp.plan, tp.layout, self.capture_dtype,
                                         dict(attrs) | {"dmi_writer": writer_info()}, overwrite=overwrite)
            except BaseException:
                tp.barrier()           # the other ranks wait there: let them go (they fail reading the store)
                raise
        tp.barrier()
        self.writer = ShardWriter(self.path, tp.plan, tp.layout, tp.rank)

    # --- writing ------------------------------------------------------------------------------------
    def _label(self) -> str:
        return f"{self.path}: rank {self.tp.rank}"

    def _write_rows(self, ctrl, records, request_ids, ring_drops, entry) -> None:
        """Each rank writes its rows straight to its shard (ShardWriter), and a group the ring
        dropped on this rank gets NaN rows, so every rank holds the same rows of the step."""
        dropped = {d.site for d in ring_drops[self._ring_pos:] if d.step == ctrl.step}
        self._take_ring_drops(ring_drops, ctrl.step, entry)
        seen = set()
        for g, sel, n, got in self._rows(ctrl, records, entry):
            seen.add(g.name)
            self._ingest(g, ctrl, sel, n, got, request_ids, entry)
        for g in self.groups.values():
            if g.name in seen or not any(s.index in dropped for s in g.sites):
                continue
            slot = next((ctrl.slots[s.index] for s in g.sites if s.index in ctrl.slots), None)
            if slot is not None and len(slot.sel):      # dropped by the ring: NaN rows keep ranks aligned
                self._ingest(g, ctrl, slot.sel, len(slot.sel), [None] * len(g.sites), request_ids, entry)

    def _ingest(self, g, ctrl, sel, n: int, got, request_ids, entry) -> None:
        tokens = ctrl.tokens
        req = tokens.request[sel]
        ids = np.asarray(request_ids[: int(req.max()) + 1], dtype=object)
        coords = {"request": ids[req], "position": tokens.position[sel], "step": np.full(n, ctrl.step, np.int64),
                  "phase": PHASE_NAMES[tokens.phase[sel]], "token_id": tokens.token_ids(sel)}
        outputs = g.sites[0].outputs
        per_layer = g.per_layer
        blocks = {}
        for o in outputs:
            dt = self._stored(o.kind)
            shape = (n, len(g.sites), *o.shape) if per_layer else (n, *o.shape)
            blocks[o.name] = np.full(shape, -1 if o.kind == "int32" else np.nan, dt)
        for li, arrays in self._records(g, n, got, entry):    # dropped / not computed: rows stay NaN / -1
            for o in outputs:
                copy_rows(blocks[o.name][:, li] if per_layer else blocks[o.name], arrays[o.name])
        entry.reqs[g.name] = req
        w = self.writer
        w.write(g.name, w.groups[g.name].rows, blocks, coords if w.writes_coords(g.name) else None)
        g.rows += n

    def _append_drops(self, drops) -> None:
        self.rank_drops.extend(drops)           # noted in tp/rank<r> at close

    # --- commit -------------------------------------------------------------------------------------
    def checkpoint(self, wait_all: bool = False) -> None:
        self._last_commit = time.monotonic()
        if self.error is not None:
            self._on_failure()
            return
        try:
            self.writer.checkpoint()
            if self.tp.rank == 0:
                commit(self.path)
        except OSError as e:
            with self._lock:
                if self.error is None:
                    self.error = StoreError(f"{self._label()}: checkpoint failed: {e}")
            self._on_failure()
            return
        last = None
        while self._log:
            last = self._log.popleft()
            self._fold(last)
        if last is not None:
            self.committed_step = last.step

    def finish(self, ring_drops=()) -> None:
        if self._finished:
            return
        self._finished = True
        self._take_ring_drops(ring_drops, None, None)
        if self.error is None:
            self.checkpoint()
        if self.error is not None:
            self._on_failure()

    def close(self, summary: dict, clean: bool = True) -> None:
        try:
            self.finish()
        except StoreError:
            clean = False
        self._shutdown(wait=True)
        names = [s.name for s in self.plan.sites]
        notes = {"rows_stored": summary.get("rows_stored"), "rows_dropped": summary.get("rows_dropped"),
                 "sites": names, "store_error": None if self.error is None else str(self.error),
                 "drops": [{"step": d.step, "site": names[d.site], "requests": self.request_names(d), "rows": d.rows,
                            "reason": d.reason}
                           for d in self.rank_drops + self.drops]}
        if self.error is None:
            self.writer.close(notes)
        else:                                   # its rows on disk stay as checkpointed
            self.writer._note(notes | {"status": "failed"})
            clean = False
        if self.tp.rank != 0:
            return
        still = wait_closed(self.path, self.tp.close_timeout_s)
        rows = commit(self.path)
        marker = {"step": self.committed_step, "next_step": summary.get("steps", self.committed_step + 1),
                  "rows": rows}
        finalize(self.path, dict(summary) | {"dmi_committed": marker, "tp_ranks_not_closed": still or None,
                                             "store_error": None if self.error is None else str(self.error)},
                 clean=clean and not still)
