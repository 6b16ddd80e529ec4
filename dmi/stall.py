"""No silent hang: a wait that sees no progress for ``policy.stall_timeout_s`` becomes an error.

Each waiting loop of the pipeline (the model's thread waiting for ring space, the drain waiting for
host staging or for the exporter's queue, a flush or close waiting for the store) holds a
:class:`Stall`. It is told, on every wake-up, a value that moves whenever the stage it waits on
makes progress (freed ring bytes, freed staging, steps exported); only a wait during which that
value stays put for the whole timeout raises. A slow store that keeps moving is never an error.
"""
from __future__ import annotations

import time

from .errors import CaptureError

DEFAULT_STALL_TIMEOUT_S = 60.0


class Stall:
    """The progress clock of one wait. ``stage``: what is waited for, as the error names it;
    ``numbers``: a callable giving the figures that explain the wait (ring, staging, queue)."""

    __slots__ = ("stage", "timeout", "numbers", "_seen", "_since")

    def __init__(self, stage: str, timeout: float | None, numbers=None):
        self.stage, self.timeout, self.numbers = stage, timeout, numbers
        self._seen = None
        self._since = time.monotonic()

    def check(self, progress) -> None:
        """Called on every wake-up of the wait with the stage's progress value."""
        now = time.monotonic()
        if progress != self._seen:
            self._seen, self._since = progress, now
            return
        if self.timeout is not None and now - self._since > self.timeout:
            detail = self.numbers() if self.numbers is not None else ""
            raise CaptureError(f"{self.stage}: no progress for {now - self._since:.0f} s"
                               + (f" ({detail})" if detail else "")
                               + ". Fix: see whether the store's disk or the drain is stuck; raise "
                                 "policy.stall_timeout_s if a stage legitimately pauses this long")
