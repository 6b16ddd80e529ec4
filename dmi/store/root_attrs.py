"""The root group's ``zarr.json`` while a store is written: its attributes change (the commit marker
every second, a writer's failover, the closing summary) and each change rewrites the whole document.
"""
from __future__ import annotations

import json
import threading


class RootAttrs:
    """The root group's metadata document, kept encoded per attribute: an update encodes only the
    attributes it changes. Zarr re-encodes every attribute, pretty-printed by Python's pure-Python
    encoder, at each update; a hook spec's steering vectors (Qwen3-8B: 36 x 4096 floats) made that
    about 0.1 s a commit on the thread that drives the model."""

    def __init__(self, loc, doc: dict | None = None):
        """``doc``: the document as last read (else it is read from ``loc``)."""
        self.loc = loc
        doc = dict(doc) if doc is not None else json.loads(loc.read("zarr.json"))
        self._attrs = {k: json.dumps(v) for k, v in (doc.pop("attributes", None) or {}).items()}
        self._rest = "".join(f",{json.dumps(k)}:{json.dumps(v)}" for k, v in doc.items())
        self._lock = threading.Lock()      # the exporter thread's commits, a failover's note, close

    def update(self, attrs: dict) -> None:
        """Set ``attrs`` (JSON values) and write the document atomically."""
        encoded = {k: json.dumps(v) for k, v in attrs.items()}
        with self._lock:
            self._attrs.update(encoded)
            body = ",".join(f"{json.dumps(k)}:{v}" for k, v in self._attrs.items())
            self.loc.write("zarr.json", f'{{"attributes":{{{body}}}{self._rest}}}'.encode())
