"""Every setting in one place: the hook spec's policy, store and engine sections (validated by
schemas/hook_spec.schema.json), the few environment variables dmi/settings.py declares, and the
table of docs/settings.md that lists them all."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch

import dmi
from dmi import settings
from dmi.errors import SpecError, StoreError
from dmi.ring.cpu import CpuRing
from dmi.settings import EngineOptions
from conftest import model_pair

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "schemas" / "hook_spec.schema.json").read_text())


def _documented() -> dict[str, str]:
    """docs/settings.md's table: setting -> where."""
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", (ROOT / "docs" / "settings.md").read_text(), re.M)
    return {name: where.strip() for name, where in rows}


def test_the_table_lists_every_hook_spec_key_and_every_environment_variable():
    sections = {"policy": SCHEMA["$defs"]["policy"], "store": SCHEMA["properties"]["store"],
                "engine": SCHEMA["properties"]["engine"]}
    keys = {f"{s}.{k}" for s, schema in sections.items() for k in schema["properties"]}
    table = _documented()
    assert {k for k, where in table.items() if where == "hook spec"} == keys
    assert {k for k, where in table.items() if where.startswith("environment")} == set(settings.SETTINGS)
    # and the schema describes each engine key, with its choices where it has some
    for key, schema in sections["engine"]["properties"].items():
        assert schema.get("description"), key


def test_engine_options_reach_the_run(encoded, write_spec, tmp_path):
    """The engine section is one frozen EngineOptions on the plan, which the ring, the step hooks and
    the HF adapter read; left out, the defaults."""
    spec = write_spec("""
        capture:
          - sites: [resid_post]
        engine:
          ring: cpu
          side: "off"
          traced: "off"
          constant_sites: false
          step_ahead: false
          copy_at_step: true
          pdl: false
    """)
    model, ref = model_pair("qwen3")
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "a.zarr") as run:
        assert run.plan.engine == EngineOptions(ring="cpu", traced="0", side="0", constant_sites=False,
                                                step_ahead=False, copy_at_step=True, pdl=False)
        assert isinstance(run.ring, CpuRing) and run.step_ahead is False
        got = run.model.generate(**encoded, max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        assert torch.equal(got, ref.generate(**encoded, max_new_tokens=3, do_sample=False))
    assert dmi.open(tmp_path / "a.zarr").attrs["hook_spec"]["engine"]["step_ahead"] is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.plan.engine.ring = "cuda"
    plain = write_spec("capture: [{sites: [resid_post]}]\n", "plain.yaml")
    model, _ = model_pair("qwen3")
    with torch.no_grad(), dmi.load(model, hook_spec=plain, store=tmp_path / "b.zarr") as run:
        assert run.plan.engine == EngineOptions() and run.step_ahead is True


@pytest.mark.parametrize("key,value,says", [
    ("ring", "gpu", "['cpu', 'cuda', 'interpret']"),
    ("traced", "1", "['off', 'all', 'range']"),
    ("side", "0", "['full', 'all', 'off']"),
    ("pdl", "no", "boolean"),
    ("writer_plugins", "mod:fn", "array"),
])
def test_a_wrong_engine_value_is_refused_at_load_naming_the_key_and_the_fix(key, value, says, write_spec, tmp_path):
    spec = write_spec(f"""
        capture:
          - sites: [resid_post]
        engine:
          {key}: "{value}"
    """)
    model, _ = model_pair("qwen3")
    with pytest.raises(SpecError) as info:
        dmi.load(model, hook_spec=spec, store=tmp_path / "s.zarr")
    msg = str(info.value)
    assert msg.startswith(f"{spec}:5: engine.{key}: ") and "Fix: " in msg and says in msg, msg
    assert not (tmp_path / "s.zarr").exists()


def test_an_old_engine_variable_in_the_environment_warns_once_naming_its_place(write_spec, tmp_path, monkeypatch):
    """DMI_RING and the other engine variables are no longer read: set, each gets one warning per
    process naming the hook-spec key (or that its switch is gone), and the run takes the spec's."""
    monkeypatch.setattr(settings, "_warned", set())
    monkeypatch.setenv("DMI_RING", "interpret")
    monkeypatch.setenv("DMI_PYDLL", "0")
    spec = write_spec("capture: [{sites: [resid_post]}]\n")
    for i in range(2):
        model, _ = model_pair("qwen3")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with dmi.load(model, hook_spec=spec, store=tmp_path / f"{i}.zarr") as run:
                assert isinstance(run.ring, CpuRing)          # the environment's interpret is not taken
        ours = [str(w.message) for w in seen if issubclass(w.category, FutureWarning) and "DMI_" in str(w.message)]
        if i == 0:
            assert len(ours) == 2, ours
            ring = next(m for m in ours if "DMI_RING" in m)
            assert "engine.ring" in ring and "Fix: unset it" in ring, ring
            assert "no longer read" in next(m for m in ours if "DMI_PYDLL" in m)
        else:
            assert ours == []


def test_writer_plugins_run_in_the_writer_process_before_the_store_opens(write_spec, tmp_path, monkeypatch):
    """engine.writer_plugins: each module:function is called in the store writer's own process (its
    process id is not this one's) before the store opens; one that does not import is refused
    naming the key, and no store is left."""
    plugin = tmp_path / "plugins" / "dmi_test_writer_plugin.py"
    plugin.parent.mkdir()
    plugin.write_text("import os, pathlib\n"
                      "def register():\n"
                      f"    pathlib.Path({str(tmp_path / 'called')!r}).write_text(str(os.getpid()))\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(plugin.parent), os.environ.get("PYTHONPATH", "")]))
    body = "capture: [{sites: [resid_post]}]\nstore: {writer: process}\n"
    good = write_spec(body + "engine: {writer_plugins: [dmi_test_writer_plugin]}\n", "good.yaml")
    model, _ = model_pair("qwen3")
    with dmi.load(model, hook_spec=good, store=tmp_path / "g.zarr"):
        pid = int((tmp_path / "called").read_text())
    assert pid != os.getpid()
    bad = write_spec(body + "engine: {writer_plugins: ['dmi_no_such_module:register']}\n", "bad.yaml")
    model, _ = model_pair("qwen3")
    with pytest.raises(StoreError, match=r"engine\.writer_plugins: 'dmi_no_such_module:register'.*Fix: "):
        dmi.load(model, hook_spec=bad, store=tmp_path / "b.zarr")
    assert not (tmp_path / "b.zarr").exists()


def test_a_resumed_store_may_change_its_engine_section_not_its_capture(encoded, write_spec, tmp_path):
    """The engine section says how, not what, is captured: a run resuming a store may change it; a
    different capture is still refused, naming the key."""
    first = write_spec("capture: [{sites: [resid_post]}]\nengine: {step_ahead: false}\n", "first.yaml")
    with torch.no_grad(), dmi.load("tiny-qwen3", hook_spec=first, store=tmp_path / "o.zarr") as run:
        run.model.generate(**encoded, max_new_tokens=2, do_sample=False)
    again = write_spec("capture: [{sites: [resid_post]}]\nengine: {ring: cpu, side: 'off'}\n", "again.yaml")
    with torch.no_grad(), dmi.load("tiny-qwen3", hook_spec=again, store=tmp_path / "o.zarr", resume=True) as run:
        run.model.generate(**encoded, max_new_tokens=2, do_sample=False)
    assert dmi.open(tmp_path / "o.zarr").attrs["steps"] == 4
    other = write_spec("capture: [{sites: [final_norm]}]\nengine: {step_ahead: false}\n", "other.yaml")
    with pytest.raises(StoreError, match=r"hook_spec\.capture.*Fix: "):
        dmi.load("tiny-qwen3", hook_spec=other, store=tmp_path / "o.zarr", resume=True)
