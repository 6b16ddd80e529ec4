"""perf/ablate.py on the CPU: every row of the ablation runs on a real patched model and reports a
step time against vanilla's (the script is a GPU benchmark; this keeps it runnable between device
sessions, where a row that broke would cost a device call to find)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = ["vanilla", "dmi null", "dmi no sites (steps only)", "dmi hidden, drain gated", "dmi hidden (full)"]


def test_every_row_runs_and_reports_a_ratio(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "perf" / "ablate.py"), "--model", "tiny", "--batch", "2",
                          "--new", "8", "--repeats", "1", "--mode", "eager"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OUT": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = {}
    for line in out.stdout.splitlines():
        m = re.match(r"(.+?)\s+([\d.]+) ms/step\s+ratio ([\d.]+)", line)
        if m:
            got[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    assert list(got) == ROWS, out.stdout
    assert all(ms > 0 and ratio > 0 for ms, ratio in got.values()), got
    # the full row captured and drained its steps: host time in dmi's step calls, nothing stalled
    full = next(line for line in out.stdout.splitlines() if line.startswith("dmi hidden (full)"))
    assert re.search(r"host \d+ us/step in step begin/end", full) and "stall 0.000s" in full, full
