"""Run code right after a module's first import, without importing it (a meta path finder)."""
from __future__ import annotations

import sys
from typing import Callable


def when_imported(module: str, fn: Callable) -> None:
    """Call ``fn(module)`` now if ``module`` is imported, else right after its first import."""
    if module in sys.modules:
        fn(sys.modules[module])
        return
    import importlib.abc
    import importlib.util

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != module:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(mod):
                run(mod)
                fn(mod)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())
