"""docs/hook_spec.md is generated from the hook spec schema and up to date: every key, its default,
an example that is a valid hook spec; the schema's defaults are the code's."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml

from dmi.schemas import reference

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "hook_spec.md"
SCHEMA = json.loads((REPO / "schemas" / "hook_spec.schema.json").read_text())


def test_committed_reference_is_up_to_date():
    assert DOC.read_text() == reference.render(), \
        "docs/hook_spec.md is stale. Fix: python -m dmi.schemas.reference > docs/hook_spec.md"


def _pointer(ref: str):
    """The schema node a JSON pointer names ("#/$defs/tokens/oneOf/1/...")."""
    target = SCHEMA
    for part in ref[2:].split("/"):
        target = target[int(part)] if isinstance(target, list) else target[part]
    return target


def _keys(node, path=""):
    """(path, schema node) of every key, walked here independently of the generator."""
    while "$ref" in node:
        node = {**_pointer(node["$ref"]), **{k: v for k, v in node.items() if k != "$ref"}}
    for alt in node.get("oneOf", []):
        yield from _keys(alt, path)
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        yield from _keys(node["items"], path + "[]")
    for key, child in node.get("properties", {}).items():
        full = f"{path}.{key}" if path else key
        yield full, child
        yield from _keys(child, full)
    named = node.get("additionalProperties")
    if path and isinstance(named, dict) and named.get("properties"):     # entries by name (requests.return.probes)
        yield from _keys(named, path + ".<name>")


def _rows() -> dict[str, list[str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells
    return rows


def test_every_key_default_and_example():
    rows = _rows()
    keys = dict(_keys(SCHEMA))
    assert set(rows) == set(keys)
    validator = jsonschema.Draft202012Validator(SCHEMA)
    for key, node in keys.items():
        _, _, default, example, _ = rows[key]
        target = node
        while "$ref" in target:
            target = _pointer(target["$ref"])
        want = node.get("default", target.get("default"))
        if want is not None:
            assert yaml.safe_load(default.strip("`")) == want, (key, default)
        # the example is a whole, valid hook spec (with a capture entry where it has none)
        spec = yaml.safe_load("{" + example.strip("`") + "}")
        spec = {"capture": [{"sites": ["resid_post"]}], **spec}
        errors = [e.message for e in validator.iter_errors(spec)]
        assert not errors, (key, example, errors)
        value = spec
        for part in key.split("."):
            value = next(iter(value.values())) if part == "<name>" else value[part.removesuffix("[]")]
            if part.endswith("[]"):
                value = value[0]
        assert value is not None, (key, example)


def test_schema_defaults_are_the_codes():
    from dmi.plan import DEFAULT_MAX_KEYS, Plan, Policy, TokenFilter
    from dmi.spec import parse_bytes
    from dmi.store.memory import DEFAULT_MEMORY_BYTES
    rows = _rows()

    def default(key):
        return yaml.safe_load(rows[key][2].strip("`"))
    policy = Policy()
    for key in ("mode", "ring_bytes", "host_bytes", "meta_records", "drain", "stall_timeout_s"):
        value = default(f"policy.{key}")
        assert (parse_bytes(value) if key.endswith("_bytes") else value) == getattr(policy, key), key
    plan = Plan(family="", sites=[], policy=policy, layers=0)
    assert parse_bytes(default("store.chunk_bytes")) == plan.chunk_bytes
    assert default("store.compression") == plan.compression and default("store.writer") == plan.writer
    assert default("store.dtype") == plan.store_dtype
    assert parse_bytes(default("store.memory_bytes")) == DEFAULT_MEMORY_BYTES
    assert default("capture[].max_keys") == DEFAULT_MAX_KEYS
    flt = TokenFilter()
    assert (default("capture[].tokens.phase"), default("capture[].tokens.last"),
            default("capture[].tokens.every_n_steps")) == (flt.phase, flt.last, flt.every_n_steps)
    assert TokenFilter.parse(default("capture[].tokens")) == flt
