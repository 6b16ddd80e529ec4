"""The engine hooks of a run: what the adapters and the site ops call, step by step (begin, end,
abort, capture, the drain's windows), and the decode bookkeeping that lets a step of the same
batch begin without reading the device. :class:`dmi.run.run.Run` adds the user's surface.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time

import numpy as np
import torch

from ..graph_inputs import static_inputs
from ..ring.layout import StepLayout
from ..tokens import StepTokens, step_tokens
from .layouts import StepLayouts
from .owner import StepOwner


DRAIN_WINDOW_S = 0.025       # drain windows (EngineHooks.drain_window) at most this often


class EngineHooks:
    """The engine-facing half of a run (the base of :class:`dmi.run.run.Run`). Needs ``ring``,
    ``plan``, ``requests`` and ``threads`` set before :meth:`_init_hooks`."""

    def _init_hooks(self, device, itemsize: int, first_step: int) -> None:
        plan = self.plan
        self.layouts = StepLayouts(plan.sites, itemsize)
        self.ticket = torch.zeros(1, dtype=torch.int64, device=device)
        # each site's identity as a tensor the site ops take (dmi.siteop: compiled layers stay alike)
        self.site_tensors = [torch.full((1,), s.index, dtype=torch.int64, device=device) for s in plan.sites]
        self._site_of = {t.data_ptr(): i for i, t in enumerate(self.site_tensors)}
        self._cuda = device.type == "cuda"
        static_inputs(self.ticket, *self.site_tensors)      # the site ops' inputs (the ticket they mutate)
        self._step = first_step              # resume: numbering goes on after the committed steps
        self.enabled = True          # False: null mode (sites stay patched, the device flag stays off)
        self._external = False       # the open step was begun outside the forward (graphs, engines)
        self._gen_mask = None        # 2D attention mask generate() prepared for the next forward
        self._mirror: _Mirror | None = None
        self._owner = StepOwner(self._orphaned)   # the thread driving the steps now (one generate at a time)
        self.drain_windows = 0               # drain windows opened (an engine pacing the drain)
        self._window_at = 0.0
        # graph-replayed steps (stepped(), vLLM's decode steps) open a drain window once launched
        # (False: the drain's timer alone, a benchmark's baseline)
        self.drain_paced = True
        # stepped() begins the next decode step while the GPU runs this one (the hook spec's engine.step_ahead)
        self.step_ahead = self.plan.engine.step_ahead
        self._ahead: _Ahead | None = None
        self._epoch = 0                      # bumped by changes that a step begun ahead did not see
        self.steps_ahead = [0, 0]            # steps begun ahead: taken by their forward, retracted

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
        self.retract_ahead()
        self._external = False
        self.ring.end_step(aborted=True)
        self._owner.release_step()

    def _orphaned(self) -> None:
        """The thread that owned the run exited inside a step: close that step as aborted."""
        self._external, self._gen_mask = False, None
        self.retract_ahead()
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
                self.retract_ahead()        # the step begun after the last forward: none came
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
            self.retract_ahead()
            if self.interventions:      # (null mode captures nothing; the interventions still apply)
                self._steer_only(tokens, attention_mask if attention_mask is not None else gen, position_ids, past)
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
                ahead.tokens.ids = host_ids(tokens)
                self._steer_decode(m)
                self.ring.take_ahead()
                self._commit(ahead.layout)
                self.steps_ahead[0] += 1
                return
            m.last_pos = m.last_pos + 1
            self._steer_decode(m)
            # the batch's rows again: its first decode step's layout is reused
            st = self._decode_tokens(m, m.last_pos)
            st.ids = host_ids(tokens)
            self._begin_tokens(st, m.pad, keys=m.total)
            return
        mask = mask_t.detach().cpu().numpy() if mask_t is not None else None
        pos = position_ids.detach().cpu().numpy() if position_ids is not None and mask is None else None
        past_len = 0 if mask is not None else past_length(past)
        st = step_tokens(self._step, batch, seq, self.requests, attention_mask=mask, position_ids=pos, past_len=past_len)
        st.ids = host_ids(tokens)
        if self.interventions:
            self.interventions.begin_step(st, batch * seq, self.requests.ids)
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

    def _steer_decode(self, m: "_Mirror") -> None:
        """The interventions' rows of a decode step of the mirrored batch (every request's row)."""
        if self.interventions:
            st = StepTokens(step=self._step, batch=m.batch, seq=1, rows=m.arange, request=m.req, position=m.last_pos,
                            phase=m.decode, local=m.zeros)
            self.interventions.begin_step(st, m.batch, self.requests.ids)

    def _steer_only(self, tokens, attention_mask, position_ids, past) -> None:
        """Null mode: the interventions' rows of a step that captures nothing."""
        batch, seq = int(tokens.shape[0]), int(tokens.shape[1])
        mask = attention_mask.detach().cpu().numpy() if isinstance(attention_mask, torch.Tensor) \
            and attention_mask.ndim == 2 else None
        pos = position_ids.detach().cpu().numpy() if position_ids is not None and mask is None else None
        st = step_tokens(self._step, batch, seq, self.requests, attention_mask=mask, position_ids=pos,
                         past_len=0 if mask is not None else past_length(past))
        self.interventions.begin_step(st, batch * seq, self.requests.ids)

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
        if (self._ahead is not None or not (self.step_ahead and self.enabled and self.layouts.stateless)
                or m is None or self._owner.depth == 0 or m.thread != threading.get_ident()):
            return
        position = m.last_pos + 1
        st = self._decode_tokens(m, position)
        try:
            layout = self.layouts.layout_for(st, None, None)
            ctrl = self.ring.begin_step(self._step, st, m.pad, layout, ahead=True, keys=m.total + 1)
        except Exception:              # the step's own begin meets (and raises) the same error
            self.ring.retract_ahead()
            return
        if ctrl is not None:
            self._ahead = _Ahead(position, layout, self._epoch, st)

    def retract_ahead(self) -> None:
        """Give back the step begun ahead: its forward did not come, or came as another step."""
        if self._ahead is not None:
            self._ahead = None
            self.steps_ahead[1] += self.ring.retract_ahead()

    def _begin_tokens(self, st: StepTokens, pad: np.ndarray, keep: dict | None = None,
                      held: dict | None = None, keys: int = 0) -> None:
        """``keys``: the step's key columns, past and padding included (HF: the 2D mask's width),
        which place a sliding-window layer's keys (dmi.gather.key_shift)."""
        self.retract_ahead()
        st.step = self._step
        layout = self.layouts.layout_for(st, keep, held)
        self.ring.begin_step(self._step, st, pad, layout, keys=keys)
        self._commit(layout)

    def _commit(self, layout: StepLayout) -> None:
        """A begun step counts: its selection in the accounting, its number taken."""
        self.layouts.count(layout)
        self._step += 1

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
        None with ``drain_paced`` off (the timer alone) or in null mode (nothing to drain)."""
        if not (self.drain_paced and self.enabled):
            return
        now = time.monotonic()
        if now - self._window_at < DRAIN_WINDOW_S:
            return
        self._window_at = now
        self.drain_windows += 1
        self.ring.urgent.set()

    @property
    def next_step(self) -> int:
        """The number the next step takes (the steps begun so far, a resumed store's included)."""
        return self._step

    def retract_idle_ahead(self) -> None:
        """Retract a step begun ahead unless another thread drives the run now (flush)."""
        if self._owner.thread in (None, threading.get_ident()):
            self.retract_ahead()

    def end_open_step(self, aborted: bool) -> None:
        """Close the open step before the run closes: one begun ahead is retracted, one whose forward
        never finished is ended (aborted where the caller failed)."""
        self.retract_ahead()
        self.ring.end_step(aborted=aborted)       # a step whose forward never finished
        self._external = False

    def limits_changed(self) -> None:
        """What a step selects or may take changed (set_limits, set_enabled): a step begun ahead is begun again."""
        self._epoch += 1

    def forget_layouts(self) -> None:
        """Lay the next step out anew (benchmarks that change what a step selects, or time fresh layouts)."""
        self.layouts.forget()


class _Ahead:
    """A decode step begun ahead of its forward (:meth:`Run._begin_ahead`); its token ids are set
    when the forward comes."""
    __slots__ = ("position", "layout", "epoch", "tokens")

    def __init__(self, position: np.ndarray, layout: StepLayout, epoch: int, tokens: StepTokens):
        self.position, self.layout, self.epoch, self.tokens = position, layout, epoch, tokens


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


def host_ids(tokens) -> "np.ndarray | PendingIds | None":
    """A step's input token ids ([batch, seq] or flat) as a flat host copy (StepTokens.ids), None for
    embeddings. From a device the copy is queued without a wait (into pinned memory, on the stream
    the forward then runs on); from the host, copied too: engines reuse their input buffers."""
    if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.is_complex():
        return None
    flat = tokens.detach().reshape(-1)
    if flat.device.type == "cpu":
        return flat.numpy().copy()
    return PendingIds(flat)


class PendingIds:
    """A device-to-host copy of a step's token ids in flight; :meth:`numpy` waits for that copy only."""
    __slots__ = ("host", "done")

    def __init__(self, flat: torch.Tensor):
        self.host = flat.to("cpu", non_blocking=True)
        self.done = torch.cuda.Event() if flat.device.type == "cuda" else None
        if self.done is not None:
            self.done.record()

    def numpy(self) -> np.ndarray:
        if self.done is not None:
            self.done.synchronize()
        return self.host.numpy()


def past_length(past) -> int:
    """The past length from an int, a 0-d tensor (read: a device sync) or a transformers cache."""
    if past is None:
        return 0
    if hasattr(past, "get_seq_length"):
        past = past.get_seq_length()
    return int(past)
