"""Where a step's captures go: a site's slot, the step's control record, and the layout a run
reuses for steps that want the same captures (decode steps of one batch).
"""
from __future__ import annotations

import collections
import collections.abc
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .records import ALIGN


@dataclass(slots=True)
class SiteSlot:
    """Where one site of one step writes: filled at begin_step, read by the capture op."""
    site: int
    offset: int               # byte offset in the payload ring
    capacity: int             # bytes reserved
    sel: np.ndarray           # int64 indices into StepTokens of the rows kept
    rows: np.ndarray          # int64 flat rows b*seq+s of those
    seq: int                  # meta sequence number of this capture


@dataclass
class StepControl:
    """Everything the device side needs for one step, and the host's memory of it."""
    step: int
    tokens: object            # StepTokens
    pad: np.ndarray           # left-padding columns per batch row (for key-indexed sites)
    slots: dict[int, SiteSlot]
    end_seq: int
    block_end: int            # absolute ring position freed when the step is drained
    first_seq: int
    ended: bool = False
    layout: "StepLayout | None" = None    # set when the step reused a layout (fast path)
    base: int = 0             # the step's block in the payload ring: offset and reserved bytes
    nbytes: int = 0
    copied: object = None     # backends that copy a step out early mark it here (CudaRing)
    dev_rows: dict = field(default_factory=dict)   # kernel rings: rows start -> its device view (eager captures)
    ranges: dict = field(default_factory=dict)     # kernel rings: what a rows array is as a row range (copied_as_range)
    stream: "StreamedStep | None" = None    # a step larger than the ring: this is one of its parts (Ring.stream_slot)
    block_start: int = 0      # a part's block: absolute ring position of its start
    partial: bool = False     # a part that is not the step's last: the run merges it with the rest before export
    keys: int = 0             # the step's key columns (past + seq, padding included; dmi.gather.key_shift)


class StreamedStep:
    """A step whose captures do not fit the ring at once (``full`` mode): it goes through the ring
    in parts. Each part reserves a block of at most half the ring; a capture takes the next place
    in the open part as it comes (any order), and one that does not fit ends the part (its end
    marker follows its captures on the device) and opens the next, waiting for the drain to free
    room. The drain copies each ended part out while the forward goes on; the run merges the parts
    into one step before the store sees it."""
    __slots__ = ("wanted", "left", "parts", "keys")

    def __init__(self, wanted: dict, left: int, keys: int):
        self.wanted = wanted      # site -> (capture tuple, aligned bytes): not captured yet
        self.left = left          # their bytes
        self.parts = 0
        self.keys = keys          # the step's key columns (StepControl.keys)


class StepLayout:
    """A step's captures laid out in its block, computed once and reused by every step that wants
    exactly the same captures (decode steps of one batch): the per-step host work is then one
    reservation and a few vector ops, not a loop over the sites (kept off the critical path: the
    GPU waits for it between decode steps).

    Captures are held as columns: the sites with rows (``site_ids``, in capture order), each one's
    bytes, aligned size and place in the block (``nbytes``, ``sizes``, ``rel``), and which of the
    step's row arrays it reads (``src``: an index into ``arrays``, the distinct ``(sel, rows)``
    pairs; sites of one token filter share theirs). :meth:`of_arrays` builds one from those with
    whole-array operations: an engine's mixed steps lay out a fresh layout every step, with up to
    hundreds of sites. ``wanted`` (the per-capture tuples of :meth:`Ring.begin_step`'s general
    path) is built only when read."""
    __slots__ = ("site_ids", "src", "arrays", "nbytes", "sizes", "rel", "total", "priority", "cache",
                 "_wanted", "_index", "_ids")

    def __init__(self, wanted: list[tuple[int, np.ndarray, np.ndarray, int, int]]):
        """From per-capture tuples (site, sel, rows, bytes, priority); captures sharing one
        ``(sel, rows)`` pair by identity share its entry of ``arrays``."""
        arrays, at, src = [], {}, []
        for w in wanted:
            key = (id(w[1]), id(w[2]))
            j = at.get(key)
            if j is None:
                j = at[key] = len(arrays)
                arrays.append((w[1], w[2]))
            src.append(j)
        site_ids, _, _, nbytes, priority = zip(*wanted) if wanted else ((),) * 5    # columns (C-level transpose)
        self._set(np.array(site_ids, np.int64), np.array(src, np.int64), arrays, np.array(nbytes, np.int64),
                  list(priority))
        self._wanted = wanted

    @classmethod
    def of_arrays(cls, site_ids: np.ndarray, src: np.ndarray, arrays: list, nbytes: np.ndarray,
                  priority) -> "StepLayout":
        """From columns (module doc; ``priority``: a sequence, or a callable giving it when the
        general path reads ``wanted``)."""
        layout = cls.__new__(cls)
        layout._set(site_ids, src, arrays, nbytes, priority)
        layout._wanted = None
        return layout

    def _set(self, site_ids, src, arrays, nbytes, priority) -> None:
        self.site_ids, self.src, self.arrays, self.nbytes, self.priority = site_ids, src, arrays, nbytes, priority
        sizes = (nbytes + (ALIGN - 1)) // ALIGN * ALIGN
        self.sizes = sizes
        self.rel = np.cumsum(sizes) - sizes
        self.total = int(sizes.sum())
        self.cache: dict = {}                  # backends keep what they derive from the layout here
        self._index = self._ids = None

    def __len__(self) -> int:
        return len(self.site_ids)

    @property
    def ids(self) -> list[int]:
        """``site_ids`` as a list of ints."""
        if self._ids is None:
            self._ids = self.site_ids.tolist()
        return self._ids

    @property
    def index(self) -> dict[int, int]:
        """site -> its capture's position."""
        if self._index is None:
            self._index = dict(zip(self.ids, range(len(self.site_ids))))
        return self._index

    def capture(self, i: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(site, sel, rows) of capture ``i``."""
        sel, rows = self.arrays[self.src[i]]
        return self.ids[i], sel, rows

    @property
    def wanted(self) -> list[tuple[int, np.ndarray, np.ndarray, int, int]]:
        """(site, sel, rows, bytes, priority) of each capture, as :meth:`Ring.begin_step` takes them."""
        if self._wanted is None:
            arrays, priority = self.arrays, self.priority
            if callable(priority):
                priority = self.priority = priority()
            self._wanted = [(s, *arrays[j], nb, p) for s, j, nb, p in
                            zip(self.ids, self.src.tolist(), self.nbytes.tolist(), priority)]
        return self._wanted


class LaidOutSlots(collections.abc.Mapping):
    """``StepControl.slots`` of a step begun from a :class:`StepLayout`, built when first read
    (by the drain thread, off the model's critical path)."""
    __slots__ = ("layout", "base", "first", "_slots")

    def __init__(self, layout: StepLayout, base: int, first: int):
        self.layout, self.base, self.first, self._slots = layout, base, first, None

    def _built(self) -> dict[int, SiteSlot]:
        if self._slots is None:
            L, base, first = self.layout, self.base, self.first
            arrays = L.arrays
            self._slots = {site: SiteSlot(site, base + r, size, *arrays[j], first + i)
                           for i, (site, j, r, size) in enumerate(zip(L.ids, L.src.tolist(), L.rel.tolist(),
                                                                      L.sizes.tolist()))}
        return self._slots

    def __getitem__(self, site: int) -> SiteSlot:
        if self._slots is not None:
            return self._slots[site]
        # one slot, not all of them: the model's thread reads single sites in eager launches (vLLM's
        # logits site, every step); the drain thread builds the rest
        L = self.layout
        i = L.index[site]
        _, sel, rows = L.capture(i)
        return SiteSlot(site, self.base + int(L.rel[i]), int(L.sizes[i]), sel, rows, self.first + i)

    def __iter__(self):
        return iter(self._built())

    def __len__(self) -> int:
        return len(self.layout)

    def __contains__(self, site) -> bool:
        return site in self.layout.index

    def views(self) -> list[SiteView]:
        """Each capture's (site, sel) in seq order, made once per layout and shared by its steps."""
        views = self.layout.cache.get("views")
        if views is None:
            L = self.layout
            sels = [a[0] for a in L.arrays]
            views = L.cache["views"] = [SiteView(site, sels[j]) for site, j in zip(L.ids, L.src.tolist())]
        return views


class SiteView(NamedTuple):
    """What a drained record's consumers (exporter, writer process) read of its :class:`SiteSlot`."""
    site: int
    sel: np.ndarray


def slot_views(slots) -> list:
    """A step's captures in seq order as objects with ``site`` and ``sel``: for a laid-out step the
    layout's shared :class:`SiteView` list (the drain builds no per-step :class:`SiteSlot`)."""
    return slots.views() if isinstance(slots, LaidOutSlots) else list(slots.values())
