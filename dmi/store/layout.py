"""The store's layout, as :class:`dmi.store.exporter.ZarrExporter` writes it: one group per
canonical site with its output arrays and token coordinates, and the ``drops`` table; created
atomically for a new store, or reopened (truncated to its last commit) to resume one.
"""
from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field

import numpy as np
import zarr
from zarr.codecs import BloscCodec

from ..errors import StoreError
from ..plan import SitePlan, chunk_rows
from .chunks import ArrayFile, LZ4, unlink_all
from .location import Remote, open_location
from .preflight import (TMP_SUFFIX, check_resumable, check_writable, create_atomically, create_remote, jsonable,
                        reserve, stored_request_ids, writer_info)
from .root_attrs import RootAttrs


COORDS = ("request", "position", "step", "phase", "token_id")
COORD_DTYPES = (str, "int64", "int64", str, "int64")


DROP_COLUMNS = {"step": "int64", "site": str, "requests": str, "rows": "int64", "bytes": "int64", "reason": str}


DROP_CHUNK = 1024


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


class StoreLayout:
    """Creating or reopening the store (a mixin of :class:`dmi.store.exporter.ZarrExporter`, whose
    plan, groups and commit marker it uses)."""

    def _create(self, path, attrs: dict, overwrite: bool) -> None:
        self.path = check_writable(path, overwrite, self.plan.storage_options)
        self.loc = open_location(self.path, self.plan.storage_options)
        try:
            if isinstance(self.loc, Remote):
                create_remote(self.loc, lambda stage: self._build(stage, attrs))
            else:
                create_atomically(self.path, overwrite, lambda stage: self._build(stage, attrs))
            self.root = zarr.open_group(self.loc.zarr(), mode="r+", use_consolidated=False)
            self.root_attrs = RootAttrs(self.loc)
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
            resumed = list(stored.get("resumed") or []) + [
                {"at_step": mark["next_step"], "previous_status": stored.get("dmi_status"),
                 "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}]
            self.root_attrs = RootAttrs(self.loc, meta)
            self.root_attrs.update({"dmi_status": "open", "dmi_writer": writer_info(), "resumed": resumed})
            self.root = zarr.open_group(self.loc.zarr(), mode="r+", use_consolidated=False)
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
