"""The store under stress: chunk files as zarr-python writes them, kill -9 mid-run, --resume,
and sink failures (store full, an OSError mid-run, a read-only directory, a write-rate cap)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
import zarr
from zarr.codecs import BloscCodec

import dmi
from dmi.cli import main
from dmi.store.chunks import LZ4, ArrayFile
from dmi.store.exporter import ZarrExporter
from dmi.zdtype import BF16
from dmi.store.inspect import writer_alive
from dmi.models import build_tiny_model
from storecheck import assert_no_torn_chunk, expected_rows

REPO = Path(__file__).resolve().parents[1]
HOOKS = """
capture:
  - sites: [resid_post, final_norm]
  - sites: [logits]
    tokens: last
    reduce: {topk: 5}
store: {chunk_bytes: 16KiB}
"""


# --- chunk files ----------------------------------------------------------------------------------

CODECS = {"none": None, "zstd": "auto", "blosc-lz4": BloscCodec(cname="lz4", clevel=1, shuffle="shuffle"),
          "blosc-lz4-bitshuffle": BloscCodec(**LZ4),         # store.compression: lz4
          "blosc-zstd": BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle")}


@pytest.mark.parametrize("codec,dtype", [(c, d) for c in CODECS for d in ("float32", "int32", "int64", "str")
                                         if d != "str" or c in ("none", "zstd")])
@pytest.mark.parametrize("keys", [{"name": "default", "separator": "/"}, {"name": "default", "separator": "."},
                                  {"name": "v2", "separator": "."}], ids=["default/", "default.", "v2"])
def test_chunk_files_are_what_zarr_python_writes(tmp_path, codec, dtype, keys):
    """dmi's chunk files (any codec dmi uses, any chunk key encoding) are byte for byte the files
    zarr-python writes for the same data, a padded partial chunk included; zarr reads them back."""
    compressors = CODECS[codec]
    rng = np.random.default_rng(0)
    shape, chunks = (13, 3, 4), (8, 3, 4)
    data = (np.array([f"r{i}" for i in range(13)], dtype=object) if dtype == "str"
            else rng.standard_normal(shape).astype(dtype) if dtype == "float32"
            else rng.integers(-99, 99, shape).astype(dtype))
    if dtype == "str":
        shape, chunks = (13,), (8,)
    root = zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=3)
    kw = dict(shape=shape, chunks=chunks, dtype=str if dtype == "str" else dtype, chunk_key_encoding=keys,
              **({} if compressors == "auto" else {"compressors": compressors}))
    ref = root.create_array("ref", **kw)
    ref[:] = data                                  # zarr-python writes chunk 0 whole, chunk 1 padded
    root.create_array("ours", **kw | {"shape": (0, *shape[1:])})
    f = ArrayFile(tmp_path / "s.zarr", "ours")
    g = ArrayFile(tmp_path / "s.zarr", "ref")
    for i in range(2):
        block = np.empty(chunks, f.dtype)
        block[: min(8, 13 - 8 * i)] = data[8 * i: 8 * i + 8]
        block[min(8, 13 - 8 * i):] = f.fill
        f.put(i, f.encode(block))
        assert g.path(i).is_file(), "the chunk key differs from zarr-python's"
        assert f.path(i).read_bytes() == g.path(i).read_bytes(), f"chunk {i} differs from zarr-python's"
    f.set_rows(13)
    back = zarr.open_array(str(tmp_path / "s.zarr" / "ours"), mode="r")[:]
    np.testing.assert_array_equal(np.asarray(back).astype(object) if dtype == "str" else back, data)


def _synthetic_steps(exporter_cls, store: Path, compression: str, steps: int = 5, tokens: int = 24):
    """Feed an exporter (thread or process writer) synthetic drained steps of a small Qwen3-shaped
    plan (resid_post of 3 layers + final_norm, bf16 captured, stored as bf16), as
    perf/exporter_bench.py does; returns each site's captured rows as uint16 bits, [rows, hidden]."""
    import transformers as tf
    from dmi.plan import build_plan
    from dmi.ring.records import META_DTYPE
    from dmi.ring.layout import SiteSlot, StepControl
    from dmi.spec import builtin_spec_dir, load_arch_spec, load_hook_spec
    from dmi.tokens import StepTokens

    cfg = tf.Qwen3Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, vocab_size=128)
    hook = load_hook_spec({"capture": [{"sites": ["resid_post", "final_norm"]}],
                           "store": {"compression": compression, "chunk_bytes": "16KiB"}})
    plan = build_plan(load_arch_spec(builtin_spec_dir() / "qwen3.yaml"), hook, cfg, model_dtype_itemsize=2)
    exp = exporter_cls(store, plan, "bfloat16", {}, overwrite=True)
    rng = np.random.default_rng(0)
    scale = np.exp(rng.standard_normal(64, dtype=np.float32))
    st = StepTokens(0, 1, tokens, np.arange(tokens), np.zeros(tokens, np.int64), np.arange(tokens),
                    np.zeros(tokens, np.int8), np.arange(tokens))
    sel = np.arange(tokens)
    fed = {s.name: [] for s in plan.sites}
    for step in range(steps):
        slots = {s.index: SiteSlot(s.index, 0, 0, sel, sel, 1) for s in plan.sites}
        ctrl = StepControl(step, st, np.zeros(1, np.int64), slots, 0, 0, 0)
        records = []
        for s in plan.sites:
            x = rng.standard_normal((tokens, 64), dtype=np.float32) * scale
            bits = x.astype(BF16).view(np.uint16)
            fed[s.name].append(bits)
            rec = np.zeros((), META_DTYPE)
            rec["rows"], rec["src_seq"], rec["nbytes"] = tokens, tokens, bits.nbytes
            records.append((slots[s.index], rec, bits.view(np.uint8).reshape(-1).copy()))
        exp.write_step(ctrl, records, ["r0"])
    exp.close({})
    return {k: np.concatenate(v) for k, v in fed.items()}


@pytest.mark.parametrize("writer", ["thread", "process", "pool"])
@pytest.mark.parametrize("compression", ["lz4", "none"])
def test_a_written_store_opens_with_xarray_and_dmi_and_holds_the_captured_bits(tmp_path, writer, compression):
    """The write path's store (lz4: bitshuffled blosc-lz4) is a plain Zarr v3 store: xarray and
    dmi.open read back exactly the captured bf16 bits, rows in step order, every chunk whole."""
    from dmi.store.pool import PoolExporter
    from dmi.store.writer import ProcessExporter
    store = tmp_path / "s.zarr"
    fed = _synthetic_steps({"thread": ZarrExporter, "process": ProcessExporter, "pool": PoolExporter}[writer], store,
                           compression)
    meta = json.loads((store / "layers/resid_post/resid_post/zarr.json").read_text())
    blosc = [c["configuration"] for c in meta["codecs"] if c["name"] == "blosc"]
    if compression == "lz4":
        assert blosc == [{"typesize": 2, "cname": "lz4", "clevel": 1, "shuffle": "bitshuffle", "blocksize": 0}]
    else:
        assert blosc == [] and [c["name"] for c in meta["codecs"]] == ["bytes"]
    assert meta["data_type"] == "bfloat16" and assert_no_torn_chunk(store) > 0
    want_resid = np.stack([fed[f"layers.{i}.resid_post"] for i in range(3)], axis=1)
    plain = xr.open_datatree(str(store), engine="zarr")          # dmi.zdtype is imported: bf16 reads
    ds = plain["layers/resid_post"].dataset
    np.testing.assert_array_equal(ds.resid_post.values.view(np.uint16), want_resid)
    np.testing.assert_array_equal(ds.step.values, np.repeat(np.arange(5), 24))
    tree = dmi.open(store, dtype=None)                          # as stored: the bf16 bits
    assert tree.attrs["dmi_status"] == "closed"
    np.testing.assert_array_equal(tree["layers/resid_post"].dataset.resid_post.values.view(np.uint16), want_resid)
    np.testing.assert_array_equal(tree["final_norm"].dataset.final_norm.values.view(np.uint16), fed["final_norm"])


# --- kill -9, recovery, --resume ------------------------------------------------------------------

def _cli_env():
    """The CLI's environment: this process's threads (tests/conftest.py: a pytest-xdist worker's
    share), and ``tests/cli_site`` (its ``sitecustomize`` settles oneMKL's vector-math kernels at
    start-up), so the CLI's first forward computes what the in-process reference does."""
    return dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "cli_site"), str(REPO),
                                            os.environ.get("PYTHONPATH", "")]))


def _prompts(path: Path, texts: list[str], ids: list[str] | None = None) -> Path:
    path.write_text("".join(json.dumps({"prompt": t} | ({"id": ids[i]} if ids else {})) + "\n"
                            for i, t in enumerate(texts)))
    return path


def _committed(store: Path) -> dict | None:
    try:
        return json.loads((store / "zarr.json").read_text())["attributes"]["dmi_committed"]
    except (OSError, ValueError, KeyError):
        return None


def _reference_rows(tokenizer, texts: list[str], batch: int, new_tokens: int) -> dict[str, np.ndarray]:
    """What `dmi capture` stores for resid_post (but the last layer's: HF's last hidden state is
    final-normed) and final_norm, from the unpatched model with the same weights."""
    model = build_tiny_model("tiny-qwen3", seed=0)
    out = {"resid_post": [], "final_norm": []}
    n_layers = model.config.num_hidden_layers
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i:i + batch], return_tensors="pt", padding=True)
        with torch.no_grad():
            want = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, output_hidden_states=True,
                                  return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
        hs, mask = want.hidden_states, enc["attention_mask"].bool()
        out["resid_post"].append(np.stack([expected_rows(hs, mask, lambda st, b, s, li=li: st[li + 1][b, s].numpy())
                                           for li in range(n_layers - 1)], axis=1))
        out["final_norm"].append(expected_rows(hs, mask, lambda st, b, s: st[-1][b, s].numpy()))
    return {k: np.concatenate(v) for k, v in out.items()}


# store.writer: the exporter in the model's process, or in its own; "drain": that process drains the
# ring too (policy.drain: process)
WRITERS = ["thread", "process", "drain", "pool"]


def _writer(writer: str) -> str:
    """The store.writer value of a WRITERS entry."""
    return "process" if writer == "drain" else writer


def _policy(policy: str, writer: str) -> str:
    """A policy flow mapping (``{mode: full}``) with the drain a WRITERS entry asks for."""
    return policy[:-1] + ", drain: process}" if writer == "drain" else policy


@pytest.mark.parametrize("writer", WRITERS)
def test_kill_9_leaves_committed_steps_then_resume_appends(tmp_path, tokenizer, capsys, writer):
    texts = [f"Prompt number {i} says hello to the wide world" for i in range(48)]
    spec = tmp_path / "hooks.yaml"
    spec.write_text(HOOKS.replace("{chunk_bytes: 16KiB}", f"{{chunk_bytes: 16KiB, writer: {_writer(writer)}}}")
                    + ("policy: {drain: process}\n" if writer == "drain" else ""))
    store = tmp_path / "s.zarr"
    batch, new = 3, 60                      # 16 batches x 60 steps: the kill lands mid-run, even on a fast machine
    cmd = [sys.executable, "-m", "dmi.cli", "capture", "--spec", str(spec), "--out", str(store), "-q",
           "--batch-size", str(batch), "--max-new-tokens", str(new)]
    proc = subprocess.Popen(cmd + ["--prompts", str(_prompts(tmp_path / "p.jsonl", texts))], env=_cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while (_committed(store) or {}).get("step", -1) < 5:
        assert proc.poll() is None, f"the capture ended before it was killed: {proc.communicate()}"
        assert time.monotonic() < deadline, "no step committed in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    if writer != "thread":       # the writer process sees its parent gone, commits what it holds and exits
        deadline = time.monotonic() + 30
        while _writer_alive(store) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _writer_alive(store), "the store writer process outlived the killed capture"

    mark = _committed(store)
    last = mark["step"]
    assert assert_no_torn_chunk(store) > 0
    with warnings.catch_warnings():      # plain xarray opens it too (no consolidated metadata: it says so)
        warnings.simplefilter("ignore", RuntimeWarning)
        plain = xr.open_datatree(str(store), engine="zarr")
    assert np.unique(plain["layers/resid_post"].dataset.step.values).tolist()[: last + 1] == list(range(last + 1))
    tree = dmi.open(store)
    assert tree.attrs["dmi_status"] == "open"
    ds = tree["layers/resid_post"].dataset
    np.testing.assert_array_equal(np.unique(ds.step.values), np.arange(last + 1))
    assert (np.diff(ds.step.values) >= 0).all()
    assert np.unique(tree["final_norm"].dataset.step.values).tolist() == list(range(last + 1))
    ref = _reference_rows(tokenizer, texts[: batch * (last // new + 1)], batch, new)
    n = ds.sizes["token"]
    assert n == mark["rows"]["layers/resid_post"] > 0
    np.testing.assert_array_equal(ds.resid_post.values[:, :-1], ref["resid_post"][:n])
    np.testing.assert_array_equal(tree["final_norm"].dataset.final_norm.values, ref["final_norm"][:n])
    assert main(["inspect", str(store)]) == 0
    assert f"did not close cleanly (last committed step {last})" in capsys.readouterr().out

    # without --resume the crashed store is refused, saying how to continue it
    assert main(["capture", "--spec", str(spec), "--out", str(store), "-q"]) == 2
    err = capsys.readouterr().err
    assert "did not close cleanly" in err and "--resume" in err and str(store) in err
    # --resume refuses another hook spec (naming the file, the key and the fix) or another model
    other = tmp_path / "other.yaml"
    other.write_text(HOOKS.replace("[resid_post, final_norm]", "[resid_post]"))
    assert main(["capture", "--resume", "--spec", str(other), "--out", str(store), "-q"]) == 2
    err = capsys.readouterr().err
    assert str(other) in err and "hook_spec.capture[0].sites" in err and "Fix:" in err
    assert main(["capture", "--resume", "--spec", str(spec), "--model", "tiny-llama3_1", "--out", str(store)]) == 2
    assert "model.name_or_path" in capsys.readouterr().err

    # --resume appends after the committed steps; whole committed chunks are never rewritten
    c = ArrayFile(store, "layers/resid_post/resid_post").chunks[0]
    whole = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for i in range(n // c)
             for p in [ArrayFile(store, "layers/resid_post/resid_post").path(i)]}
    before = ds.resid_post.values.copy()
    more = ["A resumed prompt", "Another one, a little longer"]
    proc = subprocess.run(cmd[:-4] + ["--resume", "--batch-size", "2", "--max-new-tokens", "3",
                                      "--prompts", str(_prompts(tmp_path / "more.jsonl", more))],
                          env=_cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert all((p.stat().st_ino, p.stat().st_mtime_ns) == v for p, v in whole.items())
    tree = dmi.open(store)
    ds = tree["layers/resid_post"].dataset
    assert tree.attrs["dmi_status"] == "closed" and tree.attrs["resumed"][0]["at_step"] == last + 1
    np.testing.assert_array_equal(np.unique(ds.step.values), np.arange(last + 1 + 3))
    np.testing.assert_array_equal(ds.resid_post.values[:n], before)
    np.testing.assert_array_equal(ds.resid_post.values[n:, :-1], _reference_rows(tokenizer, more, 2, 3)["resid_post"])
    old_ids = set(ds.request.values[:n].tolist())
    new_ids = list(dict.fromkeys(ds.request.values[n:].tolist()))
    assert len(new_ids) == 2 and not old_ids & set(new_ids)      # requests get new ids
    _check_accounting(tree)


def test_resume_a_closed_store_from_python(tmp_path, encoded, write_spec):
    spec = write_spec("capture: [{sites: [resid_post]}]\nstore: {chunk_bytes: 4KiB}\n")
    with torch.no_grad(), dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr") as run:
        run.model.generate(**encoded, max_new_tokens=4, do_sample=False)
    first = dmi.open(tmp_path / "o.zarr")["layers/resid_post"].dataset.resid_post.values
    run = dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr", resume=True)
    assert "consolidated_metadata" not in json.loads((tmp_path / "o.zarr" / "zarr.json").read_text())
    with torch.no_grad():
        run.model.generate(**encoded, max_new_tokens=4, do_sample=False)
    run.flush()                                 # on disk and committed: a reader sees every step
    mid = dmi.open(tmp_path / "o.zarr")
    assert mid.attrs["dmi_status"] == "open" and mid.attrs["dmi_committed"]["step"] == 7
    run.close()
    tree = dmi.open(tmp_path / "o.zarr")
    ds = tree["layers/resid_post"].dataset
    np.testing.assert_array_equal(ds.resid_post.values, np.concatenate([first, first]))   # same prompts, same rows
    assert list(dict.fromkeys(ds.request.values.tolist())) == ["r0", "r1", "r2", "r3", "r4", "r5"]
    assert tree.attrs["steps"] == 8
    _check_accounting(tree)


def test_an_open_store_is_read_up_to_its_last_commit(tmp_path, encoded, write_spec, capsys):
    """Rows past the commit marker (a writer killed between writing shapes and the marker) are not
    the store's: dmi.open and dmi inspect cut every group to the marker's rows."""
    spec = write_spec("capture: [{sites: [resid_post, final_norm]}]\n")
    with torch.no_grad(), dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr") as run:
        run.model(**encoded)
        run.model(**encoded)
    meta_file = tmp_path / "o.zarr" / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta.pop("consolidated_metadata")
    first = int(encoded["attention_mask"].sum())
    meta["attributes"] |= {"dmi_status": "open", "dmi_writer": {"pid": 2**22 + 12345, "host": "elsewhere"}}
    meta["attributes"]["dmi_committed"] |= {"step": 0, "rows": {"layers/resid_post": first, "final_norm": first,
                                                                 "drops": 0}}
    meta_file.write_text(json.dumps(meta))
    tree = dmi.open(tmp_path / "o.zarr")
    assert tree["layers/resid_post"].dataset.sizes["token"] == tree["final_norm"].dataset.sizes["token"] == first
    assert set(tree["final_norm"].dataset.step.values.tolist()) == {0}
    assert main(["inspect", str(tmp_path / "o.zarr")]) == 0
    assert "did not close cleanly (last committed step 0)" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "o.zarr"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {s["group"]: s["tokens"] for s in info["sites"]} == {"layers/resid_post": first, "final_norm": first}
    assert info["steps"] == 1 and info["committed_step"] == 0 and info["status"] == "open"


# --- sink failures ----------------------------------------------------------------------------------

def _check_accounting(tree):
    a = tree.attrs
    for site in a["sites"]:
        assert a["rows_stored"][site] + a["rows_dropped"][site] + a["rows_not_computed"][site] \
            == a["rows_selected"][site], site
    assert sum(a["rows_dropped"].values()) == int(tree["drops"].dataset.rows.sum())


def _writer_alive(store: Path) -> bool:
    """The process the store names as its writer still runs (a zombie does not)."""
    return writer_alive(json.loads((store / "zarr.json").read_text())["attributes"]["dmi_writer"])


def test_unwritable_store_path_fails_at_load_naming_path_and_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(dmi.StoreError, match=r"file.*is a file, not a directory\. Fix: "):
        dmi.load("tiny-qwen3", hook_spec={"capture": [{"sites": ["final_norm"]}]}, store=blocker / "o.zarr")
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(dmi.StoreError, match=r"ro.*is not writable\. Fix: "):
            dmi.load("tiny-qwen3", hook_spec={"capture": [{"sites": ["final_norm"]}]}, store=ro / "o.zarr")


def _store_full_spec(write_spec, policy: str, writer: str = "thread") -> Path:
    return write_spec(f"""
        capture: [{{sites: [resid_post, final_norm]}}]
        store: {{max_bytes: 60KiB, chunk_bytes: 8KiB, writer: {_writer(writer)}}}
        policy: {_policy(policy, writer)}
    """)


def test_a_store_cap_under_one_chunk_is_refused_at_load(tmp_path, write_spec):
    """store.max_bytes below one chunk of a group would fill the store before its first chunk: the
    load says so (file, line, key, the chunk's size and the fix) and writes nothing."""
    spec = write_spec("capture: [{sites: [resid_post]}]\nstore:\n  max_bytes: 64KiB\n")
    with pytest.raises(dmi.SpecError) as info:
        dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr")
    msg = str(info.value)
    assert f"{spec}:3" in msg and "store.max_bytes" in msg, msg
    assert "smaller than one chunk of group layers/resid_post" in msg, msg
    assert "Fix: raise store.max_bytes to at least 4MiB, or lower store.chunk_bytes" in msg, msg
    assert not (tmp_path / "o.zarr").exists()
    spec = write_spec("capture: [{sites: [resid_post]}]\nstore: {max_bytes: 64KiB, chunk_bytes: 8KiB}\n")
    dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr").close()     # smaller chunks fit


@pytest.mark.parametrize("writer", WRITERS)
def test_store_full_stops_the_model_at_its_next_step(tmp_path, encoded, write_spec, writer):
    """The failed write reaches the model's thread at its next step: no step begins after the
    failure was handed to the ring but the one in flight then."""
    run = dmi.load("tiny-qwen3", hook_spec=_store_full_spec(write_spec, "{mode: full}", writer),
                   store=tmp_path / "o.zarr")
    steps_at_failure = []

    def watch():                # the steps begun when the failure reached the ring (each step checks it)
        while run.ring.error is None:
            time.sleep(0.001)
        steps_at_failure.append(run.ring.stats.steps)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # generates until the failure comes back (a writer process starved by a busy machine may fail
    # the store only after many generates), within a bound that fails the test instead of hanging
    deadline = time.monotonic() + 120
    with pytest.raises(dmi.CaptureError) as info, torch.no_grad():
        while time.monotonic() < deadline:
            run.model.generate(**encoded, max_new_tokens=10, do_sample=False)
    watcher.join(5)             # (on a busy machine the raise can come before the watcher's next look)
    assert run.ring.stats.steps - steps_at_failure[0] <= 1, (run.ring.stats.steps, steps_at_failure)
    msg = str(info.value)
    assert "store full" in msg and str(tmp_path / "o.zarr") in msg and "store.max_bytes" in msg and "Fix:" in msg
    assert isinstance(info.value.__cause__, dmi.StoreError)
    with pytest.raises(dmi.CaptureError, match="store full"):
        run.close()
    tree = dmi.open(tmp_path / "o.zarr")            # consistent up to its last commit
    assert tree.attrs["dmi_status"] == "failed" and "store full" in tree.attrs["store_error"]
    last = tree.attrs["dmi_committed"]["step"]
    assert np.unique(tree["layers/resid_post"].dataset.step.values).tolist() == list(range(last + 1))
    assert run.stats()["drops_by_reason"]["sink"] > 0
    assert "sink" in set(tree["drops"].dataset.reason.values.tolist())


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("policy", ["{mode: best_effort}", "{mode: full, on_store_error: drop}"])
def test_store_full_under_drop_keeps_generating_and_counts_every_drop(tmp_path, encoded, write_spec, policy, writer):
    model = build_tiny_model("tiny-qwen3")
    ref = build_tiny_model("tiny-qwen3")
    run = dmi.load(model, hook_spec=_store_full_spec(write_spec, policy, writer), store=tmp_path / "o.zarr")
    with torch.no_grad():
        for _ in range(8):        # until the store is full, and one generate more
            out = run.model.generate(**encoded, max_new_tokens=20, do_sample=False)
            if run.exporter.error is not None:
                break
        out = run.model.generate(**encoded, max_new_tokens=20, do_sample=False)
    run.close()
    assert torch.equal(out, ref.generate(**encoded, max_new_tokens=20, do_sample=False))
    stats = run.stats()
    assert stats["store_error"] and "store full" in stats["store_error"]
    assert stats["drops_by_reason"]["sink"] == stats["dropped_captures"] > 0
    tree = dmi.open(tmp_path / "o.zarr")
    assert tree.attrs["dmi_status"] == "closed" and "store full" in tree.attrs["store_error"]
    drops = tree["drops"].dataset
    assert set(drops.reason.values.tolist()) == {"sink"} and drops.sizes["drop"] == stats["dropped_captures"]
    _check_accounting(tree)
    stored_steps = set(tree["layers/resid_post"].dataset.step.values.tolist())
    assert stored_steps.isdisjoint(drops.step.values[drops.site.values == "layers.0.resid_post"].tolist())


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("policy", ["full", "best_effort"])
def test_an_oserror_mid_run(tmp_path, encoded, write_spec, policy, writer):
    """A file where a chunk directory must go: an OSError even for root (chmod does not stop root)."""
    spec = write_spec(f"capture: [{{sites: [resid_post]}}]\nstore: {{chunk_bytes: 4KiB, writer: {_writer(writer)}}}\n"
                      f"policy: {_policy(f'{{mode: {policy}}}', writer)}\n")
    run = dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr")
    blocker = ArrayFile(tmp_path / "o.zarr", "layers/resid_post/resid_post").path(2).parent.parent
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("in the way")
    with contextlib.ExitStack() as stack:
        if policy == "full":
            info = stack.enter_context(pytest.raises(dmi.CaptureError))
        with torch.no_grad():
            for _ in range(20):
                run.model.generate(**encoded, max_new_tokens=8, do_sample=False)
                if run.exporter.error is not None and policy == "best_effort":
                    break
    if policy == "full":
        assert str(blocker) in str(info.value) and "Not a directory" in str(info.value)
        with pytest.raises(dmi.CaptureError):
            run.close()
    else:
        run.close()
        assert "Not a directory" in run.stats()["store_error"]
        _check_accounting(dmi.open(tmp_path / "o.zarr"))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="running as root: chmod does not stop root's writes (test_an_oserror_mid_run forces the "
                           "OSError with a file where a chunk directory must go)")
def test_read_only_store_mid_run(tmp_path, encoded, write_spec):
    spec = write_spec("capture: [{sites: [resid_post]}]\nstore: {chunk_bytes: 4KiB}\n")
    run = dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr")
    for d, _, _ in os.walk(tmp_path / "o.zarr"):
        os.chmod(d, 0o500)
    try:
        with pytest.raises(dmi.CaptureError, match="Permission denied"), torch.no_grad():
            for _ in range(20):
                run.model.generate(**encoded, max_new_tokens=8, do_sample=False)
        with pytest.raises(dmi.CaptureError):
            run.close()
    finally:
        for d, _, _ in os.walk(tmp_path / "o.zarr"):
            os.chmod(d, 0o700)


def test_cli_store_full_exits_1_with_the_message(tmp_path, capsys):
    spec = tmp_path / "hooks.yaml"
    spec.write_text("capture: [{sites: [resid_post, final_norm]}]\nstore: {max_bytes: 40KiB, chunk_bytes: 8KiB}\n")
    store = tmp_path / "o.zarr"
    assert main(["capture", "--spec", str(spec), "--out", str(store), "-q", "--max-new-tokens", "30"]) == 1
    err = capsys.readouterr().err
    assert "store full" in err and str(store) in err and "Fix:" in err
    assert json.loads((store / "zarr.json").read_text())["attributes"]["dmi_status"] == "failed"


def test_bytes_per_s_caps_the_write_rate_and_backpressure_reaches_the_model(tmp_path, tokenizer, write_spec,
                                                                           monkeypatch):
    """The exporter sleeps to keep store.bytes_per_s; under mode full the model cannot run ahead of
    the store by more than what the buffers between them hold (ring, host staging, open chunks)."""
    monkeypatch.setattr("dmi.store.chunks.os.cpu_count", lambda: 1)      # two chunks in flight at most
    rate, ring, host = 40 << 10, 16 << 10, 8 << 10
    spec = write_spec(f"""
        capture: [{{sites: [resid_pre, resid_mid, resid_post, mlp.out]}}]
        store: {{bytes_per_s: {rate}, chunk_bytes: 8KiB, compression: none}}
        policy: {{mode: full, ring_bytes: {ring}, host_bytes: {host}}}
    """)
    enc = tokenizer(["Paris"], return_tensors="pt")
    run = dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr")
    t0 = time.monotonic()
    with torch.no_grad():
        out = run.model.generate(**enc, max_new_tokens=60, do_sample=False)
    t_generate = time.monotonic() - t0
    run.close()
    elapsed = time.monotonic() - t0
    store = tmp_path / "o.zarr"
    chunks = [p.stat().st_size for p in store.rglob("c/*/*/*") if p.is_file()]
    captured = sum(run.plan.sites[i].row_bytes(4) * n for i, n in enumerate(run.layouts.rows_selected))
    buffered = ring + host + (2 + 4) * max(chunks)       # chunks in flight + one open chunk per group
    assert elapsed >= 0.9 * (sum(chunks) - max(chunks)) / rate > 2.0
    assert t_generate >= 0.9 * (captured - buffered) / rate > 1.0
    tree = dmi.open(store)
    assert tree["layers/resid_post"].dataset.sizes["token"] == int(enc["attention_mask"].sum()) + \
        out.shape[1] - enc["input_ids"].shape[1] - 1
