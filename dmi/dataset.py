"""``dmi.capture_dataset``: capture a whole dataset of prompts on Ray Data, into one store.

Each Ray actor holds a vLLM engine with dmi (``dmi.load(..., backend="vllm")``) writing its own
part store, ``<store>.parts/<part>.zarr``: no actor waits on another. A batch commits once its
rows are committed in the part (``Run.flush``): the actor then writes the batch's commit record,
``<store>.parts/commits/<part>-<n>.json`` (its request ids, one atomic write). Rows whose batch has
no record (an actor killed mid-batch) are discarded; Ray runs that batch again on a fresh actor,
which writes a fresh part. At the end the driver merges: for each request id the first commit
record naming it (records in name order) says which part's rows are kept, so each request is
stored once however often its batch ran. The merge writes the kept rows into ``store`` (one
closed Zarr store, as one run writes): a part's whole chunks whose rows all count as files (hard
links, or server-side copies on an object store), the other rows by value; each part's steps are
renumbered after the previous part's. Then the parts are removed (``keep_parts=True`` keeps them).
docs/ray.md.
"""
from __future__ import annotations

import json
import os
import socket
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DmiError

DEFAULT_SAMPLING = {"max_tokens": 16, "temperature": 0.0}
ROW_DIMS = ("token", "drop")      # the dims along which a part's groups grow


def parts_url(store: str) -> str:
    return f"{str(store).rstrip('/')}.parts"


class CaptureActor:
    """A Ray Data actor: one vLLM engine with dmi, writing one part store; called once per batch."""

    def __init__(self, parts: str, model: Any, hook_spec, sampling: dict, engine_kwargs: dict):
        from . import load
        from .store.location import open_location
        from .spec import load_hook_spec
        hook = load_hook_spec(hook_spec)
        self.options = (hook.data.get("store") or {}).get("storage_options")
        self.parts = open_location(parts, self.options)
        # host, pid and a random tail: a restarted actor (a new process) never reuses a part
        self.name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # the engine and its part start with the first batch: an actor Ray starts but never gives a
        # batch (and ends once the dataset is done) leaves nothing behind the merge
        self.start = lambda: load(model, hook.data, f"{parts}/{self.name}.zarr", backend="vllm", **engine_kwargs)
        self.run = None
        from vllm import SamplingParams
        self.params = SamplingParams(**sampling)
        self.batches = 0
        self.seen: set[str] = set()

    def __call__(self, batch: dict) -> dict:
        if self.run is None:
            self.run = self.start()
        ids = [str(i) for i in batch["id"]]
        texts = [str(t) for t in batch["text"]]
        dup = sorted(set(ids) & self.seen) or sorted(i for i in set(ids) if ids.count(i) > 1)
        if dup:
            raise DmiError(f"capture_dataset: request id {dup[0]!r} occurs twice in the dataset. Fix: give every "
                           f"row its own `id`")
        eng = self.run.llm.llm_engine
        for rid, text in zip(ids, texts):
            eng.add_request(rid, text, self.params)
        generated: dict[str, str] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    generated[out.request_id] = out.outputs[0].text
        self.run.run.flush()          # every row of this batch committed in the part ...
        record = {"part": self.name, "ids": ids, "texts": {i: [t, generated.get(i, "")] for i, t in zip(ids, texts)}}
        # ... before the record that makes them count (one atomic write)
        self.parts.write(f"commits/{self.name}-{self.batches:06d}.json", json.dumps(record).encode(), under="")
        self.batches += 1
        self.seen.update(ids)
        return {"id": ids, "part": [self.name] * len(ids), "generated": [generated.get(i, "") for i in ids]}

def capture_dataset(dataset, model: Any, hook_spec, store: str | Path, *, num_workers: int = 1,
                    batch_size: int = 16, sampling: dict | None = None, num_cpus: float | None = None,
                    num_gpus: float | None = None, overwrite: bool = False, keep_parts: bool = False,
                    progress: bool = True, **engine_kwargs) -> dict:
    """Capture every row of ``dataset`` (a ``ray.data.Dataset`` with ``id`` and ``text`` columns)
    with ``num_workers`` vLLM engines on Ray, into one store at ``store``.

    sampling: ``vllm.SamplingParams`` keywords (default greedy, 16 tokens). num_cpus / num_gpus:
    Ray resources per actor (on GPUs: ``num_gpus=1`` and ``tensor_parallel_size`` unset). Other
    keywords go to ``vllm.LLM``. Returns ``{"requests": n, "parts": [...], "store": path}``; the
    store's root attribute ``texts`` maps each request id to its prompt and generated text.
    Needs a running Ray (``ray.init``), else a local one starts."""
    import ray       # (first: a clear ImportError where Ray is missing)

    from .spec import load_hook_spec
    from .store.location import open_location
    from .store.preflight import check_store_writer, check_writable
    hook = load_hook_spec(hook_spec)                     # errors before any actor starts
    missing = {"id", "text"} - set(dataset.schema().names)
    if missing:
        raise DmiError(f"capture_dataset: the dataset has no column {sorted(missing)[0]!r} (columns: "
                       f"{', '.join(dataset.schema().names)}). Fix: give it an `id` (request id) and a `text` "
                       f"(prompt) column, e.g. ds.rename_columns({{'prompt': 'text'}})")
    options = (hook.data.get("store") or {}).get("storage_options")
    store = str(store)
    check_store_writer(store, hook)
    check_writable(store, overwrite, options)
    loc = open_location(parts_url(store), options)
    if overwrite:
        loc.remove()
    elif _keys(loc):
        raise DmiError(f"capture_dataset: {parts_url(store)} holds another job's parts. Fix: pass overwrite=True, "
                       f"or remove it")
    if not loc.remote:
        loc.path.mkdir(parents=True, exist_ok=True)
    if num_gpus is None and num_cpus is None:
        num_cpus = 1
    engine_kwargs.setdefault("enable_prefix_caching", False)   # a row's values must not depend on earlier batches
    results = dataset.map_batches(
        CaptureActor, compute=ray.data.ActorPoolStrategy(size=num_workers), batch_size=batch_size, batch_format="numpy",
        fn_constructor_kwargs={"parts": parts_url(store), "model": model, "hook_spec": hook.data,
                               "sampling": dict(DEFAULT_SAMPLING if sampling is None else sampling),
                               "engine_kwargs": engine_kwargs},
        **({"num_cpus": num_cpus} if num_cpus is not None else {}),
        **({"num_gpus": num_gpus} if num_gpus is not None else {}))
    total = dataset.count()
    bar = _progress(total, progress)
    for batch in results.iter_batches(batch_size=None, batch_format="numpy"):   # rows as workers finish them
        bar.update(len(batch["id"]))
    bar.close()
    summary = merge_parts(store, options, keep_parts=keep_parts)
    if summary["requests"] != total:
        raise DmiError(f"capture_dataset: {total} rows in the dataset, {summary['requests']} requests stored")
    return summary


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="req", desc="dmi capture", disable=not enabled)


def _keys(loc) -> list[str]:
    if loc.remote:
        return loc.keys()
    if not loc.path.exists():
        return []
    return [str(p.relative_to(loc.path)) for p in loc.path.rglob("*") if p.is_file()]


def commit_records(loc) -> list[dict]:
    """The parts' batch commit records, in name order."""
    keys = sorted(k for k in _keys(loc) if k.startswith("commits/") and k.endswith(".json")
                  and not os.path.basename(k).startswith("."))
    return [json.loads(loc.read(k)) for k in keys]


def merge_parts(store: str, options: dict | None = None, *, keep_parts: bool = False) -> dict:
    """Merge the committed rows of every part under ``<store>.parts`` into one store at ``store``:
    each request id's rows from the first commit record that names it. The parts are read, never
    changed (until removed at the end), so a merge that was interrupted can run again. Returns a
    summary; ``chunk_files`` counts the chunk files placed whole (``linked``, ``server_copied``,
    ``copied``; ``absent``: never written, so they read as the fill value in both)."""
    import zarr

    from . import zdtype
    from .store.location import open_location
    zdtype.register()
    parts_loc = open_location(parts_url(store), options)
    owner: dict[str, str] = {}          # request id -> the part whose rows count
    texts: dict[str, list] = {}
    for rec in commit_records(parts_loc):
        for rid in rec["ids"]:
            if rid not in owner:
                owner[rid] = rec["part"]
                texts[rid] = rec["texts"][rid]
    names = sorted(set(owner.values()))
    if not names:
        raise DmiError(f"capture_dataset: no batch committed under {parts_url(store)}: nothing to merge")
    parts = {n: zarr.open_group(open_location(f"{parts_url(store)}/{n}.zarr", options, write=False).zarr(), mode="r")
             for n in names}
    arrays = {n: _row_arrays(g) for n, g in parts.items()}
    # which rows of each part's groups are kept, and where they go
    keep: dict[tuple[str, str], np.ndarray] = {}
    totals: dict[str, int] = {}
    for n, g in parts.items():
        committed = (g.attrs.get("dmi_committed") or {}).get("rows", {})
        for group, arrs in arrays[n].items():
            rows = min(committed.get(group, arrs[next(iter(arrs))].shape[0]), *(a.shape[0] for a in arrs.values()))
            if "request" in arrs:
                req = np.asarray(arrs["request"][:rows]).tolist()
                mask = np.fromiter((owner.get(str(r)) == n for r in req), bool, count=rows)
            else:           # the drops table: each part's committed drops
                mask = np.ones(rows, bool)
            keep[n, group] = mask
            totals[group] = totals.get(group, 0) + int(mask.sum())
    # steps: each part's after the previous part's
    offsets, next_step = {}, 0
    for n, g in parts.items():
        offsets[n] = next_step
        next_step += int((g.attrs.get("dmi_committed") or {}).get("next_step", 0))
    out_loc = open_location(store, options)
    out = zarr.open_group(out_loc.zarr(), mode="w", zarr_format=3)
    first = parts[names[0]]
    layouts = {group: _layout(keep, names, group, arrs[next(iter(arrs))].chunks[0])
               for group, arrs in arrays[names[0]].items()}
    placed = {"linked": 0, "server_copied": 0, "copied": 0, "absent": 0}
    for path, src in first.members(max_depth=None):
        if isinstance(src, zarr.Group):
            out.require_group(path).attrs.update(src.attrs.asdict())
            continue
        dims = list(src.metadata.dimension_names or ())
        group, name = path.rsplit("/", 1) if "/" in path else ("", path)
        layout = layouts.get(group) if dims and dims[0] in ROW_DIMS else None
        dst = out.create_array(path, shape=(layout.rows, *src.shape[1:]) if layout else src.shape,
                               chunks=src.chunks, dtype=src.metadata.data_type, compressors=src.compressors,
                               fill_value=src.metadata.fill_value, dimension_names=dims or None,
                               attributes=src.attrs.asdict(), chunk_key_encoding=src.metadata.chunk_key_encoding)
        if layout is None:
            dst[...] = src[...]
            continue
        _copy_rows(dst, {n: arrays[n][group][name] for n in names}, layout,
                   offsets if name == "step" else None, parts_loc, out_loc, path, placed)
    attrs = first.attrs.asdict()
    attrs.update({"dmi_status": "closed", "texts": texts, "steps": next_step,
                  "stall_seconds": sum(float(g.attrs.get("stall_seconds") or 0.0) for g in parts.values()),
                  "dmi_committed": {"step": next_step - 1, "next_step": next_step, "rows": totals},
                  "ray": {"parts": [{"part": n, "step_offset": offsets[n],
                                     "requests": sum(1 for o in owner.values() if o == n)} for n in names]}})
    for k in ("rows_selected", "rows_stored", "rows_dropped", "rows_not_computed", "stats", "dmi_writer", "vllm"):
        attrs.pop(k, None)       # per-part figures; the parts' own are in the parts (keep_parts=True)
    out.attrs.update(attrs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # consolidated metadata is not in the v3 spec yet
        zarr.consolidate_metadata(out_loc.zarr())
    if not keep_parts:
        _remove(parts_loc)
    return {"store": store, "requests": len(owner), "parts": names, "rows": totals, "chunk_files": placed}


def _remove(loc) -> None:
    """Remove the parts. A removal racing a file being written there (an actor Ray has not ended
    yet) leaves the directory behind: try again, briefly."""
    import time
    for _ in range(20):
        loc.remove()
        if not _keys(loc) and (loc.remote or not loc.path.exists()):
            return
        time.sleep(0.25)
    warnings.warn(f"capture_dataset: {loc} could not be removed; remove it once the job's actors have ended",
                  stacklevel=3)


def _row_arrays(group) -> dict[str, dict]:
    """group path -> {array name: array} for the arrays that grow along a row dim."""
    import zarr
    out: dict[str, dict] = {}
    for path, obj in group.members(max_depth=None):
        if isinstance(obj, zarr.Array) and (obj.metadata.dimension_names or (None,))[0] in ROW_DIMS:
            g, name = path.rsplit("/", 1)
            out.setdefault(g, {})[name] = obj
    return out


class _Layout:
    """Where a group's kept rows go in the merged store: first each part's whole chunks whose rows
    are all kept (``slots``: (part, chunk index), in part order), each to a whole chunk of the merged
    array (so its file is placed as it is, not decoded); then every other kept row (``rest``: part ->
    row indices), part after part."""

    def __init__(self, chunk: int, slots: list, rest: dict):
        self.chunk, self.slots, self.rest = chunk, slots, rest
        self.rows = len(slots) * chunk + sum(len(r) for r in rest.values())


def _layout(keep: dict, names: list[str], group: str, chunk: int) -> _Layout:
    slots, rest = [], {}
    for n in names:
        mask = keep[n, group]
        whole = mask[: len(mask) // chunk * chunk].reshape(-1, chunk).all(axis=1)
        slots += [(n, int(i)) for i in np.flatnonzero(whole)]
        inside = np.zeros(len(mask), bool)
        inside[: len(whole) * chunk] = np.repeat(whole, chunk)
        rest[n] = np.flatnonzero(mask & ~inside)
    return _Layout(chunk, slots, rest)


def _copy_rows(dst, srcs: dict, layout: _Layout, offsets: dict | None, parts_loc, out_loc, path: str,
               placed: dict) -> None:
    """Fill one row array of the merged store per ``layout``. A whole chunk goes over as its file
    (a hard link, or a server-side copy) where the part's array is encoded exactly as ``dst``; the
    ``step`` coordinate (shifted by ``offsets``) and the rest are written by value."""
    r = layout.chunk
    files = []
    for slot, (n, i) in enumerate(layout.slots):
        src = srcs[n]
        same = (offsets is None and src.metadata.codecs == dst.metadata.codecs and src.chunks == dst.chunks
                and src.chunks[1:] == src.shape[1:])
        if same:
            files.append((f"{n}.zarr/{path}/{src.metadata.encode_chunk_key((i,) + (0,) * (src.ndim - 1))}",
                          f"{path}/{dst.metadata.encode_chunk_key((slot,) + (0,) * (dst.ndim - 1))}"))
            continue
        data = src[i * r: (i + 1) * r]
        dst[slot * r: (slot + 1) * r] = data + offsets[n] if offsets is not None else data
    if files:
        from .store.location import place_files
        for how, k in place_files(parts_loc, out_loc, files).items():
            placed[how] += k
    at = len(layout.slots) * r
    pieces = []
    for n, idx in layout.rest.items():
        if len(idx):
            data = srcs[n].oindex[idx]
            pieces.append(data + offsets[n] if offsets is not None else data)
    if pieces:
        dst[at:] = np.concatenate(pieces)
