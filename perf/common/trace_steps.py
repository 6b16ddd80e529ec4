"""Where an engine step's time goes, from torch.profiler traces (Chrome JSON, gzipped or not):
one trace per configuration (vanilla, dmi-null, dmi-hidden, ...), compared side by side.

    python perf/common/trace_steps.py DIR [DIR ...]      # each DIR: one configuration's trace files

``perf/online.py --trace N`` writes them (vLLM's profiler, N engine steps of each server,
``$OUT/trace-CONFIG``) and prints this comparison. Per configuration, over the traced window:
steps (the most frequent of vLLM's per-step annotations), GPU busy (union of kernel and copy
intervals) and kernel-only time per step, idle GPU time per step (gaps the host left), dmi's kernels
(capture and end marker) per step, the host ops (torch ops, custom ops) with the most time, the host's span of decode-only and of prefill steps (median,
from vLLM's ``execute_context_N(T)_generation_N(T)`` annotations), the CUDA runtime calls the host spent longest in (launches,
copies, synchronizations: a sync is the host waiting for the GPU), and the kernels with the
largest time per step.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re
import statistics
from pathlib import Path

DMI_KERNELS = ("capture_kernel", "end_kernel")
STEP_HINTS = ("execute_model", "forward", "model_runner")
# vLLM's per-step annotation: requests (tokens) in prefill, then in decode
VLLM_STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def trace_files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name.endswith((".json", ".json.gz")))


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(events: list[dict], top: int = 8) -> dict:
    """Totals in µs of one trace (see the module doc); ``steps`` >= 1."""
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    if gpu:
        t0 = min(e["ts"] for e in gpu)
        t1 = max(e["ts"] + e["dur"] for e in gpu)
    else:
        t0 = t1 = 0.0
    marks = [e for e in events if e.get("cat") == "user_annotation"]
    vllm_steps = [(e, VLLM_STEP.match(e["name"])) for e in marks]
    vllm_steps = [(e, m) for e, m in vllm_steps if m]
    host = {"decode": [], "prefill": []}     # host µs of each step (its annotation's span), by kind
    if vllm_steps:
        for e, m in vllm_steps:
            host["prefill" if int(m.group(2)) else "decode"].append(e["dur"])
        stepish = [("execute_context_*", len(vllm_steps))]
    else:
        annotations = collections.Counter(e["name"] for e in marks)
        stepish = [(n, c) for n, c in annotations.most_common() if any(h in n.lower() for h in STEP_HINTS)]
    # the GPU's span of each step (vLLM's annotations on the GPU timeline), by kind, with the decode
    # batch (requests) and dmi's kernels inside it: what a step costs the GPU, host effects aside
    gpu_steps = {"decode": [], "prefill": []}
    gpu_marks = [(e, VLLM_STEP.match(e["name"])) for e in events if e.get("cat") == "gpu_user_annotation"]
    starts = sorted((e["ts"], e["ts"] + e["dur"], any(k in e["name"] for k in DMI_KERNELS)) for e in kernels)
    for e, m in ((e, m) for e, m in gpu_marks if m):
        a, b = e["ts"], e["ts"] + e["dur"]
        lo, hi = bisect.bisect_left(starts, (a,)), bisect.bisect_right(starts, (b, float("inf")))
        inside = starts[lo:hi]
        dmi_in = sum(y - x for x, y, d in inside if d)
        gpu_steps["prefill" if int(m.group(2)) else "decode"].append((e["dur"], int(m.group(3)), dmi_in))
    steps = stepish[0][1] if stepish else 1
    by_kernel = collections.Counter()
    for e in kernels:
        by_kernel[e["name"][:80]] += e["dur"]
    runtime, ops = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            runtime[e["name"]] += e["dur"]
        elif e.get("cat") == "cpu_op":        # nested ops count in their callers too
            ops[e["name"][:60]] += e["dur"]
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    dmi = sum(d for n, d in by_kernel.items() if any(k in n for k in DMI_KERNELS))
    dmi_n = sum(1 for e in kernels if any(k in e["name"] for k in DMI_KERNELS))
    return {"steps": steps, "step_annotation": stepish[0][0] if stepish else None, "window_us": t1 - t0,
            "busy_us": busy, "compute_us": compute, "idle_us": (t1 - t0) - busy, "dmi_us": dmi, "dmi_launches": dmi_n,
            "kernels": len(kernels), "top_kernels": by_kernel.most_common(top), "top_runtime": runtime.most_common(top),
            "top_ops": ops.most_common(top),
            "host_steps": {k: (len(v), statistics.median(v) if v else 0.0) for k, v in host.items()},
            "gpu_steps": {k: (len(v), *(statistics.median(x[i] for x in v) if v else 0.0 for i in range(3)))
                          for k, v in gpu_steps.items()}}


def summarize_dir(d: Path) -> dict:
    """The trace of ``d`` with the most GPU work (the engine's worker; the front end has none)."""
    best = None
    for path in trace_files(d):
        s = summarize(load_events(path))
        s["file"] = path.name
        if best is None or s["busy_us"] > best["busy_us"]:
            best = s
    if best is None:
        raise SystemExit(f"{d}: no trace files (*.json, *.json.gz)")
    return best


def compare(summaries: dict[str, dict]) -> str:
    names = list(summaries)
    per = {n: max(s["steps"], 1) for n, s in summaries.items()}
    lines = ["| per step (µs) | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(n, summaries[n]) for n in names) + " |")
    row("steps traced", lambda n, s: str(s["steps"]))
    row("window", lambda n, s: f"{s['window_us'] / per[n]:.0f}")
    row("GPU busy", lambda n, s: f"{s['busy_us'] / per[n]:.0f}")
    row("GPU kernels", lambda n, s: f"{s['compute_us'] / per[n]:.0f}")
    row("GPU idle", lambda n, s: f"{s['idle_us'] / per[n]:.0f}")
    row("dmi kernels", lambda n, s: f"{s['dmi_us'] / per[n]:.1f} ({s['dmi_launches'] / per[n]:.1f} launches)")
    row("kernels launched", lambda n, s: f"{s['kernels'] / per[n]:.0f}")
    for kind in ("decode", "prefill"):      # vLLM's annotations: the host's span of each step
        row(f"host span, {kind} steps (median, count)",
            lambda n, s: "{1:.0f} ({0})".format(*s.get("host_steps", {}).get(kind, (0, 0.0))))
    for kind in ("decode", "prefill"):      # the GPU's span of each step, its decode requests, dmi's kernels in it
        row(f"GPU span, {kind} steps (median, count; decode requests; dmi µs)",
            lambda n, s: "{1:.0f} ({0}; {2:.0f}; {3:.0f})".format(*s.get("gpu_steps", {}).get(kind, (0, 0.0, 0.0, 0.0))))
    out = ["\n".join(lines)]
    for n, s in summaries.items():
        out.append(f"{n} ({s['file']}, steps by {s['step_annotation']!r}): CUDA runtime µs/step: "
                   + ", ".join(f"{k} {v / per[n]:.0f}" for k, v in s["top_runtime"])
                   + "\n  kernels µs/step: " + ", ".join(f"{k[:48]} {v / per[n]:.0f}" for k, v in s["top_kernels"])
                   + "\n  host ops µs/step (inclusive): "
                   + ", ".join(f"{k} {v / per[n]:.0f}" for k, v in s.get("top_ops", [])))
    return "\n\n".join(out)


def compare_dirs(dirs: dict[str, Path]) -> str:
    return compare({name: summarize_dir(d) for name, d in dirs.items()})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    args = ap.parse_args(argv)
    print(compare_dirs({d.name.removeprefix("trace-"): d for d in args.dirs}))


if __name__ == "__main__":
    main()
