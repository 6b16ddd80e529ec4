"""Loading and validating the two kinds of YAML: architecture specs and hook specs.

Validation is two-layered: JSON Schema (``schemas/``) for shape and types, then semantic checks
in ``dmi.plan`` (sites exist, globs match, layers in range, policy fits). Every error is a
:class:`SpecError` naming the file, the line and the key.
"""
from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from . import settings
from .errors import SpecError


_BYTES_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?) ?([KMGT]i?B|B)?$")
_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_bytes(value: int | str) -> int:
    """'64MiB' -> 67108864; ints pass through."""
    if isinstance(value, int):
        return value
    m = _BYTES_RE.match(value.strip())
    if not m:
        raise ValueError(f"not a byte size: {value!r} (use e.g. 64MiB, 1GiB, 4096)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass
class Document:
    """A parsed YAML document that remembers where each key came from."""
    data: Any
    file: str
    lines: dict[tuple, int] = field(default_factory=dict)  # json path -> 1-based line

    def line_of(self, path: tuple) -> int | None:
        """Line of ``path``, or of its closest ancestor that has one."""
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), None)

    def error(self, path: tuple, problem: str, fix: str | None = None) -> SpecError:
        return SpecError(problem, file=self.file, key=format_path(path), line=self.line_of(path), fix=fix)


def format_path(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<root>"


MAX_YAML_NODES = 100_000    # a spec is a small tree (the built-in ones have < 1,000 nodes): more is an alias bomb


class _TooLarge(Exception):
    def __init__(self, line: int, path: tuple):
        super().__init__(line)
        self.line, self.path = line, path


def _to_python(node: yaml.Node, path: tuple, lines: dict, count: list | None = None) -> Any:
    count = count if count is not None else [0]
    count[0] += 1
    if count[0] > MAX_YAML_NODES:      # aliases (`*a`) of aliases expand exponentially: stop, not minutes later
        raise _TooLarge(lines.get(path[:1]) or node.start_mark.line + 1, path[:1])
    lines.setdefault(path, node.start_mark.line + 1)   # a mapping value keeps its key's line
    if isinstance(node, yaml.MappingNode):
        out = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else "<complex key>"   # `? [a, b]: ...`
            if key in out:
                raise _DuplicateKey(path + (key,), k.start_mark.line + 1, lines.get(path + (key,)))
            lines[path + (key,)] = k.start_mark.line + 1
            out[key] = _to_python(v, path + (key,), lines, count)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(v, path + (i,), lines, count) for i, v in enumerate(node.value)]
    # scalars: let the safe constructor resolve ints, bools, nulls, floats
    if node.tag == "tag:yaml.org,2002:str":
        return node.value
    try:
        return yaml.SafeLoader(yaml.serialize(node)).get_single_data()
    except yaml.YAMLError as e:   # e.g. an unknown tag: report it at this node, not in the re-serialized copy
        raise yaml.constructor.ConstructorError(None, None, getattr(e, "problem", None) or str(e),
                                                node.start_mark) from None


class _DuplicateKey(Exception):
    def __init__(self, path: tuple, line: int, first_line: int | None):
        super().__init__(path)
        self.path, self.line, self.first_line = path, line, first_line


def _yaml_error(e: yaml.YAMLError, file: str, text: str) -> SpecError:
    """A YAML syntax error as a SpecError: the line, its text, and what YAML was parsing when it failed."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    line = mark.line + 1 if mark else None
    problem = f"not valid YAML: {getattr(e, 'problem', None) or e}"
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and cmark is not None and (mark is None or cmark.line != mark.line):
        problem += f" ({context} that starts at line {cmark.line + 1})"
    src = text.splitlines()
    here = src[line - 1] if line is not None and 0 < line <= len(src) else ""
    if here.strip():
        problem += f": `{here.strip()}`"
    fix = "fix the YAML syntax at that line (indentation, a missing ':', quote or closing bracket)"
    if "\t" in here[:len(here) - len(here.lstrip())]:
        fix = "indent with spaces, not tabs"
    return SpecError(problem, file=file, line=line, fix=fix)


def load_yaml(source: str | Path | dict, *, what: str, text: str | None = None) -> Document:
    """Parse YAML from a path (or accept a dict) keeping line numbers; errors name the file.
    ``text``: the file's content where the caller has read it (a cache keyed by it parses that)."""
    if isinstance(source, dict):
        return Document(source, f"<{what} dict>")
    if not isinstance(source, (str, Path)):
        raise SpecError(f"a {what} must be a path to a YAML file or a dict, not {type(source).__name__}",
                        file=f"<{what} {type(source).__name__}>",
                        fix=f"pass the path of the {what} file, or its content as a dict")
    path = Path(source)
    if text is None:
        text = _read_text(source, what)
    lines: dict = {}
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = _to_python(node, (), lines) if node is not None else None
    except yaml.YAMLError as e:
        raise _yaml_error(e, str(path), text) from None
    except RecursionError:
        raise SpecError("a YAML alias refers to itself", file=str(path),
                        fix="remove the recursive `*alias` (dmi specs are plain trees)") from None
    except _TooLarge as t:
        raise SpecError(f"the document expands to more than {MAX_YAML_NODES:,} YAML nodes (aliases `*name` repeat "
                        f"their anchor's content, nested ones exponentially)", file=str(path), line=t.line,
                        key=format_path(t.path) if t.path else None,
                        fix="write the content out without nested aliases (dmi specs are small trees)") from None
    except _DuplicateKey as d:
        first = f" (first at line {d.first_line})" if d.first_line else ""
        raise SpecError(f"duplicate key{first}: YAML would silently keep only the last one", file=str(path),
                        key=format_path(d.path), line=d.line, fix="merge the two into one key") from None
    if node is None:
        raise SpecError("file is empty", file=str(path), fix=f"write a {what}; see docs/sites.md for an example")
    return Document(data, str(path), lines)


def _read_text(source: str | Path, what: str) -> str:
    """A spec file's text; errors name the file and the fix."""
    path = Path(source)
    if not path.exists():
        hint = (" (this looks like YAML text, not a path: write it to a file or pass a dict)"
                if isinstance(source, str) and ("\n" in source or ": " in source) else "")
        raise SpecError(f"{what} file does not exist{hint}", file=str(path),
                        fix="check the path, or list available ones with `dmi specs list`")
    if not path.is_file():
        raise SpecError(f"{what} path is a directory, not a file", file=str(path),
                        fix=f"pass the path of the {what} YAML file itself")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise SpecError(f"not UTF-8 text (byte {e.object[e.start]:#04x})", file=str(path), line=line,
                        fix="save the file as UTF-8") from None
    except OSError as e:
        raise SpecError(f"cannot read the {what}: {e.strerror or e}", file=str(path),
                        fix="check the file's permissions") from None
    return text


@lru_cache(maxsize=None)
def _schema(name: str) -> dict:
    return json.loads(resources.files("dmi.schemas").joinpath(name).read_text())


# JSON Schema counts 2.0 as an integer; dmi does not (a float layer, head or byte count is a mistake)
_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, x: isinstance(x, int) and not isinstance(x, bool)))


def validate(doc: Document, schema_name: str, what: str) -> None:
    """JSON-Schema validation; the most specific error is reported with its file/line/key."""
    validator = _Validator(_schema(schema_name))
    errors = sorted(validator.iter_errors(doc.data), key=lambda e: (-len(e.absolute_path), str(e.message)))
    if not errors:
        return
    err = _deepest(errors[0])
    path = tuple(err.absolute_path)
    if err.validator == "additionalProperties":   # point at the (first) unknown key itself
        extra = set(err.instance) - set(err.schema.get("properties", {}))
        path += (min(extra, key=lambda k: (doc.lines.get(path + (k,), 0), str(k))),)
    fix = _fix_for(err, what)
    raise doc.error(path, _message_for(err), fix)


def _deepest(err: jsonschema.ValidationError) -> jsonschema.ValidationError:
    # oneOf/anyOf failures hide the useful message in their context: prefer the alternative whose
    # type fits the value (a dict given for `tokens` gets the object branch's error), then the deepest
    while err.context:
        err = max(err.context, key=lambda e: (e.validator not in ("type", "enum"), len(e.absolute_path)))
    return err


_BYTES_PATTERN = r"^[0-9]+(\.[0-9]+)? ?([KMGT]i?B|B)?$"     # as in hook_spec.schema.json
_RANGE_PATTERN = r"^-?[0-9]+ *- *-?[0-9]+$"


def _message_for(err: jsonschema.ValidationError) -> str:
    if err.validator == "pattern" and err.validator_value == _BYTES_PATTERN:
        return f"{err.instance!r} is not a byte size"
    if err.validator == "pattern" and err.validator_value == _RANGE_PATTERN:
        return f"{err.instance!r} is not a layer or a layer range"
    if err.validator == "additionalProperties":
        extra = sorted(set(err.instance) - set(err.schema.get("properties", {})), key=str)
        return f"unknown key(s) {', '.join(map(repr, extra))}"
    if err.validator == "required":
        return err.message
    if err.validator == "type":
        return f"{err.instance!r} is not of type {err.validator_value}"
    if err.validator == "enum":
        return f"{err.instance!r} is not one of {err.validator_value}"
    return err.message


def _fix_for(err: jsonschema.ValidationError, what: str) -> str:
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(map(str, set(err.instance) - set(allowed)))
        close = [m for k in extra for m in difflib.get_close_matches(k, allowed, n=1, cutoff=0.6)]
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        return f"{hint}use one of: {', '.join(allowed)}"
    if err.validator == "enum":
        return f"use one of {err.validator_value}"
    if err.validator == "type":
        return f"give a value of type {err.validator_value}"
    if err.validator == "pattern" and err.validator_value == _BYTES_PATTERN:
        return "write a size such as 64MiB, 1GiB, 512KB or a number of bytes"
    if err.validator == "pattern" and err.validator_value == _RANGE_PATTERN:
        return "write a layer index (negative counts from the end) or a range such as '2-5'"
    if err.validator == "pattern":
        return f"match the pattern {err.validator_value}"
    if err.validator == "const":
        return f"use {err.validator_value!r} (the only value this version of dmi accepts)"
    bound = {"minimum": "a value >= {}", "exclusiveMinimum": "a value > {}", "maximum": "a value <= {}",
             "exclusiveMaximum": "a value < {}", "minItems": "at least {} item(s)", "maxItems": "at most {} item(s)",
             "minLength": "at least {} character(s)", "minProperties": "at least {} key(s)",
             "maxProperties": "at most {} key(s)"}.get(err.validator)
    if bound:
        return "give " + bound.format(err.validator_value)
    return f"see schemas/{'hook_spec' if what == 'hook spec' else 'arch_spec'}.schema.json"


# --- architecture specs --------------------------------------------------------------------------

# The canonical site names (docs/sites.md, "Sites"): a spec may use others, which
# `dmi specs validate` warns about (a name outside the vocabulary means nothing to other families).
SITE_VOCABULARY = (
    "embed", "resid_pre", "attn.q", "attn.k", "attn.q_rot", "attn.k_rot", "attn.v", "attn.kv_latent",
    "attn.k_rope", "attn.pattern", "attn.z", "attn.out_pre_norm", "attn.out", "resid_mid", "mlp.in", "mlp.act",
    "mlp.out_pre_norm", "mlp.out", "moe.router_logits", "moe.topk_weights", "moe.topk_ids", "moe.shared_out",
    "resid_post", "final_norm", "logits",
)


def outside_vocabulary(doc: Document) -> list[tuple[str, str, str]]:
    """(site, where ``file:line``, hint) for each site name of an architecture spec outside
    :data:`SITE_VOCABULARY`."""
    out = []
    for name in doc.data["sites"]:
        if name not in SITE_VOCABULARY:
            close = difflib.get_close_matches(name, SITE_VOCABULARY, n=1, cutoff=0.6)
            hint = (f"did you mean {close[0]!r}? " if close else "") + \
                "use a name of the site vocabulary (docs/sites.md), or propose a new one there"
            line = doc.line_of(("sites", name))
            out.append((name, f"{doc.file}:{line}" if line is not None else doc.file, hint))
    return out


def builtin_spec_dir() -> Path:
    return Path(str(resources.files("dmi.specs")))


def list_specs() -> list[Path]:
    """The built-in architecture specs (:func:`search_specs` lists every source)."""
    return sorted(builtin_spec_dir().glob("*.yaml"))


SPEC_PATH_ENV = "DMI_SPEC_PATH"       # directories of specs searched before the built-in ones
ENTRY_POINT_GROUP = "dmi.specs"       # entry points of installed packages that ship specs


@dataclass(frozen=True)
class SpecFile:
    """An architecture spec file and where the search found it (``source``: ``DMI_SPEC_PATH``,
    ``built-in`` or ``entry point <name> (<distribution> <version>)``)."""
    path: Path
    source: str


def spec_path_dirs() -> list[Path]:
    """The directories of ``DMI_SPEC_PATH`` (``os.pathsep``-separated), each checked to exist."""
    out = []
    for part in (settings.get(SPEC_PATH_ENV) or "").split(os.pathsep):
        if not part.strip():
            continue
        path = Path(part).expanduser()
        if not path.is_dir():
            raise SpecError(f"{SPEC_PATH_ENV} names {part!r}, which is not a directory", file=part, key=SPEC_PATH_ENV,
                            fix=f"list directories of architecture spec YAML files, separated by {os.pathsep!r}")
        out.append(path)
    return out


def _yaml_files(obj, label: str) -> list[Path]:
    """Spec files an entry point's object names: a package or module (the ``*.yaml`` beside it), a
    directory or file path, a list of them, or a callable returning any of these."""
    import types
    if callable(obj) and not isinstance(obj, (types.ModuleType, type)):
        obj = obj()
    if isinstance(obj, (list, tuple)):
        return [p for item in obj for p in _yaml_files(item, label)]
    if isinstance(obj, types.ModuleType):
        where = getattr(obj, "__path__", None)
        obj = Path(list(where)[0]) if where else Path(obj.__file__).parent
    if isinstance(obj, (str, os.PathLike)):
        path = Path(obj)
        return sorted(path.glob("*.yaml")) if path.is_dir() else [path]
    raise SpecError(f"{label} gives a {type(obj).__name__}, not specs", file=label, key=ENTRY_POINT_GROUP,
                    fix="point the entry point at a package (its *.yaml files), a path, or a function returning paths")


def entry_point_specs() -> list[SpecFile]:
    """Specs that installed packages declare in the ``dmi.specs`` entry-point group, e.g. in their
    pyproject.toml: ``[project.entry-points."dmi.specs"] my_family = "my_package.specs"``."""
    from importlib.metadata import entry_points
    out = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        label = f"entry point {ep.name}" + (f" ({dist.name} {dist.version})" if dist is not None else "")
        try:
            obj = ep.load()
        except Exception as e:      # noqa: BLE001 - a package's broken entry point, named with the fix
            raise SpecError(f"{label} = {ep.value!r} cannot be loaded: {type(e).__name__}: {e}", file=label,
                            key=ENTRY_POINT_GROUP, fix="reinstall or fix the package that declares it") from None
        out += [SpecFile(p, label) for p in _yaml_files(obj, label)]
    return out


def search_specs() -> list[SpecFile]:
    """Every architecture spec in search order: ``DMI_SPEC_PATH``'s directories, the built-in
    specs, then those of installed packages (entry-point group ``dmi.specs``)."""
    return ([SpecFile(p, SPEC_PATH_ENV) for d in spec_path_dirs() for p in sorted(d.glob("*.yaml"))]
            + [SpecFile(p, "built-in") for p in list_specs()] + entry_point_specs())


def effective_specs() -> list[tuple[SpecFile, Document]]:
    """The specs the search uses: the first of each family name in :func:`search_specs` order (a
    spec on ``DMI_SPEC_PATH`` replaces the built-in one of its family)."""
    out, families = [], set()
    for found in search_specs():
        doc = load_arch_spec(found.path)
        if doc.data["family"] not in families:
            families.add(doc.data["family"])
            out.append((found, doc))
    return out


# (path, text) -> the checked spec: every dmi.load and tiny model searches all the specs, and the
# YAML parse and schema check of one cost ~100x a copy of its result
_ARCH_SPECS: dict[tuple[str, str], Document] = {}
_ARCH_SPECS_KEPT = 64


def load_arch_spec(source: str | Path | dict) -> Document:
    """An architecture spec, parsed and checked (a file once per content: later loads get a copy,
    which the caller may change)."""
    key = _spec_file_key(source)
    if key in _ARCH_SPECS:
        return _copy(_ARCH_SPECS[key])
    doc = _check_arch_spec(load_yaml(source, what="architecture spec", text=key[1] if key else None))
    if key is not None:
        if len(_ARCH_SPECS) >= _ARCH_SPECS_KEPT:
            _ARCH_SPECS.pop(next(iter(_ARCH_SPECS)))
        _ARCH_SPECS[key] = _copy(doc)
    return doc


def _copy(doc: Document) -> Document:
    """A copy of a parsed document that shares nothing mutable with it (its data is plain YAML:
    dicts, lists and scalars; its line keys are tuples)."""
    def tree(x):
        if isinstance(x, dict):
            return {k: tree(v) for k, v in x.items()}
        return [tree(v) for v in x] if isinstance(x, list) else x
    return Document(tree(doc.data), doc.file, dict(doc.lines))


def _spec_file_key(source) -> tuple[str, str] | None:
    """(path, text) of a readable spec file, else None (load_yaml names what is wrong). Keyed by
    the text, not the modification time: a file rewritten within the clock's tick is read anew."""
    if not isinstance(source, (str, Path)):
        return None
    try:
        return str(Path(source)), Path(source).read_text(encoding="utf-8")
    except (OSError, ValueError):      # (no such file, a directory, not UTF-8, a NUL in the name)
        return None


def _check_arch_spec(doc: Document) -> Document:
    validate(doc, "arch_spec.schema.json", "architecture spec")
    for name, site in doc.data["sites"].items():
        for dim in site["dims"]:
            if dim not in doc.data["dims"] and dim not in ("token", "key"):
                raise doc.error(("sites", name, "dims"), f"dim {dim!r} is not declared under dims",
                                fix=f"add `{dim}: <config attribute>` under dims, or use one of "
                                    f"{sorted(doc.data['dims']) + ['token', 'key']}")
        hf = site.get("hf") or {}
        layout = [d for d in hf.get("layout", []) if d not in ("batch", "seq", "token")]
        if hf and layout != site["dims"][1:]:
            raise doc.error(("sites", name, "hf", "layout"), f"the layout's feature axes {layout} are not the site's "
                            f"dims after token {site['dims'][1:]}",
                            fix=f"name the tensor's axes batch and seq (or a leading token) and the site's dims in "
                                f"their order, e.g. [batch, seq, {', '.join(site['dims'][1:])}]")
        if hf and not (hf["layout"][0] == "token" or {"batch", "seq"} <= set(hf["layout"])):
            raise doc.error(("sites", name, "hf", "layout"), "the layout names neither batch and seq nor a leading token",
                            fix="name the tensor's batch and seq axes, or write token first for a [batch*seq, ...] "
                                "tensor")
        vllm = site.get("vllm") or {}
        if "{i+1}" in vllm.get("module", "") and "last" not in vllm:
            raise doc.error(("sites", name, "vllm", "module"), "a path through the next layer ({i+1}) has no anchor "
                            "for the last layer", fix="add `last: {module: ..., output: ...}` (e.g. the final norm)")
    return doc


def find_arch_spec(model_type: str, extra_dirs: list[Path] = ()) -> Document:
    """The spec whose ``match.model_type`` lists ``model_type``, searched in :func:`effective_specs`
    order (``DMI_SPEC_PATH``, built-in, installed packages), then in ``extra_dirs``."""
    found = effective_specs()
    for _, doc in found:
        if model_type in doc.data["match"]["model_type"]:
            return doc
    for path in (p for d in extra_dirs for p in sorted(Path(d).glob("*.yaml"))):
        doc = load_arch_spec(path)
        if model_type in doc.data["match"]["model_type"]:
            return doc
    known = sorted({t for _, doc in found for t in doc.data["match"]["model_type"]})
    searched = ", ".join(map(str, [*spec_path_dirs(), builtin_spec_dir(), *extra_dirs]))
    raise SpecError(f"no architecture spec matches model_type {model_type!r} (searched {SPEC_PATH_ENV}, the built-in "
                    f"specs and installed packages' {ENTRY_POINT_GROUP!r} entry points)", file=searched,
                    key="match.model_type",
                    fix=f"write a spec for it (docs/sites.md, 'Contributing an architecture') and pass it: "
                        f"`dmi capture --arch-spec FILE`, dmi.load(..., arch_spec=FILE), or put it in a directory "
                        f"on {SPEC_PATH_ENV}; known model types: {known}")


def check_arch_matches(arch: Document, model_type: str | None) -> None:
    """Refuse an architecture spec written for another family than the model's: its
    ``match.model_type`` must list the model's ``config.model_type``."""
    types = arch.data["match"]["model_type"]
    if model_type is None or model_type in types:
        return
    try:
        right = find_arch_spec(model_type)
        other = f"pass {right.file} (the spec for model_type {model_type!r}) or leave arch_spec out, "
    except SpecError:
        other = ""
    raise arch.error(("match", "model_type"), f"this spec is for family {arch.data['family']!r} (model_type "
                     f"{', '.join(map(repr, types))}) but the model's config.model_type is {model_type!r}",
                     fix=f"{other}or, if this spec does fit the model, add {model_type!r} to match.model_type")


def load_hook_spec(source: str | Path | dict) -> Document:
    doc = load_yaml(source, what="hook spec")
    validate(doc, "hook_spec.schema.json", "hook spec")
    return doc
