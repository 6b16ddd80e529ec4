"""Errors dmi raises. Every one names where the problem is and how to fix it."""
from __future__ import annotations


class DmiError(Exception):
    """Base class of every error dmi raises on purpose."""


class SpecError(DmiError, ValueError):
    """A spec file (architecture or hook spec) is invalid.

    The message reads ``<file>:<line>: <key>: <problem>. Fix: <fix>`` so editors can jump to it.
    """

    def __init__(self, problem: str, *, file: str | None = None, key: str | None = None,
                 line: int | None = None, fix: str | None = None):
        self.problem, self.file, self.key, self.line, self.fix = problem, file, key, line, fix
        where = file or "<spec>"
        if line is not None:
            where += f":{line}"
        text = f"{where}: {key}: {problem}" if key else f"{where}: {problem}"
        if fix:
            text += f". Fix: {fix}"
        super().__init__(text)


class AnchorError(DmiError):
    """An architecture spec's anchor is not found in the installed engine's source."""


class PolicyError(DmiError, ValueError):
    """A policy cannot be met (the plan does not fit the budgets)."""


class StoreError(DmiError, OSError):
    """The store cannot be written, or a write failed while capturing."""


class CaptureError(DmiError, RuntimeError):
    """Capture failed at run time (a drain or exporter thread died, a step did not fit)."""
