"""perf/ scripts on the CPU (they are GPU benchmarks; this keeps them runnable where no GPU is):
perf/budget.py's round-robin with the inline run's rows, perf/interventions.py's table,
perf/diagnostics/guardcost.py's table (its guard lines compared: constant sites guard fewer than
handles), each on a real patched model."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script(tmp_path, name: str, *args: str) -> str:
    """stdout of ``perf/<name> args`` run in ``tmp_path`` (its files in $OUT there); it must succeed."""
    out = subprocess.run([sys.executable, str(ROOT / "perf" / name), *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OUT": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _table(stdout: str) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in stdout.splitlines() if line.startswith("| ")]
    return {r[0]: r[1:] for r in rows if not set(r[0]) <= set("-: ")}


def test_budget_rounds_rotate_both_runs_and_report_each_row(tmp_path):
    got = _table(_script(tmp_path, "budget.py", "--model", "tiny", "--batch", "2", "--new", "8", "--rounds", "2",
                         "--caps", "0.5", "--mode", "eager", "--inline"))
    base = ["null (uncapped)", "full (uncapped)", "best_effort (0.50 x rate)"]
    assert list(got) == ["policy", "vanilla twin (A/A)", *base, "full (0.50 x rate)", *(b + ", inline" for b in base)], got
    for label, cells in got.items():
        if label not in ("policy", "vanilla twin (A/A)"):
            low, median, high = map(float, cells[1].split(" / "))
            assert 0 < low <= median <= high and float(cells[2].strip("*")) > 0, (label, cells)


def test_guardcost_reports_every_model_and_the_guards(tmp_path):
    out = _script(tmp_path, "diagnostics/guardcost.py", "--layers", "2", "--batch", "2", "--new", "4", "--repeats", "1",
                  "--backend", "eager")      # (guards are Dynamo's, whatever compiles the graph)
    got = _table(out)
    assert list(got) == ["model", "vanilla", "A/A twin", "dmi null", "dmi capturing", "dmi null, handles"], out
    assert all(int(cells[0]) > 0 and float(cells[1]) > 0 for label, cells in got.items() if label != "model"), got
    checked = {label: (float(cells[3]), int(cells[5])) for label, cells in got.items()
               if label not in ("model", "dmi capturing")}
    assert all(us > 0 for us, _ in checked.values()), checked
    # guard lines: the twins share vanilla's tree; constant sites guard fewer than the handles
    lines = {label: n for label, (_, n) in checked.items()}
    assert lines["vanilla"] == lines["A/A twin"] < lines["dmi null"] < lines["dmi null, handles"], lines
    assert re.search(r"^dmi cache entry 0: \d+ guard lines", out, re.M), out


def test_interventions_reports_each_config_and_the_null_cost(tmp_path):
    stdout = _script(tmp_path, "interventions.py", "--model", "tiny", "--batch", "2", "--new-tokens", "3",
                     "--mode", "eager", "--rounds", "1")
    got = _table(stdout)
    assert list(got) == ["config", "vanilla", "capture", "disabled", "enabled"], got
    assert all(float(cells[0]) > 0 for label, cells in got.items() if label != "config"), got
    assert re.search(r"null cost of the disabled interventions: [+-][0-9.]+% of vanilla", stdout), stdout
