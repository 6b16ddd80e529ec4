"""One rank's writer into the merged store (:class:`ShardWriter`): chunk files of its own region
only, and its notes in ``tp/rank<r>`` of the rows it has on disk.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import StoreError
from ..chunks import ArrayFile, write_atomic
from ..layout import COORDS
from ..preflight import jsonable
from .merged_store import chunk_key, site_groups
from .sharding import TPLayout, index_runs


@dataclass
class _Group:
    name: str
    files: dict                                   # array name -> dmi.store.chunks.ArrayFile (codecs, fill)
    buf: dict                                     # array name -> the open token chunk, this rank's part
    runs: list[tuple[int, int, int]]              # split axis: (stored start, stored stop, buffer start)
    axis: int | None                              # split axis in the stored array ([token, (layer,) ...])
    coords: bool                                  # this rank writes the token coordinates
    chunk_rows: int
    rows: int = 0                                 # rows written or buffered
    chunk: int = 0                                # index of the open token chunk
    fill: int = 0                                 # rows in the open chunk
    on_disk: int = 0                              # rows whose chunk files are on disk, from row 0


class ShardWriter:
    """One rank's writer into the merged store that :func:`create_store` laid out.

    ``write(group, start, blocks, coords)``: this rank's part of a step's rows of one group —
    ``blocks[output]`` shaped ``[n, (layer,), *dims]`` where the split dim holds only this rank's
    heads/columns in stored order (what its :meth:`TPLayout.local_plan` captures); ``coords`` the
    token coordinates, only on the group's coordinate rank (:meth:`writes_coords`). Rows fill an
    open token chunk; a full chunk is encoded as zarr-python would store it
    (:class:`dmi.store.chunks.ArrayFile`) and written as whole chunk files — temp file + ``os.replace``
    — of this rank's region only. No rank touches an array's ``zarr.json``: :func:`commit` (rank 0)
    grows the extents over rows every writer has on disk (``checkpoint`` records them)."""

    def __init__(self, path, plan, layout: TPLayout, rank: int):
        self.path, self.layout, self.rank = Path(path), layout, rank
        self.groups: dict[str, _Group] = {}
        self.chunks_written: dict[str, set[tuple[int, ...]]] = {}
        for name, sites in site_groups(plan).items():
            first = sites[0]
            if not layout.writes(first, rank):
                continue
            sh = layout.sites[first.canonical]
            lead = 2 if first.layer is not None else 1
            runs, axis, k = [], None, 0
            if sh.kind == "split":
                axis = lead + sh.axis
                for a, b in index_runs([j for j, _ in layout.stored_positions(first, rank)]):
                    runs.append((a, b, k))
                    k += b - a
            coords = layout.coord_rank(first) == rank
            names = [o.name for o in first.outputs] + (list(COORDS) if coords else [])
            files = {n: ArrayFile(self.path, f"{name}/{n}") for n in names}
            rows = files[names[0]].chunks[0]
            buf = {}
            for n, f in files.items():
                shape = list(f.meta["shape"][1:])
                if axis is not None and n not in COORDS:
                    shape[axis - 1] = k                  # this rank's heads/columns only
                buf[n] = np.full((rows, *shape), f.fill, f.dtype)
            self.groups[name] = _Group(name, files, buf, runs, axis, coords, rows)

    def owns(self, group: str) -> bool:
        return group in self.groups

    def writes_coords(self, group: str) -> bool:
        """Whether this rank writes ``group``'s token coordinates (pass ``coords`` to ``write``)."""
        g = self.groups.get(group)
        return g is not None and g.coords

    def write(self, group: str, start: int, blocks: dict[str, np.ndarray], coords: dict | None = None) -> None:
        g = self.groups.get(group)
        if g is None:
            raise StoreError(f"rank {self.rank} writes no part of {group!r} (replicated sites: rank 0; split "
                             f"sites: the ranks holding selected heads). Fix: plan with TPLayout.local_plan")
        if start != g.rows:
            raise StoreError(f"rank {self.rank}, {group}: rows must follow each other (got start {start}, "
                             f"expected {g.rows}): every rank must write every selected row of every step, "
                             f"dropped ones as NaN, or the ranks' rows stop lining up")
        cols = dict(blocks)
        if g.coords:
            if coords is None:
                raise StoreError(f"rank {self.rank} writes the token coordinates of {group!r}: pass coords")
            cols.update({c: coords[c] for c in COORDS})
        n = len(next(iter(blocks.values())))
        done = 0
        while done < n:
            k = min(n - done, g.chunk_rows - g.fill)
            for name, v in cols.items():
                g.buf[name][g.fill:g.fill + k] = v[done:done + k]
            g.fill, g.rows, done = g.fill + k, g.rows + k, done + k
            if g.fill == g.chunk_rows:
                self._write_chunk(g)
                g.chunk, g.fill, g.on_disk = g.chunk + 1, 0, g.rows
                for name, f in g.files.items():
                    g.buf[name][...] = f.fill

    def _write_chunk(self, g: _Group) -> None:
        """Chunk files of the open token chunk (padded with the fill value): this rank's only."""
        for name, f in g.files.items():
            data = g.buf[name]
            seen = self.chunks_written.setdefault(f"{g.name}/{name}", set())
            if g.axis is None or name in COORDS:
                parts = [((g.chunk,) + (0,) * (data.ndim - 1), data)]
            else:
                c = f.chunks[g.axis]
                parts = []
                for a, b, off in g.runs:
                    for j in range(a // c, b // c):
                        lo = off + j * c - a
                        idx = (slice(None),) * g.axis + (slice(lo, lo + c),)
                        key = [0] * data.ndim
                        key[0], key[g.axis] = g.chunk, j
                        parts.append((tuple(key), data[idx]))
            for key, block in parts:
                path = f.dir / chunk_key(f.meta, key)
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, bytes(memoryview(f.encode(np.ascontiguousarray(block)))))
                seen.add(key)

    def checkpoint(self, notes: dict | None = None) -> dict:
        """Write every open chunk as it is, then note the rows on disk per group in ``tp/rank<r>``
        (call between steps: a commit then covers whole steps of every group)."""
        for g in self.groups.values():
            if g.fill:
                self._write_chunk(g)
            g.on_disk = g.rows
        return self.note({"rows": {g.name: g.on_disk for g in self.groups.values()}, **(notes or {})})

    def close(self, notes: dict | None = None) -> dict:
        """The last checkpoint; the note says ``closed`` with ``notes`` (e.g. this rank's drops)."""
        return self.checkpoint({"status": "closed",
                                "chunks_written": {k: len(v) for k, v in self.chunks_written.items()},
                                **(notes or {})})

    def note(self, fields: dict) -> dict:
        """``fields`` into this rank's notes (the attributes of ``tp/rank<r>``, replaced atomically)."""
        meta_path = self.path / "tp" / f"rank{self.rank}" / "zarr.json"
        meta = json.loads(meta_path.read_text())
        meta.setdefault("attributes", {}).update(jsonable(fields))
        write_atomic(meta_path, json.dumps(meta, indent=2).encode())
        return meta["attributes"]
