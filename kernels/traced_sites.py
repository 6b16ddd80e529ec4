"""Which sites of a :class:`dmi.kernels.kernel_ring.KernelRing` compiled code captures as traced
torch ops (:mod:`dmi.kernels.traced`), and what each needs: its view of the payload ring, its
scratch rows, its row size.
"""
from __future__ import annotations

import torch

from ..errors import CaptureError
from ..graph_inputs import static_inputs
from .traced import TracedSite, register, scratch_at


TRACED_ROW_BYTES = 256 << 10  # traced sites' rows are at most this big (16 scratch rows or more)


class TracedSites:
    """The traced captures' side of the kernel ring (a mixin of
    :class:`dmi.kernels.kernel_ring.KernelRing`, whose site launches and scratch it reads)."""

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
            static_inputs(view)
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
