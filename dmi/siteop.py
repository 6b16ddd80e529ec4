"""The site ops: registered torch custom ops, opaque to torch.compile (no graph breaks).

``dmi::capture(x, ticket, run, site, site_id, after, ring, token_dims)`` copies the selected rows of
``x`` into the run's ring; ``dmi::capture_sum(x, y, ticket, ...)`` those of ``x + y`` (a site the engine
holds as two tensors: vLLM's residual stream), without the sum as an op of the graph: a compiled
graph would give it an elementwise kernel of its own, where the engine fuses that add into its next
norm. ``dmi::step_begin`` / ``dmi::step_end`` bracket one forward call (one engine step).

A site is named in one of two ways. Code compiled layer by layer (vLLM compiles a layer's piece
once and reuses it for every layer whose piece is the same graph up to its inputs, as weights are;
``layer.compile()``) passes ``site_id``, a tensor (the run's ``site_tensors``; the op finds the
site by its address), and ``site`` -1: an int is a constant of the graph, different in every
layer, and with ints every layer's piece would be its own compile (tests/test_compile.py pins the
reuse). Code that compiles the whole
model as one graph (generate()'s compiled forward, under :func:`constant_sites`) passes ``site``
and no tensor: there nothing is reused across layers, and every tensor input costs each call
host time (Dynamo's guards and prologue). There the HF adapter's patched modules call
:func:`site_at`, with the run and site written into their code, so that no handle is guarded
either (``dmi.adapters.hf.patch.constant_sites_class``).

All of them mutate ``ticket``, a one-element tensor per run: that orders them inside a compiled
graph (a capture never moves before its step's begin or after its end) and keeps them from being
dead-code eliminated. Per-step state (offsets, row selection, enable flags) is never an argument:
the op reads it from the run, so a compiled or graph-captured forward always sees fresh values.
On CUDA the ops launch kernels that read that state from small device tensors, so a CUDA graph
that captured them writes fresh slots on every replay; the host work of a step (token
bookkeeping, reservation, the H2D copy of the control tensors) happens in ``step_begin`` only in
eager forwards, and outside the graph otherwise (``Run.begin_step`` / ``Run.stepped``).

Compiled code captures a site the ring names traceable (:meth:`dmi.kernels.traced_sites.TracedSites.traced_site`)
as traced torch ops instead (:mod:`dmi.kernels.traced`): a scatter into the ring that inductor fuses
into the kernel computing the site's tensor, where the op would cut that kernel in two. Its order
against the step's ops is data flow: the scatter reads ``ticket`` (so it follows the begin, which
in eager forwards writes the control block it reads), and ``step_end`` reads the payload views the
scatters wrote (``after``; so the end kernel, which publishes their records, follows them).
On a ring whose ``trace_mode`` is ``range`` compiled code keeps the op, and the op carries what a
compile pass needs to rewrite it into those ops where an engine compiles a range of steps apart
(``ring``: the control block and payload view; ``token_dims``: the leading dims of ``x`` that are
its rows; :func:`dmi.kernels.traced.rewrite_captures`): the op's kernel ignores both.

Patched model code calls :func:`site`, which returns the tensor the model goes on with: the one it
was given, or, at a site interventions write (:mod:`dmi.interventions`), that tensor changed by
plain torch ops that read their values and row masks from device buffers.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .interventions.device import apply_literal
from .kernels.traced import capture as traced_capture

_RUNS: dict[int, object] = {}     # run id -> dmi.run.Run (the op's only state)


def register_run(run) -> int:
    run_id = max(_RUNS, default=0) + 1
    _RUNS[run_id] = run
    return run_id


def unregister_run(run_id: int) -> None:
    _RUNS.pop(run_id, None)


def run_of(run_id: int):
    """The open run with this id, or None."""
    return _RUNS.get(run_id)


# Defined through torch.library.Library, not torch.library.custom_op: the dispatcher then calls the
# Python kernel directly. custom_op's wrappers cost 6.9 µs a call under inference_mode (vLLM),
# 16.7 under no_grad and 31.9 with grad on a 2-core CPU machine, against 3.0 / 3.1 / 3.8 here; traced code
# that runs outside a CUDA graph (vLLM's mixed prefill steps, torch.compile without cudagraphs)
# pays it for every site of every step. ``Tensor(a!) ticket``: the mutation that orders the ops.
_LIB = torch.library.Library("dmi", "DEF")
_LIB.define("capture(Tensor x, Tensor(a!) ticket, int run, int site, Tensor? site_id, Tensor[]? after=None, "
            "Tensor[]? ring=None, int token_dims=1, int side=0) -> ()")
_LIB.define("capture_sum(Tensor x, Tensor y, Tensor(a!) ticket, int run, int site, Tensor? site_id, "
            "Tensor[]? after=None, Tensor[]? ring=None, int token_dims=1, int side=0) -> ()")
_LIB.define("join(Tensor(a!) ticket, int run, Tensor[]? after=None) -> ()")
_LIB.define("step_begin(Tensor tokens, Tensor? attention_mask, Tensor? position_ids, int past_len, "
            "Tensor? past_len_t, Tensor(a!) ticket, int run) -> ()")
_LIB.define("step_end(Tensor(a!) ticket, int run, Tensor[]? after=None) -> ()")


def _op(name: str):
    """Register ``fn`` as the kernel of ``dmi::name`` on every backend, and a no-op fake kernel
    (tracing: the ops return nothing and only mutate ``ticket``)."""
    def register(fn):
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"dmi::{name}", lambda *args, **kwargs: None, lib=_LIB)
        return fn
    return register


@_op("capture")
def capture(x: torch.Tensor, ticket: torch.Tensor, run: int, site: int, site_id: Optional[torch.Tensor],
            after: Optional[list] = None, ring: Optional[list] = None, token_dims: int = 1, side: int = 0) -> None:
    r = _RUNS.get(run)
    if r is not None:
        r.capture(site if site_id is None else r.site_of(site_id), x, side=bool(side))


@_op("capture_sum")
def capture_sum(x: torch.Tensor, y: torch.Tensor, ticket: torch.Tensor, run: int, site: int,
                site_id: Optional[torch.Tensor], after: Optional[list] = None, ring: Optional[list] = None,
                token_dims: int = 1, side: int = 0) -> None:
    r = _RUNS.get(run)
    if r is not None:
        r.capture(site if site_id is None else r.site_of(site_id), x, y, side=bool(side))


@_op("join")
def join(ticket: torch.Tensor, run: int, after: Optional[list] = None) -> None:
    """The end of a graph whose captures a compile pass moved onto a side stream
    (``side=1``, :func:`dmi.kernels.side.chain_captures`): the current stream waits for the last of
    them. ``after``: that capture's tensors, kept alive (unwritten) until here."""
    r = _RUNS.get(run)
    if r is not None:
        r.ring.join_side()


@_op("step_begin")
def step_begin(tokens: torch.Tensor, attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
               past_len: int, past_len_t: Optional[torch.Tensor], ticket: torch.Tensor, run: int) -> None:
    """``past_len_t``: the cache length when the cache holds it in a tensor (static caches); it is
    read (a device sync) only when no 2D attention mask tells the past length."""
    r = _RUNS.get(run)
    if r is not None:
        r.step_begin_op(tokens, attention_mask, position_ids, past_len_t if past_len_t is not None else past_len)


@_op("step_end")
def step_end(ticket: torch.Tensor, run: int, after: Optional[list] = None) -> None:
    """``after``: the payload views traced captures write (they order the end after those writes,
    and must be the ring's own memory: see ``KernelRing.check_written_in_place``)."""
    r = _RUNS.get(run)
    if r is not None:
        if after:
            r.ring.check_written_in_place(after)
        r.step_end_op()


class SiteHandle:
    """What patched code holds for one site: ``run`` (the run's id), ``site`` (its index, for eager
    code and whole-model graphs), ``site_id`` (the same as the tensor code compiled layer by layer
    passes), ``traced`` (how compiled code captures it as torch ops,
    :class:`dmi.kernels.traced.TracedSite`, or None: the op) and ``views`` (where a compile pass
    may rewrite the op into those ops, ``dmi.kernels.traced.rewrite_captures``, on a ring whose
    ``trace_mode`` is ``range``: how many leading dims of the site's tensor are its rows, and the
    ring's control block and payload view, which the op then carries; else None).
    No tensor the run shares across sites is held here: compiled code reads the run's ticket
    through one path for every site (:func:`run_ticket`), where a handle's own would be one more
    guard each (an aliasing check)."""
    __slots__ = ("run", "site", "site_id", "traced", "views")

    def __init__(self, run: int, site: int, site_id: torch.Tensor, traced=None, views=None):
        self.run, self.site, self.site_id, self.traced, self.views = run, site, site_id, traced, views

    @classmethod
    def of(cls, run, site: int) -> "SiteHandle":
        """The handle of ``site`` of a loaded :class:`dmi.run.Run`."""
        traced = getattr(run.ring, "traced_site", None)
        traced = traced(site) if traced is not None else None
        if traced is not None and run.ring.trace_mode == "range":
            # (the rewrite takes a tensor's leading dims as its rows: token-major layouts only)
            dims = 1 if traced.layout[0] == "token" else 2 if traced.layout[:2] == ("batch", "seq") else 0
            views = (dims, [traced.ctrl, traced.payload]) if dims else None
            return cls(run.id, site, run.site_tensors[site], None, views)
        return cls(run.id, site, run.site_tensors[site], traced)


class WriteHandle(SiteHandle):
    """The handle of a site interventions write: ``write`` (:class:`dmi.interventions.WriteSite`)
    changes the tensor, ``captures`` says whether a capture reads the site too (else ``site`` is
    -1). A class of its own, so that :func:`site` tells the two apart by the type compiled code
    guards anyway: a capture-only handle adds no guard, and no layer's site index becomes one."""
    __slots__ = ("write", "captures")

    def __init__(self, run: int, site: int, site_id, traced=None, views=None, write=None):
        super().__init__(run, site, site_id, traced, views)
        self.write, self.captures = write, site >= 0

    @classmethod
    def over(cls, handle: SiteHandle | None, run, write) -> "WriteHandle":
        """A write handle for a captured site's ``handle`` (None: a site nothing captures)."""
        if handle is None:
            return cls(run.id, -1, None, write=write)
        return cls(handle.run, handle.site, handle.site_id, handle.traced, handle.views, write)


def run_ticket(run_id: int) -> torch.Tensor:
    """The run's ticket, read where compiled code reads it for every site (one graph input, one guard)."""
    return _RUNS[run_id].ticket


_constant_sites = False       # True while a whole-model compiled call runs (constant_sites)


def constant_sites(fn):
    """``fn`` (a compiled callable tracing the whole model at once, e.g. generate()'s compiled
    forward) with its sites traced as constants of the graph: ``site=i, site_id=None``. A site
    tensor is a graph input, and each input costs every call of the compiled code host time
    (Dynamo's guards on it, the prologue that fetches it, AOT's wrapper;
    perf/diagnostics/guardcost.py measures the guards), in a graph that reuses nothing across
    layers. Code compiled layer by layer (vLLM's pieces, ``layer.compile()``) keeps the tensors,
    so that every layer reuses one graph (``int site`` -1 there, the same in every layer). Dynamo
    guards the flag: the graph traced under it runs only under it."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        global _constant_sites
        saved, _constant_sites = _constant_sites, True
        try:
            return fn(*args, **kwargs)
        finally:
            _constant_sites = saved
    return call


def _compiled_capture(handle: SiteHandle, x: torch.Tensor, y: Optional[torch.Tensor] = None,
                      after: Optional[list] = None) -> None:
    """What traced code records for a site (``x``, or ``x + y``): traced ops where the ring traces
    the site, else the op; the site named as :func:`constant_sites` says. ``after``: see :func:`site`."""
    site_at, site_id = (handle.site, None) if _constant_sites else (-1, handle.site_id)
    ticket = run_ticket(handle.run)
    if handle.traced is not None:        # (inductor fuses a sum in)
        traced_capture(handle.traced, x if y is None else x + y, ticket, site_at if site_id is None else site_id)
        return
    dims, ring = handle.views or (1, None)     # (views: a compile pass may rewrite the op, rewrite_captures)
    if y is None:
        torch.ops.dmi.capture(x, ticket, handle.run, site_at, site_id, after, ring, dims)
    else:
        torch.ops.dmi.capture_sum(x, y, ticket, handle.run, site_at, site_id, after, ring, dims)


def site(handle: SiteHandle, x: torch.Tensor, after: Optional[list] = None) -> torch.Tensor:
    """The call patched into model code: capture ``x`` and hand it on, changed by the site's
    interventions where it has any (``handle.write``: applied before the capture, unless the
    hook spec says ``capture: before``).

    Traced code (torch.compile, export) gets the custom op, which keeps the graph whole and
    ordered; eager code calls the run directly, skipping the dispatcher's per-call cost.

    ``after``: tensors computed with ``x`` (a module's other outputs) that the op takes as inputs
    it does not read, so that compiled code places it after them. The op orders itself through
    ``ticket`` and inductor fuses nothing across it: where an engine computes ``x`` and another
    output in one fused kernel (vLLM's fused add + RMSNorm, output 1 the residual sum) and a
    lowering places the second one after the op, that kernel would split in two, one more kernel
    per layer (tests/test_vllm_compiled.py::test_compiled_engine_runs_as_many_kernels_with_dmi_as_without)."""
    if type(handle) is WriteHandle:
        return _written(handle, x, after)
    _capture(handle, x, after)
    return x


def _capture(handle, x: torch.Tensor, after: Optional[list]) -> None:
    if torch.compiler.is_compiling():
        _compiled_capture(handle, x, after=after)
    else:
        r = _RUNS.get(handle.run)
        if r is not None:
            r.capture(handle.site, x)


def _written(handle: WriteHandle, x: torch.Tensor, after: Optional[list]) -> torch.Tensor:
    """:func:`site` at a site interventions write: applied before the capture unless the hook
    spec says ``capture: before``."""
    write = handle.write
    if not write.capture_first:
        x = write.apply(x)
    if handle.captures:
        _capture(handle, x, after)
    if write.capture_first:
        x = write.apply(x)
    return x


def site_at(run: int, site_index: int, x: torch.Tensor, write: tuple | None = None) -> torch.Tensor:
    """:func:`site` for code that has the site's run and index written in (a whole-model graph's,
    ``dmi.adapters.hf.patch.constant_sites_class``): compiled, the op with the site a constant of
    the graph, and no handle for Dynamo to guard. ``write``: at a site interventions write
    (``site_index`` -1 where nothing captures it), its :meth:`dmi.interventions.WriteSite.literal`,
    written in too: compiled code reads the values and masks from the run's packed buffers, one
    path for every site, and guards no intervention's attributes."""
    if write is not None:
        return _written_at(run, site_index, x, *write)
    if torch.compiler.is_compiling():
        torch.ops.dmi.capture(x, run_ticket(run), run, site_index, None)
    else:
        r = _RUNS.get(run)
        if r is not None:
            r.capture(site_index, x)
    return x


def run_buffers(run_id: int):
    """The run's packed intervention buffers (:class:`dmi.interventions.device.Buffers`), read
    where compiled code reads them for every site (one path: one guard per buffer)."""
    return _RUNS[run_id].interventions.buffers


def _written_at(run: int, site_index: int, x: torch.Tensor, key: tuple, capture_first: bool,
                literal: tuple) -> torch.Tensor:
    """:func:`site_at` at a site interventions write (:func:`_written`'s order)."""
    if not torch.compiler.is_compiling():
        r = _RUNS.get(run)
        if r is None:
            return x
        write = r.interventions.sites[key]
        if not capture_first:
            x = write.apply(x)
        if site_index >= 0:
            r.capture(site_index, x)
        return write.apply(x) if capture_first else x
    buffers = run_buffers(run)
    if not capture_first:
        x = apply_literal(x, literal, buffers)
    if site_index >= 0:
        torch.ops.dmi.capture(x, run_ticket(run), run, site_index, None)
    return apply_literal(x, literal, buffers) if capture_first else x


def site_sum(handle: SiteHandle, x: torch.Tensor, y: torch.Tensor, after: Optional[list] = None) -> None:
    """:func:`site` for a site whose value is ``x + y`` (the sum is never computed as a graph op)."""
    if torch.compiler.is_compiling():
        _compiled_capture(handle, x, y, after)
    else:
        r = _RUNS.get(handle.run)
        if r is not None:
            r.capture(handle.site, x, y)
