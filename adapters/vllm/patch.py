"""Load-time patching of vLLM model source from the spec's ``vllm:`` anchors.

Same mechanisms as the HF adapter (``dmi.adapters.hf.patch``): ``assign`` and ``compute`` anchors
rewrite the class's ``forward`` from its source (``compute: attention_pattern`` calls
``dmi.adapters.vllm.pattern``); ``input``/``output`` anchors wrap the instance's ``forward`` (or
another method named by ``method``). ``rows: sampled`` (logits) is read by the run's step
bookkeeping, not here. Two things vLLM needs on top:

* a list under ``input``/``output`` is **summed** (``None`` elements skipped): vLLM carries the
  residual stream as two tensors, ``hidden_states + residual``. Two tensors go to
  ``dmi::capture_sum``, which copies the rows of their sum without adding them as a graph op
  (Inductor would give that add a kernel of its own in every layer: vLLM fuses it into the next
  RMSNorm). The built-in specs anchor the stream where that fused add+RMSNorm returns the sum
  instead (output 1: one tensor to copy), through ``{i+1}`` paths (the next layer) and the
  ``first`` / ``last`` anchors of layer 0 and the last layer (:func:`layer_anchor`). A capture
  of some outputs of a module takes its other outputs as ``after`` (``dmi.siteop.site``): vLLM's
  lowering of that fused add+RMSNorm places the normalized output after the op otherwise, and
  Inductor then computes the sum in a kernel of its own in every layer;
* ``order_by: N`` reorders the last axis by descending value of output ``N`` (vLLM's CPU router
  returns its top-k unsorted; the canonical order is by descending weight).

Module paths are attribute paths from the vLLM model (``model.layers.{i}.mlp.experts.router``): a
part may name a plain attribute, not only a submodule. Instances that observe nothing are untouched.
"""
from __future__ import annotations

import functools
import inspect
from collections import defaultdict

import torch

from ...errors import AnchorError
from ...siteop import SiteHandle, WriteHandle, site, site_sum
from ..hf.derived import DERIVED
from ..hf.patch import SITES_ATTR, AnchorNotFound, SourceEdit, bind_rewritten, ordered, put_output, rewrite_forward
from . import compat
from .pattern import sliding_window, vllm_attention_pattern

DERIVED.setdefault("vllm_attention_pattern", vllm_attention_pattern)


def module_path(pattern: str, layer: int | None) -> str:
    """An anchor's attribute path for one layer: ``{i}`` is the layer, ``{i+1}`` the next one."""
    if layer is None:
        return pattern
    return pattern.replace("{i+1}", str(layer + 1)).format(i=layer)


def layer_anchor(anchor: dict, layer: int | None, n_layers: int) -> dict:
    """The anchor a site of ``layer`` uses. The residual stream is summed by vLLM in each layer's
    fused add+RMSNorm, so a spec anchors it there: ``resid_pre`` at the layer's own norm, whose
    layer 0 has no residual to add (its ``first`` anchor: the layer's input), ``resid_post`` at the
    next layer's (``{i+1}``), which the last layer does not have (its ``last`` anchor: the final
    norm). ``first`` and ``last`` are whole anchors of their own."""
    if layer == 0 and "first" in anchor:
        return anchor["first"]
    if layer == n_layers - 1 and "{i+1}" in anchor["module"]:
        return anchor["last"]
    return anchor


def resolve(root, pattern: str, layer: int | None):
    """The object at an attribute path (``{i}`` = layer, ``{i+1}`` the next), or None when it does not exist."""
    obj = root
    for part in module_path(pattern, layer).split("."):
        if part.isdigit() and isinstance(obj, (torch.nn.ModuleList, list, tuple)):
            idx = int(part)
            if idx >= len(obj):
                return None
            obj = obj[idx]
        else:
            obj = getattr(obj, part, None)
        if obj is None:
            return None
    if type(obj).__name__ == "PPMissingLayer":    # pipeline stages keep placeholders for other ranks' layers
        return None
    return obj


def _param_position(fn, spec: int | str) -> tuple[int, str]:
    params = [p for p in inspect.signature(inspect.unwrap(fn)).parameters.values()
              if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    names = [p.name for p in params]
    if isinstance(spec, int):
        if spec >= len(params):
            raise AnchorNotFound(f"input #{spec} ({fn.__qualname__} has {len(params)} parameters)")
        return spec, names[spec]
    if spec not in names:
        raise AnchorNotFound(f"input parameter {spec!r} (parameters of {fn.__qualname__}: {names})")
    return names.index(spec), spec


def _summed(parts):
    """Sum of the non-None tensors (the residual stream of vLLM's layers: hidden_states + residual)."""
    parts = [p for p in parts if p is not None]
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def _capture_parts(handle, parts, after=None) -> None:
    """Capture the sum of the non-None tensors: two through ``dmi::capture_sum``. ``after``: the
    module's other outputs (``siteop.site``: compiled code places the op after them)."""
    parts = [p for p in parts if p is not None]
    if len(parts) == 2:
        site_sum(handle, parts[0], parts[1], after)
    else:
        site(handle, _summed(parts), after)


def _other_outputs(out, taken) -> list | None:
    """The tensors of a tuple output besides those at ``taken``: what a capture of those follows."""
    if not isinstance(out, (tuple, list)):
        return None
    return [t for i, t in enumerate(out) if i not in taken and isinstance(t, torch.Tensor)] or None


class _Capture:
    """One site of one wrapped method: which arguments/outputs feed it, and how. ``probes``: the
    linear probes read from the captured value (``dmi.adapters.vllm.probes``)."""
    __slots__ = ("handle", "inputs", "outputs", "order_by", "probes")

    def __init__(self, handle, inputs=None, outputs=None, order_by=None, probes=()):
        self.handle, self.inputs, self.outputs, self.order_by = handle, inputs, outputs, order_by
        self.probes = tuple(probes)


def _probe(probes, parts) -> None:
    """Each probe of the value the capture read: the sum of the non-None ``parts``."""
    parts = [p for p in parts if p is not None]
    for p in probes:
        p(parts[0], parts[1]) if len(parts) == 2 else p(_summed(parts))


def _written(c, x):
    """:func:`site` of a write handle, and its probes of the value the capture reads."""
    y = site(c.handle, x)
    if c.probes:
        _probe(c.probes, [x if c.handle.write.capture_first else y])
    return y


def _pick_output(out, index):
    if isinstance(out, (tuple, list)):
        return out[index]
    if index != 0:
        raise IndexError(f"output {index} of a single-tensor output")
    return out


def wrap_method(obj, method: str, captures: list[_Capture]) -> None:
    """Wrap ``obj.<method>`` (bound, instance attribute) so its inputs/outputs pass through site ops.
    A site interventions write (a :class:`dmi.siteop.WriteHandle`: one tensor, :func:`dmi.interventions.write_problem`)
    hands the written tensor on to the method or to its caller."""
    inner = getattr(obj, method)

    @functools.wraps(inner)
    def wrapped(*args, **kwargs):
        for c in captures:
            if c.inputs is not None:
                if type(c.handle) is WriteHandle:
                    (pos, name), = c.inputs
                    if pos < len(args):
                        args = args[:pos] + (_written(c, args[pos]),) + args[pos + 1:]
                    else:
                        kwargs[name] = _written(c, kwargs[name])
                else:
                    parts = [args[pos] if pos < len(args) else kwargs.get(name) for pos, name in c.inputs]
                    _capture_parts(c.handle, parts)
                    if c.probes:
                        _probe(c.probes, parts)
        out = inner(*args, **kwargs)
        for c in captures:
            if c.outputs is not None:
                parts = [_pick_output(out, i) for i in c.outputs]
                if type(c.handle) is WriteHandle:
                    written = site(c.handle, parts[0], _other_outputs(out, c.outputs))
                    if c.probes:
                        _probe(c.probes, [parts[0] if c.handle.write.capture_first else written])
                    out = put_output(out, c.outputs[0], written)
                elif c.order_by is None:
                    _capture_parts(c.handle, parts, _other_outputs(out, c.outputs))
                    if c.probes:
                        _probe(c.probes, parts)
                else:
                    site(c.handle, ordered(_summed(parts), _pick_output(out, c.order_by)))
        return out

    setattr(obj, method, wrapped)


def available_sites(model, arch, n_layers: int) -> tuple[set[tuple[str, int | None]], dict[str, str]]:
    """(canonical, layer) pairs whose vLLM anchor resolves in this model, and the canonical sites
    whose anchor resolves but is never called in this engine, with why (``compat.never_calls``)."""
    out, never = set(), {}
    for canonical, s in arch.data["sites"].items():
        anchor = s.get("vllm")
        if anchor is None or anchor.get("unsupported"):
            continue
        for layer in (range(n_layers) if s.get("per_layer") else [None]):
            a = layer_anchor(anchor, layer, n_layers)
            obj = resolve(model, a["module"], layer)
            if obj is None or (a.get("method") is not None and not hasattr(obj, a["method"])):
                continue
            path, _, child = a["module"].rpartition(".")
            why = a.get("method") and compat.never_calls(resolve(model, path, layer) if path else model, child, a["method"])
            if why:
                never[canonical] = why
            else:
                out.add((canonical, layer))
    return out, never


def anchor_error(arch, site_name: str, obj, what: str) -> AnchorError:
    rng = arch.data.get("vllm", {}).get("versions", "unspecified")
    line = arch.line_of(("sites", site_name, "vllm"))
    src = inspect.getsourcefile(type(obj)) if obj is not None else "?"
    return AnchorError(
        f"{arch.file}:{line}: sites.{site_name}.vllm: {what} not found in {type(obj).__qualname__} of the installed "
        f"vllm {compat.vllm_version()}; this spec was written for vllm {rng}. Fix: install vllm {rng}, or update the "
        f"anchor in {arch.file} to this version's source ({src})")


_SOURCE_KEYS = ("assign", "occurrence", "from_call", "compute", "after_call", "args")


def attach(model: torch.nn.Module, plan, arch, run) -> callable:
    """Patch every planned site (its ``anchor`` is the spec's ``vllm`` entry) into ``model``."""
    source_edits: dict = defaultdict(list)
    handles: dict = defaultdict(dict)
    methods: dict = defaultdict(list)        # (id(obj), method) -> captures
    objects: dict = {}
    sites = [(s.canonical, s.layer, s.anchor, SiteHandle.of(run, s.index)) for s in plan.sites]
    from .probes import Probes
    run.probes = Probes(plan.probes, run.interventions.device, run.interventions.rows)
    for (canonical, layer), write in run.interventions.sites.items():
        mine = [k for k, (c, lay, _, _) in enumerate(sites) if (c, lay) == (canonical, layer)]
        if mine:
            c, lay, a, h = sites[mine[0]]
            sites[mine[0]] = (c, lay, a, WriteHandle.over(h, run, write))
        else:                  # a site nothing captures: a handle that only writes
            anchor = layer_anchor(arch.data["sites"][canonical]["vllm"], layer, plan.layers)
            sites.append((canonical, layer, dict(anchor, module=module_path(anchor["module"], layer)),
                          WriteHandle.over(None, run, write)))
    for canonical, layer, a, handle in sites:
        obj = resolve(model, a["module"], layer)
        if obj is None:
            raise anchor_error(arch, canonical, model, f"module {module_path(a['module'], layer)!r}")
        if "assign" in a or "compute" in a:
            if "compute" in a:     # vLLM's own derived function (dmi.adapters.vllm.pattern), fed this module
                a = dict(a, compute=f"vllm_{a['compute']}", args=dict(a["args"], layer="self"))
                # (heads, max_keys, sliding window): constants for the op
                planned = plan.by_layer_site()[(canonical, layer)]
                obj._dmi_pattern = (planned.shape[0], planned.shape[-1], sliding_window(obj))
            source_edits[obj].append(SourceEdit.of(canonical, a, _SOURCE_KEYS))
            handles[obj][canonical] = handle
            continue
        method = a.get("method", "forward")
        fn = getattr(obj, method, None)
        if fn is None:
            raise anchor_error(arch, canonical, obj, f"method {method!r}")
        if "input" in a:
            specs = a["input"] if isinstance(a["input"], list) else [a["input"]]
            try:
                cap = _Capture(handle, inputs=[_param_position(fn, p) for p in specs],
                               probes=run.probes.at.get((canonical, layer), ()))
            except AnchorNotFound as e:
                raise anchor_error(arch, canonical, obj, str(e)) from None
        else:
            outs = a["output"] if isinstance(a["output"], list) else [a["output"]]
            cap = _Capture(handle, outputs=outs, order_by=a.get("order_by"), probes=run.probes.at.get((canonical, layer), ()))
        methods[(id(obj), method)].append(cap)
        objects[id(obj)] = obj

    patched: list[tuple[object, str]] = []
    for obj, edits in source_edits.items():
        try:
            fn = rewrite_forward(type(obj), tuple(sorted(edits, key=lambda e: e.canonical)))
        except AnchorNotFound as e:
            raise anchor_error(arch, edits[0].canonical, obj, str(e)) from None
        setattr(obj, SITES_ATTR, handles[obj])
        bind_rewritten(obj, fn)
        patched.append((obj, "forward"))
    for (oid, method), caps in methods.items():
        wrap_method(objects[oid], method, caps)
        patched.append((objects[oid], method))

    def detach() -> None:
        for obj, method in patched:
            for name in (method, SITES_ATTR, "_dmi_pattern"):
                obj.__dict__.pop(name, None)
    return detach
