"""Model directories vLLM can load offline, with real-size shapes and no hub access.

    python perf/common/vllm_models.py OUT qwen3-8b              # config.json + tokenizer: load with load_format="dummy"
    python perf/common/vllm_models.py OUT qwen3-0.6b --weights  # + random bf16 safetensors (HF loads it too)

Shapes: Qwen3-0.6B, Qwen3-8B, Llama-3.1-8B (as in perf/offline.py), and ``tiny`` (CPU smoke runs).
Without ``--weights`` only the config and a tokenizer are written: vLLM's ``load_format="dummy"``
(``--load-format dummy``) fills the weights with random values on the GPU, so no multi-GB file is
written or read. The tokenizer is a byte-level BPE trained on a few sentences whose vocabulary is
padded with printable synthetic tokens (``<x123>``) to exactly the model's ``vocab_size``, so every
id a random model emits detokenizes.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

# (transformers config class, architecture, kwargs)
SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3-8b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "llama-3.1-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "tiny": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=2048, tie_word_embeddings=False, max_position_embeddings=4096)),
}
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]
_TEXT = ["The quick brown fox jumps over the lazy dog.", "Hello world, how are you today?",
         "Attention is all you need.", "Large language models generate text one token at a time.",
         "Paris is the capital of France.", "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000."]


def parameter_count(name: str) -> int:
    """The weights of a dense shape above (embeddings, attention, MLP, norms, the head unless tied;
    Qwen3's q/k norms are counted for Llama too: 256 weights a layer, for a memory estimate)."""
    kw = SHAPES[name][2]
    h, i, v, hd = kw["hidden_size"], kw["intermediate_size"], kw["vocab_size"], kw["head_dim"]
    q, kv = kw["num_attention_heads"] * hd, kw["num_key_value_heads"] * hd
    layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * hd      # qkv, o, gate/up/down, norms, q/k norms
    return v * h * (1 if kw.get("tie_word_embeddings") else 2) + kw["num_hidden_layers"] * layer + h


def tokenizer(vocab_size: int):
    """A fast tokenizer with exactly ``vocab_size`` ids (BPE + printable synthetic tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_TEXT * 20, trainers.BpeTrainer(
        vocab_size=min(600, vocab_size), special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), vocab_size):       # decode to themselves through the byte-level decoder
        vocab[f"<x{i}>"] = i
    tok = Tokenizer.from_str(json.dumps(spec))
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def config(name: str, tok=None):
    import transformers as tf
    cls, arch, kw = SHAPES[name]
    ids = dict(pad_token_id=0, bos_token_id=2, eos_token_id=3) if tok is None else dict(
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg = getattr(tf, cls)(**kw, **ids)
    cfg.architectures = [arch]
    cfg.dtype = "bfloat16"
    return cfg


def write_model(name: str, out: str | Path, *, weights: bool = False, seed: int = 0) -> str:
    """Write ``name``'s model directory to ``out`` (kept when it is complete already); returns its path."""
    out = Path(out)
    done = out / ".dmi-complete"
    want = {"name": name, "weights": weights, "seed": seed}
    if done.exists() and json.loads(done.read_text()) == want:
        return str(out)
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(SHAPES[name][2]["vocab_size"])
    cfg = config(name, tok)
    tok.save_pretrained(out)
    if weights:
        import torch
        import transformers as tf
        torch.manual_seed(seed)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(out)
        del model
    else:
        cfg.save_pretrained(out)
    done.write_text(json.dumps(want))
    print(f"vllm_models: {name} -> {out} ({'weights' if weights else 'config + tokenizer'}, "
          f"{time.time() - t0:.1f} s)", flush=True)
    return str(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("name", choices=sorted(SHAPES))
    ap.add_argument("--weights", action="store_true", help="also write random bf16 safetensors")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    write_model(a.name, a.out, weights=a.weights, seed=a.seed)
    print(sorted(os.listdir(a.out)))


if __name__ == "__main__":
    main()
