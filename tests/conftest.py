"""Shared fixtures: tiny random-init models of each family, a local tokenizer, spec files."""
from __future__ import annotations

import copy
import gc
import os
import textwrap

import pytest
import torch

from dmi.models import build_tiny_model, tiny_tokenizer
import failure_log

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch's intra-op threads: 2, or each pytest-xdist worker's share of the cores (scripts/test.sh runs
# two workers on CI's two cores), also for the processes the tests start (OMP_NUM_THREADS). Two
# workers of two OpenMP threads each on two cores wait in each other's barriers: every op that
# forks slows to the scheduler's time slice.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(2, (os.cpu_count() or 1) // WORKERS))))
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]) if WORKERS > 1 else 2)


def settle_mkl_vml() -> None:
    """Resolve oneMKL's vector-math kernels before any model runs: oneMKL 2024.2 (torch's wheels)
    picks a VML function's kernel on its first call, and when two intra-op threads make that call
    together one of them can run a low-accuracy kernel on its chunk (pytorch/pytorch#188792). Here
    that was the rotary ``cos`` of the process's first forward (thread 1's half of the angles at
    VML_EP accuracy): every later array of that run's first generate off by 1e-5..2e-4 in 25 rows,
    and its store unequal to the others. One single-threaded 1-element call of each settles them;
    done here for every test process, and by the subprocesses that compare model runs bit for bit."""
    x = torch.full((1,), 0.5)
    for op in ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin",
               "sqrt", "tan", "tanh", "trunc"):        # ATen's ops on MKL VML (ATen/cpu/vml.h)
        getattr(torch, op)(x)


settle_mkl_vml()

# each failure on disk as it happens, under DMI_TEST_FAILURES (runs cut by a time limit)
pytest_runtest_logreport = failure_log.pytest_runtest_logreport

# The files that take minutes, longest first (summed from scripts/test.sh's --durations=0).
# scripts/test.sh's pytest-xdist workers take whole files in collection order (--dist loadfile
# --no-loadscope-reorder): these first, so that neither worker starts a long one while the other
# has nothing left to do.
LONG_FILES = ("test_vllm.py", "test_kernels_interpret_compiled.py", "test_reliability.py", "test_vllm_interventions.py",
              "test_ray_data.py", "test_vllm_serve.py", "test_vllm_compiled.py", "test_compile.py", "test_soak.py",
              "test_object_store.py", "test_perf_scripts.py", "test_store_property.py", "test_store_loss.py",
              "test_vllm_tp.py", "test_kernels_interpret.py", "test_writer.py", "test_drain_process.py",
              "test_capture_hf.py", "test_stepclock.py", "test_cli_progress.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))     # (stable: each file's own order kept)


def _families() -> dict:
    """family -> its built-in architecture spec's data: every file in dmi/specs/ is a family."""
    from dmi.models import builtin_families
    from dmi.spec import load_arch_spec
    return {f: load_arch_spec(path).data for f, path in builtin_families().items()}


SPECS = _families()
FAMILIES = sorted(SPECS)
MOE_FAMILIES = {f for f, d in SPECS.items() if any(s.startswith("moe.") for s in d["sites"])}
# families whose attn.pattern knows a sliding window (a tiny model of each gets one: windowed_pair)
WINDOWED = sorted(f for f, d in SPECS.items()
                  if "sliding_window" in d["sites"].get("attn.pattern", {}).get("hf", {}).get("args", {}))

PROMPTS = ["Hello world! How are you", "The quick brown fox jumps over the lazy dog today", "Paris"]


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def encoded(tokenizer):
    return tokenizer(PROMPTS, return_tensors="pt", padding=True)


def model_pair(family: str, attn: str = "eager", seed: int = 0):
    """(model to patch, untouched reference copy) with identical weights."""
    model = build_tiny_model(f"tiny-{family}", seed=seed, attn_implementation=attn)
    return model, copy.deepcopy(model)


def windowed_config(family: str, window: int):
    """The tiny config of a family in ``WINDOWED`` with a sliding attention window of ``window``
    keys. Families with ``use_sliding_window`` (Qwen2, Qwen3) slide from ``max_window_layers`` = 1
    on, where their config derives layer types (layers 1, 2 of 3); Gemma 3 keeps its layer types
    (sliding, global, sliding); the others slide on every layer."""
    from dmi.models import tiny_config
    config = tiny_config(family)
    values = {**config.to_dict(), "sliding_window": window}
    if "use_sliding_window" in values:
        values["use_sliding_window"] = True
        values.update({k: v for k, v in (("max_window_layers", 1), ("layer_types", None)) if k in values})
    return type(config)(**values)


def windowed_pair(family: str, window: int, attn: str = "eager", seed: int = 0):
    """:func:`model_pair` of a family in ``WINDOWED`` with a sliding window of ``window`` keys."""
    import transformers as tf
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(windowed_config(family, window), attn_implementation=attn).eval()
    return model, copy.deepcopy(model)


def patched_modules(model) -> list:
    """The modules dmi has patched: an observed one's class is a patched subclass (or, where the
    instance had a forward of its own, it has dmi's bound on top); the model gets its step wrapper."""
    return [m for m in model.modules()
            if "forward" in m.__dict__ or "_dmi_sites" in m.__dict__ or "_dmi_unpatched" in type(m).__dict__]


@pytest.fixture
def write_spec(tmp_path):
    """Write a YAML hook spec (dedented text) to a file and return its path."""
    def write(text: str, name: str = "hooks.yaml"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path
    return write


@pytest.fixture
def shared_files_made(monkeypatch):
    """The paths of the shared files (dmi.shared_memory.shared_file: rings, handoff buffers) this
    process makes during the test, to check that none outlives its run. (A look at /dev/shm before
    and after would also see the files of runs in other pytest-xdist workers.)"""
    from dmi import shared_memory
    made, mkstemp = [], shared_memory.tempfile.mkstemp

    def recorded(*args, **kwargs):
        fd, path = mkstemp(*args, **kwargs)
        made.append(path)
        return fd, path
    monkeypatch.setattr(shared_memory.tempfile, "mkstemp", recorded)
    return made


@pytest.fixture(autouse=True)
def _frozen_heap():
    """What the process holds before a test is out of the garbage collector's full passes during it:
    vLLM calls ``gc.collect()`` several times per engine start and shutdown, and a full pass walks
    every object of a test process (about 0.5 s once vLLM is imported). vLLM's engine shutdown
    unfreezes (``gc.unfreeze()``), so what dies with an engine is still freed; so does the end of
    every test."""
    gc.freeze()
    yield
    gc.unfreeze()
