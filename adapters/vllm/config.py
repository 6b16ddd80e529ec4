"""The vLLM plugin's inputs, declared in one place.

``vllm serve`` starts dmi from the engine's configuration (``--additional-config '{"dmi": {...}}'``)
or from these environment variables (the plugin runs in processes vLLM starts, where no Python
argument reaches it). Everything else is a hook-spec key (docs/settings.md).

``additional_config.dmi`` keys: ``hook_spec`` (path, or the spec as an object), ``store`` (else the
hook spec's ``store.path``), ``overwrite`` (bool), ``arch_spec`` (path; else found by model type),
``serving`` (default true; ``dmi.load`` passes false): a serving engine outlives its store, so unless
the hook spec sets ``policy.on_store_error``, a failed store stops capture and the engine serves on.
"""
from __future__ import annotations

from ... import settings


def env(name: str) -> str | None:
    """A declared input's value (:mod:`dmi.settings`)."""
    return settings.get(name)


def read_config(vllm_config) -> dict | None:
    """The dmi section of an engine's config (additional_config, then the environment), or None."""
    extra = getattr(vllm_config, "additional_config", None)
    cfg = dict(extra.get("dmi") or {}) if isinstance(extra, dict) and extra.get("dmi") else {}
    if not cfg.get("hook_spec") and env("DMI_HOOK_SPEC"):
        cfg["hook_spec"] = env("DMI_HOOK_SPEC")
    if not cfg.get("hook_spec"):
        return None
    cfg.setdefault("store", env("DMI_STORE"))
    cfg.setdefault("overwrite", env("DMI_OVERWRITE") in ("1", "true", "yes"))
    cfg.setdefault("arch_spec", env("DMI_ARCH_SPEC"))
    cfg.setdefault("token", "default")
    cfg.setdefault("serving", True)
    return cfg


def shutdown_grace_s() -> float:
    return float(env("DMI_SHUTDOWN_GRACE_S"))
