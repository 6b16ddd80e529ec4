"""``dmi inspect`` and ``dmi plot``: a store summarized as text or JSON, or drawn as a PNG."""
from __future__ import annotations

import argparse
import json

from .exits import EXIT_OK, UsageError
from .loading import check_model, load_tokenizer


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..store.inspect import format_summary, summarize
    options = None
    if args.storage_options:
        try:
            options = json.loads(args.storage_options)
        except ValueError as e:
            options = e
        if not isinstance(options, dict):
            raise UsageError(f"--storage-options {args.storage_options}: not a JSON object ({options}). Fix: give "
                             f"one, e.g. --storage-options '{{\"endpoint_url\": \"http://localhost:9000\"}}'")
    info = summarize(args.store, options)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_summary(info))
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    from .. import plot
    from ..store.read import open_store
    tree = open_store(args.store)
    tok = load_tokenizer(args.tokenizer or args.model) if (args.tokenizer or args.model) else None
    if args.plot_command == "attention":
        plot.attention(tree, request=args.request, layer=args.layer, head=args.head, tokenizer=tok, out=args.out)
    elif args.plot_command == "resid-norms":
        plot.resid_norms(tree, site=args.site, out=args.out)
    else:
        if not args.model:
            raise UsageError("logit-lens needs the model's final norm and unembedding. Fix: pass --model (the "
                             "built-in name and --seed, or the local path the store was captured with)")
        plot.logit_lens(tree, _plot_model(args.model, args.seed), request=args.request, tokenizer=tok, out=args.out)
    print(f"wrote {args.out}")
    return EXIT_OK


def _plot_model(name: str, seed: int):
    from ..models import BUILTIN, build_tiny_model
    if name in BUILTIN:
        return build_tiny_model(name, seed=seed)
    check_model(name)
    from transformers import AutoModelForCausalLM
    try:
        return AutoModelForCausalLM.from_pretrained(name)
    except (OSError, ValueError) as e:
        from ..models import load_failure
        raise UsageError(f"--model {name}: cannot load it: {load_failure(name, e)}. Fix: pass a built-in model name or "
                         f"the local path the store was captured with") from None
