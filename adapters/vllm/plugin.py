"""vLLM plugin entry point (``vllm.general_plugins``: ``dmi = dmi.adapters.vllm.plugin:register``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers). It only
installs two wrappers; nothing is captured unless the engine's configuration enables dmi:

* ``vllm serve MODEL --additional-config '{"dmi": {"hook_spec": "hooks.yaml", "store": "out.zarr"}}'``
* or ``DMI_HOOK_SPEC=hooks.yaml [DMI_STORE=out.zarr] vllm serve MODEL``

``additional_config.dmi`` keys: ``hook_spec`` (path, or the spec as an object), ``store`` (else the
hook spec's ``store.path``), ``overwrite`` (bool), ``arch_spec`` (path; else found by model type),
``serving`` (default true; ``dmi.load`` passes false): a serving engine outlives its store, so unless
the hook spec sets ``policy.on_store_error``, a failed store stops capture and the engine serves on.
Environment: ``DMI_HOOK_SPEC``, ``DMI_STORE``, ``DMI_OVERWRITE=1``, ``DMI_ARCH_SPEC``.

In the API server process the plugin also puts the store's state on vLLM's ``/metrics``
(:mod:`dmi.adapters.vllm.metrics`).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("dmi.vllm")
_registered = False


def read_config(vllm_config) -> dict | None:
    """The dmi section of an engine's config (additional_config, then the environment), or None."""
    extra = getattr(vllm_config, "additional_config", None)
    cfg = dict(extra.get("dmi") or {}) if isinstance(extra, dict) and extra.get("dmi") else {}
    if not cfg.get("hook_spec") and os.environ.get("DMI_HOOK_SPEC"):
        cfg["hook_spec"] = os.environ["DMI_HOOK_SPEC"]
    if not cfg.get("hook_spec"):
        return None
    cfg.setdefault("store", os.environ.get("DMI_STORE"))
    cfg.setdefault("overwrite", os.environ.get("DMI_OVERWRITE", "") in ("1", "true", "yes"))
    cfg.setdefault("arch_spec", os.environ.get("DMI_ARCH_SPEC"))
    cfg.setdefault("token", "default")
    cfg.setdefault("serving", True)
    return cfg


def register() -> None:
    """Install dmi's load-time hook (workers) and request check (API server). Idempotent."""
    global _registered
    if _registered:
        return
    _registered = True
    from . import compat
    from .worker import close_session, prepare, start
    compat.wrap_worker_load_model(start, rpc={"dmi_close_session": lambda worker, token=None: close_session(token)},
                                  before=prepare)
    compat.wrap_request_validation(_validator)
    compat.grace_engine_shutdown(lambda config: read_config(config) is not None,
                                 float(os.environ.get("DMI_SHUTDOWN_GRACE_S", "30")))
    if os.environ.get("DMI_HOOK_SPEC"):
        compat.prefer_v1_runner()


def _validator(vllm_config):
    """The front end's part (built where vLLM builds its request validation): dmi's request check,
    and on a server the store's state on /metrics."""
    from .metrics import expose
    from .policy import make_validator
    cfg = read_config(vllm_config)
    if cfg is not None and cfg.get("serving"):
        expose(cfg)
    return make_validator(vllm_config)
