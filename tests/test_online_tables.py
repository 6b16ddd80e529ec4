"""perf/online.py's tables: the paired TPOT ratio (each request against itself on vanilla)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))

import online  # noqa: E402


def _window(config, rep, tpots):
    return {"config": config, "rate": 16.0, "repeat": rep, "sent": len(tpots), "done": len(tpots),
            "ttft_p50": 20.0, "ttft_p99": 40.0, "tpot_p50": float(np.median(tpots)), "tpot_p99": max(tpots),
            "out_tok_s": 1000.0, "tpot_by_request": {str(i): t for i, t in enumerate(tpots)}}


def test_paired_ratio_cancels_the_request_mix():
    rng = np.random.default_rng(0)
    vanilla = [_window("vanilla", k, list(rng.uniform(4.0, 9.0, 40))) for k in range(3)]
    dmi = [_window("dmi-hidden", k, [t * 1.02 for t in v["tpot_by_request"].values()]) for k, v in enumerate(vanilla)]
    dmi[1]["tpot_by_request"].pop("7")                          # a request that did not finish: no pair
    rows = json.loads(json.dumps(vanilla + dmi))                 # as --baseline reads them back
    base = {16.0: [r for r in rows if r["config"] == "vanilla"]}
    ratio, n = online.paired_ratio([r for r in rows if r["config"] == "dmi-hidden"], base[16.0])
    assert ratio == pytest.approx(1.02) and n == 119
    text = online.table(rows, base)
    line = next(x for x in text.splitlines() if x.startswith("| dmi-hidden"))
    assert line.rstrip(" |").endswith("1.020 (119)")


def test_windows_without_per_request_figures_give_no_paired_ratio():
    old = {k: v for k, v in _window("vanilla", 0, [5.0, 6.0]).items() if k != "tpot_by_request"}
    assert online.paired_ratio([_window("dmi-hidden", 0, [5.1, 6.1])], [old]) is None


def test_window_table_pairs_each_window_with_vanillas_of_the_same_index():
    """Near saturation a window either keeps up or queues: each window against vanilla's own."""
    vanilla = [_window("vanilla", k, [5.0, 6.0, 7.0]) for k in range(2)]
    dmi = [_window("dmi-hidden", 0, [5.5, 6.6, 7.7]), _window("dmi-hidden", 1, [5.1, 6.12, 7.14])]
    vanilla[1]["ttft_p50"] = 1387.0
    base = {16.0: vanilla}
    lines = [x for x in online.window_table(vanilla + dmi, base).splitlines() if x.startswith("| dmi-hidden")]
    assert len(lines) == 2
    cells = [[c.strip() for c in x.strip("|").split("|")] for x in lines]
    assert cells[0][2] == "0" and cells[0][8] == "1.100" and cells[0][9] == "1.100"
    assert cells[1][2] == "1" and cells[1][5] == "1387" and cells[1][8] == "1.020" and cells[1][9] == "1.020"
    assert cells[0][10:] == ["", ""]                            # no GPU samples (a CPU run, an older baseline)
    dmi[0]["gpu"] = online.gpu_summary("1980, 612.5, 61\n1755, 700.1, 66\n[N/A], [N/A], [N/A]\n1980, 650.0, 63\n")
    vanilla[0]["gpu"] = online.gpu_summary("1980, 600.0, 60\n")
    row = next(x for x in online.window_table(vanilla + dmi, base).splitlines() if x.startswith("| dmi-hidden | 16 | 0"))
    assert [c.strip() for c in row.strip("|").split("|")][10:] == ["1980 (1755)", "1980 (1980)"]
    assert dmi[0]["gpu"]["samples"] == 3 and dmi[0]["gpu"]["temp_c_max"] == 66


def test_gpu_sampler_without_nvidia_smi_records_nothing(monkeypatch, tmp_path):
    """Where nvidia-smi is missing (CPU machines) a window runs unsampled, not failed."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with online.GpuSampler() as gpu:
        pass
    assert gpu.summary is None and online.gpu_summary("") is None
    tool = tmp_path / "nvidia-smi"          # a stand-in that samples like nvidia-smi -lms: a line at a time
    tool.write_text("#!/bin/sh\nwhile true; do echo '1410, 650.5, 70'; sleep 0.05; done\n")
    tool.chmod(0o755)
    with online.GpuSampler() as gpu:
        import time
        time.sleep(0.4)
    assert gpu.summary["sm_mhz_p50"] == 1410 and gpu.summary["samples"] >= 2 and gpu.proc.poll() is not None


def test_offline_table_shows_each_pair_beside_the_ratio_of_medians():
    """perf/offline.py: the ratio of medians can be a lucky draw of vanilla's spread, so the table
    shows each run's own ratio to the vanilla run before it (lowest, median, highest)."""
    import offline
    base = {"model": "qwen3-8b", "batch": 32, "mode": "compiled", "tok_s": 2000.0, "seconds": 3.9}
    rows = [dict(base, config="vanilla", ratio=1.0),
            dict(base, config="dmi hidden+logits -> host", ratio=1.002, pair_ratios=[0.947, 0.948, 1.037],
                 bytes=5.97e9, d2h_gbs=1.5, drops=0, ring=1.25 * 2**30, gpu_bytes=1282 * 2**20)]
    lines = offline.table(rows).splitlines()
    assert len(lines) == 4 and all(line.count("|") == lines[0].count("|") for line in lines)
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells[5:7] == ["1.002", "0.947 / 0.948 / 1.037"] and cells[13] == "0"
    assert [c.strip() for c in lines[2].strip("|").split("|")][6] == ""       # vanilla: no pairs
