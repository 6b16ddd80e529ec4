"""A capture run: the plan, the ring, the drain and exporter threads, and the patched model."""
from __future__ import annotations

import queue
import threading
import time
from importlib import metadata

import numpy as np
import torch

from .errors import CaptureError
from .exporter import ZarrExporter
from .gather import gather
from .plan import Plan, check_policy_fits
from .ring import CpuRing, Ring
from .siteop import register_run, unregister_run
from .tokens import FilterState, RequestTable, StepTokens, select, step_tokens

_STOP = object()


class Run:
    """Returned by :func:`dmi.load`. Use ``run.model`` as usual; ``run.close()`` (or ``with``) flushes."""

    def __init__(self, model: torch.nn.Module, plan: Plan, store: str, *, overwrite: bool = False,
                 attrs: dict | None = None, ring: Ring | None = None):
        self.model = model
        self.plan = plan
        self.dtype = next(model.parameters()).dtype
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        check_policy_fits(plan, self.itemsize)
        self.requests = RequestTable()
        self.ring = ring or CpuRing(plan.policy.ring_bytes, plan.policy.meta_records, plan.policy.mode)
        self.exporter = ZarrExporter(store, plan, str(self.dtype).removeprefix("torch."),
                                     _run_attrs(model, plan) | (attrs or {}), overwrite=overwrite)
        self.store = str(self.exporter.path)
        self.id = register_run(self)
        self.ticket = torch.zeros(1, dtype=torch.int64, device=next(model.parameters()).device)
        self._step = 0
        self._filters: dict = {}
        self.rows_selected = [0] * len(plan.sites)    # accounting: stored + dropped == selected
        self._rows: dict[int, torch.Tensor] = {}
        self._pad: torch.Tensor | None = None
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._queue_cond = threading.Condition()
        self._closed = False
        self._detach = None
        self._drain = threading.Thread(target=self._drain_loop, name=f"dmi-drain-{self.id}", daemon=True)
        self._export = threading.Thread(target=self._export_loop, name=f"dmi-export-{self.id}", daemon=True)
        self._drain.start()
        self._export.start()

    # --- host side of a step (called from dmi::step_begin / dmi::step_end) ----------------------
    def begin_step(self, tokens: torch.Tensor, attention_mask, position_ids, past_len: int) -> None:
        """HF: a step from the tensors the top-level forward received ([batch, seq] grid)."""
        batch, seq = tokens.shape[0], tokens.shape[1]
        mask = attention_mask.detach().cpu().numpy() if attention_mask is not None and attention_mask.ndim == 2 else None
        pos = position_ids.detach().cpu().numpy() if position_ids is not None else None
        st = step_tokens(self._step, batch, seq, self.requests, attention_mask=mask, position_ids=pos, past_len=past_len)
        pad = (mask == 0).sum(axis=1) if mask is not None else np.zeros(batch, np.int64)
        self.begin_tokens(st, pad)

    def begin_tokens(self, st: StepTokens, pad: np.ndarray) -> None:
        """Any engine: a step whose real rows the adapter already knows (``st.step`` is ignored:
        the run numbers steps). ``pad``: per batch row, key columns before the request's first key."""
        st.step = self._step
        selections: dict = {}
        wanted = []
        for s in self.plan.sites:
            if s.tokens not in selections:
                state = self._filters.setdefault(s.tokens, FilterState())
                selections[s.tokens] = select(st, s.tokens, state)
            sel = selections[s.tokens]
            self.rows_selected[s.index] += len(sel)
            if len(sel):
                wanted.append((s.index, sel, st.rows[sel], len(sel) * s.row_bytes(self.itemsize), s.priority))
        ctrl = self.ring.begin_step(self._step, st, pad, wanted)
        device = self.ticket.device
        self._rows = {i: torch.from_numpy(slot.rows).to(device) for i, slot in ctrl.slots.items()}
        self._pad = torch.from_numpy(np.asarray(pad, np.int64)).to(device)
        self._step += 1

    def capture(self, site_index: int, x: torch.Tensor) -> None:
        ctrl = self.ring.current
        if ctrl is None or ctrl.ended or site_index not in ctrl.slots:
            return
        slot = ctrl.slots[site_index]
        site = self.plan.sites[site_index]
        with torch.no_grad():
            outs, src_seq = gather(x.detach(), site, self._rows[site_index], ctrl.tokens.seq, ctrl.tokens.batch,
                                   self._pad, self.dtype)
        n = outs[0].shape[0]
        flat = torch.cat([o.contiguous().reshape(-1).view(torch.uint8).cpu() for o in outs])
        if flat.numel() > slot.capacity:
            raise CaptureError(f"{site.name}: {flat.numel()} bytes exceed the {slot.capacity} reserved")
        self.ring.payload[slot.offset:slot.offset + flat.numel()].copy_(flat)
        self.ring.publish_record(slot.seq, ctrl.step, site_index, slot.offset, flat.numel(), n, src_seq)
        self.ring.stats.bytes_captured += flat.numel()

    def end_step(self) -> None:
        self.ring.end_step()

    # --- threads ----------------------------------------------------------------------------------
    def _drain_loop(self) -> None:
        idle = 1e-4
        try:
            while True:
                ctrl = self.ring.drain_ready()
                if ctrl is None:
                    if self._closed and not self.ring.pending:
                        break
                    time.sleep(idle)
                    idle = min(idle * 2, 2e-3)
                    continue
                idle = 1e-4
                records = self.ring.drain_step(ctrl)
                nbytes = sum(len(r[2]) for r in records)
                with self._queue_cond:   # host budget: wait for the exporter before staging more
                    while self._queued_bytes and self._queued_bytes + nbytes > self.plan.policy.host_bytes:
                        if self.ring.error:
                            return
                        self._queue_cond.wait(0.05)
                    self._queued_bytes += nbytes
                self._queue.put((ctrl, records, nbytes))
        except BaseException as e:    # surfaces in the caller's next step or close
            self._fail(e)
        finally:
            self._queue.put(_STOP)

    def _export_loop(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                ctrl, records, nbytes = item
                if self.ring.error is None:
                    self.exporter.write_step(ctrl, records, self.requests.ids)
                with self._queue_cond:
                    self._queued_bytes -= nbytes
                    self._queue_cond.notify_all()
        except BaseException as e:
            self._fail(e)
            with self._queue_cond:
                self._queued_bytes = 0
                self._queue_cond.notify_all()

    def _fail(self, e: BaseException) -> None:
        if self.ring.error is None:
            self.ring.error = e
        with self.ring.cond:
            self.ring.cond.notify_all()

    # --- lifecycle ------------------------------------------------------------------------------
    def stats(self) -> dict:
        st = self.ring.stats
        return {"steps": st.steps, "records": st.records, "bytes_captured": st.bytes_captured,
                "bytes_drained": st.bytes_drained, "stall_seconds": round(st.stall_seconds, 6),
                "not_run": st.not_run, "dropped_captures": len(st.drops),
                "dropped_bytes": sum(d.bytes for d in st.drops), "requests": len(self.requests.ids)}

    def set_request_ids(self, ids: list[str]) -> None:
        """Name the rows of the next batch that starts (else they are r0, r1, ...)."""
        self.requests.set_next(list(ids))

    def close(self) -> None:
        if self._closed:
            return
        self.ring.end_step(aborted=False)
        self._closed = True
        self._drain.join()
        self._export.join()
        if self._detach is not None:
            self._detach()
        unregister_run(self.id)
        clean = self.ring.error is None
        summary = self.stats() | {"drops": list(self.ring.stats.drops),
                                  "rows_dropped": {s.name: sum(d.rows for d in self.ring.stats.drops if d.site == s.index)
                                                   for s in self.plan.sites},
                                  "rows_selected": {s.name: self.rows_selected[s.index] for s in self.plan.sites},
                                  "rows_stored": {self.plan.sites[i].name: n for i, n in self.exporter.rows_stored.items()},
                                  "rows_not_computed": {self.plan.sites[i].name: n
                                                        for i, n in self.exporter.rows_not_computed.items()}}
        self.exporter.close(summary, clean=clean)
        self.ring.raise_if_failed()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<dmi.Run {self.plan.family} sites={len(self.plan.sites)} store={self.store!r}>"


def _run_attrs(model, plan: Plan) -> dict:
    versions = {}
    for dist in ("dmi", "torch", "transformers", "zarr", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    cfg = getattr(model, "config", None)
    return {"dmi_format": 1, "family": plan.family, "arch_spec": plan.arch_file, "hook_spec_file": plan.hook_file,
            "hook_spec": plan.hook_spec, "policy": vars(plan.policy), "versions": versions,
            "model": {"name_or_path": getattr(cfg, "_name_or_path", None), "model_type": getattr(cfg, "model_type", None),
                      "dtype": str(next(model.parameters()).dtype), "class": type(model).__name__},
            "sites": [s.name for s in plan.sites]}
