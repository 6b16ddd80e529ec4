"""Token bookkeeping: which rows of a step are real tokens, whose they are, and which a site keeps.

A *step* is one forward call of the engine. Its input is a [batch, seq] grid of rows; row
``b * seq + s`` is batch row ``b`` at step-local position ``s``. Padding rows (left padding in HF
batched generate) never reach the store. Each real row carries its request id, absolute
position, step number and phase (prefill/decode).
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field

import numpy as np

from .errors import CaptureError, DmiError
from .plan import TokenFilter

PHASES = ("prefill", "decode")
MAX_ID_CHARS = 128        # an engine-given request id (a client's X-Request-Id) as the store keeps it


def bounded_id(rid: str) -> str:
    """An engine-given request id as the store keeps it: printable ASCII of at most MAX_ID_CHARS
    characters. A longer or unprintable one keeps its (cleaned) head and a digest of the whole, so
    distinct ids stay distinct: a client cannot put an unbounded string into every row."""
    clean = "".join(c if c.isascii() and c.isprintable() else "?" for c in rid)
    if clean == rid and len(rid) <= MAX_ID_CHARS:
        return rid
    digest = hashlib.sha256(rid.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{clean[:MAX_ID_CHARS - 17]}~{digest}"


@dataclass
class StepTokens:
    """The real rows of one step (all arrays are aligned, one entry per real row)."""
    step: int
    batch: int
    seq: int
    rows: np.ndarray        # int64 flat row index b*seq+s
    request: np.ndarray     # int64 index into the run's request table
    position: np.ndarray    # int64 absolute position in the request
    phase: np.ndarray       # int8 index into PHASES
    local: np.ndarray       # int64 s (step-local position), to map engine tensors with fewer positions
    # the step's input token ids, one per grid row (indexed by ``rows``): a numpy array, or a device
    # copy in flight (dmi.run.steps.PendingIds: its .numpy() waits for it); None: unknown
    ids: object = None

    def __len__(self) -> int:
        return len(self.rows)

    def token_ids(self, sel: np.ndarray) -> np.ndarray:
        """int64 input token id of the rows ``sel`` (-1 where the engine gave embeddings, not ids)."""
        if self.ids is None:
            return np.full(len(sel), -1, np.int64)
        if not isinstance(self.ids, np.ndarray):
            self.ids = self.ids.numpy()
        return self.ids[self.rows[sel]].astype(np.int64, copy=False)

    def __getstate__(self) -> dict:
        # to the drain or writer process: the ids as numpy
        state = dict(self.__dict__)
        if state["ids"] is not None and not isinstance(state["ids"], np.ndarray):
            state["ids"] = state["ids"].numpy()
        return state

    def subset(self, keep: np.ndarray | None) -> "StepTokens":
        """The rows where the bool mask ``keep`` is true (``None`` or all true: this step itself)."""
        if keep is None or keep.all():
            return self
        return StepTokens(self.step, self.batch, self.seq, self.rows[keep], self.request[keep], self.position[keep],
                          self.phase[keep], self.local[keep], self.ids)


class RequestTable:
    """Request ids of the run, which request each batch row belongs to right now, and which batch
    rows capture at all (per-request opt-in)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._index: dict[str, int] = {}
        self._batch_rows: list[int] = []     # batch row -> request index
        self._batch_thread: int | None = None    # the thread that started the current batch
        # what set_next said for the next batch, per thread: a thread's ids never name another's batch
        self._pending: dict[int, tuple[list[str] | None, np.ndarray | None]] = {}
        self.batch_capture: np.ndarray | None = None    # bool per batch row of the current batch (None: all)
        self.lock = threading.Lock()
        # an engine's request id -> the id its caller knows (vLLM: without the suffix it appends), which
        # the store keeps unless another request of the run has it already; None: the engine's id itself
        self.name_of = None
        self._names: set[str] = set()

    def set_next(self, ids: list[str] | None, capture=None) -> None:
        """Ids for the rows of the next new batch this thread starts (else 'r<N>' ids are made up),
        and ``capture``: one bool per row, False for a request that is not captured at all."""
        if ids is not None:
            dup = {i for i in ids if ids.count(i) > 1} | {i for i in ids if i in self._index}
            if dup:
                raise DmiError(f"request ids must be unique in a run; repeated: {sorted(dup)}. "
                               f"Fix: give each request a new id")
        flags = _capture_flags(capture, ids)
        self._pending[threading.get_ident()] = (None if ids is None else list(ids), flags)

    def intern(self, ids: list[str]) -> list[int]:
        """Indices of engine-given request ids (vLLM's), adding the ones not seen before, stored as
        :func:`bounded_id` (a client chooses them) of ``name_of(id)``, or of the engine's id where
        another request of the run (or of the resumed store) has that name already."""
        got = list(map(self._index.get, ids))     # (an engine step's ids are mostly known ones)
        if None not in got:
            return got
        with self.lock:
            for rid in ids:
                if rid not in self._index:
                    name = bounded_id(self.name_of(rid)) if self.name_of is not None else bounded_id(rid)
                    if name in self._names:
                        name = bounded_id(rid)
                    self._index[rid] = len(self.ids)
                    self.ids.append(name)
                    self._names.add(name)
            return [self._index[r] for r in ids]

    def stored_id(self, rid: str) -> str:
        """The id the store keeps for an engine-given request id (:meth:`intern`)."""
        return self.ids[self.intern([rid])[0]]

    def start_batch(self, batch: int) -> list[int]:
        given, flags = self._pending.pop(threading.get_ident(), (None, None))
        ids = given if given is not None else [f"r{len(self.ids) + b}" for b in range(batch)]
        if len(ids) != batch:
            raise DmiError(f"{len(ids)} request ids were given for a batch of {batch} rows. "
                           f"Fix: pass one id per batch row to set_request_ids")
        if flags is not None and len(flags) != batch:
            raise DmiError(f"{len(flags)} capture flags were given for a batch of {batch} rows. "
                           f"Fix: pass one bool per batch row in set_request_ids(capture=...)")
        with self.lock:
            for rid in ids:
                self._index[rid] = len(self.ids)
                self.ids.append(rid)
                self._names.add(rid)
        self._batch_rows = [self._index[r] for r in ids]
        self._batch_thread = threading.get_ident()
        self.batch_capture = None if flags is None or flags.all() else flags
        return self._batch_rows

    def current(self, batch: int) -> list[int]:
        if len(self._batch_rows) != batch:
            # a continuation step with another batch size: treat as new requests
            return self.start_batch(batch)
        if self._batch_thread != threading.get_ident():
            # its rows would be attributed to the requests of whatever batch another thread started last
            raise CaptureError(
                f"thread {threading.current_thread().name!r} continues a batch (a step with a KV cache) "
                f"that another thread started: a dmi run attributes a continuation step to the batch started "
                f"last, by any thread. Fix: run each batch's steps (prefill and decode) in one thread inside "
                f"`with run.exclusive():` (generate() does this itself), or serialize whole batches")
        return self._batch_rows


def _capture_flags(capture, ids: list[str] | None) -> np.ndarray | None:
    """``set_request_ids(capture=...)`` as a bool array (None: every row captures)."""
    if capture is None:
        return None
    if isinstance(capture, (str, bytes, dict)) or not hasattr(capture, "__len__") \
            or not all(isinstance(c, (bool, np.bool_)) for c in capture):
        raise DmiError(f"capture must be a list of booleans, one per batch row (True: capture that request), "
                       f"not {capture!r}. Fix: e.g. run.set_request_ids(ids, capture=[True, False, True])")
    if ids is not None and len(capture) != len(ids):
        raise DmiError(f"{len(capture)} capture flags for {len(ids)} request ids. "
                       f"Fix: pass one bool per id in set_request_ids(ids, capture=...)")
    return np.asarray(capture, bool)


def step_tokens(step: int, batch: int, seq: int, requests: RequestTable, *,
                attention_mask: np.ndarray | None, position_ids: np.ndarray | None, past_len: int) -> StepTokens:
    """Real rows of a step from what the engine passed to the model.

    attention_mask: [batch, past + seq] (HF 2D mask; 0 marks padding), or None.
    position_ids:   [batch or 1, seq] explicit positions, or None.
    """
    if attention_mask is not None and attention_mask.ndim == 2:
        past_len = attention_mask.shape[1] - seq
        mask = attention_mask.astype(bool)
        valid = mask[:, past_len:]
        pos = np.cumsum(mask, axis=1)[:, past_len:] - 1
    elif position_ids is not None:
        valid = np.ones((batch, seq), bool)
        pos = np.broadcast_to(position_ids, (batch, seq))
    else:
        valid = np.ones((batch, seq), bool)
        pos = np.broadcast_to(np.arange(past_len, past_len + seq), (batch, seq))
    new = past_len == 0
    req_of_row = np.asarray(requests.start_batch(batch) if new else requests.current(batch), np.int64)
    b_idx, s_idx = np.nonzero(valid)
    phase = 0 if (new or seq > 1) else 1
    return StepTokens(step=step, batch=batch, seq=seq, rows=(b_idx * seq + s_idx).astype(np.int64),
                      request=req_of_row[b_idx], position=np.asarray(pos)[b_idx, s_idx].astype(np.int64),
                      phase=np.full(len(b_idx), phase, np.int8), local=s_idx.astype(np.int64))


@dataclass
class FilterState:
    """Per-request counters a filter needs across steps (decode steps seen, tokens kept)."""
    decode_steps: dict[int, int] = field(default_factory=dict)
    kept: dict[int, int] = field(default_factory=dict)


EVERY_ROW = TokenFilter()     # the default filter: every row of a step


def select(tokens: StepTokens, flt: TokenFilter, state: FilterState) -> np.ndarray:
    """Indices into ``tokens`` of the rows this filter keeps (ascending)."""
    if flt == EVERY_ROW:
        return np.arange(len(tokens))          # the common filter: no mask to build
    keep = np.ones(len(tokens), bool)
    if flt.phase != "all":
        keep &= tokens.phase == PHASES.index(flt.phase)
    if flt.positions is not None:
        keep &= (tokens.position >= flt.positions[0]) & (tokens.position < flt.positions[1])
    if flt.last and len(tokens):
        # last real row of each request in this step: rows are grouped by request and ascending
        last = np.ones(len(tokens), bool)
        last[:-1] = tokens.request[1:] != tokens.request[:-1]
        keep &= last
    if flt.every_n_steps > 1:
        for r in np.unique(tokens.request[tokens.phase == 1]):
            n = state.decode_steps.get(int(r), 0) + 1
            state.decode_steps[int(r)] = n
            if n % flt.every_n_steps:
                keep &= ~((tokens.request == r) & (tokens.phase == 1))
    idx = np.nonzero(keep)[0]
    if flt.max_per_request is not None and len(idx):
        out = []
        for i in idx:
            r = int(tokens.request[i])
            if state.kept.get(r, 0) < flt.max_per_request:
                state.kept[r] = state.kept.get(r, 0) + 1
                out.append(i)
        idx = np.asarray(out, np.int64)
    return idx
