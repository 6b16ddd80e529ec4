"""A capture run: the plan, the ring, the drain and exporter threads, and the patched model."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
from importlib import metadata

import numpy as np
import torch

from .errors import CaptureError, PolicyError, SpecError, StoreError
from .exporter import TICK_S, ZarrExporter
from .plan import Plan, check_policy_fits
from .spec import parse_bytes
from .ring import Ring, SiteSlot, StepControl, StepLayout, make_ring
from .ringshare import EXPORTED, StepSender
from .siteop import register_run, unregister_run
from .stall import Stall
from .subscribers import Subscribers, Subscription
from .tokens import FilterState, RequestTable, StepTokens, select, step_tokens

_STOP = object()
DRAIN_INTERVAL_S = 0.1       # the drain copies ready steps out in batches this far apart ...
DRAIN_FAST_S = 0.0005        # ... or this far apart while a flush or close waits for it
DRAIN_BATCH = 64             # steps per batch at most
DRAIN_WINDOW_S = 0.025       # drain windows (Run.drain_window) at most this often
LAYOUTS_KEPT = 16            # laid-out steps remembered by their rows (an engine's batch sizes come and go)

log = logging.getLogger("dmi")


def never_computed(summary: dict) -> list[str]:
    """Sites that selected rows and stored none because none was computed (none dropped): a module
    that never ran, or rows the engine never computed. Nothing was lost, but nothing was captured."""
    sel, stored, dropped, missing = (summary[k] for k in ("rows_selected", "rows_stored", "rows_dropped",
                                                          "rows_not_computed"))
    return [n for n, k in sel.items() if k and not stored.get(n) and not dropped.get(n) and missing.get(n) == k]


class Run:
    """Returned by :func:`dmi.load`. Use ``run.model`` as usual; ``run.close()`` (or ``with``) flushes."""

    def __init__(self, model: torch.nn.Module, plan: Plan, store: str, *, overwrite: bool = False,
                 attrs: dict | None = None, ring: Ring | None = None, resume: bool = False, tp=None,
                 traced: str | None = None):
        self.model = model
        self.plan = plan
        self.dtype = next(model.parameters()).dtype
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        check_policy_fits(plan, self.itemsize)
        self.requests = RequestTable()
        device = next(model.parameters()).device
        self._remote = plan.policy.drain == "process"     # the drain runs in the writer's child (dmi.ringshare)
        if self._remote and tp is not None:
            raise SpecError("policy.drain: process is not supported with tensor parallelism (each rank drains its "
                            "shard in its own process)", file=plan.hook_file or None, key="policy.drain",
                            fix="remove policy.drain or set it to thread")
        self.ring = ring or make_ring(plan.policy, device, traced=traced)
        self.ring.setup(plan, self.dtype, device)
        if tp is None:
            exporter = ZarrExporter
            if plan.writer == "process":
                from .writer import ProcessExporter as exporter
            try:
                self.exporter = exporter(store, plan, str(self.dtype).removeprefix("torch."),
                                         _run_attrs(model, plan) | (attrs or {}), overwrite=overwrite, resume=resume)
            except BaseException:
                if self.ring.share is not None:
                    self.ring.share.unlink()
                raise
        else:      # tensor parallelism (dmi.shards.TPContext): plan = this rank's part; the store holds tp.plan
            if plan.writer == "process":
                raise SpecError("store.writer: process is not supported with tensor parallelism (each rank writes "
                                "its shard from its own exporter thread)", file=plan.hook_file or None,
                                key="store.writer", fix="remove store.writer or set it to thread")
            from .shards import ShardedExporter
            self.exporter = ShardedExporter(store, plan, str(self.dtype).removeprefix("torch."),
                                            _run_attrs(model, tp.plan) | (attrs or {}), overwrite=overwrite,
                                            resume=resume, tp=tp)
        if self._remote:
            if self.ring.share is None:
                raise PolicyError(f"policy.drain: process: the run was given a {type(self.ring).__name__} not made "
                                  f"for it", key="policy.drain", fix="let dmi make the ring, or use policy.drain: thread")
            try:
                self.exporter.attach_ring(self.ring.drain_info())
            finally:
                self.ring.share.unlink()
        self.store = str(self.exporter.path)
        self._tp = tp is not None
        self.subscribers = Subscribers(plan, str(self.dtype).removeprefix("torch."))
        self.id = register_run(self)
        self.ticket = torch.zeros(1, dtype=torch.int64, device=device)
        # each site's identity as a tensor the site ops take (dmi.siteop: compiled layers stay alike)
        self.site_tensors = [torch.full((1,), s.index, dtype=torch.int64, device=device) for s in plan.sites]
        self._site_of = {t.data_ptr(): i for i, t in enumerate(self.site_tensors)}
        self._cuda = device.type == "cuda"
        if self._cuda:   # the site ops' inputs (the ticket they mutate) in CUDA graphs: static addresses, never copied
            for t in (self.ticket, *self.site_tensors):
                torch._dynamo.mark_static_address(t)
        self._step = self.exporter.next_step     # resume: numbering goes on after the committed steps
        self.requests.intern(self.exporter.stored_request_ids)   # resume: new requests get new ids
        self._filters: dict = {}
        self.rows_selected = np.zeros(len(plan.sites), np.int64)   # accounting: stored + dropped == selected
        self._not_computed = np.zeros(len(plan.sites), np.int64)   # selected rows an engine tensor does not hold (held=)
        self._counting: list = [None, 0]     # (layout, steps begun with it not yet in the two arrays above)
        self.enabled = True          # False: null mode (sites stay patched, the device flag stays off)
        self.policy_changes: list[dict] = []    # set_limits calls: (step, mode, d2h_bytes_per_s) from then on
        self.close_attrs: dict = {}             # root attributes an engine adapter adds to the close summary
        self._external = False       # the open step was begun outside the forward (graphs, engines)
        self._gen_mask = None        # 2D attention mask generate() prepared for the next forward
        self._mirror: _Mirror | None = None
        self._last_rows = None       # (tokens, held, layout) of the last laid-out step, reused by equal rows
        self._layouts: dict = {}     # the rows a selection reads -> their layout, the last LAYOUTS_KEPT (oldest first)
        self._owner = _StepOwner(self._orphaned)   # the thread driving the steps now (one generate at a time)
        filters = list(dict.fromkeys(s.tokens for s in plan.sites))
        # filters whose selection in a decode step depends only on the batch (no counters, no
        # position windows): decode steps then reuse one StepLayout
        self._stateless_filters = all(f.every_n_steps <= 1 and f.max_per_request is None and f.positions is None
                                      for f in filters)
        self._filter_list = filters
        self._index_sites(plan.sites)
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._parts: list = []               # the drained parts of a streamed step, until its last
        self._exported = 0                   # steps the exporter thread is done with
        self._queue_cond = threading.Condition()
        self._closed = False
        self._detach = None
        self.drain_interval = DRAIN_INTERVAL_S
        self.drain_windows = 0               # drain windows opened (an engine pacing the drain)
        self._window_at = 0.0
        # graph-replayed steps (stepped(), vLLM's decode steps) open a drain window once launched
        self.drain_paced = os.environ.get("DMI_DRAIN_PACED", "1") != "0"
        # stepped() begins the next decode step while the GPU runs this one (DMI_STEP_AHEAD=0: off)
        self.step_ahead = os.environ.get("DMI_STEP_AHEAD", "1") != "0"
        self._ahead: _Ahead | None = None
        self._epoch = 0                      # bumped by changes that a step begun ahead did not see
        self.steps_ahead = [0, 0]            # steps begun ahead: taken by their forward, retracted
        self.thread_cpu_s: dict[str, float] = {}     # CPU seconds of the drain and export threads, once ended
        if self._remote:                     # what the drain thread has handed to the drain process
            self._sender, self._last_sent = StepSender(), 0
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
        self._owner.claim("a step")
        try:
            self._begin(tokens, attention_mask, position_ids, past_len)
        except BaseException:
            self._owner.release_step()      # a step that failed to begin holds nothing
            raise
        self._external = True

    def end_step(self) -> None:
        """Close the step begun with :meth:`begin_step` (its forward has been launched)."""
        self._external = False
        self.ring.end_step(device=True)
        self._owner.release_step()

    def abort_step(self) -> None:
        """Close the open step as aborted (its forward raised); frees the run for other threads."""
        self._retract_ahead()
        self._external = False
        self.ring.end_step(aborted=True)
        self._owner.release_step()

    def _orphaned(self) -> None:
        """The thread that owned the run exited inside a step: close that step as aborted."""
        self._external, self._gen_mask = False, None
        self._retract_ahead()
        self.ring.end_step(aborted=True)

    @contextlib.contextmanager
    def exclusive(self, what: str = "generate"):
        """The calling thread drives this run's steps for the whole block (the HF adapter wraps
        ``generate()`` in it: its steps share the request table and the decode bookkeeping). A step
        or another ``exclusive`` block of a different thread meanwhile raises :class:`CaptureError`.
        A block left by an exception closes the step its forward left open."""
        self._owner.enter(what)
        try:
            yield self
        except BaseException:
            if self._owner.depth == 1:
                self.abort_step()
            raise
        finally:
            if self._owner.depth == 1:
                self._retract_ahead()        # the step begun after the last forward: none came
            self._owner.exit()

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
                self.abort_step()
                raise
            self.end_step()
            self._begin_ahead()      # a graph replay launched: the GPU is busy, the host has time
            self.drain_window()
            return out
        return call

    def note_generation_mask(self, mask) -> None:
        """The 2D attention mask generate() made for the next forward (it passes the model a 4D mask
        with static caches): the token bookkeeping reads padding and positions from it."""
        self._gen_mask = mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None

    def set_limits(self, *, mode: str | None = None, d2h_bytes_per_s: int | str | None = "keep") -> None:
        """Change ``policy.mode`` and ``policy.d2h_bytes_per_s`` of a live run, from the next step
        on (an operator throttling capture without reloading the model; a benchmark sweeping caps
        on one compiled graph). ``d2h_bytes_per_s``: bytes per second (int or a size such as
        ``"2GiB"``), None for uncapped; left out, it stays. Budgets that size memory (ring, host
        staging, meta records) are fixed at load. Each change is listed in the store's
        ``policy_changes`` attribute (step, mode, d2h_bytes_per_s); ``policy.on_store_error`` keeps
        what it was at load."""
        policy = self.plan.policy
        mode = policy.mode if mode is None else mode
        if mode not in ("full", "best_effort"):
            raise PolicyError(f"set_limits: mode {mode!r} is not a policy mode", key="policy.mode",
                              fix="use 'full' or 'best_effort'")
        rate = policy.d2h_bytes_per_s if d2h_bytes_per_s == "keep" else d2h_bytes_per_s
        if rate is not None:
            try:
                rate = parse_bytes(rate)
            except ValueError as e:
                raise PolicyError(f"set_limits: {e}", key="policy.d2h_bytes_per_s",
                                  fix="give a rate such as 2GiB, or None for uncapped") from None
            if rate < 1:
                raise PolicyError(f"set_limits: policy.d2h_bytes_per_s is {rate} bytes/s: nothing could ever be "
                                  f"copied to the host", key="policy.d2h_bytes_per_s",
                                  fix="give a rate such as 2GiB, or None for uncapped")
        self.ring.set_limits(mode, rate)
        self._epoch += 1                 # (a step begun ahead under the old limits is begun again)
        policy.mode, policy.d2h_bytes_per_s = mode, rate
        self.policy_changes.append({"step": self._step, "mode": mode, "d2h_bytes_per_s": rate})

    def set_enabled(self, enabled: bool) -> None:
        """``False``: null mode. Sites stay patched and the site ops still run, but no step is
        begun: inside a CUDA graph their kernels exit on the device flag, which stays off; eager
        calls return on the host. Nothing is copied."""
        self.enabled = bool(enabled)
        self.ring.null = not self.enabled
        self._epoch += 1

    def step_begin_op(self, tokens, attention_mask, position_ids, past) -> None:
        """``dmi::step_begin``: the host work of an eager forward's step (none inside a graph
        capture or when the step was begun from outside)."""
        if self._cuda and torch.cuda.is_current_stream_capturing():
            return
        self._owner.claim("a forward")        # before _external: a step begun outside may be another thread's
        if self._external:
            return
        try:
            self._begin(tokens, attention_mask, position_ids, past)
        except BaseException:
            self._owner.release_step()      # a step that failed to begin (policy, request ids) holds nothing
            raise

    def step_end_op(self) -> None:
        """``dmi::step_end``: the device side of the end marker, and the host side in eager forwards."""
        self.ring.device_end()
        if not self._external and not (self._cuda and torch.cuda.is_current_stream_capturing()):
            self.ring.end_step(device=True)
            self._owner.release_step()

    def _begin(self, tokens: torch.Tensor, attention_mask, position_ids, past) -> None:
        """HF: a step from the tensors the top-level forward received ([batch, seq] grid)."""
        gen, self._gen_mask = self._gen_mask, None
        if not self.enabled:
            self._retract_ahead()
            return
        batch, seq = int(tokens.shape[0]), int(tokens.shape[1])
        mask_t = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2 else None
        if mask_t is None and gen is not None and gen.shape[0] == batch and gen.shape[1] >= seq:
            mask_t = gen
        m = self._mirror
        if (mask_t is not None and seq == 1 and m is not None
                and m.batch == batch and mask_t.shape[1] == m.total + 1 and m.thread == threading.get_ident()):
            # a decode step of the same batch (the mask grew by one column): its token is real, as
            # generate() guarantees, and positions advance by one. No device read, no sync.
            m.total += 1
            ahead = self._ahead
            if ahead is not None and ahead.epoch == self._epoch:    # begun already, as this one
                self._ahead = None
                m.last_pos = ahead.position
                self.ring.take_ahead()
                self._commit(ahead.layout)
                self.steps_ahead[0] += 1
                return
            m.last_pos = m.last_pos + 1
            # the batch's rows again: its first decode step's layout is reused
            self._begin_tokens(self._decode_tokens(m, m.last_pos), m.pad, keys=m.total)
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
        keep = self.requests.batch_capture       # per batch row (None: every request captures)
        self._mirror = _Mirror(batch, total, np.array(last, np.int64), np.asarray(self.requests.current(batch), np.int64),
                               np.asarray(pad, np.int64), keep)
        self._begin_tokens(st if keep is None else st.subset(keep[st.rows // seq]), pad, keys=total)

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
        sets ``st.local`` of a held row to ``st.seq - n + index``. An adapter that repeats a step
        passes the last step's row arrays and ``held`` themselves: the last layout is then taken
        without comparing them (:meth:`_same_rows_layout`)."""
        self._owner.claim("a step")
        if self.enabled:
            try:
                self._begin_tokens(st, pad, keep, held)
            except BaseException:
                self._owner.release_step()
                raise
        self._external = True

    def _decode_tokens(self, m: "_Mirror", position: np.ndarray) -> StepTokens:
        """The rows of a decode step of the mirrored batch at ``position`` (one token per row)."""
        st = StepTokens(step=self._step, batch=m.batch, seq=1, rows=m.arange, request=m.req, position=position,
                        phase=m.decode, local=m.zeros)
        return st if m.keep is None else st.subset(m.keep)    # some requests opted out (set_request_ids)

    def _begin_ahead(self) -> None:
        """After a compiled forward's launch (:meth:`stepped`): begin the batch's next decode step
        now, while the GPU runs this one, so the host work between two of generate()'s forwards
        (where the GPU waits for it: generate() syncs on its stop check every step) shrinks to a
        few checks when that step comes (:meth:`_begin`). Only inside generate() (an ``exclusive``
        block, whose end retracts a step that never came), with stateless token filters (nothing
        counted twice), and only where the step's layout fits now (the ring never waits here; a
        bandwidth cap under best_effort drops what it would drop at the forward, counted once the
        forward takes the step: :meth:`Ring.take_ahead`)."""
        m = self._mirror
        if (self._ahead is not None or not (self.step_ahead and self.enabled and self._stateless_filters)
                or m is None or self._owner.depth == 0 or m.thread != threading.get_ident()):
            return
        position = m.last_pos + 1
        st = self._decode_tokens(m, position)
        try:
            layout = self._layout_for(st, None, None)
            ctrl = self.ring.begin_step(self._step, st, m.pad, layout, ahead=True, keys=m.total + 1)
        except Exception:              # the step's own begin meets (and raises) the same error
            self.ring.retract_ahead()
            return
        if ctrl is not None:
            self._ahead = _Ahead(position, layout, self._epoch)

    def _retract_ahead(self) -> None:
        """Give back the step begun ahead: its forward did not come, or came as another step."""
        if self._ahead is not None:
            self._ahead = None
            self.steps_ahead[1] += self.ring.retract_ahead()

    def _begin_tokens(self, st: StepTokens, pad: np.ndarray, keep: dict | None = None,
                      held: dict | None = None, keys: int = 0) -> None:
        """``keys``: the step's key columns, past and padding included (HF: the 2D mask's width),
        which place a sliding-window layer's keys (dmi.gather.key_shift)."""
        self._retract_ahead()
        st.step = self._step
        layout = self._layout_for(st, keep, held)
        self.ring.begin_step(self._step, st, pad, layout, keys=keys)
        self._commit(layout)

    def _commit(self, layout: StepLayout) -> None:
        """A begun step counts: its selection in the accounting, its number taken."""
        self._count(layout)
        self._step += 1

    def _layout_for(self, st: StepTokens, keep: dict | None, held: dict | None) -> StepLayout:
        """The step's layout: the last step's or a remembered one where its rows are the same."""
        layout = self._same_rows_layout(st, keep, held)
        if layout is None:
            key = _rows_key(st, held) if keep is None and self._stateless_filters else None
            layout = self._layouts.pop(key, None) if key is not None else None
            if layout is None and keep is None:
                layout = self._layout_of(st, held)
            elif layout is None:
                wanted, counts = self._wanted(st, keep, held)
                # laid out as a whole (array operations, slot objects built later by the drain); the ring
                # falls back to its per-capture path where it must drop or wait for the bandwidth cap
                layout = StepLayout(wanted)
                layout.cache["counts"] = counts
            if key is not None:
                self._layouts[key] = layout          # the most recent last
                if len(self._layouts) > LAYOUTS_KEPT:
                    self._layouts.pop(next(iter(self._layouts)))
                self._last_rows = (st, held, layout)
        return layout

    def _same_rows_layout(self, st: StepTokens, keep: dict | None, held: dict | None) -> StepLayout | None:
        """The last laid-out step's layout when this step carries that step's very row arrays and
        held rows (HF's decode steps of one batch; an engine repeating a steady decode step): a few
        identity checks. Rows merely equal in value find their layout by key (:func:`_rows_key`)."""
        last = self._last_rows
        if last is None or keep is not None or not self._stateless_filters:
            return None
        prev, prev_held, layout = last
        if (prev_held is held and prev.seq == st.seq and prev.rows is st.rows and prev.request is st.request
                and prev.phase is st.phase and prev.local is st.local):
            return layout
        return None

    def forget_layouts(self) -> None:
        """Lay the next step out anew (benchmarks that change what a step selects, or time fresh layouts)."""
        self._last_rows = None
        self._layouts.clear()

    def _count(self, layout: StepLayout) -> None:
        """Account a begun step's selection: the layout's rows selected and not computed per site.
        Only once the ring took the step, so a refused step leaves selected = stored + dropped + not
        computed."""
        if layout is self._counting[0]:      # the same layout again (decode steps): counted when it changes
            self._counting[1] += 1
            return
        self._fold_counts()
        self._counting = [layout, 1]

    def _fold_counts(self) -> None:
        """The steps counted against one layout, into the per-site accounting (before it is read)."""
        layout, n = self._counting
        if n:
            sites, selected, missing = layout.cache["counts"]     # one entry per site: a plain fancy-index add
            self.rows_selected[sites] += selected * n
            self._not_computed[sites] += missing * n
        self._counting = [None, 0]

    def _index_sites(self, sites) -> None:
        """The tables a step's layout selects from, for ``sites`` (the plan's, or none: a
        run that begins and ends steps without capturing). Per site: index, bytes per row, index of its token filter, priority,
        held rows it reads (or None); index and filter again as arrays, for a step's accounting
        without a per-site Python loop."""
        self._site_info = [(s.index, s.row_bytes(self.itemsize), self._filter_list.index(s.tokens), s.priority,
                            s.anchor.get("rows")) for s in sites]
        self._site_ids = np.array([i[0] for i in self._site_info], np.int64)
        self._site_filter = np.array([i[2] for i in self._site_info], np.int64)
        self._site_row_bytes = np.array([i[1] for i in self._site_info], np.int64)
        self._site_priority = [i[3] for i in self._site_info]
        self._sources: dict[tuple, tuple] = {}        # held tensors' names -> _source_plan
        self._held_at: dict[str, list[int]] = {}       # held rows name -> positions of the sites reading them
        for i, info in enumerate(self._site_info):
            if info[4] is not None:
                self._held_at.setdefault(info[4], []).append(i)

    def _layout_of(self, st: StepTokens, held: dict | None) -> StepLayout:
        """A step's layout when no request picked its own sites: one selection per token filter,
        the rows each (filter, engine-held tensor) pair holds, then every site's capture from those
        as whole-array operations (what :meth:`_wanted` gives, without a loop over the sites: an
        engine's mixed steps lay out anew every step, the engine's GPU waiting for its host)."""
        bases = []
        for tokens in self._filter_list:
            sel = select(st, tokens, self._filters.setdefault(tokens, FilterState()))
            bases.append((sel, st.rows if len(sel) == len(st) else st.rows[sel]))   # (select is ascending)
        names = tuple(name for name in self._held_at if name in held) if held else ()
        pairs, src, held_pos = self._sources.get(names) or self._source_plan(names)
        arrays, missing = bases, None
        if pairs:
            arrays, missing = list(bases), []
            for f, name in pairs:           # a held tensor's rows: those of the filter's rows it holds
                sel = bases[f][0]
                index, n = held[name]
                at = index[sel]
                ok = at >= 0
                if ok.all():
                    arrays.append((sel, st.seq - n + at))
                    missing.append(0)
                else:
                    arrays.append((sel[ok], st.seq - n + at[ok]))
                    missing.append(len(sel) - len(arrays[-1][0]))
        lens = np.array([len(a[0]) for a in arrays], np.int64)
        n_rows = lens[src]
        nbytes = n_rows * self._site_row_bytes
        selected = lens[self._site_filter]          # a held site's: its filter's, held or not
        not_computed = np.zeros(len(src), np.int64)
        if held_pos is not None:
            not_computed[held_pos] = np.array(missing, np.int64)[src[held_pos] - len(bases)]
        has = n_rows > 0
        if has.all():
            layout = StepLayout.of_arrays(self._site_ids, src, arrays, nbytes, self._site_priority)
        else:
            layout = StepLayout.of_arrays(self._site_ids[has], src[has], arrays, nbytes[has],
                                          lambda: np.asarray(self._site_priority)[has].tolist())
        layout.cache["counts"] = (self._site_ids, selected, not_computed)
        return layout

    def _source_plan(self, names: tuple) -> tuple:
        """For the engine-held tensors ``names``: the (filter, name) pairs whose rows sites read,
        each site's array in :meth:`_layout_of` (its filter's, or its pair's after the filters),
        and the positions of the sites reading a pair (None: none)."""
        n_filters = len(self._filter_list)
        pairs, src, held_pos = [], self._site_filter.copy(), []
        for i, (_, _, f, _, name) in enumerate(self._site_info):
            if name in names:
                if (f, name) not in pairs:
                    pairs.append((f, name))
                src[i] = n_filters + pairs.index((f, name))
                held_pos.append(i)
        got = self._sources[names] = (pairs, src, np.array(held_pos, np.int64) if held_pos else None)
        return got

    def _wanted(self, st: StepTokens, keep: dict | None = None, held: dict | None = None) -> tuple[list, tuple]:
        """(site, sel, rows, bytes, priority) of each site with rows this step, and the step's
        accounting for :meth:`_count`: arrays of sites, rows selected, of those not computed.

        One selection per token filter (a stateful filter counts the step once); a site takes its
        filter's rows as they are unless ``keep`` masks them or it reads ``held`` rows (below)."""
        bases = []
        for tokens in self._filter_list:
            sel = select(st, tokens, self._filters.setdefault(tokens, FilterState()))
            bases.append((sel, st.rows[sel]))
        lens = [len(b[0]) for b in bases]
        selected = np.asarray(lens, np.int64)[self._site_filter]
        not_computed = np.zeros(len(selected), np.int64)
        own: dict[int, tuple] = {}              # site position -> its own (sel, rows)
        mine = range(len(self._site_info)) if keep is not None else [
            i for name in (held or ()) for i in self._held_at.get(name, ())]
        for i in mine:
            site, _, f, _, held_rows = self._site_info[i]
            sel, rows = bases[f]
            if keep is not None and site in keep:
                sel = sel[keep[site][sel]]
                rows = st.rows[sel]
            missing = 0
            if held is not None and held_rows in held:
                index, n = held[held_rows]
                at = index[sel]
                missing = int((at < 0).sum())
                sel, rows = sel[at >= 0], st.seq - n + at[at >= 0]
            own[i] = (sel, rows)
            selected[i] = len(sel) + missing
            not_computed[i] = missing
        wanted = []
        append = wanted.append
        for i, (site, row_bytes, f, priority, _) in enumerate(self._site_info):
            sel, rows = own.get(i, bases[f])
            if len(sel):
                append((site, sel, rows, len(sel) * row_bytes, priority))
        return wanted, (self._site_ids, selected, not_computed)

    def site_of(self, site_id: torch.Tensor) -> int:
        """The index of the site whose ``site_tensors`` entry this is (by address: no device read)."""
        return self._site_of[site_id.data_ptr()]

    def capture(self, site_index: int, x: torch.Tensor, addend: torch.Tensor | None = None, side: bool = False) -> None:
        """``dmi::capture``: the ring backend copies the step's selected rows of ``x`` (``dmi::capture_sum``:
        of ``x + addend``). ``side``: a compile pass chained this capture to the graph's others
        (:func:`dmi.kernels.side.chain_captures`): its kernel may run on a side stream."""
        self.ring.capture(self.plan.sites[site_index], x, addend, side)

    def drain_window(self) -> None:
        """An engine's cue that its host is about to wait for the GPU: it just launched a step
        whose GPU time exceeds what is left of its host work (a forward replayed as a CUDA graph:
        :meth:`stepped` after each call, vLLM's decode steps). The drain runs now, where its Python
        (which holds the GIL the engine's thread needs) and its copies cost the engine nothing,
        instead of at its next interval, which may fall where the host is the bottleneck (vLLM's
        mixed prefill steps, HF's host work between two steps). Manual CUDA-graph loops
        (:meth:`begin_step` / :meth:`end_step`) may call it after each replay's launch.

        At most one window every ``DRAIN_WINDOW_S``: each wake-up costs the drain and exporter
        threads a fixed share of CPU (H200 host, 38 sites: a window every step took them from
        ~0.14 to ~0.47 ms of CPU a step; one every 25 ms, ~0.21), so a few steps go out together.
        None with ``DMI_DRAIN_PACED=0`` (the timer alone) or in null mode (nothing to drain)."""
        if not (self.drain_paced and self.enabled):
            return
        now = time.monotonic()
        if now - self._window_at < DRAIN_WINDOW_S:
            return
        self._window_at = now
        self.drain_windows += 1
        self.ring.urgent.set()

    # --- threads ----------------------------------------------------------------------------------
    def _drain_loop(self) -> None:
        """The drain thread: a batch of ended steps each time one is due (:meth:`_until_due`),
        copied out here and queued for the exporter, or (``policy.drain: process``) handed to the
        child that drains them."""
        batch = self._hand_over if self._remote else self._copy_out
        try:
            while True:
                self._until_due()
                if batch() or (self._closed and (not self.ring.pending or self.ring.error is not None)):
                    break
        except BaseException as e:    # surfaces in the caller's next step or close
            self._fail(e)
        finally:
            self.thread_cpu_s["drain"] = time.thread_time()
            self._queue.put(_STOP)

    def _until_due(self) -> None:
        """Sleep without the GIL until the next batch is due or the ring needs room now (``urgent``)."""
        ring = self.ring
        ring.urgent.wait(DRAIN_FAST_S if self._closed or ring.hurry else self.drain_interval)
        ring.urgent.clear()

    def _copy_out(self) -> bool:
        """Copy the ready steps out and queue them for the exporter. True: stop (the run failed)."""
        ring, budget = self.ring, self.plan.policy.host_bytes
        while ctrls := ring.drain_ready(DRAIN_BATCH):
            # the steps go to the exporter in chunks, one handover (queue, wake-ups) a chunk,
            # not a step: both threads take the engine's GIL for it
            chunk = []
            for ctrl, records in zip(ctrls, ring.drain_steps(ctrls)):
                nbytes = sum(len(r[2]) for r in records)
                with self._queue_cond:   # host budget: wait for the exporter before staging more
                    if chunk and self._queued_bytes + nbytes > budget:
                        self._queue.put(chunk)    # (what the exporter can free meanwhile)
                        chunk = []
                    stall = None
                    while self._queued_bytes and self._queued_bytes + nbytes > budget:
                        if ring.error:
                            return True
                        stall = stall or Stall(f"the drain waiting for the exporter (step {ctrl.step})",
                                               ring.stall_timeout, lambda: self._queue_figures(nbytes))
                        self._queue_cond.wait(0.05)
                        stall.check(self._queued_bytes)
                    self._queued_bytes += nbytes
                chunk.append((ctrl, records, nbytes))
            if chunk:
                self._queue.put(chunk)
        return False

    def _queue_figures(self, nbytes: int = 0) -> str:
        """The exporter queue's figures for an error."""
        return (f"{nbytes:,} bytes to hand over; {self._queued_bytes:,} bytes queued for the store of "
                f"policy.host_bytes {self.plan.policy.host_bytes:,}; {self._exported} of {self.ring.stats.steps} "
                f"steps exported; store {self.store}")

    def _hand_over(self) -> bool:
        """``policy.drain: process``: send the newly ended steps to the child as descriptors and
        take its progress (freed ring space, steps written) from the shared words. True: stop."""
        ring, exp = self.ring, self.exporter
        if exp.drain_error is not None:
            raise CaptureError(f"the drain process stopped: {exp.drain_error}")
        if ring.error is not None:
            return True
        with ring.cond:
            ring.reclaim()
            new = []                           # pending steps not sent yet: the newest ones
            for ctrl in reversed(ring.pending):
                if ctrl.end_seq <= self._last_sent:
                    break
                new.append(ctrl)
        ended = list(itertools.takewhile(lambda c: c.ended, reversed(new)))
        if ended:
            exp.send_steps([self._sender.describe(c) for c in ended], self.requests.ids, ring.stats.drops)
            self._last_sent = ended[-1].end_seq
        with self._queue_cond:
            exported = int(ring.share.words[EXPORTED])
            if exported != self._exported:
                self._exported = exported
                self._queue_cond.notify_all()
        return False

    def _export_loop(self) -> None:
        exporter = self.exporter
        while True:
            try:   # wake up now and then: a failed write surfaces, and commits go on while idle
                item = self._queue.get(timeout=TICK_S)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if isinstance(item, list):         # a chunk of drained steps: (step, records, bytes) in step order
                self._export_steps(item)
                continue
            try:
                if item is None:
                    exporter.tick()
                else:                          # flush(): commit what was handed over
                    try:
                        exporter.sync()
                    finally:
                        item.set()
            except BaseException as e:     # surfaces in the caller's next step, flush or close
                self._fail(e)
        self.thread_cpu_s["export"] = time.thread_time()

    def _export_steps(self, steps: list) -> None:
        """Write a chunk of drained steps (after a failure the exporter accounts each as dropped
        instead), freeing each one's staging as it goes. The parts of a streamed step are held
        until its last part and written as one step."""
        whole = 0
        try:
            for drained, records, _ in steps:
                ctrl, held = drained, [drained]
                if ctrl.stream is not None:
                    self._parts.append((ctrl, records))
                    if ctrl.partial:
                        continue
                    held = [c for c, _ in self._parts]       # each part's host buffer, freed in order
                    ctrl, records = _merged(self._parts)
                    self._parts = []
                whole += 1
                try:
                    self.exporter.write_step(ctrl, records, self.requests.ids, self.ring.stats.drops)
                    if self.subscribers:
                        self.subscribers.deliver(ctrl, records, self.requests.ids)
                except BaseException as e:     # surfaces in the caller's next step, flush or close
                    self._fail(e)
                finally:
                    for part in held:
                        self.ring.release_host(part)
        finally:
            with self._queue_cond:
                self._queued_bytes -= sum(n for *_, n in steps)
                self._exported += whole
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
        if self._owner.thread in (None, threading.get_ident()):
            self._retract_ahead()         # (a step begun ahead outside generate(): stepped() called directly)
        self.ring.hurry = True            # the drain polls fast until this returns
        self.ring.urgent.set()
        try:
            return self._flush(timeout)
        finally:
            self.ring.hurry = False

    def _flush(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        ring = self.ring
        stall = Stall("flush waiting for the drain and the store", ring.stall_timeout,
                      lambda: f"{ring.describe_room()}; {self._queue_figures()}")
        with self._queue_cond:
            while self._exported < ring.stats.steps:
                if ring.error is not None:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._queue_cond.wait(0.01 if left is None else min(left, 0.01))
                stall.check((self._exported, self._queued_bytes, ring.bytes.tail, ring.stats.bytes_drained))
        if ring.error is None and self._export.is_alive():    # and on disk, committed
            done = threading.Event()
            self._queue.put(done)
            stall = Stall("flush waiting for the store's commit", ring.stall_timeout, lambda: f"store {self.store}")
            while not done.wait(0.01):
                if ring.error is not None:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    return False
                stall.check(self.exporter.store_bytes)
        ring.raise_if_failed()
        return True

    def stats(self) -> dict:
        st, exp = self.ring.stats, self.exporter
        # the ring's (best_effort: ring_full, bandwidth; counted whole, written ones released) + the
        # store's (sink: the store failed)
        by_reason = dict(st.drops.by_reason)
        for d in exp.drops:
            by_reason[d.reason] = by_reason.get(d.reason, 0) + 1
        return {"steps": st.steps, "records": st.records, "bytes_captured": st.bytes_captured,
                "bytes_drained": st.bytes_drained, "stall_seconds": round(st.stall_seconds, 6),
                "stall_bandwidth_seconds": round(st.stall_bandwidth_seconds, 6),
                "not_run": st.not_run, "streamed_steps": st.streamed_steps, "stream_parts": st.stream_parts,
                "stream_buffer_bytes": getattr(self.ring, "part_buffer_bytes", 0),
                "dropped_captures": len(st.drops) + len(exp.drops),
                "dropped_bytes": st.drops.bytes + sum(d.bytes for d in exp.drops), "drops_by_reason": by_reason,
                "requests": len(self.requests.ids), "committed_step": exp.committed_step,
                "store_bytes": exp.store_bytes, "store_error": None if exp.error is None else str(exp.error)}

    def subscribe(self, fn, sites: str | list[str] | None = None) -> Subscription:
        """Call ``fn(captures)`` with each drained step's captures of ``sites`` (names, canonical
        names or globs of the captured sites; None: all): ``captures`` maps each site's full name to
        a :class:`dmi.subscribers.Capture` (its rows, their request, position and phase, the values
        as numpy arrays the function may keep). Calls run on the export thread, in step order, each
        step once; an exception stops capture and reaches the caller at its next step, ``flush()``
        or ``close()``. Steps already drained are not replayed. ``.cancel()`` on the returned
        subscription stops it."""
        if self._tp:
            raise CaptureError("subscribe: not supported with tensor parallelism (each rank drains only its "
                               "shard of a site). Fix: subscribe on a run without tensor parallelism")
        if self._closed:
            raise CaptureError(f"subscribe: the run of {self.store} is closed. Fix: subscribe before close()")
        if self._remote:
            raise CaptureError("subscribe: policy.drain: process drains the ring in another process, so no rows "
                               "reach this one. Fix: use policy.drain: thread for live subscribers")
        return self.subscribers.add(fn, sites)

    def set_request_ids(self, ids: list[str] | None = None, *, capture=None) -> None:
        """Name the rows of the next batch this thread starts (else they are r0, r1, ...) and,
        with ``capture`` (one bool per batch row), say which of its requests are captured at all:
        rows of a request with ``False`` are never selected, stored or counted (opt-in per request).
        ``ids=None`` with ``capture`` keeps the made-up ids."""
        self.requests.set_next(None if ids is None else list(ids), capture)

    def close(self, error: BaseException | None = None) -> None:
        """Flush everything captured and close the store. ``error``: the caller failed (the
        store is then marked ``failed``, not ``closed``, though all it holds is consistent)."""
        if self._closed:
            return
        self._retract_ahead()
        self.ring.end_step(aborted=error is not None)       # a step whose forward never finished
        self._external = False
        self._closed = True
        self.ring.urgent.set()
        ring = self.ring
        try:
            self._join(self._drain, "close waiting for the drain",
                       lambda: (ring.bytes.tail, ring.freed_seq, len(ring.pending)), ring.describe_room)
        except CaptureError as e:          # (the drain then stops; the store is closed as failed)
            self._fail(e)
        self._join(self._export, "close waiting for the store's writes",
                   lambda: (self._exported, self.exporter.store_bytes), self._queue_figures)
        if self._remote:
            try:              # (the child lets go of the ring before this process frees it)
                self.exporter.detach_ring()
            except StoreError as e:
                self._fail(e)
        self.ring.close()
        if self._detach is not None:
            self._detach()
        unregister_run(self.id)
        try:       # tail chunks on disk and every step committed (or, if the store failed, accounted as dropped)
            self.exporter.finish(self.ring.stats.drops)
        except StoreError as e:
            self._fail(e)
        clean = self.ring.error is None and error is None
        acc = self.exporter.accounting()     # per site; a resumed store's earlier runs included
        self._fold_counts()
        names = [s.name for s in self.plan.sites]
        summary = self.stats() | {"steps": self._step,
                                  "error": None if error is None else f"{type(error).__name__}: {error}",
                                  "rows_dropped": dict(zip(names, acc["dropped"].tolist())),
                                  "rows_selected": dict(zip(names, (acc["selected"] + self.rows_selected).tolist())),
                                  "rows_stored": dict(zip(names, acc["stored"].tolist())),
                                  "rows_not_computed": dict(zip(names, (acc["not_computed"] + self._not_computed).tolist()))}
        if self.policy_changes:
            summary["policy_changes"] = self.policy_changes
        summary |= self.close_attrs
        never = never_computed(summary)
        if never:
            summary["sites_never_computed"] = never
            log.warning("dmi: %d site(s) of %s stored no row: none of the rows they selected was computed (their "
                        "module never ran, e.g. embed under inputs_embeds, or the engine computed none of those rows, "
                        "e.g. logits under logits_to_keep): %s", len(never), self.store,
                        ", ".join(never[:8]) + (", ..." if len(never) > 8 else ""))
        self.exporter.close(summary, clean=clean)
        self.ring.raise_if_failed()

    def _join(self, thread: threading.Thread, stage: str, progress, figures) -> None:
        """Join one of the run's threads; a CaptureError once it shows no progress for
        ``policy.stall_timeout_s`` (the thread, a daemon, is left behind)."""
        stall = Stall(stage, self.ring.stall_timeout, figures)
        while thread.is_alive():
            thread.join(0.05)
            if thread.is_alive():
                stall.check(progress())

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(error=exc)

    def __repr__(self) -> str:
        return f"<dmi.Run {self.plan.family} sites={len(self.plan.sites)} store={self.store!r}>"


class _StepOwner:
    """Which thread drives a run's steps. The token bookkeeping (request table, decode mirror,
    token filter counters, the open step) is one sequence of steps: two threads interleaving their
    forwards would attribute rows to each other's requests. So a thread owns the run from its step's
    begin to its end, and for a whole ``Run.exclusive`` block (a ``generate()`` call); another
    thread meanwhile is refused at once (never blocked: no deadlock, and the owner's steps are
    untouched). An owner thread that has exited is taken over (its open step is aborted by the
    next step)."""

    def __init__(self, on_takeover) -> None:
        self.on_takeover = on_takeover     # called when the owner thread is found dead
        self.lock = threading.Lock()
        self.thread: int | None = None
        self.what = ""
        self.depth = 0             # nested exclusive blocks of the owner

    def claim(self, what: str) -> None:
        me = threading.get_ident()
        if self.thread == me:      # the common case: no lock (only the owner changes an owned value)
            return
        with self.lock:
            if self.thread is not None and self.thread != me and _alive(self.thread):
                raise CaptureError(
                    f"one generate at a time per dmi run: thread {_name(me)!r} began {what} while thread "
                    f"{_name(self.thread)!r} is running {self.what} on the same run (their steps share the "
                    f"run's request bookkeeping, so rows would be attributed to the wrong requests). Fix: "
                    f"serialize the calls (e.g. a threading.Lock around generate), or give each thread its "
                    f"own model and dmi.load run")
            orphaned = self.thread is not None
            self.thread, self.what, self.depth = me, what, 0
            if orphaned:
                self.on_takeover()

    def release_step(self) -> None:
        """A step ended: the run is free again unless its thread is inside an exclusive block."""
        if self.thread == threading.get_ident() and self.depth == 0:
            self.thread = None

    def enter(self, what: str) -> None:
        self.claim(what)
        self.what = what
        self.depth += 1

    def exit(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.thread = None


def _alive(ident: int) -> bool:
    return any(t.ident == ident for t in threading.enumerate())


def _name(ident: int) -> str:
    return next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))


class _Ahead:
    """A decode step begun ahead of its forward (:meth:`Run._begin_ahead`)."""
    __slots__ = ("position", "layout", "epoch")

    def __init__(self, position: np.ndarray, layout: StepLayout, epoch: int):
        self.position, self.layout, self.epoch = position, layout, epoch


class _Mirror:
    """Host copy of what a decode step needs about the current batch (no device reads)."""
    __slots__ = ("batch", "total", "last_pos", "req", "pad", "arange", "zeros", "decode", "keep", "thread")

    def __init__(self, batch: int, total: int, last_pos: np.ndarray, req: np.ndarray, pad: np.ndarray,
                 keep: np.ndarray | None = None):
        self.batch, self.total, self.last_pos, self.req, self.pad = batch, total, last_pos, req, pad
        self.keep = None if keep is None or keep.all() else keep     # batch rows captured (None: all)
        self.thread = threading.get_ident()      # another thread's step takes the slow path (and its checks)
        self.arange = np.arange(batch, dtype=np.int64)
        self.zeros = np.zeros(batch, np.int64)
        self.decode = np.ones(batch, np.int8)


def _merged(parts: list) -> tuple[StepControl, list]:
    """The parts of a streamed step (:class:`dmi.ring._Stream`) as one step: every part's records,
    and as its slots every capture it planned (those that never ran too, so the store counts their
    rows as not computed, as for a whole step)."""
    last = parts[-1][0]
    slots = {}
    for ctrl, _ in parts:
        slots.update(ctrl.slots)
    for site, ((_, sel, rows, *_), _) in last.stream.wanted.items():
        slots[site] = SiteSlot(site, 0, 0, sel, rows, -1)
    records = [r for _, recs in parts for r in recs]
    return dataclasses.replace(last, slots=slots, stream=None, partial=False), records


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


def _rows_key(st: StepTokens, held: dict | None) -> tuple:
    """What a stateless token filter's selection reads of a step: its rows, phases, local rows,
    where one request's rows end and the next's begin (``last``), and the engine-held rows. Steps
    with equal keys select the same captures (HF: decode steps of one batch; vLLM: a decode batch
    of n requests, whichever requests they are)."""
    req = st.request
    return (st.seq, len(st), st.rows.tobytes(), st.phase.tobytes(), st.local.tobytes(),
            (req[1:] != req[:-1]).tobytes(),
            None if held is None else tuple((k, n, index.tobytes()) for k, (index, n) in sorted(held.items())))
