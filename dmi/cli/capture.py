"""``dmi capture``: prompts through a model (transformers here, or vLLM engines on Ray workers)
into a store, then a summary of it."""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path
from typing import Any

from .exits import EXIT_OK, RunFailed, UsageError, first_line, warn
from .loading import check_model, load_tokenizer
from .progress import PromptProgress
from .prompts import Prompt, read_prompts


def _example(name: str) -> Path:
    from ..examples import example_path
    return example_path(name)


def cmd_capture(args: argparse.Namespace) -> int:
    from ..spec import load_hook_spec
    check_model(args.model)
    spec = Path(args.spec) if args.spec else _example("hooks.yaml")
    prompts_path = args.prompts if args.prompts else _example("prompts.jsonl")
    prompts = read_prompts(prompts_path)         # cheap checks first: before loading a model
    hook = load_hook_spec(spec)
    if args.arch_spec:
        from ..spec import load_arch_spec
        load_arch_spec(args.arch_spec)           # its schema errors before the model loads
    out = args.out or hook.data.get("store", {}).get("path")
    if not out:
        raise UsageError("no output store. Fix: pass --out out.zarr (or set store.path in the hook spec)")
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise UsageError("--max-new-tokens and --batch-size must be >= 1. Fix: pass a positive integer")
    from ..store.preflight import check_resumable, check_store_writer, check_writable, stored_request_ids
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
    from .. import load
    from ..models import BUILTIN
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available. Fix: use --device cpu")
    torch.manual_seed(args.seed)
    tok = load_tokenizer(args.model)
    kwargs: dict[str, Any] = {"seed": args.seed} if args.model in BUILTIN else {}
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        run = load(args.model, hook_spec=spec, store=out, overwrite=args.overwrite, resume=args.resume, dtype=dtype,
                   device=args.device, arch_spec=args.arch_spec, **kwargs)
    except OSError as e:
        from ..errors import DmiError
        if isinstance(e, DmiError):
            raise
        from ..models import load_failure
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
                        f"{type(failed).__name__}: {first_line(failed)}") from failed
    from ..store.inspect import format_summary, summarize
    stats = run.stats()
    if stats["store_error"]:     # policy.on_store_error drop: the model ran on, the store stopped
        warn(f"{stats['store_error']}; policy.on_store_error is drop: "
              f"{stats['drops_by_reason'].get('sink', 0)} capture(s) dropped (reason sink)")
    print(f"captured {len(prompts)} prompt(s) into {run.store} in {time.perf_counter() - t0:.1f} s "
          f"({stats['steps']} steps)")
    from ..errors import DmiError
    try:
        print(format_summary(summarize(run.store, options)))
    except (DmiError, OSError) as e:
        warn(f"cannot summarize {run.store}: {e}")
    return EXIT_OK


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
    from ..dataset import capture_dataset
    if not ray.is_initialized():
        ray.init(address=args.ray_address, log_to_driver=not args.quiet)
    ds = ray.data.from_items([{"id": p.id, "text": p.text} for p in prompts])
    model = args.model
    from ..models import BUILTIN
    if model in BUILTIN:             # a built-in tiny model: saved once, where every local worker reads it
        from ..adapters.vllm import save_builtin
        model = save_builtin(model, seed=args.seed)
    summary = capture_dataset(ds, model, str(spec), out, num_workers=args.workers, batch_size=args.batch_size,
                              sampling={"max_tokens": args.max_new_tokens, "temperature": 0.0},
                              overwrite=args.overwrite, progress=not args.quiet, **engine)
    print(f"captured {summary['requests']} requests with {args.workers} Ray worker(s) into {out}")
    files = summary["chunk_files"]
    print(f"merged {len(summary['parts'])} part(s): {files['linked']} chunk files hard-linked, "
          f"{files['server_copied']} copied by the storage, {files['copied']} read and written")
    from ..store.inspect import format_summary, summarize
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
