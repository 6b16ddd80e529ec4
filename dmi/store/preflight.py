"""Checks before anything is written, and a store's life on disk around them: whether a path may be
written or resumed, a new store built beside its path then renamed into place, the reserve file
that keeps room for the final metadata on a full disk.
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


TMP_SUFFIX = ".dmi-tmp"


STAGE_SUFFIX = ".dmi-new"      # a store being created: built beside its path, then renamed into place


OLD_SUFFIX = ".dmi-old"        # an overwritten store, renamed away before it is deleted


RESERVE = ".dmi-reserve"       # .NAME.dmi-reserve beside an open store: space for its final metadata (a full disk)


RESERVE_BYTES = 1 << 20


def check_writable(path: str | Path, overwrite: bool) -> Path:
    """Fail early, naming the path and the fix, if the store cannot be created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise StoreError(f"store {str(path)!r} exists and is not a directory. Fix: choose another path")
    attrs = root_attrs(path) if path.is_dir() else {}
    if attrs.get("dmi_status") == "open" and writer_alive(attrs.get("dmi_writer")):
        # (overwrite too: deleting a store another run is writing loses its data and breaks that run)
        raise StoreError(f"store {str(path)!r} is being written by process {attrs['dmi_writer']['pid']}"
                         + (" (overwrite=True / --overwrite does not delete a store another run is writing)"
                            if overwrite else "") + ". Fix: choose a new path, or wait until that run closes it")
    if path.exists() and not overwrite:
        crashed = attrs.get("dmi_status") == "open"
        raise StoreError(f"store {str(path)!r} already exists" + (" and did not close cleanly" if crashed else "")
                         + ". Fix: " + ("continue it with resume=True (CLI: --resume), " if crashed else "")
                         + "pass overwrite=True (CLI: --overwrite), or choose a new path")
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


def check_resumable(path: str | Path, attrs: dict | None = None, hook_file: str | None = None) -> dict:
    """The root ``zarr.json`` of a store that a new run may append to; refuses (naming the file, the
    key and the fix) a path that is no dmi store, or one whose hook spec / model differ from
    ``attrs`` (the new run's root attributes; only the keys given are compared)."""
    path = Path(path)
    meta_file = path / "zarr.json"
    if not meta_file.is_file():
        raise StoreError(f"store {str(path)!r} does not exist (no zarr.json): there is nothing to resume. "
                         f"Fix: leave out resume (CLI: --resume) to create it")
    meta = json.loads(meta_file.read_text())
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
            value["store"] = {k: v for k, v in value["store"].items() if k not in ("path", "max_bytes", "bytes_per_s")}
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


def stored_request_ids(path: str | Path) -> list[str]:
    """Request ids in the committed rows of a store (a resumed run gives its requests new ones)."""
    path = Path(path)
    attrs = root_attrs(path)
    rows = (attrs.get("dmi_committed") or {}).get("rows", {})
    root = zarr.open_group(str(path), mode="r", use_consolidated=False)
    ids: dict[str, None] = {}
    for name, n in rows.items():
        if name != "drops" and n:
            ids.update(dict.fromkeys(str(v) for v in np.asarray(root[f"{name}/request"][:n]).tolist()))
    return list(ids)


def root_attrs(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "zarr.json").read_text()).get("attributes") or {}
    except (OSError, ValueError):
        return {}


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


def store_gone(path: Path) -> StoreError | None:
    """The error of a store whose directory was removed (or replaced) while this run wrote it."""
    if (Path(path) / "zarr.json").is_file():
        return None
    return StoreError(f"store {str(path)!r} was removed while this run was writing it (no {str(path)}/zarr.json): "
                      f"its captures are lost and nothing is written there any more (a half store is not "
                      f"recreated). Fix: leave the store in place until its run has closed it (another run's "
                      f"--overwrite is refused while it is open), then capture again into a new store")


def reserve_path(path: Path) -> Path:
    """The file beside an open store that holds space for its final metadata (a hidden sidecar:
    zarr-python warns about any file inside a group it does not know)."""
    return Path(path).parent / f".{Path(path).name}{RESERVE}"


def reserve(path: Path) -> None:
    """Hold ``RESERVE_BYTES`` beside the store for its final metadata: on a full disk ``close``
    frees them first, so the status, the error and the drops table can still be written."""
    with open(reserve_path(path), "wb") as f:
        f.write(bytes(RESERVE_BYTES))


def disk_usage(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))
