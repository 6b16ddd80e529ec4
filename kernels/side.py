"""Capture kernels off a CUDA graph's critical path: a compile pass that moves each site op's kernel
onto a side stream, joined back where nothing can have overwritten what it reads.

Inside a captured graph a capture kernel is a few µs in series with the model's kernels (37 of them
are +0.11 ms of a 5.3 ms Qwen3-8B decode step). On a side stream, forked from the current one
where the site's tensor is ready, it runs beside the model's next kernels. Three hazards decide
the shape:

* inductor reuses a buffer's storage right after its last use, and the op looks like that last
  use though its kernel reads later; a later buffer in the same storage would race the read. So
  the op's lowering (:func:`_register_lowerings`) names a chained capture's input buffers in
  ``never_reuse_buffers`` (their storage is never reused within the graph), and the ring holds
  the tensors until the join (the caching allocator cannot hand them out either). Extending their
  lives with more inputs would not do: inductor may hand an extern op a private copy of a
  tensor (its own buffer, written by the same fused kernel).
* a reinplaced mutation (a mutable op whose input is dead after it) could write a captured tensor
  in place before the join. So each capture takes the previous capture's tensors as ``after``
  (inputs it does not read): the graph uses them up to the next capture, which makes the stream
  wait for the previous one before launching its own, and reinplacing leaves them alone.
* every fork must rejoin the stream that captures the graph before its capture ends; a
  piecewise-compiled model is captured one piece at a time. So the pass ends each compiled graph
  with ``dmi::join`` (the last capture's tensors as ``after``), threaded onto the ticket the last
  capture handed on: the stream waits there for the last capture.

:func:`chain_captures` marks the ops ``side=1`` and adds those inputs and the join; at run time the
ring forks only while a CUDA graph is being captured and the engine turned it on
(``KernelRing.side_streams``): elsewhere a marked op launches inline and the join is a no-op.

Where the engines chain captures is the hook spec's ``engine.side``: ``full`` (the default: in full
CUDA graphs, the whole forward: vLLM's uniform decode steps, transformers' compiled generate),
``all`` (in every CUDA graph, vLLM's piecewise ones too) or ``off`` (on the model's stream);
``plan.engine.side`` holds it as ``full``, ``1`` or ``0``.
"""
from __future__ import annotations

import operator

import torch



CAPTURE_SOURCES = {"capture": ("x",), "capture_sum": ("x", "y")}     # each op's tensors a capture reads


_PASS: list = []


def chain_pass():
    """:func:`chain_captures` as inductor's ``post_grad_custom_post_pass`` (a ``CustomGraphPass``:
    inductor's FX graph cache keys on this module's source)."""
    if not _PASS:
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

        class ChainCaptures(CustomGraphPass):
            def __call__(self, graph) -> None:
                chain_captures(graph)

            def uuid(self):
                return get_hash_for_files((__file__,))

        _PASS.append(ChainCaptures())
    return _PASS[0]


def capture_nodes(graph: torch.fx.Graph) -> list:
    """The ``dmi::capture`` / ``dmi::capture_sum`` calls of a post-grad graph, in graph order: the
    ``auto_functionalized`` (v1 or v2) nodes that carry them (the graph is functional)."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2
    ops = {getattr(torch.ops.dmi, name).default for name in CAPTURE_SOURCES}
    return [n for n in graph.nodes if n.op == "call_function" and n.target in (auto_functionalized, auto_functionalized_v2)
            and n.args[0] in ops]


def sources(node) -> list:
    """The tensors (graph nodes) the capture ``node`` reads."""
    return [node.kwargs[k] for k in CAPTURE_SOURCES[node.args[0]._opname]]


def chain_captures(graph: torch.fx.Graph) -> int:
    """A post-grad graph pass: mark every capture of ``graph`` ``side=1``, give each the previous
    one's tensors as ``after``, and end the graph with a ``dmi::join`` that keeps the last
    capture's tensors to itself. Returns how many captures it marked (0: none, or no ticket handed
    on after the last one, and then nothing changed)."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized
    nodes = capture_nodes(graph)
    if not nodes or not _register_lowerings():
        return 0
    last = nodes[-1]
    handed = [u for u in last.users if u.op == "call_function" and u.target is operator.getitem]
    if len(handed) != 1:
        return 0
    ticket = handed[0]                # the ticket after the last capture
    later = list(ticket.users)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_use = min(later, key=order.__getitem__) if later else graph.output_node()
    kwargs = {"run": last.kwargs["run"], "after": sources(last)}
    if last.target is auto_functionalized:
        kwargs["ticket"] = ticket
    else:
        kwargs.update(_ticket_base_index=0, _all_bases=[ticket])
    with graph.inserting_before(first_use):
        join = graph.call_function(last.target, (torch.ops.dmi.join.default,), kwargs)
        join.meta["val"] = _fresh(last.meta["val"])
        handed_on = graph.call_function(operator.getitem, (join, ticket.args[1]))
        handed_on.meta["val"] = join.meta["val"][ticket.args[1]]
    for user in later:
        user.replace_input_with(ticket, handed_on)
    previous = None
    for node in nodes:
        if previous is not None:
            _set_kwarg(node, "after", list(node.kwargs.get("after") or []) + sources(previous))
        _set_kwarg(node, "side", 1)
        previous = node
    return len(nodes)


def _fresh(vals):
    """New example values shaped as ``vals`` (a functional op's outputs are new tensors: the
    join's must not share the ticket's storage, or reinplacing sees the ticket still in use
    after the join and copies it instead of handing it on)."""
    def like(v):
        if not isinstance(v, torch.Tensor):
            return v
        with v.fake_mode:
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    return tuple(like(v) for v in vals)


def _set_kwarg(node, key: str, value) -> None:
    """Set one of the op's arguments on its ``auto_functionalized`` node, and in the example values
    Dynamo recorded for it (``eager_input_vals``: inductor's decomposition of the node traces
    with them, and an argument whose structure changed, None to a list, must change there too)."""
    node.update_kwarg(key, value)
    vals = node.meta.get("eager_input_vals")
    if vals is not None:
        node.meta["eager_input_vals"] = (vals[0], {**vals[1], key: torch.fx.map_arg(value, lambda n: n.meta["val"])})


_LOWERED: list = []          # [True] once this process registered the lowerings, [False] if it could not


def _register_lowerings() -> bool:
    """Inductor lowerings of the capture ops: the fallback inductor would make for them (their
    layout constraint included), and for a chained capture (``side=1``) the names of the buffers
    it reads added to the graph's ``never_reuse_buffers``. False (nothing chained) where this
    torch's inductor lacks what it takes."""
    if _LOWERED:
        return _LOWERED[0]
    try:
        from torch._inductor import lowering
        from torch._inductor.virtualized import V
        from torch._library.utils import get_layout_constraint_tag
        for name in CAPTURE_SOURCES:
            op = getattr(torch.ops.dmi, name).default
            plain = lowering.fallback_handler(op)        # (what inductor makes for it by default, wrapped)

            def lower(*args, _op=op, _plain=plain, **kwargs):
                ops_before = len(V.graph.operations)
                out = _plain(*args, **kwargs)
                _, named = torch.fx.operator_schemas.normalize_function(
                    _op, args, kwargs, normalize_to_only_use_kwargs=True)
                if named.get("side"):
                    for made in V.graph.operations[ops_before:]:     # (the op's kernel, its inputs' copies)
                        for read in getattr(made, "inputs", ()):
                            if hasattr(read, "get_name"):
                                V.graph.never_reuse_buffers.add(read.get_name())
                return out

            lowering.add_needs_realized_inputs(op)
            lowering.add_layout_constraint(op, lowering.tag_to_layout_constraint(
                get_layout_constraint_tag(op, with_default=True)))
            lowering.register_lowering(op, type_promotion_kind=None)(lower)
        _LOWERED.append(True)
    except (ImportError, AttributeError, TypeError) as e:     # (another torch: leave the ops inline)
        import logging
        logging.getLogger("dmi").warning("dmi: captures stay on the graph's stream (inductor: %s)", e)
        _LOWERED.append(False)
    return _LOWERED[0]
