"""The ``dmi`` command line.

    dmi capture --out out.zarr                     # packaged example spec + prompts, tiny-qwen3
    dmi capture --model Qwen/Qwen3-0.6B --spec hooks.yaml --prompts prompts.jsonl --out out.zarr
    dmi capture --resume --out out.zarr --prompts more.jsonl   # append after the last committed step
    dmi inspect out.zarr [--json]
    dmi plot attention out.zarr --request r0 --layer 1 --head 0 -o attn.png
    dmi plot logit-lens out.zarr --model tiny-qwen3 -o lens.png
    dmi specs list
    dmi specs validate hooks.yaml [--arch qwen3 | --arch-spec FILE | --model NAME]
    dmi capture --model <dir> --arch-spec my_family.yaml --out out.zarr

Exit codes: 0 ok, 2 bad input (one clear line on stderr), 1 runtime failure, 130 interrupted.

Modules: ``prompts`` (the prompts file), ``loading`` (model argument, tokenizer), ``capture``
(``dmi capture``, local and on Ray), ``progress`` (its progress bar), ``show`` (``dmi inspect``,
``dmi plot``), ``specs`` (``dmi specs list/validate``), ``exits`` (exit codes, errors, messages);
here: the argument parser and :func:`main`.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .capture import cmd_capture, quiet_libraries
from .exits import (DTYPES, EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, PROG, RunFailed, UsageError,
                    first_line, print_error)
from .progress import PromptProgress
from .prompts import Prompt, read_prompts
from .show import cmd_inspect, cmd_plot
from .specs import cmd_specs_list, cmd_specs_validate

__all__ = ["DTYPES", "EXIT_FAIL", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "PROG", "Prompt", "PromptProgress",
           "RunFailed", "UsageError", "build_parser", "cmd_capture", "cmd_inspect", "cmd_plot", "cmd_specs_list",
           "cmd_specs_validate", "main", "quiet_libraries", "read_prompts"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one line (exit 2) instead of the full usage block."""

    def error(self, message: str):   # noqa: D401
        self.exit(EXIT_USAGE, f"{PROG}: error: {message}. Fix: see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    p = _Parser(prog=PROG, description="Declarative capture of LLM internals into Zarr stores.",
                epilog="Exit codes: 0 ok, 2 bad input, 1 runtime failure. Start with: dmi capture --out out.zarr")
    p.add_argument("--version", action="version", version=f"dmi {__version__}")
    p.add_argument("--traceback", action="store_true", help="print the full traceback of a runtime failure")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    c = sub.add_parser("capture", help="run prompts through a model and capture its internals into a store",
                       description="Greedy-generate from each prompt (batched, left padding) with the hook spec's "
                                   "sites patched in, then print a summary of the store.")
    c.add_argument("--model", default="tiny-qwen3",
                   help="built-in tiny model (tiny-qwen3, tiny-llama3_1, tiny-qwen3_moe, tiny-mixtral) or a "
                        "local path / hub id (default: tiny-qwen3)")
    c.add_argument("--spec", help="hook spec YAML (default: the packaged example dmi/examples/hooks.yaml)")
    c.add_argument("--arch-spec", metavar="FILE",
                   help="architecture spec YAML of the model's family (default: the spec whose match.model_type lists "
                        "the model's, searched in DMI_SPEC_PATH, the built-in specs, then installed packages' "
                        "dmi.specs entry points)")
    c.add_argument("--prompts", help='JSON lines, one {"prompt": ..., "id": ...} per line; "-" reads stdin '
                                     "(default: the packaged example dmi/examples/prompts.jsonl)")
    c.add_argument("--out", help="the Zarr store to write: a directory, or an object store URL such as "
                                 "s3://bucket/run.zarr (default: store.path of the hook spec)")
    c.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per prompt (default 8)")
    c.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default 8)")
    c.add_argument("--overwrite", action="store_true", help="replace the store if it exists")
    c.add_argument("--resume", action="store_true",
                   help="append to an existing store (one whose run was killed, or a closed one) after its last "
                        "committed step; same hook spec and model; prompts get ids the store does not hold yet")
    c.add_argument("--dtype", choices=DTYPES, help="model dtype (default: float32 for built-ins, the checkpoint's "
                                                   "dtype otherwise)")
    c.add_argument("--device", choices=("cpu", "cuda"), help="where the model runs (default: where it loads, cpu)")
    c.add_argument("--seed", type=int, default=0, help="random seed (weights of built-in models; default 0)")
    c.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars (the capture's, and transformers' and the hub's while the model loads)")
    c.add_argument("--ray", action="store_true",
                   help="capture with vLLM engines on Ray Data workers into one store (docs/ray.md; needs dmi[ray])")
    c.add_argument("--workers", type=int, default=1, help="with --ray: engines (Ray actors) running at once (default 1)")
    c.add_argument("--ray-address", metavar="ADDRESS",
                   help="with --ray: the Ray cluster (default: RAY_ADDRESS, else a local Ray)")
    c.add_argument("--engine", metavar="JSON", help='with --ray: vllm.LLM keywords, e.g. \'{"max_model_len": 4096}\'')
    c.set_defaults(func=cmd_capture)

    i = sub.add_parser("inspect", help="summarize a store: model, sites, arrays, requests, bytes, drops",
                       description="Summarize a dmi store (works on open, closed and failed runs).")
    i.add_argument("store", help="path of the Zarr store, or its object store URL (s3://bucket/run.zarr)")
    i.add_argument("--storage-options", metavar="JSON",
                   help="an object store's file system options as a JSON object (endpoint_url, anon, ...); "
                        "credentials otherwise come from the environment and config files")
    i.add_argument("--json", action="store_true", help="print the summary as JSON")
    i.set_defaults(func=cmd_inspect)

    pl = sub.add_parser("plot", help="draw a picture of a store as a PNG: attention, resid-norms, logit-lens",
                        description="Pictures of a store (needs matplotlib: pip install 'dmi[plot]'). Token text on "
                                    "the axes comes from the store's token ids and --tokenizer (or --model's).")
    psub = pl.add_subparsers(dest="plot_command", metavar="PICTURE", parser_class=_Parser)
    pa = psub.add_parser("attention", help="one request's attention pattern of one layer and head")
    pa.add_argument("--layer", type=int, default=0, help="layer (default 0)")
    pa.add_argument("--head", type=int, default=0, help="head (default 0)")
    pr = psub.add_parser("resid-norms", help="mean residual-stream norm per layer, one line per request")
    pr.add_argument("--site", default="resid_post", help="resid_post (default), resid_pre or resid_mid")
    pn = psub.add_parser("logit-lens", help="each layer's resid_post through the final norm and unembedding")
    for q in (pa, pr, pn):
        q.add_argument("store", help="path of the Zarr store")
        q.add_argument("--out", "-o", required=True, help="the PNG file to write")
        q.set_defaults(func=cmd_plot)
    for q in (pa, pn):
        q.add_argument("--request", help="the request id (default: the first in the store)")
        q.add_argument("--tokenizer", help="built-in model name or local path whose tokenizer names the tokens")
    pa.set_defaults(model=None, seed=0)
    pr.set_defaults(model=None, tokenizer=None, seed=0)
    pn.add_argument("--model", help="the model the store was captured from (built-in name or local path)")
    pn.add_argument("--seed", type=int, default=0, help="seed of a built-in model's weights (default 0)")
    pl.set_defaults(func=None, _help=pl)

    s = sub.add_parser("specs", help="list built-in architecture specs, validate a spec file",
                       description="Architecture specs (one per model family) and hook specs (yours).")
    ssub = s.add_subparsers(dest="specs_command", metavar="SUBCOMMAND", parser_class=_Parser)
    sl = ssub.add_parser("list", help="the architecture specs dmi finds", description="List the architecture specs "
                         "in search order (DMI_SPEC_PATH, built-in, installed packages' dmi.specs entry points): "
                         "family, model_types, number of sites, source, file.")
    sl.add_argument("--json", action="store_true", help="print as JSON")
    sl.set_defaults(func=cmd_specs_list)
    sv = ssub.add_parser("validate", help="validate an architecture spec or a hook spec",
                         description="Validate a spec file. A file with top-level `family` and `sites` is an "
                                     "architecture spec; one with `capture` is a hook spec, which is also resolved "
                                     "against an architecture (default qwen3) and a model config (the family's tiny "
                                     "config, or --model's).")
    sv.add_argument("file", help="the YAML file")
    sv.add_argument("--arch", "--arch-spec", dest="arch", help="architecture family, model_type or spec file to check a hook spec against "
                                   "(default: qwen3, or --model's)")
    sv.add_argument("--model", help="check against this model's config (built-in name, local path or hub id) "
                                    "instead of the family's tiny config")
    sv.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype for the bytes per row (default float32)")
    sv.set_defaults(func=cmd_specs_validate)
    s.set_defaults(func=None, _help=s)
    p.set_defaults(func=None, _help=p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dmi`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:       # --help / --version (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if args.func is None:
        helper = getattr(args, "_help", parser)
        helper.print_help(sys.stderr)
        return EXIT_USAGE
    from ..errors import AnchorError, CaptureError, DmiError
    try:
        return args.func(args)
    except UsageError as e:
        print_error(str(e))
        return EXIT_USAGE
    except RunFailed as e:
        print_error(str(e) + ("" if args.traceback else " (run with --traceback for details)"),
             exc=e.__cause__ if args.traceback else None)
        return EXIT_FAIL
    except AnchorError as e:      # the installed engine does not match the spec: not the user's input
        print_error(str(e))
        return EXIT_FAIL
    except DmiError as e:         # SpecError, PolicyError, StoreError, ...: bad input, named and fixable
        if isinstance(e, CaptureError):
            print_error(str(e), exc=e if args.traceback else None)
            return EXIT_FAIL
        print_error(str(e))
        note = getattr(e, "note", None)
        if note:
            print(f"{PROG}: note: {note}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print_error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:       # `dmi inspect ... | head`
        return EXIT_OK
    except Exception as e:        # noqa: BLE001 - runtime failure: one line, traceback on request
        print_error(f"{type(e).__name__}: {first_line(e)}" + ("" if args.traceback else
                                                         " (run with --traceback for details)"),
             exc=e if args.traceback else None)
        return EXIT_FAIL
