"""Data loss and unreadable stores: --overwrite of a store another run is writing, the store
directory removed mid-run, a kill -9 while the store is created, and a real full disk (ENOSPC on a
tiny tmpfs) under best_effort."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import dmi
from dmi.cli import main

REPO = Path(__file__).resolve().parents[1]
WRITERS = ["thread", "process", "pool"]


def _attrs(store: Path) -> dict:
    return json.loads((store / "zarr.json").read_text())["attributes"]


# --- 1. --overwrite of a live store ------------------------------------------------------------------

def test_overwrite_refuses_a_store_another_run_is_writing(tmp_path, encoded, write_spec, capsys):
    """The live-writer check holds with --overwrite / overwrite=True: refused, naming the pid and
    the fix, before anything is deleted; the writing run closes its store intact."""
    spec = write_spec("capture: [{sites: [resid_post]}]\n")
    store = tmp_path / "o.zarr"
    run = dmi.load("tiny-qwen3", hook_spec=spec, store=store)
    with torch.no_grad():
        run.model.generate(**encoded, max_new_tokens=4, do_sample=False)
    run.flush()
    committed = _attrs(store)["dmi_committed"]["step"]
    assert committed >= 0
    assert main(["capture", "--spec", str(spec), "--out", str(store), "--overwrite", "-q"]) == 2
    err = capsys.readouterr().err
    assert f"process {os.getpid()}" in err and str(store) in err and "Fix:" in err
    with pytest.raises(dmi.StoreError, match=rf"being written by process {os.getpid()}.*Fix: "):
        dmi.load("tiny-qwen3", hook_spec=spec, store=store, overwrite=True)
    assert _attrs(store)["dmi_committed"]["step"] == committed       # nothing deleted
    with torch.no_grad():
        run.model.generate(**encoded, max_new_tokens=4, do_sample=False)
    run.close()
    tree = dmi.open(store)
    assert tree.attrs["dmi_status"] == "closed" and tree.attrs["steps"] == 8
    assert tree["layers/resid_post"].dataset.sizes["token"] == run.layouts.rows_selected[0]
    # once that run has ended, --overwrite replaces the store
    assert main(["capture", "--spec", str(spec), "--out", str(store), "--overwrite", "-q",
                 "--max-new-tokens", "2"]) == 0
    assert _attrs(store)["dmi_status"] == "closed" and _attrs(store)["steps"] == 2


# --- 2. the store directory removed mid-run ---------------------------------------------------------

@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("mode", ["best_effort", "full"])
def test_store_removed_mid_run_fails_the_run_and_is_not_recreated(tmp_path, encoded, write_spec, writer, mode):
    spec = write_spec(f"capture: [{{sites: [resid_post, final_norm]}}]\n"
                      f"store: {{chunk_bytes: 4KiB, writer: {writer}}}\npolicy: {{mode: {mode}}}\n")
    store = tmp_path / "o.zarr"
    run = dmi.load("tiny-qwen3", hook_spec=spec, store=store)
    with torch.no_grad():
        run.model.generate(**encoded, max_new_tokens=4, do_sample=False)
    run.flush()
    shutil.rmtree(store)
    with pytest.raises((dmi.CaptureError, dmi.StoreError)) as info:
        with torch.no_grad():
            for _ in range(3):
                run.model.generate(**encoded, max_new_tokens=6, do_sample=False)
                time.sleep(0.3)     # the exporter thread's tick (0.25 s) sees the failure
        run.close()
    msg = str(info.value)
    assert str(store) in msg and "removed" in msg and "Fix:" in msg, msg
    if mode == "full":
        with pytest.raises((dmi.CaptureError, dmi.StoreError)):
            run.close()
    assert not store.exists(), "a half store was recreated"
    assert run.stats()["store_error"] and "removed" in run.stats()["store_error"]


# --- 3. kill -9 while the store is created ----------------------------------------------------------

CREATE_AND_HANG = """
import sys, time
import dmi.store.exporter as ex
orig = ex.ZarrExporter._create_group
def slow(self, g, compressors):
    orig(self, g, compressors)
    print("GROUP", flush=True)
    time.sleep(120)
ex.ZarrExporter._create_group = slow
import dmi
dmi.load("tiny-qwen3", hook_spec={"capture": [{"sites": ["resid_post", "final_norm"]}]}, store=sys.argv[1],
         overwrite=len(sys.argv) > 2)
"""


@pytest.mark.parametrize("existing", [False, True])
def test_kill_9_while_creating_leaves_no_half_store(tmp_path, encoded, existing):
    """Creation is atomic: a writer killed after the root zarr.json and before the first commit
    leaves either no store (a new path) or the old store untouched (--overwrite); the path can be
    captured into (or overwritten) right away."""
    store = tmp_path / "o.zarr"
    hook = {"capture": [{"sites": ["resid_post"]}]}
    if existing:
        with dmi.load("tiny-qwen3", hook_spec=hook, store=store) as run, torch.no_grad():
            run.model.generate(**encoded, max_new_tokens=2, do_sample=False)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CREATE_AND_HANG, str(store)] + (["overwrite"] if existing else []),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "GROUP", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    if existing:
        assert _attrs(store)["dmi_status"] == "closed" and _attrs(store)["steps"] == 2
        assert not any("final_norm" in s for s in dmi.open(store).attrs["sites"])     # the old store's
    else:
        assert not store.exists()
    with dmi.load("tiny-qwen3", hook_spec=hook, store=store, overwrite=existing) as run, torch.no_grad():
        run.model.generate(**encoded, max_new_tokens=3, do_sample=False)
    assert dmi.open(store).attrs["steps"] == 3
    # the killed writer's staging directory is gone once a later run created the store
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_overwrite_and_resume_after_atomic_creation(tmp_path, encoded):
    store = tmp_path / "o.zarr"
    hook = {"capture": [{"sites": ["resid_post"]}]}
    with dmi.load("tiny-qwen3", hook_spec=hook, store=store) as run, torch.no_grad():
        run.model.generate(**encoded, max_new_tokens=2, do_sample=False)
    with dmi.load("tiny-qwen3", hook_spec=hook, store=store, overwrite=True) as run, torch.no_grad():
        run.model.generate(**encoded, max_new_tokens=3, do_sample=False)
    with dmi.load("tiny-qwen3", hook_spec=hook, store=store, resume=True) as run, torch.no_grad():
        run.model.generate(**encoded, max_new_tokens=2, do_sample=False)
    tree = dmi.open(store)
    assert tree.attrs["dmi_status"] == "closed" and len(tree.attrs["resumed"]) == 1
    assert sorted(set(tree["layers/resid_post"].dataset.step.values.tolist())) == list(range(5))
    assert [p.name for p in tmp_path.iterdir()] == ["o.zarr"]


# --- 4. a full disk under best_effort --------------------------------------------------------------

def _userns_tmpfs_ok(tmp_path: Path) -> bool:
    if not shutil.which("unshare"):
        return False
    d = tmp_path / "probe"
    d.mkdir()
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                        f"mount -t tmpfs -o size=64k tmpfs {d}"], capture_output=True)
    return r.returncode == 0


@pytest.mark.parametrize("writer", ["thread", "pool"])   # (the process writer's child runs the same exporter)
def test_disk_full_under_best_effort_records_its_drops(tmp_path, writer, capsys):
    """A real ENOSPC (a 2 MiB tmpfs in a user and mount namespace): the run warns and exits 0, and
    the store still says what happened: store_error recorded, every sink drop in the drops table,
    the accounting identity holds, dmi inspect reads it."""
    if not _userns_tmpfs_ok(tmp_path):
        pytest.skip("no unprivileged user+mount namespace to mount a tiny tmpfs in")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    spec = tmp_path / "hooks.yaml"
    spec.write_text(f"capture: [{{sites: [resid_pre, resid_post, mlp.out, attn.out]}}]\n"
                    f"store: {{chunk_bytes: 64KiB, compression: none, writer: {writer}}}\n"
                    f"policy: {{mode: best_effort}}\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Prompt {i} is about the sea"}) + "\n"
                               for i in range(8)))
    copy = tmp_path / "copy.zarr"
    py = sys.executable
    script = textwrap.dedent(f"""
        set -u
        mount -t tmpfs -o size=2m tmpfs {mnt} || exit 90
        {py} -m dmi.cli capture --model tiny-qwen3 --spec {spec} --prompts {prompts} --out {mnt}/o.zarr \\
            --max-new-tokens 40 --batch-size 8 -q
        echo "rc=$?"
        cp -r {mnt}/o.zarr {copy}
    """)
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                       capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       timeout=300)
    out, err = r.stdout, r.stderr
    assert "rc=0" in out, out + err
    assert "No space left on device" in err and "reason sink" in err, err
    a = _attrs(copy)
    assert a["dmi_status"] in ("closed", "failed") and "No space left on device" in a["store_error"]
    assert main(["inspect", str(copy)]) == 0
    text = capsys.readouterr().out
    assert "No space left on device" in text and "sink" in text, text
    tree = dmi.open(copy)
    drops = tree["drops"].dataset
    assert drops.sizes["drop"] > 0 and set(drops.reason.values.tolist()) == {"sink"}
    assert a["dropped_captures"] == drops.sizes["drop"]
    for site in a["sites"]:
        assert a["rows_stored"][site] + a["rows_dropped"][site] + a["rows_not_computed"][site] \
            == a["rows_selected"][site], site
    assert sum(a["rows_dropped"].values()) == int(drops.rows.sum())
