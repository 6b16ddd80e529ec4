"""Bookkeeping of the payload ring's bytes: absolute head and tail, contiguous blocks, wrap-around.
"""
from __future__ import annotations

from .records import align_up


class ByteRing:
    """Bookkeeping of a byte ring: absolute head/tail counters, contiguous reservations, wrap-around."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.head = 0   # absolute bytes ever reserved (incl. wrap padding)
        self.tail = 0   # absolute bytes ever freed

    @property
    def used(self) -> int:
        return self.head - self.tail

    def try_reserve(self, nbytes: int) -> tuple[int, int] | None:
        """(offset within the ring, absolute end) of a contiguous block, or None if it does not fit now."""
        nbytes = align_up(max(nbytes, 1))
        if nbytes > self.capacity:
            return None
        start = self.head
        pos = start % self.capacity
        floor = self.tail
        if pos + nbytes > self.capacity:          # does not fit before the end: skip to the start
            start += self.capacity - pos
            pos = 0
            if self.tail == self.head:            # empty ring: the skipped tail holds nothing, so a block
                floor = start                     # up to the whole capacity fits (else it never would)
        end = start + nbytes
        if end - floor > self.capacity:
            return None
        self.head = end
        return pos, end

    def release(self, upto: int) -> None:
        assert self.tail <= upto <= self.head, (self.tail, upto, self.head)
        self.tail = upto
