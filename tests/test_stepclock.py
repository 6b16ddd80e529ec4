"""perf/stepclock.py: a window's engine steps split into GPU time and the gaps the host left."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))

import stepclock  # noqa: E402


def _steps(n, period, forward, gap, t0=100.0, reqs=8, mixed_every=0, g=0.0):
    """n steps on one GPU timeline from ``g`` ms: prep 0.2 ms, the forward, post 0.3 ms, then ``gap`` idle."""
    rows = []
    for i in range(n):
        mixed = mixed_every and i % mixed_every == 0
        rows.append({"t": t0 + i * period / 1e3, "reqs": reqs, "tokens": reqs + (50 if mixed else 0),
                     "exec": 1.0, "sample": 0.1, "wait": 2.0, "g": [g, g + 0.2, g + 0.2 + forward, g + 0.5 + forward]})
        g += 0.5 + forward + gap
    return rows


def test_parts_add_up_to_the_period_and_name_the_gap(tmp_path):
    rows = _steps(50, period=6.0, forward=5.0, gap=0.5, mixed_every=10)
    path = tmp_path / "stepclock-x.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = stepclock.summarize(stepclock.load(path))
    d = s["decode"]
    assert s["steps"] == 49 and d["steps"] == 49 - 5          # the last step has no next one; 5 mixed
    assert d["forward"] == pytest.approx(5.0) and d["gap"] == pytest.approx(0.5)
    assert d["prep"] == pytest.approx(0.2) and d["post"] == pytest.approx(0.3)
    assert d["period"] == pytest.approx(d["prep"] + d["forward"] + d["post"] + d["gap"])
    assert d["host_period"] == pytest.approx(6.0) and d["wait"] == pytest.approx(2.0)
    assert s["steps_per_s"] == pytest.approx(1e3 / 6.0)
    assert s["mixed"]["steps"] == 5 and s["mixed"]["tokens"] == pytest.approx(58)
    assert d["forward_p50"] == pytest.approx(5.0) and d["gap_p50"] == pytest.approx(0.5)


def test_an_idle_engine_is_not_a_slow_step(tmp_path):
    """A pause with no requests (seconds between two steps) is left out, not averaged in."""
    rows = _steps(20, period=6.0, forward=5.0, gap=0.5)
    later = _steps(20, period=6.0, forward=5.0, gap=0.5, t0=rows[-1]["t"] + 2.0, g=rows[-1]["g"][3] + 2000.0)
    s = stepclock.summarize(rows + later)
    assert s["idle_pairs"] == 1 and s["decode"]["steps"] == 38
    assert s["decode"]["gap"] == pytest.approx(0.5) and s["decode"]["period"] == pytest.approx(6.0)
    path = tmp_path / "stepclock.jsonl.gz"
    stepclock.keep(rows, "vanilla", path)
    stepclock.keep(later, "dmi", path)
    stepclock.keep(later, "vanilla", path)                    # a rerun replaces its configuration's rows
    back = stepclock.load(path)
    assert [r["config"] for r in back].count("vanilla") == 20 and len(back) == 40


def test_a_window_takes_its_own_steps_and_the_table_compares_with_vanilla():
    base = _steps(40, period=5.5, forward=5.0, gap=0.0)
    slow = _steps(40, period=6.5, forward=5.1, gap=0.9, t0=200.0)
    later = _steps(40, period=5.5, forward=5.0, gap=0.0, t0=300.0, g=slow[-1]["g"][3] + 0.9)
    s_base = stepclock.summarize(base)
    s_slow = stepclock.summarize(slow + later, 199.0, 250.0)   # the later window's steps are not its own
    assert s_slow["steps"] == 40 and s_slow["decode"]["gap"] == pytest.approx(0.9)
    text = stepclock.table([("vanilla", 16.0, 0, s_base), ("dmi", 16.0, 0, s_slow)])
    dmi_line = next(line for line in text.splitlines() if line.startswith("| dmi "))
    cells = [c.strip() for c in dmi_line.strip("|").split("|")]
    assert float(cells[-3]) == pytest.approx(1.0)              # period - vanilla
    assert float(cells[-2]) == pytest.approx(0.1)              # forward - vanilla
    assert float(cells[-1]) == pytest.approx(0.9)              # the rest: the host's gaps


def test_cpu_rows_without_gpu_times_keep_the_host_columns():
    rows = [{"t": 1.0 + i * 0.01, "reqs": 2, "tokens": 2, "exec": 3.0, "sample": 0.5, "wait": 0.0, "g": None}
            for i in range(5)]
    d = stepclock.summarize(rows)["decode"]
    assert d["exec"] == pytest.approx(3.0) and "forward" not in d
    assert d["host_period"] == pytest.approx(10.0)
