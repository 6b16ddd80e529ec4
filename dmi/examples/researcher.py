"""A researcher's first capture, end to end on the built-in tiny model (no model hub, no store).

    python -m dmi.examples.researcher pictures/

Capture the residual stream and the attention patterns of a few prompts into memory, then draw an
attention pattern, the residual norms per layer and a logit lens into ``pictures/``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

import dmi
import dmi.plot
from dmi.models import build_tiny_model, tiny_tokenizer

HOOK_SPEC = {
    "capture": [
        {"sites": ["resid_post", "final_norm"]},           # every layer's residual stream, every token
        {"sites": ["attn.pattern"], "layers": [0, 1]},     # attention weights over key positions
    ],
}
PROMPTS = {"fox": "The quick brown fox jumps over the lazy dog.", "capital": "What is the capital of France?"}


def main(out_dir: str = "pictures") -> list[Path]:
    out = Path(out_dir)
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()                       # left padding, as batched generation needs
    model = build_tiny_model("tiny-qwen3", seed=0)
    inputs = tokenizer(list(PROMPTS.values()), return_tensors="pt", padding=True)
    with dmi.load(model, hook_spec=HOOK_SPEC) as run:  # no store: the result stays in memory
        run.set_request_ids(list(PROMPTS))             # the rows' request coordinate
        with torch.no_grad():
            run.model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    tree = run.result()                                # xarray.DataTree, as dmi.open gives for a store
    print(f"captured {run.stats()['steps']} steps; groups: "
          f"{', '.join(n.path for n in tree.subtree if n.dataset.data_vars)}")
    paths = [out / "attention_fox_layer1_head0.png", out / "resid_norms.png", out / "logit_lens_capital.png"]
    dmi.plot.attention(tree, request="fox", layer=1, head=0, tokenizer=tokenizer, out=paths[0])
    dmi.plot.resid_norms(tree, out=paths[1])
    dmi.plot.logit_lens(tree, model, request="capital", tokenizer=tokenizer, out=paths[2])
    for p in paths:
        print(f"wrote {p}")
    return paths


if __name__ == "__main__":
    main(*sys.argv[1:2])
