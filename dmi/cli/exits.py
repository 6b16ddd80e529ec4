"""Exit codes, the errors that choose them, and the one-line messages the CLI prints on stderr."""
from __future__ import annotations

import sys

PROG = "dmi"
EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DTYPES = ("float32", "bfloat16", "float16")


class UsageError(Exception):
    """Bad input from the command line (exit 2); the message is one line naming the fix."""


class RunFailed(Exception):
    """A failure after the model started running (exit 1); ``__cause__`` is the original error."""


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (the one-line report)."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0].rstrip(".")


def warn(msg: str) -> None:
    print(f"{PROG}: warning: {msg}", file=sys.stderr)


def print_error(msg: str, exc: BaseException | None = None) -> None:
    """``dmi: error: msg`` on stderr, after ``exc``'s traceback when one is given (--traceback)."""
    if exc is not None:
        import traceback
        traceback.print_exception(exc, file=sys.stderr)
    print(f"{PROG}: error: {msg}", file=sys.stderr)
