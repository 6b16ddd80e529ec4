"""The Hugging Face Transformers engine as the pipeline sees it (:class:`dmi.pipeline.EngineAdapter`)."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ...errors import DmiError
from . import attach, available_sites, transformers_version


class HFEngine:
    """dmi's adapter for transformers models (:mod:`dmi.adapters.hf`)."""

    name = "hf"

    @staticmethod
    def resolve_model(model: Any, dtype=None, device=None, **hf_kwargs):
        """A transformers causal-LM from a model object, a config, a built-in name or a path/hub id."""
        import torch
        import transformers as tf
        from ...models import BUILTIN, build_tiny_model, model_arg_problem
        if isinstance(model, torch.nn.Module):
            out = model
        elif isinstance(model, tf.PretrainedConfig):
            out = tf.AutoModelForCausalLM.from_config(model, dtype=dtype or torch.float32, **hf_kwargs)
        elif isinstance(model, str) and model in BUILTIN:
            out = build_tiny_model(model, dtype=dtype, **hf_kwargs)
        elif isinstance(model, (str, Path)) and (problem := model_arg_problem(model)) is not None:
            raise DmiError(f"dmi.load: model: {problem[0]}. Fix: {problem[1]}")
        elif isinstance(model, (str, Path)):
            try:
                out = tf.AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype or "auto", **hf_kwargs)
            except (OSError, ValueError) as e:
                from ...models import load_failure
                raise DmiError(f"dmi.load: model: cannot load {str(model)!r} with from_pretrained: "
                               f"{load_failure(model, e)}. Fix: pass a "
                               f"local model directory or a hub id that is reachable (or a built-in: {sorted(BUILTIN)})"
                               ) from e
        else:
            raise DmiError(f"dmi.load: model: cannot load a model from a {type(model).__name__}. Fix: pass a transformers "
                           f"model, a PretrainedConfig, a built-in name ({sorted(BUILTIN)}), or a path / hub id")
        if device is not None:
            out = out.to(device)
        if not hasattr(out, "config") or not hasattr(out, "get_submodule"):
            raise DmiError(f"dmi.load: model: {type(out).__name__} is not a transformers model. Fix: pass an "
                           f"AutoModelForCausalLM model (or a built-in name, a config, a path or hub id)")
        return out.eval()

    @staticmethod
    def check_version(arch) -> None:
        rng = arch.data.get("hf", {}).get("transformers")
        if not rng:
            return
        from packaging.specifiers import SpecifierSet
        if transformers_version() not in SpecifierSet(rng):
            warnings.warn(f"{arch.file}: written for transformers {rng}, installed {transformers_version()}; "
                          f"anchors are checked at load and a missing one is an error", stacklevel=4)

    @staticmethod
    def available_sites(model, arch, config) -> tuple[set, dict]:
        return available_sites(model, arch), {}

    @staticmethod
    def write_anchor(arch, canonical, layer, n_layers):
        return arch.data["sites"][canonical].get("hf")

    @staticmethod
    def attach(model, plan, arch, run):
        return attach(model, plan, arch, run)
