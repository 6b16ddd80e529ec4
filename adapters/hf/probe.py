"""Load-time checks of the planned sites against the real model, before anything is captured.

A spec copied from another family loads, and its mistakes would otherwise surface at the first
forward, in dmi's or the model's own code, naming nothing of the spec. Two checks catch them at
``dmi.load``; each error names the architecture spec's file, line, site and the fix:

* ``args`` of ``compute`` anchors (:func:`check_args`): every argument is one the derived
  function takes, every name is a variable of the module's ``forward`` (or a global of its
  file), and every ``self.<attribute>`` is evaluated against each patched module (an attribute
  some layers lack is found here, not in the model's file at the first forward).
* layouts (:func:`probe_shapes`): one forward of ``PROBE_BATCH`` x ``PROBE_SEQ`` tokens with the
  sites patched in through probe handles, which record each site's tensor instead of capturing
  it; every shape is checked against the anchor's ``layout`` and the site's dims, as
  :func:`dmi.gather.token_major` will read it. It costs one short prefill (a model whose weights
  are on the meta device is not probed).
"""
from __future__ import annotations

import ast
import builtins
import difflib
import functools
import inspect
import textwrap
import traceback
import warnings

import torch

from ...plan import Plan, SitePlan
from ...siteop import SiteHandle, register_run, unregister_run
from ...spec import Document, format_path
from . import group_sites, module_at, patch_sites
from .derived import DERIVED
from .patch import SITES_ATTR, compute_derived

PROBE_BATCH, PROBE_SEQ = 2, 5      # sizes unlike any head count or width: a swapped axis shows


def check_sites(model: torch.nn.Module, plan: Plan, arch: Document) -> None:
    """Both checks (module doc); raises :class:`SpecError` before the model is patched for good."""
    check_args(model, plan, arch)
    probe_shapes(model, plan, arch)


# --- args of compute anchors ---------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _forward_variables(fn) -> frozenset:
    """Names ``fn`` binds: its parameters and every name it assigns (imports, loop targets included)."""
    names = set(inspect.signature(fn).parameters)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return frozenset(names)


def _self_chains(tree: ast.AST) -> list[str]:
    """``self.a.b`` attribute chains of an expression, outermost first (``self.a.b``, not ``self.a``)."""
    chains, inner = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                inner.add(id(cur.value))
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "self":
                chains.append("self." + ".".join(reversed(parts)))
    return chains


def _attributes(module: torch.nn.Module) -> list[str]:
    """The module's own attributes (its values, submodules, parameters and buffers; not nn.Module's methods)."""
    own = [*vars(module), *module._modules, *module._parameters, *module._buffers,
           *(n for n in dir(type(module)) if not hasattr(torch.nn.Module, n))]
    return sorted({n for n in own if not n.startswith("_")})


def check_args(model: torch.nn.Module, plan: Plan, arch: Document) -> None:
    """The ``args`` of every planned ``compute`` anchor, against the derived function and each
    patched module (module doc)."""
    by_site: dict[str, list[SitePlan]] = {}
    for s in plan.sites:
        if "compute" in s.anchor:
            by_site.setdefault(s.canonical, []).append(s)
    for canonical, sites in by_site.items():
        anchor = sites[0].anchor
        path = ("sites", canonical, "hf", "args")
        args = dict(anchor.get("args") or {})
        _check_signature(arch, path, anchor["compute"], args)
        modules = [(s.layer, anchor["module"].format(i=s.layer) if s.layer is not None else anchor["module"],
                    module_at(model, anchor["module"], s.layer)) for s in sites]
        modules = [m for m in modules if m[2] is not None]
        if not modules:
            continue
        fn = inspect.unwrap(type(modules[0][2]).forward)
        local = _forward_variables(fn) - {"self"}
        known = local | set(fn.__globals__) | set(dir(builtins)) | {"self"}
        for name, expr in args.items():
            where = path + (name,)
            try:
                tree = ast.parse(expr.strip(), mode="eval")
            except SyntaxError as e:
                raise arch.error(where, f"`{expr}` is not a Python expression ({e.msg})",
                                 fix="write an expression of forward's scope, e.g. query_states or self.scaling") from None
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            unknown = sorted(names - known)
            if unknown:
                close = difflib.get_close_matches(unknown[0], sorted(local), n=2)
                hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
                raise arch.error(where, f"`{expr}`: {unknown[0]!r} is not a variable of {type(modules[0][2]).__name__}"
                                 f".forward ({inspect.getsourcefile(fn)})",
                                 fix=f"{hint}use one of its variables ({', '.join(sorted(local))}) or self.<attribute>")
            whole = not (names & local)       # no variable of forward: the whole expression evaluates now
            exprs = [expr.strip()] if whole else _self_chains(tree)
            for text in exprs:
                _evaluate_on_layers(arch, where, text, expr, modules, fn.__globals__)


def _check_signature(arch: Document, path: tuple, compute: str, args: dict) -> None:
    fn = DERIVED[compute]
    params = inspect.signature(fn).parameters
    accepted = ", ".join(params)
    for name in args:
        if name not in params:
            close = difflib.get_close_matches(name, list(params), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise arch.error(path + (name,), f"{compute} takes no argument {name!r}",
                             fix=f"{hint}{compute} takes {accepted} (docs/sites.md, 'attention_pattern')")
    missing = [p.name for p in params.values() if p.default is p.empty and p.name not in args]
    if missing:
        raise arch.error(path, f"{compute} needs argument(s) {', '.join(missing)}",
                         fix=f"add {', '.join(f'{m}: <expression>' for m in missing)} to args ({compute} takes "
                             f"{accepted})")


def _evaluate_on_layers(arch: Document, where: tuple, text: str, expr: str, modules: list, scope: dict) -> None:
    """Evaluate ``text`` (``self...`` only) on every patched module; the first failure is a SpecError
    that says on which layers it does hold."""
    code = compile(text, f"<{arch.file}: {format_path(where)}>", "eval")
    failed, held = [], []
    for layer, path, module in modules:
        try:
            eval(code, scope, {"self": module})       # noqa: S307 - the spec's own expression, as forward runs it
        except Exception as e:                      # noqa: BLE001 - any failure is the spec's, named below
            failed.append((layer, path, module, e))
        else:
            held.append(layer)
    if not failed:
        return
    layer, path, module, e = failed[0]
    on = f"layer {layer}'s" if layer is not None else "the"
    problem = (f"`{expr}` fails on {on} {type(module).__name__} ({path}): {type(e).__name__}: {e}"
               + (f" (also on layers {[f[0] for f in failed[1:]]})" if len(failed) > 1 else ""))
    attr = e.name if isinstance(e, AttributeError) and getattr(e, "name", None) else None
    if attr and held:
        fix = (f"the attribute exists only on layers {held}: write `getattr(self, {attr!r}, None)` for a value "
               f"that the other layers lack")
    elif attr:
        close = difflib.get_close_matches(attr, _attributes(module), n=2)
        hint = f"did you mean {' or '.join(f'self.{c}' for c in close)}? " if close else ""
        fix = (f"{hint}{type(module).__name__} has no attribute {attr!r} on any layer: drop the argument if this "
               f"family has no such value, or write `getattr(self, {attr!r}, None)`; its attributes: "
               f"{', '.join(_attributes(module))}")
    else:
        fix = "correct the expression (it is evaluated in the module's forward, where `self` is the module)"
    raise arch.error(where, problem, fix=fix)


# --- shapes, from a forward of a few tokens ------------------------------------------------------

class _Probe:
    """What the probe handles report to: each site's first tensor (its shape) or what it was instead."""

    def __init__(self):
        self.seen: dict[int, tuple | str] = {}

    def capture(self, site_index: int, x, addend=None, side: bool = False) -> None:
        if site_index not in self.seen:
            self.seen[site_index] = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def probe_shapes(model: torch.nn.Module, plan: Plan, arch: Document) -> None:
    """One forward of ``PROBE_BATCH`` x ``PROBE_SEQ`` tokens through the model with the sites
    patched in; each site's tensor checked against its layout (module doc)."""
    if not plan.sites:
        return
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.device.type == "meta":
        return
    probe = _Probe()
    run_id = register_run(probe)
    try:
        grouped = group_sites(model, plan, arch, lambda index: SiteHandle(run_id, index, None))
        undo = patch_sites(arch, *grouped)
        try:
            vocab = weight.shape[0]
            ids = (torch.arange(PROBE_BATCH * PROBE_SEQ, device=weight.device).reshape(PROBE_BATCH, PROBE_SEQ)
                   + 3) % vocab
            with torch.no_grad():
                model(input_ids=ids, attention_mask=torch.ones_like(ids))
        except Exception as e:                          # noqa: BLE001 - named below when a site's code raised it
            _forward_failed(e, model, plan, arch)
            return
        finally:
            for fn in reversed(undo):
                fn()
    finally:
        unregister_run(run_id)
    _check_shapes(model, plan, arch, probe.seen)


def _forward_failed(e: Exception, model, plan: Plan, arch: Document) -> None:
    """A probe forward that raised: a SpecError where the raising code is a site's (a derived
    computation, or a patched forward's own statements), else a warning (the model itself failed
    a forward of plain token ids, which is not the spec's to say)."""
    frames = [f for f, _ in traceback.walk_tb(e.__traceback__)]
    raising = frames[-1] if frames else None
    names = {id(m): n for n, m in model.named_modules()}
    sites, module = None, None
    for frame in reversed(frames):
        if frame.f_code is compute_derived.__code__:
            sites, module = [frame.f_locals.get("canonical")], frame.f_locals.get("module")
            break
    if sites is None and raising is not None:
        owner = raising.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and SITES_ATTR in owner.__dict__ \
                and getattr(type(owner).forward, "__code__", None) is raising.f_code:
            sites, module = sorted(owner.__dict__[SITES_ATTR]), owner
    what = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if sites is None:
        warnings.warn(f"dmi.load: a forward of {PROBE_BATCH}x{PROBE_SEQ} token ids at load, to check the sites' "
                      f"shapes, failed in the model's own code ({what}); the shapes are checked at the first "
                      f"forward instead", stacklevel=4)
        return
    site = sites[0]
    line = traceback.extract_tb(e.__traceback__)[-1]
    path = names.get(id(module), "?")
    raise arch.error(("sites", site, "hf"), f"a forward of {PROBE_BATCH}x{PROBE_SEQ} tokens at load, with site(s) "
                     f"{', '.join(sites)} patched into {type(module).__name__} ({path}), raised {what} "
                     f"(at {line.filename}:{line.lineno})",
                     fix=f"correct the anchor of {site} (its variable, args or layout) to the source of "
                         f"{type(module).__name__} ({inspect.getsourcefile(type(module))})") from None


def _expected(site: SitePlan) -> dict[str, int | None]:
    """Size of each feature dim of the site (None: any, the key axis)."""
    return {d: (None if d == "key" else n) for d, n in zip(site.dims, site.shape)}


def _packs(rest: list[int], feats: list[int | None]) -> bool:
    """Whether tensor axes ``rest`` hold the feature sizes ``feats`` in order, an axis possibly
    packing several consecutive ones (``head*head_dim``); None (key) is an axis of its own."""
    i = 0
    for size in rest:
        if i < len(feats) and feats[i] is None:
            i += 1
            continue
        prod = 1
        while i < len(feats) and feats[i] is not None and prod < size:
            prod *= feats[i]
            i += 1
        if prod != size:
            return False
    return i == len(feats)


def _fits(shape: tuple, layout: list[str], site: SitePlan) -> bool:
    sizes, partial = _expected(site), bool(site.anchor.get("partial"))
    ok_seq = (lambda n: 0 < n <= PROBE_SEQ) if partial else (lambda n: n == PROBE_SEQ)
    if layout[0] == "token":
        tokens = shape[0] if shape else -1
        if not (tokens == PROBE_BATCH * PROBE_SEQ or (partial and 0 < tokens <= PROBE_BATCH * PROBE_SEQ)):
            return False
        rest = list(shape[1:])
    else:
        if "batch" not in layout or "seq" not in layout:
            return False
        bi, si = layout.index("batch"), layout.index("seq")
        if len(shape) <= max(bi, si) or shape[bi] != PROBE_BATCH or not ok_seq(shape[si]):
            return False
        rest = [n for k, n in enumerate(shape) if k not in (bi, si)]
    feats = [sizes.get(d, -1) for d in layout if d not in ("batch", "seq", "token")]
    return _packs(rest, feats)


def _spelled(layout: list[str], site: SitePlan) -> str:
    sizes = {**_expected(site), "batch": PROBE_BATCH, "seq": PROBE_SEQ, "token": PROBE_BATCH * PROBE_SEQ}
    return "[" + ", ".join(f"{d}={sizes[d] if sizes.get(d) is not None else 'any'}" for d in layout) + "]"


def _check_shapes(model, plan: Plan, arch: Document, seen: dict) -> None:
    bad: list[tuple[SitePlan, tuple | str]] = []
    for s in plan.sites:
        got = seen.get(s.index)
        if got is None or any(b[0].canonical == s.canonical for b in bad):
            continue        # (a site the forward did not reach is checked when it first runs)
        if isinstance(got, str) or not _fits(got, s.anchor["layout"], s):
            bad.append((s, got))
    if not bad:
        return
    s, got = bad[0]
    layout = list(s.anchor["layout"])
    path = s.anchor["module"].format(i=s.layer) if s.layer is not None else s.anchor["module"]
    module = module_at(model, s.anchor["module"], s.layer)
    on = f"layer {s.layer}, " if s.layer is not None else ""
    more = f" (and site(s) {', '.join(b[0].canonical for b in bad[1:])})" if len(bad) > 1 else ""
    if isinstance(got, str):
        raise arch.error(("sites", s.canonical, "hf"), f"this anchor gives a {got}, not a tensor ({on}"
                         f"{type(module).__name__} at {path}){more}",
                         fix="point the anchor at a tensor (another output index, input or variable)")
    feats = [d for d in layout if d not in ("batch", "seq", "token")]
    candidates = [["batch", "seq", *feats], ["batch", *feats[:1], "seq", *feats[1:]], ["token", *feats]]
    fitting = next((c for c in candidates if c != layout and _fits(got, c, s)), None)
    fix = (f"the tensor fits `layout: [{', '.join(fitting)}]`: write that if it holds the site's values, else "
           f"anchor the site where the tensor has the layout written" if fitting else
           f"anchor the site where the tensor has the layout written (for `assign`, another occurrence or "
           f"from_call), or write the tensor's own layout (its axes, in order, named {', '.join(feats)}, batch and "
           f"seq; one axis may pack several: [batch, seq, head, head_dim] reads a [batch, seq, head*head_dim] tensor)")
    raise arch.error(("sites", s.canonical, "hf", "layout"),
                     f"the tensor this anchor captures ({on}{type(module).__name__} at {path}) has shape {list(got)} in "
                     f"a forward of {PROBE_BATCH}x{PROBE_SEQ} tokens at load, but `layout: [{', '.join(layout)}]` says "
                     f"{_spelled(layout, s)}{more}", fix=fix)
