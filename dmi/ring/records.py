"""What the host and the device agree on: the meta ring's record format, the payload ring's
alignment, and the progress words a drain in another process publishes (:mod:`dmi.ring.share`).

A record is read ``seq`` first, then the rest: the writer stores ``seq`` last (after a fence on
the GPU), so a matching ``seq`` means the fields are complete.
"""
from __future__ import annotations

import numpy as np

from ..plan import RING_ALIGN


ALIGN = RING_ALIGN       # the plan's budget checks round each site's block the same way


META_DTYPE = np.dtype([("seq", "<u8"), ("step", "<i8"), ("site", "<i4"), ("flags", "<i4"),
                       ("offset", "<i8"), ("nbytes", "<i8"), ("rows", "<i8"), ("src_seq", "<i8")])


META_WORDS = META_DTYPE.itemsize // 8      # a record as int64 words: seq, step, site|flags<<32, offset, ...


END_MARKER = -1


FLAG_ABORTED = 1


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


# the progress words of a ring drained in another process (int64, in its shared file: dmi.ring.share):
# the child writes them, the model's process reads them (Ring.reclaim)
FREED_SEQ, TAIL, EXPORTED, RECORDS, DRAINED, CAPTURED, NOT_RUN = range(7)
WORDS = 8
