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
import dataclasses
import datetime
import json
import logging
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec

from ..errors import StoreError
from ..plan import Plan, SitePlan, chunk_rows
from ..ring.budget import Drop
from .chunks import ArrayFile, LZ4, default_threads, lower_priority, storage_dtype, unlink_all
from .location import Remote, open_location
from .preflight import (TMP_SUFFIX, check_resumable, check_writable, create_atomically, create_remote, jsonable,
                        reserve, store_gone, stored_request_ids, unreserve, writer_info)
from .rows import PHASE_NAMES, computed_rows, copy_all, output_views


log = logging.getLogger("dmi")


COORDS = ("request", "position", "step", "phase", "token_id")
COORD_DTYPES = (str, "int64", "int64", str, "int64")


DROP_COLUMNS = {"step": "int64", "site": str, "requests": str, "rows": "int64", "bytes": "int64", "reason": str}


DROP_CHUNK = 1024


COPY_PARALLEL_BYTES = 4 << 20   # a step with more rows than this is copied into chunks by several threads


FREE_BYTES = 512 << 20          # chunk buffers kept for reuse: fresh ones cost a page fault per 4 KiB


TICK_S = 0.25          # the exporter thread looks at failures and the commit clock at least this often


COMMIT_S = 1.0         # open chunks are written and steps committed at least this often


_FIX_IO = ("Fix: free space or restore write permission there (policy.on_store_error: drop keeps the model "
           "running without the store)")


def sink_policy(plan: Plan) -> str:
    """What a failed store write does: policy.on_store_error (the plan defaults it from
    policy.mode: full raises, the model stops; best_effort drops, the model runs on)."""
    return plan.policy.on_store_error


@dataclass(eq=False)
class GroupBuffer:
    """One store group: its arrays' files, the open chunk's rows, and which rows are on disk."""
    name: str
    sites: list[SitePlan]                 # one per captured layer (or a single model-level site); [] for drops
    chunk_rows: int = 0
    capped: bool = True                   # counts against store.max_bytes, stops when the store failed
    files: dict[str, ArrayFile] = field(default_factory=dict)      # the token-dim arrays
    buf: dict[str, np.ndarray] = field(default_factory=dict)       # the open chunk, per array
    free: list = field(default_factory=list)      # buffers of written chunks, reused (no page faults)
    chunk_nbytes: int = 0
    rows: int = 0             # rows appended
    chunk: int = 0            # index of the open chunk
    fill: int = 0             # rows in the open chunk
    snap: int = 0             # rows covered by the last write submitted for the open chunk
    gen: int = 0              # writes submitted: orders the writes of one chunk
    # written by the pool threads, under the exporter's lock:
    whole: int = 0            # chunks [0, whole) are complete on disk
    durable: int = 0          # rows on disk, from row 0
    landed: dict = field(default_factory=dict)   # chunk >= whole -> (gen, rows end) of its newest file
    sizes: dict = field(default_factory=dict)    # chunk >= whole -> bytes of its files
    writing: dict = field(default_factory=dict)  # chunk >= whole -> its lock: one write of a chunk at a time
    shape_rows: int = 0       # rows the arrays' zarr.json covers (exporter thread)

    @property
    def per_layer(self) -> bool:
        return bool(self.sites) and self.sites[0].layer is not None


class _Entry:
    """One step appended but not yet committed: rows per group after it, and its row accounting."""
    __slots__ = ("step", "cum", "stored", "dropped", "nc", "reqs", "bytes")

    def __init__(self, step: int, n_sites: int):
        self.step = step
        self.cum = None
        self.stored = np.zeros(n_sites, np.int64)
        self.dropped = np.zeros(n_sites, np.int64)
        self.nc = np.zeros(n_sites, np.int64)        # selected rows the engine did not compute
        self.reqs: dict[str, np.ndarray] = {}        # group -> request index of each row
        self.bytes = np.zeros(n_sites, np.int64)


class ZarrExporter:
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
        self._log: collections.deque[_Entry] = collections.deque()
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

    # --- layout ---------------------------------------------------------------------------------
    def _create(self, path, attrs: dict, overwrite: bool) -> None:
        self.path = check_writable(path, overwrite, self.plan.storage_options)
        self.loc = open_location(self.path, self.plan.storage_options)
        try:
            if isinstance(self.loc, Remote):
                create_remote(self.loc, lambda stage: self._build(stage, attrs))
            else:
                create_atomically(self.path, overwrite, lambda stage: self._build(stage, attrs))
            self.root = zarr.open_group(self.loc.zarr(), mode="r+", use_consolidated=False)
            for g in self._all:
                self._open_files(g)
            reserve(self.loc)
        except OSError as e:
            raise StoreError(f"store {str(self.path)!r} cannot be created: {e}. Fix: choose a writable path") from e
        self.store_bytes = self.loc.total_bytes()

    def _build(self, stage, attrs: dict) -> None:
        """The new store's layout, in its staging directory or in memory (see create_atomically,
        create_remote)."""
        self.root = zarr.open_group(stage, mode="w", zarr_format=3)
        self.root.attrs.update(jsonable(attrs) | {"dmi_status": "open", "dmi_writer": writer_info()})
        # captured floats barely compress and zstd runs at a fraction of disk speed; blosc-lz4 keeps
        # near disk speed and shrinks the fill of partial tail chunks
        compressors = {"none": None, "zstd": "auto", "lz4": BloscCodec(**LZ4)}[self.plan.compression]
        for g in self.groups.values():
            self._create_group(g, compressors)
        grp = self.root.require_group("drops")
        for name, dt in DROP_COLUMNS.items():
            grp.create_array(name, shape=(0,), chunks=(DROP_CHUNK,), dtype=dt, dimension_names=["drop"])
        grp.attrs["description"] = ("every dropped capture: (step, site, requests, rows, bytes, reason); requests: "
                                    "the capture's request ids (as the request coordinate), space-separated; "
                                    "reason: what the policy dropped (ring_full, bandwidth) or sink (the store failed)")
        self.root.attrs["dmi_committed"] = self._marker()

    def _create_group(self, g: GroupBuffer, compressors) -> None:
        grp = self.root.require_group(g.name)
        first = g.sites[0]
        g.chunk_rows = chunk_rows(self.plan, g.sites, self.float_dtype.itemsize)
        lead = ("token", "layer") if g.per_layer else ("token",)
        nl = (len(g.sites),) if g.per_layer else ()
        coords = list(COORDS) + (["layer"] if g.per_layer else []) + (["head"] if first.heads else [])
        for o in first.outputs:
            dtype = self._stored(o.kind)
            arr = grp.create_array(o.name, shape=(0, *nl, *o.shape), chunks=(g.chunk_rows, *nl, *o.shape),
                                   compressors=compressors,
                                   dtype=dtype, dimension_names=[*lead, *o.dims],
                                   fill_value=-1 if o.kind == "int32" else np.nan)
            arr.attrs.update({"coordinates": " ".join(coords), "site": first.canonical,
                              "description": f"{first.canonical} {o.name}"})
        for c, dt in zip(COORDS, COORD_DTYPES):
            grp.create_array(c, shape=(0,), chunks=(g.chunk_rows,), dtype=dt, dimension_names=["token"])
        if g.per_layer:
            lay = grp.create_array("layer", shape=(len(g.sites),), dtype="int32", dimension_names=["layer"])
            lay[:] = np.array([s.layer for s in g.sites], np.int32)
        if first.heads:
            hd = grp.create_array("head", shape=(len(first.heads),), dtype="int32", dimension_names=["head"])
            hd[:] = np.array(first.heads, np.int32)
        grp.attrs.update({"site": first.canonical, "sites": [s.name for s in g.sites],
                          "tokens": dataclasses.asdict(first.tokens), "reduce": first.reduce or {}})

    def _open_files(self, g: GroupBuffer) -> None:
        # (a store written before a coordinate existed is resumed without it)
        coords = [c for c in COORDS if self.loc.exists(f"{g.name}/{c}/zarr.json")]
        names = [o.name for o in g.sites[0].outputs] + coords if g.sites else list(DROP_COLUMNS)
        g.files = {k: ArrayFile(self.loc, f"{g.name}/{k}") for k in names}
        g.chunk_rows = g.files[names[0]].chunks[0]
        g.buf = self._fresh(g)
        g.chunk_nbytes = sum(b.nbytes for b in g.buf.values())

    def _stored(self, kind: str) -> np.dtype:
        return self.float_dtype if kind == "float" else np.dtype(kind)

    def _reopen(self, path, attrs: dict) -> None:
        """Resume: append after the committed steps of an existing store (crashed or closed)."""
        self.loc = open_location(path, self.plan.storage_options)
        self.path = self.loc.url if isinstance(self.loc, Remote) else self.loc.path
        meta = check_resumable(self.loc, jsonable(attrs), self.plan.hook_file)
        stored = meta["attributes"]
        mark = stored["dmi_committed"]
        if not isinstance(self.loc, Remote):             # (an object store has no temp objects: a PUT is whole)
            for p in self.loc.path.rglob(f"*{TMP_SUFFIX}"):      # temp files of a killed writer
                unlink_all([p])
        try:
            meta.pop("consolidated_metadata", None)  # stale as soon as anything is appended
            self.loc.write("zarr.json", json.dumps(meta, indent=2).encode())
            self.root = zarr.open_group(self.loc.zarr(), mode="r+", use_consolidated=False)
            resumed = list(stored.get("resumed") or []) + [
                {"at_step": mark["next_step"], "previous_status": stored.get("dmi_status"),
                 "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}]
            self.root.attrs.update({"dmi_status": "open", "dmi_writer": writer_info(), "resumed": resumed})
            reserve(self.loc)
            for g in self._all:
                self._open_files(g)
                if g.sites:
                    floats = [g.files[o.name].dtype for o in g.sites[0].outputs if o.kind == "float"]
                    # the floats as the store holds them (a store from before bf16 was stored as bf16: float32)
                    want = chunk_rows(self.plan, g.sites, floats[0].itemsize if floats else 4)
                    if want != g.chunk_rows:
                        raise StoreError(f"{path}/{g.name}: chunks: the store has {g.chunk_rows} rows per chunk, "
                                         f"this run would write {want}. Fix: resume with the store.chunk_bytes the "
                                         f"store was written with, or capture into a new store")
                self._restore(g, int(mark["rows"].get(g.name, 0)))
        except StoreError:
            raise
        except OSError as e:
            raise StoreError(f"store {str(path)!r} cannot be resumed: {e}. Fix: check it is writable") from e
        names = stored.get("sites") or []
        for k in self.prior:
            values = mark.get(k) or []
            if len(values) == len(names) == len(self.plan.sites):
                self.prior[k][:] = values
        self.committed_step = int(mark["step"])
        self.next_step = int(mark["next_step"])
        self.stored_request_ids = stored_request_ids(self.loc)
        self.store_bytes = self.loc.total_bytes()

    def _restore(self, g: GroupBuffer, n: int) -> None:
        """Truncate a group to its committed rows and reload the rows of its partial last chunk."""
        for f in g.files.values():
            if f.meta["shape"][0] != n:
                f.set_rows(n)
        c = g.chunk_rows
        g.rows = g.durable = g.shape_rows = g.snap = n
        g.chunk = g.whole = n // c
        g.fill = n % c
        if g.fill:
            g.landed[g.chunk] = (0, n)
            g.sizes[g.chunk] = sum(self.loc.size(f.store_key(g.chunk)) for f in g.files.values())
            for name in g.files:
                values = np.asarray(self.root[f"{g.name}/{name}"][g.chunk * c:n])
                g.buf[name][:g.fill] = values.astype(object) if g.files[name].vlen else values

    # --- writing --------------------------------------------------------------------------------
    def write_step(self, ctrl, records, request_ids: list[str], ring_drops=()) -> None:
        """records: (slot, meta record, bytes) of one drained step; ring_drops: the ring's list of
        drops (those of this step and earlier ones are recorded with it)."""
        self._request_ids = request_ids
        if self.error is not None:
            self.drop_step(ctrl, records, request_ids, ring_drops)
            self._on_failure()
            return
        entry = _Entry(ctrl.step, len(self.plan.sites))
        try:
            self._write_rows(ctrl, records, request_ids, ring_drops, entry)
        except Exception as e:     # noqa: BLE001 - a step half written: the store takes nothing more
            with self._lock:
                if self.error is None:
                    self.error = e if isinstance(e, StoreError) else StoreError(
                        f"{self._label()}: exporting step {ctrl.step} failed: {type(e).__name__}: {e}")
            self._jobs.clear()
            self._flush_jobs()        # the drops table's chunks still go out; the site groups' do not
            self._sink_drops(entry)
            self._on_failure()
            return
        self._log.append(entry)
        if time.monotonic() - self._last_commit >= COMMIT_S:
            self.checkpoint()

    def _label(self) -> str:
        """How errors name this writer."""
        return str(self.path)

    def _write_rows(self, ctrl, records, request_ids, ring_drops, entry: _Entry) -> None:
        """A drained step's rows into the groups' open chunks (and its ring drops into the table)."""
        self._take_ring_drops(ring_drops, ctrl.step, entry)
        for g, sel, n, got in self._rows(ctrl, records, entry):
            self._ingest(g, ctrl, sel, n, got, request_ids, entry)
        self._flush_jobs()
        entry.cum = np.array([g.rows for g in self._all], np.int64)

    def drop_step(self, ctrl, records, request_ids, ring_drops=(), reason: str = "sink") -> None:
        """A step the failed store will not get: every capture of it is accounted as dropped (the
        drops table gets them at close, as far as the store still takes writes)."""
        self._request_ids = request_ids
        entry = _Entry(ctrl.step, len(self.plan.sites))
        self._take_ring_drops(ring_drops, ctrl.step, entry)
        self._step_drops(ctrl, records, entry, reason)
        self._fold(entry)

    def lose_step(self, ctrl, records, request_ids, ring_drops=(), reason: str = "writer") -> None:
        """A step whose rows were lost before they reached this exporter (the writer process died):
        its captures go into the drops table now and are committed with the steps around them."""
        self._request_ids = request_ids
        entry = _Entry(ctrl.step, len(self.plan.sites))
        self._take_ring_drops(ring_drops, ctrl.step, entry)
        self._append_drops(self._step_drops(ctrl, records, entry, reason))
        self._flush_jobs()
        entry.cum = np.array([g.rows for g in self._all], np.int64)
        self._log.append(entry)

    def _step_drops(self, ctrl, records, entry: _Entry, reason: str) -> list[Drop]:
        """Every capture of a step as dropped (``records``' bytes are only counted)."""
        new = []
        for g, sel, n, got in self._rows(ctrl, records, entry):
            reqs = tuple(np.unique(ctrl.tokens.request[sel]).tolist())
            for s, item in zip(g.sites, got):
                if item is not None:
                    new.append(Drop(ctrl.step, s.index, reqs, n, len(item[2]), reason))
                    self._drop(new[-1], entry)
        return new

    def _rows(self, ctrl, records, entry: _Entry):
        """Per group with rows this step: (group, selected rows, count, per-site record or None);
        counts the selected rows the engine never computed."""
        tokens = ctrl.tokens
        by_site = {slot.site: (slot, rec, data) for slot, rec, data in records}
        for g in self.groups.values():
            got = [by_site.get(s.index) for s in g.sites]
            for s, item in zip(g.sites, got):
                if item is None and s.index in ctrl.slots:
                    entry.nc[s.index] += len(ctrl.slots[s.index].sel)
            present = [x for x in got if x is not None]
            if not present:
                continue
            slot, rec, _ = present[0]
            sel = computed_rows(tokens, slot, rec)
            for s, item in zip(g.sites, got):
                if item is not None:
                    entry.nc[s.index] += len(slot.sel) - len(sel)
            if len(sel):
                yield g, sel, len(sel), got

    def _ingest(self, g: GroupBuffer, ctrl, sel, n: int, got, request_ids, entry: _Entry) -> None:
        tokens = ctrl.tokens
        req = tokens.request[sel]
        ids = np.asarray(request_ids[: int(req.max()) + 1], dtype=object)
        cols = {"request": ids[req], "position": tokens.position[sel], "step": np.full(n, ctrl.step, np.int64),
                "phase": PHASE_NAMES[tokens.phase[sel]]}
        if "token_id" in g.files:
            cols["token_id"] = tokens.token_ids(sel)
        srcs: dict[str, list] = {o.name: [None] * len(g.sites) for o in g.sites[0].outputs}
        for li, arrays in self._records(g, n, got, entry):    # a dropped layer's rows stay NaN / -1
            for name, a in arrays.items():
                srcs[name][li] = a
        entry.reqs[g.name] = req
        self._append(g, n, cols, srcs)

    def _records(self, g: GroupBuffer, n: int, got, entry: "_Entry"):
        """(layer index in the group, {output name: [n, *shape] view}) of each record of a group's
        step (dropped or not computed captures skipped), counted as stored."""
        outputs = g.sites[0].outputs
        for li, (s, item) in enumerate(zip(g.sites, got)):
            if item is None:
                continue
            _, rec, data = item
            if int(rec["rows"]) != n:
                raise StoreError(f"site {s.name}: record has {int(rec['rows'])} rows, expected {n}")
            entry.stored[s.index] += n
            entry.bytes[s.index] += len(data)
            yield li, output_views(outputs, n, data, self.capture_dtype)

    def _append(self, g: GroupBuffer, n: int, cols: dict, srcs: dict | None = None) -> None:
        """Copy n rows into the open chunk(s) of a group; a chunk that fills goes to the writers."""
        done, c = 0, g.chunk_rows
        while done < n:
            a = g.fill
            k = min(n - done, c - a)
            for name, v in cols.items():
                g.buf[name][a:a + k] = v[done:done + k]
            for name, layers in (srcs or {}).items():
                buf, fill = g.buf[name], g.files[name].fill
                for li, src in enumerate(layers):
                    dst = buf[a:a + k, li] if g.per_layer else buf[a:a + k]
                    if src is None:
                        dst[...] = fill
                    else:
                        self._jobs.append((dst, src[done:done + k]))
                        self._job_bytes += dst.nbytes
            g.fill += k
            g.rows += k
            done += k
            if g.fill == c:
                self._sealed.append((g, g.chunk, g.buf, g.rows))
                g.buf = self._fresh(g)
                g.chunk, g.fill, g.snap = g.chunk + 1, 0, g.rows

    def _flush_jobs(self) -> None:
        """Run the step's row copies (on several threads when the step is big), then hand the
        chunks it filled to the writers."""
        jobs, self._jobs = self._jobs, []
        if self._copy_pool is not None and self._job_bytes >= COPY_PARALLEL_BYTES and len(jobs) > 1:
            n = min(self._workers, len(jobs))
            list(self._copy_pool.map(copy_all, [jobs[k::n] for k in range(n)]))
        else:
            copy_all(jobs)
        self._job_bytes = 0
        sealed, self._sealed = self._sealed, []
        for g, i, bufs, end in sealed:
            self._submit(g, i, bufs, end, recycle=True)

    def _fresh(self, g: GroupBuffer) -> dict[str, np.ndarray]:
        with self._lock:
            if g.free:
                self._free_bytes -= g.chunk_nbytes
                return g.free.pop()
        return {k: np.empty((g.chunk_rows, *f.chunks[1:]), f.dtype) for k, f in g.files.items()}

    def _write_open(self, g: GroupBuffer) -> None:
        """Write the open chunk as it is (padded with the fill value), if it holds unwritten rows."""
        if not g.fill or g.snap == g.rows:
            return
        bufs = {}
        for k, f in g.files.items():
            b = np.empty_like(g.buf[k])
            b[:g.fill] = g.buf[k][:g.fill]
            b[g.fill:] = f.fill
            bufs[k] = b
        g.snap = g.rows
        self._submit(g, g.chunk, bufs, g.rows, recycle=False)

    def _submit(self, g: GroupBuffer, i: int, bufs: dict, end: int, recycle: bool) -> None:
        g.gen += 1
        fut = self._pool.submit(self._write_chunk, g, i, g.gen, bufs, end, recycle)
        fut.add_done_callback(self._written)
        self._inflight.append(fut)
        while self._inflight and (self._inflight[0].done() or len(self._inflight) > self._max_inflight):
            wait([self._inflight.popleft()])

    def _write_chunk(self, g: GroupBuffer, i: int, gen: int, bufs: dict, end: int, recycle: bool) -> None:
        """Pool thread: encode and write every array's chunk ``i`` of a group; the files replace the
        old ones together, and only if no newer write of this chunk landed first."""
        if self.error is not None and g.capped:
            return
        tmps: list[Path] = []
        try:
            encoded = [(f, f.encode(bufs[k])) for k, f in g.files.items()]
            size = sum(memoryview(d).nbytes for _, d in encoded)
            self._throttle(size)
            if self.loc.remote:
                self._put(g, i, gen, end, size, encoded)
            else:
                files = []
                for f, data in encoded:
                    tmp, path = f.write(i, data)
                    tmps.append(tmp)
                    files.append((tmp, path))
                tmps = []
                self._land(g, i, gen, end, size, files)
        except StoreError:
            raise
        except OSError as e:
            raise self._write_error(g, i, e) from e
        finally:
            unlink_all(tmps)
            if recycle:
                with self._lock:
                    if self._free_bytes + g.chunk_nbytes <= FREE_BYTES:
                        g.free.append(bufs)
                        self._free_bytes += g.chunk_nbytes

    def _land(self, g: GroupBuffer, i: int, gen: int, end: int, size: int, files: list) -> None:
        """Chunk ``i``'s temp files (``files``: (temp, final)) replace its files, unless a newer write
        of the chunk landed first; the group's rows on disk move on. The temp files are gone after."""
        left = files
        try:
            with self._lock:
                if i < g.whole or g.landed.get(i, (0, 0))[0] > gen:
                    return       # stale: a newer write of this chunk is on disk
                self._charge(g, i, size)
                for k, (tmp, path) in enumerate(files):
                    left = files[k:]
                    os.replace(tmp, path)
                left = []
                self._landed(g, i, gen, end)
        finally:
            unlink_all(tmp for tmp, _ in left)

    def _put(self, g: GroupBuffer, i: int, gen: int, end: int, size: int, encoded: list) -> None:
        """Chunk ``i``'s objects PUT over its old ones on an object store (each PUT lands whole; there
        is no rename to do under the lock), unless a newer write of the chunk landed first."""
        with self._lock:
            writing = g.writing.setdefault(i, threading.Lock())
        with writing:            # one write of a chunk at a time: an older write never lands over a newer one
            with self._lock:
                if i < g.whole or g.landed.get(i, (0, 0))[0] > gen:
                    return       # stale: a newer write of this chunk is stored
                self._charge(g, i, size)
            for f, data in encoded:
                f.put(i, data)
            with self._lock:
                self._landed(g, i, gen, end)

    def _landed(self, g: GroupBuffer, i: int, gen: int, end: int) -> None:
        """Chunk ``i`` (rows up to ``end``) is stored: the group's whole chunks and rows stored move on
        (under the lock)."""
        g.landed[i] = (gen, end)
        c = g.chunk_rows
        while g.landed.get(g.whole, (0, 0))[1] == (g.whole + 1) * c:
            del g.landed[g.whole]
            g.sizes.pop(g.whole, None)
            g.writing.pop(g.whole, None)
            g.whole += 1
        g.durable = g.landed.get(g.whole, (0, g.whole * c))[1]

    def _write_error(self, g: GroupBuffer, i: int, e) -> StoreError:
        """A failed chunk write as the store's error (the store's directory removed, or an I/O error)."""
        return store_gone(self.loc) or StoreError(f"{self.path}: {g.name}: writing chunk {i} failed: {e}. {_FIX_IO}")

    def _charge(self, g: GroupBuffer, i: int, size: int) -> None:
        """Bytes on disk after replacing chunk i's files (under the lock); refuses past store.max_bytes."""
        delta = size - g.sizes.get(i, 0)
        cap = self.plan.max_bytes
        if cap is not None and g.capped and self.store_bytes + delta > cap:
            raise StoreError(f"{self.path}: store.max_bytes: store full: chunk {i} of {g.name} ({size:,} bytes) "
                             f"would take the store to {self.store_bytes + delta:,} bytes, over the cap of {cap:,}. "
                             f"Fix: raise store.max_bytes, capture fewer sites or tokens, or use store.compression")
        self.store_bytes += delta
        g.sizes[i] = size

    def _throttle(self, size: int) -> None:
        """store.bytes_per_s: each write starts when the ones before it have used their share of time."""
        rate = self.plan.bytes_per_s
        if not rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(self._rate_t, now)
            self._rate_t = start + size / rate
        if start > now:
            time.sleep(start - now)

    def _written(self, fut) -> None:
        e = fut.exception()
        if e is None:
            return
        if not isinstance(e, StoreError):
            e = StoreError(f"{self.path}: writing a chunk failed: {type(e).__name__}: {e}")
        with self._lock:
            if self.error is None:
                self.error = e

    def _wait_all(self) -> None:
        while self._inflight:
            wait([self._inflight.popleft()])

    # --- commit ---------------------------------------------------------------------------------
    def tick(self) -> None:
        """The exporter thread, idle (at least every TICK_S): surface a failure, keep commits going."""
        if self.error is not None:
            self._on_failure()
        elif time.monotonic() - self._last_commit >= COMMIT_S:
            self.checkpoint()

    def checkpoint(self, wait_all: bool = False) -> None:
        """Write the open chunks, then commit every step whose rows are all on disk."""
        self._last_commit = time.monotonic()
        if self.error is None:
            for g in self._all:
                self._write_open(g)
        if wait_all:
            self._wait_all()
        if self.error is not None:
            self._on_failure()
            return
        with self._lock:
            durable = np.array([g.durable for g in self._all], np.int64)
        last = None
        while self._log and (self._log[0].cum <= durable).all():
            last = self._log.popleft()
            self._fold(last)
        if last is None:
            return
        self.committed_step = last.step
        try:
            gone = store_gone(self.loc)
            if gone is not None:
                raise gone
            for g, n in zip(self._all, last.cum.tolist()):
                if g.shape_rows != n:
                    for f in g.files.values():
                        f.set_rows(n)
                    g.shape_rows = n
            self.root.attrs["dmi_committed"] = self._marker()   # zarr writes a temp file and renames it
        except (OSError, StoreError) as e:
            with self._lock:
                if self.error is None:
                    self.error = e if isinstance(e, StoreError) else (store_gone(self.loc) or StoreError(
                        f"{self.path}: committing step {last.step} failed: {e}. {_FIX_IO}"))
            self._on_failure()

    def _marker(self, summary: dict | None = None) -> dict:
        """Root attribute ``dmi_committed``: the last step the store holds, the rows of each group up to
        it, and per site (in ``sites`` order) the row accounting of the steps it covers."""
        acc = self.accounting()
        names = [s.name for s in self.plan.sites]
        summary = summary or {}
        if "rows_selected" in summary:
            acc = {k: [summary[f"rows_{k}"][n] for n in names] for k in ("selected", "stored", "dropped", "not_computed")}
        else:     # committed steps only: their selected rows are exactly what was stored, dropped or not computed
            acc["selected"] = acc["selected"] + self._acc["stored"] + self._acc["dropped"] + self._acc["not_computed"]
        return {"step": self.committed_step, "next_step": summary.get("steps", self.committed_step + 1),
                "rows": {g.name: g.shape_rows for g in self._all},
                **{k: [int(x) for x in v] for k, v in acc.items()}}

    def continue_run(self, prior: dict[str, np.ndarray], ring_drops_done: int) -> None:
        """This exporter resumed a store that the same run was writing (its writer process died):
        what the store committed beyond ``prior`` (the store's accounting when the run opened it)
        is this run's own, and the run's first ``ring_drops_done`` ring drops are in its table."""
        for k in ("stored", "dropped", "not_computed"):
            self._acc[k] = self.prior[k] - prior[k]
        self.prior = {k: np.array(prior[k], np.int64) for k in self.prior}
        self._ring_pos = ring_drops_done

    def accounting(self) -> dict[str, np.ndarray]:
        """Per site, rows accounted so far (earlier runs of a resumed store included): ``stored``,
        ``dropped``, ``not_computed``; ``selected`` holds only the earlier runs' (the run counts its own)."""
        return {"selected": self.prior["selected"].copy(),
                **{k: self.prior[k] + self._acc[k] for k in ("stored", "dropped", "not_computed")}}

    def _fold(self, e: _Entry) -> None:
        self._acc["stored"] += e.stored
        self._acc["dropped"] += e.dropped
        self._acc["not_computed"] += e.nc

    # --- drops and failures -----------------------------------------------------------------------
    def _take_ring_drops(self, ring_drops, step: int, entry: _Entry | None) -> None:
        """The ring's drops up to ``step``: counted with the step and appended to the drops table."""
        new = []
        while self._ring_pos < len(ring_drops) and (step is None or ring_drops[self._ring_pos].step <= step):
            new.append(ring_drops[self._ring_pos])
            self._ring_pos += 1
        for d in new:
            if entry is not None:
                entry.dropped[d.site] += d.rows
            else:
                self._acc["dropped"][d.site] += d.rows
        self._append_drops(new)
        release = getattr(ring_drops, "release", None)     # (dmi.ring.budget.DropLog: written, so forgotten there)
        if release is not None:
            release(self._ring_pos)

    def _append_drops(self, drops: list[Drop]) -> None:
        if not drops:
            return
        names = [s.name for s in self.plan.sites]
        cols = {"step": np.array([d.step for d in drops], np.int64),
                "site": np.array([names[d.site] for d in drops], object),
                "requests": np.array([self.request_names(d) for d in drops], object),
                "rows": np.array([d.rows for d in drops], np.int64),
                "bytes": np.array([d.bytes for d in drops], np.int64),
                "reason": np.array([d.reason for d in drops], object)}
        self._append(self.drops_group, len(drops), cols)
        self._flush_jobs()

    def request_names(self, d: Drop) -> str:
        """The dropped capture's requests as the store names them (its ``request`` coordinate's ids),
        space-separated."""
        ids = self._request_ids
        return " ".join(ids[i] if i < len(ids) else str(i) for i in d.requests)

    def _drop(self, d: Drop, entry: _Entry) -> None:
        self.drops.append(d)
        entry.dropped[d.site] += d.rows

    def _sink_drops(self, e: _Entry) -> None:
        """A step whose rows will never be committed: its stored rows become drops (reason sink)."""
        names = {s.index: s for s in self.plan.sites}
        for i in np.flatnonzero(e.stored).tolist():
            rows = int(e.stored[i])
            reqs = tuple(np.unique(e.reqs.get(names[i].group, np.zeros(0, np.int64))).tolist())
            self.drops.append(Drop(e.step, i, reqs, rows, int(e.bytes[i]), "sink"))
            e.dropped[i] += rows
            e.stored[i] = 0
        self._fold(e)

    def _on_failure(self) -> None:
        """The store failed: steps not committed are accounted as dropped (reason sink) and nothing
        more is written to the site groups; policy.on_store_error raise: raise it (once)."""
        if not self._failed:
            self._failed = True
            while self._log:
                self._sink_drops(self._log.popleft())
            if self.on_error == "drop":
                log.warning("dmi: %s; policy.on_store_error is drop: the model keeps running and every later "
                            "capture is dropped (reason sink)", self.error)
        if self.on_error == "raise" and not self._raised:
            self._raised = True
            raise self.error

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
                    self.root.attrs.update(attrs | {"dmi_committed": self._marker(summary)})
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
            self.root.attrs.update(attrs)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # consolidated metadata is not in the v3 spec yet
                zarr.consolidate_metadata(self.loc.zarr())
        except OSError as e:
            self._shutdown(wait=False)
            if self.error is None:
                raise StoreError(f"{self.path}: closing the store failed: {e}. {_FIX_IO}") from e
            log.warning("dmi: %s: the store keeps its last committed step %d (%s)", self.path, self.committed_step, e)

    def _shutdown(self, wait: bool) -> None:
        self._pool.shutdown(wait=wait)
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=wait)

