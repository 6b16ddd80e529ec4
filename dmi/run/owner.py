"""Which thread drives a run's steps (one generate at a time per run)."""
from __future__ import annotations

import threading

from ..errors import CaptureError


class StepOwner:
    """Which thread drives a run's steps. The token bookkeeping (request table, decode mirror,
    token filter counters, the open step) is one sequence of steps: two threads interleaving their
    forwards would attribute rows to each other's requests. So a thread owns the run from its step's
    begin to its end, and for a whole ``Run.exclusive`` block (a ``generate()`` call); another
    thread meanwhile is refused at once (never blocked: no deadlock, and the owner's steps are
    untouched). An owner thread that has exited is taken over (its open step is aborted by the
    next step)."""

    def __init__(self, on_takeover) -> None:
        self.on_takeover = on_takeover     # called when the owner thread is found dead
        self.lock = threading.Lock()
        self.thread: int | None = None
        self.what = ""
        self.depth = 0             # nested exclusive blocks of the owner

    def claim(self, what: str) -> None:
        me = threading.get_ident()
        if self.thread == me:      # the common case: no lock (only the owner changes an owned value)
            return
        with self.lock:
            if self.thread is not None and self.thread != me and thread_alive(self.thread):
                raise CaptureError(
                    f"one generate at a time per dmi run: thread {thread_name(me)!r} began {what} while thread "
                    f"{thread_name(self.thread)!r} is running {self.what} on the same run (their steps share the "
                    f"run's request bookkeeping, so rows would be attributed to the wrong requests). Fix: "
                    f"serialize the calls (e.g. a threading.Lock around generate), or give each thread its "
                    f"own model and dmi.load run")
            orphaned = self.thread is not None
            self.thread, self.what, self.depth = me, what, 0
            if orphaned:
                self.on_takeover()

    def release_step(self) -> None:
        """A step ended: the run is free again unless its thread is inside an exclusive block."""
        if self.thread == threading.get_ident() and self.depth == 0:
            self.thread = None

    def enter(self, what: str) -> None:
        self.claim(what)
        self.what = what
        self.depth += 1

    def exit(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.thread = None


def thread_alive(ident: int) -> bool:
    return any(t.ident == ident for t in threading.enumerate())


def thread_name(ident: int) -> str:
    return next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))
