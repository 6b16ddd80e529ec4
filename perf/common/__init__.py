"""What the benchmarks of perf/ share: real-size model configurations with random weights built by
name, a twin of a model that shares its weights, prompts, generate() arguments, timing (wall time,
GPU busy time from one profiled run, garbage-collector time), the hook specs the benchmarks
capture, and markdown table helpers.

The modules beside this one are tools the benchmarks use, each also a command line of its own:
``pyspy`` (py-spy profiles per thread), ``stepclock`` and ``trace_steps`` (where a serving step's
time goes), ``vllm_models`` (model folders for vLLM with dummy weights) and ``vllm_plugins`` (the
vLLM plugin perf/online.py loads into its servers)."""
from __future__ import annotations

import collections
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

GiB = 1 << 30
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# name -> (transformers config class, its arguments): the shapes of the real models, random weights
MODELS = {
    "qwen3-0.6b": ("Qwen3Config", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                       tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                       rms_norm_eps=1e-6, max_position_embeddings=40960)),
    "qwen3-8b": ("Qwen3Config", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                     tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                     rms_norm_eps=1e-6, max_position_embeddings=40960)),
    "llama-3.1-8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                                         tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=131072,
                                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 8192})),
    # smoke runs (CPU too)
    "tiny": ("Qwen3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=False,
                                 max_position_embeddings=1024)),
}

# every layer's residual stream and the final norm at every token, the logits at each request's last
HEADLINE_SPEC = {"capture": [{"sites": ["resid_post", "final_norm"]}, {"sites": ["logits"], "tokens": "last"}]}


# --- models -------------------------------------------------------------------------------------
def config(name: str):
    """The transformers config of ``MODELS[name]``."""
    import transformers as tf
    cls, kw = MODELS[name]
    cfg = getattr(tf, cls)(**kw, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._name_or_path = f"random-{name}"
    return cfg


def build(name: str):
    """``MODELS[name]`` with random weights (seed 0), bf16 on a GPU, fp32 on the CPU, SDPA attention."""
    import transformers as tf
    torch.manual_seed(0)
    with torch.device(DEV):
        model = tf.AutoModelForCausalLM.from_config(config(name), dtype=torch.bfloat16 if DEV == "cuda" else torch.float32,
                                                    attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None       # random weights: always generate every new token
    model.generation_config.pad_token_id = 0
    return model


def twin(model):
    """A second instance of ``model`` sharing its weights (buffers and modules copied): dmi patches
    instances, so the twin carries dmi while ``model`` stays vanilla, and the two can be timed
    alternately in one process (no drift between a vanilla phase and a dmi phase)."""
    import copy
    t = copy.deepcopy(model, memo={id(p): p for p in model.parameters()})
    # generate()'s compiled forward is cached on the instance and deepcopy keeps a function as is: a
    # twin made after the model compiled would replay the model's own graph, never its patched one
    for attr in ("_compiled_call", "_last_compile_config"):
        t.__dict__.pop(attr, None)
    return t


def prompts(batch: int, lo: int, hi: int, vocab: int, seed: int = 0):
    """(left-padded input_ids and attention_mask, lengths): ``batch`` random prompts whose lengths
    spread evenly over ``lo..hi`` tokens, in shuffled order."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(lo, hi, batch).round().astype(int)
    rng.shuffle(lengths)
    width = int(lengths.max())
    ids = np.zeros((batch, width), np.int64)
    mask = np.zeros((batch, width), np.int64)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = rng.integers(3, vocab, n)
        mask[b, width - n:] = 1
    return {"input_ids": torch.from_numpy(ids).to(DEV), "attention_mask": torch.from_numpy(mask).to(DEV)}, lengths


def gen_kwargs(mode: str, new: int) -> dict:
    """generate() arguments: greedy, exactly ``new`` tokens; ``compiled``: a static cache and
    ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), ``eager``: the dynamic cache."""
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if mode == "compiled":
        from transformers import CompileConfig
        kw.update(cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))
    return kw


# --- hook specs ---------------------------------------------------------------------------------
def hidden_spec(ring: int, host: int, writer: str = "thread", **store) -> dict:
    """The headline sites under the ``full`` policy with this ring and pinned staging."""
    return {**HEADLINE_SPEC, "policy": {"mode": "full", "ring_bytes": ring, "host_bytes": host},
            "store": {"writer": writer, **store}}


def internals_spec(ring: int, host: int) -> dict:
    """q, k, v, z, mlp.in, mlp.out and resid_mid of every layer under the ``full`` policy."""
    return {"capture": [{"sites": ["attn.q", "attn.k", "attn.v", "attn.z", "mlp.in", "mlp.out", "resid_mid"]}],
            "policy": {"mode": "full", "ring_bytes": ring, "host_bytes": host}}


def ring_for(step_bytes: int, floor: int = GiB) -> int:
    """The ring: 1 GiB, or the next 256 MiB above one prefill step when that does not fit."""
    need = int(step_bytes * 1.02) + (64 << 20)
    return floor if need <= floor else -(-need // (256 << 20)) * (256 << 20)


class Skip:
    """Exporter stand-in: rows are drained to pinned host memory, then dropped (no store writes):
    the "-> host" rows, the capture path without the store."""

    def __init__(self, run):
        self.run, self.saved = run, run.exporter.write_step

    def __enter__(self):
        self.run.exporter.write_step = lambda *a, **k: None

    def __exit__(self, *exc):
        self.run.exporter.write_step = self.saved


def store_dir() -> Path:
    """A fresh directory for a store: on /dev/shm where it has room, else the temp directory."""
    shm = Path("/dev/shm")
    if shm.exists() and shutil.disk_usage(shm).free > 48 * GiB:
        return Path(tempfile.mkdtemp(dir=shm, prefix="dmi-perf-"))
    return Path(tempfile.mkdtemp(prefix="dmi-perf-"))


# --- timing -------------------------------------------------------------------------------------
def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def rotated(items: list, r: int) -> list:
    """``items`` starting at round ``r``'s place: a round-robin whose order rotates each round,
    so that no configuration always runs first."""
    k = r % len(items)
    return items[k:] + items[:k]


def timed(fn) -> float:
    """Seconds of ``fn()``, the device synchronized before and after."""
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def gpu_profile(fn, steps: int) -> dict:
    """One run of ``fn`` under torch.profiler, per step: wall ms, GPU busy ms (the union of kernel
    and copy intervals, all streams), the same without copies (compute), device events, the host
    µs of Dynamo's cache lookups, and GPU time by kernel name. GPU busy time is the stable
    measure of what a configuration costs the device, where the wall time of HF's compiled
    generate is host-bound and jitters by several percent between identical runs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    _sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
        t = time.perf_counter()
        fn()
        _sync()
        wall = time.perf_counter() - t
    events = [e for e in p.events() if e.device_type == DeviceType.CUDA]
    busy = _union_us(events)
    # without the copies: the drain's D2H runs on the copy engine beside the kernels, and counts
    # in "busy" only where it fills a gap the host left
    compute = _union_us([e for e in events if not e.name.startswith(("Memcpy", "Memset"))])
    by_name = collections.defaultdict(float)
    for e in events:
        by_name[e.name[:90]] += e.time_range.end - e.time_range.start
    lookup = sum(cache_lookups_us(p))
    return {"wall_ms": wall * 1e3 / steps, "busy_ms": busy / 1e3 / steps, "compute_ms": compute / 1e3 / steps,
            "kernels": len(events) / steps, "lookup_us": lookup / steps,
            "by_name": {k: v / steps for k, v in by_name.items()}}


def cache_lookups_us(prof) -> list[float]:
    """CPU µs of each Dynamo cache lookup (guard evaluation before a compiled call) a torch.profiler
    run recorded, the profiler's own cost included."""
    return [e.cpu_time_total for e in prof.events() if e.name == "TorchDynamo Cache Lookup"]


def _union_us(events) -> float:
    """Length of the union of the events' intervals (µs)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in events):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class GcClock:
    """Seconds the process spent in Python's cyclic garbage collector, and full (generation 2)
    collections, since it was made (``gc.callbacks``). A full collection walks every tracked object:
    after torch.compile has built its graphs that heap is large, and one landing inside a timed run
    slows whichever configuration runs then, vanilla or not."""

    def __init__(self):
        self.seconds, self.full, self._t = 0.0, 0, None
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t
            self.full += info.get("generation") == 2
            self._t = None


# --- tables -------------------------------------------------------------------------------------
def raw_write_gbs(directory: Path, n_bytes: int, block: int = 16 << 20) -> float:
    """The directory's file system's raw sequential write speed: one file written in ``block``-byte
    writes, then fsync'd (GB/s from open to fsync done); the file is removed."""
    directory.mkdir(parents=True, exist_ok=True)
    buf = np.random.default_rng(1).integers(0, 256, block, dtype=np.uint8)
    path = directory / ".raw-write-probe"
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(max(1, n_bytes // block)):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        return max(1, n_bytes // block) * block / (time.perf_counter() - t0) / 1e9
    finally:
        path.unlink(missing_ok=True)


def spread(ratios) -> str:
    """'low / median / high' of per-pair ratios, 3 decimals."""
    r = sorted(ratios)
    return f"{r[0]:.3f} / {statistics.median(r):.3f} / {r[-1]:.3f}"


def md_header(columns: list[str], text: int = 1) -> str:
    """A markdown table's header and rule: the first ``text`` columns aligned left, the figures right."""
    return md_row(columns) + "\n" + md_row(["---" if i < text else "---:" for i in range(len(columns))])


def md_row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"
