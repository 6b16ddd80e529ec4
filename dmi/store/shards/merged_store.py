"""The merged store of a tensor parallel run, laid out once by rank 0 before any rank writes
(:func:`create_store`): the groups and arrays a single-process store has, split arrays chunked at
the shard boundaries, the ``tp`` layout in the attributes, one ``tp/rank<r>`` group of notes per
rank.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..chunks import storage_dtype
from ..layout import COORD_DTYPES, COORDS, DROP_CHUNK, DROP_COLUMNS
from ..preflight import check_writable, create_atomically, jsonable
from .sharding import TPLayout, index_runs


def site_groups(plan) -> dict[str, list]:
    """The plan's sites by store group, in plan order."""
    groups: dict[str, list] = {}
    for s in plan.sites:
        groups.setdefault(s.group, []).append(s)
    return groups


def _token_chunk(plan, layout: TPLayout, sites: list, chunk_rows: int | None, float_itemsize: int) -> int:
    """Rows per chunk: ``plan.chunk_bytes`` over the bytes of one rank's part of a row (what a rank
    buffers for its open chunk; its chunk files split that along the split dim)."""
    if chunk_rows:
        return int(chunk_rows)
    first = sites[0]
    sh = layout.sites[first.canonical]
    split = max(len(layout.stored_positions(first, r)) for r in range(layout.world)) if sh.kind == "split" else 1
    part = 0                               # bytes of one rank's part of a row
    for o in first.outputs:
        n = o.row_elems * o.itemsize(float_itemsize)
        if sh.kind == "split":
            n = n // o.shape[sh.axis] * split
        part += n
    row_bytes = part * len(sites)
    return int(max(16, min(65536, plan.chunk_bytes // max(row_bytes, 1))))


def create_store(path, plan, layout: TPLayout, capture_dtype: str, attrs: dict, *, overwrite: bool = False,
                 chunk_rows: int | None = None):
    """Rank 0, once, before any rank writes: the merged store's layout — the same groups, arrays,
    dimension names, coordinates and ``drops`` group as :class:`dmi.store.exporter.ZarrExporter` makes for
    the unsharded ``plan``, split arrays chunked at shard boundaries, the ``tp`` layout in the root
    and array attributes, and one ``tp/rank<r>`` group per rank (its notes: only that rank writes
    them). Token extents start at 0 and only :func:`commit` grows them. Returns the root group."""
    import zarr
    layout.check_plan(plan)
    path = check_writable(path, overwrite)
    # built beside the path and renamed into place: a rank 0 killed meanwhile leaves no half store
    create_atomically(path, overwrite, lambda stage: _lay_out(stage, plan, layout, capture_dtype, attrs, chunk_rows))
    return zarr.open_group(str(path), mode="r+", use_consolidated=False)


def _lay_out(path, plan, layout: TPLayout, capture_dtype: str, attrs: dict, chunk_rows: int | None):
    """create_store's layout, in its staging directory."""
    import zarr
    root = zarr.open_group(str(path), mode="w", zarr_format=3)
    root.attrs.update(jsonable(attrs) | {"dmi_status": "open", "tp": layout.describe()})
    float_dtype = storage_dtype(plan, capture_dtype)
    compressors = _compressors(plan)
    for name, sites in site_groups(plan).items():
        first = sites[0]
        per_layer = first.layer is not None
        sh = layout.sites[first.canonical]
        rows = _token_chunk(plan, layout, sites, chunk_rows, float_dtype.itemsize)
        grp = root.require_group(name)
        lead, nl = (("token", "layer"), (len(sites),)) if per_layer else (("token",), ())
        coords = list(COORDS) + (["layer"] if per_layer else []) + (["head"] if first.heads else [])
        ranks = {str(r): index_runs([j for j, _ in layout.stored_positions(first, r)]) for r in range(layout.world)}
        for o in first.outputs:
            dtype = float_dtype if o.kind == "float" else np.dtype(o.kind)
            chunks = list(o.shape)
            note: dict = {"kind": sh.kind, "writer": 0}
            if sh.kind == "split":
                chunks[sh.axis] = layout.split_chunk(first)
                note = {"kind": "split", "dim": sh.dim, "axis": len(lead) + sh.axis, "chunk": chunks[sh.axis],
                        "rank": {r: [list(x) for x in v] for r, v in ranks.items() if v}}
            arr = grp.create_array(o.name, shape=(0, *nl, *o.shape), chunks=(rows, *nl, *chunks),
                                   dtype=dtype, dimension_names=[*lead, *o.dims], compressors=compressors,
                                   fill_value=-1 if o.kind == "int32" else np.nan)
            arr.attrs.update({"coordinates": " ".join(coords), "site": first.canonical,
                              "description": f"{first.canonical} {o.name}", "tp": note})
        for c, dt in zip(COORDS, COORD_DTYPES):
            grp.create_array(c, shape=(0,), chunks=(rows,), dtype=dt, dimension_names=["token"])
        if per_layer:
            grp.create_array("layer", shape=(len(sites),), dtype="int32", dimension_names=["layer"])[:] = \
                np.array([s.layer for s in sites], np.int32)
        if first.heads:
            grp.create_array("head", shape=(len(first.heads),), dtype="int32", dimension_names=["head"])[:] = \
                np.array(first.heads, np.int32)
        grp.attrs.update({"site": first.canonical, "sites": [s.name for s in sites],
                          "tokens": dataclasses.asdict(first.tokens), "reduce": first.reduce or {},
                          "tp": {"coord_rank": layout.coord_rank(first), **sh.describe()}})
    drops = root.require_group("drops")
    for name, dt in DROP_COLUMNS.items():
        drops.create_array(name, shape=(0,), chunks=(DROP_CHUNK,), dtype=dt, dimension_names=["drop"])
    drops.attrs["description"] = "dropped captures; under tensor parallelism each rank's are in tp/rank<r>"
    tp = root.require_group("tp")
    for r in range(layout.world):
        tp.require_group(f"rank{r}").attrs.update({"rank": r, "status": "open", "rows": {}})
    return root


def _compressors(plan):
    from zarr.codecs import BloscCodec
    return {"none": None, "zstd": "auto",
            "lz4": BloscCodec(cname="lz4", clevel=1, shuffle="shuffle")}[plan.compression]


def chunk_key(meta: dict, coords: tuple[int, ...]) -> str:
    """A chunk's key under the array's chunk_key_encoding (zarr v3 default or v2)."""
    enc = meta["chunk_key_encoding"]
    default = enc["name"] == "default"
    sep = enc.get("configuration", {}).get("separator", "/" if default else ".")
    return ("c" + sep if default else "") + sep.join(map(str, coords))
