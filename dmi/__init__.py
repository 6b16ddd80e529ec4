"""dmi: declarative, low-overhead observation of LLM internals while they serve.

    import dmi
    with dmi.load("tiny-qwen3", hook_spec="hooks.yaml", store="out.zarr") as run:
        run.model.generate(**inputs)
    tree = dmi.open("out.zarr")       # xarray.DataTree with named dims and coordinates
"""
from __future__ import annotations

from .errors import AnchorError, CaptureError, DmiError, PolicyError, SpecError, StoreError


def __getattr__(name: str):
    # load/open pull in torch and transformers: import them on first use, so the CLI's
    # `specs` and `inspect` commands start fast
    if name in ("load", "open"):
        from . import api
        return {"load": api.load, "open": api.open_store}[name]
    raise AttributeError(f"module 'dmi' has no attribute {name!r}")

__version__ = "0.1.0"
__all__ = ["load", "open", "DmiError", "SpecError", "AnchorError", "PolicyError", "StoreError", "CaptureError",
           "__version__"]
