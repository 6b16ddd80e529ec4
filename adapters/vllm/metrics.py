"""The capture store's state on the server's ``/metrics`` (vLLM's Prometheus endpoint).

The store is written in the engine's process; the API server, which answers ``/metrics``, reads
what the store's root ``zarr.json`` says at each scrape (a small file, replaced atomically), so
no channel between the processes is needed and what the metrics say is what the store records::

    dmi_capture_active{store="..."} 1.0                 # 0 once capture stopped or the store closed
    dmi_capture_info{store="...",status="closed",stopped_at_step="41",reason="...store full..."} 1.0
    dmi_committed_step{store="..."} 40.0

``status`` is the store's ``dmi_status`` (open, closed, failed), ``missing`` before the engine
created it, or ``unreadable``; ``reason``: why capture stopped (root attribute
``capture_stopped``), else the store's error, else empty. With several API server processes
(``--api-server-count`` > 1) vLLM serves only its multiprocess metrics, without these.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("dmi.vllm")
REASON_CHARS = 500          # a label value stays a line, not a traceback
_exposed: set[str] = set()


def store_state(store: str | Path) -> dict:
    """(status, active, reason, stopped_at_step, committed_step) of a store, from its root attributes."""
    path = Path(store)
    try:
        attrs = json.loads((path / "zarr.json").read_bytes()).get("attributes") or {}
    except FileNotFoundError:
        return {"status": "missing", "active": False, "reason": "", "stopped_at_step": None, "committed_step": None}
    except (OSError, ValueError) as e:
        return {"status": "unreadable", "active": False, "reason": f"{type(e).__name__}: {e}"[:REASON_CHARS],
                "stopped_at_step": None, "committed_step": None}
    status = str(attrs.get("dmi_status", "unknown"))
    stopped = attrs.get("capture_stopped") or {}
    reason = stopped.get("reason") or attrs.get("store_error") or ""
    committed = (attrs.get("dmi_committed") or {}).get("step")
    return {"status": status, "active": status == "open" and not stopped, "reason": str(reason)[:REASON_CHARS],
            "stopped_at_step": stopped.get("step"), "committed_step": committed}


class StoreCollector:
    """A Prometheus collector of one store's state (:func:`store_state`)."""

    def __init__(self, store: str):
        self.store = store

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
        s = store_state(self.store)
        active = GaugeMetricFamily("dmi_capture_active", "1 while dmi captures into its store; 0 once capture "
                                   "stopped (see dmi_capture_info's reason) or the store closed", labels=["store"])
        active.add_metric([self.store], 1.0 if s["active"] else 0.0)
        yield active
        info = InfoMetricFamily("dmi_capture", "dmi's capture store: its status and why capture stopped",
                                labels=["store"])
        stopped = "" if s["stopped_at_step"] is None else str(s["stopped_at_step"])
        info.add_metric([self.store], {"status": s["status"], "reason": s["reason"], "stopped_at_step": stopped})
        yield info
        if s["committed_step"] is not None:
            committed = GaugeMetricFamily("dmi_committed_step", "the last engine step the store committed",
                                          labels=["store"])
            committed.add_metric([self.store], float(s["committed_step"]))
            yield committed


def expose(cfg: dict) -> None:
    """Register the store's collector on the default Prometheus registry (vLLM's ``/metrics`` with
    one API server), once per store."""
    store = cfg.get("store")
    if not store:
        from ...spec import load_hook_spec
        try:
            store = (load_hook_spec(cfg["hook_spec"]).data.get("store") or {}).get("path")
        except Exception:     # noqa: BLE001 - the engine refuses the same spec with its own error
            return
    if not store:
        return
    store = str(Path(store).resolve())
    if store in _exposed:
        return
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    _exposed.add(store)
    REGISTRY.register(StoreCollector(store))
    log.info("dmi: /metrics reports the capture store %s (dmi_capture_active, dmi_capture_info)", store)
