"""dmi: declarative, low-overhead observation of LLM internals while they serve.

    import dmi
    with dmi.load("tiny-qwen3", hook_spec="hooks.yaml", store="out.zarr") as run:
        run.model.generate(**inputs)
    tree = dmi.open("out.zarr")       # xarray.DataTree with named dims and coordinates
    r0 = dmi.request(tree, "r0")      # one request's rows, in position order (lazy)
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


def _bfloat16_for_zarr() -> None:
    """Register dmi's bfloat16 with zarr (dmi.zdtype) once zarr is imported, so that a plain
    ``zarr.open_group`` / ``xarray.open_datatree(engine="zarr")`` after ``import dmi`` reads bfloat16
    stores (zarr 3.1 never loads the ``zarr.data_type`` entry point). Importing zarr here would
    slow every ``import dmi`` down: the registration waits for zarr's own import instead."""
    from .imports import when_imported

    def register(_zarr) -> None:
        try:
            from . import zdtype  # noqa: F401  (registers on import)
        except ImportError:       # (no ml_dtypes: zarr works on, without bfloat16)
            pass
    when_imported("zarr", register)


_bfloat16_for_zarr()


def __getattr__(name: str):
    # load/open pull in torch and transformers: import them on first use, so the CLI's
    # `specs` and `inspect` commands start fast
    if name == "load":
        from .api import load
        return load
    if name == "open":
        from .store.read import open_store
        return open_store
    if name == "plot":       # matplotlib only when pictures are asked for
        import importlib
        return importlib.import_module(".plot", __name__)
    if name == "request":
        from .select import request
        return request
    if name == "capture_dataset":     # Ray only when a dataset is captured
        from .dataset import capture_dataset
        return capture_dataset
    raise AttributeError(f"module 'dmi' has no attribute {name!r}")

__version__ = "0.1.0"
__all__ = ["load", "open", "request", "capture_dataset", "DmiError", "SpecError", "AnchorError", "PolicyError", "StoreError", "CaptureError",
           "__version__"]
