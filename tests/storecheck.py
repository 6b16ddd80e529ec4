"""Helpers shared by test files (and the TRITON_INTERPRET subprocess): reference rows of a
generate() call in capture order, bit-for-bit store comparison, and whole chunk files."""
from __future__ import annotations

import json

import numpy as np


def generate_rows(mask, step: int):
    """(batch row, step-local position) of the real rows of generate step ``step``, in capture order."""
    if step == 0:
        return [(b, s) for b in range(mask.shape[0]) for s in range(mask.shape[1]) if mask[b, s]]
    return [(b, 0) for b in range(mask.shape[0])]


def expected_rows(per_step, mask, pick):
    """Stack reference rows in capture order; ``pick(step_tensors, b, s)`` reads one row."""
    return np.stack([pick(per_step[t], b, s) for t in range(len(per_step)) for b, s in generate_rows(mask, t)])


def _bits(a: np.ndarray) -> np.ndarray:
    from dmi.zdtype import BF16        # bfloat16 (ml_dtypes) is not of kind "f"
    return a.view(f"u{a.itemsize}") if a.dtype.kind == "f" or a.dtype == BF16 else a


def assert_stores_equal(a_path, b_path) -> int:
    """Every array and coordinate of two stores equal bit for bit (NaN too); returns how many. A
    difference names every array that differs and where, so a rare one says what it was."""
    import dmi
    a, b = dmi.open(a_path, dtype=None), dmi.open(b_path, dtype=None)    # as stored
    n, diffs = 0, []
    for node in a.subtree:
        for v in list(node.dataset.data_vars) + list(node.dataset.coords):
            x, y = node.dataset[v].values, b[node.path].dataset[v].values
            assert x.shape == y.shape and x.dtype == y.dtype, (node.path, v, x.shape, y.shape)
            if not np.array_equal(_bits(x), _bits(y)):
                diffs.append(_where(node.path, v, x, y))
            n += 1
    assert not diffs, f"{a_path} vs {b_path}:\n" + "\n".join(diffs)
    return n


def _where(path: str, name: str, x: np.ndarray, y: np.ndarray) -> str:
    """Which rows (first dim) of two equal-shape arrays differ, and by how much."""
    bx, by = _bits(x), _bits(y)
    rows = np.flatnonzero((bx != by).reshape(len(bx), -1).any(axis=1)) if bx.ndim else np.array([0])
    text = f"{path}/{name}: {len(rows)} of {len(bx) if bx.ndim else 1} rows differ, first {rows[:8].tolist()}"
    if x.dtype.kind == "f" and len(rows):
        d = np.abs(x[rows].astype(np.float64) - y[rows].astype(np.float64))
        text += f", max |diff| {np.nanmax(d) if np.isfinite(d).any() else 'nan'}"
    return text


def store_keys(loc) -> set[str]:
    """Every key of a store (a :mod:`dmi.store.location`): its objects, or its directory's files."""
    if loc.remote:
        return set(loc.keys())
    return {str(p.relative_to(loc.path)) for p in loc.path.rglob("*") if p.is_file()}


def assert_no_torn_chunk(store) -> int:
    """Every chunk file or object of a store (committed or not; a killed writer's temp files aside)
    decodes to a whole chunk; returns how many. ``store``: a local path or a location."""
    import numcodecs

    from dmi.store.chunks import ArrayFile
    from dmi.store.location import TMP_SUFFIX, open_location
    loc = open_location(store)
    keys, n = store_keys(loc), 0
    for meta in sorted(k for k in keys if k == "zarr.json" or k.endswith("/zarr.json")):
        name = meta.rsplit("/", 1)[0] if "/" in meta else ""
        if json.loads(loc.read(meta)).get("node_type") != "array":
            continue
        f = ArrayFile(loc, name)
        for key in sorted(k for k in keys if k.startswith(f"{name}/c/") and not k.endswith(TMP_SUFFIX)):
            raw = loc.read(key)
            for codec in reversed(f.codecs):
                raw = codec.decode(raw)
            if f.vlen:
                assert len(numcodecs.VLenUTF8().decode(raw)) == f.chunks[0], key
            else:
                assert len(raw) == np.prod(f.chunks) * f.dtype.itemsize, key
            n += 1
    return n
