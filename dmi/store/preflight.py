"""Checks before anything is written, and a store's life on disk around them: whether a path (or an
object store URL, :mod:`dmi.store.location`) may be written or resumed, a new store built beside its
path then renamed into place (on an object store: built in memory, then its root ``zarr.json``
written last), the reserve file that keeps room for the final metadata on a full disk.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import zarr

from ..errors import StoreError
from .inspect import writer_alive
from .location import TMP_SUFFIX, Local, Remote, is_remote, open_location


CREATING = ".dmi-creating"     # an object store's store being created: who creates it (removed once it is whole)


STAGE_SUFFIX = ".dmi-new"      # a store being created: built beside its path, then renamed into place


OLD_SUFFIX = ".dmi-old"        # an overwritten store, renamed away before it is deleted


RESERVE = ".dmi-reserve"       # .NAME.dmi-reserve beside an open store: space for its final metadata (a full disk)


RESERVE_BYTES = 1 << 20


POOL_ON_OBJECT_STORE = ("store.writer: pool writes each chunk to a temp file that it renames into a local "
                       "directory; store {store!r} is an object store")
POOL_FIX = ("remove store.writer (the thread writer sends each chunk as one PUT), or write to a local "
            "directory and copy the store afterwards")


def check_store_writer(store, hook) -> None:
    """``store.writer: pool`` needs a local directory: refused for an object store at load, naming
    the hook spec's key and line."""
    if (hook.data.get("store") or {}).get("writer") == "pool" and is_remote(store):
        raise hook.error(("store", "writer"), POOL_ON_OBJECT_STORE.format(store=str(store)), fix=POOL_FIX)


def check_writable(path, overwrite: bool, storage_options: dict | None = None) -> Path | str:
    """Fail early, naming the path and the fix, if the store cannot be created. Returns the local
    path, or an object store's URL."""
    loc = open_location(path, storage_options)
    if isinstance(loc, Remote):
        return _check_remote_writable(loc, overwrite)
    path = loc.path
    if path.exists() and not path.is_dir():
        raise StoreError(f"store {str(path)!r} exists and is not a directory. Fix: choose another path")
    _refuse_existing(str(path), root_attrs(path) if path.is_dir() else {}, path.exists(), overwrite)
    if path.exists() and any(path.iterdir()) and not (path / "zarr.json").exists():
        raise StoreError(f"store {str(path)!r} is a directory that is not a Zarr store; overwrite=True would delete "
                         f"everything in it. Fix: choose a new path, or remove that directory yourself")
    probe_dir = path.parent if str(path.parent) else Path(".")
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise StoreError(f"store {str(path)!r} cannot be created: {str(probe_dir)!r} is a file, not a directory. "
                         f"Fix: choose a store path whose parent is a directory")
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise StoreError(f"store {str(path)!r} cannot be written: {str(probe_dir)!r} is not writable. "
                         f"Fix: choose a store path in a writable directory")
    return path


def _refuse_existing(name: str, attrs: dict, exists: bool, overwrite: bool) -> None:
    """A store at ``name`` that another run writes, or that exists when no overwrite was asked."""
    if attrs.get("dmi_status") == "open" and writer_alive(attrs.get("dmi_writer")):
        # (overwrite too: deleting a store another run is writing loses its data and breaks that run)
        raise StoreError(f"store {name!r} is being written by process {attrs['dmi_writer']['pid']}"
                         + (" (overwrite=True / --overwrite does not delete a store another run is writing)"
                            if overwrite else "") + ". Fix: choose a new path, or wait until that run closes it")
    if exists and not overwrite:
        crashed = attrs.get("dmi_status") == "open"
        raise StoreError(f"store {name!r} already exists" + (" and did not close cleanly" if crashed else "")
                         + ". Fix: " + ("continue it with resume=True (CLI: --resume), " if crashed else "")
                         + "pass overwrite=True (CLI: --overwrite), or choose a new path")


def _check_remote_writable(loc: Remote, overwrite: bool) -> str:
    """check_writable on an object store: the bucket answers, and what is under the URL may go."""
    keys = loc.keys()
    if keys and "zarr.json" not in keys:
        creator = _creator(loc) if CREATING in keys else None
        if creator is not None and writer_alive(creator):
            raise StoreError(f"store {loc.url!r} is being created by process {creator.get('pid')}. Fix: choose a "
                             f"new URL, or wait until that run has created it")
        if creator is None:
            raise StoreError(f"store {loc.url!r} holds {len(keys)} object(s) but no Zarr store (no zarr.json); "
                             f"overwrite=True would delete them all. Fix: choose a new URL, or remove those "
                             f"objects yourself")
        return loc.url           # a creation that died: creating the store again removes what it left
    _refuse_existing(loc.url, root_attrs(loc) if keys else {}, bool(keys), overwrite)
    return loc.url


def _creator(loc: Remote) -> dict:
    try:
        return json.loads(loc.read(CREATING) or b"{}")
    except ValueError:
        return {}


def check_resumable(path, attrs: dict | None = None, hook_file: str | None = None,
                    storage_options: dict | None = None) -> dict:
    """The root ``zarr.json`` of a store that a new run may append to; refuses (naming the file, the
    key and the fix) a path that is no dmi store, or one whose hook spec / model differ from
    ``attrs`` (the new run's root attributes; only the keys given are compared)."""
    loc = open_location(path, storage_options)
    if isinstance(loc, Remote):
        loc.keys()              # the bucket answers (else: the cause and the fix)
    path = loc.path if isinstance(loc, Local) else loc.url
    meta_file = f"{loc}/zarr.json"
    raw = loc.read("zarr.json")
    if raw is None:
        raise StoreError(f"store {str(path)!r} does not exist (no zarr.json): there is nothing to resume. "
                         f"Fix: leave out resume (CLI: --resume) to create it")
    meta = json.loads(raw)
    stored = meta.get("attributes") or {}
    if "dmi_format" not in stored:
        raise StoreError(f"{meta_file}: dmi_format: not a dmi store. Fix: resume a store written by dmi")
    if "dmi_committed" not in stored:
        raise StoreError(f"{meta_file}: dmi_committed: the store has no commit marker (written by an older dmi). "
                         f"Fix: capture into a new store")
    if stored.get("dmi_status") == "open" and writer_alive(stored.get("dmi_writer")):
        raise StoreError(f"{meta_file}: dmi_writer: process {stored['dmi_writer']['pid']} is still writing this "
                         f"store. Fix: resume it once that run has ended, or capture into a new store")
    for key in ("family", "sites", "model", "hook_spec", "engine"):
        if attrs is None or key not in attrs:
            continue
        a, b = _comparable(key, stored.get(key), attrs[key]), _comparable(key, attrs[key], attrs[key])
        diff = _first_diff(a, b, key)
        if diff is not None:
            where, old, new = diff
            file = hook_file if key == "hook_spec" and hook_file else str(meta_file)
            raise StoreError(f"{file}: {where}: this run has {new!r} but the store {str(path)!r} was captured with "
                             f"{old!r}. Fix: resume with the hook spec and model the store was written with "
                             f"(`dmi inspect {path}` shows them), or capture into a new store")
    return meta


def _comparable(key: str, value, new):
    """What must match between a store and a run resuming it (the policy, the engine options and the
    sink limits may change); ``new``: the run's value, which says which model fields are known."""
    value = jsonable({"v": value})["v"]
    if key == "hook_spec" and isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in ("policy", "engine")}   # how, not what, is captured
        if isinstance(value.get("store"), dict):
            value["store"] = {k: v for k, v in value["store"].items()
                              if k not in ("path", "max_bytes", "bytes_per_s", "storage_options")}
    if key == "model" and isinstance(value, dict):
        value = {k: value.get(k) for k in ("name_or_path", "model_type", "dtype", "class") if k in (new or {})}
    return value


def _first_diff(a, b, where: str):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            d = _first_diff(a.get(k), b.get(k), f"{where}.{k}")
            if d is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_diff(x, y, f"{where}[{i}]")
            if d is not None:
                return d
        return None
    return None if a == b else (where, a, b)


def stored_request_ids(path, storage_options: dict | None = None) -> list[str]:
    """Request ids in the committed rows of a store (a resumed run gives its requests new ones)."""
    loc = open_location(path, storage_options)
    attrs = root_attrs(loc)
    rows = (attrs.get("dmi_committed") or {}).get("rows", {})
    root = zarr.open_group(loc.zarr(), mode="r", use_consolidated=False)
    ids: dict[str, None] = {}
    for name, n in rows.items():
        if name != "drops" and n:
            ids.update(dict.fromkeys(str(v) for v in np.asarray(root[f"{name}/request"][:n]).tolist()))
    return list(ids)


def root_attrs(path) -> dict:
    """A store's root attributes ({} where it has none): ``path`` a local path or a location."""
    loc = open_location(path)
    try:
        return json.loads(loc.read("zarr.json") or b"{}").get("attributes") or {}
    except (OSError, ValueError):
        return {}


def create_remote(loc: Remote, build) -> None:
    """Create a store on an object store as a whole: ``build(store)`` lays it out in memory, and
    its objects are written with the root ``zarr.json`` last, so that no half store is ever taken
    for a store. A marker object (``.dmi-creating``: who writes) stands until then: a process
    killed meanwhile leaves a prefix the next creation of the same URL clears. Whatever was under
    the URL (``check_writable`` allowed it: overwrite, or a creation that died) is removed first."""
    from zarr.storage import MemoryStore

    objects: dict = {}
    build(MemoryStore(objects))
    loc.remove()
    loc.write(CREATING, json.dumps(writer_info()).encode())
    data = {k: v.to_bytes() for k, v in objects.items()}
    root = data.pop("zarr.json")
    loc.write_many(data)
    loc.write("zarr.json", root)
    loc.delete(CREATING)


def create_atomically(path: Path, overwrite: bool, build) -> None:
    """Create a store at ``path`` as a whole: ``build(stage)`` lays it out in a hidden directory
    beside it (``.NAME.PID.HOST.dmi-new``, same file system), which is then renamed into place. A
    process killed while building leaves no half store at ``path`` (an existing one it was to
    overwrite stays as it was); the staging directories of dead processes are removed by the next
    creation of the same path. ``check_writable`` must have allowed ``path`` (and ``overwrite``)."""
    path = Path(path)
    tag = f"{os.getpid()}.{socket.gethostname()}"
    stage = path.parent / f".{path.name}.{tag}{STAGE_SUFFIX}"
    _remove_stale(path)
    if stage.exists():
        shutil.rmtree(stage)
    try:
        build(stage)
        if path.exists():             # overwrite: the old store goes aside, the new one takes its name
            old = path.parent / f".{path.name}.{tag}{OLD_SUFFIX}"
            os.rename(path, old)
            os.rename(stage, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(stage, path)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _remove_stale(path: Path) -> None:
    """Staging (and overwritten) directories beside ``path`` that a dead process on this host left."""
    prefix = f".{path.name}."
    try:
        entries = list(path.parent.iterdir()) if path.parent.is_dir() else []
    except OSError:
        return
    for p in entries:
        name = p.name
        if not name.startswith(prefix) or not name.endswith((STAGE_SUFFIX, OLD_SUFFIX)):
            continue
        pid, _, host = name[len(prefix):].rsplit(".", 1)[0].partition(".")
        if pid.isdigit() and host == socket.gethostname() and writer_alive({"pid": int(pid), "host": host}) is False:
            shutil.rmtree(p, ignore_errors=True)


def store_gone(path) -> StoreError | None:
    """The error of a store whose directory was removed (or replaced) while this run wrote it."""
    loc = open_location(path)
    if loc.exists("zarr.json"):
        return None
    return StoreError(f"store {str(path)!r} was removed while this run was writing it (no {str(path)}/zarr.json): "
                      f"its captures are lost and nothing is written there any more (a half store is not "
                      f"recreated). Fix: leave the store in place until its run has closed it (another run's "
                      f"--overwrite is refused while it is open), then capture again into a new store")


def unreserve(path) -> None:
    """Free the reserve file of :func:`reserve` (none on an object store)."""
    if not isinstance(path, Remote):
        try:
            os.unlink(reserve_path(open_location(path).path))
        except OSError:
            pass


def reserve_path(path: Path) -> Path:
    """The file beside an open store that holds space for its final metadata (a hidden sidecar:
    zarr-python warns about any file inside a group it does not know)."""
    return Path(path).parent / f".{Path(path).name}{RESERVE}"


def reserve(path) -> None:
    """Hold ``RESERVE_BYTES`` beside the store for its final metadata: on a full disk ``close``
    frees them first, so the status, the error and the drops table can still be written (an
    object store is never full: nothing to hold)."""
    if isinstance(path, Remote):
        return
    path = open_location(path).path
    with open(reserve_path(path), "wb") as f:
        f.write(bytes(RESERVE_BYTES))


def disk_usage(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


def writer_info() -> dict:
    """Who writes the store (its markers and attributes name the process)."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def choose_writer(writer: str, device, store, tensor_parallel: bool, in_memory: bool) -> tuple[str, str | None]:
    """``store.writer: auto`` (the default) as the run's writer, and why (None: the hook spec chose).
    The pool keeps chunk encoding and file writes off the model process's GIL, which a GPU model's
    host loop needs between steps (perf/offline.py --headline); it writes local directories only,
    one exporter per store (no tensor-parallel shards), and a store on disk. A CPU model computes
    far slower than it captures, and gains nothing from worker processes that take its cores."""
    if writer != "auto":
        return writer, None
    if getattr(device, "type", device) != "cuda":
        return "thread", "a model on the CPU: the exporter's threads in its process"
    if tensor_parallel or in_memory or is_remote(store):
        what = ("tensor parallelism" if tensor_parallel else "an in-memory result" if in_memory
                else "an object store")
        return "thread", f"{what}: the exporter's threads in the model's process"
    return "pool", "a CUDA model writing a local directory: chunks encoded and written by worker processes"
