"""The model argument checked before anything loads, and tokenizers loaded (for capture and plot)."""
from __future__ import annotations

from .exits import UsageError


def load_tokenizer(model: str):
    from ..models import BUILTIN, tiny_tokenizer
    if model in BUILTIN:
        return tiny_tokenizer()
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        from ..models import load_failure
        raise UsageError(f"cannot load a tokenizer for {model!r}: {load_failure(model, e)}. "
                         f"Fix: pass a built-in model name or a local path / hub id with a tokenizer") from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise UsageError(f"the tokenizer of {model!r} has neither a pad nor an eos token; batched generation "
                             f"needs one. Fix: use --batch-size 1, or a tokenizer with a pad token")
        tok.pad_token = tok.eos_token
    return tok


def check_model(model: str) -> None:
    """The model argument, before anything loads (no tokenizer or config lookup on the hub for a typo)."""
    from ..models import model_arg_problem
    problem = model_arg_problem(model)
    if problem is not None:
        raise UsageError(f"--model {model}: {problem[0]}. Fix: {problem[1]}")
