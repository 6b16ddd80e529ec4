"""dmi: declarative, low-overhead observation of LLM internals while they serve.

    import dmi
    with dmi.load("tiny-qwen3", hook_spec="hooks.yaml", store="out.zarr") as run:
        run.model.generate(**inputs)
    tree = dmi.open("out.zarr")       # xarray.DataTree with named dims and coordinates
"""
from __future__ import annotations

from .api import load, open_store as open
from .errors import AnchorError, CaptureError, DmiError, PolicyError, SpecError, StoreError

__version__ = "0.1.0"
__all__ = ["load", "open", "DmiError", "SpecError", "AnchorError", "PolicyError", "StoreError", "CaptureError",
           "__version__"]
