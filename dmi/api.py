"""``dmi.load`` and ``dmi.open``."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from .errors import DmiError, SpecError
from .plan import build_plan
from .run import Run
from .spec import find_arch_spec, load_arch_spec, load_hook_spec


def _resolve_model(model: Any, dtype=None, device=None, **hf_kwargs):
    """A transformers causal-LM from a model object, a config, a built-in name or a path/hub id."""
    import torch
    import transformers as tf
    from .models import BUILTIN, build_tiny_model
    if isinstance(model, torch.nn.Module):
        out = model
    elif isinstance(model, tf.PretrainedConfig):
        out = tf.AutoModelForCausalLM.from_config(model, dtype=dtype or torch.float32, **hf_kwargs)
    elif isinstance(model, str) and model in BUILTIN:
        out = build_tiny_model(model, dtype=dtype, **hf_kwargs)
    elif isinstance(model, (str, Path)):
        out = tf.AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype or "auto", **hf_kwargs)
    else:
        raise DmiError(f"dmi.load cannot load a model from {type(model).__name__}. Fix: pass a transformers model, "
                       f"a PretrainedConfig, a built-in name ({sorted(BUILTIN)}), or a path / hub id")
    if device is not None:
        out = out.to(device)
    if not hasattr(out, "config") or not hasattr(out, "get_submodule"):
        raise DmiError(f"{type(out).__name__} is not a transformers model. Fix: pass an AutoModelForCausalLM model")
    return out.eval()


def load(model: Any, hook_spec: str | Path | dict, store: str | Path | None = None, *, backend: str = "hf",
         arch_spec: str | Path | dict | None = None, overwrite: bool = False, dtype=None, device=None,
         **engine_kwargs) -> Run:
    """Load (or take) a model, patch the hook spec's sites into it and start capturing into ``store``.

    model: a transformers model, a ``PretrainedConfig``, a built-in tiny model name (``tiny-qwen3``,
    ``tiny-llama3_1``, ``tiny-qwen3_moe``, ``tiny-mixtral``) or a path / hub id for ``from_pretrained``.
    """
    if backend != "hf":
        raise DmiError(f"backend {backend!r} is not available yet. Fix: use backend='hf'")
    from .adapters import hf
    hook = load_hook_spec(hook_spec)
    store = store if store is not None else hook.data.get("store", {}).get("path")
    if store is None:
        raise SpecError("no store given", file=hook.file, key="store.path",
                        fix="pass store='out.zarr' to dmi.load, or set store.path in the hook spec")
    m = _resolve_model(model, dtype=dtype, device=device, **engine_kwargs)
    arch = load_arch_spec(arch_spec) if arch_spec is not None else find_arch_spec(m.config.model_type)
    _check_version(arch)
    plan = build_plan(arch, hook, m.config, available=hf.available_sites(m, arch))
    run = Run(m, plan, str(store), overwrite=overwrite)
    try:
        run._detach = hf.attach(m, plan, arch, run)
    except BaseException:
        run.close()
        raise
    return run


def _check_version(arch) -> None:
    rng = arch.data.get("hf", {}).get("transformers")
    if not rng:
        return
    from packaging.specifiers import SpecifierSet
    from .adapters.hf import transformers_version
    if transformers_version() not in SpecifierSet(rng):
        warnings.warn(f"{arch.file}: written for transformers {rng}, installed {transformers_version()}; "
                      f"anchors are checked at load and a missing one is an error", stacklevel=3)


def open_store(path: str | Path):
    """The store as an ``xarray.DataTree`` (named dims; request/position/step/phase coordinates)."""
    import xarray as xr
    from .errors import StoreError
    if not Path(path).exists():
        raise StoreError(f"store {str(path)!r} does not exist. Fix: check the path (dmi capture --out writes one)")
    return xr.open_datatree(str(path), engine="zarr", consolidated=True)
