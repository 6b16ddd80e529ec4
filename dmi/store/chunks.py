"""Chunk I/O: one Zarr array's chunk files encoded as zarr-python would store them and written
atomically (:class:`ArrayFile`: a temp file renamed into place in a local directory, one PUT on an
object store), the codecs, the dtypes, and the store threads' priority.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numcodecs
import numpy as np

from ..errors import StoreError
from ..plan import Plan
from ..zdtype import BF16
from .chunkwriter import numcodec
from .location import TMP_SUFFIX, open_location


STORE_NICE = 10       # the store's threads' niceness: the model's threads (0) win a contended core


# store.compression lz4: blosc-lz4 over each value's bits regrouped (bitshuffle). On bf16 activations
# byte shuffle + lz4 encoded 0.7 GB/s a core and saved 6 % of the bytes; bitshuffle encodes 1.6-2.0
# GB/s and saves 12-14 % (float32-widened bf16: 1.6 -> 1.8 GB/s, 51 -> 56 % saved); decoding is as fast
LZ4 = {"cname": "lz4", "clevel": 1, "shuffle": "bitshuffle", "blocksize": 0}


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4}


VLEN = numcodecs.VLenUTF8()


def storage_dtype(plan: Plan, capture_dtype: str) -> np.dtype:
    """Float storage dtype: the capture dtype ('native'), or the hook spec's store.dtype.
    bfloat16 is stored as itself (the Zarr v3 extension data type, dmi/zdtype.py): two bytes a
    value, exact, and its rows are a plain copy of the captured bits."""
    return numpy_dtype(capture_dtype if plan.store_dtype == "native" else plan.store_dtype)


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a Zarr v3 data type name (bfloat16: ml_dtypes')."""
    return BF16 if name == "bfloat16" else np.dtype(name)


class ArrayFile:
    """An array zarr-python created whose chunk files and shape dmi writes itself. A chunk file
    holds exactly what zarr-python would store: its codec chain is read from ``zarr.json``.
    ``store``: a local directory or a :mod:`dmi.store.location` (an object store)."""

    def __init__(self, store, name: str):
        self.loc = open_location(store)
        self.name = name
        # the array's directory (a local store), or how errors name it
        self.dir = f"{self.loc}/{name}" if self.loc.remote else self.loc.path / name
        raw = self.loc.read(f"{name}/zarr.json")
        if raw is None:
            raise FileNotFoundError(f"{self.dir}/zarr.json")
        self.meta = json.loads(raw)
        m = self.meta
        self.chunks = tuple(m["chunk_grid"]["configuration"]["chunk_shape"])
        enc = m["chunk_key_encoding"]
        default = enc["name"] == "default"
        self._sep = enc.get("configuration", {}).get("separator", "/" if default else ".")
        self._prefix = "c" + self._sep if default else ""
        first, *rest = m["codecs"]
        if first["name"] not in ("bytes", "vlen-utf8") or first.get("configuration", {}).get("endian", "little") != "little":
            raise StoreError(f"{self.dir}/zarr.json: codecs: {first['name']} is not a codec dmi writes")
        self.vlen = first["name"] == "vlen-utf8"
        self.codecs = [numcodec(c, self.dir) for c in rest]
        self.dtype = np.dtype(object) if self.vlen else numpy_dtype(m["data_type"]).newbyteorder("<")
        fv = m["fill_value"]
        floating = self.dtype.kind == "f" or self.dtype == BF16
        self.fill = float(fv) if isinstance(fv, str) and floating else fv   # "NaN" -> nan
        self._dirs: set = set()       # chunk directories known to exist (a local store): paths, put's keys

    def key(self, chunk: int) -> list[str]:
        """The chunk key of token chunk ``chunk`` (every other dim is one chunk), per
        chunk_key_encoding, as path parts below the array's directory."""
        return (self._prefix + self._sep.join(map(str, (chunk,) + (0,) * (len(self.chunks) - 1)))).split("/")

    def store_key(self, chunk: int) -> str:
        """The store key of token chunk ``chunk`` (``layers/resid_post/resid_post/c/0/0/0``)."""
        return "/".join([self.name, *self.key(chunk)])

    def path(self, chunk: int) -> Path:
        """The chunk file of token chunk ``chunk`` in a local store."""
        return self.loc.path.joinpath(self.name, *self.key(chunk))

    def encode(self, block: np.ndarray):
        data = VLEN.encode(block.reshape(-1)) if self.vlen else np.ascontiguousarray(block).view(np.uint8).reshape(-1)
        for codec in self.codecs:
            data = codec.encode(data)
        return data

    def write(self, chunk: int, data) -> tuple[Path, Path]:
        """Write an encoded chunk to a temp file beside its final name, in a local store: (temp, final)."""
        path = self.path(chunk)
        if path.parent not in self._dirs:
            d = self.dir          # below the array's directory only: a removed store is not recreated
            for part in path.parent.relative_to(self.dir).parts:
                d = d / part
                try:
                    os.mkdir(d)
                except FileExistsError:
                    pass
            self._dirs.add(path.parent)
        tmp = path.parent / f".{path.name}.{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}"
        with open(tmp, "wb") as f:
            f.write(data)
        return tmp, path

    def put(self, chunk: int, data) -> None:
        """Write an encoded chunk atomically (a local temp file renamed into place, or one PUT on an
        object store): a reader sees the old chunk or the new one, whole."""
        key = self.store_key(chunk)
        parent = key.rpartition("/")[0]
        # directories below the array's own only: a removed store is not recreated
        self.loc.write(key, data, under=None if parent in self._dirs else self.name)
        self._dirs.add(parent)

    def set_rows(self, n: int) -> None:
        self.meta["shape"][0] = int(n)
        self.loc.write(f"{self.name}/zarr.json", json.dumps(self.meta, indent=2).encode())


def default_threads() -> int:
    """``store.threads`` unset: half the cores, at least 2 and at most 8. With one thread the row
    copies run on the exporter thread and one thread encodes and writes every chunk, while the
    exporter thread waits for it (2-core box, Qwen3-8B hidden states: lz4 0.39 -> 0.64 GB/s, none
    0.59 -> 0.70 with two); the store's threads run at STORE_NICE, so a busy model keeps its core."""
    return max(2, min(8, (os.cpu_count() or 1) // 2))


def lower_priority(nice: int = STORE_NICE, tid: int | None = None) -> None:
    """Run the calling thread (or thread ``tid`` of this process) at niceness ``nice`` at least
    (Linux: niceness is per thread, and threads inherit their creator's). Where the system has no
    such call, or refuses it, the thread keeps its priority."""
    try:
        tid = threading.get_native_id() if tid is None else tid
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError):
        pass


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.parent / f".{path.name}.{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def unlink_all(paths) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass
