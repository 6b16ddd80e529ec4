"""A capture run: the plan, the ring, the drain and exporter threads, and the patched model.

* ``run``: :class:`Run`, the user's surface (close, flush, stats, subscribe, limits, request ids);
* ``steps``: its engine hooks (what adapters and site ops call step by step);
* ``layouts``: what each step captures (token filters, step layouts, row accounting);
* ``threads``: the drain and export threads;
* ``owner``: which thread drives the steps.
"""
from .run import Run


__all__ = ["Run"]
