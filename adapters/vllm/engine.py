"""The vLLM engine as the pipeline sees it (:class:`dmi.pipeline.EngineAdapter`)."""
from __future__ import annotations

import logging

from ...errors import DmiError
from . import compat
from .patch import attach, available_sites, layer_anchor

log = logging.getLogger("dmi.vllm")


class VllmEngine:
    """dmi's adapter for a vLLM worker's model (:mod:`dmi.adapters.vllm`)."""

    name = "vllm"

    @staticmethod
    def resolve_model(worker):
        """(vllm_config, model runner, model) of the worker whose ``load_model`` just ran."""
        return compat.worker_parts(worker)

    @staticmethod
    def check_version(arch) -> None:
        warning = compat.check_version()
        if warning:
            log.warning(warning)
        if "vllm" not in arch.data:
            raise DmiError(f"{arch.file}: this architecture spec has no vllm anchors (no top-level `vllm:` section). "
                           f"Fix: add them (docs/vllm.md), or capture with backend='hf'")

    @staticmethod
    def available_sites(model, arch, config) -> tuple[set, dict]:
        return available_sites(model, arch, config.num_hidden_layers)

    @staticmethod
    def write_anchor(arch, canonical, layer, n_layers):
        anchor = arch.data["sites"][canonical].get("vllm")
        return None if anchor is None else dict(layer_anchor(anchor, layer, n_layers), layout=["token"])

    @staticmethod
    def attach(model, plan, arch, run):
        return attach(model, plan, arch, run)
