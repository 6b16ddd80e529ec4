"""The reference backend: payload and meta ring in host memory, captures gathered in torch.
"""
from __future__ import annotations

import numpy as np

from ..errors import CaptureError
from .layout import StepControl
from .protocol import Ring
from .records import END_MARKER, META_DTYPE


class CpuRing(Ring):
    """Ring² with the payload and the meta ring in host memory; the capture op runs in torch
    (``dmi.gather`` on the model's device, then a copy to host memory). It is the reference path:
    every other backend must store the same bytes."""

    def __init__(self, capacity: int, meta_records: int, mode: str = "full", share=None):
        """``share``: a :class:`dmi.ring.share.RingShare` (``policy.drain: process``) holding the
        payload and the meta ring, which the drain's process maps too."""
        super().__init__(capacity, meta_records, mode)
        import torch
        self.share = share
        if share is None:
            self.payload = torch.empty(capacity, dtype=torch.uint8)
            self.meta = np.zeros(meta_records, META_DTYPE)
        else:
            self.payload = torch.from_numpy(share.payload)
            self.meta = share.meta
        self._payload_np = self.payload.numpy()
        self._rows: dict = {}
        self._pad, self._keys = None, 0

    def meta_view(self) -> np.ndarray:
        return self.meta

    def publish_control(self, ctrl: StepControl) -> None:
        import torch
        device = getattr(self, "device", None) or "cpu"
        self._rows = {i: torch.from_numpy(slot.rows).to(device) for i, slot in ctrl.slots.items()}
        self._pad = torch.from_numpy(np.asarray(ctrl.pad, np.int64)).to(device)
        self._keys = ctrl.keys

    def capture(self, site, x, addend=None, side: bool = False) -> None:
        ctrl = self.current
        if ctrl is not None and ctrl.stream is not None and not ctrl.ended:
            self.stream_slot(site.index)
            ctrl = self.current
        if ctrl is None or ctrl.ended or site.index not in ctrl.slots:
            return                  # (null mode, nothing selected: before the imports, once per site and step)
        import torch
        from ..gather import gather
        if addend is not None:
            x = x + addend
        slot = ctrl.slots[site.index]
        with torch.no_grad():
            outs, src_seq = gather(x.detach(), site, self._rows[site.index], ctrl.tokens.seq, ctrl.tokens.batch,
                                   self._pad, self.dtype, self._keys)
        n = outs[0].shape[0]
        flat = torch.cat([o.contiguous().reshape(-1).view(torch.uint8).cpu() for o in outs])
        if flat.numel() > slot.capacity:
            raise CaptureError(f"{site.name}: {flat.numel()} bytes exceed the {slot.capacity} reserved")
        self.payload[slot.offset:slot.offset + flat.numel()].copy_(flat)
        self.publish_record(slot.seq, ctrl.step, site.index, slot.offset, flat.numel(), n, src_seq)
        self.stats.bytes_captured += flat.numel()

    def publish_end(self, ctrl: StepControl, flags: int = 0) -> None:
        self.publish_record(ctrl.end_seq, ctrl.step, END_MARKER, 0, 0, 0, 0, flags)

    def copy_out(self, offset: int, nbytes: int) -> np.ndarray:
        return self._payload_np[offset:offset + nbytes].copy()

    def drain_info(self) -> dict:
        """What the drain's process needs to open this ring (``policy.drain: process``)."""
        return {"kind": "cpu", "capacity": self.bytes.capacity, "mode": self.mode, **self.share.describe()}
