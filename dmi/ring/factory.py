"""The ring backend for a model's device (``make_ring``), and the drain process's reader of it
(``open_reader``).
"""
from __future__ import annotations

from ..errors import PolicyError
from ..settings import EngineOptions
from ..kernels.traced import trace_mode
from .cpu import CpuRing
from .protocol import Ring
from .share import CpuRingReader, RingShare


def make_ring(policy, device, *, kind: str | None = None, traced: str | None = None,
              engine: EngineOptions = EngineOptions()) -> Ring:
    """The ring backend for a model on ``device``: ``CudaRing`` on CUDA devices, else ``CpuRing``.

    ``kind`` (or the hook spec's ``engine.ring``): ``cpu`` forces the reference path (on a GPU
    too: captures go through ``dmi.gather`` and a host copy), ``cuda`` forces the CUDA ring,
    ``interpret`` runs the CUDA ring's Triton kernels on host memory (``TRITON_INTERPRET=1``, tests).
    ``traced`` (or ``engine.traced``): where compiled code captures as traced ops (kernel rings:
    ``KernelRing``'s ``traced``). ``engine``: the rest of the hook spec's engine options."""
    # (checked for every ring: the CPU ring has no traced captures)
    traced = trace_mode(traced if traced is not None else engine.traced)
    kind = kind or engine.ring or ("cuda" if getattr(device, "type", str(device)) == "cuda" else "cpu")
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
                        max_step_tokens=policy.max_step_tokens, device=device, share=share, traced=traced,
                        pdl=engine.pdl, copy_at_step=engine.copy_at_step)
    if remote:
        raise PolicyError(f"policy.drain: process needs the cpu or cuda ring, not {kind!r} (engine.ring)",
                          key="policy.drain", fix="remove engine.ring (or set it to cpu or cuda), or use "
                                                  "policy.drain: thread")
    if kind == "interpret":     # the CUDA path's kernels in host memory (needs TRITON_INTERPRET=1)
        from ..kernels.kernel_ring import InterpretRing
        return InterpretRing(policy.ring_bytes, policy.meta_records, policy.mode, host_bytes=policy.host_bytes,
                             max_step_tokens=policy.max_step_tokens, traced=traced, pdl=engine.pdl)
    raise ValueError(f"unknown ring backend {kind!r} (engine.ring): use 'cpu', 'cuda' or 'interpret'")


def open_reader(info: dict, host_bytes: int):
    """The drain process's reader of the ring ``info`` describes (its ``drain_info()``)."""
    share = RingShare.attach(info)
    if info["kind"] == "cuda":
        from ..kernels.cuda_ring import CudaRingReader
        return CudaRingReader(info, share, host_bytes)
    return CpuRingReader(info, share)
