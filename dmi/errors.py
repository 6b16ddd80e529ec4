"""Errors dmi raises. Every one names where the problem is and how to fix it."""
from __future__ import annotations


class DmiError(Exception):
    """Base class of every error dmi raises on purpose."""


def located(problem: str, file: str | None = None, key: str | None = None, line: int | None = None,
            fix: str | None = None, *, default_file: str | None = None) -> str:
    """``<file>:<line>: <key>: <problem>. Fix: <fix>`` (parts that are unknown are left out)."""
    where = file or default_file
    if where and line is not None:
        where += f":{line}"
    text = ": ".join(x for x in (where, key, problem) if x)
    if fix:
        text += f". Fix: {fix}"
    return text


class SpecError(DmiError, ValueError):
    """A spec file (architecture or hook spec) is invalid.

    The message reads ``<file>:<line>: <key>: <problem>. Fix: <fix>`` so editors can jump to it.
    """

    def __init__(self, problem: str, *, file: str | None = None, key: str | None = None,
                 line: int | None = None, fix: str | None = None):
        self.problem, self.file, self.key, self.line, self.fix = problem, file, key, line, fix
        super().__init__(located(problem, file, key, line, fix, default_file="<spec>"))


class AnchorError(DmiError):
    """An architecture spec's anchor is not found in the installed engine's source."""


class PolicyError(DmiError, ValueError):
    """A policy cannot be met (the plan does not fit the budgets).

    Raised at load it names the hook spec like :class:`SpecError` (``<file>:<line>: policy.<key>: ...``);
    raised while capturing it may carry the whole message as ``problem``.
    """

    def __init__(self, problem: str, *, file: str | None = None, key: str | None = None,
                 line: int | None = None, fix: str | None = None):
        self.problem, self.file, self.key, self.line, self.fix = problem, file, key, line, fix
        super().__init__(located(problem, file, key, line, fix))


class StoreError(DmiError, OSError):
    """The store cannot be written, or a write failed while capturing."""


class CaptureError(DmiError, RuntimeError):
    """Capture failed at run time (a drain or exporter thread died, a step did not fit)."""
