"""Interventions on a vLLM engine: each step's rows for the write sites (:mod:`dmi.interventions`).

Captures see only the rows a step captures (requests that opted out, rows recomputed after a
preemption and padding are left out: :mod:`.steps`); an intervention sees every real row of the
step, since a request's tokens depend on all of them. vLLM's flat batch ``[num_tokens_padded, ...]``
holds request ``j``'s ``num_scheduled[j]`` rows one after the other, in the runner's request order,
at positions ``num_computed[j] ...``; padding rows (CUDA graphs) stay out of every mask.

A request turns on the interventions its hook spec marks ``requests: on_request`` by naming them
in ``extra_args["dmi"]["interventions"]`` (``vllm_xargs``: ``dmi_interventions: "a,b"``); the
request validation refuses any other name (:func:`dmi.adapters.vllm.policy.check`).
"""
from __future__ import annotations

import numpy as np

from ...tokens import StepTokens
from .policy import RequestRefused, options


class StepWrites:
    """Builds each step's rows for the run's interventions and writes their masks."""

    def __init__(self, run, runner, read_args):
        self.run, self.runner, self._read = run, runner, read_args
        self.named: dict[str, frozenset] = {}         # request id -> the on_request interventions it named
        self._last: tuple | None = None               # (request ids, StepTokens, padded) of the last step
        self.on_request = {iv.name for iv in run.interventions.by_name.values() if iv.on_request}

    def _names(self, req_id: str) -> frozenset:
        got = self.named.get(req_id)
        if got is None:
            try:
                args = options(self._read(self.runner, req_id)) or {}
            except RequestRefused:
                args = {}
            asked = args.get("interventions") or []
            got = frozenset(n for n in asked if n in self.on_request) if isinstance(asked, list) else frozenset()
            self.named[req_id] = got
        return got

    def begin(self, batch, num_tokens_padded: int) -> None:
        """Write the masks of a step: ``batch`` (a :class:`compat.Batch`), or None for the last
        step's requests decoding one token further (the repeated steady step)."""
        if batch is None:
            ids, prev, j_of = self._last
            st = StepTokens(step=0, batch=1, seq=prev.seq, rows=prev.rows, request=prev.request,
                            position=prev.position + 1, phase=prev.phase, local=prev.local)
        else:
            for rid in batch.finished:
                self.named.pop(rid, None)
            n_sched = np.asarray(batch.num_scheduled, np.int64)
            computed = np.asarray(batch.num_computed, np.int64)
            req_index = np.asarray(self.run.requests.intern(batch.req_ids), np.int64)
            j_of = np.repeat(np.arange(len(n_sched)), n_sched)          # each row's request in the batch
            within = np.arange(len(j_of), dtype=np.int64) - np.repeat(np.cumsum(n_sched) - n_sched, n_sched)
            pos = computed[j_of] + within
            phase = (pos >= np.asarray(batch.num_prompt, np.int64)[j_of]).astype(np.int8)
            st = StepTokens(step=0, batch=1, seq=int(num_tokens_padded), rows=np.arange(len(j_of), dtype=np.int64),
                            request=req_index[j_of], position=pos, phase=phase, local=within)
            ids = list(batch.req_ids)
        self._last = (ids, st, j_of)
        extra = None
        if self.on_request:
            names = [self._names(rid) for rid in ids]
            extra = {name: np.fromiter((name in n for n in names), bool, len(names))[j_of] for name in self.on_request}
        self.run.interventions.begin_step(st, int(num_tokens_padded), self.run.requests.ids, extra)
