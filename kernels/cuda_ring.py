"""Ring² on a CUDA device, its memory managed through cuda-python.

* payload ring: ``cudaMalloc`` (outside PyTorch's caching allocator and any KV pool);
* meta ring: ``cudaHostAlloc(mapped)`` host memory the capture kernels write through its device
  pointer and the drain thread polls as a numpy array (no CUDA call on the hot path);
* host staging: ``cudaHostAlloc`` pinned memory (``policy.host_bytes``), a byte ring the drain
  copies into and the exporter frees in order;
* the drain's own non-blocking stream and a blocking-sync event;
* non-blocking calls (async copies, event records) through libcuda with the GIL held
  (:class:`AsyncCalls`); blocking ones (event waits) through cuda-python, which lets it go.

Copy-out timing. The engine's own small D2H copies (HF's stop check, vLLM's sampled tokens) share
the device-to-host copy engine with the drain, which serves queued copies in order: a drain batch
of ~100 ms of steps (hundreds of MB) queued just before such a copy holds the model's step back for
the whole batch (`perf/drain_bench.py --hol`: a 4-byte copy waited ~19 ms behind 1 GiB, also when
that GiB was queued as 8 MiB pieces). So the drain queues its copies one ``DRAIN_PIECE`` (16 MiB,
~0.3 ms) at a time, each once the one before it is done. With ``copy_at_step`` (the hook spec's ``engine.copy_at_step``;
not the default: on the H200 its paced drain cut that wait to 12 µs at the median, but neither offline nor
online throughput improved, perf/RESULTS.md) the model's thread instead queues each step's copy when the next
step begins, on the drain stream behind an event recorded where the step ended: by then the
engine's copy of that step is already queued, and the step's copy (one step's data) runs beside
the next forward. The drain thread then only waits for it; steps it could not copy that way
(staging full, a graph capture in progress, a step over ``PACED_PIECE``) take the batched path,
in order, whose copies then go out one ``PACED_PIECE`` at a time.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from . import capture as K
from ..ring.layout import StepControl
from ..ring.protocol import Ring
from ..ring.records import META_DTYPE
from ..ring.share import ChildSide
from .cudart import AsyncCalls, CudaBytes, DevicePointer, RtEvent, check_call, cudart, host_array
from .kernel_ring import KernelRing, with_scratch


PACED_PIECE = 64 << 20        # copy_at_step: the drain's copies go out in pieces this big, one at a time


DRAIN_PIECE = 16 << 20        # otherwise this big: ~0.3 ms of the copy engine (module doc)


CHECK_BYTES = 32     # the libcuda check's bytes (AsyncCalls.check) past a ring drained in another process


class CudaRing(KernelRing):
    """Ring² on a CUDA device; memory, stream and events through cuda-python."""

    def __init__(self, capacity: int, meta_records: int, mode: str = "full", *, host_bytes: int = 256 << 20,
                 max_step_tokens: int | None = None, device=None, share=None, traced: str | None = None,
                 pdl: bool = True, copy_at_step: bool = False):
        """``share``: a :class:`dmi.ring.share.RingShare` (``policy.drain: process``): the meta ring in
        its file, registered as mapped memory, and the payload ring exported through CUDA IPC.
        ``traced``, ``pdl``: :class:`KernelRing`'s. ``copy_at_step`` (the hook spec's
        ``engine.copy_at_step``): the model's thread copies each step out as the next one begins
        (module doc)."""
        dev = torch.device(device) if device is not None else torch.device("cuda")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__(capacity, meta_records, mode, max_step_tokens=max_step_tokens, device=dev, traced=traced,
                         pdl=pdl)
        rt = self._rt = cudart()
        torch.cuda.init()                      # torch and cuda-python share the primary context
        self._thread_device = threading.local()
        self.enter_thread()
        self.device_bytes = with_scratch(capacity, self.scratch_bytes)
        # a ring drained in another process keeps a few bytes of its own past the rest: that process
        # checks its libcuda calls there, where the payload and scratch hold live rows. (Its own
        # attribute: device_bytes goes on to count the control tensors that setup() allocates.)
        self._check_at = self.device_bytes
        self._payload_ptr = check_call(rt.cudaMalloc(self._check_at + (CHECK_BYTES if share is not None else 0)))
        meta_bytes = meta_records * META_DTYPE.itemsize
        self.share, self._registered = share, None
        if share is None:
            flags = rt.cudaHostAllocMapped | rt.cudaHostAllocPortable
            self._meta_ptr = check_call(rt.cudaHostAlloc(meta_bytes, flags))
            ctypes.memset(self._meta_ptr, 0, meta_bytes)
            self.meta = host_array(self._meta_ptr, meta_bytes, META_DTYPE)
            self._meta_dev = check_call(rt.cudaHostGetDevicePointer(self._meta_ptr, 0))
        else:         # the shared file, registered whole (page-aligned) as mapped pinned memory
            self._meta_ptr = None
            base = np.frombuffer(share.map, np.uint8).ctypes.data
            check_call(rt.cudaHostRegister(base, len(share.map), rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable))
            self._registered = base
            self.meta = share.meta
            self._meta_dev = check_call(rt.cudaHostGetDevicePointer(base, 0)) + share.meta_offset
            self.ipc_handle = bytes(check_call(rt.cudaIpcGetMemHandle(self._payload_ptr)).reserved)
        # (drained in another process, staging serves only the libcuda check)
        self._drain_side(host_bytes if share is None else 0, self._payload_ptr)
        self.payload = DevicePointer(self._payload_ptr, torch.uint8)
        self.scratch_t = torch.as_tensor(CudaBytes(self._payload_ptr, self.device_bytes), device=self.torch_device)
        self.payload_t = self.scratch_t[:capacity]
        self.meta_dev = DevicePointer(self._meta_dev, torch.int64)
        self.pinned_bytes = meta_bytes + self.staging_bytes
        self._closed = False
        # copy each step out from the model's thread when the next one begins (module doc)
        self.copy_at_step = copy_at_step
        self._gap_seq = -1                     # end seq of the latest step left to the drain
        self._step_done = self._drain_stream = None    # made at the first step copied this way
        self.steps_copied_at_step = 0

    def _drain_side(self, host_bytes: int, check_at: int) -> None:
        """What the drain copies with: pinned staging (a byte ring the exporter frees in order),
        its own stream and event, the libcuda calls (checked with 32 bytes at ``check_at``)."""
        rt = self._rt
        self.staging_bytes = max(int(host_bytes), 1 << 20)
        self._part_ptrs: list[int] = []
        self._staging_ptr = check_call(rt.cudaHostAlloc(self.staging_bytes, rt.cudaHostAllocPortable))
        self._init_staging(host_array(self._staging_ptr, self.staging_bytes))
        self._stream = check_call(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
        self._event = check_call(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming | rt.cudaEventBlockingSync))
        self._calls = AsyncCalls(rt)
        self._calls.check(self._staging, check_at, self._stream, self._event)

    def _drain_side_frees(self) -> tuple:
        """What :meth:`_drain_side` made, as (free function, handle) pairs for ``close``."""
        rt = self._rt
        return ((rt.cudaEventDestroy, self._event), (rt.cudaStreamDestroy, self._stream),
                (rt.cudaFreeHost, self._staging_ptr), *((rt.cudaFreeHost, p) for p in self._part_ptrs))

    def _pinned_buffer(self, nbytes: int) -> np.ndarray | None:
        err, ptr = self._rt.cudaHostAlloc(nbytes, self._rt.cudaHostAllocPortable)
        if int(err) != 0:
            return None                     # (pinned memory is scarce here: pageable then)
        self._part_ptrs.append(ptr)
        return host_array(ptr, nbytes)

    def setup(self, plan, dtype, device) -> None:
        super().setup(plan, dtype, device)
        self._heads_ptr = self._heads.data_ptr()
        self._ctrl_ptr = self.ctrl.data_ptr()
        self._host_ctrl_ptrs = [t.data_ptr() for t in self._host_ctrl]
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)    # (what Triton's launcher reads)
        index = self.torch_device.index
        self._raw_stream = (lambda: raw(index)) if raw is not None else (
            lambda: torch.cuda.current_stream(self.torch_device).cuda_stream)

    def _new_event(self):
        return RtEvent(self._rt, self._calls)

    def _copy_head(self, j: int) -> None:
        """One async H2D on the model's current stream (:class:`AsyncCalls`): torch's ``copy_`` of a
        pinned tensor adds its dispatch and a host-allocator event, several times the copy's own
        host cost."""
        self._calls.h2d(self._ctrl_ptr, self._heads_ptr + j * K.G_WORDS * 8, K.G_WORDS * 8, self._raw_stream())

    def _copy_block(self, k: int, words: int) -> None:
        """As :meth:`_copy_head`, then the buffer's event."""
        stream = self._raw_stream()
        self._calls.h2d(self._ctrl_ptr, self._host_ctrl_ptrs[k], words * 8, stream)
        self._ctrl_events[k].record_on(stream)

    def copy_rows(self, x: torch.Tensor, start: int, n: int, pitch: int, row_bytes: int, offset: int,
                  addend: torch.Tensor | None = None) -> None:
        """Back-to-back rows: one async device-to-device copy on the model's current stream, a few
        µs of host time where the eager path's torch ops cost tens. Rows spaced wider than they
        are long (a slice of a fused projection, in eager steps only), and the rows of a sum:
        torch's strided copy or add."""
        isz = x.element_size()
        if pitch * isz != row_bytes or addend is not None:
            super().copy_rows(x, start, n, pitch, row_bytes, offset, addend)
            return
        self._calls.d2d(self._payload_ptr + offset, x.data_ptr() + start * pitch * isz, n * row_bytes,
                        self._raw_stream())

    def enter_thread(self) -> None:
        """Per thread, once (the drain's, the exporter's): the ring's device, and relaxed
        stream-capture mode. Without it a CUDA graph capture in global mode (torch.cuda.graph's
        default) on the model's thread would fail this thread's copies and event waits (the drain's
        copies, the exporter's wait for a step's token ids), though they never touch the captured
        stream."""
        if not getattr(self._thread_device, "set", False):
            rt = self._rt
            check_call(rt.cudaSetDevice(self.torch_device.index))
            check_call(rt.cudaThreadExchangeStreamCaptureMode(rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed))
            self._thread_device.set = True

    # --- drain ----------------------------------------------------------------------------------------
    def meta_view(self) -> np.ndarray:
        return self.meta

    def drain_info(self) -> dict:
        """What the drain's process needs to open this ring (``policy.drain: process``)."""
        return {"kind": "cuda", "capacity": self.bytes.capacity, "mode": self.mode, "check_at": self._check_at,
                "device": self.torch_device.index, "ipc": self.ipc_handle, **self.share.describe()}

    # --- copy-out at the next step (model's thread) ----------------------------------------------
    def end_step(self, aborted: bool = False, device: bool = False) -> None:
        ctrl = self.current
        closing = ctrl is not None and not ctrl.ended and ctrl.copied is None
        super().end_step(aborted, device)
        if (not self.copy_at_step or not closing or aborted or not ctrl.nbytes
                or torch.cuda.is_current_stream_capturing() or not self._copy_lock.acquire(blocking=False)):
            return                             # (lock busy: the drain is claiming steps, maybe this one)
        try:
            if ctrl.copied is None:
                if self._step_done is None:    # recorded where the latest step's forward ended
                    self._step_done = torch.cuda.Event()
                    self._drain_stream = torch.cuda.ExternalStream(int(self._stream), device=self.torch_device)
                self._step_done.record(torch.cuda.current_stream(self.torch_device))
                ctrl.copied = "marked"         # _step_done now follows this step's forward
        finally:
            self._copy_lock.release()

    def _before_step(self) -> None:
        ctrl = self.current
        if ctrl is None or not self.copy_at_step or not ctrl.nbytes or (ctrl.copied not in (None, "marked")):
            return                             # nothing to copy, or the drain has it already
        if not self._copy_out(ctrl):
            self._gap_seq = ctrl.end_seq       # left to the drain: later steps wait until it is drained

    def _copy_out(self, ctrl: StepControl) -> bool:
        """Queue ``ctrl``'s block to staging on the drain stream behind ``_step_done``; never waits.
        Staging is reserved in step order (the exporter frees it in order): not while an older step
        left to the drain is still pending."""
        if (ctrl.copied != "marked" or ctrl.nbytes > min(self._stage.capacity // 4, PACED_PIECE)
                or self._gap_seq >= self.freed_seq
                or torch.cuda.is_current_stream_capturing() or torch.cuda.current_device() != self.torch_device.index):
            return False
        if not self._copy_lock.acquire(blocking=False):
            return False                       # the drain is claiming steps right now
        try:
            if ctrl.copied != "marked":
                return True                    # the drain took it meanwhile: reserved in order
            with self._stage_cond:
                got = self._stage.try_reserve(ctrl.nbytes)
            if got is None:
                return False
            dst, end = got
            self._stage_ends[id(ctrl)] = end
            self._drain_stream.wait_event(self._step_done)
            self._calls.d2h(self._staging.ctypes.data + dst, self._payload_ptr + ctrl.base, ctrl.nbytes, self._stream)
            ctrl.copied = (self._staging, dst - ctrl.base)
            self.steps_copied_at_step += 1
            return True
        finally:
            self._copy_lock.release()

    def _copies_done(self) -> None:
        self._calls.record(self._event, self._stream)
        check_call(self._rt.cudaEventSynchronize(self._event))

    def _copy(self, host: int, lo: int, nbytes: int, pinned: bool = True) -> None:
        """Payload ``[lo, lo + nbytes)`` to ``host`` on the drain stream, in pieces of
        ``DRAIN_PIECE`` (``PACED_PIECE`` with ``copy_at_step``), each queued once the one before it
        is done: the copy engine serves queued copies in order, so the engine's own small D2H
        (vLLM's sampled tokens, every step) waits for one piece at most, not for a whole drain batch
        of hundreds of MB (pieces queued at once did not help: module doc)."""
        rt, calls = self._rt, self._calls
        piece = PACED_PIECE if self.copy_at_step else DRAIN_PIECE
        for at in range(0, nbytes, piece):
            if at:
                calls.record(self._event, self._stream)
                check_call(rt.cudaEventSynchronize(self._event))    # (the one call a piece that lets the GIL go)
            calls.d2h(host + at, self._payload_ptr + lo + at, min(piece, nbytes - at), self._stream, pinned)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        rt = self._rt
        self._end_graph = None
        self._site_graphs.clear()
        try:
            torch.cuda.synchronize(self.torch_device)
            check_call(rt.cudaStreamSynchronize(self._stream))
        finally:
            self.meta = self.meta.copy()       # views stay valid for post-mortem reads
            self._meta_words = None
            self._staging = None
            for fn, arg in (*self._drain_side_frees(), (rt.cudaFree, self._payload_ptr),
                            (rt.cudaFreeHost, self._meta_ptr), (rt.cudaHostUnregister, self._registered)):
                if arg is not None:
                    fn(arg)


class CudaRingReader(ChildSide, CudaRing):
    """The child's side of a :class:`CudaRing` drained in another process (``policy.drain:
    process``, :mod:`dmi.ring.share`): the payload ring through its CUDA IPC handle, the meta ring in
    the shared file, and :class:`CudaRing`'s batched, paced copy-out into this process's own pinned
    staging. Made in the store writer's process; no torch CUDA call (cuda-python only)."""

    def __init__(self, info: dict, share, host_bytes: int):
        Ring.__init__(self, info["capacity"], share.meta_records, info["mode"])
        self.share = share
        rt = self._rt = cudart()
        self.torch_device = torch.device("cuda", info["device"])
        self._thread_device = threading.local()
        self.enter_thread()
        handle = rt.cudaIpcMemHandle_t()
        handle.reserved = info["ipc"]
        self._payload_ptr = check_call(rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess))
        self.meta = share.meta
        # (the check's bytes go past the ring and its scratch, where the model's process left room:
        # the payload holds live steps)
        self._drain_side(host_bytes, self._payload_ptr + info["check_at"])
        self.copy_at_step = False
        self._copy_lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        rt = self._rt
        try:
            check_call(rt.cudaStreamSynchronize(self._stream))
        finally:
            self._staging = None
            for fn, arg in (*self._drain_side_frees(), (rt.cudaIpcCloseMemHandle, self._payload_ptr)):
                fn(arg)
