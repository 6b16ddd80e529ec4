"""Example inputs for the command line: ``hooks.yaml`` (a hook spec) and ``prompts.jsonl``.

``dmi capture --out out.zarr`` uses both when ``--spec`` / ``--prompts`` are not given.
``python -m dmi.examples.researcher DIR``: a capture into memory on the built-in tiny model, and its
pictures (an attention pattern, residual norms, a logit lens) written to DIR.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def example_path(name: str) -> Path:
    """Path of a packaged example file: ``hooks.yaml`` or ``prompts.jsonl``."""
    return Path(str(resources.files(__name__).joinpath(name)))
