"""Reading a store: one request's rows (``dmi.request``) and float captures as a computable dtype.

Both stay lazy: a request's rows are picked by integer indices (computed from the small
``request`` and ``position`` coordinates), never by a boolean mask over the data, which dask
refuses (``where(..., drop=True)`` with ``chunks={}``); a cast is applied chunk by chunk as the
values are read.
"""
from __future__ import annotations

import numpy as np

from .errors import StoreError
from .zdtype import BF16


def request(obj, request_id: str):
    """The rows of request ``request_id`` in position order, from a store's ``xarray.DataTree``
    (every group with a ``token`` dim; groups without the request keep none of their rows), a
    group's ``Dataset`` or one of its ``DataArray``s. Lazy: with ``dmi.open(path, chunks={})``
    the result is still dask-backed. Raises ``KeyError`` when no group holds the request."""
    import xarray as xr
    rid = str(request_id)
    if isinstance(obj, xr.DataTree):
        found = []

        def pick(ds):
            if "token" not in ds.dims or "request" not in ds.coords:
                return ds
            idx = _rows_of(ds, rid)
            found.append(len(idx))
            return ds.isel(token=idx)
        out = obj.map_over_datasets(pick)
        if not any(found):
            raise KeyError(_missing(rid, obj))
        return out
    if not isinstance(obj, (xr.Dataset, xr.DataArray)) or "token" not in obj.dims or "request" not in obj.coords:
        raise TypeError(f"dmi.request: expected a store's DataTree, or a Dataset / DataArray with a 'token' dim and "
                        f"a 'request' coordinate, not {type(obj).__name__}. Fix: pass dmi.open(path) or a group of it, "
                        f"e.g. tree['layers/resid_post']")
    idx = _rows_of(obj, rid)
    if not len(idx):
        raise KeyError(_missing(rid, obj))
    return obj.isel(token=idx)


def _rows_of(ds, rid: str) -> np.ndarray:
    """Indices of the request's rows along ``token``, sorted by position (stable)."""
    req = np.asarray(ds.coords["request"].values)       # (object, str or numpy's StringDType)
    idx = np.flatnonzero(req == rid)
    if "position" in ds.coords and len(idx):
        pos = np.asarray(ds.coords["position"].values)[idx]
        idx = idx[np.argsort(pos, kind="stable")]
    return idx


def _missing(rid: str, obj) -> str:
    import xarray as xr
    nodes = obj.subtree if isinstance(obj, xr.DataTree) else [obj]
    ids: set[str] = set()
    for n in nodes:
        coords = n.coords if hasattr(n, "coords") else {}
        if "request" in coords:
            ids.update(map(str, np.asarray(coords["request"].values).tolist()))
    some = ", ".join(repr(i) for i in sorted(ids)[:10]) + (", ..." if len(ids) > 10 else "")
    return (f"request {rid!r} has no rows here; the requests stored are {some or 'none'}. Fix: pass one of those "
            f"ids (the request coordinate)")


class AsDtype:
    """A picklable cast (dask ships it to its workers)."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)

    def __call__(self, a):
        return np.asarray(a).astype(self.dtype)


def is_float(dtype) -> bool:
    return dtype == BF16 or np.issubdtype(dtype, np.floating)


def cast_floats(tree, dtype):
    """Every float data variable of ``tree`` (bfloat16 captures first of all, which numpy, xarray's
    reductions and ``torch.from_numpy`` cannot compute with) as ``dtype``, lazily."""
    import xarray as xr
    want = np.dtype(dtype)
    if not is_float(want):
        raise StoreError(f"dmi.open: dtype={dtype!r} is not a float dtype. Fix: pass dtype='float32' (the default), "
                         f"'float64', or None for the dtype the store holds")
    for node in tree.subtree:
        ds = node.to_dataset(inherit=False)
        names = [k for k, v in ds.data_vars.items() if is_float(v.dtype) and v.dtype != want]
        if not names:
            continue
        for k in names:
            v = ds[k].variable
            ds[k] = xr.Variable(v.dims, _lazy_cast(v, want), v.attrs, v.encoding | {"dtype": v.dtype})
        node.dataset = ds
    return tree


def _lazy_cast(v, want: np.dtype):
    if v.chunks is not None:              # dask: a cast per chunk, when computed
        return v.data.astype(want)
    try:                                  # a lazily loaded array: xarray's own lazy element-wise wrapper
        from xarray.coding.common import lazy_elemwise_func
        from xarray.core.indexing import LazilyIndexedArray
        return LazilyIndexedArray(lazy_elemwise_func(v._data, AsDtype(want), want))
    except (ImportError, AttributeError):  # (xarray moved them): dask keeps it lazy, in the store's chunks
        return v.chunk().data.astype(want)
