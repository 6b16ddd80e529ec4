"""dmi: declarative, low-overhead observation of LLM internals while they serve.

    import dmi
    with dmi.load("tiny-qwen3", hook_spec="hooks.yaml", store="out.zarr") as run:
        run.model.generate(**inputs)
    tree = dmi.open("out.zarr")       # xarray.DataTree with named dims and coordinates
"""
from __future__ import annotations

from pathlib import Path as _Path

# In a checkout, specs/, schemas/, kernels/ and adapters/ sit beside this package (pyproject.toml
# installs them as dmi.specs, dmi.schemas, ...). Imported from a checkout that was not installed
# (a script that puts it on sys.path, `python -m pytest` from its root), find them there.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "specs").is_dir() and (_checkout / "specs" / "__init__.py").is_file():
    __path__.append(str(_checkout))

from .errors import AnchorError, CaptureError, DmiError, PolicyError, SpecError, StoreError


def __getattr__(name: str):
    # load/open pull in torch and transformers: import them on first use, so the CLI's
    # `specs` and `inspect` commands start fast
    if name in ("load", "open"):
        from . import api
        return {"load": api.load, "open": api.open_store}[name]
    if name == "plot":       # matplotlib only when pictures are asked for
        import importlib
        return importlib.import_module(".plot", __name__)
    raise AttributeError(f"module 'dmi' has no attribute {name!r}")

__version__ = "0.1.0"
__all__ = ["load", "open", "DmiError", "SpecError", "AnchorError", "PolicyError", "StoreError", "CaptureError",
           "__version__"]
