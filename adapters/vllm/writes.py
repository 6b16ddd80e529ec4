"""Interventions on a vLLM engine: each step's rows for the write sites (:mod:`dmi.interventions`).

Captures see only the rows a step captures (requests that opted out, rows recomputed after a
preemption and padding are left out: :mod:`.steps`); an intervention sees every real row of the
step, since a request's tokens depend on all of them. vLLM's flat batch ``[num_tokens_padded, ...]``
holds request ``j``'s ``num_scheduled[j]`` rows one after the other, in the runner's request order,
at positions ``num_computed[j] ...``; padding rows (CUDA graphs) stay out of every mask.

A request turns on the interventions its hook spec marks ``requests: on_request`` by naming them
in ``extra_args["dmi"]["interventions"]`` (``vllm_xargs``: ``dmi_interventions: "a,b"``); the
request validation refuses any other name (:func:`dmi.adapters.vllm.policy.check`). A request that
sets values of its own (``{"interventions": {"steer": {"scale": 2.0}}}``, within the operator's
``client:`` bounds) gets a slot: a row of each such intervention's value buffers, loaded once when
the request first runs, which its rows read (:meth:`dmi.interventions.Intervention.load_slot`).
"""
from __future__ import annotations

import numpy as np

from ...tokens import StepTokens
from .policy import RequestRefused, intervention_values, offered_plans, options, request_values


class StepWrites:
    """Builds each step's rows for the run's interventions and writes their masks."""

    def __init__(self, run, runner, read_args):
        self.run, self.runner, self._read = run, runner, read_args
        self.named: dict[str, frozenset] = {}         # request id -> the on_request interventions it named
        self._last: tuple | None = None               # (request ids, StepTokens, padded) of the last step
        self.on_request = {iv.name for iv in run.interventions.by_name.values() if iv.on_request}
        self.offered = offered_plans(run.interventions.plans)
        self.client = {iv.name: iv for iv in run.interventions.by_name.values() if iv.slot is not None}
        self.values: dict[str, dict] = {}             # request id -> {name: its checked values}
        n_slots = next(iter(self.client.values())).slots["scale"].shape[0] if self.client else 1
        self.free = list(range(n_slots - 1, 0, -1))   # slot 0: the operator's values
        self.slot_of: dict[str, int] = {}             # request id -> its slot while it holds one
        self._slots = None                            # the last step's {name: slot per row}

    def _names(self, req_id: str) -> frozenset:
        got = self.named.get(req_id)
        if got is None:
            try:
                args = options(self._read(self.runner, req_id)) or {}
                values = request_values(args, self.offered) if self.client else {}
            except RequestRefused:          # (refused where the request came in; here: nothing turned on)
                args, values = {}, {}
            got = frozenset(n for n in intervention_values(args) if n in self.on_request)
            self.named[req_id] = got
            if values:
                self.values[req_id] = values
        return got

    def _slot(self, req_id: str, ids: set) -> int:
        """The request's slot, loaded with its values when it takes one. With none free, one of a
        request outside this step is taken (it reloads when it runs again)."""
        k = self.slot_of.get(req_id)
        if k is None:
            if not self.free:
                other = next(r for r in self.slot_of if r not in ids)
                self.free.append(self.slot_of.pop(other))
            k = self.slot_of[req_id] = self.free.pop()
            for name, vals in self.values[req_id].items():
                self.client[name].load_slot(k, vals)
        return k

    def _forget(self, finished) -> None:
        for rid in finished:
            self.named.pop(rid, None)
            self.values.pop(rid, None)
            k = self.slot_of.pop(rid, None)
            if k is not None:
                self.free.append(k)

    def begin(self, batch, num_tokens_padded: int) -> None:
        """Write the masks of a step: ``batch`` (a :class:`compat.Batch`), or None for the last
        step's requests decoding one token further (the repeated steady step)."""
        if batch is None:
            ids, prev, j_of = self._last
            st = StepTokens(step=0, batch=1, seq=prev.seq, rows=prev.rows, request=prev.request,
                            position=prev.position + 1, phase=prev.phase, local=prev.local)
        else:
            self._forget(batch.finished)
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
            asked = frozenset().union(*names)
            nobody = np.zeros(len(j_of), bool)      # (an intervention no request of the step asked for: no rows)
            extra = {name: np.fromiter((name in n for n in names), bool, len(names))[j_of] if name in asked else nobody
                     for name in self.on_request}
        if self.client and (batch is not None or self._slots is None):
            here = set(ids)
            valued = [self.values.get(rid, ()) for rid in ids]
            self._slots = {}
            for name in self.client:
                if not any(name in v for v in valued):      # every row reads the operator's values
                    self._slots[name] = np.zeros(len(j_of), np.int64)
                    continue
                per_req = np.fromiter((self._slot(rid, here) if name in v else 0 for rid, v in zip(ids, valued)),
                                      np.int64, len(ids))
                self._slots[name] = per_req[j_of]
        self.run.interventions.begin_step(st, int(num_tokens_padded), self.run.requests.ids, extra, self._slots)
