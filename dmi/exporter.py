"""Zarr v3 exporter: drained steps in, chunk-aligned appends out.

Layout (mirrors the spec): one group per canonical site (``layers/attn/q``, ``final_norm``,
``logits``) holding its output arrays ``[token, (layer,) ...]`` and the token coordinates
``request``, ``position``, ``step``, ``phase`` of that group's rows. Every group has its own
``token`` dim (groups keep different rows) and no ancestor group holds arrays, so
``xarray.open_datatree`` opens the whole store. Root attributes carry the run metadata; the
``drops`` group lists every dropped capture.

One thread (the exporter's) owns every array handle: one writer per array, no locks needed.
Rows are buffered per group and written in whole chunks; the tail is written on close.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec

from .errors import StoreError
from .plan import Plan, SitePlan
from .tokens import PHASES

COORDS = ("request", "position", "step", "phase")


@dataclass
class GroupBuffer:
    """Pending rows of one store group (one canonical site) before they fill a chunk."""
    name: str
    sites: list[SitePlan]                 # one per captured layer (or a single model-level site)
    chunk_rows: int
    arrays: dict = field(default_factory=dict)
    pending: dict[str, list[np.ndarray]] = field(default_factory=dict)
    pending_rows: int = 0
    written: int = 0

    @property
    def per_layer(self) -> bool:
        return self.sites[0].layer is not None


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4}


def storage_dtype(plan: Plan, capture_dtype: str) -> np.dtype:
    """Float storage dtype: the capture dtype ('native'), or the hook spec's store.dtype;
    bfloat16 has no Zarr dtype and is stored as float32 (exact)."""
    name = capture_dtype if plan.store_dtype == "native" else plan.store_dtype
    return np.dtype("float32" if name == "bfloat16" else name)


def check_writable(path: str | Path, overwrite: bool) -> Path:
    """Fail early, naming the path and the fix, if the store cannot be created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise StoreError(f"store {str(path)!r} exists and is not a directory. Fix: choose another path")
    if path.exists() and not overwrite:
        raise StoreError(f"store {str(path)!r} already exists. Fix: pass overwrite=True (CLI: --overwrite), "
                         f"or choose a new path")
    if path.exists() and any(path.iterdir()) and not (path / "zarr.json").exists():
        raise StoreError(f"store {str(path)!r} is a directory that is not a Zarr store; overwrite=True would delete "
                         f"everything in it. Fix: choose a new path, or remove that directory yourself")
    probe_dir = path.parent if str(path.parent) else Path(".")
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise StoreError(f"store {str(path)!r} cannot be created: {str(probe_dir)!r} is a file, not a directory. "
                         f"Fix: choose a store path whose parent is a directory")
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise StoreError(f"store {str(path)!r} cannot be written: {str(probe_dir)!r} is not writable. "
                         f"Fix: choose a store path in a writable directory")
    return path


class ZarrExporter:
    def __init__(self, path: str | Path, plan: Plan, capture_dtype: str, attrs: dict, overwrite: bool = False):
        self.path = check_writable(path, overwrite)
        if self.path.exists():
            shutil.rmtree(self.path)
        self.plan = plan
        self.capture_dtype = capture_dtype
        self.float_dtype = storage_dtype(plan, self.capture_dtype)
        try:
            self.root = zarr.open_group(str(self.path), mode="w", zarr_format=3)
        except OSError as e:
            raise StoreError(f"store {str(self.path)!r} cannot be created: {e}. Fix: choose a writable path") from e
        self.root.attrs.update(_jsonable(attrs) | {"dmi_status": "open"})
        # captured floats barely compress and zstd runs at a fraction of disk speed; blosc-lz4 keeps
        # near disk speed and shrinks the fill of partial tail chunks
        self._compressors = {"none": None, "zstd": "auto",
                             "lz4": BloscCodec(cname="lz4", clevel=1, shuffle="shuffle")}[plan.compression]
        # groups flush their whole chunks in parallel (file writes release the GIL); each array
        # is still written by one task at a time
        self._pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="dmi-zarr")
        self.groups: dict[str, GroupBuffer] = {}
        for s in plan.sites:
            self.groups.setdefault(s.group, GroupBuffer(s.group, [], 0)).sites.append(s)
        for g in self.groups.values():
            self._create(g)
        self.rows_stored: dict[int, int] = {s.index: 0 for s in plan.sites}
        # selected rows the engine never computed: logits of non-final prompt positions under
        # generate, or a module that did not run in a step (not drops: nothing was captured)
        self.rows_not_computed: dict[int, int] = {s.index: 0 for s in plan.sites}

    # --- layout ---------------------------------------------------------------------------------
    def _create(self, g: GroupBuffer) -> None:
        grp = self.root.require_group(g.name)
        first = g.sites[0]
        row_bytes = sum(o.row_elems for o in first.outputs) * 4 * len(g.sites)
        g.chunk_rows = int(max(16, min(65536, self.plan.chunk_bytes // max(row_bytes, 1))))
        lead = ("token", "layer") if g.per_layer else ("token",)
        nl = (len(g.sites),) if g.per_layer else ()
        coords = list(COORDS) + (["layer"] if g.per_layer else []) + (["head"] if first.heads else [])
        for o in first.outputs:
            dtype = self._stored(o.kind)
            arr = grp.create_array(o.name, shape=(0, *nl, *o.shape), chunks=(g.chunk_rows, *nl, *o.shape),
                                   compressors=self._compressors,
                                   dtype=dtype, dimension_names=[*lead, *o.dims],
                                   fill_value=-1 if o.kind == "int32" else np.nan)
            arr.attrs.update({"coordinates": " ".join(coords), "site": first.canonical,
                              "description": f"{first.canonical} {o.name}"})
            g.arrays[o.name] = arr
        for c, dt in zip(COORDS, (str, "int64", "int64", str)):
            g.arrays[c] = grp.create_array(c, shape=(0,), chunks=(g.chunk_rows,), dtype=dt, dimension_names=["token"])
        if g.per_layer:
            lay = grp.create_array("layer", shape=(len(g.sites),), dtype="int32", dimension_names=["layer"])
            lay[:] = np.array([s.layer for s in g.sites], np.int32)
        if first.heads:
            hd = grp.create_array("head", shape=(len(first.heads),), dtype="int32", dimension_names=["head"])
            hd[:] = np.array(first.heads, np.int32)
        grp.attrs.update({"site": first.canonical, "sites": [s.name for s in g.sites],
                          "tokens": dataclasses.asdict(first.tokens), "reduce": first.reduce or {}})
        g.pending = {k: [] for k in g.arrays if k not in ("layer", "head")}

    def _stored(self, kind: str) -> np.dtype:
        return self.float_dtype if kind == "float" else np.dtype(kind)

    # --- writing --------------------------------------------------------------------------------
    def write_step(self, ctrl, records, request_ids: list[str]) -> None:
        """records: (slot, meta record, bytes) of one drained step."""
        tokens = ctrl.tokens
        by_site = {slot.site: (slot, rec, data) for slot, rec, data in records}
        ids = np.asarray(request_ids[: int(tokens.request.max()) + 1] if len(tokens) else [], dtype=str)
        for g in self.groups.values():
            got = [by_site.get(s.index) for s in g.sites]
            for s, item in zip(g.sites, got):
                if item is None and s.index in ctrl.slots:
                    self.rows_not_computed[s.index] += len(ctrl.slots[s.index].sel)
            present = [x for x in got if x is not None]
            if not present:
                continue
            slot, rec, _ = present[0]
            keep = tokens.local[slot.sel] >= ctrl.tokens.seq - int(rec["src_seq"])
            sel = slot.sel[keep]
            n = len(sel)
            for s, item in zip(g.sites, got):
                if item is not None:
                    self.rows_not_computed[s.index] += len(slot.sel) - n
            if n == 0:
                continue
            first = g.sites[0]
            blocks = {}
            for o in first.outputs:
                dtype = self._stored(o.kind)
                shape = (n, len(g.sites), *o.shape) if g.per_layer else (n, *o.shape)
                blocks[o.name] = np.empty(shape, dtype)
            for li, item in enumerate(got):
                if item is None:    # this layer's capture was dropped: its rows stay NaN / -1
                    for o in first.outputs:
                        blocks[o.name][:, li] = -1 if o.kind == "int32" else np.nan
                    continue
                s_rec, rec, data = item
                if int(rec["rows"]) != n:
                    raise StoreError(f"site {g.sites[li].name}: record has {int(rec['rows'])} rows, expected {n}")
                offset = 0
                for o in first.outputs:
                    src = self.capture_dtype if o.kind == "float" else o.kind
                    nb = n * o.row_elems * ITEMSIZE[src]
                    vals = _decode(data[offset:offset + nb], src).reshape(n, *o.shape)
                    offset += nb
                    if g.per_layer:
                        blocks[o.name][:, li] = vals
                    else:
                        blocks[o.name][:] = vals
                self.rows_stored[g.sites[li].index] += n
            g.pending["request"].append(ids[tokens.request[sel]])
            g.pending["position"].append(tokens.position[sel])
            g.pending["step"].append(np.full(n, ctrl.step, np.int64))
            g.pending["phase"].append(np.asarray(PHASES)[tokens.phase[sel]])
            for k, v in blocks.items():
                g.pending[k].append(v)
            g.pending_rows += n
        full = [g for g in self.groups.values() if g.pending_rows >= g.chunk_rows]
        for done in [self._pool.submit(self._flush, g, True) for g in full]:
            done.result()

    def _flush(self, g: GroupBuffer, whole_chunks: bool) -> None:
        if not g.pending_rows:
            return
        n = g.pending_rows // g.chunk_rows * g.chunk_rows if whole_chunks else g.pending_rows
        if n == 0:
            return
        start = g.written
        for k, parts in g.pending.items():
            data = np.concatenate(parts) if len(parts) > 1 else parts[0]
            arr = g.arrays[k]
            arr.resize((start + n, *arr.shape[1:]))
            arr[start:start + n] = data[:n]
            g.pending[k] = [data[n:]] if len(data) > n else []
        g.written += n
        g.pending_rows -= n

    def close(self, summary: dict, clean: bool = True) -> None:
        for done in [self._pool.submit(self._flush, g, False) for g in self.groups.values()]:
            done.result()
        self._pool.shutdown()
        self._write_drops(summary.pop("drops", []))
        self.root.attrs.update(_jsonable(summary) | {"dmi_status": "closed" if clean else "failed"})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # consolidated metadata is not in the v3 spec yet
            zarr.consolidate_metadata(str(self.path))

    def _write_drops(self, drops) -> None:
        grp = self.root.require_group("drops")
        cols = {"step": ("int64", [d.step for d in drops]),
                "site": (str, [self.plan.sites[d.site].name for d in drops]),
                "requests": (str, [" ".join(map(str, d.requests)) for d in drops]),
                "rows": ("int64", [d.rows for d in drops]),
                "bytes": ("int64", [d.bytes for d in drops]),
                "reason": (str, [d.reason for d in drops])}
        for name, (dt, values) in cols.items():
            arr = grp.create_array(name, shape=(len(values),), dtype=dt, dimension_names=["drop"],
                                   chunks=(max(len(values), 1),), overwrite=True)
            if values:
                arr[:] = np.asarray(values, dtype=dt if dt is not str else str)
        grp.attrs["description"] = "every capture dropped under policy best_effort: (step, site, requests, rows, bytes)"


def _decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":   # the upper half of a float32: widening is exact
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.dtype(dtype))


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))
