"""Where dmi finds architecture specs: ``--arch-spec`` on the command line, the ``DMI_SPEC_PATH``
directories (before the built-in specs, a family's spec there replacing the built-in one), and the
``dmi.specs`` entry points of installed packages (a real distribution on sys.path: a dist-info
directory with entry_points.txt, found by importlib.metadata as pip's would be)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers as tf
import zarr

import dmi
from dmi.cli import main
from dmi.errors import SpecError
from dmi.models import tiny_tokenizer
from dmi.spec import builtin_spec_dir, effective_specs, find_arch_spec, search_specs

REPO = Path(__file__).resolve().parents[1]
HOOKS = "capture:\n  - sites: [resid_post, mlp.act]\n"
PROMPTS = '{"id": "a", "prompt": "Hello world! How are you"}\n{"id": "b", "prompt": "Paris"}\n'


def olmo_spec(path: Path, family: str = "olmo_example") -> Path:
    """An OLMo spec a contributor wrote from the Llama one (the sites this test captures fit OLMo)."""
    text = (builtin_spec_dir() / "llama3_1.yaml").read_text()
    text = text.replace("family: llama3_1", f"family: {family}").replace("model_type: [llama]", "model_type: [olmo]")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def olmo_dir(tmp_path_factory) -> Path:
    """A tiny OLMo saved as a model directory (config, weights, tokenizer): no spec is built in."""
    d = tmp_path_factory.mktemp("olmo") / "model"
    config = tf.OlmoConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def capture(tmp_path: Path, model: Path, *extra: str) -> int:
    hooks, prompts = tmp_path / "hooks.yaml", tmp_path / "prompts.jsonl"
    hooks.write_text(HOOKS)
    prompts.write_text(PROMPTS)
    return main(["capture", "--model", str(model), "--spec", str(hooks), "--prompts", str(prompts), "--out",
                 str(tmp_path / "out.zarr"), "--max-new-tokens", "2", "--quiet", *extra])


def test_capture_without_a_spec_for_the_model_names_the_flag(tmp_path, olmo_dir, capsys, monkeypatch):
    monkeypatch.delenv("DMI_SPEC_PATH", raising=False)
    assert capture(tmp_path, olmo_dir) == 2
    err = capsys.readouterr().err
    assert "no architecture spec matches model_type 'olmo'" in err
    assert "dmi capture --arch-spec FILE" in err and "DMI_SPEC_PATH" in err, err
    assert not (tmp_path / "out.zarr").exists()


def test_capture_takes_an_arch_spec(tmp_path, olmo_dir, capsys, monkeypatch):
    monkeypatch.delenv("DMI_SPEC_PATH", raising=False)
    spec = olmo_spec(tmp_path / "specs" / "olmo.yaml")
    assert capture(tmp_path, olmo_dir, "--arch-spec", str(spec)) == 0, capsys.readouterr().err
    root = zarr.open_group(str(tmp_path / "out.zarr"), mode="r")
    assert root.attrs["arch_spec"] == str(spec) and root.attrs["family"] == "olmo_example"
    assert root["layers/mlp/act/act"].shape[0] > 0


def test_capture_finds_a_spec_on_dmi_spec_path(tmp_path, olmo_dir, capsys, monkeypatch):
    spec = olmo_spec(tmp_path / "specs" / "olmo.yaml")
    monkeypatch.setenv("DMI_SPEC_PATH", os.pathsep.join([str(tmp_path / "empty"), str(spec.parent)]))
    (tmp_path / "empty").mkdir()
    assert capture(tmp_path, olmo_dir) == 0, capsys.readouterr().err
    assert zarr.open_group(str(tmp_path / "out.zarr"), mode="r").attrs["arch_spec"] == str(spec)


def test_a_family_on_dmi_spec_path_replaces_the_builtin_one(tmp_path, monkeypatch, capsys):
    """Searched by family name before the built-in specs: a llama3_1 spec there is the one used."""
    mine = tmp_path / "specs" / "llama3_1.yaml"
    mine.parent.mkdir()
    mine.write_text((builtin_spec_dir() / "llama3_1.yaml").read_text().replace("description: Llama decoder",
                                                                                "description: my Llama decoder"))
    monkeypatch.setenv("DMI_SPEC_PATH", str(mine.parent))
    assert find_arch_spec("llama").file == str(mine)
    with dmi.load("tiny-llama3_1", hook_spec={"capture": [{"sites": ["resid_post"]}]}, store=tmp_path / "o.zarr") as run:
        assert run.plan.arch_file == str(mine)
    assert main(["specs", "list", "--json"]) == 0
    out = capsys.readouterr()
    rows = [r for r in json.loads(out.out) if r["family"] == "llama3_1"]
    assert [(r["source"], r["file"]) for r in rows] == [("DMI_SPEC_PATH", str(mine)),
                                                       ("built-in", str(builtin_spec_dir() / "llama3_1.yaml"))]
    assert rows[1]["shadowed_by"] == str(mine)


def test_dmi_spec_path_that_is_not_a_directory_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("DMI_SPEC_PATH", str(tmp_path / "nope"))
    with pytest.raises(SpecError) as info:
        find_arch_spec("llama")
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path / 'nope'}: DMI_SPEC_PATH: ") and "not a directory" in msg and "Fix: " in msg


def installed_package(root: Path) -> Path:
    """A package shipping one spec, installed as pip would: the package directory and its
    dist-info (METADATA, entry_points.txt with a ``dmi.specs`` entry) under ``root``."""
    pkg = root / "dmi_extra_specs"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    olmo_spec(pkg / "olmo.yaml", family="olmo_extra")
    info = root / "dmi_extra_specs-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dmi-extra-specs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dmi.specs]\nextra = dmi_extra_specs\n")
    (info / "RECORD").write_text("")
    return pkg / "olmo.yaml"


def test_an_installed_packages_specs_are_found_and_listed(tmp_path, monkeypatch):
    spec = installed_package(tmp_path / "site")
    monkeypatch.delenv("DMI_SPEC_PATH", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    found = [f for f in search_specs() if f.path == spec]
    assert [f.source for f in found] == ["entry point extra (dmi-extra-specs 0.1)"]
    assert find_arch_spec("olmo").file == str(spec)
    assert any(d.data["family"] == "olmo_extra" for _, d in effective_specs())
    # `dmi specs list` (the console entry point, in a process of its own) shows it with its source
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path / "site")])}
    out = subprocess.run([sys.executable, "-m", "dmi.cli", "specs", "list"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("olmo_extra"))
    assert "olmo" in row and "entry point extra (dmi-extra-specs 0.1)" in row and str(spec) in row, row
    header = out.stdout.splitlines()[0].split()
    assert header == ["family", "model_types", "sites", "source", "file"]


def test_an_entry_point_that_cannot_load_is_named(tmp_path, monkeypatch):
    installed_package(tmp_path / "site")
    (tmp_path / "site" / "dmi_extra_specs-0.1.dist-info" / "entry_points.txt").write_text(
        "[dmi.specs]\nextra = dmi_extra_specs_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(SpecError) as info:
        search_specs()
    msg = str(info.value)
    assert msg.startswith("entry point extra (dmi-extra-specs 0.1): dmi.specs: ") and "ModuleNotFoundError" in msg
    assert "Fix: " in msg


def test_specs_validate_warns_about_site_names_outside_the_vocabulary(tmp_path, capsys):
    spec = tmp_path / "odd.yaml"
    spec.write_text((builtin_spec_dir() / "qwen3.yaml").read_text().replace("  attn.z:\n", "  attn.zz:\n"))
    assert main(["specs", "validate", str(spec)]) == 0
    err = capsys.readouterr().err
    line = next(i for i, t in enumerate(spec.read_text().splitlines(), 1) if t == "  attn.zz:")
    assert f"dmi: warning: {spec}:{line}: sites.attn.zz: 'attn.zz' is not in the site vocabulary. Fix: did you " \
           f"mean 'attn.z'?" in err, err
    assert main(["specs", "validate", str(builtin_spec_dir() / "qwen3.yaml")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_the_vocabulary_is_the_one_docs_sites_md_lists():
    """Every site the docs' table names is in the vocabulary, and the other way round; every
    built-in spec uses vocabulary names only."""
    import re
    from dmi.spec import SITE_VOCABULARY, list_specs, load_arch_spec
    table = (REPO / "docs" / "sites.md").read_text().split("## Sites", 1)[1].split("Notes:", 1)[0]
    documented = {re.sub(r"^layers\.\{i\}\.", "", m) for m in re.findall(r"^\| `([^`]+)` \|", table, re.M)}
    assert documented == set(SITE_VOCABULARY)
    for path in list_specs():
        assert set(load_arch_spec(path).data["sites"]) <= set(SITE_VOCABULARY), path


def test_cli_help_names_the_arch_spec_flag():
    out = subprocess.run([sys.executable, "-m", "dmi.cli", "capture", "--help"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert "--arch-spec FILE" in out.stdout and "DMI_SPEC_PATH" in textwrap.dedent(out.stdout).replace("\n", " ")
