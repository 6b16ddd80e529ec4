"""Hook specs with an ``engine`` section: how the capture engine works (ring backend, traced ops,
side streams, ...), for tests that compare its choices (docs/settings.md)."""
from __future__ import annotations

import json
from pathlib import Path


def with_engine(spec: Path | dict, **options) -> Path | dict:
    """``spec`` (a hook spec's file or dict, without an engine section) with ``options`` as its
    engine section: a dict stays a dict; a file gets a sibling named after the options."""
    if isinstance(spec, dict):
        return {**spec, "engine": {**spec.get("engine", {}), **options}}
    spec = Path(spec)
    out = spec.with_name(spec.stem + "".join(f"-{k}-{v}" for k, v in options.items()) + spec.suffix)
    out.write_text(spec.read_text().rstrip("\n") + f"\nengine: {json.dumps(options)}\n")
    return out
