"""Bad input fails early with a dmi error that names the file, the line, the key and the fix.

Every case checks four things:

* the class: a dmi error (SpecError / PolicyError / StoreError / AnchorError / DmiError);
* the message: ``<file>:<line>: <key>: <problem>. Fix: <fix>`` where there is a file / line / key;
* early: raised by dmi's own code (no frame of the traceback inside torch, zarr, yaml, jsonschema or
  transformers) and, for ``dmi.load``, before anything is written to the store;
* the fix is there (``Fix:``).

A hypothesis property test then feeds random hook specs (valid and invalid) to the plan builder and
random mutations of a YAML file to the loader: they load, or raise SpecError / PolicyError, never
anything else.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
import yaml

import dmi
import dmi.adapters
import dmi.kernels
import dmi.schemas
import dmi.specs
from dmi.errors import AnchorError, DmiError, PolicyError, SpecError, StoreError
from dmi.models import build_tiny_model, tiny_config
from dmi.plan import Plan, build_plan
from dmi.spec import builtin_spec_dir, load_arch_spec, load_hook_spec

from conftest import patched_modules

# dmi's code: the package and the subpackages that sit beside it in a checkout (specs, schemas, ...)
DMI_DIRS = tuple(Path(m.__file__).resolve().parent for m in (dmi, dmi.adapters, dmi.kernels, dmi.schemas, dmi.specs))
QWEN3_SPEC = builtin_spec_dir() / "qwen3.yaml"
GOOD = {"capture": [{"sites": ["resid_post"]}]}


# --- helpers ----------------------------------------------------------------------------------------

def check(excinfo: pytest.ExceptionInfo, cls: type, *, file=None, line: int | None = None, key: str | None = None,
          says: tuple[str, ...] = ()) -> str:
    """Assert the error class, its ``file:line: key:`` prefix, the fix, and that dmi raised it itself."""
    e = excinfo.value
    assert type(e) is cls, f"expected {cls.__name__}, got {type(e).__name__}: {e}"
    assert isinstance(e, DmiError)
    msg = str(e)
    if file is not None:
        where = f"{file}:{line}:" if line is not None else f"{file}:"
        assert msg.startswith(where), f"message should start with {where!r}: {msg}"
    if key is not None:
        assert f": {key}: " in msg, f"message should name the key {key!r}: {msg}"
    assert "Fix: " in msg, f"message has no fix: {msg}"
    assert len(msg.split("Fix: ", 1)[1].strip()) > 5, msg
    for text in says:
        assert text in msg, f"message should say {text!r}: {msg}"
    # raised early: by dmi's code, not from deep inside a library it calls
    frames = [Path(str(entry.path)).resolve() for entry in excinfo.traceback]
    assert any(frames[-1].is_relative_to(d) for d in DMI_DIRS), f"raised outside dmi, at {frames[-1]}"
    libs = ("torch", "zarr", "yaml", "jsonschema", "transformers", "numpy")
    deep = [f for f in frames if "site-packages" in f.parts and any(p in f.parts for p in libs)]
    assert not deep, f"raised from inside a library: {deep}"
    return msg


def line_of(path: Path, needle: str) -> int:
    """1-based line of the first line of ``path`` containing ``needle``."""
    for i, text in enumerate(path.read_text().splitlines(), 1):
        if needle in text:
            return i
    raise AssertionError(f"{needle!r} not in {path}")


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("tiny-qwen3")       # 3 layers, vocab 512, 4 heads, 2 kv heads


@pytest.fixture
def store(tmp_path):
    return tmp_path / "out.zarr"


@pytest.fixture
def load(model, store):
    """dmi.load(model, spec, store) that must fail: returns the ExceptionInfo; asserts no store was written."""
    def run(spec, exc: type = DmiError, **kwargs):
        kwargs.setdefault("store", store)
        with pytest.raises(exc) as info:
            dmi.load(kwargs.pop("model", model), hook_spec=spec, **kwargs)
        assert not store.exists(), "a failed load wrote a store"
        return info
    return run


def qwen3_copy(tmp_path: Path, old: str, new: str) -> Path:
    """The built-in qwen3 spec with the first ``old`` replaced by ``new``, written under tmp_path."""
    text = QWEN3_SPEC.read_text()
    assert old in text
    path = tmp_path / "qwen3_copy.yaml"
    path.write_text(text.replace(old, new, 1))
    return path


# --- YAML files -------------------------------------------------------------------------------------

def test_broken_yaml_bad_indentation(write_spec, load):
    spec = write_spec("""\
        capture:
          - sites: [resid_post]
           layers: [0]
        policy: {mode: full}
    """)
    check(load(spec, SpecError), SpecError, file=spec, line=3, says=("not valid YAML", "`layers: [0]`"))


def test_broken_yaml_unclosed_bracket(write_spec, load):
    spec = write_spec("""\
        capture:
          - sites: [resid_post, final_norm
            layers: [0]
        policy: {mode: full}
    """)
    # YAML notices at line 3; the message also points at the '[' that is not closed (line 2)
    check(load(spec, SpecError), SpecError, file=spec, line=3,
          says=("not valid YAML", "flow sequence that starts at line 2", "closing bracket"))


def test_broken_yaml_tab_indentation(write_spec, load):
    spec = write_spec("capture:\n\t- sites: [resid_post]\n")
    check(load(spec, SpecError), SpecError, file=spec, line=2, says=("not valid YAML", "spaces, not tabs"))


def test_unknown_yaml_tag_points_at_its_line(write_spec, load):
    spec = write_spec("""\
        capture:
          - sites: [resid_post]
            priority: !high 3
    """)
    check(load(spec, SpecError), SpecError, file=spec, line=3, says=("!high",))


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_empty_file(write_spec, load, text):
    spec = write_spec(text)
    check(load(spec, SpecError), SpecError, file=spec, says=("file is empty",))


def test_missing_file(tmp_path, load):
    spec = tmp_path / "nope.yaml"
    check(load(spec, SpecError), SpecError, file=spec, says=("does not exist",))


def test_yaml_text_instead_of_a_path(load):
    info = load("capture:\n  - sites: [resid_post]\n", SpecError)
    check(info, SpecError, says=("looks like YAML text",))


def test_spec_path_is_a_directory(tmp_path, load):
    check(load(tmp_path, SpecError), SpecError, file=tmp_path, says=("directory",))


def test_spec_not_utf8(tmp_path, load):
    spec = tmp_path / "latin1.yaml"
    spec.write_bytes("capture:\n  - sites: [resid_post]\n# café\n".encode("latin-1"))
    check(load(spec, SpecError), SpecError, file=spec, line=3, says=("UTF-8",))


def test_yaml_alias_bomb_is_refused_fast(write_spec, load, monkeypatch):
    """Refused once the expansion passes the node limit, not after walking all of it."""
    import dmi.spec
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdef", "bcdefg")]
    spec = write_spec("\n".join(levels) + "\ncapture: [*g]\n")       # 9**7 = 4.8 million scalars
    convert, visited = dmi.spec._to_python, [0]

    def counted(*args, **kwargs):
        visited[0] += 1
        return convert(*args, **kwargs)
    monkeypatch.setattr(dmi.spec, "_to_python", counted)     # (its recursion goes through the module's name)
    check(load(spec, SpecError), SpecError, file=spec, says=("expands to more than 100,000 YAML nodes", "aliases"))
    assert dmi.spec.MAX_YAML_NODES < visited[0] <= dmi.spec.MAX_YAML_NODES + 1, visited


def test_hook_spec_of_a_wrong_type(load):
    check(load(["resid_post"], SpecError), SpecError, says=("must be a path to a YAML file or a dict",))


# A bad hook spec: the error names the file, the line and the key, and says what is wrong and the fix.
# (test id, hook spec, line, key, what the message says)
SPEC_ERRORS = [
    ("duplicate_key", """\
        capture:
          - sites: [resid_post]
        policy: {mode: full}
        policy: {ring_bytes: 1MiB}
    """, 4, "policy",
     ("duplicate key (first at line 3)",)),
    ("unknown_top_level_key", """\
        capture:
          - sites: [resid_post]
        polcy:
          mode: full
    """, 3, "polcy",
     ("unknown key(s) 'polcy'", "did you mean 'policy'")),
    ("unknown_key_in_capture_entry", """\
        capture:
          - sites: [resid_post]
          - sites: [attn.q]
            layer: [0, 1]
    """, 4, "capture[1].layer",
     ("unknown key(s) 'layer'", "did you mean 'layers'")),
    ("sites_not_a_list", """\
        capture:
          - sites: resid_post
    """, 2, "capture[0].sites",
     ("'resid_post' is not of type array",)),
    ("layers_malformed_range", """\
        capture:
          - sites: [resid_post]
            layers: ["1-"]
    """, 3, "capture[0].layers[0]",
     ("not a layer or a layer range", "'2-5'")),
    ("ring_bytes_not_a_size", """\
        capture:
          - sites: [resid_post]
        policy:
          mode: full
          ring_bytes: lots
    """, 5, "policy.ring_bytes",
     ("'lots' is not a byte size", "64MiB")),
    ("tokens_empty_position_window", """\
        capture:
          - sites: [resid_post]
            tokens:
              positions: [8, 4]
    """, 4, "capture[0].tokens.positions",
     ("empty window [8, 4)",)),
    ("meta_records_below_schema_minimum", """\
        capture:
          - sites: [resid_post]
        policy:
          meta_records: 4
    """, 4, "policy.meta_records",
     ("4 is less than the minimum of 16", ">= 16")),
    ("store_threads_below_one", """\
        capture:
          - sites: [resid_post]
        store:
          threads: 0
    """, 4, "store.threads",
     ("0 is less than the minimum of 1",)),
    ("glob_matching_nothing", """\
        capture:
          - sites: [layers.*.attn.qq]
    """, 2, "capture[0].sites[0]",
     ("'layers.*.attn.qq' matches no site", "did you mean 'attn.q'")),
    ("layer_out_of_range", """\
        capture:
          - sites: [resid_post]
            layers: [0, 7]
    """, 3, "capture[0].layers[1]",
     ("layer 7 is out of range", "3 layers", "0..2")),
    ("negative_layer_out_of_range", """\
        capture:
          - sites: [resid_post]
            layers: [-1, -4]
    """, 3, "capture[0].layers[1]",
     ("layer -4 is out of range",)),
    ("site_captured_twice", """\
        capture:
          - sites: [resid_post]
          - sites: [attn.q, layers.1.resid_post]
    """, 3, "capture[1].sites[1]",
     ("'layers.1.resid_post' is already captured by capture[0]",)),
    ("site_layers_split_across_entries", """\
        capture:
          - sites: [resid_post]
            layers: [0]
          - sites: [resid_post]
            layers: [1]
            tokens: last
    """, 4, "capture[1].sites",
     ("layers of site 'resid_post' are split across capture[0] and capture[1]",)),
    ("max_keys_on_a_site_without_key_dim", """\
        capture:
          - sites: [attn.q]
            max_keys: 64
    """, 3, "capture[0].max_keys",
     ("max_keys applies only to sites with a key dim",)),
    ("topk_larger_than_vocab", """\
        capture:
          - sites: [logits]
            reduce:
              topk: 1000
    """, 4, "capture[0].reduce.topk",
     ("topk 1000 exceeds", "vocab=512", "topk <= 512")),
    ("heads_out_of_range", """\
        capture:
          - sites: [attn.k]
            heads: [0, 2]
    """, 3, "capture[0].heads",
     ("heads [2] out of range", "attn.k has 2", "0..1")),
    ("heads_on_a_site_without_head_dim", """\
        capture:
          - sites: [mlp.out]
            heads: [0]
    """, 3, "capture[0].heads",
     ("'mlp.out' has no head dim", "remove `heads`")),
    ("layers_on_a_model_level_site", """\
        capture:
          - sites: [final_norm]
            layers: [0]
    """, 3, "capture[0].layers",
     ("site 'final_norm' is not per-layer", "`layers` does not apply", "in an entry without `layers`")),
    ("layers_on_a_glob_with_model_level_sites", """\
        capture:
          - sites: ["*"]
            layers: [0]
    """, 3, "capture[0].layers",
     ("matches model-level site(s) ['embed', 'final_norm', 'logits']", "narrow the pattern")),
]


@pytest.mark.parametrize("text, line, key, says", [pytest.param(*case[1:], id=case[0]) for case in SPEC_ERRORS])
def test_bad_hook_spec(write_spec, load, text, line, key, says):
    spec = write_spec(text)
    check(load(spec, SpecError), SpecError, file=spec, line=line, key=key, says=says)


# --- hook spec: shape and types (JSON Schema) -------------------------------------------------------

@pytest.mark.parametrize("value", ["1.5", "2.0"])
def test_layers_with_a_float(write_spec, load, value):
    spec = write_spec(f"""\
        capture:
          - sites: [resid_post]
            layers: [0, {value}]
    """)
    check(load(spec, SpecError), SpecError, file=spec, line=3, key="capture[0].layers[1]",
          says=(f"{value} is not of type integer",))


@pytest.mark.parametrize("tokens, key, says", [
    ("first", "capture[0].tokens", ("'first' is not one of", "'last'")),
    ("{every: 2}", "capture[0].tokens.every", ("unknown key(s) 'every'", "every_n_steps")),
    ("{every_n_steps: 0}", "capture[0].tokens.every_n_steps", ("give a value >= 1",)),
])
def test_invalid_tokens(write_spec, load, tokens, key, says):
    spec = write_spec(f"""\
        capture:
          - sites: [resid_post]
            tokens: {tokens}
    """)
    check(load(spec, SpecError), SpecError, file=spec, line=3, key=key, says=says)


def test_wrong_version(load):
    check(load({"version": 2, **GOOD}, SpecError), SpecError, file="<hook spec dict>", key="version",
          says=("use 1",))


# --- hook spec against the model (dmi.plan) ---------------------------------------------------------

def test_unknown_site_did_you_mean(write_spec, load):
    spec = write_spec("""\
        capture:
          - sites: [final_norm]
          - sites: [resid_pre, resid_psot]
    """)
    msg = check(load(spec, SpecError), SpecError, file=spec, line=3, key="capture[1].sites[1]",
                says=("'resid_psot'", "did you mean 'resid_post'"))
    assert "qwen3.yaml" in msg       # names the architecture spec that lists the sites


@pytest.mark.parametrize("site, says", [
    ("layers.5.attn.q", ("matches no layer of this model", "0..2", "layers.<0..2>.attn.q")),
    ("layers.0.logits", ("'logits' is a model-level site", "without 'layers.0.'")),
])
def test_site_name_with_a_wrong_layer(write_spec, load, site, says):
    spec = write_spec(f"""\
        capture:
          - sites: [{site}]
    """)
    check(load(spec, SpecError), SpecError, file=spec, line=2, key="capture[0].sites[0]", says=says)


def test_site_listed_twice_in_one_entry(load):
    check(load({"capture": [{"sites": ["attn.*", "attn.q"]}]}, SpecError), SpecError, file="<hook spec dict>",
          key="capture[0].sites[1]", says=("'layers.0.attn.q' is already captured by sites[0] of this entry",))


@pytest.mark.parametrize("rng", ["2-1", "-1--2"])
def test_empty_layer_range(write_spec, load, rng):
    spec = write_spec(f"""\
        capture:
          - sites: [resid_post]
            layers: ["{rng}"]
    """)
    check(load(spec, SpecError), SpecError, file=spec, line=3, key="capture[0].layers[0]",
          says=(f"empty range '{rng}'", "low-high"))


def test_negative_layer_ranges_resolve():
    # not an error: '-3--1' is every layer of a 3-layer model, '0 - -2' the first two
    arch, cfg = load_arch_spec(QWEN3_SPEC), tiny_config("qwen3")
    plan = build_plan(arch, load_hook_spec({"capture": [{"sites": ["resid_post"], "layers": ["-3--1"]},
                                                        {"sites": ["mlp.out"], "layers": ["0 - -2"]}]}), cfg)
    assert [s.name for s in plan.sites] == ["layers.0.mlp.out", "layers.0.resid_post", "layers.1.mlp.out",
                                            "layers.1.resid_post", "layers.2.resid_post"]


def test_a_site_the_engine_never_computes_is_refused_by_name_and_left_out_of_a_glob(write_spec):
    """An adapter passes the sites whose anchor exists but never runs in its engine, with why
    (vLLM 0.25's CPU MoE kernel routes inside itself: scripts/gpu_versions.sh runs that engine).
    Named, such a site is refused with the reason; matched by a glob it is left out, and the plan
    says so (the vLLM adapter logs it and records it in the store's ``sites_unavailable``)."""
    arch, cfg = load_arch_spec(QWEN3_SPEC), tiny_config("qwen3")
    why = {"attn.q": "this engine fuses q into its attention kernel"}
    spec = write_spec("""\
        capture:
          - sites: [resid_post, attn.q]
    """)
    with pytest.raises(SpecError) as info:
        build_plan(arch, load_hook_spec(spec), cfg, unavailable=why)
    check(info, SpecError, file=spec, line=2, key="capture[0].sites[1]",
          says=("'attn.q' cannot be captured in this engine: this engine fuses q", "drop 'attn.q' from `sites`"))
    plan = build_plan(arch, load_hook_spec({"capture": [{"sites": ["resid_post", "attn.*"]}]}), cfg, unavailable=why)
    assert plan.unavailable == why
    assert "attn.q" not in {s.canonical for s in plan.sites} and "attn.k" in {s.canonical for s in plan.sites}
    assert build_plan(arch, load_hook_spec({"capture": [{"sites": ["resid_post"]}]}), cfg, unavailable=why).unavailable == {}


def test_heads_listed_twice(write_spec, load):
    spec = write_spec("""\
        capture:
          - sites: [attn.q]
            heads: [1, 1]
    """)
    check(load(spec, SpecError), SpecError, file=spec, line=3, key="capture[0].heads", says=("more than once",))


def test_policy_ring_too_small(write_spec, load):
    spec = write_spec("""\
        capture:
          - sites: [resid_pre, resid_post, attn.q, attn.k, mlp.act, logits]
        policy:
          mode: best_effort
          ring_bytes: 1KiB
    """)
    # best_effort drops what does not fit, so one whole step must fit:
    # one token: 3 layers x (64 + 64 + 4*32 + 2*32 + 128) floats + 512 logits, 4 bytes each
    need = 4 * (3 * (64 + 64 + 128 + 64 + 128) + 512)
    check(load(spec, PolicyError), PolicyError, file=spec, line=5, key="policy.ring_bytes",
          says=(f"needs {need:,} bytes", "policy.ring_bytes is 1,024", f"at least {need:,}"))


def test_policy_ring_too_small_for_max_step_tokens():
    hook = load_hook_spec({"capture": [{"sites": ["resid_post"]}],
                           "policy": {"ring_bytes": "64KiB", "max_step_tokens": 1024}})
    with pytest.raises(PolicyError) as info:
        build_plan(load_arch_spec(QWEN3_SPEC), hook, tiny_config("qwen3"))
    need = 1024 * 64 * 4          # one capture (one layer's rows): a larger step streams through the ring
    check(info, PolicyError, file="<hook spec dict>", key="policy.ring_bytes",
          says=("1024 token(s)", f"{need:,} bytes", "65,536", "max_step_tokens"))


def test_unknown_trace_mode_is_refused_on_every_ring(load, write_spec):
    """The hook spec's engine.traced is checked at load: a value it does not know is refused naming
    the three, on the CPU ring too (which has no traced captures to make)."""
    spec = write_spec("""
        capture:
          - sites: [resid_post]
        engine:
          traced: "yes"
    """)
    info = load(spec, SpecError)
    check(info, SpecError, file=str(spec), line=5, key="engine.traced", says=("'yes'", "off", "all", "range"))


def test_meta_records_too_small_for_the_sites(write_spec, load):
    spec = write_spec("""\
        capture:
          - sites: [resid_pre, resid_mid, resid_post, attn.q, attn.k, attn.v]
        policy:
          meta_records: 16
    """)
    check(load(spec, PolicyError), PolicyError, file=spec, line=4, key="policy.meta_records",
          says=("19 meta records (18 sites + 1)", "policy.meta_records is 16", "at least 19"))


# --- store ------------------------------------------------------------------------------------------

def test_store_under_a_regular_file(tmp_path, load):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file, so nothing can be created under it (even as root)")
    target = blocker / "sub" / "out.zarr"
    msg = check(load(GOOD, StoreError, store=target), StoreError, says=(str(target), "is a file, not a directory"))
    assert str(blocker) in msg
    assert blocker.read_text().startswith("a file")


def test_store_exists_without_overwrite(tmp_path, model):
    existing = tmp_path / "old.zarr"
    existing.mkdir()
    (existing / "zarr.json").write_text("{}")
    with pytest.raises(StoreError) as info:
        dmi.load(model, hook_spec=GOOD, store=existing)
    check(info, StoreError, says=(str(existing), "already exists", "overwrite=True"))
    assert (existing / "zarr.json").read_text() == "{}"


def test_store_is_a_file(tmp_path, model):
    path = tmp_path / "out.zarr"
    path.write_text("x")
    with pytest.raises(StoreError) as info:
        dmi.load(model, hook_spec=GOOD, store=path, overwrite=True)
    check(info, StoreError, says=(str(path), "not a directory"))


def test_overwrite_refuses_a_directory_that_is_not_a_store(tmp_path, model):
    precious = tmp_path / "my_results"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(StoreError) as info:
        dmi.load(model, hook_spec=GOOD, store=precious, overwrite=True)
    check(info, StoreError, says=(str(precious), "not a Zarr store"))
    assert (precious / "notes.txt").read_text() == "keep me"


def test_store_is_checked_before_the_model_loads(tmp_path, monkeypatch):
    existing = tmp_path / "old.zarr"
    existing.mkdir()
    from dmi.adapters.hf.engine import HFEngine
    monkeypatch.setattr(HFEngine, "resolve_model", lambda *a, **k: pytest.fail("the model was loaded first"))
    with pytest.raises(StoreError):
        dmi.load("tiny-qwen3", hook_spec=GOOD, store=existing)


def test_no_store_to_resume(write_spec, load):
    """No store is an in-memory result (tests/test_memory_result.py), which cannot be resumed."""
    spec = write_spec("""\
        capture:
          - sites: [resid_post]
        policy: {mode: full}
    """)
    check(load(spec, SpecError, store=None, resume=True), SpecError, file=spec, key="store.path",
          says=("resume=True needs a store", "store='out.zarr'"))


# --- architecture specs -----------------------------------------------------------------------------

def test_unknown_model_type(load):
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    msg = check(load(GOOD, SpecError, model=gpt2), SpecError, file=builtin_spec_dir(), key="match.model_type",
                says=("no architecture spec matches model_type 'gpt2'", "arch_spec=", "'qwen3'"))
    assert "<spec>" not in msg


def test_arch_spec_dim_not_declared(tmp_path, load):
    arch = qwen3_copy(tmp_path, "dims: [token, head, head_dim]", "dims: [token, heads, head_dim]")
    check(load(GOOD, SpecError, arch_spec=arch), SpecError, file=arch, line=line_of(arch, "[token, heads, head_dim]"),
          key="sites.attn.q.dims", says=("dim 'heads' is not declared under dims", "'head'"))


def test_arch_spec_next_layer_path_without_a_last_anchor(tmp_path, load):
    arch = qwen3_copy(tmp_path, ", last: {module: model.norm, output: 1}}", "}")
    check(load(GOOD, SpecError, arch_spec=arch), SpecError, file=arch, line=line_of(arch, "{i+1}.input_layernorm"),
          key="sites.resid_post.vllm.module", says=("next layer ({i+1})", "add `last:"))


def test_arch_spec_broken_yaml(tmp_path, load):
    arch = qwen3_copy(tmp_path, "  layer: num_hidden_layers", "  layer num_hidden_layers: [")
    check(load(GOOD, SpecError, arch_spec=arch), SpecError, file=arch, says=("not valid YAML",))


def test_arch_spec_unknown_anchor_key(tmp_path, load):
    arch = qwen3_copy(tmp_path, "occurrence: 0", "ocurrence: 0")
    check(load(GOOD, SpecError, arch_spec=arch), SpecError, file=arch, line=line_of(arch, "ocurrence"),
          key="sites.attn.q.hf.ocurrence", says=("'ocurrence'", "did you mean 'occurrence'"))


def test_arch_spec_anchor_missing_in_this_transformers(tmp_path, store):
    arch = qwen3_copy(tmp_path, "assign: query_states", "assign: no_such_variable")
    rng = yaml.safe_load(QWEN3_SPEC.read_text())["hf"]["transformers"]
    model = build_tiny_model("tiny-qwen3")
    with pytest.raises(AnchorError) as info:
        dmi.load(model, hook_spec={"capture": [{"sites": ["attn.q", "resid_post"]}]}, store=store, arch_spec=arch)
    check(info, AnchorError, file=arch, line=line_of(arch, "no_such_variable"), key="sites.attn.q.hf",
          says=("'no_such_variable'", f"installed transformers {transformers.__version__}", rng,
                f"install transformers {rng}"))
    assert not store.exists(), "a load that failed to patch left a store behind"
    # the model is left unpatched and still runs
    assert not patched_modules(model)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))


def test_anchor_error_names_the_site_whose_anchor_is_missing(tmp_path, store):
    arch = qwen3_copy(tmp_path, "assign: value_states", "assign: no_such_variable")
    model = build_tiny_model("tiny-qwen3")
    with pytest.raises(AnchorError) as info:
        dmi.load(model, hook_spec={"capture": [{"sites": ["resid_post", "attn.q", "attn.v"]}]},
                 store=store, arch_spec=arch)
    check(info, AnchorError, file=arch, line=line_of(arch, "no_such_variable"), key="sites.attn.v.hf")
    # nothing stays patched
    assert not patched_modules(model)


def test_arch_spec_of_another_family_is_refused(load):
    llama = build_tiny_model("tiny-llama3_1")
    msg = check(load(GOOD, SpecError, model=llama, arch_spec=QWEN3_SPEC), SpecError, file=QWEN3_SPEC,
                line=line_of(QWEN3_SPEC, "model_type:"), key="match.model_type",
                says=("family 'qwen3'", "config.model_type is 'llama'", "llama3_1.yaml", "add 'llama' to match.model_type"))
    assert "did you mean" not in msg


def test_arch_spec_listing_the_model_type_is_accepted(tmp_path, store):
    arch = qwen3_copy(tmp_path, "model_type: [qwen3]", "model_type: [qwen3, llama]")
    run = dmi.load(build_tiny_model("tiny-llama3_1"), hook_spec={"capture": [{"sites": ["resid_post"]}]},
                   store=store, arch_spec=arch)
    run.close()


def test_arch_spec_module_path_that_matches_nothing_is_blamed_on_the_arch_spec(tmp_path, write_spec, load):
    arch = qwen3_copy(tmp_path, '"model.layers.{i}", output: 0', '"model.blocks.{i}", output: 0')
    hook = write_spec("capture:\n  - sites: [resid_post]\n")
    msg = check(load(hook, SpecError, arch_spec=arch), SpecError, file=arch, line=line_of(arch, "model.blocks.{i}"),
                key="sites.resid_post.hf.module",
                says=("site 'resid_post' is in the spec but its module path 'model.blocks.{i}' matches nothing in this "
                      "model", f"{hook}:2 capture[0].sites[0]"))
    assert "did you mean" not in msg


def test_model_without_layers_is_not_a_typo(load):
    config = tiny_config("qwen3")
    config.num_hidden_layers = 0
    msg = check(load(GOOD, SpecError, model=config), SpecError, file=QWEN3_SPEC, key="dims.layer",
                says=("num_hidden_layers=0", "no layer to capture", "final_norm"))
    assert "did you mean" not in msg


def test_a_close_match_never_suggests_the_name_asked_for():
    from dmi.plan import no_match
    arch = load_arch_spec(QWEN3_SPEC)
    _, fix = no_match("resid_post", arch, sorted(arch.data["sites"]), 3, [], {})
    assert "'resid_post'" not in fix.split("sites of this family")[0], fix


# --- the model argument -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad, says", [
    (object(), "cannot load a model from a object"),
    (torch.nn.Linear(4, 4), "Linear is not a transformers model"),
    ("tiny-qwen4", "did you mean 'tiny-qwen3'"),
    ("qwen3-tiny", "is not a built-in model, a local directory or a model in the hub cache"),
    ("./no/such/model", "no such directory: 'no/such/model'"),
    ("~/no-such-model-dir", "no such directory: "),
    (Path("/no/such/model"), "no such directory: '/no/such/model'"),
])
def test_load_with_something_that_is_not_a_model(load, bad, says):
    check(load(GOOD, DmiError, model=bad), DmiError, key="model", says=(says,))


def test_a_model_name_is_checked_without_the_network(load, monkeypatch):
    def offline(*args, **kwargs):
        raise AssertionError("from_pretrained was called: the check should have refused the name first")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", offline)
    msg = check(load(GOOD, DmiError, model="tiny-qwen4"), DmiError, key="model", says=("tiny-llama3_1", "tiny-mixtral"))
    assert "hub cache" in msg


@pytest.mark.parametrize("bad", [123, 1.5, ["out.zarr"]])
def test_store_of_a_wrong_type(load, bad):
    check(load(GOOD, StoreError, store=bad), StoreError, key="store",
          says=(f"a {type(bad).__name__}", "is not a store path", "str or a pathlib.Path"))


def test_errors_name_the_schema_patterns_they_special_case():
    # dmi.spec words the byte-size and layer-range pattern errors; keep it in step with the schema
    import json

    from dmi import spec
    schema = json.loads((Path(dmi.schemas.__file__).parent / "hook_spec.schema.json").read_text())
    assert schema["$defs"]["bytes"]["oneOf"][1]["pattern"] == spec._BYTES_PATTERN
    assert schema["$defs"]["capture"]["properties"]["layers"]["items"]["oneOf"][1]["pattern"] == spec._RANGE_PATTERN


# --- property tests ---------------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ARCH = load_arch_spec(QWEN3_SPEC)
CONFIG = tiny_config("qwen3")
CANONICAL = sorted(ARCH.data["sites"])


def mix(good, bad, one_in: int = 12):
    """Mostly ``good`` values, one time in ``one_in`` a ``bad`` one (so about half the specs are valid)."""
    # the bad branch sits mid-range: hypothesis favours 0 and the bounds when it draws integers
    return st.integers(0, one_in - 1).flatmap(lambda i: bad if i == one_in // 2 else good)


def _range(lo: int, hi: int) -> str:
    return f"{lo}-{hi}"


SITE = mix(
    st.one_of(st.sampled_from(CANONICAL),
              st.builds("layers.{}.{}".format, st.sampled_from(["*", "0", "1", "2", "[01]"]), st.sampled_from(CANONICAL))),
    st.one_of(st.builds("layers.{}.{}".format, st.sampled_from(["3", "-1", "x"]), st.sampled_from(CANONICAL)),
              st.sampled_from(["resid_psot", "layers.*.attn.qq", "", "layers.", "[", "Logits", "final_norm.x"])),
)
SITES = mix(st.lists(SITE, min_size=1, max_size=3), st.one_of(st.just([]), st.sampled_from(CANONICAL)))
LAYER = mix(
    st.one_of(st.integers(-3, 2), st.tuples(st.integers(0, 2), st.integers(0, 2)).map(lambda t: _range(*sorted(t))),
              st.sampled_from(["-3--1", "0 - 2", "-2--2"])),
    st.one_of(st.sampled_from([3, -4, 7, "2-1", "-1--2", "0-3", "1-", "x", 1.5, 2.0, True, None]),
              st.tuples(st.integers(-6, 6), st.integers(-6, 6)).map(lambda t: _range(*t))),
)
LAYERS = mix(st.lists(LAYER, min_size=1, max_size=3), st.just([]), one_in=20)
TOKENS = mix(
    st.one_of(
        st.sampled_from(["all", "prefill", "decode", "last"]),
        st.fixed_dictionaries({}, optional={
            "phase": st.sampled_from(["all", "prefill", "decode"]),
            "last": st.booleans(),
            "every_n_steps": st.integers(1, 4),
            "positions": st.tuples(st.integers(0, 8), st.integers(1, 8)).map(lambda t: [t[0], t[0] + t[1]]),
            "max_per_request": st.integers(1, 8),
        })),
    st.one_of(
        st.sampled_from(["first", None, 3, True, {"every": 2}, {"phase": "last"}, {"last": "yes"},
                         {"every_n_steps": 0}, {"every_n_steps": 2.0}, {"positions": [5, 2]}, {"positions": [4, 4]},
                         {"positions": [-1, 3]}, {"positions": [0]}, {"positions": [0, 1, 2]},
                         {"max_per_request": 0}]),
    ),
)
REDUCE = mix(st.one_of(st.builds(lambda k: {"topk": k}, st.integers(1, 40)), st.just({"norm": True})),
             st.sampled_from([{"topk": 600}, {"topk": 0}, {"norm": False}, {}, {"topk": 2, "norm": True}, {"max": 1}]))
HEADS = mix(st.lists(st.integers(0, 1), min_size=1, max_size=2, unique=True),
            st.sampled_from([[], [-1], [0, 0], [5], [1.0], "0"]))
BYTES = mix(st.one_of(st.sampled_from(["64MiB", "8 MiB", "0.5GiB", "1MiB"]), st.integers(1 << 20, 1 << 26)),
            st.sampled_from(["1KiB", "16B", 100, 0, -1, "lots", "1e6", "", 4096.0, None]))
# a D2H cap: good ones high enough that a short capture never waits on it
D2H = mix(st.one_of(st.sampled_from(["2GiB", "64 MiB", "1.5GiB"]), st.integers(64 << 20, 1 << 33)),
          st.sampled_from([0, "0 GiB", "0.5B", -1, "fast", "2 GiB/s", 1.5e9, None]))
POLICY = st.fixed_dictionaries({}, optional={
    "mode": mix(st.sampled_from(["full", "best_effort"]), st.just("fast")),
    "ring_bytes": BYTES,
    "host_bytes": BYTES,
    "meta_records": mix(st.integers(64, 8192), st.sampled_from([0, 15, 16, 17, "many", 32.0])),
    "max_step_tokens": mix(st.integers(1, 64), st.sampled_from([0, 4096, None])),
    "d2h_bytes_per_s": D2H,
    "on_store_error": mix(st.sampled_from(["raise", "drop"]), st.just("ignore")),
})
ENTRY = st.builds(
    lambda entry, extra: {**entry, **extra},
    st.fixed_dictionaries({"sites": SITES}, optional={
        "layers": LAYERS,
        "tokens": TOKENS,
        "reduce": REDUCE,
        "max_keys": mix(st.integers(1, 64), st.sampled_from([0, 64.0, "all"])),
        "priority": mix(st.integers(-3, 3), st.sampled_from(["high", 1.5])),
    }),
    # rare: only head sites take `heads`; `layer` is a misspelt key
    mix(st.just({}), st.one_of(HEADS.map(lambda h: {"heads": h}), st.just({"layer": [0]})), one_in=6),
)
HOOK = st.builds(
    lambda hook, extra: {**hook, **extra},
    st.fixed_dictionaries({"capture": mix(st.lists(ENTRY, min_size=1, max_size=3), st.just([]), one_in=30)}, optional={
        "policy": POLICY,
        "store": st.fixed_dictionaries({}, optional={
            "path": mix(st.just("o.zarr"), st.sampled_from(["", 3])),
            "dtype": mix(st.sampled_from(["float16", "float32", "bfloat16", "native"]), st.just("int8")),
            "chunk_bytes": BYTES,
            "threads": mix(st.integers(1, 3), st.sampled_from([0, "2"]))}),
        "version": mix(st.just(1), st.just(2)),
    }),
    mix(st.just({}), st.just({"polcy": {}}), one_in=20),     # rare: a misspelt top-level key
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(HOOK)
def test_random_hook_specs_plan_or_raise_spec_errors(spec):
    try:
        plan = build_plan(ARCH, load_hook_spec(spec), CONFIG)
    except (SpecError, PolicyError) as e:
        msg = str(e)
        assert msg.startswith("<hook spec dict>: ") and "Fix: " in msg, msg
        return
    assert isinstance(plan, Plan)
    names = [s.name for s in plan.sites]
    assert len(names) == len(set(names)) > 0
    assert all(s.layer is None or 0 <= s.layer < CONFIG.num_hidden_layers for s in plan.sites)
    assert all(isinstance(d, int) for s in plan.sites for o in s.outputs for d in o.shape)
    assert isinstance(plan.policy.ring_bytes, int) and plan.policy.ring_bytes >= plan.step_bytes(1, 4)


VALID_YAML = """\
version: 1
capture:
  - sites: [resid_post, attn.q]
    layers: [0, "1-2"]
    tokens: {phase: decode, every_n_steps: 2}
  - sites: [logits]
    reduce: {topk: 5}
    tokens: last
policy:
  mode: best_effort
  ring_bytes: 8MiB
store: {dtype: float16}
"""
_FUZZ_DIR = Path(tempfile.mkdtemp(prefix="dmi-test-errors-"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID_YAML)), st.integers(0, 3),
                          st.sampled_from(list("[]{}:-,'\"\t #&*!|>?%@`\n") + ["  ", "- ", "1.5", "<<: "])),
                min_size=1, max_size=4))
def test_mutated_yaml_loads_or_raises_spec_errors(edits):
    text = VALID_YAML
    for pos, cut, insert in edits:
        pos = min(pos, len(text))
        text = text[:pos] + insert + text[pos + cut:]
    path = _FUZZ_DIR / "fuzz.yaml"
    path.write_text(text)
    try:
        build_plan(ARCH, load_hook_spec(path), CONFIG)
    except (SpecError, PolicyError) as e:
        msg = str(e)
        assert msg.startswith(f"{path}") and "Fix: " in msg, msg
        assert re.match(rf"{re.escape(str(path))}(:\d+)?: ", msg), msg


def test_moe_site_on_a_dense_layer(write_spec, tmp_path):
    spec = write_spec("""\
        capture:
          - sites: [layers.1.moe.topk_ids]
    """)
    moe = build_tiny_model("tiny-qwen3_moe")      # layer 1 is dense (mlp_only_layers)
    with pytest.raises(SpecError) as excinfo:
        dmi.load(moe, hook_spec=spec, store=tmp_path / "o.zarr")
    check(excinfo, SpecError, file=spec, line=2, key="capture[0].sites[0]",
          says=("'moe.topk_ids' does not exist on layer 1", "only on layers [0, 2]"))
    assert not (tmp_path / "o.zarr").exists()


def test_failed_attach_leaves_no_module_patched(tmp_path, store):
    # attn.q patches fine (source rewrite), then mlp.act's input parameter is missing
    arch = qwen3_copy(tmp_path, "mlp.down_proj\", input: 0", "mlp.down_proj\", input: no_such_param")
    model = build_tiny_model("tiny-qwen3")
    with pytest.raises(AnchorError) as info:
        dmi.load(model, hook_spec={"capture": [{"sites": ["attn.q", "mlp.act"]}]}, store=store, arch_spec=arch)
    check(info, AnchorError, file=arch, key="sites.mlp.act.hf", says=("no_such_param",))
    assert not patched_modules(model)
    assert not store.exists()
