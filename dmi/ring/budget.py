"""Budgets and drops: ``policy.d2h_bytes_per_s`` as a token bucket, the log of dropped captures,
and the ring's counters.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Drop:
    step: int
    site: int
    requests: tuple[int, ...]
    rows: int
    bytes: int
    reason: str


class DropLog:
    """The captures a ring dropped, in order: the model's thread appends, the store's writer takes
    them by absolute position (``len``, ``log[i]``, ``log[i:]`` count every drop since the start)
    and releases those it has written (:meth:`release`), so a long ``best_effort`` run under a tight
    cap keeps memory flat. The counts the run reports (captures, bytes, per reason) cover every
    drop, released or not. Iteration yields the drops still held."""

    def __init__(self) -> None:
        self._held: list[Drop] = []
        self._base = 0                  # absolute position of _held[0]
        self._lock = threading.Lock()   # (release against positional reads from another thread)
        self.bytes = 0
        self.by_reason: dict[str, int] = {}

    def append(self, drop: Drop) -> None:
        self._held.append(drop)
        self.bytes += drop.bytes
        self.by_reason[drop.reason] = self.by_reason.get(drop.reason, 0) + 1

    def extend(self, drops) -> None:
        drops = list(drops)
        self._held.extend(drops)
        self.bytes += sum(d.bytes for d in drops)
        for d in drops:
            self.by_reason[d.reason] = self.by_reason.get(d.reason, 0) + 1

    def __len__(self) -> int:
        with self._lock:
            return self._base + len(self._held)

    def __getitem__(self, key):
        with self._lock:
            if isinstance(key, slice):
                start = self._base if key.start is None else key.start
                if start < self._base or key.stop is not None or key.step is not None:
                    raise IndexError(f"DropLog[{key}]: drops before {self._base} were released (only [start:] with "
                                     f"start >= {self._base} can be read)")
                return self._held[start - self._base:]
            if key < self._base:
                raise IndexError(f"DropLog[{key}]: released (the first held drop is {self._base})")
            return self._held[key - self._base]

    def __iter__(self):
        return iter(list(self._held))

    def through(self, step: int) -> int:
        """The absolute position after the last drop of a step up to ``step`` (drops come in step
        order); released drops count as such (only written ones are released)."""
        with self._lock:
            n = 0
            for d in self._held:
                if d.step > step:
                    break
                n += 1
            return self._base + n

    def release(self, upto: int) -> None:
        """Forget the drops before absolute position ``upto`` (written to the store)."""
        with self._lock:
            k = max(0, min(upto - self._base, len(self._held)))
            if k:
                del self._held[:k]
                self._base += k


@dataclass
class Stats:
    steps: int = 0
    records: int = 0
    bytes_captured: int = 0
    bytes_drained: int = 0
    stall_seconds: float = 0.0               # steps held back (full): ring/meta space or the bandwidth cap
    stall_bandwidth_seconds: float = 0.0     # of which waiting for policy.d2h_bytes_per_s
    not_run: int = 0
    streamed_steps: int = 0                  # steps larger than the ring, captured in parts (full)
    stream_parts: int = 0
    drops: DropLog = field(default_factory=DropLog)


class TokenBucket:
    """``policy.d2h_bytes_per_s`` as a token bucket on the bytes each step reserves.

    It fills at ``rate`` bytes/s up to ``burst`` (one second of rate) and starts full. A step may
    start when the bucket holds its bytes. A step larger than the burst may start once the bucket is
    full: it then drives the level negative and later steps wait until that debt is paid back at
    ``rate``. Without that exception such a step could never start (``full`` would wait forever,
    ``best_effort`` would drop it every time) although the cap is an average, and the long-run
    average still never exceeds ``rate``: over any interval T at most ``burst + rate * T`` plus one
    step's overshoot goes through."""

    def __init__(self, rate: float, burst: float | None = None, clock=time.monotonic):
        self.rate = float(rate)
        self.burst = float(rate if burst is None else burst)
        self.clock = clock
        self.level = self.burst
        self.t = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.burst, self.level + (now - self.t) * self.rate)
        self.t = now

    def wait_for(self, nbytes: int) -> float:
        """Seconds until a step of ``nbytes`` may start (0.0: now; a step that copies nothing never waits)."""
        if nbytes <= 0:
            return 0.0
        self._refill()
        return max(0.0, (min(nbytes, self.burst) - self.level) / self.rate)

    def fits(self, needs: np.ndarray) -> np.ndarray:
        """``wait_for(n) == 0`` for each of ``needs`` at once (one refill)."""
        self._refill()
        return (needs <= 0) | (np.minimum(needs, self.burst) <= self.level)

    def spend(self, nbytes: int) -> None:
        self._refill()
        self.level -= nbytes

    def refund(self, nbytes: int) -> None:
        """Give back what a step that never ran spent (:meth:`Ring.retract_ahead`)."""
        self.level = min(self.burst, self.level + nbytes)
