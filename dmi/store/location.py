"""Where a store lives: a local directory (:class:`Local`), or an object store's URL such as
``s3://bucket/run.zarr`` (:class:`Remote`) reached through zarr-python's own storage layer
(``zarr.storage.FsspecStore``).

Both give the exporter the same operations on the store's keys (``zarr.json``,
``layers/resid_post/resid_post/c/0/0/0``): read, an atomic write (locally a temp file renamed into
place; on an object store one PUT, and an object appears whole or not at all), existence, sizes,
removal, and the zarr store to open groups with. ``store.storage_options`` (hook spec) go to the
fsspec file system (``endpoint_url``, ``key``/``secret``, ``anon``, ``client_kwargs``, ...);
credentials otherwise come from the usual environment variables and config files (for S3:
``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``~/.aws``, ``AWS_ENDPOINT_URL``).
"""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from ..errors import StoreError


# object stores dmi writes, by URL scheme: the package fsspec needs for each
WRITABLE = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
            "abfss": "adlfs", "memory": None}


# storage options whose values never go into the store's attributes (credentials)
SECRET_WORDS = ("secret", "token", "password", "key", "credential", "session", "sas")


TMP_SUFFIX = ".dmi-tmp"


_FIX_SCHEME = ("Fix: give a local directory, or an object store URL dmi writes: s3://bucket/run.zarr (any S3-"
               "compatible server: store.storage_options.endpoint_url), gs://, az:// or memory://")


def scheme_of(store) -> str | None:
    """The URL scheme of ``store`` (``s3``), or None for a local path (a ``str`` without ``://``,
    or a ``pathlib.Path``)."""
    if isinstance(store, str) and "://" in store:
        return store.split("://", 1)[0].lower()
    return None


def is_remote(store) -> bool:
    """Whether ``store`` names an object store (``file://`` is a local directory)."""
    if isinstance(store, (Local, Remote)):
        return isinstance(store, Remote)
    return scheme_of(store) not in (None, "file")


def open_location(store, storage_options: dict | None = None, write: bool = True) -> "Local | Remote":
    """The location of ``store``: a path (``file://`` URLs included) or an object store URL.
    Refuses, naming the URL and the fix, a scheme dmi cannot write (``write``) or read, and a
    scheme whose package is not installed. Nothing is read or written here."""
    if isinstance(store, (Local, Remote)):
        return store
    scheme = scheme_of(store)
    if scheme is None:
        return Local(Path(store))
    if scheme == "file":
        return Local(Path(store.split("://", 1)[1]))
    return Remote(store, storage_options, write)


class Local:
    """A store in a local directory."""

    remote = False

    def __init__(self, path: Path):
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.path)

    def zarr(self):
        """What zarr.open_group takes for this store."""
        return str(self.path)

    def read(self, key: str) -> bytes | None:
        try:
            return (self.path / key).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, key: str, data, under: str | None = None) -> None:
        """Write ``key`` atomically (a temp file renamed over it). Missing directories are made
        below ``under`` only (a store directory removed under a run is not recreated)."""
        path = self.path / key
        if under is not None:
            d = self.path / under
            for part in path.parent.relative_to(d).parts:
                d = d / part
                try:
                    os.mkdir(d)
                except FileExistsError:
                    pass
        tmp = path.parent / f".{path.name}.{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def exists(self, key: str) -> bool:
        return (self.path / key).is_file()

    def size(self, key: str) -> int:
        try:
            return (self.path / key).stat().st_size
        except FileNotFoundError:
            return 0

    def total_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(self.path) for f in files)

    def delete(self, key: str) -> None:
        try:
            os.unlink(self.path / key)
        except FileNotFoundError:
            pass

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class Remote:
    """A store under an object store URL, through ``zarr.storage.FsspecStore``."""

    remote = True

    def __init__(self, url: str, storage_options: dict | None = None, write: bool = True):
        self.url = url.rstrip("/")
        self.scheme = scheme_of(url)
        import fsspec
        known = self.scheme in fsspec.available_protocols()
        if write and self.scheme not in WRITABLE:
            why = ("is read-only to dmi: a store cannot be written there" if known else
                   "is no storage scheme dmi knows")
            raise StoreError(f"store {self.url!r}: {self.scheme}:// {why}. {_FIX_SCHEME}")
        if not known:
            raise StoreError(f"store {self.url!r}: {self.scheme}:// is no storage scheme dmi knows. {_FIX_SCHEME}")
        options = dict(storage_options or {})
        if self.scheme in ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"):
            # no cached listings: another process (the writer, a crashed run) changes the store
            options = {"use_listings_cache": False} | options
        from zarr.storage import FsspecStore
        try:
            self.store = FsspecStore.from_url(self.url, storage_options=options, read_only=not write)
        except ImportError as e:
            pkg = WRITABLE.get(self.scheme) or "the fsspec implementation of " + self.scheme
            raise StoreError(f"store {self.url!r}: {self.scheme}:// needs {pkg}, which is not installed ({e}). "
                             f"Fix: pip install {pkg}" + (" (or pip install 'dmi[s3]')" if pkg == "s3fs" else "")
                             ) from None
        except (TypeError, ValueError) as e:
            raise StoreError(f"store {self.url!r}: store.storage_options: {e}. Fix: give the options the "
                             f"{self.scheme}:// file system takes (e.g. endpoint_url, key, secret, anon)") from None

    def __str__(self) -> str:
        return self.url

    def zarr(self):
        return self.store

    def _sync(self, coro, what: str):
        """Run one of the zarr store's coroutines on zarr's I/O loop; a failure other than a missing
        object names the URL, what failed and the fix."""
        from zarr.core.sync import sync
        try:
            return sync(coro)
        except (FileNotFoundError, StoreError):
            raise
        except Exception as e:   # noqa: BLE001 - botocore's, aiohttp's, the file system's own errors
            raise StoreError(f"store {self.url!r}: {what} failed: {type(e).__name__}: {e}. Fix: check the URL, that "
                             f"the bucket exists, and the credentials (environment, ~/.aws, or store.storage_options: "
                             f"key, secret, endpoint_url for an S3-compatible server)") from e

    def read(self, key: str) -> bytes | None:
        from zarr.core.buffer import default_buffer_prototype
        buf = self._sync(self.store.get(key, prototype=default_buffer_prototype()), f"reading {key}")
        return None if buf is None else buf.to_bytes()

    def write(self, key: str, data, under: str | None = None) -> None:
        """One PUT: the object appears whole or not at all (no temp object, no rename)."""
        from zarr.core.buffer import cpu
        self._sync(self.store.set(key, cpu.Buffer.from_bytes(memoryview(data).cast("B"))), f"writing {key}")

    def write_many(self, items: dict) -> None:
        """Several objects, PUT concurrently."""
        import asyncio

        from zarr.core.buffer import cpu

        async def put_all():
            await asyncio.gather(*(self.store.set(k, cpu.Buffer.from_bytes(memoryview(v).cast("B")))
                                   for k, v in items.items()))
        self._sync(put_all(), f"writing {len(items)} objects")

    def exists(self, key: str) -> bool:
        return bool(self._sync(self.store.exists(key), f"looking up {key}"))

    def delete(self, key: str) -> None:
        self._sync(self.store.delete(key), f"deleting {key}")

    def size(self, key: str) -> int:
        try:
            return int(self._sync(self.store.getsize(key), f"the size of {key}"))
        except FileNotFoundError:
            return 0

    def keys(self) -> list[str]:
        """Every object under the store's prefix (one listing): checked before the model loads, it
        fails with the URL, the cause and the fix where the bucket cannot be listed (no such
        bucket, no credentials, a wrong endpoint)."""
        async def listing():
            return [k async for k in self.store.list_prefix("")]
        try:
            keys = self._sync(listing(), "listing the store")
        except FileNotFoundError:
            keys = []
        if not keys and self.scheme != "memory":      # nothing under the prefix: is there a bucket at all?
            bucket = self.store.path.split("/", 1)[0]
            if not self._sync(self.store.fs._exists(bucket), f"looking up bucket {bucket}"):
                raise StoreError(f"store {self.url!r}: bucket {bucket!r} does not exist (or these credentials cannot "
                                 f"see it). Fix: create the bucket, or check the URL and the credentials (for an "
                                 f"S3-compatible server: store.storage_options.endpoint_url or AWS_ENDPOINT_URL)")
        return keys

    def total_bytes(self) -> int:
        """The bytes of every object under the store's prefix (one listing, with sizes)."""
        try:
            found = self._sync(self.store.fs._find(self.store.path, detail=True), "listing the store")
        except FileNotFoundError:
            return 0
        return sum(int(info.get("size") or 0) for info in found.values())

    def remove(self) -> None:
        self._sync(self.store.delete_dir(""), "removing the store")



def remove_store(store, storage_options: dict | None = None) -> None:
    """Remove a store a failed start left (best effort: a failure to remove is not the error)."""
    try:
        open_location(store, storage_options).remove()
    except Exception:   # noqa: BLE001 - the caller raises the error that made the store worthless
        pass


def redact(options):
    """``store.storage_options`` as the store's attributes keep them: credentials masked."""
    if isinstance(options, dict):
        return {k: "***" if any(w in str(k).lower() for w in SECRET_WORDS) and not isinstance(v, (dict, bool))
                else redact(v) for k, v in options.items()}
    return options


def place_files(src: "Local | Remote", dst: "Local | Remote", keys: list[tuple[str, str]]) -> dict[str, int]:
    """Put the files ``src/<a>`` at ``dst/<b>`` for each ``(a, b)`` in ``keys``, without reading them
    where the storage allows: on one file system a hard link (the source stays as it was, so an
    interrupted merge can run again), between two object store URLs of one scheme a server-side
    copy; else (another file system, no hard links, local to remote) read and written, each file
    whole (a temp file renamed, or one PUT). Returns how many went each way."""
    done = {"linked": 0, "server_copied": 0, "copied": 0, "absent": 0}
    if not src.remote and not dst.remote:
        for a, b in keys:
            done[_link_or_copy(src.path / a, dst.path / b)] += 1
        return done
    if (src.remote and dst.remote and src.scheme == dst.scheme and type(src.store.fs) is type(dst.store.fs)
            and getattr(dst.store.fs, "async_impl", False)):
        import asyncio
        fs = dst.store.fs
        limit = asyncio.Semaphore(32)

        async def copy(a, b):
            async with limit:
                try:
                    await fs._copy(f"{src.store.path}/{a}", f"{dst.store.path}/{b}")
                except FileNotFoundError:
                    return "absent"
            return "server_copied"

        async def copy_all():
            return await asyncio.gather(*(copy(a, b) for a, b in keys))
        for how in dst._sync(copy_all(), f"copying {len(keys)} objects from {src.url}"):
            done[how] += 1
        return done
    for a, b in keys:
        data = src.read(a)
        if data is not None:
            dst.write(b, data, under="")
        done["absent" if data is None else "copied"] += 1
    return done


def _link_or_copy(a: Path, b: Path) -> str:
    b.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(a, b)
        return "linked"
    except FileNotFoundError:
        if not a.exists():           # (a chunk never written reads as the fill value: nothing to place)
            return "absent"
        raise
    except OSError:                  # another file system (EXDEV), or one without hard links
        tmp = b.parent / f".{b.name}.{os.getpid()}{TMP_SUFFIX}"
        shutil.copyfile(a, tmp)
        os.replace(tmp, b)
        return "copied"
