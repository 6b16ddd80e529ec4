"""The store writer in its own process (``store.writer: process``).

The exporter's Python work (row bookkeeping, chunk assembly, commits) holds the GIL for about as
long as it runs, and on a GPU host the model's thread wants the GIL back every few microseconds
(every torch call hands it over): measured on an H200, the in-process exporter took 1.8 ms of
CPU per Qwen3-8B decode step and the step grew from 15 to 25 ms (perf/RESULTS.md). Here the
:class:`~dmi.store.exporter.ZarrExporter` runs unchanged in a child process with its own interpreter;
the model's process keeps one copy per record into a shared-memory handoff buffer and one small
message per step.

Parent (:class:`ProcessExporter`, the same interface as the exporter for :class:`dmi.run.Run`):
each drained step's bytes go into the handoff buffer (a file in ``/dev/shm``, reserved in step
order as a :class:`~dmi.ring.bytering.ByteRing`), then ``("step", ...)`` on a socket; the child answers each
step with ``done`` once the exporter copied its rows, which frees the buffer. A reader thread
takes the answers. Failures keep the exporter's semantics: the child's first ``StoreError`` comes
back and is raised once by the next call of the exporter thread (``policy.on_store_error: raise``),
within ``TICK_S``.

The child is ``python -m dmi.store.writer_child FD PATH`` (:mod:`dmi.store.writer_child`; a plain
subprocess: no ``multiprocessing`` spawn, which would re-run the user's main module). If the model's process dies (``kill -9``) the child
reads end-of-file, commits what it holds and exits, leaving the store ``open`` as a crashed
in-process writer would (resume works the same).

If the child dies (say OOM-killed): under ``policy.on_store_error: raise`` capture stops with a
``StoreError`` naming it. Under ``drop`` (best_effort's default) the model keeps serving: a
:class:`~dmi.store.exporter.ZarrExporter` in this process resumes the store from its last commit and
takes over (:meth:`ProcessExporter._failover`). The steps the child had been sent but had not
committed are lost; each of their captures is recorded in the drops table with reason
``writer``, so rows stored + dropped still equal rows selected.
"""
from __future__ import annotations

import collections
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from ..errors import CaptureError, StoreError
from ..ring.bytering import ByteRing
from ..ring.layout import slot_views
from ..ring.records import META_DTYPE
from ..shared_memory import shared_file
from .drops import sink_policy
from .location import is_remote, scheme_of


log = logging.getLogger("dmi")
START_TIMEOUT_S = 120      # the child imports numpy, zarr and dmi before it answers
# glibc malloc in the child: chunk-sized blocks (the codec's output, chunk buffers) stay in the
# heap instead of a fresh mmap each, and freed memory is kept, not handed back and faulted in again.
# By default each of those blocks is a fresh mmap, faulted in and zeroed, and about half the store's
# CPU time is the kernel's (perf/exporter_bench.py --writers process times the writer). Other C
# libraries ignore these variables.
STORE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


class ProcessExporter:
    """:class:`~dmi.store.exporter.ZarrExporter` in a child process (see the module doc)."""

    def __init__(self, path, plan, capture_dtype: str, attrs: dict, overwrite: bool = False, resume: bool = False,
                 handoff_bytes: int | None = None):
        if scheme_of(str(path)) == "memory":
            raise StoreError(f"store {str(path)!r}: store.writer: process writes from a child process, which does not "
                             f"see this process's memory:// file system. Fix: remove store.writer and policy.drain "
                             f"(or set them to thread), or write to a local directory or an object store")
        self.plan = plan
        self._capture_dtype, self._attrs = capture_dtype, attrs
        self.error: StoreError | None = None
        self.drain_error: str | None = None    # policy.drain: process: why the child stopped draining
        self.drops: list = []             # sink drops (the store failed), as the child reports them
        self.committed_step, self.store_bytes = -1, 0
        self._raised = False
        self.inline_steps = 0             # steps larger than the handoff buffer, sent in their message
        self._ids_sent = self._drops_sent = self._seq = 0
        self._ends: dict[int, int] = {}   # step message -> end of its handoff span
        self._cond = threading.Condition()
        self._replies: dict[str, tuple] = {}
        # failover (module doc): what was sent and not yet committed, and the run's live lists
        self._failover_ok = False         # (set once the store's accounting at open is known)
        self._inproc = None               # the in-process exporter that took over, once the child died
        self.failover: dict | None = None
        self._unsettled: collections.deque = collections.deque()   # (step, ctrl, records without bytes)
        self._ids_ref: list[str] = []
        self._ring_drops_ref = ()
        self._child_drops: list = []
        size = int(handoff_bytes or plan.policy.host_bytes)
        self._space = ByteRing(size)
        self._buf_path, self._map = _handoff_buffer(size)
        self._buf = np.frombuffer(self._map, np.uint8)
        ours, theirs = socket.socketpair()
        # the child imports this same dmi (a checkout put on sys.path by a script is not on the child's)
        here = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p),
                   **STORE_MALLOC)
        self._proc = subprocess.Popen([sys.executable, "-m", "dmi.store.writer_child", str(theirs.fileno()),
                                       self._buf_path],
                                      pass_fds=(theirs.fileno(),), close_fds=True, start_new_session=True, env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._reader = threading.Thread(target=self._read_loop, name="dmi-writer-reader", daemon=True)
        try:
            self._conn.send(("open", str(path), plan, capture_dtype, attrs, overwrite, resume))
            opened = self._conn.recv() if self._conn.poll(START_TIMEOUT_S) else ("error", "no answer from the child")
        except (EOFError, OSError) as e:
            opened = ("error", f"the writer process exited at start ({e})")
        finally:
            os.unlink(self._buf_path)     # the mapping stays; nothing is left behind if either side dies
        if opened[0] != "opened":
            self._stop()
            raise StoreError(opened[1])
        _, path, self.next_step, self.stored_request_ids, self.store_bytes, self.committed_step = opened
        self.path = path if is_remote(path) else Path(path)
        self._reader.start()
        # the store's accounting before this run: a failover hands the rest to the new exporter as this run's
        self._open_prior = self._call("accounting")[0] if sink_policy(plan) == "drop" else None
        self._failover_ok = self._open_prior is not None

    # --- the exporter's interface (called by the run's exporter thread) ------------------------------
    def write_step(self, ctrl, records, request_ids: list[str], ring_drops=()) -> None:
        if self._inproc is not None:
            return self._delegate("write_step", ctrl, records, request_ids, ring_drops)
        self._raise_once()
        self._ids_ref, self._ring_drops_ref = request_ids, ring_drops
        sizes = [len(data) for _, _, data in records]
        span = sum(sizes)
        inline = None
        if span > self._space.capacity:   # a step larger than the buffer travels in the message itself
            inline, start, end = np.concatenate([_bytes(d) for _, _, d in records]), 0, None
            self.inline_steps += 1
        else:
            with self._cond:              # room in the handoff buffer: the child frees it step by step
                while (got := self._space.try_reserve(span)) is None and not self._check_alive():
                    self._cond.wait(0.05)
            if got is None:               # the child died and an in-process exporter took over
                return self._delegate("write_step", ctrl, records, request_ids, ring_drops)
            start, end = got
            at = start
            for (_, _, data), n in zip(records, sizes):
                np.copyto(self._buf[at:at + n], _bytes(data))
                at += n
        slots = {v.site: v.sel for v in slot_views(ctrl.slots)}
        recs = np.array([rec for _, rec, _ in records], META_DTYPE) if records else np.zeros(0, META_DTYPE)
        sites = [slot.site for slot, _, _ in records]
        self._seq += 1
        with self._cond:
            self._ends[self._seq] = end
        if not self._send(("step", self._seq, ctrl.step, ctrl.tokens, slots, sites, recs, start, sizes, inline,
                           self._new_ids(request_ids), self._new_drops(ring_drops))):
            return self._delegate("write_step", ctrl, records, request_ids, ring_drops)
        if self._failover_ok:             # kept (without their bytes) until the child commits the step
            while self._unsettled and self._unsettled[0][0] <= self.committed_step:
                self._unsettled.popleft()
            # (the records' bytes stand in as a range of their length: only their number is read then)
            self._unsettled.append((ctrl.step, ctrl, [(slot, rec, range(len(data))) for slot, rec, data in records]))
        self._forget_drops(ring_drops)

    # --- policy.drain: process (dmi.ring.share): the child drains the ring itself ------------------------
    def attach_ring(self, info: dict) -> None:
        """The child maps the ring ``info`` describes and drains it from now on (no failover then:
        a store resumed here could not reach the steps the child held)."""
        self._failover_ok = False
        reply = self._call("ring", info)
        if reply is None or reply[0] is not None:
            self._stop()
            raise CaptureError(f"policy.drain: process: the drain process could not open the ring: "
                               f"{reply[0] if reply else 'it exited'}. Fix: use policy.drain: thread")

    def send_steps(self, descs: list, request_ids: list[str], ring_drops) -> None:
        """Ended steps' descriptors (:class:`dmi.ring.share.StepSender`), in step order."""
        self._raise_once()
        self._send(("steps", descs, self._new_ids(request_ids), self._new_drops(ring_drops)))
        self._forget_drops(ring_drops)

    def detach_ring(self) -> None:
        """After every step was drained: the child lets go of the ring (before this process frees it)."""
        self._call("ring_close")

    def tick(self) -> None:
        if self._inproc is not None:
            return self._delegate("tick")
        self._raise_once()
        self._check_alive()

    def sync(self) -> None:
        """Every step handed over so far on disk and committed (``run.flush``)."""
        if self._inproc is not None or self._call("sync") is None:
            return self._delegate("sync")
        self._raise_once()
        self._forget_drops(self._ring_drops_ref)          # (every step sent is committed now)

    def finish(self, ring_drops=()) -> None:
        reply = self._call("finish", self._new_drops(ring_drops)) if self._inproc is None else None
        if reply is None:
            return self._delegate("finish", ring_drops)
        if reply[0] is not None:
            raise StoreError(reply[0])

    def accounting(self) -> dict[str, np.ndarray]:
        reply = self._call("accounting") if self._inproc is None else None
        return self._delegate("accounting") if reply is None else reply[0]

    def close(self, summary: dict, clean: bool = True) -> None:
        try:
            reply = self._call("close", summary, clean) if self._inproc is None else None
        finally:
            self._stop()
        if reply is None:
            return self._delegate("close", summary, clean)
        if reply[0] is not None:
            raise StoreError(reply[0])

    # --- plumbing -------------------------------------------------------------------------------------
    def _new_ids(self, ids: list[str]) -> list[str]:
        new, self._ids_sent = ids[self._ids_sent:], len(ids)
        return new

    def _new_drops(self, drops) -> list:
        new = list(drops[self._drops_sent:])
        self._drops_sent += len(new)      # (not len(drops): the model's thread may have appended since)
        return new

    def _forget_drops(self, ring_drops) -> None:
        """Release from the ring's log (``dmi.ring.budget.DropLog``) the drops the child has: all sent ones,
        or, where this process may take the store over after the child dies, those of the steps the
        child committed (a failover counts them, :func:`_drops_through`)."""
        release = getattr(ring_drops, "release", None)
        if release is not None:
            upto = self._drops_sent
            if self._failover_ok:
                upto = min(upto, ring_drops.through(self.committed_step))
            release(upto)

    def _send(self, msg) -> bool:
        """Send to the child: True, or False once an in-process exporter took over."""
        try:
            self._conn.send(msg)
            return True
        except OSError as e:
            try:                          # a broken pipe: the child is gone or about to be
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            self._reader.join(timeout=2)
            if self._check_alive():
                return False
            raise StoreError(f"{self.path}: the store writer process is gone ({e})") from e

    def _call(self, kind: str, *args) -> tuple | None:
        """A request the child answers with ``(kind, ...)``; waits for it. None: the child died
        and an in-process exporter took over (ask it instead)."""
        with self._cond:
            self._replies.pop(kind, None)
        if not self._send((kind, *args)):
            return None
        with self._cond:
            while kind not in self._replies:
                if self._check_alive():
                    return None
                self._cond.wait(0.05)
            return self._replies.pop(kind)

    def _read_loop(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                with self._cond:
                    kind, state = msg[0], msg[-1]
                    self.committed_step, self.store_bytes = state["committed_step"], state["store_bytes"]
                    self.drops.extend(state["drops"])
                    if state["error"] is not None and self.error is None:
                        self.error = StoreError(state["error"])
                    if state.get("drain_error") and self.drain_error is None:
                        self.drain_error = state["drain_error"]
                    if kind == "done":
                        end = self._ends.pop(msg[1])
                        if end is not None:
                            self._space.release(end)
                    elif kind != "state":     # (a drain's batch changed the store: nothing waits for it)
                        self._replies[kind] = msg[1:-1]
                    self._cond.notify_all()
        except (EOFError, OSError):
            with self._cond:
                self._cond.notify_all()

    def _check_alive(self) -> bool:
        """False while the child lives (or its last answers are still being read). Once it has
        died: under on_store_error drop an in-process exporter takes over (True); else raise."""
        code = self._proc.poll()
        if code is None or self._reader.is_alive():
            return False
        if self._inproc is not None:
            return True
        if self._failover_ok:
            self._failover(code)
            return True
        if self.error is None:
            self.error = StoreError(f"{getattr(self, 'path', 'store')}: the store writer process exited "
                                    f"(code {code}). Fix: see its message above; the store keeps its last "
                                    f"committed step (policy.on_store_error: drop would resume it in this "
                                    f"process and keep capturing)")
        self._raised = True
        raise self.error

    def _failover(self, code: int) -> None:
        """The child died under on_store_error drop: resume the store in this process from its last
        commit and go on with it; the steps the child had not committed are recorded as dropped
        (reason ``writer``)."""
        from .exporter import ZarrExporter
        try:
            exp = ZarrExporter(self.path, self.plan, self._capture_dtype, self._attrs, resume=True)
        except StoreError as e:
            self.error = StoreError(f"{self.path}: the store writer process exited (code {code}) and this process "
                                    f"could not resume the store: {e}")
            self._raised = True
            raise self.error from e
        committed = exp.committed_step
        exp.continue_run(self._open_prior, _drops_through(self._ring_drops_ref, committed))
        lost = [u for u in self._unsettled if u[0] > committed]
        for _, ctrl, records in lost:
            exp.lose_step(ctrl, records, self._ids_ref, self._ring_drops_ref)
        self._unsettled.clear()
        self._child_drops = list(self.drops)
        self.failover = {"exit_code": code, "committed_step": committed, "steps_lost": len(lost),
                         "captures_lost": len(exp.drops)}
        exp.root_attrs.update({"writer_failover": self.failover})
        self._inproc = exp
        self._mirror()
        log.warning("dmi: %s: the store writer process exited (code %s); this process resumed the store after "
                    "step %s and writes it from now on; %d captures of %d uncommitted steps are recorded as dropped "
                    "(reason writer)", self.path, code, committed, len(exp.drops), len(lost))

    def _delegate(self, name: str, *args):
        """A call of the exporter interface, on the in-process exporter that took over."""
        try:
            return getattr(self._inproc, name)(*args)
        finally:
            self._mirror()

    def _mirror(self) -> None:
        exp = self._inproc
        self.error, self.committed_step, self.store_bytes = exp.error, exp.committed_step, exp.store_bytes
        self.drops = self._child_drops + exp.drops

    def _raise_once(self) -> None:
        if self.error is not None and not self._raised and sink_policy(self.plan) == "raise":
            self._raised = True
            raise self.error

    def _stop(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._reader.is_alive():
            self._reader.join(timeout=5)


def _handoff_buffer(size: int) -> tuple[str, mmap.mmap]:
    """The shared handoff buffer (:func:`dmi.shared_memory.shared_file`), or a StoreError with the fix."""
    try:
        return shared_file(size, "dmi-handoff-")
    except OSError as e:
        raise StoreError(f"store.writer: process: no room for the {size:,}-byte handoff buffer (policy.host_bytes) "
                         f"({e}). Fix: lower policy.host_bytes, free space in /dev/shm, or use "
                         f"store.writer: thread") from e


def _bytes(data) -> np.ndarray:
    return data.view(np.uint8).reshape(-1) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)


def _drops_through(ring_drops, step: int) -> int:
    """How many of the ring's drops (in step order) belong to steps up to ``step``."""
    through = getattr(ring_drops, "through", None)
    return through(step) if through is not None else sum(1 for d in ring_drops if d.step <= step)
