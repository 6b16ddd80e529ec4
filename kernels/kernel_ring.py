"""Ring² whose captures run the Triton kernels of :mod:`dmi.kernels.capture`: site launches, end
markers, eager captures (a range copy, a replayed CUDA graph). :class:`InterpretRing` keeps every
buffer in host memory (``TRITON_INTERPRET=1``: CI runs the kernels on the CPU);
:mod:`dmi.kernels.cuda_ring` puts them on a CUDA device.

Per step, the control block (:mod:`dmi.kernels.control_block`) goes to the device ahead of the
forward's kernels. The site ops launch the Triton kernels of ``dmi.kernels.capture``; those read
only the device control tensor, so the same launches replayed from a CUDA graph capture each new
step. The drain copies ended steps to host staging (:mod:`dmi.kernels.host_staging`); compiled
code may capture sites as traced ops (:mod:`dmi.kernels.traced_sites`). Bookkeeping
(reservation, backpressure, drops, FIFO release) is the shared :class:`dmi.ring.protocol.Ring`'s.
"""
from __future__ import annotations

import contextlib
import ctypes
import time

import numpy as np
import torch

from . import capture as K
from ..errors import PolicyError
from ..graph_inputs import static_inputs
from ..ring.layout import StepControl
from ..ring.protocol import Ring
from ..ring.records import META_DTYPE
from .control_block import CTRL_BUFFERS, HEAD_SLOTS, ControlBlock
from .host_staging import ALIGN_GAP, PART_PINNED_BYTES, HostStaging
from .site_launch import SiteLaunch, same_layout
from .traced import trace_mode
from .traced_sites import TRACED_ROW_BYTES, TracedSites
from .words import SCRATCH_BYTES

__all__ = ["KernelRing", "InterpretRing", "with_scratch", "DEFAULT_MAX_ROWS", "SITE_KEYS", "SEEN_TO_CAPTURE",
           "CAPTURE_GAP", "CTRL_BUFFERS", "HEAD_SLOTS", "ALIGN_GAP", "PART_PINNED_BYTES", "TRACED_ROW_BYTES"]


DEFAULT_MAX_ROWS = 65536      # rows one token filter may select in one step (policy.max_step_tokens overrides)


SITE_KEYS = 64                # eager tensors a site remembers (and keeps graphs of: _replayed) ...


SEEN_TO_CAPTURE = 3           # ... capturing one's graph once it came this many times ...


CAPTURE_GAP = 8               # ... and at most one every this many steps


def with_scratch(capacity: int, scratch: int) -> int:
    """Bytes to allocate for a payload ring of ``capacity`` bytes and ``scratch`` bytes of scratch
    rows (16-byte aligned: the scratch starts at a whole element of any site dtype)."""
    return -(-capacity // 16) * 16 + scratch


class KernelRing(ControlBlock, HostStaging, TracedSites, Ring):
    """Ring² whose captures run the Triton kernels of ``dmi.kernels.capture``: control tensors
    (:class:`ControlBlock`), launches, end markers, host staging (:class:`HostStaging`), traced
    sites (:class:`TracedSites`). Where the payload, meta ring and staging live is the subclass's:
    :class:`CudaRing` (device + mapped pinned memory) or :class:`InterpretRing` (host memory, for
    the Triton interpreter on CPU)."""
    device_publishes_end = True

    def __init__(self, capacity: int, meta_records: int, mode: str = "full", *, max_step_tokens: int | None = None,
                 device=None, traced: str | None = None, pdl: bool = True):
        """``traced``: where compiled code captures the traceable sites as traced torch ops
        (:mod:`dmi.kernels.traced`; the hook spec's ``engine.traced``; None: ``0``). ``0``: nowhere (the site
        op); ``1``: every compiled forward (opt-in: slower than the op under CUDA graphs,
        perf/RESULTS.md); ``range``: only where an engine's compile pass rewrites the op
        (:func:`dmi.kernels.traced.rewrite_captures`: vLLM's steps above its largest CUDA graph),
        in steps of more than :attr:`traced_above` rows. ``pdl`` (``engine.pdl``): launch the capture
        kernels as programmatic dependents where the GPU can (:mod:`dmi.kernels.capture`)."""
        super().__init__(capacity, meta_records, mode)
        self.torch_device = torch.device(device) if device is not None else torch.device("cpu")
        self.is_cuda = self.torch_device.type == "cuda"
        self.max_rows = int(max_step_tokens or DEFAULT_MAX_ROWS)
        self.device_bytes = self.pinned_bytes = 0
        self.trace_mode = trace_mode(traced)
        self.pdl = pdl and self.is_cuda and K.pdl_possible(self.torch_device.index)
        # traced captures' scratch rows, past the payload's end: allocated only where they may run
        self.scratch_bytes = SCRATCH_BYTES if self.trace_mode != "0" else 0
        self.graph_mode = False   # tests: launch as while capturing a CUDA graph (no host values baked in)

    def setup(self, plan, dtype, device) -> None:
        super().setup(plan, dtype, device)
        dev = self.torch_device
        n_sites = len(plan.sites)
        n_filters = max(1, len({s.tokens for s in plan.sites}))
        self.site_words = K.G_WORDS + K.S_WORDS * n_sites
        self.sites = {s.index: SiteLaunch(s, dtype, dev) for s in plan.sites}
        self.traced = self._traceable(plan)
        # rows (one array per token filter), padding, and the inverse maps of traced sites' selections
        self.ctrl_words = self.site_words + (n_filters * (2 if self.traced else 1) + 1) * self.max_rows
        self.ctrl = torch.zeros(self.ctrl_words, dtype=torch.int64, device=dev)
        self.traced_table = torch.tensor([(i, i & 0xFFFFFFFF, self.sites[i].row_bytes[0]) for i in self.traced],
                                         dtype=torch.int64, device=dev).reshape(-1, K.TRACED_WORDS)
        self.traced_steps = False           # a compiled forward captures sites as traced ops (dmi.kernels.traced)
        self.traced_above: int | None = None   # trace_mode range: steps of more rows run the rewritten captures
        self.traced_key = None              # this ring's key for traced code (dmi.kernels.traced.register)
        self._traced_word = 0               # the traced word the open step's control block was given
        self.traced_views: dict = {}       # dtype -> the payload ring and its scratch row as it
        static_inputs(self.ctrl)      # a graph input that compiled graphs mutate: cudagraphs stay on
        self.counters = torch.zeros(1, dtype=torch.int32, device=dev)    # the end kernel's fence word
        self.fence_idx = 0
        self.arange = torch.arange(self.max_rows, dtype=torch.int64, device=dev)
        self._init_control_buffers(n_sites)
        self.end_warm = False               # launching_without_step has compiled the end-marker kernel
        self._end_graph = None              # the end-marker launch as a CUDA graph (device_end)
        # sites whose eager captures may replay as graphs (_replayed): an engine names those it runs
        # in plain PyTorch between its graphs every step (vLLM's logits); never under torch.compile,
        # whose cudagraph warm-up runs the site ops eagerly inside its own capture bookkeeping
        self.replay_eager: set[int] = set()
        self._site_graphs: dict = {}        # site -> {key of an eager tensor: times seen, or its launch as a graph}
        self._graphs_made: dict = {}        # site -> graphs captured for it (_replayed)
        self._capture_after: dict = {}      # site -> the step from which it may capture again
        # an eager capture whose selected rows are one range of x's rows is one strided copy (copy_rows)
        self.range_copy = True
        # captures outside a graph, by how: one copy of a row range, the eager path's torch ops, a replay, a
        # launch + graph capture: [count, host s]
        self.eager_time = {how: [0, 0.0] for how in ("copy", "eager", "replay", "capture")}
        self._graph_pool = None             # one memory pool for the graphs _capture makes (their temporaries)
        self._payload_views: dict = {}      # dtype -> the payload ring viewed as it (payload_as)
        self._site_order = np.arange(n_sites, dtype=np.int64)     # (a layout's capture order: its seq offsets)
        self.geometry: tuple[int, int | None] | None = None   # (batch, seq) of the latest step; seq None: x's own
        # captures a compile pass chained (side=1: dmi.kernels.side) launch on this stream while a CUDA
        # graph is captured, where the engine turns it on (and ``side_when``, if set, says yes: vLLM's
        # full graphs only, where piecewise ones replay slower with forks); the one not yet joined:
        # (event, its tensors)
        self.side_streams = False
        self.side_when = None
        self._side_stream = torch.cuda.Stream(dev) if self.is_cuda else None
        self._side_open: tuple | None = None
        self.side_counts = {"marked": 0, "forked": 0, "joined": 0}     # captures marked side=1; forked; joins waited
        self.device_bytes += (self.ctrl_words + self.max_rows + self.traced_table.numel()) * 8 + self.counters.numel() * 4

    @contextlib.contextmanager
    def launching_without_step(self, batch: int = 1):
        """Engines' warm-up and graph-capture runs, with no step open: launch as while capturing a
        graph (kernels that read the disarmed control block and exit, so Triton compiles and loads
        them outside any capture), for a flat batch whose token count is each tensor's own
        (geometry ``(batch, None)``: every captured graph bakes its own padded size)."""
        graph_mode = self.graph_mode
        self.geometry, self.graph_mode = (batch, None), True
        try:
            yield
        finally:
            self.graph_mode = graph_mode
            self._side_open = None     # (a fork a failed capture left: its event belongs to no stream now)
        if not self.end_warm and not (self.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.end_warm = True      # the end-marker kernel too, which only real steps launch (disarmed: it exits)
            self.device_end()

    def device_end(self) -> None:
        """The end-marker kernel, on the current stream. Outside a graph capture (vLLM ends every
        step from the host; eager HF forwards) a one-kernel CUDA graph of it is replayed: its
        arguments never change (it reads the step from ``ctrl``), and a replay costs the host a
        few µs where Triton's Python launcher took 130 µs a step in a serving engine."""
        if self.traced_steps and not self._traced_word and self.traced and self.current is not None:
            # the step's forward was compiled (traced) after its control block went out: its records too
            self._traced_word = 1
            self.ctrl.narrow(0, K.G_TRACED, 1).fill_(1)
        if self._end_graph is not None and not torch.cuda.is_current_stream_capturing():
            self._end_graph.replay()
            return
        self.launch_end()
        if self.is_cuda and self._end_graph is None and not torch.cuda.is_current_stream_capturing():
            self._end_graph = self._capture(self.launch_end)     # launched once above: compiled and loaded

    def _capture(self, launch):
        """A CUDA graph of ``launch()``, captured on a side stream (thread-local capture mode: the
        drain thread's CUDA calls meanwhile are not part of it and stay legal)."""
        graph, side, cur = torch.cuda.CUDAGraph(), torch.cuda.Stream(self.torch_device), torch.cuda.current_stream()
        if self._graph_pool is None:           # shared: the graphs replay one at a time on one stream, and
            self._graph_pool = torch.cuda.graph_pool_handle()     # their temporaries die inside each replay
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self._graph_pool, capture_error_mode="thread_local")
            try:
                launch()
            finally:
                graph.capture_end()
        cur.wait_stream(side)
        return graph

    def check_streamable(self, step: int, tokens) -> None:
        if self.traced and (self.traced_steps or (self.traced_above is not None
                                                  and tokens.batch * tokens.seq > self.traced_above)):
            raise PolicyError(f"step {step} is larger than the ring ({self.describe_room()}) and its captures run "
                              f"as traced ops in compiled code, which cannot stream through the ring in parts",
                              key="policy.ring_bytes", fix="raise policy.ring_bytes to hold the engine's largest step, "
                                                           "or set engine.traced: off in the hook spec (the site "
                                                           "op streams)")

    def end_part_marker(self, ctrl: StepControl) -> None:
        """A part ended inside an eager forward: the end kernel, behind its captures on the stream."""
        self.device_end()

    def launch_end(self) -> None:
        """The end-marker kernel through Triton's launcher (what the graph replays)."""
        K.launch_end(self.ctrl, self.meta_dev, self.counters, meta_records=self.meta_records, fence_idx=self.fence_idx,
                     traced=self.traced_table)

    def publish_end(self, ctrl: StepControl, flags: int = 0) -> None:
        """Host-published end marker (an aborted step or a forward that never finished): wait for
        what the device already has in flight, then write the record, ``seq`` last."""
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)
        self.disarm()                          # a stray replay captures nothing
        rec = self.meta[ctrl.end_seq % self.meta_records]
        rec["step"], rec["site"], rec["flags"] = ctrl.step, -1, flags
        rec["offset"] = rec["nbytes"] = rec["rows"] = rec["src_seq"] = 0
        rec["seq"] = ctrl.end_seq

    def disarm(self) -> None:
        self.ctrl[:1].zero_()                  # (stream-ordered after the last step's control words)

    def capture(self, site, x: torch.Tensor, addend: torch.Tensor | None = None, side: bool = False) -> None:
        if side:       # (a chained capture: the previous one is joined first, see dmi.kernels.side)
            self.side_counts["marked"] += 1
            self.join_side()
        cur = self.current if self.current is not None and not self.current.ended else None
        stream_capturing = self.is_cuda and torch.cuda.is_current_stream_capturing()
        capturing = self.graph_mode or stream_capturing
        if cur is not None and cur.stream is not None:
            if capturing:
                raise PolicyError(f"step {cur.step} is larger than the ring ({self.describe_room()}) and runs inside "
                                  f"a CUDA graph, where it cannot stream through the ring in parts",
                                  key="policy.ring_bytes", fix="raise policy.ring_bytes to hold the graph's whole step")
            self.stream_slot(site.index)
            cur = self.current
        if not capturing and (cur is None or site.index not in cur.slots):
            return                             # no step (null mode), nothing selected or dropped: no launch
        eager = cur if not capturing and cur is not None else None
        x = x.detach() if x.requires_grad else x       # no autograd graph
        if addend is not None and addend.requires_grad:
            addend = addend.detach()
        if eager is None:
            # (engines capture inside their warm-up runs, graph_mode: fork only where a stream capture is on)
            fork = side and self.side_streams and stream_capturing and (self.side_when is None or self.side_when())
            self.sites[site.index].launch(self, x, None, addend, fork=fork)
            return
        t0 = time.perf_counter()               # the host time of captures outside graphs (engine step stats)
        launcher = self.sites[site.index]
        if addend is not None and not same_layout(x, addend):
            x, addend = x + addend, None       # the sum as a tensor: what any eager op costs
        how = "copy" if self.range_copy and launcher.copied_as_range(self, x, eager, addend) else None
        if how is None and addend is not None:
            x = x + addend
        if how is None and site.index in self.replay_eager:
            how = self._replayed(site, x)
        if how is None:
            launcher.launch(self, x, eager)
        spent = self.eager_time[how or "eager"]
        spent[0] += 1
        spent[1] += time.perf_counter() - t0

    def launch_on_side(self, launch, *tensors) -> None:
        """``launch()`` on the side stream, forked from the current one where everything
        queued so far (the site's tensor) is done; the stream joins it at the next chained capture
        or ``dmi::join``. While a CUDA graph is captured the fork and join become the graph's edges:
        in each replay the kernel runs beside the model's. ``tensors``: what it reads, held until
        then (the caching allocator cannot hand their memory out before the join)."""
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(side):       # (the kernel the warm-up loaded: a new variant cannot load while
            launch()                        # a stream captures; a programmatic edge from the producer holds)
        done = torch.cuda.Event()
        done.record(side)
        self._side_open = (done, tensors)
        self.side_counts["forked"] += 1

    def join_side(self) -> None:
        if self._side_open is not None:
            torch.cuda.current_stream(self.torch_device).wait_event(self._side_open[0])
            self._side_open = None
            self.side_counts["joined"] += 1

    def _replayed(self, site, x: torch.Tensor) -> str | None:
        """An eager capture of a tensor this site saw in earlier steps (same address, shape,
        strides and step geometry: vLLM's logits, computed outside its CUDA graphs every step, get
        the same block from the caching allocator): the graph-mode launch, which reads everything
        from the control block, replayed as a captured CUDA graph (``"replay"``). A replay costs the
        host a few µs; the eager path's torch ops and host-written record cost 10-50 times that on a
        serving host. A capture costs far more (H200: 9.55 ms each in serving, 7.8 ms in a loop
        with no engine), so ahead of this the range copy takes what it can, and a tensor's graph is
        captured only once the tensor came ``SEEN_TO_CAPTURE`` times (that step launches
        graph-mode, then captures: ``"capture"``), at most one every ``CAPTURE_GAP`` steps, and a
        site keeps the graphs of its last ``SITE_KEYS`` tensors, so the batch sizes of a serving
        engine, which come back, are captured once each. None: take the eager path."""
        key = (x.data_ptr(), x.shape, x.stride(), x.dtype, self.geometry)
        known = self._site_graphs.setdefault(site.index, {})     # key -> times seen, or its graph; oldest first
        got = known.pop(key, 0)
        if not isinstance(got, int):
            got.replay()
            known[key] = got                   # the most recent last
            return "replay"
        step = self.current.step
        if got + 1 < SEEN_TO_CAPTURE or step < self._capture_after.get(site.index, 0):
            known[key] = got + 1
            how = None
        else:
            launch = self.sites[site.index].launch
            launch(self, x, None)
            known[key] = self._capture(lambda: launch(self, x, None))
            self._graphs_made[site.index] = self._graphs_made.get(site.index, 0) + 1
            self._capture_after[site.index] = step + CAPTURE_GAP
            how = "capture"
        if len(known) > SITE_KEYS:             # (the least recently seen goes, its graph with it)
            known.pop(next(iter(known)))
        return how

    @property
    def eager_replays(self) -> int:
        """Eager captures done by a graph replay."""
        return self.eager_time["replay"][0]

    def copy_rows(self, x: torch.Tensor, start: int, n: int, pitch: int, row_bytes: int, offset: int,
                  addend: torch.Tensor | None = None) -> None:
        """Rows ``start .. start + n`` of ``x`` (``pitch`` elements apart, ``row_bytes`` each) to
        payload ``offset``, on the current stream: torch here, one driver call on CUDA. ``addend``
        (x's shape, strides and dtype): the rows of ``x + addend``, added straight into the ring
        (one kernel, as torch adds and rounds; no sum tensor allocated and copied)."""
        isz = x.element_size()
        row = row_bytes // isz
        rows = lambda t: t.as_strided((n, row), (pitch, 1), t.storage_offset() + start * pitch)    # noqa: E731
        dst = self.payload_as(x.dtype).narrow(0, offset // isz, n * row).view(n, row)
        if addend is None:
            dst.copy_(rows(x))
        else:
            torch.add(rows(x), rows(addend), out=dst)

    def payload_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The payload ring as a flat tensor of ``dtype`` (made once per dtype: eager captures
        gather straight into it)."""
        t = self._payload_views.get(dtype)
        if t is None:
            whole = self.payload_t.numel() // dtype.itemsize * dtype.itemsize     # any ring_bytes, even odd
            t = self._payload_views[dtype] = self.payload_t[:whole].view(dtype)
        return t


class InterpretRing(KernelRing):
    """The kernels' ring with every buffer in host memory: with ``TRITON_INTERPRET=1`` the Triton
    kernels run on the CPU, so CI exercises the CUDA path's control words, kernels and records."""

    def __init__(self, capacity: int, meta_records: int, mode: str = "full", *, host_bytes: int = 256 << 20,
                 max_step_tokens: int | None = None, device=None, traced: str | None = None, **_):
        super().__init__(capacity, meta_records, mode, max_step_tokens=max_step_tokens, device="cpu", traced=traced)
        self.scratch_t = torch.zeros(with_scratch(capacity, self.scratch_bytes), dtype=torch.uint8)
        self.payload = self.payload_t = self.scratch_t[:capacity]
        self.meta = np.zeros(meta_records, META_DTYPE)
        self.meta_dev = torch.from_numpy(self.meta.view(np.int64))
        self._init_staging(np.empty(host_bytes, np.uint8))   # the drain stages as the CUDA ring's does

    def meta_view(self) -> np.ndarray:
        return self.meta

    def _copy(self, host: int, lo: int, nbytes: int, pinned: bool = True) -> None:
        ctypes.memmove(host, self.payload.data_ptr() + lo, nbytes)
