"""Load-time patching of HF model source: the site op goes into the code, no forward hooks.

Two mechanisms, chosen by the anchor kind of the architecture spec:

* ``assign`` / ``compute`` anchors rewrite the class's ``forward`` from its source (AST): after
  the anchored assignment we insert ``var = __dmi_site__(self, "attn.q", var)``; after the
  anchored call we insert ``__dmi_compute__(self, "attn.pattern", ...)``. The rewritten function
  is compiled once per class and bound to each observed instance.
* ``input`` / ``output`` anchors wrap the instance's ``forward`` in a small function that passes
  the tensor through the site op.

Instances that observe nothing keep their original ``forward``.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass

import torch

from ...siteop import SiteHandle, site
from .derived import DERIVED

SITES_ATTR = "_dmi_sites"


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


def _dmi_compute(module, canonical: str, fn: str, **kwargs):
    handle = getattr(module, SITES_ATTR, {}).get(canonical)
    if handle is not None:
        site(handle, DERIVED[fn](**kwargs))


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


def _inserted(anchor: dict, canonical: str, like: ast.stmt) -> ast.stmt:
    if "assign" in anchor:
        v = anchor["assign"]
        code = f"{v} = __dmi_site__(self, {canonical!r}, {v})"
    else:
        kwargs = ", ".join(f"{k}={expr}" for k, expr in dict(anchor["args"]).items())
        code = f"__dmi_compute__(self, {canonical!r}, {anchor['compute']!r}, {kwargs})"
    node = ast.parse(code).body[0]
    for sub in ast.walk(node):
        sub.lineno, sub.col_offset = like.lineno, like.col_offset
        sub.end_lineno, sub.end_col_offset = like.end_lineno, like.end_col_offset
    return node


@functools.lru_cache(maxsize=None)
def rewrite_forward(cls: type, edits: tuple[SourceEdit, ...]):
    """``cls.forward`` with the site calls inserted. Raises AnchorNotFound naming what is missing."""
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
        placed.append((body, body.index(stmt), _inserted(dict(edit.anchor), edit.canonical, stmt)))
    for body, index, new in reversed(sorted(placed, key=lambda p: p[1])):
        body.insert(index + 1, new)
    module_globals = raw.__globals__
    module_globals.setdefault("__dmi_site__", _dmi_site)
    module_globals.setdefault("__dmi_compute__", _dmi_compute)
    code = compile(ast.Module(body=[fn_node], type_ignores=[]), inspect.getsourcefile(raw) or "<dmi>", "exec")
    namespace: dict = {}
    exec(code, module_globals, namespace)
    new_fn = namespace[fn_node.name]
    new_fn.__dmi_patched__ = True
    return new_fn


def wrap_io(module: torch.nn.Module, inputs: list[tuple[int, str, SiteHandle]], outputs: list[tuple[int, SiteHandle]]):
    """Wrap ``module.forward`` so the named inputs and outputs pass through the site op."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if inputs:
            args = list(args)
            for pos, name, handle in inputs:
                if pos < len(args):
                    args[pos] = site(handle, args[pos])
                elif name in kwargs:
                    kwargs[name] = site(handle, kwargs[name])
        out = inner(*args, **kwargs)
        for index, handle in outputs:
            if isinstance(out, (tuple, list)):
                site(handle, out[index])
            else:
                site(handle, out)
        return out

    module.forward = forward


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
