"""A site captured as traced torch ops: what compiled code runs instead of the ``dmi::capture`` op.

``dmi::capture`` is opaque to inductor: the kernel computing a site's tensor ends before it (a
residual add is cut off from the RMSNorm it would be fused with), the capture kernel runs after
it, and outside a CUDA graph both are host launches (vLLM's steps above its largest graph). Traced
instead, the capture is a scatter of the site's rows into the payload ring at destinations read
from the ring's control block (``ring.index_put_``): inductor folds it into the kernel that
computes the rows, so a capture adds no kernel, launch or dispatch (``tests/test_kernels_interpret.py`` compares the stores).

The destinations follow the same control words the capture kernel reads (``dmi.kernels.capture``):
row ``i`` of the tensor in token-major order is step row ``i``; its place in the site's block is
``i`` itself where the selection is every row (``enabled`` 2), else the selection's inverse map
(``inv_start``: per step row, its place or -1). Rows not captured (not selected, padding, a
disarmed or dropped capture) go to scratch rows past the ring's end (row ``i`` to scratch row
``i % scratch_rows``: a prefill's thousands of skipped rows do not all store to one address).

The ops never write a record: the end-marker kernel publishes the records of a step's traced
sites (their row count is the host's reservation: only sites holding every step row are traced,
see :meth:`dmi.kernels.traced_sites.TracedSites.traced_site`), before its fence.

Two ways in: code traced with the ring's :class:`TracedSite` calls :func:`capture` (the hook spec's
``engine.traced: all``: every compiled forward), or a post-grad compile pass turns the ``dmi::capture`` ops of one compiled
graph into the same scatter (:func:`rewrite_captures`, ``engine.traced: range``: vLLM's steps above its
largest CUDA graph, where graph replays keep the op).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from dataclasses import dataclass

import torch

from ..errors import PolicyError
from . import words as K


@dataclass(frozen=True)
class TracedSite:
    """What a compiled forward needs to capture one site as torch ops."""
    ring_key: int              # the KernelRing's key in _RINGS (told at trace time that traced code exists)
    ctrl: torch.Tensor         # the ring's control block (int64, on the device)
    payload: torch.Tensor      # the payload ring as the site's dtype, scratch row included
    row_elems: int
    scratch: int               # element index of the first scratch row
    scratch_rows: int
    dtype: torch.dtype
    layout: tuple


def token_rows(x: torch.Tensor, layout: tuple, row_elems: int) -> torch.Tensor:
    """x as [rows, row_elems] in token-major order (row b*seq+s)."""
    if layout[0] != "token":
        bi, si = layout.index("batch"), layout.index("seq")
        x = x.permute(bi, si, *[i for i in range(x.ndim) if i not in (bi, si)])
    return x.reshape(-1, row_elems)


_RINGS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def scratch_at(payload_elems: int, itemsize: int, row_bytes: int) -> tuple[int, int]:
    """(element index of the first scratch row, how many scratch rows) of a payload view of
    ``payload_elems`` elements, the ring with its ``SCRATCH_BYTES`` of scratch past the end, for
    rows of ``row_bytes``."""
    return payload_elems - K.SCRATCH_BYTES // itemsize, K.SCRATCH_BYTES // row_bytes


def register(ring) -> int:
    """A key for ``ring`` that traced code can pass as a constant."""
    key = next(_KEYS)
    _RINGS[key] = ring
    return key


@torch.compiler.assume_constant_result
def _compiling_for(ring_key: int) -> bool:
    """Tell the ring that a compiled forward captures as traced ops: called once, while Dynamo
    traces (not when the graph runs), so the step being traced already has its records published."""
    ring = _RINGS.get(ring_key)
    if ring is not None:
        ring.traced_steps = True
    return True


def capture(t: TracedSite, x: torch.Tensor, ticket: torch.Tensor, site_id: "torch.Tensor | int") -> None:
    """Scatter the step's selected rows of ``x`` into the payload ring (traced: no op, no launch).
    ``ticket`` is read only to follow the step's begin (``dmi.siteop``'s module doc); ``site_id``
    (the site's index: a tensor where layers compile alike, an int in a whole-model graph) locates
    its control words."""
    _compiling_for(t.ring_key)
    scatter(token_rows(x, t.layout, t.row_elems), t.ctrl, t.payload, ticket, site_id, t.scratch, t.scratch_rows)


def scatter(rows: torch.Tensor, ctrl: torch.Tensor, payload: torch.Tensor, ticket: torch.Tensor,
            site_id: "torch.Tensor | int", scratch: int, scratch_rows: int) -> None:
    """The traced capture of ``rows`` (``[step rows, row_elems]``, token-major) into ``payload`` (the
    ring as the site's dtype) at the places the control block ``ctrl`` gives them."""
    row_elems = rows.shape[1]
    rows = rows.to(payload.dtype)
    w = ctrl.shape[0]
    # every word is read at an index that depends on the ticket: no read of the control block can
    # be scheduled before the step's begin, which may write it in the same graph (eager forwards)
    z = ticket[:1] * 0                   # (a 1-element index: a 0-dim one would be read as an int)
    g = ctrl[z + torch.arange(K.G_WORDS, device=ctrl.device)]
    hdr = z + K.G_WORDS + K.S_WORDS * site_id
    i = torch.arange(rows.shape[0], device=rows.device)
    count, enabled = ctrl[hdr + K.S_ROWS], ctrl[hdr + K.S_ENABLED]
    listed = ctrl[(ctrl[hdr + K.S_INV] + i).clamp(0, w - 1)]
    place = torch.where(enabled == K.ENABLED_ARANGE, torch.where(i < count, i, -1), listed)
    ok = (g[K.G_ARMED] != 0) & (enabled != 0) & (place >= 0) & (place < count) & (i < g[K.G_BATCH] * g[K.G_SEQ])
    first = (g[K.G_BASE] + ctrl[hdr + K.S_OFFSET]) // rows.element_size()
    dst = torch.where(ok, first + place * row_elems, scratch + (i % scratch_rows) * row_elems)
    payload.index_put_((dst[:, None] + torch.arange(row_elems, device=rows.device),), rows)


def rewrite_captures(graph: torch.fx.Graph) -> int:
    """A post-grad graph pass: each ``dmi::capture`` / ``dmi::capture_sum`` that carries its ring's
    views (``ring=[ctrl, payload]`` and ``token_dims``: :attr:`dmi.siteop.SiteHandle.views`) becomes
    the traced scatter of :func:`scatter`, which inductor then fuses into the kernel computing the
    rows. An engine that compiles a graph per token range runs it on some ranges only (vLLM: steps
    above its largest CUDA graph, where the op costs a host call per site and step;
    ``dmi.adapters.vllm.compat.install_graph_pass``); the ring's traced word must be set in
    exactly those steps (``KernelRing.traced_above``), so that the end kernel publishes the
    rewritten sites' records. Returns how many captures it rewrote.

    The graph is functional (a capture is ``auto_functionalized``, v1 or v2): the scatter, traced
    with ``make_fx`` under the graph's fake mode and inductor's decompositions, is inlined before
    the capture; it writes the payload in place (a graph input), and the ticket the op mutated is
    handed on unchanged."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from .side import capture_nodes, sources as read_by

    done = 0
    for node in capture_nodes(graph):
        if not node.kwargs.get("ring"):
            continue
        kw = node.kwargs
        ticket = kw["ticket"] if node.target is auto_functionalized else kw["_all_bases"][kw["_ticket_base_index"]]
        ctrl, payload = kw["ring"]
        site_id = kw["site_id"]
        sources = read_by(node)
        x = sources[0].meta["val"]
        pay = payload.meta["val"]
        row_elems = int(math.prod(x.shape[kw.get("token_dims", 1):]))
        scratch, scratch_rows = scratch_at(pay.numel(), pay.dtype.itemsize, row_elems * pay.dtype.itemsize)
        site = kw["site"] if site_id is None else None          # (a site named as a constant of the graph)

        def traced(ctrl_t, payload_t, ticket_t, *rest):
            site_t, xs = (site, rest) if site is not None else (rest[0], rest[1:])
            rows = (xs[0] if len(xs) == 1 else xs[0] + xs[1]).reshape(-1, row_elems)
            scatter(rows, ctrl_t, payload_t, ticket_t, site_t, scratch, scratch_rows)

        inputs = [ctrl, payload, ticket, *([site_id] if site_id is not None else []), *sources]
        vals = [n.meta["val"] for n in inputs]
        with detect_fake_mode(vals) or contextlib.nullcontext():
            sub = make_fx(traced, decomposition_table=select_decomp_table())(*vals)   # (inductor's own)
        env = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], inputs))
        with graph.inserting_before(node):
            for n in sub.graph.nodes:
                if n.op not in ("placeholder", "output"):
                    env[n] = graph.node_copy(n, lambda a: env[a])
        for user in list(node.users):          # getitem(node, k): the ticket after the op, i.e. the ticket
            user.replace_all_uses_with(ticket)
            graph.erase_node(user)
        graph.erase_node(node)
        done += 1
    if done:      # a ticket no capture mutates any more is copied onto itself: drop those copies
        for node in list(graph.nodes):
            if node.target is torch.ops.aten.copy_.default and node.args[0] is node.args[1]:
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
    return done


TRACE_MODES = ("0", "1", "range")    # where compiled code captures as traced ops (engine.traced; KernelRing)


def trace_mode(traced: str | None) -> str:
    """``traced`` (None: ``0``), refused unless one of TRACE_MODES (dmi.settings.TRACED: the hook
    spec's ``engine.traced`` words for them)."""
    mode = traced if traced is not None else "0"
    if mode not in TRACE_MODES:
        raise PolicyError(f"traced={mode!r} is not one of {', '.join(TRACE_MODES)}", key="engine.traced",
                          fix="set the hook spec's engine.traced to off (the site op), all (traced in every compiled "
                              "forward) or range (traced where an engine's compile pass rewrites the op)")
    return mode
