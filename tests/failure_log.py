"""Each failing test's report written to a file the moment it fails (``DMI_TEST_FAILURES=path``).

A run killed by its time limit (``timeout``) never reaches the end of pytest's session, where
pytest prints its failures: a test that failed before the limit would leave no traceback.
scripts/gpu.sh and scripts/gpu_vllm.sh set the variable per step and print the file after it.
Loaded by tests/conftest.py; ``python -m pytest -p failure_log`` (tests/ on the path) elsewhere.
"""
from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("DMI_TEST_FAILURES")
    if not path or not report.failed or hasattr(report, "node"):
        return          # (pytest-xdist: the worker wrote it; ``node``: the controller's copy of its report)
    with open(path, "a") as f:     # appended and closed per failure: a kill right after loses nothing
        f.write(f"== FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")
