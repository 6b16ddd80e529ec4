"""A store as an ``xarray.DataTree``: ``dmi.open``."""
from __future__ import annotations

from pathlib import Path


def open_store(path: str | Path, storage_options: dict | None = None, *, dtype: str | None = "float32",
               chunks=None):
    """The store as an ``xarray.DataTree`` (named dims; request/position/step/phase/token_id coordinates).

    dtype: the float captures read as this dtype (default float32: exact for bfloat16 and float16,
    and what numpy, xarray's reductions and ``torch.from_numpy`` compute with), cast lazily as
    values are read; None: as stored (bfloat16 as ``ml_dtypes.bfloat16``).
    chunks: as for ``xarray.open_datatree``; ``{}`` gives dask arrays in the store's chunks.

    ``path``: a local directory, or an object store URL (``s3://bucket/run.zarr``; credentials
    from the environment and config files, or ``storage_options`` such as ``endpoint_url``).
    A closed store opens from its consolidated metadata. A store still open (being written, or
    whose writer died: ``dmi_status: open``) opens from each array's own metadata, never from
    consolidated metadata (stale once rows are appended), and is cut to its last committed step
    (root attribute ``dmi_committed``), so every group holds the same whole steps."""
    import json

    import xarray as xr

    from .. import zdtype
    from .location import Local, open_location
    zdtype.register()        # bfloat16 arrays open (zarr-python 3.1 has no bfloat16 of its own)
    from ..errors import StoreError
    loc = open_location(path, storage_options, write=False)
    if isinstance(loc, Local) and not loc.path.exists():
        raise StoreError(f"store {str(path)!r} does not exist. Fix: check the path (dmi capture --out writes one)")
    try:
        raw = loc.read("zarr.json")
        if raw is None:
            raise FileNotFoundError(f"{loc}/zarr.json")
        meta = json.loads(raw)
    except (OSError, ValueError) as e:
        raise StoreError(f"{str(path)!r} is not a Zarr v3 store ({e}). Fix: pass the directory (or URL) that "
                         f"`dmi capture --out` wrote") from None
    attrs = meta.get("attributes") or {}
    from ..select import cast_floats
    if attrs.get("dmi_status") in ("closed", "failed") and meta.get("consolidated_metadata"):
        tree = xr.open_datatree(loc.zarr(), engine="zarr", consolidated=True, chunks=chunks)
        return tree if dtype is None else cast_floats(tree, dtype)
    rows = (attrs.get("dmi_committed") or {}).get("rows", {})
    source = loc.zarr()
    if attrs.get("dmi_status") == "open":
        source = committed_view(source, rows)
    tree = xr.open_datatree(source, engine="zarr", consolidated=False, chunks=chunks)
    return tree if dtype is None else cast_floats(tree, dtype)


def committed_view(source, rows: dict[str, int]):
    """A read-only zarr store over ``source`` whose arrays end at their group's committed rows.

    A commit grows each array's ``zarr.json`` one at a time, so a writer killed mid-commit leaves
    arrays of one group at different lengths (a value column ahead of its ``request`` coordinate);
    xarray would refuse to align them. Cutting each array's shape in its metadata, before xarray
    reads it, leaves only the whole steps of ``dmi_committed``: rows beyond it are never read."""
    import json

    import zarr
    from zarr.storage import WrapperStore

    class CommittedView(WrapperStore):
        async def get(self, key, prototype, byte_range=None):
            buf = await self._store.get(key, prototype, byte_range)
            parts = key.split("/")
            if buf is None or byte_range is not None or len(parts) < 3 or parts[-1] != "zarr.json":
                return buf
            group = "/".join(parts[:-2])
            n = rows.get(group)
            meta = json.loads(buf.to_bytes())
            dim = "drop" if parts[-3] == "drops" else "token"
            names = meta.get("dimension_names") or []
            if n is None or meta.get("node_type") != "array" or dim not in names:
                return buf
            axis = names.index(dim)
            if meta["shape"][axis] <= n:
                return buf
            meta["shape"][axis] = int(n)
            return prototype.buffer.from_bytes(json.dumps(meta).encode())

    if isinstance(source, str):
        source = zarr.storage.LocalStore(source, read_only=True)
    return CommittedView(source)
