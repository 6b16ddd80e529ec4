"""What each step captures: the plan's token filters applied to a step's rows, every site's capture
laid out as a :class:`dmi.ring.layout.StepLayout` (reused by steps with the same rows), and the
per-site accounting of rows selected and not computed (``selected == stored + dropped + not computed``).
"""
from __future__ import annotations

import numpy as np

from ..ring.layout import StepLayout
from ..tokens import FilterState, StepTokens, select


LAYOUTS_KEPT = 16            # laid-out steps remembered by their rows (an engine's batch sizes come and go)


class StepLayouts:
    """A run's step layouts and selection accounting, for the plan's ``sites`` at ``itemsize`` bytes
    per element."""

    def __init__(self, sites, itemsize: int):
        self.itemsize = itemsize
        self._filter_state: dict = {}
        self.rows_selected = np.zeros(len(sites), np.int64)   # accounting: stored + dropped == selected
        self.not_computed = np.zeros(len(sites), np.int64)    # selected rows an engine tensor does not hold (held=)
        self._counting: list = [None, 0]     # (layout, steps begun with it not yet in the two arrays above)
        self._last_rows = None       # (tokens, held, layout) of the last laid-out step, reused by equal rows
        self._layouts: dict = {}     # the rows a selection reads -> their layout, the last LAYOUTS_KEPT (oldest first)
        filters = list(dict.fromkeys(s.tokens for s in sites))
        # filters whose selection in a decode step depends only on the batch (no counters, no
        # position windows): decode steps then reuse one StepLayout
        self.stateless = all(f.every_n_steps <= 1 and f.max_per_request is None and f.positions is None
                             for f in filters)
        self._filter_list = filters
        self.index_sites(sites)

    def layout_for(self, st: StepTokens, keep: dict | None, held: dict | None) -> StepLayout:
        """The step's layout: the last step's or a remembered one where its rows are the same."""
        layout = self._same_rows_layout(st, keep, held)
        if layout is None:
            key = rows_key(st, held) if keep is None and self.stateless else None
            layout = self._layouts.pop(key, None) if key is not None else None
            if layout is None and keep is None:
                layout = self.layout_of(st, held)
            elif layout is None:
                wanted, counts = self.wanted(st, keep, held)
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
        if last is None or keep is not None or not self.stateless:
            return None
        prev, prev_held, layout = last
        if (prev_held is held and prev.seq == st.seq and prev.rows is st.rows and prev.request is st.request
                and prev.phase is st.phase and prev.local is st.local):
            return layout
        return None

    def forget(self) -> None:
        """Lay the next step out anew (benchmarks that change what a step selects, or time fresh layouts)."""
        self._last_rows = None
        self._layouts.clear()

    def count(self, layout: StepLayout) -> None:
        """Account a begun step's selection: the layout's rows selected and not computed per site.
        Only once the ring took the step, so a refused step leaves selected = stored + dropped + not
        computed."""
        if layout is self._counting[0]:      # the same layout again (decode steps): counted when it changes
            self._counting[1] += 1
            return
        self.fold_counts()
        self._counting = [layout, 1]

    def fold_counts(self) -> None:
        """The steps counted against one layout, into the per-site accounting (before it is read)."""
        layout, n = self._counting
        if n:
            sites, selected, missing = layout.cache["counts"]     # one entry per site: a plain fancy-index add
            self.rows_selected[sites] += selected * n
            self.not_computed[sites] += missing * n
        self._counting = [None, 0]

    def index_sites(self, sites) -> None:
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

    def layout_of(self, st: StepTokens, held: dict | None) -> StepLayout:
        """A step's layout when no request picked its own sites: one selection per token filter,
        the rows each (filter, engine-held tensor) pair holds, then every site's capture from those
        as whole-array operations (what :meth:`wanted` gives, without a loop over the sites: an
        engine's mixed steps lay out anew every step, the engine's GPU waiting for its host)."""
        bases = []
        for tokens in self._filter_list:
            sel = select(st, tokens, self._filter_state.setdefault(tokens, FilterState()))
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

    def wanted(self, st: StepTokens, keep: dict | None = None, held: dict | None = None) -> tuple[list, tuple]:
        """(site, sel, rows, bytes, priority) of each site with rows this step, and the step's
        accounting for :meth:`count`: arrays of sites, rows selected, of those not computed.

        One selection per token filter (a stateful filter counts the step once); a site takes its
        filter's rows as they are unless ``keep`` masks them or it reads ``held`` rows (below)."""
        bases = []
        for tokens in self._filter_list:
            sel = select(st, tokens, self._filter_state.setdefault(tokens, FilterState()))
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


def rows_key(st: StepTokens, held: dict | None) -> tuple:
    """What a stateless token filter's selection reads of a step: its rows, phases, local rows,
    where one request's rows end and the next's begin (``last``), and the engine-held rows. Steps
    with equal keys select the same captures (HF: decode steps of one batch; vLLM: a decode batch
    of n requests, whichever requests they are)."""
    req = st.request
    return (st.seq, len(st), st.rows.tobytes(), st.phase.tobytes(), st.local.tobytes(),
            (req[1:] != req[:-1]).tobytes(),
            None if held is None else tuple((k, n, index.tobytes()) for k, (index, n) in sorted(held.items())))
