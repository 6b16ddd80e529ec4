"""cuda-python and libcuda calls the CUDA ring makes: the runtime module, error checks, device
pointers Triton and torch accept, and the non-blocking calls made with the GIL held (:class:`AsyncCalls`).
"""
from __future__ import annotations

import ctypes
import warnings

import numpy as np
import torch

from ..errors import CaptureError


def cudart():
    """cuda-python's runtime module (``cuda.bindings.runtime``; ``cuda.cudart`` on older releases)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError as e:
            raise CaptureError("the CUDA ring needs cuda-python. Fix: pip install 'dmi[cuda]' (or set the hook "
                               "spec's engine.ring: cpu for the slower reference path)") from e
    return runtime


def check_call(result):
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


class CudaBytes:
    """Device memory as a uint8 array torch can wrap without a copy (``torch.as_tensor``)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (int(ptr), False),
                                         "version": 3}


def host_array(ptr: int, nbytes: int, dtype=np.uint8) -> np.ndarray:
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


class AsyncCalls:
    """The ring's non-blocking CUDA calls (async copies, event records): through libcuda with
    ``ctypes.PyDLL``, which keeps the GIL across a call that returns in µs. cuda-python lets the GIL
    go in every call, and on a serving host the other thread is waiting for it: each call of the
    engine's thread then waits for a slice of the drain's Python, each call of the drain's forces
    a switch of the engine's thread (H200 host, 32-request steady step: the head slot's copy 49-68
    µs of wall time, an eager row-range copy ~110). Blocking calls (event waits, copies into
    pageable memory) keep cuda-python's and let the GIL go. No libcuda to load (no driver), or
    one that fails :meth:`check`: cuda-python's calls throughout."""

    _SIGNATURES = {
        "cuMemcpyDtoHAsync_v2": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
        "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
        "cuMemcpyDtoDAsync_v2": [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
        "cuEventRecord": [ctypes.c_void_p, ctypes.c_void_p],
    }

    def __init__(self, rt):
        self._rt = rt
        self._kinds = {k: getattr(rt.cudaMemcpyKind, f"cudaMemcpy{k}") for k in ("DeviceToHost", "HostToDevice",
                                                                                 "DeviceToDevice")}
        self._fn = None
        try:
            lib = ctypes.PyDLL("libcuda.so.1")
            fn = {name: getattr(lib, name) for name in self._SIGNATURES}
        except (OSError, AttributeError):
            return
        for name, f in fn.items():
            f.argtypes, f.restype = self._SIGNATURES[name], ctypes.c_int
        self._fn = fn

    @property
    def holds_gil(self) -> bool:
        return self._fn is not None

    def check(self, staging: np.ndarray, device: int, stream, event) -> None:
        """Once, at start: 16 bytes host -> device -> device -> host through libcuda on ``stream``
        (handles and signatures as this driver takes them); on any failure, cuda-python's calls
        from here on, with a warning."""
        if self._fn is None:
            return
        pattern = np.frombuffer(b"dmi-ring-check-1", np.uint8)
        staging[:16], staging[16:32] = pattern, 0
        host = staging.ctypes.data
        try:
            self.h2d(device, host, 16, stream)
            self.d2d(device + 16, device, 16, stream)
            self.d2h(host + 16, device + 16, 16, stream)
            self.record(event, stream)
            check_call(self._rt.cudaEventSynchronize(event))
            ok = bytes(staging[16:32]) == pattern.tobytes()
        except Exception as e:        # (a wrong handle type: the driver says so, it does not crash)
            ok, why = False, e
        else:
            why = "the bytes copied back differ"
        if not ok:
            self._fn = None
            warnings.warn(f"dmi: libcuda through ctypes failed its check ({why}); the CUDA ring's async calls go "
                          f"through cuda-python (slower on a busy host)", RuntimeWarning, stacklevel=2)

    def _call(self, name: str, *args) -> None:
        err = self._fn[name](*args)
        if err != 0:
            raise CaptureError(f"CUDA driver error {err} in {name}{args}. Fix: check the device and its driver "
                               f"(nvidia-smi); if cuda-python's calls work where libcuda's through ctypes fail, "
                               f"report it with the driver's version")

    def d2h(self, host: int, device: int, nbytes: int, stream, pinned: bool = True) -> None:
        if self._fn is None or not pinned:     # (into pageable memory the copy blocks: the GIL must go)
            check_call(self._rt.cudaMemcpyAsync(host, device, nbytes, self._kinds["DeviceToHost"], stream))
        else:
            self._call("cuMemcpyDtoHAsync_v2", host, device, nbytes, int(stream))

    def h2d(self, device: int, host: int, nbytes: int, stream) -> None:
        """(``host`` pinned: the copy does not block.)"""
        if self._fn is None:
            check_call(self._rt.cudaMemcpyAsync(device, host, nbytes, self._kinds["HostToDevice"], stream))
        else:
            self._call("cuMemcpyHtoDAsync_v2", device, host, nbytes, int(stream))

    def d2d(self, dst: int, src: int, nbytes: int, stream) -> None:
        if self._fn is None:
            check_call(self._rt.cudaMemcpyAsync(dst, src, nbytes, self._kinds["DeviceToDevice"], stream))
        else:
            self._call("cuMemcpyDtoDAsync_v2", dst, src, nbytes, int(stream))

    def record(self, event, stream) -> None:
        if self._fn is None:
            check_call(self._rt.cudaEventRecord(event, stream))
        else:
            self._call("cuEventRecord", int(event), int(stream))


class RtEvent:
    """A control buffer's event on the CUDA ring: cuda-python's, recorded on a raw stream handle
    through :class:`AsyncCalls` (``record_on``; a few µs of host time less than torch's Event) and
    waited for as torch's is (``synchronize``)."""

    def __init__(self, rt, calls: AsyncCalls):
        self._rt, self._calls = rt, calls
        self._event = check_call(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming))

    def record_on(self, stream) -> None:
        self._calls.record(self._event, stream)

    def synchronize(self) -> None:
        check_call(self._rt.cudaEventSynchronize(self._event))

    def __del__(self):
        try:
            self._rt.cudaEventDestroy(self._event)
        except Exception:
            pass


class NoEvent:
    def synchronize(self) -> None:
        pass

    def record(self) -> None:
        pass
