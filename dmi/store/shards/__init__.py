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

from ..layout import COORDS
from .merge import commit, finalize, rank_notes, wait_closed
from .merged_store import chunk_key, create_store, site_groups
from .rank_exporter import ShardedExporter, TPContext
from .rank_writer import ShardWriter
from .sharding import SPLIT_DIMS, SiteSharding, TPLayout, anchor_kind, check_parallel, index_runs, input_kind

__all__ = ["COORDS", "SPLIT_DIMS", "SiteSharding", "TPLayout", "anchor_kind", "input_kind", "check_parallel",
           "index_runs", "site_groups", "create_store", "chunk_key", "ShardWriter", "rank_notes", "commit",
           "finalize", "wait_closed", "TPContext", "ShardedExporter"]
