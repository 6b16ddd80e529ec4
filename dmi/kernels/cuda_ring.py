"""Ring² on a CUDA device, its memory managed through cuda-python.

* payload ring: ``cudaMalloc`` (outside PyTorch's caching allocator and any KV pool);
* meta ring: ``cudaHostAlloc(mapped)`` host memory the capture kernels write through its device
  pointer and the drain thread polls as a numpy array (no CUDA call on the hot path);
* host staging: ``cudaHostAlloc`` pinned memory (``policy.host_bytes``), a byte ring the drain
  copies into and the exporter frees in order;
* the drain's own non-blocking stream and a blocking-sync event.

Per step, ``publish_control`` writes the step's control words (armed flag, offsets, sequence
numbers, row counts, row indices, padding) into one of a few pinned buffers and copies them with
one async H2D on the current stream, ahead of the forward's kernels. The site ops launch the
Triton kernels of ``dmi.kernels.capture``; those read only the device control tensor, so the same
launches replayed from a CUDA graph capture each new step. Bookkeeping (reservation, backpressure,
drops, FIFO release) is the shared :class:`dmi.ring.Ring`'s.
"""
from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import torch

from ..errors import CaptureError, PolicyError
from ..gather import check_max_keys, select_rows, site_dtype, token_major
from ..ring import META_DTYPE, ByteRing, Ring, StepControl
from . import capture as K

DEFAULT_MAX_ROWS = 65536      # rows one token filter may select in one step (policy.max_step_tokens overrides)
CTRL_BUFFERS = 4              # pinned control buffers in flight


def cudart():
    """cuda-python's runtime module (``cuda.bindings.runtime``; ``cuda.cudart`` on older releases)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError as e:
            raise CaptureError("the CUDA ring needs cuda-python. Fix: pip install 'dmi[cuda]' (or set DMI_RING=cpu "
                               "for the slower reference path)") from e
    return runtime


def _ok(result):
    """Unpack a cuda-python ``(err, value...)`` tuple, raising on error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        rt = cudart()
        msg = rt.cudaGetErrorString(err)[1]
        raise CaptureError(f"CUDA error {int(err)}: {msg.decode() if isinstance(msg, bytes) else msg}")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


class DevicePointer:
    """A raw device address Triton accepts as a pointer argument (``data_ptr`` + ``dtype``)."""
    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype = int(ptr), dtype

    def data_ptr(self) -> int:
        return self.ptr


def _host_array(ptr: int, nbytes: int, dtype=np.uint8) -> np.ndarray:
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


class KernelRing(Ring):
    """Ring² whose captures run the Triton kernels of ``dmi.kernels.capture``: control tensors,
    launches, end markers. Where the payload, meta ring and staging live is the subclass's:
    :class:`CudaRing` (device + mapped pinned memory) or :class:`InterpretRing` (host memory, for
    the Triton interpreter on CPU)."""
    device_publishes_end = True

    def __init__(self, capacity: int, meta_records: int, mode: str = "full", *, max_step_tokens: int | None = None,
                 device=None):
        super().__init__(capacity, meta_records, mode)
        self.torch_device = torch.device(device) if device is not None else torch.device("cpu")
        self.is_cuda = self.torch_device.type == "cuda"
        self.max_rows = int(max_step_tokens or DEFAULT_MAX_ROWS)
        self.device_bytes = self.pinned_bytes = 0
        self.graph_mode = False   # tests: launch as while capturing a CUDA graph (no host values baked in)

    def setup(self, plan, dtype, device) -> None:
        super().setup(plan, dtype, device)
        dev = self.torch_device
        n_sites = len(plan.sites)
        n_filters = max(1, len({s.tokens for s in plan.sites}))
        self.site_words = K.G_WORDS + K.S_WORDS * n_sites
        self.ctrl_words = self.site_words + (n_filters + 1) * self.max_rows
        self.ctrl = torch.zeros(self.ctrl_words, dtype=torch.int64, device=dev)
        self.counters = torch.zeros(n_sites + 2, dtype=torch.int32, device=dev)
        self.fence_idx = n_sites + 1
        self.arange = torch.arange(self.max_rows, dtype=torch.int64, device=dev)
        self._host_ctrl = [torch.zeros(self.ctrl_words, dtype=torch.int64, pin_memory=self.is_cuda)
                           for _ in range(CTRL_BUFFERS)]
        self._host_ctrl_np = [t.numpy() for t in self._host_ctrl]
        self._host_sites = [a[K.G_WORDS:self.site_words].reshape(n_sites, K.S_WORDS) for a in self._host_ctrl_np]
        self._ctrl_events = [torch.cuda.Event() if self.is_cuda else _NoEvent() for _ in range(CTRL_BUFFERS)]
        self._ctrl_next = 0
        self.sites = {s.index: _SiteLaunch(s, dtype, dev) for s in plan.sites}
        self.geometry: tuple[int, int] | None = None     # (batch, seq) of the latest step
        self.device_bytes += (self.ctrl_words + self.max_rows) * 8 + self.counters.numel() * 4
        self.pinned_bytes += CTRL_BUFFERS * self.ctrl_words * 8

    # --- host: per step -----------------------------------------------------------------------------
    def publish_control(self, ctrl: StepControl) -> None:
        k = self._ctrl_next
        self._ctrl_next = (k + 1) % CTRL_BUFFERS
        self._ctrl_events[k].synchronize()     # that buffer's previous H2D has been consumed
        h = self._host_ctrl_np[k]
        tok = ctrl.tokens
        batch, seq = tok.batch, tok.seq
        self.geometry = (batch, seq)
        sw = self.site_words
        hs = self._host_sites[k]
        hs[:, K.S_ENABLED] = 0
        pos = sw
        pad = np.asarray(ctrl.pad, np.int64)
        if pos + len(pad) > self.ctrl_words:
            raise PolicyError(f"batch of {len(pad)} rows exceeds the CUDA ring's control buffer "
                              f"(policy.max_step_tokens={self.max_rows}). Fix: raise policy.max_step_tokens")
        h[pos:pos + len(pad)] = pad
        pad_start = pos
        pos += len(pad)
        starts: dict[int, int] = {}
        ctrl.dev_rows_start = rows_start = {}
        fields = []
        for site, slot in ctrl.slots.items():
            key = id(slot.sel)                 # sites with one token filter share its selection
            start = starts.get(key)
            n = len(slot.rows)
            if start is None:
                if n > self.max_rows or pos + n > self.ctrl_words:
                    raise PolicyError(f"step {ctrl.step} selects {n} rows for {self.plan.sites[site].name}, more than "
                                      f"policy.max_step_tokens={self.max_rows}. Fix: raise policy.max_step_tokens")
                h[pos:pos + n] = slot.rows
                start = starts[key] = pos
                pos += n
            rows_start[site] = start
            fields.append((site, slot.offset, slot.seq, n, start, 1))
        if fields:
            f = np.array(fields, np.int64)
            hs[f[:, 0]] = f[:, 1:]
        h[:K.G_WORDS] = (1, ctrl.step, batch, seq, ctrl.end_seq, pad_start, 0, 0)
        ctrl.dev_pad_start = pad_start
        self.ctrl[:pos].copy_(self._host_ctrl[k][:pos], non_blocking=True)
        self._ctrl_events[k].record()

    def device_end(self) -> None:
        K.launch_end(self.ctrl, self.meta_dev, self.counters, meta_records=self.meta_records, fence_idx=self.fence_idx)

    def publish_end(self, ctrl: StepControl, flags: int = 0) -> None:
        """Host-published end marker (an aborted step or a forward that never finished): wait for
        what the device already has in flight, then write the record, ``seq`` last."""
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)
        self.ctrl[:1].zero_()                  # disarm: a stray replay captures nothing
        rec = self.meta[ctrl.end_seq % self.meta_records]
        rec["step"], rec["site"], rec["flags"] = ctrl.step, -1, flags
        rec["offset"] = rec["nbytes"] = rec["rows"] = rec["src_seq"] = 0
        rec["seq"] = ctrl.end_seq

    def capture(self, site, x: torch.Tensor) -> None:
        cur = self.current if self.current is not None and not self.current.ended else None
        capturing = self.graph_mode or (self.is_cuda and torch.cuda.is_current_stream_capturing())
        if not capturing:
            if cur is None:
                if not self.null:
                    return
            elif site.index not in cur.slots:
                return                         # nothing selected (or dropped): no launch in eager mode
        eager = cur if not capturing and cur is not None else None
        self.sites[site.index].launch(self, x.detach(), eager)     # detached: no autograd graph


class CudaRing(KernelRing):
    """Ring² on a CUDA device; memory, stream and events through cuda-python."""

    def __init__(self, capacity: int, meta_records: int, mode: str = "full", *, host_bytes: int = 256 << 20,
                 max_step_tokens: int | None = None, device=None):
        dev = torch.device(device) if device is not None else torch.device("cuda")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__(capacity, meta_records, mode, max_step_tokens=max_step_tokens, device=dev)
        rt = self._rt = cudart()
        torch.cuda.init()                      # torch and cuda-python share the primary context
        self._thread_device = threading.local()
        self._use_device()
        self._payload_ptr = _ok(rt.cudaMalloc(capacity))
        meta_bytes = meta_records * META_DTYPE.itemsize
        flags = rt.cudaHostAllocMapped | rt.cudaHostAllocPortable
        self._meta_ptr = _ok(rt.cudaHostAlloc(meta_bytes, flags))
        ctypes.memset(self._meta_ptr, 0, meta_bytes)
        self.meta = _host_array(self._meta_ptr, meta_bytes, META_DTYPE)
        self._meta_dev = _ok(rt.cudaHostGetDevicePointer(self._meta_ptr, 0))
        self.staging_bytes = max(int(host_bytes), 1 << 20)
        self._staging_ptr = _ok(rt.cudaHostAlloc(self.staging_bytes, rt.cudaHostAllocPortable))
        self._staging = _host_array(self._staging_ptr, self.staging_bytes)
        self._stage = ByteRing(self.staging_bytes)
        self._stage_cond = threading.Condition()
        self._stage_ends: dict[int, int] = {}
        self._stream = _ok(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
        self._event = _ok(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming | rt.cudaEventBlockingSync))
        self.payload = DevicePointer(self._payload_ptr, torch.uint8)
        self.meta_dev = DevicePointer(self._meta_dev, torch.int64)
        self.device_bytes = capacity
        self.pinned_bytes = meta_bytes + self.staging_bytes
        self._closed = False

    def _use_device(self) -> None:
        if not getattr(self._thread_device, "set", False):
            _ok(self._rt.cudaSetDevice(self.torch_device.index))
            self._thread_device.set = True

    # --- drain ----------------------------------------------------------------------------------------
    def meta_view(self) -> np.ndarray:
        return self.meta

    def fetch(self, ctrl: StepControl, recs: list[np.void]) -> list[np.ndarray]:
        if not recs:
            return []
        self._use_device()
        lo = min(int(r["offset"]) for r in recs)
        hi = max(int(r["offset"]) + int(r["nbytes"]) for r in recs)
        span = hi - lo
        if span > self._stage.capacity:
            buf = np.empty(span, np.uint8)       # larger than all of host staging: a pageable copy
            base = 0
            dst = buf.ctypes.data
        else:
            with self._stage_cond:
                while True:
                    got = self._stage.try_reserve(span)
                    if got is not None:
                        break
                    if self.error is not None:
                        raise CaptureError("drain stopped") from self.error
                    self._stage_cond.wait(0.05)
            base, end = got
            self._stage_ends[id(ctrl)] = end
            buf = self._staging
            dst = self._staging_ptr + base
        if span:
            rt = self._rt
            _ok(rt.cudaMemcpyAsync(dst, self._payload_ptr + lo, span, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                                   self._stream))
            _ok(rt.cudaEventRecord(self._event, self._stream))
            _ok(rt.cudaEventSynchronize(self._event))
        out = []
        for r in recs:
            a = base + int(r["offset"]) - lo
            out.append(buf[a:a + int(r["nbytes"])])
            self.stats.bytes_captured += int(r["nbytes"])
        return out

    def release_host(self, ctrl: StepControl) -> None:
        end = self._stage_ends.pop(id(ctrl), None)
        if end is not None:
            with self._stage_cond:
                self._stage.release(end)
                self._stage_cond.notify_all()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        rt = self._rt
        try:
            torch.cuda.synchronize(self.torch_device)
            _ok(rt.cudaStreamSynchronize(self._stream))
        finally:
            self.meta = self.meta.copy()       # views stay valid for post-mortem reads
            self._staging = None
            for fn, arg in ((rt.cudaEventDestroy, self._event), (rt.cudaStreamDestroy, self._stream),
                            (rt.cudaFree, self._payload_ptr), (rt.cudaFreeHost, self._meta_ptr),
                            (rt.cudaFreeHost, self._staging_ptr)):
                fn(arg)


class _SiteLaunch:
    """What one site's launches need, computed once: its mode, geometry rules, head indices."""

    def __init__(self, site, dtype: torch.dtype, device: torch.device):
        self.site = site
        self.layout = site.anchor["layout"]
        self.dtype = site_dtype(site, dtype)      # a direct copy needs the engine tensor in this dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.plain = site.heads is None and "key" not in site.dims and not site.reduce
        self.heads = torch.tensor(site.heads, device=device) if site.heads is not None else None
        self.row_bytes = [o.row_elems * o.itemsize(self.itemsize) for o in site.outputs]

    def _batch(self, x, ring, eager):
        if self.layout[0] != "token":
            return x.shape[self.layout.index("batch")]
        if eager is not None:
            return eager.tokens.batch
        if ring.geometry is None:
            if ring.null:
                return 1                       # null mode: the kernel exits on the device flag
            raise CaptureError(f"{self.site.name}: the step's batch size is unknown while capturing a CUDA graph. "
                               f"Fix: run one forward of the same shape (or call run.begin_step) before capturing")
        return ring.geometry[0]

    def launch(self, ring: CudaRing, x: torch.Tensor, eager: StepControl | None) -> None:
        site = self.site
        batch = self._batch(x, ring, eager)
        if eager is not None:
            step_seq = eager.tokens.seq
        else:
            step_seq = ring.geometry[1] if ring.geometry is not None else None
        common = dict(site_index=site.index, meta_records=ring.meta_records, fence_idx=ring.fence_idx)
        geo = direct_geo = None
        if self.plain and x.dtype == self.dtype:
            direct_geo = K.direct_geometry(x, self.layout, batch)
        if direct_geo is not None:
            src_seq, *geo = direct_geo
            seq = step_seq if step_seq is not None else src_seq
            if eager is not None:
                slot = eager.slots[site.index]
                c = len(slot.rows)
                drow, n = None, c
                if src_seq < seq:             # the tensor holds only the last src_seq positions
                    held = slot.rows % seq >= seq - src_seq
                    n = int(held.sum())
                    drow = _upload(np.where(held, np.cumsum(held) - 1, -1).astype(np.int64), x.device)
                K.launch(x, ring.payload, ring.ctrl, ring.meta_dev, ring.counters, K=c, src_seq=src_seq, geometry=geo,
                         mode=K.DIRECT, row_bytes0=self.row_bytes[0], c_arg=c, n_arg=n, drow=drow, seq_arg=seq,
                         **common)
                return
            k_rows = min(ring.max_rows, batch * seq)
            drow, cnt = None, None
            if src_seq < seq:
                drow, cnt, _ = _device_compaction(ring, site, k_rows, seq, src_seq)
            K.launch(x, ring.payload, ring.ctrl, ring.meta_dev, ring.counters, K=k_rows, src_seq=src_seq, geometry=geo,
                     mode=K.DIRECT, row_bytes0=self.row_bytes[0], drow=drow, cnt=cnt, cnt_idx=0 if cnt is not None else -1,
                     seq_arg=seq, **common)
            return
        # IDENTITY: the reference's torch ops on the device, then a raw row copy
        flat, src_seq = token_major(x, self.layout, batch)
        seq = step_seq if step_seq is not None else src_seq
        hdr = K.G_WORDS + K.S_WORDS * site.index
        if eager is not None:
            slot = eager.slots[site.index]
            rows_np = slot.rows
            if src_seq < seq:
                held = rows_np % seq >= seq - src_seq
                rows_np = rows_np[held]
                idx = _upload((rows_np // seq) * src_seq + rows_np % seq - (seq - src_seq), x.device)
                b_of_row = _upload(rows_np // seq, x.device) if "key" in site.dims else None
            else:
                cand = ring.ctrl.narrow(0, eager.dev_rows_start[site.index], len(rows_np))
                b_of_row = cand // seq
                idx = b_of_row * src_seq + cand % seq
            n = len(rows_np)
            pad = ring.ctrl.narrow(0, eager.dev_pad_start, eager.tokens.batch) if "key" in site.dims else None
            if "key" in site.dims and n:
                check_max_keys(site, x.shape[self.layout.index("key")],
                               int(np.asarray(eager.pad)[rows_np // seq].min()))
            outs = select_rows(x, flat, site, idx, b_of_row, pad, self.dtype, heads=self.heads, check_keys=False)
            self._copy(ring, outs, n, src_seq, c_arg=n, n_arg=n, **common)
            return
        k_rows = min(ring.max_rows, batch * seq)
        ar = ring.arange[:k_rows]
        start = ring.ctrl.narrow(0, hdr + K.S_ROWS_START, 1)
        cand = ring.ctrl.index_select(0, (start + ar).clamp_(max=ring.ctrl_words - 1))
        b_of_row = cand // seq
        s = cand % seq - (seq - src_seq)
        idx = (b_of_row * src_seq + s).clamp_(0, max(flat.shape[0] - 1, 0))
        b_of_row = b_of_row.clamp_(0, batch - 1)
        pad = None
        if "key" in site.dims:
            pad_start = ring.ctrl.narrow(0, K.G_PAD_START, 1)
            pad = ring.ctrl.index_select(0, (pad_start + ring.arange[:batch]).clamp_(max=ring.ctrl_words - 1))
        outs = select_rows(x, flat, site, idx, b_of_row, pad, self.dtype, heads=self.heads, check_keys=False)
        drow = cnt = None
        if src_seq < seq:
            drow, cnt, _ = _device_compaction(ring, site, k_rows, seq, src_seq)
        self._copy(ring, outs, k_rows, src_seq, drow=drow, cnt=cnt, cnt_idx=0 if cnt is not None else -1, **common)

    def _copy(self, ring, outs, k_rows, src_seq, **kw) -> None:
        w, wdt = K.word_dtype(*self.row_bytes)
        srcs = [o.contiguous().reshape(o.shape[0], -1).view(wdt) for o in outs]
        geometry = [(s.stride(0), s.shape[1]) for s in srcs]
        K.launch(srcs[0], ring.payload, ring.ctrl, ring.meta_dev, ring.counters, K=k_rows, src_seq=src_seq,
                 geometry=geometry, mode=K.IDENTITY, row_bytes0=self.row_bytes[0],
                 src1=srcs[1] if len(srcs) > 1 else None, row_bytes1=self.row_bytes[1] if len(srcs) > 1 else 0, **kw)


class InterpretRing(KernelRing):
    """The kernels' ring with every buffer in host memory: with ``TRITON_INTERPRET=1`` the Triton
    kernels run on the CPU, so CI exercises the CUDA path's control words, kernels and records."""

    def __init__(self, capacity: int, meta_records: int, mode: str = "full", *, max_step_tokens: int | None = None,
                 device=None, **_):
        super().__init__(capacity, meta_records, mode, max_step_tokens=max_step_tokens, device="cpu")
        self.payload = torch.zeros(capacity, dtype=torch.uint8)
        self.meta = np.zeros(meta_records, META_DTYPE)
        self.meta_dev = torch.from_numpy(self.meta.view(np.int64))

    def meta_view(self) -> np.ndarray:
        return self.meta

    def copy_out(self, offset: int, nbytes: int) -> np.ndarray:
        data = self.payload[offset:offset + nbytes].numpy().copy()
        self.stats.bytes_captured += nbytes
        return data


class _NoEvent:
    def synchronize(self) -> None:
        pass

    def record(self) -> None:
        pass


def _device_compaction(ring: CudaRing, site, k_rows: int, seq: int, src_seq: int):
    """Graph-safe (drow, n) for a tensor holding the last ``src_seq`` of ``seq`` positions: the
    destination row of each candidate row (-1: not held) and the number held, on the device."""
    hdr = K.G_WORDS + K.S_WORDS * site.index
    ar = ring.arange[:k_rows]
    start = ring.ctrl.narrow(0, hdr + K.S_ROWS_START, 1)
    c = ring.ctrl.narrow(0, hdr + K.S_ROWS, 1)
    cand = ring.ctrl.index_select(0, (start + ar).clamp_(max=ring.ctrl_words - 1))
    held = (cand % seq >= seq - src_seq) & (ar < c)
    dst = torch.cumsum(held, 0) - 1
    drow = torch.where(held, dst, torch.full_like(dst, -1))
    n = held.sum().reshape(1)
    return drow, n, held


def _upload(a: np.ndarray, device) -> torch.Tensor:
    """An eager-only H2D of a small host array through pinned memory (no stream sync; torch's
    pinned allocator keeps the source until the copy has run)."""
    t = torch.from_numpy(np.ascontiguousarray(a, np.int64))
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
