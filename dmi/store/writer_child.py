"""The store writer's child process (``store.writer: process``, :mod:`dmi.store.writer`): a
:class:`~dmi.store.exporter.ZarrExporter` serving the parent's messages (steps whose bytes lie in
the shared handoff buffer, sync, finish, close) and, under ``policy.drain: process``, draining the
model's ring itself (:class:`_Drain`). Each answer carries the store's state for the parent to mirror.

Run as ``python -m dmi.store.writer_child FD PATH``.
"""
from __future__ import annotations

import logging
import sys
import time
import types
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from ..errors import StoreError
from ..ring.budget import DropLog
from .chunks import lower_priority
from .chunkwriter import run_child
from .commits import TICK_S


log = logging.getLogger("dmi")
RING_POLL_S = 0.0005       # policy.drain: process: how often the child looks for ended steps while some are pending
DRAIN_BATCH = 64           # steps the child copies out and writes at a time at most


def _state(exp, sent: list) -> dict:
    """What the parent mirrors after each answer: commit point, store size, new sink drops, the error."""
    new = exp.drops[len(sent):]
    sent.extend(new)
    return {"committed_step": exp.committed_step, "store_bytes": exp.store_bytes, "drops": list(new),
            "error": None if exp.error is None else str(exp.error)}


def _guarded(fn, *args) -> str | None:
    """Run an exporter call; its StoreError goes back with the next answer (state['error'])."""
    try:
        fn(*args)
        return None
    except StoreError as e:
        return str(e)


def _serve(conn: Connection, buf: np.ndarray) -> None:
    from .exporter import ZarrExporter
    _, path, plan, capture_dtype, attrs, overwrite, resume = conn.recv()
    try:
        _load_plugins(plan)
        exp = ZarrExporter(path, plan, capture_dtype, attrs, overwrite=overwrite, resume=resume)
    except Exception as e:  # noqa: BLE001 - the parent raises it as a StoreError
        conn.send(("error", str(e) if isinstance(e, StoreError) else f"{path}: {type(e).__name__}: {e}"))
        return
    conn.send(("opened", str(exp.path), exp.next_step, exp.stored_request_ids, exp.store_bytes, exp.committed_step))
    ids: list[str] = []
    ring_drops = DropLog()           # (the parent's drops as they arrive; released once written)
    sent: list = []
    drain = _Drain(exp, ids, ring_drops, conn, sent)
    ticked = time.monotonic()
    while True:
        try:
            msg = conn.recv() if conn.poll(RING_POLL_S if drain.busy else TICK_S) else None
        except (EOFError, OSError):        # the model's process is gone: commit what arrived, stay "open"
            _guarded(exp.checkpoint, True)
            exp._shutdown(wait=True)
            drain.close()
            return
        kind = msg[0] if msg is not None else None
        if kind in (None, "steps"):        # idle, or (policy.drain: process) ended steps to drain from the ring
            if kind == "steps":
                _, descs, new_ids, new_drops = msg
                ids.extend(new_ids)
                ring_drops.extend(new_drops)
                drain.take(descs)
            drain.run()
            if time.monotonic() - ticked >= TICK_S:     # commits go on while idle; a failed write surfaces
                ticked = time.monotonic()
                _guarded(exp.tick)
        elif kind == "ring":
            conn.send(("ring", drain.open(msg[1], plan.policy.host_bytes), _state(exp, sent)))
        elif kind == "ring_close":
            drain.close()
            conn.send(("ring_close", _state(exp, sent)))
        elif kind == "step":
            _, seq, step, tokens, slots, sites, recs, start, sizes, inline, new_ids, new_drops = msg
            ids.extend(new_ids)
            ring_drops.extend(new_drops)
            slot_of = {s: types.SimpleNamespace(site=s, sel=sel) for s, sel in slots.items()}
            ctrl = types.SimpleNamespace(step=step, tokens=tokens, slots=slot_of)
            src = buf if inline is None else inline
            records, at = [], start
            for site, rec, n in zip(sites, recs, sizes):
                records.append((slot_of[site], rec, src[at:at + n]))
                at += n
            _guarded(exp.write_step, ctrl, records, ids, ring_drops)
            del records
            conn.send(("done", seq, _state(exp, sent)))
        elif kind == "sync":
            _guarded(exp.sync)
            conn.send(("sync", _state(exp, sent)))
        elif kind == "finish":
            ring_drops.extend(msg[1])
            err = _guarded(exp.finish, ring_drops)
            conn.send(("finish", err, _state(exp, sent)))
        elif kind == "accounting":
            conn.send(("accounting", exp.accounting(), _state(exp, sent)))
        elif kind == "close":
            err = _guarded(exp.close, msg[1], msg[2])
            conn.send(("close", err, _state(exp, sent)))
            return


class _Drain:
    """The child's drain of a ring shared by the model's process (``policy.drain: process``,
    :mod:`dmi.ring.share`): ready steps are copied out and written in batches; after each, the
    progress words free their ring space and a ``state`` message goes back if the store's state
    changed. A failure to drain (not the store's: the exporter accounts those) stops draining and
    goes back as ``drain_error``; the model's process then stops capturing."""

    def __init__(self, exp, ids: list, ring_drops: DropLog, conn: Connection, sent: list):
        self.exp, self.ids, self.ring_drops, self.conn, self.sent = exp, ids, ring_drops, conn, sent
        self.reader = self.receiver = None
        self.exported = 0
        self.failed = False
        self._last_state = None

    @property
    def busy(self) -> bool:
        return self.reader is not None and not self.failed and bool(self.reader.pending)

    def open(self, info: dict, host_bytes: int) -> str | None:
        from ..ring.share import StepReceiver
        from ..ring.factory import open_reader
        try:
            self.reader, self.receiver = open_reader(info, host_bytes), StepReceiver()
            return None
        except Exception as e:  # noqa: BLE001 - the model's process raises it
            return f"{type(e).__name__}: {e}"

    def take(self, descs: list) -> None:
        if self.reader is not None:
            self.reader.take(descs, self.receiver)

    def run(self) -> None:
        reader, exp = self.reader, self.exp
        if reader is None or self.failed:
            return
        try:
            while ctrls := reader.batch(DRAIN_BATCH):
                for ctrl, records in zip(ctrls, reader.drain_steps(ctrls)):
                    try:
                        _guarded(exp.write_step, ctrl, records, self.ids, self.ring_drops)
                    finally:
                        reader.release_host(ctrl)
                self.exported += len(ctrls)
                reader.publish_progress(self.exported)
                self._report()
        except Exception as e:  # noqa: BLE001 - reaches the model's process, which stops capturing
            log.exception("dmi: the drain process stopped")
            self.failed = True
            self.conn.send(("state", _state(exp, self.sent) | {"drain_error": f"{type(e).__name__}: {e}"}))

    def _report(self) -> None:
        exp = self.exp
        now = (exp.committed_step, exp.store_bytes, len(exp.drops), exp.error is not None)
        if now != self._last_state:
            self._last_state = now
            self.conn.send(("state", _state(exp, self.sent)))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


def _load_plugins(plan) -> None:
    """The hook spec's ``engine.writer_plugins``: ``module:function`` entries called once, before
    the store is opened (zarr codecs or data types of a plugin; instrumentation that must reach the
    store writer's process too, e.g. perf/common/vllm_plugins.py's host sink under
    ``policy.drain: process``)."""
    import importlib
    for entry in plan.engine.writer_plugins:
        module, _, fn = entry.strip().partition(":")
        try:
            call = getattr(importlib.import_module(module), fn or "register")
        except (ImportError, AttributeError) as e:
            raise StoreError(f"{plan.hook_file or 'hook spec'}: engine.writer_plugins: {entry!r}: {e}. Fix: name "
                             f"an importable module:function (the store writer's process imports it)") from None
        call()


def main(argv: list[str]) -> None:
    # all of this process is store work: the model's threads keep their cores (its threads started
    # at import, e.g. zarr's event loop, too; the ones it starts later inherit the main thread's)
    tasks = Path("/proc/self/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [None]:
        lower_priority(tid=tid)
    run_child(argv, _serve)


if __name__ == "__main__":
    main(sys.argv[1:])
