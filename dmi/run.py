"""A capture run: the plan, the ring, the drain and exporter threads, and the patched model."""
from __future__ import annotations

import functools
import queue
import threading
import time
from importlib import metadata

import numpy as np
import torch

from .errors import CaptureError
from .exporter import ZarrExporter
from .plan import Plan, check_policy_fits
from .ring import Ring, make_ring
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
        device = next(model.parameters()).device
        self.ring = ring or make_ring(plan.policy, device)
        self.ring.setup(plan, self.dtype, device)
        self.exporter = ZarrExporter(store, plan, str(self.dtype).removeprefix("torch."),
                                     _run_attrs(model, plan) | (attrs or {}), overwrite=overwrite)
        self.store = str(self.exporter.path)
        self.id = register_run(self)
        self.ticket = torch.zeros(1, dtype=torch.int64, device=device)
        self._cuda = device.type == "cuda"
        if self._cuda:   # the site ops mutate it inside CUDA graphs: a static address keeps cudagraphs on
            torch._dynamo.mark_static_address(self.ticket)
        self._step = 0
        self._filters: dict = {}
        self.rows_selected = [0] * len(plan.sites)    # accounting: stored + dropped == selected
        self._not_computed = [0] * len(plan.sites)    # selected rows an engine tensor does not hold (held=)
        self.enabled = True          # False: null mode (sites stay patched, the device flag stays off)
        self._external = False       # the open step was begun outside the forward (graphs, engines)
        self._gen_mask = None        # 2D attention mask generate() prepared for the next forward
        self._mirror: _Mirror | None = None
        filters = list(dict.fromkeys(s.tokens for s in plan.sites))
        self._n_filters = len(filters)
        self._site_info = [(s, s.row_bytes(self.itemsize), filters.index(s.tokens)) for s in plan.sites]
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._exported = 0                   # steps the exporter thread is done with
        self._queue_cond = threading.Condition()
        self._closed = False
        self._detach = None
        self._drain = threading.Thread(target=self._drain_loop, name=f"dmi-drain-{self.id}", daemon=True)
        self._export = threading.Thread(target=self._export_loop, name=f"dmi-export-{self.id}", daemon=True)
        self._drain.start()
        self._export.start()

    # --- host side of a step ----------------------------------------------------------------------
    def begin_step(self, tokens: torch.Tensor, attention_mask=None, position_ids=None, past_len=0) -> None:
        """Begin a step from outside the forward that runs it, with that forward's inputs.

        For forwards whose host code does not run per step (a replayed CUDA graph): call this before
        each replay and :meth:`end_step` after it; the graph's site ops read the step's offsets, rows
        and flags from device tensors this call updates (async H2D on the current stream).
        ``past_len``: an int, a 0-d tensor or a transformers cache (read only without a 2D mask)."""
        self._external = True
        self._begin(tokens, attention_mask, position_ids, past_len)

    def end_step(self) -> None:
        """Close the step begun with :meth:`begin_step` (its forward has been launched)."""
        self._external = False
        self.ring.end_step(device=True)

    def stepped(self, fn, step_inputs):
        """``fn`` (a callable running one forward, e.g. transformers' compiled forward) with the
        step's host work done around it instead of inside it: required when ``fn`` replays a CUDA
        graph (``torch.compile(mode="reduce-overhead")``). ``step_inputs(args, kwargs)`` is the
        adapter's reading of a call: (tokens, attention_mask, position_ids, cache)."""
        @functools.wraps(fn)
        def call(*args, **kwargs):
            self.begin_step(*step_inputs(args, kwargs))
            try:
                out = fn(*args, **kwargs)
            except BaseException:
                self._external = False
                self.ring.end_step(aborted=True)
                raise
            self.end_step()
            return out
        return call

    def note_generation_mask(self, mask) -> None:
        """The 2D attention mask generate() made for the next forward (it passes the model a 4D mask
        with static caches): the token bookkeeping reads padding and positions from it."""
        self._gen_mask = mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None

    def set_enabled(self, enabled: bool) -> None:
        """``False``: null mode. Sites stay patched and the site ops still run (launching their
        kernels on CUDA), but no step is begun, so the device flag stays off and nothing is copied."""
        self.enabled = bool(enabled)
        self.ring.null = not self.enabled

    def step_begin_op(self, tokens, attention_mask, position_ids, past) -> None:
        """``dmi::step_begin``: the host work of an eager forward's step (none inside a graph
        capture or when the step was begun from outside)."""
        if self._external or (self._cuda and torch.cuda.is_current_stream_capturing()):
            return
        self._begin(tokens, attention_mask, position_ids, past)

    def step_end_op(self) -> None:
        """``dmi::step_end``: the device side of the end marker, and the host side in eager forwards."""
        self.ring.device_end()
        if not self._external and not (self._cuda and torch.cuda.is_current_stream_capturing()):
            self.ring.end_step(device=True)

    def _begin(self, tokens: torch.Tensor, attention_mask, position_ids, past) -> None:
        """HF: a step from the tensors the top-level forward received ([batch, seq] grid)."""
        gen, self._gen_mask = self._gen_mask, None
        if not self.enabled:
            return
        batch, seq = int(tokens.shape[0]), int(tokens.shape[1])
        mask_t = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2 else None
        if mask_t is None and gen is not None and gen.shape[0] == batch and gen.shape[1] >= seq:
            mask_t = gen
        m = self._mirror
        if (mask_t is not None and mask_t.device.type != "cpu" and seq == 1 and m is not None
                and m.batch == batch and mask_t.shape[1] == m.total + 1):
            # a decode step of the same batch (the mask grew by one column): its token is real, as
            # generate() guarantees, and positions advance by one. No device read, no sync.
            m.total += 1
            m.last_pos = m.last_pos + 1
            st = StepTokens(step=self._step, batch=batch, seq=1, rows=m.arange, request=m.req, position=m.last_pos,
                            phase=m.decode, local=m.zeros)
            self._begin_tokens(st, m.pad)
            return
        mask = mask_t.detach().cpu().numpy() if mask_t is not None else None
        pos = position_ids.detach().cpu().numpy() if position_ids is not None and mask is None else None
        past_len = 0 if mask is not None else _past_int(past)
        st = step_tokens(self._step, batch, seq, self.requests, attention_mask=mask, position_ids=pos, past_len=past_len)
        pad = (mask == 0).sum(axis=1) if mask is not None else np.zeros(batch, np.int64)
        if mask is not None:
            last = mask.astype(np.int64).sum(axis=1) - 1
            total = mask.shape[1]
        else:
            last = np.broadcast_to(pos[:, -1] if pos is not None else np.int64(past_len + seq - 1), (batch,))
            total = past_len + seq
        self._mirror = _Mirror(batch, total, np.array(last, np.int64), np.asarray(self.requests.current(batch), np.int64),
                               np.asarray(pad, np.int64))
        self._begin_tokens(st, pad)

    def begin_tokens(self, st: StepTokens, pad: np.ndarray, *, keep: dict | None = None,
                     held: dict | None = None) -> None:
        """Any engine: begin a step whose real rows the adapter already knows (``st.step`` is
        ignored: the run numbers steps), from outside the forward; :meth:`end_step` closes it.
        ``pad``: per batch row, key columns before the request's first key.

        keep: ``{site index: bool mask over st's rows}``, rows a site may keep on top of its token
        filter (vLLM: per-request site sets). held: ``{name: (index, n)}`` for sites whose anchor
        says ``rows: name``, an engine tensor of ``n`` rows holding only some rows of the step
        (vLLM's logits: one per request); ``index`` (int64 over st's rows) is each row's row in it,
        -1 where the engine never computes it (counted as not computed). The ring sees such a
        tensor like HF's ``logits_to_keep`` output, the last ``n`` rows of the step: the adapter
        sets ``st.local`` of a held row to ``st.seq - n + index``."""
        self._external = True
        if self.enabled:
            self._begin_tokens(st, pad, keep, held)

    def _begin_tokens(self, st: StepTokens, pad: np.ndarray, keep: dict | None = None,
                      held: dict | None = None) -> None:
        st.step = self._step
        selections: list = [None] * self._n_filters
        wanted = []
        for s, row_bytes, f in self._site_info:      # per site: (plan, bytes per row, token filter index)
            base = selections[f]
            if base is None:
                state = self._filters.setdefault(s.tokens, FilterState())
                sel = select(st, s.tokens, state)
                base = selections[f] = (sel, st.rows[sel])
            sel, rows = base
            if keep is not None and s.index in keep:
                sel = sel[keep[s.index][sel]]
                rows = st.rows[sel]
            if held is not None and s.anchor.get("rows") in held:
                index, n = held[s.anchor["rows"]]
                at = index[sel]
                self.rows_selected[s.index] += int((at < 0).sum())
                self._not_computed[s.index] += int((at < 0).sum())
                sel, rows = sel[at >= 0], st.seq - n + at[at >= 0]
            self.rows_selected[s.index] += len(sel)
            if len(sel):
                wanted.append((s.index, sel, rows, len(sel) * row_bytes, s.priority))
        self.ring.begin_step(self._step, st, pad, wanted)
        self._step += 1

    def capture(self, site_index: int, x: torch.Tensor) -> None:
        """``dmi::capture``: the ring backend copies the step's selected rows of ``x``."""
        self.ring.capture(self.plan.sites[site_index], x)

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
                self.ring.release_host(ctrl)
                with self._queue_cond:
                    self._queued_bytes -= nbytes
                    self._exported += 1
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
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every step begun so far is drained and handed to the store (True), or the
        timeout passed (False). The run stays open."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queue_cond:
            while self._exported < self.ring.stats.steps:
                if self.ring.error is not None:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._queue_cond.wait(0.01 if left is None else min(left, 0.01))
        self.ring.raise_if_failed()
        return True

    def stats(self) -> dict:
        st = self.ring.stats
        return {"steps": st.steps, "records": st.records, "bytes_captured": st.bytes_captured,
                "bytes_drained": st.bytes_drained, "stall_seconds": round(st.stall_seconds, 6),
                "not_run": st.not_run, "dropped_captures": len(st.drops),
                "dropped_bytes": sum(d.bytes for d in st.drops), "requests": len(self.requests.ids)}

    def set_request_ids(self, ids: list[str]) -> None:
        """Name the rows of the next batch that starts (else they are r0, r1, ...)."""
        self.requests.set_next(list(ids))

    def close(self, error: BaseException | None = None) -> None:
        """Flush everything captured and close the store. ``error``: the caller failed (the
        store is then marked ``failed``, not ``closed``, though all it holds is consistent)."""
        if self._closed:
            return
        self.ring.end_step(aborted=error is not None)       # a step whose forward never finished
        self._external = False
        self._closed = True
        self._drain.join()
        self._export.join()
        self.ring.close()
        if self._detach is not None:
            self._detach()
        unregister_run(self.id)
        clean = self.ring.error is None and error is None
        summary = self.stats() | {"error": None if error is None else f"{type(error).__name__}: {error}",
                                  "drops": list(self.ring.stats.drops),
                                  "rows_dropped": {s.name: sum(d.rows for d in self.ring.stats.drops if d.site == s.index)
                                                   for s in self.plan.sites},
                                  "rows_selected": {s.name: self.rows_selected[s.index] for s in self.plan.sites},
                                  "rows_stored": {self.plan.sites[i].name: n for i, n in self.exporter.rows_stored.items()},
                                  "rows_not_computed": {self.plan.sites[i].name: n + self._not_computed[i]
                                                        for i, n in self.exporter.rows_not_computed.items()}}
        self.exporter.close(summary, clean=clean)
        self.ring.raise_if_failed()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(error=exc)

    def __repr__(self) -> str:
        return f"<dmi.Run {self.plan.family} sites={len(self.plan.sites)} store={self.store!r}>"


class _Mirror:
    """Host copy of what a decode step needs about the current batch (no device reads)."""
    __slots__ = ("batch", "total", "last_pos", "req", "pad", "arange", "zeros", "decode")

    def __init__(self, batch: int, total: int, last_pos: np.ndarray, req: np.ndarray, pad: np.ndarray):
        self.batch, self.total, self.last_pos, self.req, self.pad = batch, total, last_pos, req, pad
        self.arange = np.arange(batch, dtype=np.int64)
        self.zeros = np.zeros(batch, np.int64)
        self.decode = np.ones(batch, np.int8)


def _past_int(past) -> int:
    """The past length from an int, a 0-d tensor (read: a device sync) or a transformers cache."""
    if past is None:
        return 0
    if hasattr(past, "get_seq_length"):
        past = past.get_seq_length()
    return int(past)


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
