"""A property of every store: random interleavings of `dmi capture` (the CLI, the built-in tiny
model), kill -9 at random moments, `--resume`, `--overwrite` attempts while another run writes,
and readers leave stores that open with `dmi.open` and with plain xarray and hold only whole,
correct steps: each request's rows are a whole-step prefix of what an uninterrupted run stores
for the same prompt, bit for bit.

Batches of one prompt (no padding): a request's rows depend on its prompt alone, so every run,
resumed or not, can be checked against one reference run. A seeded random generator picks the
operations and the moments. Runs that are killed are CLI processes; runs that end run the CLI in
this process (a process's start-up, the model's load, is most of a short run's time)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import dmi
from dmi.cli import main
from storecheck import assert_no_torn_chunk
from test_reliability import _cli_env, _committed, _prompts

TEXTS = [f"Prompt {k} " + "goes on and on " * (k % 4) + "to the end" for k in range(8)]
NEW = 12                       # tokens generated per prompt
PER_RUN = 3                    # prompts per run
HOOKS = "capture: [{sites: [resid_post]}]\nstore: {chunk_bytes: 4KiB}\n"    # many chunks, partial ones too


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """text index -> resid_post rows of an uninterrupted run (positions 0, 1, ...), and the spec."""
    tmp = tmp_path_factory.mktemp("reference")
    spec = tmp / "hooks.yaml"
    spec.write_text(HOOKS)
    prompts = _prompts(tmp / "all.jsonl", TEXTS, [f"t{k}" for k in range(len(TEXTS))])
    assert main(["capture", "--spec", str(spec), "--out", str(tmp / "ref.zarr"), "--prompts", str(prompts),
                 "--batch-size", "1", "--max-new-tokens", str(NEW), "-q"]) == 0
    ds = dmi.open(tmp / "ref.zarr")["layers/resid_post"].dataset
    rows = {}
    for k in range(len(TEXTS)):
        mine = ds.request.values == f"t{k}"
        assert (ds.position.values[mine] == np.arange(mine.sum())).all()
        rows[k] = ds.resid_post.values[mine]
    return rows, spec


class World:
    """The stores of one seed's interleaving and the operations on them."""

    def __init__(self, tmp: Path, spec: Path, rng: np.random.Generator, reference: dict):
        self.tmp, self.spec, self.rng, self.ref = tmp, spec, rng, reference
        self.stores: list[Path] = []
        self.runs = 0

    def _args(self, store: Path, *flags: str) -> list[str]:
        """A capture of PER_RUN random prompts under ids new to every store (t<text>.<run>)."""
        self.runs += 1
        ks = self.rng.choice(len(TEXTS), PER_RUN, replace=False).tolist()
        prompts = _prompts(self.tmp / f"p{self.runs}.jsonl", [TEXTS[k] for k in ks], [f"t{k}.{self.runs}" for k in ks])
        return ["capture", "--spec", str(self.spec), "--out", str(store), "--prompts", str(prompts),
                "--batch-size", "1", "--max-new-tokens", str(NEW), "-q", *flags]

    def start(self, store: Path, *flags: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "dmi.cli", *self._args(store, *flags)], env=_cli_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, store: Path, *flags: str) -> str:
        """A run to its end (in this process: no model load to wait for), or one killed with -9 at a
        random moment after it began writing the store (a CLI process)."""
        if self.rng.random() < 0.35:
            assert main(self._args(store, *flags)) == 0
            return "finished"
        return self.finish_or_kill(self.start(store, *flags), store, kill=True)

    def finish_or_kill(self, proc: subprocess.Popen, store: Path, kill: bool) -> str:
        """Let a CLI process end, or kill -9 it at a random moment after it began writing the store."""
        if not kill:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
            return "finished"
        deadline = time.monotonic() + 300
        while proc.poll() is None and not _touching(store, proc.pid) and time.monotonic() < deadline:
            time.sleep(0.005)             # (the model loads first: a kill then would test nothing)
        time.sleep(float(self.rng.uniform(0.0, 1.5)))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        if proc.returncode != -signal.SIGKILL:
            assert proc.returncode == 0, proc.stderr
            return "finished"
        return "killed"

    # --- operations ---------------------------------------------------------------------------
    def fresh(self) -> str:
        store = self.tmp / f"s{len(self.stores)}.zarr"
        self.stores.append(store)
        return "fresh " + self.run(store)

    def resume(self) -> str:
        have = [s for s in self.stores if (s / "zarr.json").exists()]
        if not have:
            return self.fresh()
        store = have[int(self.rng.integers(len(have)))]
        return "resume " + self.run(store, "--resume")

    def overwrite_race(self) -> str:
        """A second run with --overwrite while the first writes: refused, the first's data intact
        (or, should the first have closed its store just before, a clean overwrite)."""
        store = self.tmp / f"s{len(self.stores)}.zarr"
        self.stores.append(store)
        proc = self.start(store)
        deadline = time.monotonic() + 300
        while proc.poll() is None and _committed(store) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(3):                # readers while it writes
            check_store(store, self.ref, plain=False)
        rc = main(self._args(store, "--overwrite"))
        if rc == 0:                       # the first had closed the store just before: it ends cleanly
            assert proc.wait(300) == 0, proc.stderr.read()
            return "race: overwrote a closed store"
        assert rc == 2                    # refused: the store is being written
        check_store(store, self.ref, plain=False)
        return "race: refused, then " + self.finish_or_kill(proc, store, kill=self.rng.random() < 0.65)


def _touching(store: Path, pid: int) -> bool:
    """Process ``pid`` has begun writing ``store``: creating it (its staging directory) or holding it."""
    if any(store.parent.glob(f".{store.name}.{pid}.*")):
        return True
    try:
        return json.loads((store / "zarr.json").read_text())["attributes"]["dmi_writer"]["pid"] == pid
    except (OSError, ValueError, KeyError):
        return False


def check_store(store: Path, ref: dict, plain: bool = True) -> None:
    """The store opens with dmi.open (and plain xarray) and holds whole, correct steps only."""
    if not store.exists():               # killed before its creation was done: nothing is left
        return
    tree = dmi.open(store)
    ds = tree["layers/resid_post"].dataset
    steps = np.unique(ds.step.values)
    assert (np.diff(ds.step.values) >= 0).all() and (steps == np.arange(len(steps)) + (steps[0] if len(steps) else 0)).all()
    closed = tree.attrs["dmi_status"] == "closed"
    requests = ds.request.values
    for rid in dict.fromkeys(requests.tolist()):
        k = int(str(rid).split(".")[0][1:])
        mine = requests == rid
        n = int(mine.sum())
        want = ref[k]
        n_prompt = len(want) - (NEW - 1)
        assert n >= n_prompt and n <= len(want), (store, rid, n)           # whole steps: the prompt's, then one each
        assert not closed or n == len(want), (store, rid, n)               # a closed store holds whole requests
        assert (ds.position.values[mine] == np.arange(n)).all(), (store, rid)
        np.testing.assert_array_equal(ds.resid_post.values[mine], want[:n], err_msg=f"{store} {rid}")
    if plain:
        assert assert_no_torn_chunk(store) >= 0
        with warnings.catch_warnings():  # (an open store has no consolidated metadata: xarray says so)
            warnings.simplefilter("ignore", RuntimeWarning)
            raw = xr.open_datatree(str(store), engine="zarr", consolidated=closed)["layers/resid_post"].dataset
        n = ds.sizes["token"]
        assert raw.sizes["token"] >= n
        np.testing.assert_array_equal(raw.resid_post.values[:n], ds.resid_post.values)
        np.testing.assert_array_equal(raw.request.values[:n], requests)


@pytest.mark.parametrize("seed", range(3))
def test_random_interleavings_leave_only_whole_correct_steps(tmp_path, reference, seed):
    rows, spec = reference
    _interleave(tmp_path, spec, rows, seed)


def test_random_interleavings_with_the_writer_pool(tmp_path, reference):
    """The same property with store.writer: pool: a killed run's chunk writers end with it, and
    what they leave resumes like the thread writer's store."""
    rows, _ = reference
    spec = tmp_path / "hooks.yaml"
    spec.write_text(HOOKS.replace("{chunk_bytes: 4KiB}", "{chunk_bytes: 4KiB, writer: pool, writers: 2}"))
    _interleave(tmp_path, spec, rows, 0)


def _interleave(tmp_path, spec, rows, seed: int) -> None:
    rng = np.random.default_rng(seed)
    world = World(tmp_path, spec, rng, rows)
    done = []
    for op in ["fresh", *rng.choice(["resume", "overwrite_race", "fresh"], 2, p=[0.5, 0.3, 0.2]).tolist()]:
        done.append(getattr(world, op)())
        for store in world.stores:
            check_store(store, rows)
    print(seed, done)
    assert world.stores
    closed = [json.loads((s / "zarr.json").read_text())["attributes"]["dmi_status"] for s in world.stores
              if (s / "zarr.json").exists()]
    assert all(c in ("open", "closed") for c in closed), closed
