"""A chunk writer process of ``store.writer: pool``: encodes chunks read from shared memory and
writes each as a temp file beside its chunk key.

The model's process (:class:`dmi.store.pool.PoolExporter`) assembles each chunk's rows in a slot
of a shared arena and sends one message per chunk: per array, its name, its chunk key and where
its bytes are (a span of the arena, or bytes in the message for variable-length strings, which
the model's process has already turned into their ``vlen-utf8`` bytes). This process applies the
array's codecs after ``bytes`` (Blosc, Zstd: those zarr-python stores), writes a temp file, and
answers with the temp files and their sizes; the model's process renames them over the chunk
keys in write order, so the files are byte for byte what the thread writer writes.

It imports numpy, numcodecs and :mod:`dmi.shared_memory` only (no zarr, no torch): it starts in a fraction of a second. It
exits at end-of-file on its socket (the model's process closed the pool, or died: the temp files
it leaves are removed when the store is resumed).

Run as ``python -m dmi.store.chunkwriter FD ARENA``.
"""
from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection

import numcodecs
import numcodecs.blosc
import numpy as np

from ..shared_memory import map_shared


def numcodec(c: dict, where):
    """The numcodecs object zarr-python's codec of the same configuration (a ``zarr.json`` codec
    entry) encodes with."""
    cfg = c.get("configuration", {})
    if c["name"] == "blosc":
        return numcodecs.Blosc(cname=cfg["cname"], clevel=cfg["clevel"], blocksize=cfg.get("blocksize", 0),
                               shuffle={"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[cfg["shuffle"]],
                               typesize=cfg["typesize"])
    if c["name"] == "zstd":
        return numcodecs.Zstd(level=cfg.get("level", 0), checksum=cfg.get("checksum", False))
    from ..errors import StoreError
    raise StoreError(f"{where}/zarr.json: codecs: {c['name']} is not a codec dmi writes")


class ChunkFiles:
    """The arrays this process writes: per name, its directory and codecs, and the chunk key
    directories made so far (below the array's directory only: a removed store is not recreated)."""

    def __init__(self, arrays: dict, tmp_suffix: str):
        self.arrays = {name: (d, [numcodec(c, d) for c in codecs]) for name, (d, codecs) in arrays.items()}
        self.suffix = tmp_suffix
        self.made: set[str] = set()

    def write(self, job: int, name: str, key: list[str], data) -> tuple[str, str, int]:
        """Encode one array's chunk and write it as a temp file: (temp path, chunk path, bytes)."""
        d, codecs = self.arrays[name]
        for codec in codecs:
            data = codec.encode(data)
        parent = d
        for part in key[:-1]:
            parent = os.path.join(parent, part)
            if parent not in self.made:
                try:
                    os.mkdir(parent)
                except FileExistsError:
                    pass
                self.made.add(parent)
        tmp = os.path.join(parent, f".{key[-1]}.{os.getpid()}-{job}{self.suffix}")
        with open(tmp, "wb") as f:
            f.write(data)
        return tmp, os.path.join(parent, key[-1]), memoryview(data).nbytes


def lower_priority(nice: int) -> None:
    """All of this process is store work: every thread of it (those numpy started at import too)
    runs at niceness ``nice`` at least, so the model's threads keep their cores (Linux: per thread)."""
    tasks = "/proc/self/task"
    for tid in [int(t) for t in os.listdir(tasks)] if os.path.isdir(tasks) else [0]:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        except (AttributeError, OSError):
            pass


def serve(conn: Connection, arena: np.ndarray) -> None:
    _, arrays, suffix, nice = conn.recv()
    lower_priority(nice)
    numcodecs.blosc.use_threads = False      # one core per process: the pool is the parallelism
    files = ChunkFiles(arrays, suffix)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        _, job, items = msg
        written = []
        try:
            for name, key, src in items:
                data = arena[src[0]:src[0] + src[1]] if isinstance(src, tuple) else src
                written.append(files.write(job, name, key, data))
            conn.send(("done", job, written))
        except Exception as e:  # noqa: BLE001 - the model's process turns it into the store's error
            for tmp, _, _ in written:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            conn.send(("failed", job, f"{e}" if isinstance(e, OSError) else f"{type(e).__name__}: {e}",
                       isinstance(e, OSError)))


def run_child(argv: list[str], serve) -> None:
    """A store child process started as ``FD PATH`` (this one, the writer process of
    :mod:`dmi.store.writer`): ``serve(conn, shared)`` over the socket ``FD``, with the shared file
    ``PATH`` mapped. Ctrl-C or a stop signal is the model's process's to handle (the child runs in
    its own session, and ignores them where they still reach it, e.g. a whole cgroup stopped): that
    process closes the child, or dies and the child sees end-of-file."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd, path = int(argv[0]), argv[1]
    mapping = map_shared(path)
    conn = Connection(fd)
    try:
        serve(conn, np.frombuffer(mapping, np.uint8))
    finally:
        conn.close()


def main(argv: list[str]) -> None:
    run_child(argv, serve)


if __name__ == "__main__":
    main(sys.argv[1:])
