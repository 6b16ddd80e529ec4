"""Live subscribers: a user's function called with each drained step's captures, off the model's
thread (probes and monitors reading activations while the model serves).

A subscriber runs on the run's export thread, after the drain copied the step to host memory and
as the exporter takes it: steps come in order, each exactly once, with the rows and coordinates
the store gets (padding and rows the engine never computed left out). The model's thread never
waits for it unless the host staging budget fills (``policy.host_bytes``: a slow subscriber holds
staging as a slow store does, so ``full`` backpressures and ``best_effort`` drops, counted). An
exception a subscriber raises stops capture like a failing store: it reaches the caller at its next
step, ``flush()`` or ``close()`` as a :class:`~dmi.errors.CaptureError` naming the subscriber and
the step.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import CaptureError, SpecError
from .store.rows import PHASE_NAMES, computed_rows, output_views
from .plan import Plan
from .zdtype import BF16


@dataclass(frozen=True)
class Capture:
    """One site's rows of one step, as the store holds them: ``values`` maps each stored output
    (the site's own leaf name, e.g. ``resid_post``, or ``topk_values``/``topk_indices``, ``norm``)
    to an array ``[rows, *dims]`` in the captured dtype (bfloat16 as ``ml_dtypes.bfloat16``). The
    arrays are the subscriber's own (copies): they outlive the call."""
    step: int
    site: str                   # the full site name: 'layers.3.resid_post', 'logits'
    request: np.ndarray         # request id of each row
    position: np.ndarray        # its position in the request's sequence
    phase: np.ndarray           # 'prefill' or 'decode'
    values: dict[str, np.ndarray]
    token_id: np.ndarray        # its input token id (-1 where the engine gave embeddings, not ids)


class Subscription:
    """Returned by :meth:`dmi.run.Run.subscribe`; :meth:`cancel` stops the calls (from the next step)."""

    def __init__(self, fn: Callable[[dict[str, Capture]], object], sites: frozenset[int], owner: "Subscribers"):
        self.fn, self.sites, self._owner = fn, sites, owner
        self.name = getattr(fn, "__qualname__", None) or repr(fn)
        self.steps = 0                          # steps delivered

    def cancel(self) -> None:
        self._owner.remove(self)


class Subscribers:
    """A run's subscribers and the decoding of a drained step into :class:`Capture` objects."""

    def __init__(self, plan: Plan, capture_dtype: str):
        self.plan, self.capture_dtype = plan, capture_dtype
        self._subs: tuple[Subscription, ...] = ()      # replaced, never mutated: the export thread reads it unlocked

    def __bool__(self) -> bool:
        return bool(self._subs)

    def add(self, fn, sites: str | list[str] | None = None) -> Subscription:
        if not callable(fn):
            raise TypeError(f"subscribe: {fn!r} is not callable: pass a function taking a dict of captures")
        sub = Subscription(fn, self._site_set(sites), self)
        self._subs = self._subs + (sub,)
        return sub

    def remove(self, sub: Subscription) -> None:
        self._subs = tuple(s for s in self._subs if s is not sub)

    def _site_set(self, sites) -> frozenset[int]:
        """Site indices a subscriber's names or globs select: full names ('layers.3.resid_post'),
        canonical names ('resid_post': every layer) or globs of either, among the plan's sites."""
        planned = self.plan.sites
        if sites is None:
            return frozenset(s.index for s in planned)
        patterns = [sites] if isinstance(sites, str) else list(sites)
        chosen: set[int] = set()
        for p in patterns:
            hit = {s.index for s in planned if fnmatch.fnmatchcase(s.name, p) or fnmatch.fnmatchcase(s.canonical, p)}
            if not hit:
                names = sorted({s.canonical for s in planned})
                raise SpecError(f"subscribe: {p!r} matches none of the captured sites ({', '.join(names)})",
                                key="sites", fix="name a site the hook spec captures (a subscriber sees only "
                                "captured sites), e.g. " + repr(names[0]))
            chosen |= hit
        return frozenset(chosen)

    def deliver(self, ctrl, records, request_ids: list[str]) -> None:
        """Call every subscriber with the captures of one drained step it subscribed to (none:
        not called). ``records``: (slot, meta record, bytes) as the drain hands them over, valid
        until the step's staging is released (after this returns)."""
        subs = self._subs
        if not subs:
            return
        wanted = frozenset().union(*(s.sites for s in subs))
        captures = dict(self._decode(ctrl, records, request_ids, wanted))
        for sub in subs:
            mine = {c.site: c for i, c in captures.items() if i in sub.sites}
            if not mine:
                continue
            try:
                sub.fn(mine)
            except Exception as e:      # noqa: BLE001 - reaches the caller (Run._fail), as a store failure does
                raise CaptureError(f"subscriber {sub.name} failed on step {ctrl.step}: {type(e).__name__}: {e}") from e
            sub.steps += 1

    def _decode(self, ctrl, records, request_ids, wanted: frozenset[int]):
        """(site index, Capture) of each record of a subscribed site."""
        tokens = ctrl.tokens
        # the step's requests' names, looked up once (the table grows with every request served)
        in_step = np.unique(tokens.request)
        names = np.array([request_ids[i] for i in in_step.tolist()], dtype=object)
        for slot, rec, data in records:
            if slot.site not in wanted:
                continue
            site = self.plan.sites[slot.site]
            sel = computed_rows(tokens, slot, rec)          # the rows the store keeps of this record
            n = len(sel)
            if int(rec["rows"]) != n:
                raise CaptureError(f"site {site.name}: step {ctrl.step}'s record has {int(rec['rows'])} rows, "
                                   f"expected {n}")
            values = {name: (v.view(BF16) if v.dtype == np.uint16 else v).copy()     # (uint16: bfloat16's bits)
                      for name, v in output_views(site.outputs, n, data, self.capture_dtype).items()}
            yield slot.site, Capture(ctrl.step, site.name, names[np.searchsorted(in_step, tokens.request[sel])],
                                     tokens.position[sel].copy(),
                                     PHASE_NAMES[tokens.phase[sel]], values, tokens.token_ids(sel))
