"""Where a serving engine step's time goes, without a profiler: GPU time against the gaps the host
left, from the step clock ``perf/common/vllm_plugins.py`` records in the engine process
(``DMI_PERF_STEPCLOCK``; ``perf/online.py --stepclock`` sets it for every server, vanilla too).

Each step has GPU timestamps where its work starts (``g0``, the executor's ``execute_model``),
around the model forward (``g1``, ``g2``) and where sampling ends (``g3``). An event fires when
the stream reaches it, so over consecutive steps

    period = g0(next) - g0 = prep (g1 - g0) + forward (g2 - g1) + post (g3 - g2) + gap (g0(next) - g3)

where ``forward`` is GPU time (a decode step is one CUDA graph), ``prep`` and ``post`` are the GPU
work around it plus any wait for the host to launch it, and ``gap`` is the stream idle between
steps: the host was late. The table gives medians per part (the parts' medians need not add up
to the period's; the means do, over the steps kept) for decode steps and mixed steps apart. Host
columns: ms in ``execute_model`` and ``sample_tokens``, and ``wait``, the host blocked on sampled
tokens (its slack: near zero when the host is the bottleneck), ``pre``, the host's time from the
step's start to the forward's launch (vLLM's input preparation, and dmi's step begin), ``launch``, the
host's time in the forward's call (a graph replay; a piecewise step's launches), the engine thread's CPU
time in ``execute_model`` and in that call (CUDA's default synchronization spins, so waiting for the GPU
counts as CPU time: wall less CPU is waiting for the GIL or blocked in the kernel), ``replay`` (the
host's time inside the CUDA-graph replays of that call) and ``graphs`` (how many: one a piece of a
piecewise step; ``launch`` less ``replay`` is the Python between the pieces), and with dmi,
``dmi begin`` (its part of ``pre``) and ``dmi threads`` (CPU its drain and export threads spent
during the step, on the same GIL); ``syncs`` and ``syncs in forward``: the engine thread's
synchronizing torch calls in the step and inside its forward (servers run with ``DMI_PERF_SYNCS``,
``perf/online.py --syncs``); ``host probe`` and its CPU: the ms of a fixed piece of host work the
engine's thread did before some steps (``DMI_PERF_PROBE``, ``perf/online.py --probe``): the same
work in every server, so a slower probe is a slower host thread, not more work; ``torch probe``
and its CPU: a fixed number of tiny torch ops launched there too (slower alone: torch or the
CUDA driver, not the thread).

    python perf/common/stepclock.py FILE [FILE ...]     # whole files (or each config of one, see keep()), a row each
    python perf/common/stepclock.py FILE --kind mixed --tokens 41-90 --reqs 41-70   # like steps only
    python perf/common/stepclock.py FILE [FILE ...] --bins                          # the usual sizes, a table each

A mixed step's time depends on its size (tokens, requests) far more than on anything else, and
a window's mix of sizes depends on how much it queued: ``--tokens`` and ``--reqs`` keep the steps
in those ranges (inclusive) before summarizing, so configurations compare like steps with like.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

PARTS = ("period", "prep", "forward", "post", "gap")
IDLE_MS = 50.0              # a longer pause between two steps: the engine was idle, not slow
HOST = ("exec", "exec_cpu", "sample", "wait", "pre", "launch", "launch_cpu", "replay", "graphs", "dmi_begin", "threads",
        "syncs", "fwd_syncs", "probe", "probe_cpu", "probe_torch", "probe_torch_cpu")


def load(path) -> list[dict]:
    """The rows of a step clock file (JSON lines; gzipped when the name ends in .gz)."""
    import gzip
    p = Path(path)
    if not p.exists():
        return []
    text = gzip.open(p, "rt").read() if p.suffix == ".gz" else p.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def like(rows: list[dict], tokens: tuple[int, int] | None = None, reqs: tuple[int, int] | None = None) -> list[dict]:
    """The steps whose token and request counts lie in the given inclusive ranges, each with the
    step after it (its period needs the next step's start), as pairs flattened for
    :func:`summarize`: a kept step's next step is kept too, marked ``_next`` (never counted)."""
    rows = sorted(rows, key=lambda r: r["t"])
    inside = lambda r: ((tokens is None or tokens[0] <= r["tokens"] <= tokens[1])    # noqa: E731
                        and (reqs is None or reqs[0] <= r["reqs"] <= reqs[1]))
    out = []
    for a, b in zip(rows, rows[1:]):
        if inside(a):
            out += [a, {**b, "_next": True}]
    return out


def summarize(rows: list[dict], t0: float = float("-inf"), t1: float = float("inf")) -> dict:
    """Steps that started in [t0, t1] and whose next step is recorded too, as pairs (step, next),
    per kind (``decode``: every request decodes one token; ``mixed``: a prefill chunk too; ``all``):
    ms means and medians of each part, and steps/s. A pair whose next step started over
    ``IDLE_MS`` later (the engine had no request) is left out: one such gap outweighs thousands
    of steps in a mean."""
    rows = sorted(rows, key=lambda r: r["t"])
    # a probe (perf/common/vllm_plugins.py) runs before its step's clock starts, so it lengthens the step
    # before it: that pair is left out (the probed step's own pair keeps its probe figures)
    pairs = [(a, b) for a, b in zip(rows, rows[1:])
             if t0 <= a["t"] <= t1 and not a.get("_next") and "probe" not in b]
    busy = [(a, b) for a, b in pairs if (b["t"] - a["t"]) * 1e3 <= IDLE_MS]
    out = {"steps": len(pairs), "idle_pairs": len(pairs) - len(busy), "steps_per_s": 0.0}
    if len(pairs) > 1:
        span = pairs[-1][0]["t"] - pairs[0][0]["t"]
        out["steps_per_s"] = (len(pairs) - 1) / span if span > 0 else 0.0
    for kind in ("all", "decode", "mixed"):
        sel = [(a, b) for a, b in busy if kind == "all" or (a["tokens"] == a["reqs"]) == (kind == "decode")]
        d = {"steps": len(sel), "reqs": _mean([a["reqs"] for a, _ in sel]), "tokens": _mean([a["tokens"] for a, _ in sel])}
        d.update({k: _mean([_host(a, k) for a, _ in sel]) for k in HOST})
        d["host_period"] = _mean([(b["t"] - a["t"]) * 1e3 for a, b in sel])
        gpu = [(a["g"], b["g"]) for a, b in sel if a.get("g") and b.get("g") and None not in a["g"] and b["g"][0] is not None]
        if gpu:
            g = np.array([ga + [gb[0]] for ga, gb in gpu], float)    # g0 g1 g2 g3 g0(next)
            parts = {"period": g[:, 4] - g[:, 0], "prep": g[:, 1] - g[:, 0], "forward": g[:, 2] - g[:, 1],
                     "post": g[:, 3] - g[:, 2], "gap": g[:, 4] - g[:, 3]}
            d.update({k: float(np.mean(v)) for k, v in parts.items()})
            d.update({f"{k}_p50": float(np.median(v)) for k, v in parts.items()})
        out[kind] = d
    return out


def load_label(load: float | str) -> str:
    """A serving load as tables print it: a rate (req/s) as a number, ``cN`` (N closed-loop clients) as is."""
    return load if isinstance(load, str) else f"{load:g}"


def _host(row: dict, key: str) -> float | None:
    """A step's host figure ``key`` (``dmi_begin``: the begin entry of its ``dmi`` hook times;
    ``syncs`` / ``fwd_syncs``: its synchronizing torch calls in all / inside the forward, where
    the server ran with ``DMI_PERF_SYNCS``)."""
    if key == "dmi_begin":
        return row["dmi"][1] if row.get("dmi") else None
    if key in ("syncs", "fwd_syncs"):
        syncs = row.get("syncs")
        return None if syncs is None else syncs[1] if key == "fwd_syncs" else sum(syncs)
    return row.get(key)


def keep(rows: list[dict], config: str, path: Path) -> None:
    """Add a configuration's rows (each tagged ``config``) to one gzipped JSON-lines file, replacing
    that configuration's earlier rows: a run's steps kept for later analysis."""
    import gzip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = []
    if path.exists():
        with gzip.open(path, "rt") as f:
            old = [line for line in f if json.loads(line).get("config") != config]
    with gzip.open(path, "wt") as f:
        f.writelines(old)
        f.writelines(json.dumps({"config": config, **r}) + "\n" for r in rows)


def _mean(v) -> float | None:
    v = [x for x in v if x is not None]
    return float(np.mean(v)) if v else None


def table(entries: list[tuple[str, float, int, dict]], base: str = "vanilla", kind: str = "decode") -> str:
    """(config, rate, window, summarize()) rows: ``kind`` steps' medians (ms) of each part and
    their change against ``base``'s window of the same rate and index (else that rate's first)."""
    ref = {}
    for name, rate, rep, s in entries:
        if name == base:
            ref.setdefault((rate, rep), s)
            ref.setdefault(rate, s)
    cols = [f"{k}_p50" for k in PARTS]
    head = ("| config | rate | window | steps/s | steps | reqs | tokens | period | prep | forward | post | gap | "
            "period mean | host exec | host exec CPU | host sample | host wait | host pre | host launch | host launch CPU | "
            "host replay | graphs | dmi begin | dmi threads | syncs | syncs in forward | host probe | host probe CPU | "
            "torch probe | torch probe CPU | "
            "period - base | forward - base | prep+post+gap - base |")
    lines = [head, "|" + " --- |" * 33]
    f = lambda v: f"{v:.3f}" if v is not None else ""    # noqa: E731
    for name, rate, rep, s in entries:
        d = s.get(kind, {})
        r = ref.get((rate, rep), ref.get(rate, {})).get(kind, {}) if name != base else {}
        delta = lambda k: (d[k] - r[k]) if d.get(k) is not None and r.get(k) is not None else None   # noqa: E731
        rest = [delta(f"{k}_p50") for k in ("prep", "post", "gap")]
        lines.append("| " + " | ".join(
            [name, load_label(rate), str(rep), f"{s['steps_per_s']:.1f}", str(d.get("steps", 0)),
             f"{d['reqs']:.1f}" if d.get("reqs") is not None else "", f"{d['tokens']:.0f}" if d.get("tokens") is not None else ""]
            + [f(d.get(k)) for k in cols] + [f(d.get("period"))] + [f(d.get(k)) for k in HOST]
            + [f(delta("period_p50")), f(delta("forward_p50")), f(sum(rest)) if None not in rest else ""]) + " |")
    return "\n".join(lines)


# (kind, tokens, requests) of the like-for-like comparisons --bins prints: a serving window's decode
# steps at 16 req/s and at a full batch (64 req/s, c64), mixed steps of a light and a full batch
# (c64's are mostly 150-560 tokens), and steps above the largest CUDA graph (512 tokens in
# perf/online.py), which run without graphs
BINS = [("decode", None, (5, 20)), ("decode", None, (41, 70)), ("mixed", (10, 40), (5, 20)),
        ("mixed", (41, 90), (41, 70)), ("mixed", (100, 300), (41, 70)), ("mixed", (301, 512), (41, 70)),
        ("mixed", (513, 1 << 20), None)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--kind", default="decode", choices=["decode", "mixed", "all"])
    ap.add_argument("--tokens", default=None, metavar="LO-HI", help="only steps with this many tokens")
    ap.add_argument("--reqs", default=None, metavar="LO-HI", help="only steps with this many requests")
    ap.add_argument("--bins", action="store_true", help="a table for each of the usual sizes (BINS)")
    args = ap.parse_args(argv)
    span = lambda v: tuple(int(x) for x in v.split("-", 1)) if v else None     # noqa: E731
    by_config: dict = {}
    for p in args.files:
        for r in load(p):
            by_config.setdefault(r.get("config", Path(p).name.split(".")[0]), []).append(r)
    bins = BINS if args.bins else [(args.kind, span(args.tokens), span(args.reqs))]
    for kind, tokens, reqs in bins:
        entries = [(name, 0.0, 0, summarize(like(rows, tokens, reqs) if tokens or reqs else rows))
                   for name, rows in by_config.items()]
        if args.bins:
            print(f"\n{kind} steps, tokens {tokens or 'any'}, requests {reqs or 'any'}\n")
        print(table(entries, base=entries[0][0] if entries else "vanilla", kind=kind))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
