"""Zarr v3 exporter: drained steps in, whole chunk files out.

Layout (mirrors the spec): one group per canonical site (``layers/attn/q``, ``final_norm``,
``logits``) holding its output arrays ``[token, (layer,) ...]`` and the token coordinates
``request``, ``position``, ``step``, ``phase``, ``token_id`` (the row's input token id; -1 for
embeddings) of that group's rows. Every group has its own
``token`` dim (groups keep different rows) and no ancestor group holds arrays, so
``xarray.open_datatree`` opens the whole store. Root attributes carry the run metadata; the
``drops`` group lists every dropped capture.

Write path: zarr-python creates the groups and arrays (their ``zarr.json``); dmi writes the chunk
files itself. The exporter thread copies each step's rows straight into the open chunk of their
group (bf16 widened on the way); a full chunk is encoded exactly as zarr-python would store it
(``bytes`` codec: the raw little-endian C-order bytes, then numcodecs' Blosc or Zstd, which release
the GIL) and written by a thread pool (one thread per core) as a temp file + ``os.replace`` (on an
object store, one PUT per chunk: :mod:`dmi.store.location`): chunks are written in parallel and a
reader never sees a torn one.

Commit protocol (crash consistency): an array's ``shape`` only grows over rows whose chunk files
are on disk, and only to whole steps. At least every ``COMMIT_S`` the exporter writes the open
(partial) chunk of each group, takes the last step S whose rows are on disk in every group,
rewrites the arrays' ``zarr.json`` to the rows up to S (atomically), then the root attribute
``dmi_committed`` (step S, rows per group, row accounting up to S). A process killed at any point
leaves a store that opens, holds steps 0..S, and still says ``dmi_status: open``.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zarr

from ..errors import StoreError
from ..plan import Plan
from ..ring.budget import Drop
from .assembly import COPY_PARALLEL_BYTES, StepAssembly
from .chunk_threads import FIX_IO, FREE_BYTES, ChunkThreads
from .chunks import default_threads, lower_priority, storage_dtype
from .commits import COMMIT_S, TICK_S, Commits, PendingStep
from .drops import Drops, sink_policy
from .layout import COORD_DTYPES, COORDS, DROP_CHUNK, DROP_COLUMNS, GroupBuffer, StoreLayout
from .preflight import jsonable, store_gone, unreserve

__all__ = ["ZarrExporter", "GroupBuffer", "PendingStep", "sink_policy", "COORDS", "COORD_DTYPES", "DROP_COLUMNS",
           "DROP_CHUNK", "COPY_PARALLEL_BYTES", "FREE_BYTES", "TICK_S", "COMMIT_S"]


log = logging.getLogger("dmi")


class ZarrExporter(StepAssembly, Commits, Drops, ChunkThreads, StoreLayout):
    """Drained steps in, a Zarr store out (see the module doc): step assembly
    (:mod:`dmi.store.assembly`), commits (:mod:`dmi.store.commits`), drops and failures
    (:mod:`dmi.store.drops`), chunk writers (:mod:`dmi.store.chunk_threads`), the store's layout
    (:mod:`dmi.store.layout`)."""

    def __init__(self, path: str | Path, plan: Plan, capture_dtype: str, attrs: dict, overwrite: bool = False,
                 resume: bool = False):
        self.plan = plan
        self.capture_dtype = capture_dtype
        self.float_dtype = storage_dtype(plan, self.capture_dtype)
        self.on_error = sink_policy(plan)                # 'raise' | 'drop'
        self.error: StoreError | None = None             # the store's first failure
        self.drops: list[Drop] = []                      # captures lost in the store's writing (sink, writer)
        self._request_ids: list[str] = []                # the run's request ids by index (its live list)
        self._failed = self._raised = False
        self._lock = threading.Lock()
        self._workers = workers = plan.threads or default_threads()
        # encoding and writing chunks never competes with the model's threads for a core: a
        # host-bound decode loop that loses its core for a moment leaves the GPU idle that long
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dmi-zarr", initializer=lower_priority)
        # the row copies of a big step run on several cores too (numpy releases the GIL); with two
        # threads or fewer they stay on the exporter thread: on a 2-core box a copy pool bought no
        # throughput and made a thread waking every 200 us get the GIL back 250-310 us late, not 190-220
        self._copy_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dmi-copy",
                                             initializer=lower_priority) if workers > 2 else None
        self._jobs: list = []         # (destination, source) row copies of the step being appended
        self._job_bytes = 0
        self._sealed: list = []       # chunks the step filled: written once its copies are done
        self._inflight: collections.deque = collections.deque()
        self._max_inflight = 2 * workers                 # bounds the memory of chunks waiting for a thread
        self._rate_t = 0.0
        self._free_bytes = 0
        n = len(plan.sites)
        self._log: collections.deque[PendingStep] = collections.deque()
        self._acc = {k: np.zeros(n, np.int64) for k in ("stored", "dropped", "not_computed")}   # this run, accounted
        self.prior = {k: np.zeros(n, np.int64) for k in ("selected", "stored", "dropped", "not_computed")}
        self._ring_pos = 0
        self.committed_step = -1
        self.next_step = 0                               # the first step this run numbers
        self.stored_request_ids: list[str] = []
        self.store_bytes = 0
        self._finished = False
        self._last_commit = time.monotonic()
        self.groups: dict[str, GroupBuffer] = {}
        for s in plan.sites:
            self.groups.setdefault(s.group, GroupBuffer(s.group, [])).sites.append(s)
        self.drops_group = GroupBuffer("drops", [], DROP_CHUNK, capped=False)
        self._all = list(self.groups.values()) + [self.drops_group]
        try:
            if resume:
                self._reopen(path, attrs)
            else:
                self._create(path, attrs, overwrite)
        except BaseException:
            self._shutdown(wait=False)
            raise

    # --- end ------------------------------------------------------------------------------------
    def sync(self) -> None:
        """Every step handed over so far on disk and committed (``run.flush``)."""
        self.checkpoint(wait_all=True)

    def finish(self, ring_drops=()) -> None:
        """Before the close summary: every step on disk and committed, or (once the store failed)
        accounted as dropped; ring drops of steps that never reached the exporter recorded."""
        if self._finished:
            return
        self._finished = True
        self._take_ring_drops(ring_drops, None, None)
        if self.error is None:
            self.checkpoint(wait_all=True)
        self._wait_all()
        if self.error is not None:
            self._on_failure()

    def close(self, summary: dict, clean: bool = True) -> None:
        """Final metadata: the drops table, the summary attributes, the marker, consolidated metadata.
        Once the store has failed this is best effort (what cannot be written stays as committed)."""
        try:
            self.finish()
        except StoreError:
            clean = False
        gone = store_gone(self.loc)
        if gone is not None:      # removed under the run: nothing more is written (zarr would recreate a half store)
            self._shutdown(wait=False)
            unreserve(self.loc)
            with self._lock:
                if self.error is None:
                    self.error = gone
            raise gone
        try:
            unreserve(self.loc)    # its space is for what follows, should the disk be full
            attrs = jsonable(summary) | {"dmi_status": "closed" if clean else "failed",
                                          "store_error": None if self.error is None else str(self.error)}
            if self.error is not None:        # the site groups stay as committed; the drops table gets every drop
                try:                          # the status and the error first, should the drops table fill the disk
                    self.root_attrs.update(attrs | {"dmi_committed": self._marker(summary)})
                except OSError as e:
                    log.warning("dmi: %s: recording the store's failure failed: %s", self.path, e)
                for g in self.groups.values():    # a commit that failed midway (a full disk) can have grown
                    for f in g.files.values():    # some arrays of a group: all back to the last commit
                        f.set_rows(g.shape_rows)
                self._append_drops([d for d in self.drops if d.reason == "sink"])   # (writer drops are in it)
                self._write_open(self.drops_group)
                self._wait_all()
                with self._lock:
                    n = self.drops_group.durable
                for f in self.drops_group.files.values():
                    f.set_rows(n)
                self.drops_group.shape_rows = n
            self._shutdown(wait=True)
            attrs["dmi_committed"] = self._marker(summary)
            status = {"dmi_status": attrs.pop("dmi_status")}
            self.root_attrs.update(attrs)         # all but the status: until it is written the store reads as open
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # consolidated metadata is not in the v3 spec yet
                zarr.consolidate_metadata(self.loc.zarr())
            # the status and the consolidated metadata in one write of the root's zarr.json: a process
            # killed in between leaves an open store, never a closed one without its metadata
            self.root = zarr.open_group(self.loc.zarr(), mode="r+", use_consolidated=True)
            self.root.attrs.update(status)
        except OSError as e:
            self._shutdown(wait=False)
            if self.error is None:
                raise StoreError(f"{self.path}: closing the store failed: {e}. {FIX_IO}") from e
            log.warning("dmi: %s: the store keeps its last committed step %d (%s)", self.path, self.committed_step, e)
