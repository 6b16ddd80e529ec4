"""Summaries of a dmi store: what ``dmi inspect`` (and ``dmi capture``) print, reusable from Python.

    from dmi.store.inspect import summarize, format_summary
    info = summarize("out.zarr")        # a plain, JSON-serializable dict
    print(format_summary(info))

Reads the store with ``zarr`` directly (no xarray, no consolidated metadata needed), so it also
works on a store whose run is still open, failed, or was killed: a store still marked ``open``
is read from each array's own metadata and cut to its last committed step (``dmi_committed``).
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreError


COORD_NAMES = ("request", "position", "step", "phase", "token_id", "layer", "head")
MAX_IDS = 5


def _open_root(path: str | Path, storage_options: dict | None = None):
    import zarr

    from .. import zdtype
    from .location import Local, open_location
    zdtype.register()        # bfloat16 arrays open (zarr-python 3.1 has no bfloat16 of its own)
    loc = open_location(path, storage_options, write=False)
    if isinstance(loc, Local) and not loc.path.exists():
        raise StoreError(f"store {str(path)!r} does not exist. Fix: check the path (dmi capture --out writes one)")
    raw = loc.read("zarr.json")
    if raw is None:
        raise StoreError(f"{str(path)!r} is not a Zarr v3 store (no zarr.json). "
                         f"Fix: pass the directory (or URL) that `dmi capture --out` wrote")
    try:
        meta = json.loads(raw)
        # consolidated metadata is only trusted on a closed store: appends make it stale
        closed = (meta.get("attributes") or {}).get("dmi_status") in ("closed", "failed")
        root = zarr.open_group(loc.zarr(), mode="r", use_consolidated=closed and bool(meta.get("consolidated_metadata")))
    except Exception as e:   # noqa: BLE001 - any failure to open means "not a readable store"
        raise StoreError(f"{str(path)!r} cannot be opened as a Zarr group: {e}. "
                         f"Fix: pass the directory that `dmi capture --out` wrote") from None
    attrs = dict(root.attrs)
    if "dmi_format" not in attrs:
        raise StoreError(f"{str(path)!r} is a Zarr store but not a dmi store (no dmi_format attribute). "
                         f"Fix: pass a store written by dmi (dmi capture / dmi.load)")
    return root, attrs


def _stored_bytes(arr) -> int:
    try:
        return int(arr.nbytes_stored())
    except Exception:   # noqa: BLE001 - stores that cannot list sizes
        return 0


def _ordered_unique(values: np.ndarray) -> list[str]:
    """Unique values in order of first appearance."""
    if values.size == 0:
        return []
    try:
        uniq, first = np.unique(values, return_index=True)
    except TypeError:   # dtypes np.unique cannot sort
        return [str(v) for v in dict.fromkeys(values.tolist())]
    return [str(u) for u in uniq[np.argsort(first, kind="stable")]]


def layers_text(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    if not layers:
        return "-"
    out, start, prev = [], layers[0], layers[0]
    for v in layers[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)


def summarize(path: str | Path, storage_options: dict | None = None) -> dict[str, Any]:
    """A JSON-serializable summary of the dmi store at ``path`` (a directory, or an object store
    URL opened with ``storage_options``).

    Raises :class:`dmi.StoreError` if the path does not exist or is not a dmi store.
    """
    root, attrs = _open_root(path, storage_options)
    status = attrs.get("dmi_status", "unknown")
    committed = attrs.get("dmi_committed") or {}
    cut = committed.get("rows", {}) if status == "open" else {}    # rows past the last commit are not the store's
    sites: list[dict] = []
    request_parts: list[np.ndarray] = []
    total_bytes = total_logical = 0
    drops: dict[str, Any] = {"count": 0, "bytes": 0, "by_reason": {}, "bytes_by_reason": {}}
    groups = [(name, g) for name, g in root.members(max_depth=None) if not hasattr(g, "shape")]
    order = {s: i for i, s in enumerate(attrs.get("sites") or [])}   # plan (model) order

    def model_order(kv):
        first = [order[s] for s in (kv[1].attrs.get("sites") or []) if s in order]
        return (min(first) if first else len(order), kv[0])

    for name, grp in sorted(groups, key=model_order):
        arrays = {k: a for k, a in grp.arrays()}
        if name == "drops":
            for a in arrays.values():
                total_bytes += _stored_bytes(a)
                total_logical += int(a.nbytes)
            n = min(arrays["step"].shape[0], cut.get(name, arrays["step"].shape[0])) if "step" in arrays else 0
            drops["count"] = int(n)
            if n and "bytes" in arrays:
                drops["bytes"] = int(np.asarray(arrays["bytes"][:n]).sum())
            if n and "reason" in arrays:
                reason = np.asarray(arrays["reason"][:n]).astype(object)
                nbytes = np.asarray(arrays["bytes"][:n]) if "bytes" in arrays else np.zeros(n, np.int64)
                for r in _ordered_unique(reason):
                    drops["by_reason"][r] = int((reason == r).sum())
                    drops["bytes_by_reason"][r] = int(nbytes[reason == r].sum())
            continue
        if "request" not in arrays:     # intermediate groups (layers/, layers/attn/) hold no arrays
            continue
        gattrs = dict(grp.attrs)
        data, coords = [], []
        stored = logical = 0
        n = min(arrays["request"].shape[0], cut.get(name, arrays["request"].shape[0]))
        for k, a in sorted(arrays.items()):
            dims = list(a.metadata.dimension_names or ())
            shape = [n if d == "token" else s for d, s in zip(dims, a.shape)] if dims else list(a.shape)
            entry = {"name": k, "dims": dims, "shape": shape, "dtype": str(a.dtype)}
            (coords if k in COORD_NAMES else data).append(entry)
            stored += _stored_bytes(a)
            logical += int(a.nbytes)
        req = np.asarray(arrays["request"][:n])
        request_parts.append(req)
        layers = [int(v) for v in arrays["layer"][:]] if "layer" in arrays else None
        heads = [int(v) for v in arrays["head"][:]] if "head" in arrays else None
        steps = arrays["step"][:n] if "step" in arrays else np.zeros(0)
        sites.append({"group": name, "site": gattrs.get("site", name.split("/")[-1]),
                      "tokens": int(n), "layers": layers, "heads": heads,
                      "token_filter": gattrs.get("tokens"), "reduce": gattrs.get("reduce") or None,
                      "requests": len(_ordered_unique(req)),
                      "steps": [int(steps.min()), int(steps.max())] if steps.size else None,
                      "arrays": data, "coords": coords, "bytes": stored, "logical_bytes": logical})
        total_bytes += stored
        total_logical += logical
    ids = _ordered_unique(np.concatenate(request_parts)) if request_parts else []
    model = attrs.get("model") or {}
    last = committed.get("step")
    return {
        "store": str(path),
        "status": status,
        "committed_step": last,
        "writer_alive": writer_alive(attrs.get("dmi_writer")) if status == "open" else None,
        "writer": attrs.get("dmi_writer"),
        "error": attrs.get("error"),
        "store_error": attrs.get("store_error"),
        "capture_stopped": attrs.get("capture_stopped"),
        "resumed": attrs.get("resumed") or [],
        "writer_failover": attrs.get("writer_failover"),
        "format": attrs.get("dmi_format"),
        "model": model.get("name_or_path"),
        "model_class": model.get("class"),
        "model_type": model.get("model_type"),
        "model_dtype": str(model.get("dtype", "")).removeprefix("torch.") or None,
        "family": attrs.get("family"),
        "hook_spec_file": attrs.get("hook_spec_file"),
        "policy_mode": (attrs.get("policy") or {}).get("mode"),
        "steps": attrs.get("steps") if status != "open" or last is None else last + 1,
        "requests": {"count": len(ids), "first": ids[:MAX_IDS]},
        "sites": sites,
        "total_bytes": total_bytes,
        "total_logical_bytes": total_logical,
        "bytes_captured": attrs.get("bytes_captured"),
        "drops": drops | {"dropped_captures_attr": attrs.get("dropped_captures"),
                          "dropped_bytes_attr": attrs.get("dropped_bytes")},
        "stall_seconds": attrs.get("stall_seconds"),
        "stall_bandwidth_seconds": attrs.get("stall_bandwidth_seconds"),
        "streamed_steps": attrs.get("streamed_steps"),
        "stream_parts": attrs.get("stream_parts"),
        "stream_buffer_bytes": attrs.get("stream_buffer_bytes"),
        "sized_automatically": attrs.get("sized_automatically") or {},
        "versions": attrs.get("versions", {}),
        "vllm": attrs.get("vllm"),
        "sites_unavailable": attrs.get("sites_unavailable") or {},
        "sites_never_computed": attrs.get("sites_never_computed") or [],
    }


def _auto_value(key: str, value) -> str:
    return human_bytes(value) if key.endswith("_bytes") and isinstance(value, int) else str(value)


def writer_alive(writer: dict | None) -> bool | None:
    """Whether the process that opened a store (root attribute ``dmi_writer``) still runs; None
    when it ran on another host (unknown)."""
    if not writer or not writer.get("pid"):
        return False
    if writer.get("host") != socket.gethostname():
        return None
    if int(writer["pid"]) == os.getpid():
        return True
    try:
        os.kill(int(writer["pid"]), 0)
    except ProcessLookupError:
        return False
    except OSError:              # exists, owned by someone else
        pass
    try:   # a zombie has exited: an orphaned store writer process waits as one where nothing reaps it
        return Path(f"/proc/{int(writer['pid'])}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def status_text(info: dict) -> str:
    """'closed', 'failed', or for an open store whether its writer still runs and its last committed step."""
    status = info["status"]
    if status != "open":
        return status
    last = info.get("committed_step")
    upto = f"last committed step {last}" if last is not None and last >= 0 else "no step committed yet"
    if info.get("writer_alive"):
        return f"open: being written by pid {info['writer']['pid']} ({upto})"
    return f"open: did not close cleanly ({upto})" + ("" if info.get("writer_alive") is False else
                                                      " unless its writer on another host still runs")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _shape(entry: dict) -> str:
    return "(" + ", ".join(f"{d}={s}" for d, s in zip(entry["dims"], entry["shape"])) + ")"


def format_summary(info: dict) -> str:
    """The human-readable text of :func:`summarize`'s dict."""
    req = info["requests"]
    ids = ", ".join(req["first"]) + (", ..." if req["count"] > len(req["first"]) else "")
    model = info["model"] or "?"
    extra = ", ".join(x for x in (info.get("model_class"), info.get("model_dtype")) if x)
    drops = info["drops"]
    stall = info.get("stall_seconds")
    by_reason = drops.get("bytes_by_reason", {})
    lines = [
        f"store     {info['store']}",
        f"model     {model}" + (f" ({extra})" if extra else ""),
        f"family    {info['family']}",
        f"status    {status_text(info)}" + (f"   policy {info['policy_mode']}" if info.get("policy_mode") else ""),
    ]
    for key in ("error", "store_error"):
        if info.get(key):
            lines.append(f"error     {info[key]}")
    stopped = info.get("capture_stopped")
    if stopped:
        lines.append(f"stopped   capture stopped at engine step {stopped.get('step')} (last committed step "
                     f"{stopped.get('committed_step')}) and the engine served on without it: the store failed "
                     f"(policy.on_store_error: drop)")
    if info.get("resumed"):
        lines.append("resumed   at step " + ", ".join(str(r.get("at_step")) for r in info["resumed"]))
    if info.get("writer_failover"):
        f = info["writer_failover"]
        lines.append(f"failover  the writer process exited (code {f.get('exit_code')}) after committing step "
                     f"{f.get('committed_step')}; the capturing process resumed the store; {f.get('captures_lost')} "
                     f"captures of {f.get('steps_lost')} uncommitted steps are drops (reason writer)")
    lines += [
        f"steps     {info['steps'] if info['steps'] is not None else '-'}",
        f"requests  {req['count']}" + (f": {ids}" if ids else ""),
        f"bytes     {human_bytes(info['total_bytes'])} stored "
        f"({human_bytes(info['total_logical_bytes'])} uncompressed)",
        f"drops     {drops['count']} captures, {human_bytes(drops['bytes'])}"
        + (" (" + ", ".join(f"{r}: {c}, {human_bytes(by_reason.get(r))}" for r, c in drops["by_reason"].items())
           + ")" if drops["by_reason"] else ""),
        _stall_line(stall, info.get("stall_bandwidth_seconds")),
        *([f"streamed  {info['streamed_steps']} step(s) larger than the ring went through it in "
           f"{info['stream_parts']} parts, held in {human_bytes(info.get('stream_buffer_bytes') or 0)} of host "
           f"buffers sized automatically to the largest"] if info.get("streamed_steps") else []),
        *[f"auto      {key} {_auto_value(key, a.get('value'))}: {a.get('why')}"
          for key, a in (info.get("sized_automatically") or {}).items()],
        f"sites     {len(info['sites'])} groups",
    ]
    for site, why in info.get("sites_unavailable", {}).items():     # matched by the hook spec, never computed here
        lines.append(f"  not captured: {site}: {why}")
    never = info.get("sites_never_computed") or []
    if never:
        lines.append(f"  no row computed: {', '.join(never)} (their module never ran, or the engine computed none "
                     f"of the rows they selected)")
    if info["sites"]:
        w = max(len(s["group"]) for s in info["sites"])
        lines.append(f"  {'group':<{w}}  {'tokens':>7}  {'layers':<8}  {'bytes':>10}  arrays")
        for s in info["sites"]:
            layers = layers_text(s["layers"]) if s["layers"] is not None else "-"
            arrays = "; ".join(f"{a['name']} {_shape(a)} {a['dtype']}" for a in s["arrays"])
            lines.append(f"  {s['group']:<{w}}  {s['tokens']:>7}  {layers:<8}  {human_bytes(s['bytes']):>10}  {arrays}")
    if info.get("vllm"):
        lines.append(vllm_line(info["vllm"]))
    if any(a["dtype"] == "bfloat16" for s in info["sites"] for a in s["arrays"]):
        lines.append("readers   bfloat16 arrays: dmi.open reads them (as float32); plain zarr-python or xarray after `import dmi`")
    return "\n".join(lines)


def vllm_line(v: dict) -> str:
    """What the vLLM engine's scheduling did to capture, and dmi's host time per engine step."""
    text = (f"vllm      {v.get('padded_steps', 0)} graph-padded steps ({v.get('padding_rows_skipped', 0)} padding rows "
            f"never copied), {v.get('recomputed_rows_skipped', 0)} recomputed rows skipped, "
            f"{v.get('steps_repeated', 0)} of {v.get('steps', 0)} steps repeating the last")
    host = v.get("host_us_per_step") or {}
    wall, cpu = host.get("wall") or {}, host.get("cpu") or {}
    if wall:
        text += "; dmi host µs/step " + ", ".join(f"{k} {wall[k]:g} ({cpu.get(k, 0):g} CPU)" for k in wall)
    kinds = v.get("begin_us_by_step_kind")
    if kinds:
        text += f"; begin µs: repeated steps {kinds['repeat']:g}, others {kinds['other']:g}"
    eager = {k: e for k, e in (v.get("eager_captures") or {}).items() if e.get("count")}
    if eager:
        text += "; captures outside graphs: " + ", ".join(f"{k} {e['count']} x {e['us']:g} µs" for k, e in eager.items())
    threads = v.get("thread_cpu_s")
    if threads:
        text += "; " + ", ".join(f"{k} thread {t:g} s CPU" for k, t in threads.items())
    if v.get("drain_windows"):
        text += f"; {v['drain_windows']} drain windows (decode steps)"
    return text


def _stall_line(stall, bandwidth) -> str:
    """Time steps were held back (policy full), and how much of it the bandwidth cap caused."""
    if not isinstance(stall, (int, float)):
        return "stall     -"
    if isinstance(bandwidth, (int, float)) and bandwidth > 0:
        return f"stall     {stall:.6f} s ({bandwidth:.6f} s waiting for the D2H bandwidth cap, the rest for ring space)"
    return f"stall     {stall:.6f} s"
