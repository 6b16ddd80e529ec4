"""``dmi specs list`` and ``dmi specs validate``: the architecture specs found, a spec file checked."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .exits import EXIT_FAIL, EXIT_OK, PROG, UsageError, warn
from .loading import check_model


def cmd_specs_list(args: argparse.Namespace) -> int:
    from ..errors import DmiError
    from ..spec import load_arch_spec, search_specs
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
    from ..spec import effective_specs, load_arch_spec
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
        from ..models import BUILTIN, tiny_config
        if model in BUILTIN:
            return tiny_config(BUILTIN[model]), model
        check_model(model)
        from transformers import AutoConfig
        try:
            return AutoConfig.from_pretrained(model), model
        except (OSError, ValueError) as e:
            from ..models import load_failure
            raise UsageError(f"--model {model}: cannot load its config: {load_failure(model, e)}. "
                             f"Fix: pass a built-in model name or a local path / hub id") from None
    from ..models import tiny_config
    try:
        return tiny_config(family), f"tiny-{family}"
    except KeyError:
        return None, None


def _available(config, arch) -> set | None:
    """(canonical, layer) pairs that exist in a model of ``config`` (built on the meta device)."""
    try:
        import torch
        import transformers as tf
        from ..adapters.hf import available_sites
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config)
        return available_sites(model, arch)
    except Exception:   # noqa: BLE001 - fall back to "every site exists"
        return None


def cmd_specs_validate(args: argparse.Namespace) -> int:
    from ..errors import SpecError
    from ..spec import load_arch_spec, load_hook_spec, load_yaml
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
        from ..spec import find_arch_spec
        config, _ = _config_for("", args.model)
        arch = find_arch_spec(config.model_type)
    else:
        arch = _arch_by_name("qwen3")
    return _validate_hook(hook, arch, args)


def _validate_arch(arch, args) -> int:
    from ..models import check_on_tiny_model, tiny_config
    from ..plan import build_plan
    from ..spec import Document
    d = arch.data
    per_layer = sum(1 for s in d["sites"].values() if s.get("per_layer"))
    print(f"{arch.file}: ok: architecture spec, family {d['family']}, model_type {', '.join(d['match']['model_type'])}")
    print(f"  {len(d['sites'])} sites ({per_layer} per layer, {len(d['sites']) - per_layer} model-level); "
          f"dims: {', '.join(f'{k}={v}' for k, v in d['dims'].items())}")
    print(f"  sites: {', '.join(d['sites'])}")
    from ..spec import outside_vocabulary
    for name, where, hint in outside_vocabulary(arch):
        warn(f"{where}: sites.{name}: {name!r} is not in the site vocabulary. Fix: {hint}")
    config = tiny_config(arch)        # from the spec alone: its model_type's config class, dims, `tiny:` block
    probe = Document({"capture": [{"sites": ["*"]}], "policy": {"ring_bytes": "1GiB"}}, f"<all sites of {arch.file}>")
    plan = build_plan(arch, probe, config, available=_available(config, arch))
    rows = check_on_tiny_model(arch)
    print(f"  captured from a real tiny {type(config).__name__} model ({plan.layers} layers, prefill and decode): "
          f"{len(plan.sites)} site instances in {len(rows)} store groups, dims as the spec says")
    return EXIT_OK


def _validate_hook(hook, arch, args) -> int:
    from ..errors import SpecError
    from ..plan import build_plan
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    config, label = _config_for(arch.data["family"], args.model)
    if config is None:
        print(f"{hook.file}: ok: hook spec (schema only: no built-in tiny config for family "
              f"{arch.data['family']!r}; pass --model to check sites and layers against a model config)")
        return EXIT_OK
    if args.model:
        from ..spec import check_arch_matches
        check_arch_matches(arch, getattr(config, "model_type", None))
    try:
        plan = build_plan(arch, hook, config, model_dtype_itemsize=itemsize, available=_available(config, arch))
    except SpecError as e:
        if not args.model and any(k in (e.key or "") for k in ("layers", "heads", "ring_bytes", "topk")):
            e.note = (f"checked against the built-in {label} config ({config.num_hidden_layers} layers); "
                      f"pass --model <path or hub id> to check against your model")
        raise
    from ..interventions import plan_interventions
    writes = plan_interventions(arch, hook, config, available=_available(config, arch), engine="hf",
                                anchor_of=lambda canonical, layer: arch.data["sites"][canonical].get("hf"))
    print(f"{hook.file}: ok: hook spec, {len(plan.sites)} site instances in "
          f"{len({s.group for s in plan.sites})} store groups"
          + (f", {len(writes)} intervention(s)" if writes else ""))
    print(f"  checked against: {label} (family {plan.family}, {plan.layers} layers), arch spec {arch.file}")
    rows: dict[str, list] = {}
    for s in plan.sites:
        rows.setdefault(s.group, []).append(s)
    from ..store.inspect import layers_text
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
