"""Which canonical sites tensor parallelism shards across ranks, and how (:class:`TPLayout`,
derived from a site's canonical dims: :mod:`dmi.store.shards`), with the checks against vLLM's
loaded modules and parallel config that refuse what dmi cannot merge.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import DmiError


SPLIT_DIMS = ("head", "kv_head", "mlp")       # canonical dims vLLM's parallel linears split


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
        from ...plan import config_dim
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
            for a, b in index_runs([j for j, _ in self.stored_positions(site, r)]):
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


def index_runs(idx: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs [a, b) of sorted-by-position integers (in the given order)."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
