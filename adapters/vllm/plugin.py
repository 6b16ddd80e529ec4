"""vLLM plugin entry point (``vllm.general_plugins``: ``dmi = dmi.adapters.vllm.plugin:register``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers). It only
installs two wrappers; nothing is captured unless the engine's configuration enables dmi:

* ``vllm serve MODEL --additional-config '{"dmi": {"hook_spec": "hooks.yaml", "store": "out.zarr"}}'``
* or ``DMI_HOOK_SPEC=hooks.yaml [DMI_STORE=out.zarr] vllm serve MODEL``

Its inputs (``additional_config.dmi`` keys, environment variables) are declared in
:mod:`dmi.adapters.vllm.config`.

In the API server process the plugin also puts the store's state on vLLM's ``/metrics``
(:mod:`dmi.adapters.vllm.metrics`).
"""
from __future__ import annotations

import logging

from .config import env, read_config, shutdown_grace_s


log = logging.getLogger("dmi.vllm")
_registered = False


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
    compat.grace_engine_shutdown(lambda config: read_config(config) is not None, shutdown_grace_s())
    if env("DMI_HOOK_SPEC"):
        compat.prefer_v1_runner()


def _validator(vllm_config):
    """The front end's part (built where vLLM builds its request validation): dmi's request check,
    and on a server the store's state on /metrics."""
    from .metrics import expose
    from .validate import make_validator
    cfg = read_config(vllm_config)
    if cfg is not None and cfg.get("serving"):
        expose(cfg)
    return make_validator(vllm_config)
