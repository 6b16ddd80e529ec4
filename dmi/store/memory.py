"""An in-memory result: ``dmi.load(..., store=None)`` with no ``store.path`` in the hook spec.

The rows take the store's own path (the same exporter, groups, coordinates and commit protocol)
into a Zarr store in a temporary directory; at ``run.close()`` that store is opened as a DataTree
exactly as ``dmi.open`` opens a store, read into memory, and the directory is removed. So a
notebook's result has the groups, variables, coordinates and attributes a store of the same run
would have. Writing the chunk files through zarr's ``MemoryStore`` would need a second write
path (the exporter writes chunk files itself, in parallel, with atomic renames).

``store.memory_bytes`` bounds the result: the bytes of its arrays as they will sit in memory
(rows x each array's row bytes; string coordinates count one reference a row). A step that would
take it past the budget fails like a full store (``policy.on_store_error``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..errors import StoreError
from .exporter import ZarrExporter
from .layout import GroupBuffer


DEFAULT_MEMORY_BYTES = 2 << 30
KEY = "store.memory_bytes"


def host_memory_bytes() -> int | None:
    """The host's physical memory, where the platform says (None elsewhere)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


class MemoryExporter(ZarrExporter):
    """The store exporter, writing into a temporary directory and counting the result's bytes."""

    def __init__(self, path, plan, capture_dtype: str, attrs: dict, overwrite: bool = False,
                 resume: bool = False, *, memory_bytes: int):
        self.memory_bytes = memory_bytes
        self.result_bytes = 0
        self.tmp = Path(tempfile.mkdtemp(prefix="dmi-result-"))
        try:
            super().__init__(self.tmp / "result.zarr", plan, capture_dtype, attrs)
        except BaseException:
            self.discard()
            raise

    def _label(self) -> str:
        return "the in-memory result"

    def _ingest(self, g: GroupBuffer, ctrl, sel, n: int, got, request_ids, entry) -> None:
        need = self.result_bytes + n * (g.chunk_nbytes // g.chunk_rows)
        if need > self.memory_bytes:
            raise StoreError(f"the in-memory result: {KEY}: step {ctrl.step} would take it to {need:,} bytes, over "
                             f"its budget of {self.memory_bytes:,} bytes. Fix: raise {KEY} in the hook spec "
                             f"(store: {{memory_bytes: 8GiB}}), capture fewer sites or tokens, or pass a store "
                             f"path to dmi.load to write a store on disk")
        super()._ingest(g, ctrl, sel, n, got, request_ids, entry)
        self.result_bytes = need

    def take_result(self):
        """The closed store as an in-memory ``xarray.DataTree`` (as ``dmi.open`` opens it); the
        temporary directory is removed whatever happens."""
        try:
            from .read import open_store
            import xarray as xr
            tree = open_store(self.path)
            # each node read by itself (DataTree.load() left a node's variable of the node's own
            # name, e.g. /logits/logits, lazy: it would read the removed directory)
            loaded = xr.DataTree.from_dict({node.path: node.to_dataset(inherit=False).compute()
                                            for node in tree.subtree})
            tree.close()
            return loaded
        finally:
            self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
