"""Tensors that compiled code reads or writes in place between steps (a run's ticket, an
intervention's mask, a ring's control words)."""
from __future__ import annotations

import torch


def static_inputs(*tensors: torch.Tensor | None) -> None:
    """Mark each CUDA tensor of ``tensors`` as a static address: a CUDA graph (``reduce-overhead``,
    cudagraph trees) then reads it where it is, instead of copying it into a graph-owned buffer at
    every replay, and sees the values written between replays. Other devices: nothing to do."""
    for t in tensors:
        if t is not None and t.device.type == "cuda":
            torch._dynamo.mark_static_address(t)
