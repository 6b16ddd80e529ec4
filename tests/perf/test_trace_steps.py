"""perf/common/trace_steps.py's reading of torch.profiler Chrome traces."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

from common import trace_steps  # noqa: E402


def _x(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def test_totals_per_step_of_a_synthetic_trace(tmp_path):
    events = [_x("execute_model", "user_annotation", 0, 100), _x("execute_model", "user_annotation", 100, 100),
              _x("gemm", "kernel", 0, 50), _x("gemm", "kernel", 40, 30),            # overlap: union 70
              _x("capture_kernel_0d1", "kernel", 120, 5), _x("end_kernel", "kernel", 130, 2),
              _x("Memcpy DtoH", "gpu_memcpy", 125, 11),                              # beside the end marker
              _x("cudaGraphLaunch", "cuda_runtime", 0, 20), _x("cudaStreamSynchronize", "cuda_runtime", 50, 60),
              {"ph": "i", "name": "instant", "ts": 3}]
    d = tmp_path / "trace-dmi"
    d.mkdir()
    with gzip.open(d / "worker.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    (d / "frontend.json").write_text(json.dumps({"traceEvents": [_x("execute_model", "user_annotation", 0, 9)]}))
    s = trace_steps.summarize_dir(d)
    assert s["file"] == "worker.pt.trace.json.gz" and s["steps"] == 2
    assert s["window_us"] == 136 and s["busy_us"] == 70 + 5 + 11 and s["compute_us"] == 70 + 5 + 2
    assert s["idle_us"] == 136 - 86 and s["dmi_us"] == 7 and s["dmi_launches"] == 2
    assert dict(s["top_runtime"]) == {"cudaStreamSynchronize": 60, "cudaGraphLaunch": 20}
    table = trace_steps.compare({"vanilla": s, "dmi": s})
    assert "| GPU busy | 43 | 43 |" in table and "| GPU idle | 25 | 25 |" in table and "| dmi kernels | 3.5 (1.0 launches) |" in table


def test_a_real_torch_profiler_trace_is_read(tmp_path):
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(3):
            with record_function("execute_model"):
                torch.randn(64, 64) @ torch.randn(64, 64)
    p.export_chrome_trace(str(tmp_path / "t.json"))
    s = trace_steps.summarize(trace_steps.load_events(tmp_path / "t.json"))
    assert s["steps"] == 3 and s["step_annotation"] == "execute_model" and s["busy_us"] == 0   # CPU only


def test_vllm_step_annotations_split_decode_from_prefill_steps():
    events = [_x("execute_context_0(0)_generation_4(4)", "user_annotation", 0, 100),
              _x("execute_context_0(0)_generation_4(4)", "user_annotation", 100, 120),
              _x("execute_context_0(0)_generation_4(4)", "user_annotation", 220, 300),
              _x("execute_context_1(200)_generation_3(3)", "user_annotation", 520, 900),
              _x("execute_model", "user_annotation", 0, 2000)]
    s = trace_steps.summarize(events)
    assert s["steps"] == 4 and s["host_steps"] == {"decode": (3, 120), "prefill": (1, 900)}
    assert "| host span, prefill steps (median, count) | 900 (1) |" in trace_steps.compare({"x": s | {"file": "f"}})


def test_gpu_span_of_vllm_steps_with_their_batch_and_dmi_kernels():
    events = [_x("execute_context_0(0)_generation_4(4)", "gpu_user_annotation", 0, 100),
              _x("execute_context_0(0)_generation_6(6)", "gpu_user_annotation", 200, 140),
              _x("execute_context_2(300)_generation_4(4)", "gpu_user_annotation", 400, 900),
              _x("gemm", "kernel", 10, 50), _x("capture_kernel", "kernel", 70, 3), _x("end_kernel", "kernel", 90, 1),
              _x("gemm", "kernel", 210, 100), _x("capture_kernel", "kernel", 320, 5),
              _x("capture_kernel", "kernel", 410, 7), _x("gemm", "kernel", 500, 700)]
    s = trace_steps.summarize(events)
    # decode: spans 100 and 140 (median 120), requests 4 and 6 (5), dmi 4 and 5 µs (4.5); prefill: its one step
    assert s["gpu_steps"] == {"decode": (2, 120, 5, 4.5), "prefill": (1, 900, 4, 7)}
    table = trace_steps.compare({"x": s | {"file": "f"}})
    assert "| GPU span, decode steps (median, count; decode requests; dmi µs) | 120 (2; 5; 4) |" in table
