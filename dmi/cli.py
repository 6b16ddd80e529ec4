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
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

PROG = "dmi"
EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DTYPES = ("float32", "bfloat16", "float16")


class UsageError(Exception):
    """Bad input from the command line (exit 2); the message is one line naming the fix."""


class RunFailed(Exception):
    """A failure after the model started running (exit 1); ``__cause__`` is the original error."""


# --- prompts ------------------------------------------------------------------------------------

@dataclass
class Prompt:
    id: str
    text: str
    line: int
    auto: bool = False      # the id was made up (p<N>), not given in the file


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSON-lines file: one object per line with "prompt" and an optional "id".

    Blank lines and lines starting with '#' are skipped. Default ids are p0, p1, ... (the prompt's
    index in the file). Every problem raises :class:`UsageError` naming the file and the line.
    """
    name = str(path)
    if name == "-":
        text, name = sys.stdin.read(), "<stdin>"
    else:
        p = Path(path)
        if not p.exists():
            raise UsageError(f"{name}: prompts file does not exist. Fix: check the path, or leave --prompts out "
                             f"to use the packaged example")
        if p.is_dir():
            raise UsageError(f"{name}: is a directory, not a prompts file. Fix: pass a .jsonl file")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{name}: cannot be read: {e}. Fix: pass a UTF-8 JSON-lines file") from None
    out: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{name}:{lineno}: not valid JSON ({e.msg} at column {e.colno}). "
                             f'Fix: write one JSON object per line, e.g. {{"id": "a", "prompt": "Hello"}}') from None
        if not isinstance(obj, dict):
            raise UsageError(f"{name}:{lineno}: expected a JSON object, got {type(obj).__name__}. "
                             f'Fix: write {{"prompt": "..."}} on each line')
        if "prompt" not in obj:
            raise UsageError(f"{name}:{lineno}: missing \"prompt\" (keys: {', '.join(map(repr, obj)) or 'none'}). "
                             f'Fix: add "prompt": "<text>" to this line')
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise UsageError(f"{name}:{lineno}: \"prompt\" must be a non-empty string. Fix: quote the prompt text")
        rid = obj.get("id", f"p{len(out)}")
        if isinstance(rid, bool) or not isinstance(rid, (str, int)) or str(rid) == "":
            raise UsageError(f"{name}:{lineno}: \"id\" must be a non-empty string or an integer, got {rid!r}. "
                             f"Fix: use a string id, or leave \"id\" out for p0, p1, ...")
        rid = str(rid)
        if rid in seen:
            raise UsageError(f"{name}:{lineno}: id {rid!r} is already used on line {seen[rid]}. "
                             f"Fix: give every prompt a unique id")
        seen[rid] = lineno
        out.append(Prompt(rid, obj["prompt"], lineno, auto="id" not in obj))
    if not out:
        raise UsageError(f"{name}: no prompts. Fix: write one JSON object per line, e.g. "
                         f'{{"id": "a", "prompt": "Hello"}}')
    return out


# --- capture --------------------------------------------------------------------------------------

def _example(name: str) -> Path:
    from .examples import example_path
    return example_path(name)


def _load_tokenizer(model: str):
    from .models import BUILTIN, tiny_tokenizer
    if model in BUILTIN:
        return tiny_tokenizer()
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        from .models import load_failure
        raise UsageError(f"cannot load a tokenizer for {model!r}: {load_failure(model, e)}. "
                         f"Fix: pass a built-in model name or a local path / hub id with a tokenizer") from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise UsageError(f"the tokenizer of {model!r} has neither a pad nor an eos token; batched generation "
                             f"needs one. Fix: use --batch-size 1, or a tokenizer with a pad token")
        tok.pad_token = tok.eos_token
    return tok


def _check_model(model: str) -> None:
    """The model argument, before anything loads (no tokenizer or config lookup on the hub for a typo)."""
    from .models import model_arg_problem
    problem = model_arg_problem(model)
    if problem is not None:
        raise UsageError(f"--model {model}: {problem[0]}. Fix: {problem[1]}")


def cmd_capture(args: argparse.Namespace) -> int:
    from .spec import load_hook_spec
    _check_model(args.model)
    spec = Path(args.spec) if args.spec else _example("hooks.yaml")
    prompts_path = args.prompts if args.prompts else _example("prompts.jsonl")
    prompts = read_prompts(prompts_path)         # cheap checks first: before loading a model
    hook = load_hook_spec(spec)
    if args.arch_spec:
        from .spec import load_arch_spec
        load_arch_spec(args.arch_spec)           # its schema errors before the model loads
    out = args.out or hook.data.get("store", {}).get("path")
    if not out:
        raise UsageError("no output store. Fix: pass --out out.zarr (or set store.path in the hook spec)")
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise UsageError("--max-new-tokens and --batch-size must be >= 1. Fix: pass a positive integer")
    from .store.preflight import check_resumable, check_store_writer, check_writable, stored_request_ids
    if args.ray and (args.resume or args.device or args.dtype):
        raise UsageError("--ray runs vLLM engines on Ray workers and writes a new store: --resume, --device and "
                         "--dtype do not apply. Fix: leave them out (engine keywords go in --engine)")
    if not args.ray and (args.workers != 1 or args.engine or args.ray_address):
        raise UsageError("--workers, --engine and --ray-address are for --ray. Fix: add --ray, or leave them out")
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite contradict each other. Fix: pass one of them")
    check_store_writer(out, hook)
    options = (hook.data.get("store") or {}).get("storage_options")
    if args.resume:                              # before spending time on the model
        check_resumable(out, {"hook_spec": hook.data, "model": {"name_or_path": args.model}}, hook.file, options)
        _new_ids(prompts, set(stored_request_ids(out, options)), "<stdin>" if str(prompts_path) == "-" else prompts_path,
                 out)
    else:
        check_writable(out, args.overwrite, options)

    if args.quiet:
        quiet_libraries()
    if args.ray:
        return _capture_on_ray(args, prompts, spec, out, options)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    import torch
    from . import load
    from .models import BUILTIN
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available. Fix: use --device cpu")
    torch.manual_seed(args.seed)
    tok = _load_tokenizer(args.model)
    kwargs: dict[str, Any] = {"seed": args.seed} if args.model in BUILTIN else {}
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        run = load(args.model, hook_spec=spec, store=out, overwrite=args.overwrite, resume=args.resume, dtype=dtype,
                   device=args.device, arch_spec=args.arch_spec, **kwargs)
    except OSError as e:
        from .errors import DmiError
        if isinstance(e, DmiError):
            raise
        from .models import load_failure
        raise UsageError(f"cannot load model {args.model!r}: {load_failure(args.model, e)}. Fix: pass a built-in model "
                         f"({', '.join(sorted(BUILTIN))}) or a local path / hub id") from None

    device = next(run.model.parameters()).device
    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": tok.pad_token_id}
    if tok.eos_token_id is not None:
        gen["eos_token_id"] = tok.eos_token_id
    # root attributes: this run (a resumed store keeps the runs before it) and each request's text
    stored = _stored_attrs(out) if args.resume else {}
    texts = dict(stored.get("texts") or {})
    run.close_attrs["cli"] = list(stored.get("cli") or []) + [{
        "started": started, "model": args.model, "seed": args.seed, "dtype": args.dtype, "device": str(device),
        "batch_size": args.batch_size, "generation": dict(gen), "requests": [p.id for p in prompts]}]
    run.close_attrs["texts"] = texts
    t0 = time.perf_counter()
    failed: BaseException | None = None
    done = 0
    bar = PromptProgress(len(prompts), args.max_new_tokens, disable=args.quiet)
    if not args.quiet:
        gen["logits_processor"] = bar.processors()
    try:
        for i in range(0, len(prompts), args.batch_size):
            batch = prompts[i:i + args.batch_size]
            enc = tok([p.text for p in batch], return_tensors="pt", padding=True)
            enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
            run.set_request_ids([p.id for p in batch])
            bar.batch(len(batch))
            with torch.inference_mode():
                seqs = run.model.generate(**enc, **gen)
            new = seqs[:, enc["input_ids"].shape[1]:].cpu()
            for p, ids in zip(batch, new):
                texts[p.id] = {"prompt": p.text, "generated": tok.decode(ids, skip_special_tokens=True)}
            done += len(batch)
            bar.done(done)
    except BaseException as e:    # close the run (flushes what was captured) before reporting
        failed = e
    finally:
        bar.close()
    try:
        run.close(error=failed)   # a failed capture leaves a consistent store marked 'failed'
    except BaseException as e:    # noqa: BLE001
        if failed is None:
            failed = e
    if isinstance(failed, KeyboardInterrupt):
        raise failed
    if failed is not None:
        raise RunFailed(f"capture into {run.store} failed after {done} of {len(prompts)} prompt(s): "
                        f"{type(failed).__name__}: {_first_line(failed)}") from failed
    from .store.inspect import format_summary, summarize
    stats = run.stats()
    if stats["store_error"]:     # policy.on_store_error drop: the model ran on, the store stopped
        _warn(f"{stats['store_error']}; policy.on_store_error is drop: "
              f"{stats['drops_by_reason'].get('sink', 0)} capture(s) dropped (reason sink)")
    print(f"captured {len(prompts)} prompt(s) into {run.store} in {time.perf_counter() - t0:.1f} s "
          f"({stats['steps']} steps)")
    from .errors import DmiError
    try:
        print(format_summary(summarize(run.store, options)))
    except (DmiError, OSError) as e:
        _warn(f"cannot summarize {run.store}: {e}")
    return EXIT_OK


class PromptProgress:
    """The capture's progress bar, in prompts, moving with every generated token: a batch of b
    prompts adds b / max_new_tokens a decode step (counted by a logits processor, which runs on the
    model's thread without a device sync), and the bar is set to the prompts done after each batch
    (one that stopped early at its eos token included)."""

    def __init__(self, total: int, max_new_tokens: int, disable: bool):
        from tqdm import tqdm
        self.per_step = self.limit = 0.0
        self.max_new_tokens = max_new_tokens
        self.bar = tqdm(total=total, unit="prompt", desc="capture", file=sys.stderr, disable=disable,
                        dynamic_ncols=True, mininterval=0.2,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total} prompts [{elapsed}<{remaining}]")

    def processors(self):
        from transformers import LogitsProcessor, LogitsProcessorList
        progress = self

        class _Step(LogitsProcessor):
            def __call__(self, input_ids, scores):
                progress.step()
                return scores
        return LogitsProcessorList([_Step()])

    def batch(self, prompts: int) -> None:
        self.per_step = prompts / self.max_new_tokens
        self.limit = self.bar.n + prompts           # (float steps never run past the batch)

    def step(self) -> None:
        k = min(self.per_step, self.limit - self.bar.n)
        if k > 0:
            self.bar.update(k)

    def done(self, prompts: int) -> None:
        self.bar.n = prompts
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _capture_on_ray(args: argparse.Namespace, prompts: list[Prompt], spec: Path, out: str, options) -> int:
    """``dmi capture --ray``: the prompts as a Ray dataset, captured by ``--workers`` vLLM engines
    into one store (``dmi.capture_dataset``, docs/ray.md)."""
    import json
    try:
        engine = json.loads(args.engine) if args.engine else {}
    except ValueError as e:
        raise UsageError(f"--engine: not JSON ({e}). Fix: pass an object of vllm.LLM keywords, e.g. "
                         f"--engine '{{\"max_model_len\": 4096}}'") from None
    if not isinstance(engine, dict):
        raise UsageError("--engine: expected a JSON object of vllm.LLM keywords. Fix: --engine '{\"max_model_len\": 4096}'")
    if args.workers < 1:
        raise UsageError("--workers must be >= 1. Fix: pass a positive integer")
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray Data. Fix: pip install 'dmi[ray]'") from None
    from .dataset import capture_dataset
    if not ray.is_initialized():
        ray.init(address=args.ray_address, log_to_driver=not args.quiet)
    ds = ray.data.from_items([{"id": p.id, "text": p.text} for p in prompts])
    model = args.model
    from .models import BUILTIN
    if model in BUILTIN:             # a built-in tiny model: saved once, where every local worker reads it
        from .adapters.vllm import save_builtin
        model = save_builtin(model, seed=args.seed)
    summary = capture_dataset(ds, model, str(spec), out, num_workers=args.workers, batch_size=args.batch_size,
                              sampling={"max_tokens": args.max_new_tokens, "temperature": 0.0},
                              overwrite=args.overwrite, progress=not args.quiet, **engine)
    print(f"captured {summary['requests']} requests with {args.workers} Ray worker(s) into {out}")
    files = summary["chunk_files"]
    print(f"merged {len(summary['parts'])} part(s): {files['linked']} chunk files hard-linked, "
          f"{files['server_copied']} copied by the storage, {files['copied']} read and written")
    from .store.inspect import format_summary, summarize
    print(format_summary(summarize(out, options)))
    return 0


def quiet_libraries() -> None:
    """-q: no progress bar of transformers (weight loading) or huggingface_hub (downloads) either."""
    from transformers.utils import logging as tf_logging
    tf_logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()
    except ImportError:
        pass


def _stored_attrs(store) -> dict:
    """The root attributes of an existing store (--resume)."""
    try:
        return json.loads((Path(store) / "zarr.json").read_text()).get("attributes") or {}
    except (OSError, ValueError):
        return {}


def _new_ids(prompts: list[Prompt], taken: set[str], path, store) -> None:
    """--resume: requests must not reuse the store's ids. Made-up ids move on to free p<N>; a
    given id already in the store is refused."""
    for p in prompts:
        if not p.auto and p.id in taken:
            raise UsageError(f"{path}:{p.line}: id {p.id!r} is already in the store {str(store)!r}. Fix: give this "
                             f"prompt a new id (--resume appends new requests after the stored ones)")
    used = taken | {p.id for p in prompts if not p.auto}
    k = 0
    for p in prompts:
        if p.auto:
            while f"p{k}" in used:
                k += 1
            p.id = f"p{k}"
            used.add(p.id)


# --- inspect --------------------------------------------------------------------------------------

def cmd_inspect(args: argparse.Namespace) -> int:
    from .store.inspect import format_summary, summarize
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


# --- plot -----------------------------------------------------------------------------------------

def cmd_plot(args: argparse.Namespace) -> int:
    from . import plot
    from .store.read import open_store
    tree = open_store(args.store)
    tok = _load_tokenizer(args.tokenizer or args.model) if (args.tokenizer or args.model) else None
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
    from .models import BUILTIN, build_tiny_model
    if name in BUILTIN:
        return build_tiny_model(name, seed=seed)
    _check_model(name)
    from transformers import AutoModelForCausalLM
    try:
        return AutoModelForCausalLM.from_pretrained(name)
    except (OSError, ValueError) as e:
        from .models import load_failure
        raise UsageError(f"--model {name}: cannot load it: {load_failure(name, e)}. Fix: pass a built-in model name or "
                         f"the local path the store was captured with") from None


# --- specs ----------------------------------------------------------------------------------------

def cmd_specs_list(args: argparse.Namespace) -> int:
    from .errors import DmiError
    from .spec import load_arch_spec, search_specs
    rows, bad, first = [], 0, {}
    for found in search_specs():
        try:
            doc = load_arch_spec(found.path)
        except DmiError as e:
            bad += 1
            rows.append({"family": found.path.stem, "model_types": [], "sites": None, "source": found.source,
                         "file": str(found.path), "error": str(e)})
            continue
        family = doc.data["family"]
        row = {"family": family, "model_types": list(doc.data["match"]["model_type"]),
               "sites": len(doc.data["sites"]), "source": found.source, "file": str(found.path)}
        if family in first:       # the search takes the first spec of a family
            row["shadowed_by"] = first[family]
        first.setdefault(family, str(found.path))
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        def source(r):
            return r["source"] + (" (shadowed)" if "shadowed_by" in r else "")
        wf = max([len("family")] + [len(r["family"]) for r in rows])
        wt = max([len("model_types")] + [len(", ".join(r["model_types"])) for r in rows])
        ws = max([len("source")] + [len(source(r)) for r in rows])
        print(f"{'family':<{wf}}  {'model_types':<{wt}}  {'sites':>5}  {'source':<{ws}}  file")
        for r in rows:
            sites = "ERR" if r["sites"] is None else r["sites"]
            print(f"{r['family']:<{wf}}  {', '.join(r['model_types']):<{wt}}  {sites:>5}  {source(r):<{ws}}  {r['file']}")
        for r in rows:
            if "error" in r:
                print(f"{PROG}: error: {r['error']}", file=sys.stderr)
            if "shadowed_by" in r:
                print(f"{PROG}: note: {r['file']} ({r['source']}) is not used: {r['shadowed_by']} comes first in the "
                      f"search for family {r['family']!r}", file=sys.stderr)
    return EXIT_FAIL if bad else EXIT_OK


def _arch_by_name(name: str):
    """An architecture spec by family name, by model_type, or by file path."""
    from .spec import effective_specs, load_arch_spec
    if Path(name).suffix in (".yaml", ".yml") or Path(name).is_file():
        return load_arch_spec(name)
    docs = [doc for _, doc in effective_specs()]
    for doc in docs:
        if doc.data["family"] == name:
            return doc
    for doc in docs:
        if name in doc.data["match"]["model_type"]:
            return doc
    import difflib
    families = sorted(d.data["family"] for d in docs)
    close = difflib.get_close_matches(name, families, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UsageError(f"--arch {name}: no architecture spec has this family (searched DMI_SPEC_PATH, the built-in "
                     f"specs and installed packages'). "
                     f"Fix: {hint}use one of {', '.join(families)} (see `dmi specs list`) or a spec file path")


def _config_for(family: str, model: str | None):
    """(config, label) to check a hook spec against: --model's config, else the family's tiny config."""
    if model:
        from .models import BUILTIN, tiny_config
        if model in BUILTIN:
            return tiny_config(BUILTIN[model]), model
        _check_model(model)
        from transformers import AutoConfig
        try:
            return AutoConfig.from_pretrained(model), model
        except (OSError, ValueError) as e:
            from .models import load_failure
            raise UsageError(f"--model {model}: cannot load its config: {load_failure(model, e)}. "
                             f"Fix: pass a built-in model name or a local path / hub id") from None
    from .models import tiny_config
    try:
        return tiny_config(family), f"tiny-{family}"
    except KeyError:
        return None, None


def _available(config, arch) -> set | None:
    """(canonical, layer) pairs that exist in a model of ``config`` (built on the meta device)."""
    try:
        import torch
        import transformers as tf
        from .adapters.hf import available_sites
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config)
        return available_sites(model, arch)
    except Exception:   # noqa: BLE001 - fall back to "every site exists"
        return None


def cmd_specs_validate(args: argparse.Namespace) -> int:
    from .errors import SpecError
    from .spec import load_arch_spec, load_hook_spec, load_yaml
    doc = load_yaml(args.file, what="spec")
    data = doc.data
    if isinstance(data, dict) and "capture" in data:
        kind = "hook"
    elif isinstance(data, dict) and "sites" in data and "family" in data:
        kind = "arch"
    else:
        keys = ", ".join(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise SpecError(f"cannot tell the kind of spec (top level: {keys})", file=doc.file, line=doc.line_of(()),
                        fix="a hook spec has a top-level `capture:` list; an architecture spec has `family:` "
                            "and `sites:`")
    if kind == "arch":
        return _validate_arch(load_arch_spec(args.file), args)
    hook = load_hook_spec(args.file)
    if args.arch:
        arch = _arch_by_name(args.arch)
    elif args.model:
        from .spec import find_arch_spec
        config, _ = _config_for("", args.model)
        arch = find_arch_spec(config.model_type)
    else:
        arch = _arch_by_name("qwen3")
    return _validate_hook(hook, arch, args)


def _validate_arch(arch, args) -> int:
    from .models import check_on_tiny_model, tiny_config
    from .plan import build_plan
    from .spec import Document
    d = arch.data
    per_layer = sum(1 for s in d["sites"].values() if s.get("per_layer"))
    print(f"{arch.file}: ok: architecture spec, family {d['family']}, model_type {', '.join(d['match']['model_type'])}")
    print(f"  {len(d['sites'])} sites ({per_layer} per layer, {len(d['sites']) - per_layer} model-level); "
          f"dims: {', '.join(f'{k}={v}' for k, v in d['dims'].items())}")
    print(f"  sites: {', '.join(d['sites'])}")
    from .spec import outside_vocabulary
    for name, where, hint in outside_vocabulary(arch):
        _warn(f"{where}: sites.{name}: {name!r} is not in the site vocabulary. Fix: {hint}")
    config = tiny_config(arch)        # from the spec alone: its model_type's config class, dims, `tiny:` block
    probe = Document({"capture": [{"sites": ["*"]}], "policy": {"ring_bytes": "1GiB"}}, f"<all sites of {arch.file}>")
    plan = build_plan(arch, probe, config, available=_available(config, arch))
    rows = check_on_tiny_model(arch)
    print(f"  captured from a real tiny {type(config).__name__} model ({plan.layers} layers, prefill and decode): "
          f"{len(plan.sites)} site instances in {len(rows)} store groups, dims as the spec says")
    return EXIT_OK


def _validate_hook(hook, arch, args) -> int:
    from .errors import SpecError
    from .plan import build_plan
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    config, label = _config_for(arch.data["family"], args.model)
    if config is None:
        print(f"{hook.file}: ok: hook spec (schema only: no built-in tiny config for family "
              f"{arch.data['family']!r}; pass --model to check sites and layers against a model config)")
        return EXIT_OK
    if args.model:
        from .spec import check_arch_matches
        check_arch_matches(arch, getattr(config, "model_type", None))
    try:
        plan = build_plan(arch, hook, config, model_dtype_itemsize=itemsize, available=_available(config, arch))
    except SpecError as e:
        if not args.model and any(k in (e.key or "") for k in ("layers", "heads", "ring_bytes", "topk")):
            e.note = (f"checked against the built-in {label} config ({config.num_hidden_layers} layers); "
                      f"pass --model <path or hub id> to check against your model")
        raise
    from .interventions import plan_interventions
    writes = plan_interventions(arch, hook, config, available=_available(config, arch), engine="hf",
                                anchor_of=lambda canonical, layer: arch.data["sites"][canonical].get("hf"))
    print(f"{hook.file}: ok: hook spec, {len(plan.sites)} site instances in "
          f"{len({s.group for s in plan.sites})} store groups"
          + (f", {len(writes)} intervention(s)" if writes else ""))
    print(f"  checked against: {label} (family {plan.family}, {plan.layers} layers), arch spec {arch.file}")
    rows: dict[str, list] = {}
    for s in plan.sites:
        rows.setdefault(s.group, []).append(s)
    from .store.inspect import layers_text
    wg = max(len(g) for g in rows)
    print(f"  {'group':<{wg}}  {'layers':<8}  {'tokens':<10}  {'bytes/row':>9}  {'bytes/token':>11}  outputs")
    per_token = 0
    for g, sites in rows.items():
        s = sites[0]
        layers = layers_text([x.layer for x in sites]) if s.layer is not None else "-"
        row = s.row_bytes(itemsize)
        total = sum(x.row_bytes(itemsize) for x in sites)
        per_token += total
        outputs = "; ".join(f"{o.name} ({', '.join(f'{d}={n}' for d, n in zip(o.dims, o.shape))})" for o in s.outputs)
        print(f"  {g:<{wg}}  {layers:<8}  {_tokens_text(s.tokens):<10}  {row:>9,}  {total:>11,}  {outputs}")
    pol = plan.policy
    fits = pol.ring_bytes // per_token if per_token else 0
    print(f"  per token (all sites, {args.dtype}): {per_token:,} bytes; policy {pol.mode}, ring {pol.ring_bytes:,} bytes "
          f"(~{fits:,} tokens per step)")
    return EXIT_OK


def _tokens_text(flt) -> str:
    parts = []
    if flt.phase != "all":
        parts.append(flt.phase)
    if flt.last:
        parts.append("last")
    if flt.every_n_steps > 1:
        parts.append(f"every {flt.every_n_steps}")
    if flt.positions:
        parts.append(f"pos {flt.positions[0]}-{flt.positions[1]}")
    if flt.max_per_request:
        parts.append(f"max {flt.max_per_request}")
    return ",".join(parts) or "all"


# --- parser ---------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one line (exit 2) instead of the full usage block."""

    def error(self, message: str):   # noqa: D401
        self.exit(EXIT_USAGE, f"{PROG}: error: {message}. Fix: see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0].rstrip(".")


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
    from .errors import AnchorError, CaptureError, DmiError
    try:
        return args.func(args)
    except UsageError as e:
        _err(str(e))
        return EXIT_USAGE
    except RunFailed as e:
        _err(str(e) + ("" if args.traceback else " (run with --traceback for details)"),
             exc=e.__cause__ if args.traceback else None)
        return EXIT_FAIL
    except AnchorError as e:      # the installed engine does not match the spec: not the user's input
        _err(str(e))
        return EXIT_FAIL
    except DmiError as e:         # SpecError, PolicyError, StoreError, ...: bad input, named and fixable
        if isinstance(e, CaptureError):
            _err(str(e), exc=e if args.traceback else None)
            return EXIT_FAIL
        _err(str(e))
        note = getattr(e, "note", None)
        if note:
            print(f"{PROG}: note: {note}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:       # `dmi inspect ... | head`
        return EXIT_OK
    except Exception as e:        # noqa: BLE001 - runtime failure: one line, traceback on request
        _err(f"{type(e).__name__}: {_first_line(e)}" + ("" if args.traceback else
                                                         " (run with --traceback for details)"),
             exc=e if args.traceback else None)
        return EXIT_FAIL


def _warn(msg: str) -> None:
    print(f"{PROG}: warning: {msg}", file=sys.stderr)


def _err(msg: str, exc: BaseException | None = None) -> None:
    if exc is not None:
        import traceback
        traceback.print_exception(exc, file=sys.stderr)
    print(f"{PROG}: error: {msg}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
