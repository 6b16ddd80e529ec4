"""Rank 0's side of the merged store: the arrays' extents grow over the rows every rank has on disk
(:func:`commit`), and at close, once every rank closed (:func:`wait_closed`), the summary and
status (:func:`finalize`). A store left by a killed run opens with the rows all ranks wrote.
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

from ...errors import StoreError
from ..chunks import ArrayFile
from ..preflight import jsonable


def rank_notes(path) -> list[dict]:
    """Every rank's notes (``tp/rank<r>`` attributes), read from their files."""
    path = Path(path)
    world = json.loads((path / "zarr.json").read_text())["attributes"]["tp"]["world_size"]
    return [json.loads((path / "tp" / f"rank{r}" / "zarr.json").read_text())["attributes"] for r in range(world)]


def commit(path) -> dict[str, int]:
    """Rank 0, at any time (e.g. the exporter's commit clock): each group's arrays get the rows
    every rank writing the group has on disk (the minimum of their notes), so a reader — or a store
    left by a killed run — only ever sees rows all ranks wrote. Only rank 0 writes ``zarr.json``
    of the arrays. Returns rows per group."""
    path = Path(path)
    notes = rank_notes(path)
    rows: dict[str, int] = {}
    for note in notes:
        for g, n in note.get("rows", {}).items():
            rows[g] = min(rows.get(g, n), n)
    for g, n in rows.items():
        for child in sorted((path / g).iterdir()):
            meta = child / "zarr.json"
            if not meta.exists():
                continue
            m = json.loads(meta.read_text())
            if m.get("node_type") == "array" and (m.get("dimension_names") or [None])[0] == "token" \
                    and m["shape"][0] != n:
                ArrayFile(path, f"{g}/{child.name}").set_rows(n)
    return rows


def finalize(path, summary: dict | None = None, clean: bool = True) -> dict[str, int]:
    """Rank 0, after every rank closed its writer: the last :func:`commit`, the run summary and
    ``dmi_status`` in the root, consolidated metadata. The ranks writing a group must agree on its
    rows and every rank must have closed; otherwise the store is marked failed and this raises."""
    import zarr
    notes = rank_notes(path)
    seen: dict[str, int] = {}
    mismatch: dict[str, dict] = {}
    for r, note in enumerate(notes):
        for g, n in note.get("rows", {}).items():
            if seen.setdefault(g, n) != n:
                mismatch.setdefault(g, {})[str(r)] = n
    open_ranks = [r for r, note in enumerate(notes) if note.get("status") != "closed"]
    rows = commit(path)
    ok = clean and not mismatch and not open_ranks
    root = zarr.open_group(str(path), mode="r+")
    extra = {"tp_errors": {"rows": mismatch, "open_ranks": open_ranks}} if mismatch or open_ranks else {}
    root.attrs.update(jsonable(summary or {}) | {"dmi_status": "closed" if ok else "failed"} | extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))
    if mismatch or open_ranks:
        raise StoreError(f"{path}: ranks disagree on the rows of {mismatch} / did not close: {open_ranks}; the store "
                         f"is marked failed")
    return rows


def wait_closed(path, timeout_s: float, poll_s: float = 0.05) -> list[int]:
    """Rank 0 at close: wait until every rank's notes say ``closed`` (or ``failed``); returns the
    ranks still open after ``timeout_s`` (:func:`finalize` then marks the store failed). A file
    poll, not a collective: close runs from ``LLM.collective_rpc``, engine shutdown or process
    exit, and a rank that never closes must not hang the others."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            still = [r for r, n in enumerate(rank_notes(path)) if n.get("status") not in ("closed", "failed")]
        except (OSError, ValueError):      # a note being replaced: read again
            still = [-1]
        if not still or time.monotonic() > deadline:
            return still
        time.sleep(poll_s)
