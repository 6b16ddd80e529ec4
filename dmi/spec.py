"""Loading and validating the two kinds of YAML: architecture specs and hook specs.

Validation is two-layered: JSON Schema (``schemas/``) for shape and types, then semantic checks
in ``dmi.plan`` (sites exist, globs match, layers in range, policy fits). Every error is a
:class:`SpecError` naming the file, the line and the key.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

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


def _to_python(node: yaml.Node, path: tuple, lines: dict) -> Any:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out = {}
        for k, v in node.value:
            key = yaml.safe_load(yaml.serialize(k)) if not isinstance(k, yaml.ScalarNode) else k.value
            lines[path + (key,)] = k.start_mark.line + 1
            out[key] = _to_python(v, path + (key,), lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(v, path + (i,), lines) for i, v in enumerate(node.value)]
    # scalars: let the safe constructor resolve ints, bools, nulls, floats
    return yaml.SafeLoader(yaml.serialize(node)).get_single_data() if node.tag != "tag:yaml.org,2002:str" else node.value


def load_yaml(source: str | Path | dict, *, what: str) -> Document:
    """Parse YAML from a path (or accept a dict) keeping line numbers; errors name the file."""
    if isinstance(source, dict):
        return Document(source, f"<{what} dict>")
    path = Path(source)
    if not path.exists():
        raise SpecError(f"{what} file does not exist", file=str(path),
                        fix=f"check the path, or list available ones with `dmi specs list`")
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise SpecError(f"not valid YAML: {getattr(e, 'problem', None) or e}", file=str(path),
                        line=mark.line + 1 if mark else None,
                        fix="fix the YAML syntax at that line (indentation, a missing ':' or quote)") from None
    if node is None:
        raise SpecError("file is empty", file=str(path), fix=f"write a {what}; see docs/sites.md for an example")
    lines: dict = {}
    return Document(_to_python(node, (), lines), str(path), lines)


@lru_cache(maxsize=None)
def _schema(name: str) -> dict:
    return json.loads(resources.files("dmi.schemas").joinpath(name).read_text())


def validate(doc: Document, schema_name: str, what: str) -> None:
    """JSON-Schema validation; the most specific error is reported with its file/line/key."""
    validator = jsonschema.Draft202012Validator(_schema(schema_name))
    errors = sorted(validator.iter_errors(doc.data), key=lambda e: (-len(e.absolute_path), str(e.message)))
    if not errors:
        return
    err = _deepest(errors[0])
    path = tuple(err.absolute_path)
    fix = _fix_for(err, what)
    raise doc.error(path, _message_for(err), fix)


def _deepest(err: jsonschema.ValidationError) -> jsonschema.ValidationError:
    # oneOf/anyOf failures hide the useful message in their context
    while err.context:
        err = max(err.context, key=lambda e: len(e.absolute_path))
    return err


def _message_for(err: jsonschema.ValidationError) -> str:
    if err.validator == "additionalProperties":
        extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
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
        return f"use one of: {', '.join(allowed)}"
    if err.validator == "enum":
        return f"use one of {err.validator_value}"
    if err.validator == "type":
        return f"give a value of type {err.validator_value}"
    if err.validator == "pattern":
        return f"match the pattern {err.validator_value}"
    return f"see schemas/{'hook_spec' if what == 'hook spec' else 'arch_spec'}.schema.json"


# --- architecture specs --------------------------------------------------------------------------

def builtin_spec_dir() -> Path:
    return Path(str(resources.files("dmi.specs")))


def list_specs() -> list[Path]:
    return sorted(builtin_spec_dir().glob("*.yaml"))


def load_arch_spec(source: str | Path | dict) -> Document:
    doc = load_yaml(source, what="architecture spec")
    validate(doc, "arch_spec.schema.json", "architecture spec")
    for name, site in doc.data["sites"].items():
        for dim in site["dims"]:
            if dim not in doc.data["dims"] and dim not in ("token", "key"):
                raise doc.error(("sites", name, "dims"), f"dim {dim!r} is not declared under dims",
                                fix=f"add `{dim}: <config attribute>` under dims, or use one of "
                                    f"{sorted(doc.data['dims']) + ['token', 'key']}")
    return doc


def find_arch_spec(model_type: str, extra_dirs: list[Path] = ()) -> Document:
    """The spec whose ``match.model_type`` lists ``model_type``."""
    for path in [*list_specs(), *(p for d in extra_dirs for p in sorted(Path(d).glob("*.yaml")))]:
        doc = load_arch_spec(path)
        if model_type in doc.data["match"]["model_type"]:
            return doc
    known = sorted({t for p in list_specs() for t in load_arch_spec(p).data["match"]["model_type"]})
    raise SpecError(f"no architecture spec matches model_type {model_type!r}", key="match.model_type",
                    fix=f"pass arch_spec=<your spec.yaml> (see CONTRIBUTING in docs/sites.md); known: {known}")


def load_hook_spec(source: str | Path | dict) -> Document:
    doc = load_yaml(source, what="hook spec")
    validate(doc, "hook_spec.schema.json", "hook spec")
    return doc
