"""Shared fixtures: tiny random-init models of each family, a local tokenizer, spec files."""
from __future__ import annotations

import copy
import os
import textwrap

import pytest
import torch

from dmi.models import build_tiny_model, tiny_tokenizer
import failure_log

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)


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

# One entry per architecture family: adding a family = one spec file + one entry here.
FAMILIES = ["qwen3", "llama3_1", "qwen3_moe", "mixtral"]
MOE_FAMILIES = {"qwen3_moe", "mixtral"}

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


WINDOWED = {"qwen3": "layers 1, 2 of 3 sliding", "qwen3_moe": "every layer sliding", "mixtral": "every layer sliding"}


def windowed_pair(family: str, window: int, attn: str = "eager", seed: int = 0):
    """:func:`model_pair` of a family with a sliding attention window of ``window`` keys (the
    families in ``WINDOWED``; Qwen3 mixes full and sliding layers, as ``max_window_layers`` does)."""
    import transformers as tf
    from dmi.models import tiny_config
    config = tiny_config(family)
    if family == "mixtral":
        config.sliding_window = window
    else:       # (Qwen3's config derives each layer's type from these when it is built)
        extra = {"max_window_layers": 1, "layer_types": None} if family == "qwen3" else {}
        config = type(config)(**{**config.to_dict(), "use_sliding_window": True, "sliding_window": window, **extra})
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
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
