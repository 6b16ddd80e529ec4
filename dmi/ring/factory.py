"""The ring backend for a model's device (``make_ring``), and the drain process's reader of it
(``open_reader``).
"""
from __future__ import annotations

from .. import settings
from ..errors import PolicyError
from ..kernels.traced import trace_mode
from .cpu import CpuRing
from .protocol import Ring
from .share import CpuRingReader, RingShare


def make_ring(policy, device, *, kind: str | None = None, traced: str | None = None) -> Ring:
    """The ring backend for a model on ``device``: ``CudaRing`` on CUDA devices, else ``CpuRing``.

    ``kind`` (or the environment variable ``DMI_RING``): ``cpu`` forces the reference path (on a GPU
    too: captures go through ``dmi.gather`` and a host copy), ``cuda`` forces the CUDA ring,
    ``interpret`` runs the CUDA ring's Triton kernels on host memory (``TRITON_INTERPRET=1``, tests).
    ``traced``: where compiled code captures as traced ops (kernel rings: ``KernelRing``'s ``traced``)."""
    traced = trace_mode(traced)          # (checked for every ring: the CPU ring has no traced captures)
    kind = kind or settings.get("DMI_RING") or ("cuda" if getattr(device, "type", str(device)) == "cuda" else "cpu")
    remote, share = getattr(policy, "drain", "thread") == "process", None
    if remote and kind in ("cpu", "cuda"):
        try:
            share = RingShare.create(policy.meta_records, policy.ring_bytes if kind == "cpu" else 0)
        except OSError as e:
            raise PolicyError(f"policy.drain: process: no room for the ring's shared file ({e})", key="policy.drain",
                              fix="free space in /dev/shm (or the temp directory), lower policy.meta_records (and, "
                                  "on CPU, policy.ring_bytes), or use policy.drain: thread") from e
    if kind == "cpu":
        return CpuRing(policy.ring_bytes, policy.meta_records, policy.mode, share=share)
    if kind == "cuda":
        from ..kernels.cuda_ring import CudaRing
        return CudaRing(policy.ring_bytes, policy.meta_records, policy.mode, host_bytes=policy.host_bytes,
                        max_step_tokens=policy.max_step_tokens, device=device, share=share, traced=traced)
    if remote:
        raise PolicyError(f"policy.drain: process needs the cpu or cuda ring, not {kind!r} (DMI_RING)",
                          key="policy.drain", fix="unset DMI_RING, or use policy.drain: thread")
    if kind == "interpret":     # the CUDA path's kernels in host memory (needs TRITON_INTERPRET=1)
        from ..kernels.kernel_ring import InterpretRing
        return InterpretRing(policy.ring_bytes, policy.meta_records, policy.mode, host_bytes=policy.host_bytes,
                             max_step_tokens=policy.max_step_tokens, traced=traced)
    raise ValueError(f"unknown ring backend {kind!r} (DMI_RING): use 'cpu', 'cuda' or 'interpret'")


def open_reader(info: dict, host_bytes: int):
    """The drain process's reader of the ring ``info`` describes (its ``drain_info()``)."""
    share = RingShare.attach(info)
    if info["kind"] == "cuda":
        from ..kernels.cuda_ring import CudaRingReader
        return CudaRingReader(info, share, host_bytes)
    return CpuRingReader(info, share)
