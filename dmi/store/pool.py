"""The store's chunks encoded and written by a pool of processes (``store.writer: pool``).

With the thread writer the store's threads hold the model process's GIL for every chunk (opening
files, calling the codec, the bookkeeping around them), and a host-bound model thread waits for
it between its steps. Here the exporter thread still assembles rows into chunks (numpy copies,
which release the GIL), but each chunk is assembled in a slot of a shared arena, and a pool of
worker processes (:mod:`dmi.store.chunkwriter`, ``store.writers`` of them) encodes it and writes
its temp files; the model's process only sends the slot's spans (one small message per chunk) and,
when the answer comes, renames the temp files over the chunk keys, so the commit protocol, the
ordering of a chunk's writes, ``store.max_bytes`` and the files' bytes are the thread writer's.

A full chunk is handed to the pool as soon as its rows are copied, so a large step's chunks are
written while its later rows are still being copied. The arena has a slot for each open chunk and
``2 * store.writers`` more: when none is free the exporter thread waits for a worker to finish
one (backpressure into host staging and the ring, as the thread writer's bounded queue does).

A worker that dies (killed, out of memory) fails the store at once, as a failed chunk write does:
the error names the process and how it ended, and ``policy.on_store_error`` applies (``raise``:
the caller gets it within a second; ``drop``: later steps are counted as dropped, reason ``sink``).
Steps committed before stay in the store. The drops table, small, is written by a thread as before.
"""
from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection, wait
from pathlib import Path

import numpy as np

from ..errors import SpecError, StoreError
from ..shared_memory import shared_file
from .chunks import STORE_NICE, VLEN, default_threads, unlink_all
from .exporter import ZarrExporter
from .layout import GroupBuffer
from .location import TMP_SUFFIX, is_remote
from .preflight import POOL_FIX, POOL_ON_OBJECT_STORE
from .writer import STORE_MALLOC


START_TIMEOUT_S = 60       # a worker imports numpy and numcodecs before it answers
POLL_S = 0.05              # waits look at failures this often
ALIGN = 4096


class SlotBuffers(dict):
    """A chunk's buffers, per array: views of an arena slot (variable-length strings: private)."""
    slot: int


def default_writers() -> int:
    """``store.writers`` unset: half the cores, at least 2 and at most 8 (as ``store.threads``)."""
    return default_threads()


class PoolExporter(ZarrExporter):
    """:class:`~dmi.store.exporter.ZarrExporter` whose site groups' chunks are encoded and written
    by worker processes (see the module doc)."""

    def __init__(self, path, plan, capture_dtype: str, attrs: dict, overwrite: bool = False, resume: bool = False):
        self._arena = None                 # set once the pool runs: until then chunks are private buffers
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._pool_cond = threading.Condition()
        self._free_slots: list[int] = []
        self._outstanding: dict[int, tuple] = {}     # job -> (group, chunk, gen, rows end, buffers, worker)
        self._load: list[int] = []                   # jobs outstanding per worker
        self._dead: set[int] = set()                 # workers that ended
        self._job_ids = itertools.count(1)
        self._stopping = False
        self._collector: threading.Thread | None = None
        if is_remote(path):      # (dmi.load refuses it first, naming the hook spec's line)
            raise SpecError(POOL_ON_OBJECT_STORE.format(store=str(path)), file=plan.hook_file or None,
                            key="store.writer", fix=POOL_FIX)
        super().__init__(path, plan, capture_dtype, attrs, overwrite=overwrite, resume=resume)
        try:
            self._start_pool(plan.writers or default_writers())
        except BaseException:
            self._shutdown(wait=False)
            raise

    # --- the pool -------------------------------------------------------------------------------------
    def _start_pool(self, n: int) -> None:
        self._spans: dict[str, dict[str, tuple[int, int]]] = {}
        slot_bytes = ALIGN
        for g in self.groups.values():
            spans, off = {}, 0
            for k, b in g.buf.items():
                if b.dtype != object:
                    spans[k] = (off, b.nbytes)
                    off += -(-b.nbytes // 64) * 64
            self._spans[g.name] = spans
            slot_bytes = max(slot_bytes, -(-off // ALIGN) * ALIGN)
        n_slots = 2 * n + len(self.groups) + 1
        try:
            arena_path, self._map = shared_file(slot_bytes * n_slots, "dmi-chunks-")
        except OSError as e:
            raise StoreError(f"store.writer: pool: no room for the {slot_bytes * n_slots:,}-byte chunk arena "
                             f"({n_slots} chunks) ({e}). Fix: lower store.writers or store.chunk_bytes, free space "
                             f"in /dev/shm, or use store.writer: thread") from e
        self._slot_bytes = slot_bytes
        self._arena = np.frombuffer(self._map, np.uint8)
        arrays = {f"{g.name}/{k}": (str(f.dir), f.meta["codecs"][1:]) for g in self.groups.values()
                  for k, f in g.files.items()}
        here = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p),
                   **STORE_MALLOC, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")   # (no BLAS work there)
        try:
            for _ in range(n):
                ours, theirs = socket.socketpair()
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "dmi.store.chunkwriter", str(theirs.fileno()), arena_path],
                    pass_fds=(theirs.fileno(),), close_fds=True, start_new_session=True, env=env))
                theirs.close()
                conn = Connection(ours.detach())
                conn.send(("init", arrays, TMP_SUFFIX, STORE_NICE))
                self._conns.append(conn)
            for proc, conn in zip(self._procs, self._conns):
                if not conn.poll(START_TIMEOUT_S):
                    raise StoreError(f"store.writer: pool: chunk writer process {proc.pid} did not start within "
                                     f"{START_TIMEOUT_S} s. Fix: use store.writer: thread")
                conn.recv()
        except (EOFError, OSError) as e:
            raise StoreError(f"store.writer: pool: a chunk writer process exited at start ({e}). "
                             f"Fix: see its message above, or use store.writer: thread") from e
        finally:
            os.unlink(arena_path)         # the mappings stay; nothing is left behind if a process dies
        self._load = [0] * n
        self._free_slots = list(range(n_slots))[::-1]
        for g in self.groups.values():    # the open chunks (a resumed store's rows in them) move into slots
            bufs = self._take_slot(g)
            for k in g.buf:
                bufs[k][...] = g.buf[k]
            g.buf = bufs
        self._collector = threading.Thread(target=self._collect, name="dmi-pool-collector", daemon=True)
        self._collector.start()

    def _take_slot(self, g: GroupBuffer) -> SlotBuffers | None:
        """A free slot's buffers for a chunk of ``g``; waits for one. None: the store failed meanwhile."""
        with self._pool_cond:
            while not self._free_slots:
                if self.error is not None:
                    return None
                self._pool_cond.wait(POLL_S)
            slot = self._free_slots.pop()
        bufs, base = SlotBuffers(), slot * self._slot_bytes
        spans = self._spans[g.name]
        for k, f in g.files.items():
            shape = (g.chunk_rows, *f.chunks[1:])
            if k in spans:
                off, nb = spans[k]
                bufs[k] = self._arena[base + off:base + off + nb].view(f.dtype).reshape(shape)
            else:
                bufs[k] = np.empty(shape, f.dtype)
        bufs.slot = slot
        return bufs

    def _release(self, bufs: SlotBuffers) -> None:
        with self._pool_cond:
            self._free_slots.append(bufs.slot)
            self._pool_cond.notify_all()

    def _pooled(self, g: GroupBuffer) -> bool:
        return self._arena is not None and g.capped

    # --- the exporter's chunk hooks -------------------------------------------------------------------
    def _fresh(self, g: GroupBuffer) -> dict[str, np.ndarray]:
        if not self._pooled(g):
            return super()._fresh(g)
        if self._sealed:          # a chunk just filled: copy its rows and hand it over now, mid-step
            self._flush_jobs()
        bufs = self._take_slot(g)
        return super()._fresh(g) if bufs is None else bufs

    def _write_open(self, g: GroupBuffer) -> None:
        if not self._pooled(g):
            return super()._write_open(g)
        if not g.fill or g.snap == g.rows:
            return
        bufs = self._take_slot(g)
        if bufs is None:
            return
        for k, f in g.files.items():
            bufs[k][:g.fill] = g.buf[k][:g.fill]
            bufs[k][g.fill:] = f.fill
        g.snap = g.rows
        self._submit(g, g.chunk, bufs, g.rows, recycle=True)

    def _submit(self, g: GroupBuffer, i: int, bufs: dict, end: int, recycle: bool) -> None:
        if not isinstance(bufs, SlotBuffers):
            return super()._submit(g, i, bufs, end, recycle)
        g.gen += 1
        if self.error is not None:       # the site groups take no more writes
            self._release(bufs)
            return
        spans, base = self._spans[g.name], bufs.slot * self._slot_bytes
        items = []
        for k, f in g.files.items():
            key = f.key(i)
            if k in spans:
                src = (base + spans[k][0], spans[k][1])
            else:                        # vlen-utf8 strings: their bytes go in the message
                src = bytes(VLEN.encode(bufs[k].reshape(-1)))
            items.append((f"{g.name}/{k}", key, src))
        with self._pool_cond:
            live = [w for w in range(len(self._load)) if w not in self._dead]
            if not live:
                self._free_slots.append(bufs.slot)
                return
            w = min(live, key=self._load.__getitem__)
            job = next(self._job_ids)
            self._outstanding[job] = (g, i, g.gen, end, bufs, w)
            self._load[w] += 1
        try:
            self._conns[w].send(("job", job, items))
        except OSError:       # the worker is gone (the collector reports how): its job never lands
            with self._pool_cond:
                if self._outstanding.pop(job, None) is not None:
                    self._load[w] -= 1
                    self._free_slots.append(bufs.slot)
                    self._pool_cond.notify_all()

    def _wait_all(self) -> None:
        super()._wait_all()
        with self._pool_cond:
            while self._outstanding:
                if self._collector is None or not self._collector.is_alive():
                    break
                self._pool_cond.wait(POLL_S)

    # --- answers --------------------------------------------------------------------------------------
    def _collect(self) -> None:
        """The collector thread: each worker's answers (the chunk's files renamed into place), and a
        worker's end (the store fails naming it, unless the pool is being closed)."""
        live = {conn: w for w, conn in enumerate(self._conns)}
        while live:
            for conn in wait(list(live), timeout=0.25):
                w = live[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    del live[conn]
                    self._worker_ended(w)
                    continue
                self._answered(msg)

    def _answered(self, msg) -> None:
        kind, job = msg[0], msg[1]
        with self._pool_cond:
            g, i, gen, end, bufs, w = self._outstanding.pop(job)
        try:
            if kind == "failed":
                _, _, why, io = msg
                self._fail(self._write_error(g, i, why) if io else
                           StoreError(f"{self.path}: {g.name}: writing chunk {i} failed: {why}"))
                return
            written = msg[2]
            files = [(tmp, path) for tmp, path, _ in written]
            if self.error is not None:
                unlink_all(tmp for tmp, _ in files)
                return
            size = sum(n for _, _, n in written)
            self._throttle(size)
            self._land(g, i, gen, end, size, files)
        except StoreError as e:
            self._fail(e)
        except OSError as e:
            self._fail(self._write_error(g, i, e))
        finally:
            with self._pool_cond:
                self._load[w] -= 1
                self._free_slots.append(bufs.slot)
                self._pool_cond.notify_all()

    def _worker_ended(self, w: int) -> None:
        proc = self._procs[w]
        try:
            code = proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        if not self._stopping:
            self._fail(StoreError(
                f"{self.path}: store.writer: pool: chunk writer process {proc.pid} {_ended(code)} while writing "
                f"the store; the store keeps its last committed step. Fix: see its message above (out of memory?), "
                f"resume the store (dmi.load(..., resume=True)), or use store.writer: thread"))
        with self._pool_cond:               # its chunks will never land
            for job, (g, i, gen, end, bufs, ww) in list(self._outstanding.items()):
                if ww == w:
                    del self._outstanding[job]
                    self._free_slots.append(bufs.slot)
            self._dead.add(w)
            self._pool_cond.notify_all()

    def _fail(self, e: StoreError) -> None:
        with self._lock:
            if self.error is None:
                self.error = e
        with self._pool_cond:
            self._pool_cond.notify_all()

    # --- end ------------------------------------------------------------------------------------------
    def _shutdown(self, wait: bool) -> None:
        super()._shutdown(wait)
        if wait:
            self._wait_all()
        self._stopping = True
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=5 if wait else 1)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._collector is not None:
            self._collector.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns = []


def _ended(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
