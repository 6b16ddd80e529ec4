"""Built-in tiny models: random-init configs of each family and a small local BPE tokenizer.

No model hub is needed: these are what the tests, the README's first command and the CPU CI use.
Real models go through ``dmi.load("org/name")`` (``from_pretrained``) unchanged.
"""
from __future__ import annotations

from functools import lru_cache

_CORPUS = """The quick brown fox jumps over the lazy dog. A model's internals are a window into how it
computes: residual streams carry features from layer to layer, attention heads move information
between positions, and MLPs write new features. Observability means seeing these while serving.
Interpretability researchers probe layers, safety teams monitor activations, and serving engineers
watch the cost. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000. Hello world! How are you today? What is
the capital of France? Paris is the capital of France. Tell me a story about a dragon and a knight.
Once upon a time there was a small robot who wanted to learn how to paint the sea at night."""

TINY_VOCAB = 512
TINY_TOKENIZER_VOCAB = 320


def tiny_config(family: str):
    """A small random-init config of ``family`` (qwen3, llama3_1, qwen3_moe, mixtral)."""
    import transformers as tf
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32)
    if family == "llama3_1":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
        return tf.LlamaConfig(**common, head_dim=32, rope_parameters=rope)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                 decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)
    if family == "mixtral":
        return tf.MixtralConfig(**common, head_dim=32, num_local_experts=4, num_experts_per_tok=2)
    raise KeyError(family)


BUILTIN = {f"tiny-{f}": f for f in ("qwen3", "llama3_1", "qwen3_moe", "mixtral")}


def model_arg_problem(model) -> tuple[str, str] | None:
    """(problem, fix) for a model argument that cannot name a model, found without the network;
    None when it may (a built-in name, an existing directory, a hub id ``org/name``, a bare name
    in the local hub cache). A path-like argument (``/``, ``.`` or ``~`` first, or more than one
    ``/``) must exist; a bare name that is no built-in must be in the hub cache (a hub id without
    an organization is looked up offline: it never waits for the network)."""
    import difflib
    from pathlib import Path
    builtins = ", ".join(sorted(BUILTIN))
    name = str(model)
    if name in BUILTIN:
        return None
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir():
            return None
        return (f"{name!r} is a file, not a model directory",
                "pass the directory that holds the model's config.json")
    if not isinstance(model, str) or name.startswith((".", "~", "/")) or name.count("/") > 1 or name.endswith("/"):
        return (f"no such directory: {str(path)!r}",
                f"check the path, or pass a built-in model ({builtins}) or a hub id (org/name)")
    if "/" in name:
        return None            # org/name: a hub id, for from_pretrained
    if _in_hub_cache(name):
        return None
    close = difflib.get_close_matches(name, sorted(BUILTIN), n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (f"{name!r} is not a built-in model, a local directory or a model in the hub cache",
            f"{hint}built-in models: {builtins}; give a hub model by its full id (org/name)")


def _in_hub_cache(repo_id: str) -> bool:
    """A model's config in the local hub cache (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:       # an id the hub would refuse, no huggingface_hub: not cached
        return False


def build_tiny_model(name: str, seed: int = 0, dtype=None, attn_implementation: str = "sdpa"):
    """A built-in tiny model (``tiny-qwen3`` ...) with random weights from ``seed``."""
    import torch
    import transformers as tf
    if name not in BUILTIN:
        raise KeyError(f"unknown built-in model {name!r}; built-in models: {sorted(BUILTIN)}")
    config = tiny_config(BUILTIN[name])
    config._name_or_path = name
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32,
                                                attn_implementation=attn_implementation)
    return model.eval()


@lru_cache(maxsize=1)
def tiny_tokenizer():
    """A byte-level BPE tokenizer trained in-process on a small built-in corpus (left padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_TOKENIZER_VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side="left")
