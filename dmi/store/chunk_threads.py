"""The store's chunk writers (:class:`dmi.store.exporter.ZarrExporter`): full and open chunks
encoded and written by a thread pool, a temp file + ``os.replace`` each (one PUT on an object
store), landing in order per chunk; the store's bytes (``store.max_bytes``) and write rate
(``store.bytes_per_s``); chunk buffers recycled.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import wait
from pathlib import Path

import numpy as np

from ..errors import StoreError
from .chunks import unlink_all
from .layout import GroupBuffer
from .preflight import store_gone


FREE_BYTES = 512 << 20          # chunk buffers kept for reuse: fresh ones cost a page fault per 4 KiB


FIX_IO = ("Fix: free space or restore write permission there (policy.on_store_error: drop keeps the model "
          "running without the store)")


class ChunkThreads:
    """Chunks out (a mixin of :class:`dmi.store.exporter.ZarrExporter`, whose pool, lock and error
    it uses)."""

    def _fresh(self, g: GroupBuffer) -> dict[str, np.ndarray]:
        with self._lock:
            if g.free:
                self._free_bytes -= g.chunk_nbytes
                return g.free.pop()
        return {k: np.empty((g.chunk_rows, *f.chunks[1:]), f.dtype) for k, f in g.files.items()}

    def _write_open(self, g: GroupBuffer) -> None:
        """Write the open chunk as it is (padded with the fill value), if it holds unwritten rows."""
        if not g.fill or g.snap == g.rows:
            return
        bufs = {}
        for k, f in g.files.items():
            b = np.empty_like(g.buf[k])
            b[:g.fill] = g.buf[k][:g.fill]
            b[g.fill:] = f.fill
            bufs[k] = b
        g.snap = g.rows
        self._submit(g, g.chunk, bufs, g.rows, recycle=False)

    def _submit(self, g: GroupBuffer, i: int, bufs: dict, end: int, recycle: bool) -> None:
        g.gen += 1
        fut = self._pool.submit(self._write_chunk, g, i, g.gen, bufs, end, recycle)
        fut.add_done_callback(self._written)
        self._inflight.append(fut)
        while self._inflight and (self._inflight[0].done() or len(self._inflight) > self._max_inflight):
            wait([self._inflight.popleft()])

    def _write_chunk(self, g: GroupBuffer, i: int, gen: int, bufs: dict, end: int, recycle: bool) -> None:
        """Pool thread: encode and write every array's chunk ``i`` of a group; the files replace the
        old ones together, and only if no newer write of this chunk landed first."""
        if self.error is not None and g.capped:
            return
        tmps: list[Path] = []
        try:
            encoded = [(f, f.encode(bufs[k])) for k, f in g.files.items()]
            size = sum(memoryview(d).nbytes for _, d in encoded)
            self._throttle(size)
            if self.loc.remote:
                self._put(g, i, gen, end, size, encoded)
            else:
                files = []
                for f, data in encoded:
                    tmp, path = f.write(i, data)
                    tmps.append(tmp)
                    files.append((tmp, path))
                tmps = []
                self._land(g, i, gen, end, size, files)
        except StoreError:
            raise
        except OSError as e:
            raise self._write_error(g, i, e) from e
        finally:
            unlink_all(tmps)
            if recycle:
                with self._lock:
                    if self._free_bytes + g.chunk_nbytes <= FREE_BYTES:
                        g.free.append(bufs)
                        self._free_bytes += g.chunk_nbytes

    def _land(self, g: GroupBuffer, i: int, gen: int, end: int, size: int, files: list) -> None:
        """Chunk ``i``'s temp files (``files``: (temp, final)) replace its files, unless a newer write
        of the chunk landed first; the group's rows on disk move on. The temp files are gone after."""
        left = files
        try:
            with self._lock:
                if i < g.whole or g.landed.get(i, (0, 0))[0] > gen:
                    return       # stale: a newer write of this chunk is on disk
                self._charge(g, i, size)
                for k, (tmp, path) in enumerate(files):
                    left = files[k:]
                    os.replace(tmp, path)
                left = []
                self._landed(g, i, gen, end)
        finally:
            unlink_all(tmp for tmp, _ in left)

    def _put(self, g: GroupBuffer, i: int, gen: int, end: int, size: int, encoded: list) -> None:
        """Chunk ``i``'s objects PUT over its old ones on an object store (each PUT lands whole; there
        is no rename to do under the lock), unless a newer write of the chunk landed first."""
        with self._lock:
            writing = g.writing.setdefault(i, threading.Lock())
        with writing:            # one write of a chunk at a time: an older write never lands over a newer one
            with self._lock:
                if i < g.whole or g.landed.get(i, (0, 0))[0] > gen:
                    return       # stale: a newer write of this chunk is stored
                self._charge(g, i, size)
            for f, data in encoded:
                f.put(i, data)
            with self._lock:
                self._landed(g, i, gen, end)

    def _landed(self, g: GroupBuffer, i: int, gen: int, end: int) -> None:
        """Chunk ``i`` (rows up to ``end``) is stored: the group's whole chunks and rows stored move on
        (under the lock)."""
        g.landed[i] = (gen, end)
        c = g.chunk_rows
        while g.landed.get(g.whole, (0, 0))[1] == (g.whole + 1) * c:
            del g.landed[g.whole]
            g.sizes.pop(g.whole, None)
            g.writing.pop(g.whole, None)
            g.whole += 1
        g.durable = g.landed.get(g.whole, (0, g.whole * c))[1]

    def _write_error(self, g: GroupBuffer, i: int, e) -> StoreError:
        """A failed chunk write as the store's error (the store's directory removed, or an I/O error)."""
        return store_gone(self.loc) or StoreError(f"{self.path}: {g.name}: writing chunk {i} failed: {e}. {FIX_IO}")

    def _charge(self, g: GroupBuffer, i: int, size: int) -> None:
        """Bytes on disk after replacing chunk i's files (under the lock); refuses past store.max_bytes."""
        delta = size - g.sizes.get(i, 0)
        cap = self.plan.max_bytes
        if cap is not None and g.capped and self.store_bytes + delta > cap:
            raise StoreError(f"{self.path}: store.max_bytes: store full: chunk {i} of {g.name} ({size:,} bytes) "
                             f"would take the store to {self.store_bytes + delta:,} bytes, over the cap of {cap:,}. "
                             f"Fix: raise store.max_bytes, capture fewer sites or tokens, or use store.compression")
        self.store_bytes += delta
        g.sizes[i] = size

    def _throttle(self, size: int) -> None:
        """store.bytes_per_s: each write starts when the ones before it have used their share of time."""
        rate = self.plan.bytes_per_s
        if not rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(self._rate_t, now)
            self._rate_t = start + size / rate
        if start > now:
            time.sleep(start - now)

    def _written(self, fut) -> None:
        e = fut.exception()
        if e is None:
            return
        if not isinstance(e, StoreError):
            e = StoreError(f"{self.path}: writing a chunk failed: {type(e).__name__}: {e}")
        with self._lock:
            if self.error is None:
                self.error = e

    def _wait_all(self) -> None:
        while self._inflight:
            wait([self._inflight.popleft()])

    def _shutdown(self, wait: bool) -> None:
        self._pool.shutdown(wait=wait)
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=wait)
