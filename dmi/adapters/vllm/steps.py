"""Token bookkeeping of a vLLM step: the scheduler's batch -> the rows dmi captures.

vLLM runs one flat batch per step: ``[num_tokens_padded, ...]`` tensors whose first
``sum(num_scheduled)`` rows are real tokens, grouped by request in the runner's order, and whose
tail (CUDA-graph padding) is not. For request ``j`` the step computes positions
``num_computed[j] .. num_computed[j] + num_scheduled[j] - 1``: a chunk of its prompt (chunked
prefill), the rest of its prompt after a prefix-cache hit (earlier positions are never computed,
so they never appear in the store: the ``position`` coordinate says which were captured), or one
decode token. After a preemption vLLM recomputes a request from the start; rows at positions dmi
already captured for that request are skipped, so every (request, position) is stored once.

Rows a request opted out of, and padding rows, are simply not rows of the step for dmi: they are
never copied. The logits tensor holds one row per request (its last scheduled token):
``held["sampled"]`` maps step rows to logits rows.
"""
from __future__ import annotations

import numpy as np

from ...tokens import RequestTable, StepTokens
from .compat import Batch

PREFILL, DECODE = 0, 1


class StepBuilder:
    """Turns each step's :class:`Batch` into :class:`StepTokens` plus per-site row masks."""

    def __init__(self, requests: RequestTable):
        self.requests = requests
        self.captured_upto: dict[str, int] = {}     # request id -> first position not yet captured
        self.rows_taken: dict[str, int] = {}        # request id -> token rows given to the run so far
        self.capped: set[str] = set()               # requests that reached their row cap
        self.recomputed_rows = 0                    # rows vLLM recomputed after a preemption (not stored twice)

    def build(self, batch: Batch, num_tokens_padded: int, wants, n_sites: int) -> tuple[StepTokens, dict | None, dict]:
        """(tokens, keep, held) for ``Run.begin_tokens``.

        wants(req_id) -> a ``policy.Want``: the site indices this request captures (None: every
        default site; empty: none, its rows are left out of the step) and its row cap.
        """
        for rid in batch.finished:
            self.captured_upto.pop(rid, None)
            self.rows_taken.pop(rid, None)
        n_sched = batch.num_scheduled
        starts = np.concatenate([[0], np.cumsum(n_sched)[:-1]]).astype(np.int64)
        sampled_row = starts + n_sched - 1                  # flat row of each request's logits row
        req_index = self.requests.intern(batch.req_ids)
        rows, req, pos, phase, logit, sets = [], [], [], [], [], []
        for j, rid in enumerate(batch.req_ids):
            if n_sched[j] == 0:
                continue
            w = wants(rid)
            want = w.sites
            if want is not None and not want:
                continue
            p = batch.num_computed[j] + np.arange(n_sched[j], dtype=np.int64)
            fresh = p >= self.captured_upto.get(rid, 0)     # recomputed after a preemption: stored already
            self.recomputed_rows += int((~fresh).sum())
            self.captured_upto[rid] = max(self.captured_upto.get(rid, 0), int(p[-1]) + 1)
            if w.max_rows is not None:                      # the request's row cap: later rows are not captured
                room = max(w.max_rows - self.rows_taken.get(rid, 0), 0)
                if int(fresh.sum()) > room:
                    fresh &= np.cumsum(fresh) <= room
                    self.capped.add(rid)
                self.rows_taken[rid] = self.rows_taken.get(rid, 0) + int(fresh.sum())
            r = (starts[j] + np.arange(n_sched[j], dtype=np.int64))[fresh]
            rows.append(r)
            pos.append(p[fresh])
            req.append(np.full(len(r), req_index[j], np.int64))
            phase.append(np.where(p[fresh] < batch.num_prompt[j], PREFILL, DECODE).astype(np.int8))
            logit.append(np.where(r == sampled_row[j], j, -1).astype(np.int64))
            sets.append((len(r), want))
        flat, logit_at = _cat(rows, np.int64), _cat(logit, np.int64)
        n_logits = len(batch.req_ids)
        seq = int(num_tokens_padded)
        # a held row's local index: its place in a tensor presented as the step's last n rows (Run.begin_tokens)
        local = np.where(logit_at >= 0, seq - n_logits + logit_at, flat)
        st = StepTokens(step=0, batch=1, seq=seq, rows=flat, request=_cat(req, np.int64), position=_cat(pos, np.int64),
                        phase=_cat(phase, np.int8), local=local)
        return st, _site_masks(sets, len(st), n_sites), {"sampled": (logit_at, n_logits)}


def _cat(parts, dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def _site_masks(sets, n: int, n_sites: int) -> dict | None:
    """{site index: bool mask over the step's rows} when some request picked a site set."""
    if all(want is None for _, want in sets):
        return None
    masks = {}
    for s in range(n_sites):
        m = np.zeros(n, bool)
        at = 0
        for count, want in sets:
            m[at:at + count] = want is None or s in want
            at += count
        masks[s] = m
    return masks
