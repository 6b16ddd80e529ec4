"""Activation patching: a replacement table read from a closed store."""
from __future__ import annotations

import numpy as np

from .plan import InterventionError


def values_from_store(tree, request_id: str, site: str, *, layer: int | None = None,
                      positions: tuple[int, int] | None = None) -> np.ndarray:
    """A replacement table from a closed store (``dmi.open``): request ``request_id``'s rows of
    ``site`` (of ``layer``) at ``positions`` ``[start, stop)`` (default: all its rows), as
    ``[positions, *trailing dims]`` for ``run.set_intervention(name, vector=...)`` of a
    ``replace`` intervention whose ``tokens.positions`` starts at ``start`` (activation patching).
    Raises :class:`InterventionError` naming what is missing when the store has not captured it."""
    group = ("layers/" if layer is not None else "") + site.replace(".", "/")
    try:
        node = tree[group]
    except KeyError:
        raise InterventionError(f"values_from_store: the store holds no site {site!r} (group {group!r}). Fix: "
                                f"capture it in the source run (capture: [{{sites: [{site}]}}]) and read that "
                                f"run's store once it is closed") from None
    ds = node.to_dataset(inherit=False) if hasattr(node, "to_dataset") else node.dataset
    name = site.rsplit(".", 1)[-1]
    if name not in ds.data_vars:
        name = next(iter(ds.data_vars))
    arr = ds[name]
    if layer is not None:
        if "layer" not in arr.dims or layer not in arr.coords["layer"].values.tolist():
            raise InterventionError(f"values_from_store: {site!r} was not captured at layer {layer}. Fix: capture "
                                    f"that layer in the source run")
        arr = arr.sel(layer=layer)
    req = np.asarray(arr.coords["request"].values)       # (object, str or numpy's StringDType)
    idx = np.flatnonzero(req == str(request_id))
    if not len(idx):
        some = sorted(set(map(str, req.tolist())))[:10]
        raise InterventionError(f"values_from_store: request {request_id!r} has no rows of {site!r} in this store "
                                f"(it holds {some}). Fix: run the source request first, with a capture of "
                                f"{site!r}, and read its store once that run is closed")
    pos = np.asarray(arr.coords["position"].values)[idx]
    idx = idx[np.argsort(pos, kind="stable")]
    pos = np.sort(pos)
    if positions is not None:
        want = np.arange(*positions)
        missing = sorted(set(want.tolist()) - set(pos.tolist()))
        if missing:
            raise InterventionError(f"values_from_store: request {request_id!r} has no rows of {site!r} at "
                                    f"positions {missing[:10]} (stored: {pos.min()}..{pos.max()}). Fix: patch "
                                    f"positions the source captured (its capture's tokens filter keeps them)")
        idx = idx[np.searchsorted(pos, want)]
    return np.asarray(arr.isel(token=idx).values)
