"""Hugging Face Transformers adapter: resolve spec anchors to modules and patch them at load time."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections import defaultdict

import torch

from ...errors import AnchorError, DmiError
from ...kernels import side
from ...plan import Plan
from ...siteop import SiteHandle, WriteHandle, constant_sites, run_of, run_ticket
from ...spec import Document
from .patch import AnchorNotFound, SITES_ATTR, SourceEdit, constant_sites_class, parameter_position, patch_module


def transformers_version() -> str:
    import transformers
    return transformers.__version__


def available_sites(model: torch.nn.Module, arch: Document) -> set[tuple[str, int | None]]:
    """(canonical, layer) pairs whose HF module exists in this model (MoE sites only on MoE layers)."""
    n_layers = model.config.num_hidden_layers
    out = set()
    for canonical, site in arch.data["sites"].items():
        anchor = site.get("hf")
        if anchor is None:
            continue
        for layer in (range(n_layers) if site.get("per_layer") else [None]):
            if module_at(model, anchor["module"], layer) is not None:
                out.add((canonical, layer))
    return out


def module_at(model: torch.nn.Module, pattern: str, layer: int | None):
    try:
        return model.get_submodule(pattern.format(i=layer) if layer is not None else pattern)
    except AttributeError:
        return None


def _anchor_error(arch: Document, site_name: str, module, what: str) -> AnchorError:
    rng = arch.data.get("hf", {}).get("transformers", "unspecified")
    line = arch.line_of(("sites", site_name, "hf"))
    return AnchorError(
        f"{arch.file}:{line}: sites.{site_name}.hf: {what} not found in {type(module).__qualname__}.forward of the "
        f"installed transformers {transformers_version()}; this spec was written for transformers {rng}. "
        f"Fix: install transformers {rng}, or update the anchor in {arch.file} to this version's source "
        f"({inspect.getsourcefile(type(module))})")


def check_unpatched(model: torch.nn.Module) -> None:
    """Refuse a model another open run has patched: its sites would feed both runs."""
    for name, m in model.named_modules():
        handles = m.__dict__.get(SITES_ATTR)
        if handles:
            other = run_of(next(iter(handles.values())).run)
            raise DmiError(f"dmi.load: this {type(model).__name__} is already patched by an open run (module "
                           f"{name or '(the model)'}, store {getattr(other, 'store', '?')}). Fix: close that run "
                           f"(run.close(), or leave its with block) before loading another on the same model")


def group_sites(model: torch.nn.Module, plan: Plan, arch: Document, handle_of) -> tuple[dict, dict, dict, dict]:
    """(edits, inputs, outputs, handles) per module for the planned sites; ``handle_of(site index)``
    gives each site's handle (a run's, or the load-time probe's: :mod:`.probe`)."""
    edits: dict[torch.nn.Module, list[SourceEdit]] = defaultdict(list)
    inputs: dict[torch.nn.Module, list] = defaultdict(list)
    outputs: dict[torch.nn.Module, list] = defaultdict(list)
    handles: dict[torch.nn.Module, dict[str, SiteHandle]] = defaultdict(dict)
    for s in plan.sites:
        _place(model, arch, s.canonical, s.layer, s.anchor, handle_of(s.index), edits, inputs, outputs, handles)
    return edits, inputs, outputs, handles


def _place(model, arch: Document, canonical: str, layer, anchor: dict, handle: SiteHandle, edits, inputs, outputs,
           handles) -> None:
    """Group one site's handle under its module, by anchor kind (:func:`group_sites`)."""
    module = module_at(model, anchor["module"], layer)
    if module is None:
        raise _anchor_error(arch, canonical, model, f"module {anchor['module'].format(i=layer)!r}")
    handles[module][canonical] = handle
    if "assign" in anchor or "compute" in anchor:
        edits[module].append(SourceEdit.of(canonical, anchor))
    elif "input" in anchor:
        try:
            pos, name = parameter_position(module, anchor["input"])
        except AnchorNotFound as e:
            raise _anchor_error(arch, canonical, module, str(e)) from None
        inputs[module].append((pos, name, canonical))
    else:
        outputs[module].append((anchor["output"], canonical, anchor.get("order_by")))


def add_write_sites(model, arch: Document, run, edits, inputs, outputs, handles) -> None:
    """The sites the run's interventions write (:mod:`dmi.interventions`): a captured site's handle
    gets them, a site nothing captures gets a handle that only writes."""
    for (canonical, layer), write in run.interventions.sites.items():
        anchor = arch.data["sites"][canonical]["hf"]
        module = module_at(model, anchor["module"], layer)
        handle = handles.get(module, {}).get(canonical) if module is not None else None
        if handle is not None:
            handles[module][canonical] = WriteHandle.over(handle, run, write)
        else:
            _place(model, arch, canonical, layer, anchor, WriteHandle.over(None, run, write), edits, inputs, outputs,
                   handles)


def patch_sites(arch: Document, edits: dict, inputs: dict, outputs: dict, handles: dict) -> list:
    """Patch every module of :func:`group_sites`; returns the undo functions (all undone on a failure)."""
    undo: list = []
    try:
        for module, sites in handles.items():
            mod_edits = tuple(sorted(edits[module], key=lambda e: e.canonical))
            try:
                undo.append(patch_module(module, sites, mod_edits, tuple(inputs[module]), tuple(outputs[module])))
            except AnchorNotFound as e:
                raise _anchor_error(arch, e.site or mod_edits[0].canonical, module, str(e)) from None
    except BaseException:
        for fn in reversed(undo):
            fn()
        raise
    return undo


def attach(model: torch.nn.Module, plan: Plan, arch: Document, run) -> callable:
    """Patch every planned site into ``model``; returns a function that undoes it."""
    edits, inputs, outputs, handles = group_sites(model, plan, arch, lambda index: SiteHandle.of(run, index))
    if run.interventions:
        add_write_sites(model, arch, run, edits, inputs, outputs, handles)

    undo: list = []
    saved = {name: model.__dict__[name] for name in _STEP_ATTRS if name in model.__dict__}

    def detach() -> None:
        for fn in reversed(undo):
            fn()
        undo.clear()
        for name in _STEP_ATTRS:
            model.__dict__.pop(name, None)
        model.__dict__.update(saved)

    try:
        undo += patch_sites(arch, edits, inputs, outputs, handles)
        _wrap_step(model, run, list(handles))
    except BaseException:
        detach()            # a half-patched model is never handed back
        raise
    return detach


def _step_inputs(given: dict) -> tuple:
    """(tokens, attention_mask, position_ids, cache) of a causal-LM call, by argument name:
    transformers 5.24 renamed past_key_values to cache."""
    tokens = given.get("input_ids")
    tokens = tokens if tokens is not None else given.get("inputs_embeds")
    cache = given.get("past_key_values")
    cache = cache if cache is not None else given.get("cache")
    return tokens, given.get("attention_mask"), given.get("position_ids"), cache


def _wrap_step(model: torch.nn.Module, run, patched: list) -> None:
    """Bracket each top-level forward with dmi::step_begin / dmi::step_end (one forward = one step).
    ``patched``: the modules patched with sites, which generate()'s compiled forward (the whole
    model as one graph) gets with constant sites (``patch.constant_sites_class``)."""
    inner = model.forward
    run_id = run.id
    traced = list(getattr(run.ring, "traced_views", {}).values()) or None   # step_end follows their writes (dmi.siteop)
    params = list(inspect.signature(inner).parameters)

    def step_inputs(args, kwargs):
        return _step_inputs({**dict(zip(params, args)), **kwargs})

    @functools.wraps(inner)   # keeps the signature: generate() inspects it (e.g. logits_to_keep)
    def forward(*args, **kwargs):
        tokens, mask, position_ids, cache = step_inputs(args, kwargs)
        past_len = cache.get_seq_length() if cache is not None else 0
        past_t = past_len if isinstance(past_len, torch.Tensor) else None      # static caches keep it on device
        mask = mask if isinstance(mask, torch.Tensor) else None
        ticket = run_ticket(run_id)     # (where the site ops read it: one graph input)
        torch.ops.dmi.step_begin(tokens, mask, position_ids, 0 if past_t is not None else past_len,
                                 past_t, ticket, run_id)
        if torch.compiler.is_compiling():
            out = inner(*args, **kwargs)
        else:
            try:
                out = inner(*args, **kwargs)
            except BaseException:
                run.abort_step()        # eager: end the step now, which frees the run for other threads
                raise
        torch.ops.dmi.step_end(ticket, run_id, traced)
        return out

    model.forward = forward

    # generate(): the 2D mask it prepares (the model gets a 4D one with static caches) feeds the
    # token bookkeeping, and its compiled per-step forward (a CUDA graph with reduce-overhead) runs
    # with the step's host work outside it
    prepare = model.prepare_inputs_for_generation

    @functools.wraps(prepare)
    def prepare_inputs_for_generation(*args, **kwargs):
        run.note_generation_mask(kwargs.get("attention_mask"))
        return prepare(*args, **kwargs)

    compiled_call = model.get_compiled_call
    options = run.plan.engine         # the hook spec's engine section
    chain = hasattr(run.ring, "side_streams") and options.side != "0"
    if chain:
        run.ring.side_streams = run.ring.is_cuda
    # the patched modules get classes whose code names their sites when generate() first compiles its
    # forward (patch.constant_sites_class); engine.constant_sites: false keeps the handles (a baseline
    # for perf/diagnostics/guardcost.py)
    constants = patched if options.constant_sites else []

    @functools.wraps(compiled_call)
    def get_compiled_call(compile_config=None, *args, **kwargs):
        if chain:
            compile_config = _chained(compile_config or _default_compile_config(model))
        while constants:        # once (detach restores the unpatched classes)
            module = constants.pop()
            module.__class__ = constant_sites_class(module) or type(module)
        return run.stepped(constant_sites(compiled_call(compile_config, *args, **kwargs)), step_inputs)

    # one generate() at a time per run: its steps share the run's request bookkeeping, so another
    # thread's step meanwhile is refused (Run.exclusive)
    generate = model.generate

    @functools.wraps(generate)
    def generate_(*args, **kwargs):
        with run.exclusive("generate"):
            return generate(*args, **kwargs)

    model.prepare_inputs_for_generation = prepare_inputs_for_generation
    model.get_compiled_call = get_compiled_call
    model.generate = generate_


def _default_compile_config(model):
    """What get_compiled_call compiles with when generate() names no config (5.19:
    ``_default_compile_config``, TPUs aside; before it, ``CompileConfig()``)."""
    default = getattr(model, "_default_compile_config", None)
    if default is not None:
        return default()
    from transformers import CompileConfig
    return CompileConfig()


def _chained(config):
    """transformers' ``CompileConfig`` for generate()'s compiled forward with dmi's side-stream chain
    (:func:`dmi.kernels.side.chain_captures`) among inductor's passes, where that forward replays a
    CUDA graph (``reduce-overhead``): each replay then runs the capture kernels beside the model's
    instead of between them. ``config`` itself where inductor does not compile it, no graph is
    captured, or a post-grad pass of the user's is set (left alone; captures stay inline).
    (``mode`` becomes the options it stands for: torch.compile takes one or the other.)"""
    from torch._inductor import list_mode_options
    options = dict(config.options or {})
    if config.backend != "inductor" or "post_grad_custom_post_pass" in options or (config.mode and options):
        return config
    options = {**list_mode_options(config.mode), **options}
    if not options.get("triton.cudagraphs"):
        return config
    return dataclasses.replace(config, mode=None, options={**options, "post_grad_custom_post_pass": side.chain_pass()})


_STEP_ATTRS = ("forward", "prepare_inputs_for_generation", "get_compiled_call", "generate")
