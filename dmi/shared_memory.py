"""Files shared by two processes, mapped by both: the ring's shared file and the store writer's
handoff buffer (:mod:`dmi.ring.share`, :mod:`dmi.store.writer`), the chunk writers' arena
(:mod:`dmi.store.pool`, :mod:`dmi.store.chunkwriter`). Standard library only: a chunk writer
process imports it and starts in a fraction of a second.
"""
from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path


def shared_file(size: int, prefix: str) -> tuple[str, mmap.mmap]:
    """A shared file of ``size`` bytes, mapped: in /dev/shm, else the temp directory (a container's
    /dev/shm is often 64 MiB). Its blocks are allocated up front (a sparse file on a full tmpfs
    would kill the process with SIGBUS at the first write past the space) and faulted in (first
    touches of fresh shared pages cost more than the copies themselves). OSError naming every place
    tried when none has room."""
    tried = []
    for where in (Path("/dev/shm"), Path(tempfile.gettempdir())):
        if not where.is_dir():
            continue
        fd, path = tempfile.mkstemp(prefix=prefix, dir=where)
        try:
            os.posix_fallocate(fd, 0, size)
            return path, _mapped(fd, size)
        except OSError as e:
            tried.append(f"{where}: {e.strerror or e}")
            os.unlink(path)
        finally:
            os.close(fd)
    raise OSError("; ".join(tried) or "no /dev/shm or temp directory")


def map_shared(path: str) -> mmap.mmap:
    """Another process's :func:`shared_file`, mapped whole."""
    with open(path, "r+b") as f:
        return _mapped(f.fileno(), 0)


def _mapped(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
