"""Load-time patching of HF model source: the site op goes into the code, no forward hooks.

Two mechanisms, chosen by the anchor kind of the architecture spec:

* ``assign`` / ``compute`` anchors rewrite the class's ``forward`` from its source (AST): after
  the anchored assignment we insert ``var = __dmi_site__(self, "attn.q", var)``; after the
  anchored call we insert ``__dmi_compute__(self, "attn.pattern", ...)``. The rewritten function
  is compiled once per class.
* ``input`` / ``output`` anchors wrap ``forward`` in a function generated once per class and
  anchor set, with the argument positions, names and output indices written into its code.

An observed instance gets that forward through its class: its ``__class__`` becomes a subclass
made once per (class, patched forward), with the original's name (:func:`patch_module`), and the
instance holds only its sites' handles (``_dmi_sites``). A compiled forward then guards a patched
module as any module, by its type, plus each handle's few attributes (an instance-level
``forward`` closing over lists of handles cost ~10 guards a site more, evaluated before every
call; tests/test_compile.py pins the guards per site). Every instance of a class shares that forward's code, so a layer compiled
on its own (``layer.compile()``) reuses one graph for all layers: the handle names the site by a
tensor (``dmi.siteop``).

Code that compiles the whole model as one graph (generate()'s compiled forward) reuses nothing
across layers, and there the handles' guards are all Dynamo adds to an unpatched model's (~12 guard
lines a site, evaluated before every decode step). :func:`constant_sites_class` gives such an
instance a class of its own instead, whose forward has its sites' run and index written into its
code and whose dict holds its bases' attributes: Dynamo guards it by its type, which it guards
anyway, and passes no extra MRO level (perf/diagnostics/guardcost.py). An instance that already has a
``forward`` of its own (accelerate's hooks) keeps it, with the patched forward bound on top.

Instances that observe nothing keep their class.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass

import torch

from ...siteop import SiteHandle, WriteHandle, site, site_at
from .derived import DERIVED

SITES_ATTR = "_dmi_sites"
PATCH_ATTR = "_dmi_patch"      # a patched class's (edits, inputs, outputs): what constant_sites_class rebuilds


@dataclass(frozen=True)
class SourceEdit:
    canonical: str
    anchor: tuple          # frozen anchor items (hashable: rewritten functions are cached by them)

    @classmethod
    def of(cls, canonical: str, anchor: dict, keys: tuple[str, ...] | None = None) -> "SourceEdit":
        items = ((k, tuple(sorted(v.items())) if isinstance(v, dict) else tuple(v) if isinstance(v, list) else v)
                 for k, v in anchor.items() if keys is None or k in keys)
        return cls(canonical, tuple(sorted(items)))


def _dmi_site(module, canonical: str, x):
    handle = getattr(module, SITES_ATTR, {}).get(canonical)
    return x if handle is None else site(handle, x)


def compute_derived(module, canonical: str, fn: str, **kwargs):
    handle = getattr(module, SITES_ATTR, {}).get(canonical)
    if handle is not None:
        site(handle, DERIVED[fn](**kwargs))


def _dmi_compute_at(run: int, site_index: int, fn: str, **kwargs):
    site_at(run, site_index, DERIVED[fn](**kwargs))


def _calls(node: ast.AST, name: str) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            if (isinstance(f, ast.Name) and f.id == name) or (isinstance(f, ast.Attribute) and f.attr == name):
                return True
    return False


def _assigns(stmt: ast.stmt, var: str) -> bool:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
    for t in targets:
        for sub in ast.walk(t):
            if isinstance(sub, ast.Name) and sub.id == var:
                return True
    return False


def _statements(body: list[ast.stmt]):
    """(statement, the list holding it) in source order, into if/for/with/try blocks."""
    for stmt in body:
        yield stmt, body
        for attr in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, attr, None)
            if isinstance(inner, list) and not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from _statements(inner)
        for h in getattr(stmt, "handlers", []):
            yield from _statements(h.body)


class AnchorNotFound(Exception):
    """``site``: the canonical site whose anchor is missing (None: the module as a whole)."""

    def __init__(self, what: str, site: str | None = None):
        super().__init__(what)
        self.site = site


def _find(fn_node: ast.FunctionDef, anchor: dict) -> tuple[ast.stmt, list]:
    stmts = list(_statements(fn_node.body))
    if "assign" in anchor:
        hits = [(s, b) for s, b in stmts if _assigns(s, anchor["assign"])]
        if "from_call" in anchor:
            hits = [(s, b) for s, b in hits if _calls(s, anchor["from_call"])]
            what = f"assignment of {anchor['assign']!r} from a call to {anchor['from_call']!r}"
            if not hits:
                raise AnchorNotFound(what)
            return hits[0]
        k = anchor.get("occurrence", 0)
        what = f"assignment #{k} of {anchor['assign']!r} ({len(hits)} found)"
        if not -len(hits) <= k < len(hits):
            raise AnchorNotFound(what)
        return hits[k]
    hits = [(s, b) for s, b in stmts if _calls(s, anchor["after_call"])]
    if not hits:
        raise AnchorNotFound(f"statement calling {anchor['after_call']!r}")
    return hits[0]


def _inserted(anchor: dict, canonical: str, like: ast.stmt, at: tuple | None = None) -> ast.stmt:
    """The site call after ``like``: through the instance's handle, or with ``at`` (run, site
    index, write) written in (:func:`constant_sites_class`)."""
    kwargs = ", ".join(f"{k}={expr}" for k, expr in dict(anchor.get("args", ())).items())
    if "assign" in anchor:
        v = anchor["assign"]
        code = f"{v} = __dmi_site__(self, {canonical!r}, {v})" if at is None else f"{v} = {_site_at(at, v)}"
    elif at is None:
        code = f"__dmi_compute__(self, {canonical!r}, {anchor['compute']!r}, {kwargs})"
    else:
        code = f"__dmi_compute_at__({at[0]}, {at[1]}, {anchor['compute']!r}, {kwargs})"
    node = ast.parse(code).body[0]
    for sub in ast.walk(node):
        sub.lineno, sub.col_offset = like.lineno, like.col_offset
        sub.end_lineno, sub.end_col_offset = like.end_lineno, like.end_col_offset
    return node


@functools.lru_cache(maxsize=None)
def rewrite_forward(cls: type, edits: tuple[SourceEdit, ...]):
    """``cls.forward`` with the site calls inserted. Raises AnchorNotFound naming what is missing."""
    return _rewrite(cls, edits, {})


def _site_at(at: tuple, x: str) -> str:
    """The call of :func:`dmi.siteop.site_at` on ``x`` with ``at`` (run, site index, write or
    None) written in: a write site's literal is plain values (``WriteSite.literal``)."""
    run, index, write = at
    return f"__dmi_site_at__({run}, {index}, {x}{'' if write is None else f', {write!r}'})"


def _rewrite(cls: type, edits: tuple[SourceEdit, ...], at: dict[str, tuple]):
    """:func:`rewrite_forward`; a site named in ``at`` with its (run, site index, write) written in."""
    fn = cls.forward
    raw = inspect.unwrap(fn)
    if raw.__code__.co_freevars:
        raise AnchorNotFound(f"{cls.__qualname__}.forward is a closure ({raw.__code__.co_freevars}); it cannot be rewritten")
    lines, first = inspect.getsourcelines(raw)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first - 1)
    fn_node = tree.body[0]
    assert isinstance(fn_node, ast.FunctionDef), fn_node
    placed = []   # anchors are all found first, then inserts go in from the bottom up
    for edit in edits:
        try:
            stmt, body = _find(fn_node, dict(edit.anchor))
        except AnchorNotFound as e:
            raise AnchorNotFound(str(e), edit.canonical) from None
        placed.append((body, body.index(stmt), _inserted(dict(edit.anchor), edit.canonical, stmt,
                                                         at.get(edit.canonical))))
    for body, index, new in reversed(sorted(placed, key=lambda p: p[1])):
        body.insert(index + 1, new)
    module_globals = raw.__globals__
    module_globals.setdefault("__dmi_site__", _dmi_site)
    module_globals.setdefault("__dmi_compute__", compute_derived)
    module_globals.setdefault("__dmi_site_at__", site_at)
    module_globals.setdefault("__dmi_compute_at__", _dmi_compute_at)
    code = compile(ast.Module(body=[fn_node], type_ignores=[]), inspect.getsourcefile(raw) or "<dmi>", "exec")
    namespace: dict = {}
    exec(code, module_globals, namespace)
    new_fn = namespace[fn_node.name]
    new_fn.__dmi_patched__ = True
    return new_fn


def _call_prior(self, *args, **kwargs):
    """An instance's own forward from before dmi patched it (accelerate's hooks)."""
    return self._dmi_prior_forward(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def io_forward(inner, inputs: tuple[tuple[int, str, str], ...], outputs: tuple[tuple[int, str], ...],
               writes: frozenset = frozenset()):
    """``inner`` (a forward taking ``self``) with ``inputs`` ((position, name, canonical)) passed
    through the site op before it and ``outputs`` ((index, canonical, order_by)) after it. Generated code:
    positions, names and indices are constants of it, and its globals are its own (Dynamo guards
    them once, whatever instance runs it). ``writes``: output sites interventions change, whose
    value the forward returns in place of the module's (:func:`put_output`)."""
    return _io_forward(inner, inputs, outputs, {}, writes)


@functools.lru_cache(maxsize=None)
def _io_scope(inner) -> dict:
    """The globals of ``inner``'s generated forwards: one dict for all of them (one guard)."""
    return {"__dmi_capture__": site, "__dmi_site_at__": site_at, "__dmi_inner__": inner, "__dmi_ordered__": ordered,
            "__dmi_put__": put_output}


def put_output(out, index: int, value):
    """``out`` with element ``index`` (or itself, a single tensor) replaced by ``value``: an output
    site an intervention changed."""
    if isinstance(out, tuple):
        return out[:index] + (value,) + out[index + 1:]
    if isinstance(out, list):
        return out[:index] + [value] + out[index + 1:]
    return value


def ordered(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """x with its last axis reordered by descending ``key`` (stable: ties keep the module's order):
    an ``order_by`` anchor (top-k routing a router returns unsorted)."""
    order = torch.sort(key.float(), dim=-1, descending=True, stable=True).indices
    return torch.gather(x, -1, order)


def _io_forward(inner, inputs, outputs, at: dict[str, tuple], writes: frozenset = frozenset()):
    """:func:`io_forward`; a site named in ``at`` with its (run, site index, write) written in."""
    def capture(canonical: str, x: str) -> str:
        if canonical in at:
            return _site_at(at[canonical], x)
        return f"__dmi_capture__(self.__dict__[{SITES_ATTR!r}][{canonical!r}], {x})"
    lines = ["def forward(self, *args, **kwargs):"]
    for pos, name, canonical in inputs:
        lines += [f"    if len(args) > {pos}:",
                  f"        args = args[:{pos}] + ({capture(canonical, f'args[{pos}]')},) + args[{pos + 1}:]",
                  f"    elif {name!r} in kwargs:",
                  f"        kwargs[{name!r}] = {capture(canonical, f'kwargs[{name!r}]')}"]
    lines.append("    out = __dmi_inner__(self, *args, **kwargs)")
    for index, canonical, order_by in outputs:
        value = f"out[{index}] if isinstance(out, (tuple, list)) else out"
        if order_by is not None:
            value = f"__dmi_ordered__(out[{index}], out[{order_by}])"
        if canonical in writes:
            lines.append(f"    out = __dmi_put__(out, {index}, {capture(canonical, value)})")
        else:
            lines.append(f"    {capture(canonical, value)}")
    lines.append("    return out")
    namespace: dict = {}
    exec(compile("\n".join(lines), f"<dmi: {getattr(inner, '__qualname__', 'forward')} with sites>", "exec"),
         _io_scope(inner), namespace)
    fn = namespace["forward"]
    fn.__wrapped__, fn.__doc__ = inner, inner.__doc__
    return fn


def _own(cls: type, forward, patch: tuple) -> dict:
    """What a patched subclass of ``cls`` defines itself: ``forward``, ``cls``'s names, and what
    it was patched from (``patch``: (edits, inputs, outputs) that made ``forward``)."""
    return {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "_dmi_unpatched": cls, PATCH_ATTR: patch}


@functools.lru_cache(maxsize=None)
def patched_class(cls: type, forward, patch: tuple = ()) -> type:
    """``cls`` with ``forward`` as its forward: what an observed instance's ``__class__`` becomes.
    ``patch``: (edits, inputs, outputs) that made ``forward``, for :func:`constant_sites_class`."""
    return type(cls.__name__, (cls,), _own(cls, forward, patch))


# what a class's own layout or machinery defines: not copied into a flattened class's dict. Nor
# are ``__init__`` and ``__setstate__``: no forward looks them up, and Dynamo's first compile
# replaces ``torch.nn.Module``'s (generation tagging), which a copy taken before would hide
_NOT_FLATTENED = frozenset({"__dict__", "__weakref__", "__slots__", "__module__", "__qualname__", "__doc__",
                            "__annotations__", "__init_subclass__", "__slotnames__", "__abstractmethods__", "_abc_impl",
                            "__orig_bases__", "__parameters__", "__init__", "__setstate__"})


def _flattened(cls: type) -> dict:
    """Every attribute ``cls`` finds through its MRO (``object``'s aside), as one class dict."""
    ns: dict = {}
    for klass in reversed(cls.__mro__[:-1]):
        ns.update((k, v) for k, v in vars(klass).items() if k not in _NOT_FLATTENED)
    return ns


def constant_sites_class(module: torch.nn.Module) -> type | None:
    """A class of this patched instance's own, whose forward names its sites by constants (run,
    site index) instead of through its handles, or None where it keeps its class (its forward is
    an instance's own; a site traced as torch ops, whose handle says how; or interventions that
    read per-request values). A site interventions write has them written in too
    (:meth:`dmi.interventions.WriteSite.literal`). For code compiled as one graph of the whole
    model (module doc); code compiled layer by layer would compile each layer on its own with it.

    Its dict also holds every attribute its bases define (a snapshot: the class lives as long as
    the run): Dynamo looks ``__call__``, ``_call_impl`` and the like up through each MRO level
    before the one defining it and guards each level it passed, so a subclass would add one level
    per patched module (36 layers, torch 2.11 on a 2-core CPU machine: 7,731 guard lines and +31.6 µs a
    check over the unpatched model's 7,441); flattened, it finds them at the class itself (7,371
    lines, +12.3 µs; perf/diagnostics/guardcost.py). ``isinstance`` and the class's name are unchanged."""
    patched = type(module)
    edits, inputs, outputs = patched.__dict__.get(PATCH_ATTR) or (None, None, None)
    handles = module.__dict__.get(SITES_ATTR, {})
    writes = {canonical: h.write.literal() for canonical, h in handles.items() if isinstance(h, WriteHandle)}
    if edits is None or None in writes.values() or any(h.traced is not None or h.views is not None
                                                       for h in handles.values()):
        return None
    cls = patched.__dict__["_dmi_unpatched"]
    at = {canonical: (h.run, h.site, writes.get(canonical)) for canonical, h in handles.items()}
    inner = _rewrite(cls, edits, at) if edits else cls.forward
    forward = _io_forward(inner, inputs, outputs, at, frozenset(writes)) if inputs or outputs else inner
    own = _own(cls, forward, (edits, inputs, outputs))
    try:
        return type(cls.__name__, (cls,), {**_flattened(cls), **own})
    except Exception:      # (a base's descriptor refusing to be set on a second class): one MRO level more
        return type(cls.__name__, (cls,), own)


def patch_module(module: torch.nn.Module, handles: dict[str, SiteHandle], edits: tuple = (), inputs: tuple = (),
                 outputs: tuple = ()):
    """Patch one observed instance: ``edits`` (:class:`SourceEdit`, sorted) rewrite its class's
    forward, ``inputs`` / ``outputs`` wrap it; ``handles``: its sites by canonical name. Returns
    the function that undoes it. Raises AnchorNotFound before changing anything."""
    cls = type(module)
    prior = module.__dict__.get("forward")
    inner = rewrite_forward(cls, edits) if edits else cls.forward if prior is None else _call_prior
    writes = frozenset(c for c, h in handles.items() if isinstance(h, WriteHandle))
    forward = io_forward(inner, inputs, outputs, writes) if inputs or outputs else inner
    module.__dict__[SITES_ATTR] = handles
    if prior is None:
        module.__class__ = patched_class(cls, forward, (edits, inputs, outputs))

        def undo():
            module.__class__ = cls
            module.__dict__.pop(SITES_ATTR, None)
    else:
        module.__dict__["_dmi_prior_forward"] = prior
        bind_rewritten(module, forward)

        def undo():
            module.__dict__["forward"] = prior
            for name in (SITES_ATTR, "_dmi_prior_forward"):
                module.__dict__.pop(name, None)
    return undo


def parameter_position(module: torch.nn.Module, spec: int | str) -> tuple[int, str]:
    """(position among forward's arguments after self, name) of an ``input`` anchor."""
    params = [p for p in inspect.signature(inspect.unwrap(type(module).forward)).parameters.values()
              if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if isinstance(spec, int):
        if spec >= len(params):
            raise AnchorNotFound(f"input #{spec} ({type(module).__name__}.forward has {len(params)} parameters)")
        return spec, params[spec].name
    names = [p.name for p in params]
    if spec not in names:
        raise AnchorNotFound(f"input parameter {spec!r} (parameters: {names})")
    return names.index(spec), spec


def bind_rewritten(module: torch.nn.Module, fn) -> None:
    module.forward = types.MethodType(fn, module)
