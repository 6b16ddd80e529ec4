"""Stores on an object store: a real tiny model captured into ``s3://`` on a local S3-compatible
server (moto's, started here), read back with ``dmi.open`` / ``dmi inspect`` and compared with a
local-directory store of the same run; kill -9 mid-run, then ``--resume``; ``file://`` and
``memory://``; schemes and buckets that cannot work, refused before anything is written."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import dmi
from dmi.cli import main
from dmi.store.inspect import writer_alive
from dmi.store.location import open_location
from storecheck import assert_no_torn_chunk, assert_stores_equal, store_keys
from test_reliability import _check_accounting, _cli_env, _prompts, _reference_rows

pytest.importorskip("s3fs")
if importlib.util.find_spec("moto") is None:     # (not imported here: the server runs in its own process)
    pytest.skip("moto is not installed (pip install 'moto[server]')", allow_module_level=True)

BUCKET = "dmi-test"
KEYS = {"key": "dmi-test-key", "secret": "dmi-test-secret"}     # moto accepts any credentials
CAPTURE = """
capture:
  - sites: [resid_post, final_norm]
  - sites: [logits]
    tokens: last
    reduce: {topk: 5}
"""


@pytest.fixture(scope="session")
def s3():
    """A local S3-compatible server (moto's, in a process of its own: flask, which it imports, trips
    vLLM's scan of loaded modules) on a free port, with an empty bucket: its endpoint."""
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=2).close()
            break
        except OSError:
            assert server.poll() is None, "the S3 server exited at start"
            assert time.monotonic() < deadline, "the S3 server did not answer in time"
            time.sleep(0.2)
    try:
        import boto3
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEYS["key"],
                     aws_secret_access_key=KEYS["secret"]).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)


def _options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, **KEYS}


def _spec(endpoint: str, extra: str = "") -> str:
    """The hook spec with store.storage_options for the server (flow style: one line)."""
    return CAPTURE + f"store: {{chunk_bytes: 16KiB, storage_options: {json.dumps(_options(endpoint))}{extra}}}\n"


def _capture(spec, store, encoded, **kw):
    with torch.no_grad(), dmi.load("tiny-qwen3", hook_spec=spec, store=store, **kw) as run:
        run.model.generate(**encoded, max_new_tokens=6, do_sample=False)
    return run


def test_capture_into_s3_is_the_local_store_of_the_same_run(s3, tmp_path, write_spec, encoded, capsys, monkeypatch):
    """dmi.load(store='s3://...') writes the same Zarr layout, and the same values, as a local
    directory; dmi.open and dmi inspect read it by URL; credentials are masked in its attributes."""
    spec = write_spec(_spec(s3))
    url = f"s3://{BUCKET}/run.zarr"
    monkeypatch.chdir(tmp_path)
    run = _capture(spec, url, encoded)
    assert run.store == url and sorted(os.listdir(tmp_path)) == ["hooks.yaml"]    # no local "s3:" directory
    _capture(spec, tmp_path / "local.zarr", encoded)

    remote, local = open_location(url, _options(s3)), open_location(tmp_path / "local.zarr")
    assert store_keys(remote) == store_keys(local)        # the same objects as the directory's files
    tree = dmi.open(url, storage_options=_options(s3))
    assert tree.attrs["dmi_status"] == "closed"
    assert tree.attrs["hook_spec"]["store"]["storage_options"] == {"endpoint_url": s3, "key": "***", "secret": "***"}
    assert KEYS["secret"] not in remote.read("zarr.json").decode()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3)          # the usual environment reaches the server too
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEYS["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", KEYS["secret"])
    assert assert_stores_equal(tmp_path / "local.zarr", url) > 10
    _check_accounting(tree)

    assert main(["inspect", url, "--storage-options", json.dumps({"endpoint_url": s3})]) == 0
    out = capsys.readouterr().out
    assert url in out and "closed" in out and "layers/resid_post" in out

    # an existing store is refused (naming the URL and the fix); overwrite replaces it
    with pytest.raises(dmi.StoreError, match=rf"{url}' already exists\. Fix: .*overwrite"):
        dmi.load("tiny-qwen3", hook_spec=spec, store=url)
    _capture(spec, url, encoded, overwrite=True)
    assert_stores_equal(tmp_path / "local.zarr", url)


def test_file_and_memory_urls(tmp_path, write_spec, encoded):
    """file:// is a local directory; memory:// an fsspec in-memory store (one process)."""
    spec = write_spec(CAPTURE + "store: {chunk_bytes: 16KiB}\n")
    _capture(spec, tmp_path / "local.zarr", encoded)
    _capture(spec, f"file://{tmp_path}/f.zarr", encoded)
    assert (tmp_path / "f.zarr" / "zarr.json").is_file()
    assert_stores_equal(tmp_path / "local.zarr", f"file://{tmp_path}/f.zarr")
    _capture(spec, "memory://dmi-test/m.zarr", encoded)
    assert_stores_equal(tmp_path / "local.zarr", "memory://dmi-test/m.zarr")
    with pytest.raises(dmi.StoreError, match=r"memory://dmi-test/p\.zarr.*store\.writer: process.*Fix: "):
        _capture(write_spec(CAPTURE + "store: {writer: process}\n", "p.yaml"), "memory://dmi-test/p.zarr", encoded)


def _committed(client, key: str) -> dict | None:
    try:
        body = client.get_object(Bucket=BUCKET, Key=f"{key}/zarr.json")["Body"].read()
        return json.loads(body)["attributes"]["dmi_committed"]
    except Exception:   # noqa: BLE001 - not created yet
        return None


def test_kill_9_on_s3_then_resume(s3, tmp_path, tokenizer, capsys):
    """A capture into s3:// killed with SIGKILL leaves whole steps 0..S, no torn chunk object, a
    store dmi.open and dmi inspect read; --resume appends after S: no row missing or twice."""
    import boto3
    client = boto3.client("s3", endpoint_url=s3, region_name="us-east-1", aws_access_key_id=KEYS["key"],
                          aws_secret_access_key=KEYS["secret"])
    spec = tmp_path / "hooks.yaml"
    spec.write_text(_spec(s3))
    url = f"s3://{BUCKET}/crash.zarr"
    texts = [f"Prompt number {i} says hello to the wide world" for i in range(48)]
    batch, new = 3, 60                      # the kill lands mid-run, even on a fast machine
    cmd = [sys.executable, "-m", "dmi.cli", "capture", "--spec", str(spec), "--out", url, "-q",
           "--batch-size", str(batch), "--max-new-tokens", str(new)]
    proc = subprocess.Popen(cmd + ["--prompts", str(_prompts(tmp_path / "p.jsonl", texts))], env=_cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    deadline = time.monotonic() + 240
    while (_committed(client, "crash.zarr") or {}).get("step", -1) < 5:
        assert proc.poll() is None, f"the capture ended before it was killed: {proc.communicate()}"
        assert time.monotonic() < deadline, "no step committed in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    loc = open_location(url, _options(s3))
    attrs = json.loads(loc.read("zarr.json"))["attributes"]
    assert attrs["dmi_status"] == "open" and writer_alive(attrs["dmi_writer"]) is False
    mark = attrs["dmi_committed"]
    last = mark["step"]
    assert assert_no_torn_chunk(loc) > 0
    tree = dmi.open(url, storage_options=_options(s3))
    ds = tree["layers/resid_post"].dataset
    n = ds.sizes["token"]
    assert n == mark["rows"]["layers/resid_post"] > 0
    np.testing.assert_array_equal(np.unique(ds.step.values), np.arange(last + 1))
    ref = _reference_rows(tokenizer, texts[: batch * (last // new + 1)], batch, new)
    np.testing.assert_array_equal(ds.resid_post.values[:, :-1], ref["resid_post"][:n])
    np.testing.assert_array_equal(tree["final_norm"].dataset.final_norm.values, ref["final_norm"][:n])
    assert main(["inspect", url, "--storage-options", json.dumps(_options(s3))]) == 0
    assert f"did not close cleanly (last committed step {last})" in capsys.readouterr().out
    # without --resume the crashed store is refused, saying how to continue it
    assert main(["capture", "--spec", str(spec), "--out", url, "-q"]) == 2
    err = capsys.readouterr().err
    assert "did not close cleanly" in err and "--resume" in err and url in err

    before = ds.resid_post.values.copy()
    more = ["A resumed prompt", "Another one, a little longer"]
    done = subprocess.run(cmd[:-4] + ["--resume", "--batch-size", "2", "--max-new-tokens", "3",
                                      "--prompts", str(_prompts(tmp_path / "more.jsonl", more))],
                          env=_cli_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    tree = dmi.open(url, storage_options=_options(s3))
    ds = tree["layers/resid_post"].dataset
    assert tree.attrs["dmi_status"] == "closed" and tree.attrs["resumed"][0]["at_step"] == last + 1
    np.testing.assert_array_equal(np.unique(ds.step.values), np.arange(last + 1 + 3))
    np.testing.assert_array_equal(ds.resid_post.values[:n], before)
    np.testing.assert_array_equal(ds.resid_post.values[n:, :-1], _reference_rows(tokenizer, more, 2, 3)["resid_post"])
    rows = list(zip(ds.request.values.tolist(), ds.position.values.tolist()))
    assert len(rows) == len(set(rows))          # no row twice
    assert not set(ds.request.values[:n].tolist()) & set(ds.request.values[n:].tolist())
    _check_accounting(tree)
    assert sorted(os.listdir(tmp_path)) == ["hooks.yaml", "more.jsonl", "p.jsonl"]


@pytest.mark.parametrize("url,match", [
    ("http://example.com/run.zarr", r"'http://example\.com/run\.zarr': http:// is read-only to dmi.*Fix: .*s3://"),
    ("foo://bucket/run.zarr", r"'foo://bucket/run\.zarr': foo:// is no storage scheme dmi knows.*Fix: .*s3://"),
    ("s3://no-such-bucket/run.zarr", r"'s3://no-such-bucket/run\.zarr': bucket 'no-such-bucket' does not exist.*Fix: "),
])
def test_a_store_url_that_cannot_work_is_refused_before_anything_is_written(s3, tmp_path, url, match, monkeypatch):
    """The URL and the fix, from dmi.load and dmi capture, before the model loads: no local
    directory named like the scheme, no object."""
    monkeypatch.chdir(tmp_path)
    spec = {"capture": [{"sites": ["final_norm"]}], "store": {"storage_options": _options(s3)}}
    (tmp_path / "hooks.yaml").write_text(json.dumps(spec))
    with pytest.raises(dmi.StoreError, match=match):
        dmi.load("tiny-qwen3", hook_spec=spec, store=url)
    assert main(["capture", "--spec", str(tmp_path / "hooks.yaml"), "--out", url, "-q"]) == 2
    assert sorted(os.listdir(tmp_path)) == ["hooks.yaml"]


def test_the_writer_pool_is_refused_for_an_object_store(tmp_path, write_spec, capsys):
    """store.writer: pool renames temp files in a local directory: an object store's URL is refused at
    load, naming the hook spec's file, line and key and the fix, before anything is written."""
    spec = write_spec(CAPTURE + "store:\n  chunk_bytes: 16KiB\n  writer: pool\n")
    url = "memory://dmi-test/pool.zarr"
    with pytest.raises(dmi.SpecError, match=r"hooks\.yaml:\d+: store\.writer: store\.writer: pool .*'memory://dmi-test/"
                                            r"pool\.zarr' is an object store.*Fix: remove store\.writer"):
        dmi.load("tiny-qwen3", hook_spec=spec, store=url)
    assert main(["capture", "--spec", str(spec), "--out", url, "-q"]) == 2
    assert "store.writer: pool" in capsys.readouterr().err
    assert open_location(url).keys() == []


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_a_missing_storage_package_is_named_with_the_fix(tmp_path):
    with pytest.raises(dmi.StoreError, match=r"'gs://bucket/run\.zarr': gs:// needs gcsfs, which is not installed.*"
                                             r"Fix: pip install gcsfs"):
        dmi.load("tiny-qwen3", hook_spec={"capture": [{"sites": ["final_norm"]}]}, store="gs://bucket/run.zarr")
    with pytest.raises(dmi.StoreError, match=r"gs:// needs gcsfs"):
        dmi.open("gs://bucket/run.zarr")


def test_the_writer_process_writes_to_s3(s3, tmp_path, write_spec, encoded):
    """store.writer: process: the child opens the object store from the hook spec's options."""
    _capture(write_spec(CAPTURE + "store: {chunk_bytes: 16KiB}\n", "local.yaml"), tmp_path / "local.zarr", encoded)
    url = f"s3://{BUCKET}/process.zarr"
    run = _capture(write_spec(_spec(s3, ", writer: process")), url, encoded)
    assert run.store == url
    tree = dmi.open(url, storage_options=_options(s3))
    assert tree.attrs["dmi_status"] == "closed" and tree.attrs["dmi_writer"]["pid"] != os.getpid()
    local = dmi.open(tmp_path / "local.zarr")
    for group, name in [("layers/resid_post", "resid_post"), ("final_norm", "final_norm"), ("logits", "topk_values")]:
        np.testing.assert_array_equal(tree[group].dataset[name].values, local[group].dataset[name].values)


def test_vllm_captures_into_s3(s3, tmp_path, monkeypatch):
    """dmi.load(..., backend="vllm", store='s3://...'): the URL and the hook spec's storage options
    reach the engine's run; every computed (request, position) is stored once."""
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from dmi.adapters.vllm import save_builtin
    from test_vllm import ENGINE, PROMPTS, generate, positions_by_request
    url = f"s3://{BUCKET}/vllm.zarr"
    spec = {"capture": [{"sites": ["resid_post"]}], "policy": {"ring_bytes": "16MiB"},
            "store": {"storage_options": _options(s3)}}
    run = dmi.load(save_builtin("tiny-qwen3"), hook_spec=spec, store=url, backend="vllm", **ENGINE)
    try:
        assert run.store == url
        seqs = generate(run, PROMPTS, vllm.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    finally:
        run.shutdown()
    tree = dmi.open(url, storage_options=_options(s3))
    assert tree.attrs["dmi_status"] == "closed" and tree.attrs["engine"] == "vllm"
    want = {rid: list(range(len(p) + len(o) - 1)) for rid, (p, o) in seqs.items()}
    assert positions_by_request(tree["layers/resid_post"].dataset) == want
    assert np.isfinite(tree["layers/resid_post"].dataset.resid_post.values).all()
