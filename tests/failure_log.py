"""Each failing test's report written to a file the moment it fails (``DMI_TEST_FAILURES=path``).

A device call is killed by its time limit (``timeout``), and pytest prints its failures only at
the end of the session: a test that failed before the limit was reached left no traceback
(thirty-eighth GPU session: a MoE test failed, the next one was cut, the log held one "F").
perf/gpu_session.sh and perf/gpu_vllm.sh set the variable per step and print the file after it.
Loaded by tests/conftest.py; ``python -m pytest -p failure_log`` (tests/ on the path) elsewhere.
"""
from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("DMI_TEST_FAILURES")
    if not path or not report.failed:
        return
    with open(path, "a") as f:     # appended and closed per failure: a kill right after loses nothing
        f.write(f"== FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")
