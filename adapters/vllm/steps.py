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

import collections
import hashlib
import itertools

import numpy as np

from ...tokens import RequestTable, StepTokens
from .compat import Batch, client_request_id

PREFILL, DECODE = 0, 1


class StepBuilder:
    """Turns each step's :class:`Batch` into :class:`StepTokens` plus per-site row masks."""

    def __init__(self, requests: RequestTable, client_of=client_request_id):
        self.requests = requests
        self.captured_upto: dict[str, int] = {}     # request id -> first position not yet captured
        self.rows = ClientRows(client_of)           # token rows given to the run so far, per client request
        self.capped: set[str] = set()               # requests that reached their row cap
        self.recomputed_rows = 0                    # rows vLLM recomputed after a preemption (not stored twice)
        self._last: tuple | None = None             # the last step, when a steady decode step may follow it
        self._ahead = 0                             # steps repeated since _last's positions were settled

    @property
    def last_ids(self) -> list[str] | None:
        """The requests of the last step when the next may repeat it (:meth:`repeat`), else None."""
        return self._last[0] if self._last is not None and not self._last[6] else None

    def repeat(self, num_tokens_padded: int) -> tuple[StepTokens, dict | None, dict] | None:
        """The last steady decode step again, one position further: the adapter saw the same
        requests decoding one token each (``compat.repeats_last_step``). The cheapest step there
        is (the GPU waits for it): no per-request work, the positions captured so far settled
        when a general step comes (:meth:`build`). None when a row cap (checked per step) or
        another padded size rules it out: take :meth:`build`."""
        last = self._last
        if last is None or last[6] or last[2] != num_tokens_padded:
            return None
        prev = last[3]
        st = StepTokens(step=0, batch=1, seq=prev.seq, rows=prev.rows, request=prev.request,
                        position=prev.position + 1, phase=prev.phase, local=prev.local)
        self._last = last[:3] + (st,) + last[4:]
        self._ahead += 1
        return st, last[4], last[5]

    def _settle(self) -> None:
        """Positions of the steps :meth:`repeat` made, into the per-request bookkeeping."""
        if self._ahead:
            ids, computed = self._last[0], self._last[1] + self._ahead
            self._last = (ids, computed) + self._last[2:]
            self.captured_upto.update(zip(ids, computed.tolist()))
            self._ahead = 0

    def build(self, batch: Batch, num_tokens_padded: int, wants, n_sites: int,
              wants_all=None) -> tuple[StepTokens, dict | None, dict]:
        """(tokens, keep, held) for ``Run.begin_tokens``.

        wants(req_id) -> a ``policy.Want``: the site indices this request captures (None: every
        default site; empty: none, its rows are left out of the step) and its row cap;
        ``wants_all(req_ids)``, where given, the same for a whole batch at once.

        One pass over the requests for what only Python knows (their wants, how far each was
        captured), then whole-step array operations over the rows: an engine step carries up to
        hundreds of requests, and this runs on the host between two steps.
        """
        self._settle()
        steady = self._steady(batch, num_tokens_padded)
        if steady is not None:
            return steady
        self._last = None
        for rid in batch.finished:
            self.captured_upto.pop(rid, None)
        self.rows.finished(batch.finished)
        n_req = len(batch.req_ids)
        n_sched = np.asarray(batch.num_scheduled, np.int64)
        computed = np.asarray(batch.num_computed, np.int64)
        req_index = np.asarray(self.requests.intern(batch.req_ids), np.int64)
        want_of = [None] * n_req
        masked = False                                       # some request picked its own sites
        caps: list[tuple[int, int]] = []                     # (request, row cap)
        upto_get = self.captured_upto.get
        ws = wants_all(batch.req_ids) if wants_all is not None else list(map(wants, batch.req_ids))
        first = ws[0] if ws else None
        if first is None or (first.sites is None and first.max_rows is None and ws.count(first) == n_req):
            # every request takes the default sites, uncapped (a serving engine's usual batch)
            upto = np.fromiter(map(upto_get, batch.req_ids, itertools.repeat(0)), np.int64, n_req)
            js = np.flatnonzero(n_sched > 0)
        else:
            upto_l = [0] * n_req                             # first position not yet captured
            active = (n_sched > 0).tolist()                  # (Python lists: this loop runs per request)
            for j, (rid, w) in enumerate(zip(batch.req_ids, ws)):
                if not active[j]:
                    continue
                if w.sites is not None:
                    if not w.sites:
                        active[j] = False                    # opted out: its rows are not rows of the step
                        continue
                    want_of[j], masked = w.sites, True
                upto_l[j] = upto_get(rid, 0)
                if w.max_rows is not None:
                    caps.append((j, w.max_rows))
            upto = np.asarray(upto_l, np.int64)
            js = np.flatnonzero(active)
        one_each = bool((n_sched == 1).all())               # a decode batch: row j is request j's one (and last) row
        if one_each:
            j_of = js
            pos = computed[js]
            fresh = pos >= upto[js]                          # recomputed after a preemption: stored already
            ends, grew = pos + 1, fresh                      # (one row grows the captured range iff it is fresh)
        else:
            counts = n_sched[js]
            j_of = np.repeat(js, counts)                     # request of each scheduled row
            within = np.arange(len(j_of), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
            pos = computed[j_of] + within
            fresh = pos >= upto[j_of]
            ends = computed[js] + counts
            grew = ends > upto[js]
        recomputed = int(len(fresh) - np.count_nonzero(fresh))
        self.recomputed_rows += recomputed
        ids = batch.req_ids
        if len(js) == n_req and grew.all():                 # (every request scheduled and further on: the usual step)
            self.captured_upto.update(zip(ids, ends.tolist()))
        else:
            self.captured_upto.update(zip([ids[j] for j in js[grew].tolist()], ends[grew].tolist()))
        for j, cap in caps:                                  # row caps: later rows are not captured
            rid = batch.req_ids[j]
            mine = np.flatnonzero(j_of == j)
            room = max(cap - self.rows.taken_by(rid), 0)     # (what the client request's other engine requests took counts)
            f = fresh[mine]
            if int(f.sum()) > room:
                f &= np.cumsum(f) <= room
                fresh[mine] = f
                self.capped.add(rid)
            self.rows.add(rid, int(f.sum()))
        j_of, pos = j_of[fresh], pos[fresh]
        seq = int(num_tokens_padded)
        # a held row's local index: its place in a tensor presented as the step's last n rows (Run.begin_tokens)
        if one_each:
            flat = logit_at = j_of
            local = seq - n_req + logit_at
        else:
            starts = np.cumsum(n_sched) - n_sched            # each request's first flat row
            flat = starts[j_of] + within[fresh]
            logit_at = np.where(within[fresh] == n_sched[j_of] - 1, j_of, -1)   # the request's last scheduled row
            local = np.where(logit_at >= 0, seq - n_req + logit_at, flat)
        phase = np.where(pos < np.asarray(batch.num_prompt, np.int64)[j_of], PREFILL, DECODE).astype(np.int8)
        st = StepTokens(step=0, batch=1, seq=seq, rows=flat, request=req_index[j_of], position=pos, phase=phase,
                        local=local)
        keep = _site_masks(j_of, want_of, n_sites) if masked else None
        held = {"sampled": (logit_at, n_req)}
        if not recomputed and one_each and (phase == DECODE).all():
            # every request decodes one token: the next step may be this one again with positions one
            # further (a serving batch's steady state); the capped requests that kept their row
            # must then have room for one more, those at their cap stay without one
            kept = set(j_of.tolist())
            self._last = (list(batch.req_ids), computed + 1, seq, st, keep, held,
                          [(ids[j], cap) for j, cap in caps if j in kept])
        return st, keep, held

    def _steady(self, batch: Batch, num_tokens_padded: int) -> tuple | None:
        """The step after a steady decode step, when it is the same requests decoding one token
        each, every one exactly one token further (no preemption, no join, no finish), at the same
        padded size, and each row-capped request with room for one more row: its rows are the last
        step's, positions plus one, with none of the per-request work (the wants of a live request
        never change)."""
        last = self._last
        if last is None or batch.finished or batch.spec_decode:
            return None
        ids, computed, seq, prev, keep, held, capped = last
        now = np.asarray(batch.num_computed, np.int64)
        if (seq != int(num_tokens_padded) or len(now) != len(computed) or not np.array_equal(now, computed)
                or not (np.asarray(batch.num_scheduled) == 1).all() or batch.req_ids != ids):
            return None
        if capped:
            rows = self.rows
            keys = [(rows.key(rid), cap) for rid, cap in capped]
            step = collections.Counter(k for k, _ in keys)     # (a client request's samples decode side by side)
            if any(rows.taken.get(k, 0) + step[k] > cap for k, cap in keys):
                return None                        # a cap is reached: the general path drops that row
            for k, _ in keys:
                rows.taken[k] = rows.taken.get(k, 0) + 1
        st = StepTokens(step=0, batch=1, seq=seq, rows=prev.rows, request=prev.request, position=prev.position + 1,
                        phase=prev.phase, local=prev.local)
        self.captured_upto.update(zip(ids, (now + 1).tolist()))
        self._last = (ids, now + 1, seq, st, keep, held, capped)
        return st, keep, held


class ClientRows:
    """Token rows captured per client request. A client request's ``n`` samples and the prompts of a
    list request are engine requests of their own; they share one count (``client_of``: engine
    request id -> client request id), so a row cap holds per client request, not per engine request."""
    KEEP = 16384           # counts of client requests whose engine requests all finished, newest kept:
                           # an engine request of theirs scheduled later still counts against them
    KEY_CHARS = 128        # longer client ids are counted under their digest

    def __init__(self, client_of):
        self.client_of = client_of
        self.taken: dict[str, int] = {}                        # client key -> rows
        self._key: dict[str, str] = {}                         # live engine request id -> client key
        self._live: collections.Counter = collections.Counter()  # client key -> live engine requests
        self._done: collections.OrderedDict = collections.OrderedDict()   # finished client keys, oldest first

    def key(self, rid: str) -> str:
        k = self._key.get(rid)
        if k is None:
            k = self.client_of(rid)
            if len(k) > self.KEY_CHARS:
                k = "#" + hashlib.blake2b(k.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
            self._key[rid] = k
            self._live[k] += 1
            self._done.pop(k, None)
        return k

    def taken_by(self, rid: str) -> int:
        return self.taken.get(self.key(rid), 0)

    def add(self, rid: str, n: int) -> None:
        k = self.key(rid)
        self.taken[k] = self.taken.get(k, 0) + n

    def finished(self, rids) -> None:
        for rid in rids:
            k = self._key.pop(rid, None)
            if k is None:
                continue
            self._live[k] -= 1
            if self._live[k] > 0:
                continue
            del self._live[k]
            self._done[k] = None
            while len(self._done) > self.KEEP:
                self.taken.pop(self._done.popitem(last=False)[0], None)


def _site_masks(j_of: np.ndarray, want_of: list, n_sites: int) -> dict:
    """{site index: bool mask over the step's rows} when some request picked a site set."""
    picked = {}
    for j in np.unique(j_of).tolist():
        if want_of[j] is not None:
            picked[j] = want_of[j]
    masks = {}
    for s in range(n_sites):
        off = [j for j, sites in picked.items() if s not in sites]
        masks[s] = ~np.isin(j_of, off) if off else np.ones(len(j_of), bool)
    return masks
