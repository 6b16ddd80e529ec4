"""tests/failure_log.py: a failure's traceback is on disk before pytest's session ends, so a run
killed by its time limit still says what failed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_pytest(test_file: Path, failures: Path, *args: str) -> subprocess.CompletedProcess:
    """A pytest session of ``test_file`` (a file or a directory) alone, with these more ``args``, the
    plugin loaded and ``DMI_TEST_FAILURES=failures``."""
    env = os.environ | {"DMI_TEST_FAILURES": str(failures), "PYTHONPATH": str(TESTS)}
    root = test_file if test_file.is_dir() else test_file.parent
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "failure_log", "-p", "no:cacheprovider",
                           "--rootdir", str(root), *args, str(test_file)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_failure_written_before_the_session_is_killed(tmp_path):
    (tmp_path / "test_cut.py").write_text(textwrap.dedent("""
        import os, signal

        def test_first_fails():
            rows = {"req-1": [0, 1, 2]}
            assert rows["req-1"] == [0, 1], "rows under the wrong positions"

        def test_passes():
            pass

        def test_then_killed():      # a time limit's kill, mid-session
            os.kill(os.getpid(), signal.SIGKILL)
        """))
    failures = tmp_path / "failures.txt"
    proc = run_pytest(tmp_path / "test_cut.py", failures)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert "rows under the wrong positions" not in proc.stdout      # pytest's own report never came
    text = failures.read_text()
    assert text.startswith("== FAILED test_cut.py::test_first_fails (call, ")
    assert "rows under the wrong positions" in text and "assert [0, 1, 2] == [0, 1]" in text
    assert "test_passes" not in text and "test_then_killed" not in text


def test_nothing_written_for_passing_tests(tmp_path):
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    failures = tmp_path / "failures.txt"
    proc = run_pytest(tmp_path / "test_ok.py", failures)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not failures.exists()


def test_each_failure_written_once_under_pytest_xdist(tmp_path):
    """scripts/test.sh's two pytest-xdist workers: each failure is written by the worker that ran
    it, once (not again from the controller's copy of its report)."""
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(f"def test_{name}_fails():\n    assert '{name}' == 'z', 'the {name} rows'\n"
                                                  f"\n\ndef test_{name}_passes():\n    pass\n")
    failures = tmp_path / "failures.txt"
    proc = run_pytest(tmp_path, failures, "-n", "2", "--dist", "loadfile")
    assert proc.returncode == 1 and "2 failed, 2 passed" in proc.stdout, proc.stdout + proc.stderr
    text = failures.read_text()
    heads = sorted(line.split(" (call, ")[0] for line in text.splitlines() if line.startswith("== FAILED"))
    assert heads == ["== FAILED test_a.py::test_a_fails", "== FAILED test_b.py::test_b_fails"], text
    assert "the a rows" in text and "the b rows" in text and "passes" not in text
