"""Ring² whose captures run the Triton kernels of :mod:`dmi.kernels.capture`: control words, site
launches, end markers, host staging. :class:`InterpretRing` keeps every buffer in host memory
(``TRITON_INTERPRET=1``: CI runs the kernels on the CPU); :mod:`dmi.kernels.cuda_ring` puts them on a
CUDA device.

Per step, ``publish_control`` writes the step's control words (armed flag, offsets, sequence
numbers, row counts, row indices, padding) into one of a few pinned buffers and copies them with
one async H2D on the current stream, ahead of the forward's kernels. The site ops launch the
Triton kernels of ``dmi.kernels.capture``; those read only the device control tensor, so the same
launches replayed from a CUDA graph capture each new step. Bookkeeping (reservation, backpressure,
drops, FIFO release) is the shared :class:`dmi.ring.protocol.Ring`'s.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import time

import numpy as np
import torch

from . import capture as K
from ..errors import CaptureError, PolicyError
from ..ring.bytering import ByteRing
from ..ring.layout import StepControl
from ..ring.protocol import Ring
from ..ring.records import META_DTYPE
from ..stall import Stall
from .cudart import NoEvent
from .site_launch import SiteLaunch, is_arange, same_layout
from .traced import TracedSite, register, scratch_at, trace_mode
from .words import SCRATCH_BYTES


DEFAULT_MAX_ROWS = 65536      # rows one token filter may select in one step (policy.max_step_tokens overrides)


TRACED_ROW_BYTES = 256 << 10  # traced sites' rows are at most this big (16 scratch rows or more)


CTRL_BUFFERS = 4              # pinned control buffers in flight


HEAD_SLOTS = 64               # pinned slots of a steady step's global words (publish_control)


SITE_KEYS = 64                # eager tensors a site remembers (and keeps graphs of: _replayed) ...


SEEN_TO_CAPTURE = 3           # ... capturing one's graph once it came this many times ...


CAPTURE_GAP = 8               # ... and at most one every this many steps


ALIGN_GAP = 64 << 10          # steps this close in the payload ring are copied as one span


# a streamed step's parts are held until its last part: in recycled host buffers, pinned up to this
# much in all (a D2H copy into fresh pageable memory ran at about 2 GB/s on an H100 host, and the
# model waits for it to free the ring; perf/offline.py --headline), pageable past it
PART_PINNED_BYTES = 4 << 30


def with_scratch(capacity: int, scratch: int) -> int:
    """Bytes to allocate for a payload ring of ``capacity`` bytes and ``scratch`` bytes of scratch
    rows (16-byte aligned: the scratch starts at a whole element of any site dtype)."""
    return -(-capacity // 16) * 16 + scratch


class KernelRing(Ring):
    """Ring² whose captures run the Triton kernels of ``dmi.kernels.capture``: control tensors,
    launches, end markers. Where the payload, meta ring and staging live is the subclass's:
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
        if self.is_cuda:      # graph inputs that compiled graphs mutate: static addresses keep cudagraphs on
            torch._dynamo.mark_static_address(self.ctrl)
        self.counters = torch.zeros(1, dtype=torch.int32, device=dev)    # the end kernel's fence word
        self.fence_idx = 0
        self.arange = torch.arange(self.max_rows, dtype=torch.int64, device=dev)
        self._host_ctrl = [torch.zeros(self.ctrl_words, dtype=torch.int64, pin_memory=self.is_cuda)
                           for _ in range(CTRL_BUFFERS)]
        self._host_ctrl_np = [t.numpy() for t in self._host_ctrl]
        # the global words' views, made once: a steady step copies only them (no slicing per step)
        self._ctrl_head = self.ctrl[:K.G_WORDS]
        self._host_heads = [t[:K.G_WORDS] for t in self._host_ctrl]
        self._host_sites = [a[K.G_WORDS:self.site_words].reshape(n_sites, K.S_WORDS) for a in self._host_ctrl_np]
        self._ctrl_events = [self._new_event() for _ in range(CTRL_BUFFERS)]
        self._ctrl_next = 0
        # a step whose layout the device holds needs only its global words: each step takes the next
        # of these slots, reused once the step that last took it has ended on the device (its end
        # marker is in the meta ring, so the copy queued before its forward has run): no event per step
        self._heads = torch.zeros((HEAD_SLOTS, K.G_WORDS), dtype=torch.int64, pin_memory=self.is_cuda)
        self._heads_np = self._heads.numpy()
        self._head_next = 0
        self._head_seq = [-1] * HEAD_SLOTS     # end seq of the step that last took each slot
        self._on_device: tuple = (None, None)   # (layout, pad) whose words the device's ctrl holds
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
        self.pinned_bytes += CTRL_BUFFERS * self.ctrl_words * 8 + self._heads.numel() * 8

    def _init_staging(self, staging: np.ndarray) -> None:
        """Host staging: a byte ring over ``staging`` that the drain reserves in step order and the
        exporter frees in order (:meth:`release_host`)."""
        self._staging = staging
        self._stage = ByteRing(len(staging))
        self._stage_cond = threading.Condition()
        self._stage_ends: dict[int, int] = {}
        self._copy_lock = threading.Lock()     # who copies a step: the model's thread or the drain
        self._part_free: list[np.ndarray] = []         # host buffers for streamed parts, free to reuse
        self._part_held: dict[int, np.ndarray] = {}    # id(ctrl) -> the buffer its part (copy group) lies in
        self._part_pinned: set[int] = set()            # ids of the pinned ones
        self.part_buffer_bytes = 0                     # allocated for parts: grows to the largest streamed step
        self.part_pinned_bytes = 0                     # of which pinned

    def _use_device(self) -> None:
        """The drain thread's device setup (CudaRing)."""

    def _copy(self, host: int, lo: int, nbytes: int, pinned: bool = True) -> None:
        """Payload ``[lo, lo + nbytes)`` to host address ``host`` (CudaRing: async, on the drain stream)."""
        raise NotImplementedError

    def _copies_done(self) -> None:
        """Wait until every copy :meth:`_copy` queued has landed."""

    # --- drain: the payload to host staging -----------------------------------------------------
    def fetch_steps(self, ctrls: list[StepControl], recs: list[np.ndarray]) -> list[list[np.ndarray]]:
        """Copy several steps' records to host staging: one async copy (:meth:`_copy`) per run of steps
        that are adjacent in the payload ring (up to a quarter of staging), one event wait for all
        (which also covers steps the model's thread copied out already: same stream, queued earlier)."""
        self._use_device()
        bases: dict[int, tuple[np.ndarray, int]] = {}     # step index -> (buffer, buffer index of ring offset 0)
        with self._copy_lock:                  # claim the steps not copied out yet, reserving in order
            for i, ctrl in enumerate(ctrls):
                if isinstance(ctrl.copied, tuple):
                    bases[i] = ctrl.copied
                else:
                    ctrl.copied = "drain"
            # each step's reserved block (its records lie in it): no per-step reductions over records
            spans = [(c.base, c.base + c.nbytes) if c.nbytes and len(r) and i not in bases else None
                     for i, (c, r) in enumerate(zip(ctrls, recs))]
            groups: list[list[int]] = []           # indices of steps copied together
            lo = hi = 0
            for i, span in enumerate(spans):
                if span is None:
                    continue
                if groups and 0 <= span[0] - hi <= ALIGN_GAP and span[1] - lo <= self._stage.capacity // 4:
                    groups[-1].append(i)
                    hi = span[1]
                else:
                    groups.append([i])
                    lo, hi = span
            copies, upto = [], len(ctrls)
            for k, group in enumerate(groups):
                lo, hi = spans[group[0]][0], spans[group[-1]][1]
                # only the batch's first copy may wait for staging: the exporter frees it, and it gets
                # this batch's steps only once they are all copied (waiting for a later one: deadlock)
                got = self._stage_for(ctrls[group[-1]], hi - lo, wait=not k)
                if got is None:
                    upto = group[0]                # the rest stays pending for the next batch
                    for i in range(upto, len(ctrls)):
                        if ctrls[i].copied == "drain":
                            ctrls[i].copied = None
                    break
                buf, dst = got
                pinned = buf is self._staging or id(buf) in self._part_pinned
                copies.append((buf.ctypes.data + dst, lo, hi - lo, pinned))
                for i in group:
                    bases[i] = (buf, dst - lo)
        for host, lo, nbytes, pinned in copies:    # outside the lock: the model's thread may copy its next step meanwhile
            self._copy(host, lo, nbytes, pinned)
        if bases:
            self._copies_done()
        out = []
        for i, r in enumerate(recs[:upto]):
            if i not in bases:
                out.append([])
                continue
            buf, shift = bases[i]
            self.stats.bytes_captured += int(r["nbytes"].sum())
            out.append([buf[a:a + n] for a, n in zip((r["offset"] + shift).tolist(), r["nbytes"].tolist())])
        return out

    def _stage_for(self, ctrl: StepControl, span: int, wait: bool = True) -> tuple[np.ndarray, int] | None:
        """(buffer, byte index) for ``span`` bytes: host staging, freed when the exporter is done
        with ``ctrl`` (the last step of the copy); for a part of a streamed step, a part buffer
        (the run holds parts until the step's last: in staging they could leave nothing for the
        parts still to come, and they never wait); pageable memory for a span larger than staging.
        ``wait``: else None when staging is full."""
        if ctrl.stream is not None:
            buf = self._part_buffer(span)
            self._part_held[id(ctrl)] = buf
            return buf, 0
        if span > self._stage.capacity:
            return np.empty(span, np.uint8), 0
        with self._stage_cond:
            stall = None
            while (got := self._stage.try_reserve(span)) is None:
                if self.error is not None:
                    raise CaptureError("drain stopped") from self.error
                if not wait:
                    return None
                if stall is None:
                    stall = Stall(f"the drain waiting for host staging (step {ctrl.step})", self.stall_timeout,
                                  lambda: f"needs {span:,} bytes; staging {self._stage.used:,} of "
                                          f"{self._stage.capacity:,} bytes held by steps the store has not "
                                          f"written yet")
                self._stage_cond.wait(0.05)
                stall.check(self._stage.tail)
        base, end = got
        self._stage_ends[id(ctrl)] = end
        return self._staging, base

    def _part_buffer(self, span: int) -> np.ndarray:
        """The smallest free part buffer of at least ``span`` bytes, else a new one of at least half
        the ring (a part's most): pinned while those stay within ``PART_PINNED_BYTES``."""
        with self._stage_cond:
            fits = [i for i, b in enumerate(self._part_free) if len(b) >= span]
            if fits:
                return self._part_free.pop(min(fits, key=lambda i: len(self._part_free[i])))
        size = max(span, self.bytes.capacity // 2)
        buf = self._pinned_buffer(size) if self.part_pinned_bytes + size <= PART_PINNED_BYTES else None
        if buf is None:
            buf = np.empty(size, np.uint8)
        else:
            self._part_pinned.add(id(buf))
            self.part_pinned_bytes += size
        self.part_buffer_bytes += size
        return buf

    def _pinned_buffer(self, nbytes: int) -> np.ndarray | None:
        """Pinned host memory for part buffers, freed at close (None: this ring has none)."""
        return None

    def release_host(self, ctrl: StepControl) -> None:
        buf = self._part_held.pop(id(ctrl), None)
        if buf is not None:
            with self._stage_cond:
                self._part_free.append(buf)
        end = self._stage_ends.pop(id(ctrl), None)
        if end is not None:
            with self._stage_cond:
                self._stage.release(end)
                self._stage_cond.notify_all()

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

    def _traceable(self, plan) -> list[int]:
        """The sites a compiled forward captures as traced torch ops (none unless ``engine.traced: all``:
        opt-in while it measures slower than the op under HF's CUDA graphs, RESULTS.md): plain
        row copies (no head selection, key alignment or reduction; any dtype) of one output, from a
        tensor holding every step row (not vLLM's sampled logits, nor a tensor a spec marks
        ``partial``: transformers' logits under ``logits_to_keep``), rows up to TRACED_ROW_BYTES."""
        if not self.scratch_bytes:           # (engine.traced was off when the ring was made)
            return []
        out = []
        for s in plan.sites:
            launcher, a = self.sites[s.index], s.anchor
            layout = a["layout"]
            if (launcher.plain and len(s.outputs) == 1 and not a.get("rows") and not a.get("partial")
                    and (layout[0] == "token" or ("batch" in layout and "seq" in layout))
                    and launcher.row_bytes[0] <= TRACED_ROW_BYTES):
                out.append(s.index)
        return out

    def traced_site(self, index: int) -> TracedSite | None:
        """What a compiled forward needs to capture site ``index`` as traced torch ops, or None
        (the site op then launches the capture kernel)."""
        if index not in self.traced:
            return None
        launcher = self.sites[index]
        dtype = launcher.dtype
        view = self.traced_views.get(dtype)
        if view is None:
            view = self.traced_views[dtype] = self.scratch_t.view(dtype)
            if self.is_cuda:
                torch._dynamo.mark_static_address(view)
        scratch, scratch_rows = scratch_at(view.numel(), dtype.itemsize, launcher.row_bytes[0])
        if self.traced_key is None:
            self.traced_key = register(self)
        return TracedSite(self.traced_key, self.ctrl, view, launcher.row_bytes[0] // dtype.itemsize,
                          scratch, scratch_rows, dtype, tuple(launcher.layout))

    def check_written_in_place(self, views: list) -> None:
        """The payload views a compiled forward's traced captures wrote, as its ``dmi::step_end``
        got them: they must be the ring's memory. A backend that functionalizes the scatters without
        writing them back in place (``aot_eager``) hands copies: its captures would never reach the
        ring, and its copy written back at the graph's end would overwrite what the site ops wrote."""
        ptr = self.scratch_t.data_ptr()
        if any(v.data_ptr() != ptr for v in views):
            raise CaptureError("a compiled forward wrote traced captures into a copy of the payload ring, not the ring "
                               "(a torch.compile backend that functionalizes without inductor, such as aot_eager). Fix: "
                               "compile with inductor (the default) or backend='eager', or remove engine.traced from "
                               "the hook spec (or set it to off) to capture through the site op")

    # --- host: per step -----------------------------------------------------------------------------
    def publish_control(self, ctrl: StepControl) -> None:
        tok = ctrl.tokens
        batch, seq = tok.batch, tok.seq
        self.geometry = (batch, seq)
        pad_start = pos = self.site_words
        pad, layout = ctrl.pad, ctrl.layout
        laid = layout.cache.get("ctrl") if layout is not None else None
        if laid is not None and laid[4] != batch * seq:
            laid = None                        # (the inverse maps of traced sites are per step geometry)
        ctrl.dev_pad_start = pad_start
        # the end kernel publishes traced sites' records in steps that ran traced code (compiled)
        self._traced_word = traced = int(bool(self.traced) and (self.traced_steps or (
            self.traced_above is not None and batch * seq > self.traced_above)))
        words = (1, ctrl.step, batch, seq, ctrl.end_seq, pad_start, ctrl.base, ctrl.first_seq, traced, ctrl.keys)
        steady = laid is not None and layout is self._on_device[0] and (
            pad is self._on_device[1] or np.array_equal(pad, self._on_device[1]))
        if steady:
            # the last full publish put this layout's site words, rows and pad on the device: they
            # are relative to the global words, which are all that changes (64 bytes, not the block)
            ctrl.dev_rows_start = laid[2]
            if self._publish_head(words, ctrl.end_seq):
                return
        k = self._ctrl_next
        self._ctrl_next = (k + 1) % CTRL_BUFFERS
        self._ctrl_events[k].synchronize()     # that buffer's previous H2D has been consumed
        h = self._host_ctrl_np[k]
        if steady:
            pos = K.G_WORDS
        else:
            if pos + len(pad) > self.ctrl_words:
                raise PolicyError(f"batch of {len(pad)} rows exceeds the CUDA ring's control buffer "
                                  f"(policy.max_step_tokens={self.max_rows}). Fix: raise policy.max_step_tokens")
            h[pos:pos + len(pad)] = pad
            pos += len(pad)
            if laid is not None:               # a reused layout: its words, relative to the step's block
                rows_at, f, rows_start, pos, _ = laid
                for at, rows in rows_at:
                    h[at:at + len(rows)] = rows
            else:
                f, rows_start, pos = self._site_words(ctrl, h, pos)
            if traced and (f[:, 1 + K.S_INV] < 0).any():
                # a selection's inverse map did not fit: no traced records
                words = words[:K.G_TRACED] + (0,) + words[K.G_TRACED + 1:]
                self._traced_word = 0
            hs = self._host_sites[k]
            hs[:, K.S_ENABLED] = K.OFF
            hs[f[:, 0]] = f[:, 1:]
            ctrl.dev_rows_start = rows_start
            self._on_device = (layout, pad)    # (layout None: the next step publishes in full too)
        h[:K.G_WORDS] = words
        self._copy_block(k, pos)

    def _new_event(self):
        """An event a control buffer's copy records (its next use waits for it)."""
        return torch.cuda.Event() if self.is_cuda else NoEvent()

    def _copy_block(self, k: int, words: int) -> None:
        """The first ``words`` of host control buffer ``k`` to the device's control block, then
        that buffer's event (the next use of the buffer waits for it)."""
        self.ctrl[:words].copy_(self._host_ctrl[k][:words], non_blocking=True)
        self._ctrl_events[k].record()

    def _publish_head(self, words: tuple, end_seq: int) -> bool:
        """A steady step's global words through the next head slot; False while that slot's last
        step has not ended on the device (the host far ahead: the buffered path waits instead)."""
        j = self._head_next
        prev = self._head_seq[j]
        if prev >= self.freed_seq and int(self.meta_view()["seq"][prev % self.meta_records]) != prev:
            return False
        self._head_next = (j + 1) % HEAD_SLOTS
        self._head_seq[j] = end_seq
        self._heads_np[j] = words
        self._copy_head(j)
        return True

    def _copy_head(self, j: int) -> None:
        self._ctrl_head.copy_(self._heads[j], non_blocking=True)

    def _site_words(self, ctrl: StepControl, h: np.ndarray, pos: int):
        """Per site: (site, offset from base, seq from first_seq, rows, rows_start, enabled) words,
        the rows written at ``pos`` on (sites sharing a token filter share its rows); remembered
        for a reused layout."""
        if ctrl.layout is not None:
            return self._layout_words(ctrl, h, pos)
        slots = list(ctrl.slots.values())
        start_of, _, pos, enabled = self._place_rows(ctrl, h, pos, [(slot.site, slot.rows) for slot in slots])
        inv_of, _, pos = self._place_inverses(ctrl, h, pos, [slot.rows for slot in slots], enabled)
        fields = np.array([(slot.site, slot.offset - ctrl.base, slot.seq - ctrl.first_seq, len(slot.rows), start, on, inv)
                           for slot, start, on, inv in zip(slots, start_of, enabled, inv_of)],
                          np.int64).reshape(len(slots), K.S_WORDS + 1)
        return fields, {slot.site: start for slot, start in zip(slots, start_of)}, pos

    def _place_inverses(self, ctrl: StepControl, h: np.ndarray, pos: int, arrays: list, enabled: list):
        """For traced captures: each listed rows array's inverse map (per step row b*seq+s, its
        place in the array or -1) at ``pos`` on, once per array: (each array's start, [(start,
        map)], next pos). -1 where the map does not fit (the step then publishes no traced records);
        0 for arrays of every row (traced code needs no map) or with no traced sites."""
        if not self.traced or (self.trace_mode == "range" and not self._traced_word):
            return [0] * len(arrays), [], pos      # (range: a step's geometry decides its word, and keys its layout)
        n = ctrl.tokens.batch * ctrl.tokens.seq
        placed: dict[int, int] = {}
        at = []
        for rows, on in zip(arrays, enabled):
            if on != K.ENABLED or not len(rows) or id(rows) in placed:
                continue
            if pos + n > self.ctrl_words:
                placed[id(rows)] = -1
                continue
            inv = np.full(n, -1, np.int64)
            inv[rows] = np.arange(len(rows))
            h[pos:pos + n] = inv
            placed[id(rows)] = pos
            at.append((pos, inv))
            pos += n
        return [placed.get(id(rows), 0) for rows in arrays], at, pos

    def _layout_words(self, ctrl: StepControl, h: np.ndarray, pos: int):
        """:meth:`_site_words` of a laid-out step, as whole-array operations over its sites (an
        engine step lays out a fresh layout each step, with up to hundreds of sites): the rows of
        each of the layout's distinct row arrays once, then every site's words from its array's."""
        layout = ctrl.layout
        starts, flags, lens, rows_at, placed = [], [], [], [], []
        used = np.zeros(len(layout.arrays), bool)
        used[layout.src] = True            # (a filter whose every site reads an engine-held tensor's rows)
        for j, (_, rows) in enumerate(layout.arrays):
            if not used[j]:                # placed nowhere, read by no site
                rows = rows[:0]
            n = len(rows)
            if n > self.max_rows or pos + n > self.ctrl_words:
                raise self._too_many_rows(ctrl, n, layout.ids[int(np.argmax(layout.src == j))])
            h[pos:pos + n] = rows
            starts.append(pos)
            flags.append(K.ENABLED_ARANGE if is_arange(rows) else K.ENABLED)
            lens.append(n)
            rows_at.append((pos, rows))
            placed.append(rows)
            pos += n
        inv_of, inv_at, pos = self._place_inverses(ctrl, h, pos, placed, flags)
        rows_at += inv_at
        src, n_sites = layout.src, len(layout)
        rel = np.empty((n_sites, K.S_WORDS + 1), np.int64)   # relative to the block's base and first seq
        rel[:, 0] = layout.site_ids
        rel[:, 1] = layout.rel
        rel[:, 2] = self._site_order[:n_sites]
        rel[:, 3] = np.array(lens, np.int64)[src]
        rel[:, 4] = np.array(starts, np.int64)[src]
        rel[:, 5] = np.array(flags, np.int64)[src]
        rel[:, 6] = np.array(inv_of, np.int64)[src]
        rows_start = dict(zip(layout.ids, rel[:, 4].tolist()))
        layout.cache["ctrl"] = (rows_at, rel, rows_start, pos, ctrl.tokens.batch * ctrl.tokens.seq)
        return rel, rows_start, pos

    def _place_rows(self, ctrl: StepControl, h: np.ndarray, pos: int, site_rows: list):
        """Each capture's row indices into the control words at ``pos`` on, once per rows array
        (sites of one token filter share it): (start of each capture's rows, [(start, rows)], next
        pos, each capture's enabled word: ENABLED_ARANGE where its rows are 0 .. n-1)."""
        placed: dict[int, tuple[int, int]] = {}       # id(rows) -> (start, enabled word)
        rows_at = []
        for site, rows in site_rows:                  # each distinct rows array once
            if id(rows) in placed:
                continue
            n = len(rows)
            if n > self.max_rows or pos + n > self.ctrl_words:
                raise self._too_many_rows(ctrl, n, site)
            h[pos:pos + n] = rows
            placed[id(rows)] = (pos, K.ENABLED_ARANGE if is_arange(rows) else K.ENABLED)
            rows_at.append((pos, rows))
            pos += n
        got = [placed[id(rows)] for _, rows in site_rows]
        return [g[0] for g in got], rows_at, pos, [g[1] for g in got]

    def _too_many_rows(self, ctrl: StepControl, n: int, site: int) -> PolicyError:
        """The refusal of a step whose ``n`` rows for ``site`` do not fit the control words."""
        return PolicyError(f"step {ctrl.step} selects {n} rows for {self.plan.sites[site].name}, "
                           f"more than policy.max_step_tokens={self.max_rows}. Fix: raise policy.max_step_tokens")

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
