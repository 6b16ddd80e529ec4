"""store.writer: process — the exporter in its own process — and store.writer: pool — chunks encoded
and written by worker processes — write the same store as the in-process exporter, and their
failures reach the caller the same way."""
from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import dmi
from conftest import model_pair

SPEC = {"capture": [{"sites": ["resid_post", "final_norm"]}, {"sites": ["logits"], "tokens": "last", "reduce": {"topk": 5}},
                    {"sites": ["attn.q"], "layers": [0], "tokens": {"phase": "decode"}}],
        "store": {"chunk_bytes": "16KiB"}}


def _arrays(group: zarr.Group, prefix: str = ""):
    for name, node in group.members():
        if isinstance(node, zarr.Group):
            yield from _arrays(node, f"{prefix}{name}/")
        else:
            yield f"{prefix}{name}", node[...]


def _capture(encoded, store, writer: str, policy: dict):
    model, ref = model_pair("qwen3")
    spec = SPEC | {"store": SPEC["store"] | {"writer": writer}, "policy": policy}
    with torch.no_grad():
        with dmi.load(model, hook_spec=spec, store=store) as run:
            outs = [run.model.generate(**encoded, max_new_tokens=n, do_sample=False) for n in (6, 3)]
            if writer == "process":
                assert run.exporter._proc.poll() is None and run.exporter._proc.pid != os.getpid()
                inline = run.exporter.inline_steps
        want = [ref.generate(**encoded, max_new_tokens=n, do_sample=False) for n in (6, 3)]
    assert all(torch.equal(a, b) for a, b in zip(outs, want)), "patched model generated different tokens"
    return run.stats() | ({"inline_steps": inline} if writer == "process" else {})


@pytest.mark.parametrize("policy", [
    {"mode": "full", "ring_bytes": "8MiB"},
    # a ring far smaller than the run (backpressure) and a handoff buffer smaller than a prefill step
    {"mode": "full", "ring_bytes": "96KiB", "host_bytes": "48KiB"}])
def test_process_writer_stores_what_the_thread_writer_stores(tmp_path, encoded, policy):
    stats = {w: _capture(encoded, tmp_path / f"{w}.zarr", w, policy) for w in ("thread", "process")}
    assert stats["process"]["dropped_captures"] == stats["thread"]["dropped_captures"] == 0
    if policy.get("host_bytes"):
        assert stats["process"]["inline_steps"] > 0
    a, b = (zarr.open_group(str(tmp_path / f"{w}.zarr"), mode="r") for w in ("thread", "process"))
    got = dict(_arrays(b))
    names = []
    for name, want in _arrays(a):
        names.append(name)
        if want.dtype == object:
            assert want.tolist() == got[name].tolist(), name
        else:
            np.testing.assert_array_equal(got[name], want, err_msg=name)
    assert sorted(names) == sorted(got) and "layers/resid_post/resid_post" in names
    assert b.attrs["hook_spec"]["store"]["writer"] == "process"
    # stall time is a clock reading: under backpressure either run may wait a fraction of a ms
    timing = {"stall_seconds", "stall_bandwidth_seconds"}
    skip = {"dmi_writer", "created", "store_bytes", "hook_spec"} | timing
    assert {k: v for k, v in b.attrs.asdict().items() if k not in skip} == \
        {k: v for k, v in a.attrs.asdict().items() if k not in skip}
    assert all(t.attrs[k] >= 0 for t in (a, b) for k in timing)
    assert b.attrs["dmi_status"] == "closed" and b.attrs["dmi_writer"]["pid"] != os.getpid()


@pytest.mark.parametrize("drain", ["thread", "process"])
def test_a_killed_writer_process_stops_capture_naming_it(tmp_path, encoded, drain):
    """Also with policy.drain: process, where the killed child drained the ring (a small ring: full
    mode waits for it, then the failure reaches the waiting step). The child's exit itself stops
    capture: a wait that saw no progress until policy.stall_timeout_s (the hang guard here) would
    raise a stall error instead."""
    spec = SPEC | {"store": SPEC["store"] | {"writer": "process"},
                   "policy": {"mode": "full", "drain": drain, "ring_bytes": "256KiB", "stall_timeout_s": 30}}
    run = dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr")
    with torch.no_grad():
        run.model.generate(**encoded, max_new_tokens=4, do_sample=False)
        run.flush()
        committed = run.stats()["committed_step"]
        os.kill(run.exporter._proc.pid, signal.SIGKILL)
        with pytest.raises(dmi.CaptureError, match="store writer process exited") as info:
            for _ in range(200):
                run.model.generate(**encoded, max_new_tokens=4, do_sample=False)
    assert "no progress" not in str(info.value)      # the exit was seen, not a stall timed out
    assert str(tmp_path / "o.zarr") in str(info.value) and "Fix:" in str(info.value)
    with pytest.raises(dmi.DmiError, match="store writer process exited"):
        run.close()
    tree = dmi.open(tmp_path / "o.zarr")           # consistent up to its last commit
    assert tree.attrs["dmi_status"] == "open" and tree.attrs["dmi_committed"]["step"] >= committed >= 0
    last = tree.attrs["dmi_committed"]["step"]
    assert np.unique(tree["layers/resid_post"].dataset.step.values).tolist() == list(range(last + 1))


def test_the_writer_process_outlives_ctrl_c_and_stop_signals(tmp_path, encoded):
    """SIGINT / SIGTERM are the capturing process's to handle (it closes the store cleanly)."""
    spec = SPEC | {"store": SPEC["store"] | {"writer": "process"}}
    run = dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr")
    child = run.exporter._proc
    assert os.getpgid(child.pid) != os.getpgid(0)          # Ctrl-C at a terminal does not reach it
    with torch.no_grad():
        run.model.generate(**encoded, max_new_tokens=3, do_sample=False)
        run.flush()                                        # (the child has set up its handlers by now)
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(child.pid, sig)
        run.model.generate(**encoded, max_new_tokens=3, do_sample=False)
    time.sleep(0.2)
    assert child.poll() is None
    run.close()
    assert child.returncode == 0 and dmi.open(tmp_path / "o.zarr").attrs["dmi_status"] == "closed"


def test_a_handoff_buffer_that_cannot_be_allocated_is_refused_at_load(tmp_path, monkeypatch, shared_files_made):
    """No tmpfs or disk here has 64 TiB: refused with the numbers and the fix, nothing left behind.
    (dmi.load's check against the host's RAM, which refuses it first, is set aside: this is the
    handoff buffer's own check, for a size that RAM has but its file system has not.)"""
    import dmi.api
    monkeypatch.setattr(dmi.api, "check_memory", lambda *a, **k: None)
    spec = SPEC | {"store": SPEC["store"] | {"writer": "process"}, "policy": {"host_bytes": "64TiB"}}
    with pytest.raises(dmi.StoreError, match=r"no room for the 70,368,744,177,664-byte handoff buffer "
                                             r"\(policy\.host_bytes\).*Fix: lower policy\.host_bytes"):
        dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr")
    tried = [p for p in shared_files_made if Path(p).name.startswith("dmi-handoff-")]
    assert tried and not any(Path(p).exists() for p in tried), tried


def test_writer_process_is_refused_with_tensor_parallelism(tmp_path):
    from dmi.errors import SpecError
    from dmi.run import Run
    from dmi.models import build_tiny_model
    from dmi.plan import build_plan
    from dmi.spec import builtin_spec_dir, load_arch_spec, load_hook_spec
    model = build_tiny_model("tiny-qwen3")
    hook = load_hook_spec({"capture": [{"sites": ["final_norm"]}], "store": {"writer": "process"}})
    plan = build_plan(load_arch_spec(builtin_spec_dir() / "qwen3.yaml"), hook, model.config, model_dtype_itemsize=4)
    with pytest.raises(SpecError, match=r"store\.writer: process is not supported with tensor parallelism.*Fix:"):
        Run(model, plan, str(tmp_path / "o.zarr"), tp=object())


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@pytest.mark.skipif(not hasattr(os, "getpriority") or not Path("/proc/self/task").exists(), reason="Linux threads")
@pytest.mark.parametrize("writer", ["thread", "process", "pool"])
def test_the_store_threads_yield_their_cores_to_the_model(tmp_path, encoded, writer):
    """store.threads sets the exporter's pool; its threads (the writer process: all of it) run at
    lowered CPU priority, the model's thread keeps its own, and the store still holds every row."""
    import threading
    from dmi.store.chunks import STORE_NICE
    spec = SPEC | {"store": SPEC["store"] | {"writer": writer, "threads": 2}}
    mine = _nice(threading.get_native_id())
    with torch.no_grad(), dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr") as run:
        run.model.generate(**encoded, max_new_tokens=4, do_sample=False)
        run.flush()
        if writer == "thread":
            assert run.exporter._workers == 2
            pool = [t for t in threading.enumerate() if t.name.startswith(("dmi-zarr", "dmi-copy"))]
            assert pool and all(_nice(t.native_id) >= STORE_NICE for t in pool)
        else:
            pids = [run.exporter._proc.pid] if writer == "process" else [p.pid for p in run.exporter._procs]
            for pid in pids:
                tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
                assert tids and all(_nice(t) >= STORE_NICE for t in tids)
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert b"MALLOC_MMAP_THRESHOLD_=%d" % (32 << 20) in env
        assert _nice(threading.get_native_id()) == mine
        stats = run.stats()
    tree = dmi.open(tmp_path / "o.zarr")
    assert stats["dropped_captures"] == 0 and tree.attrs["dmi_status"] == "closed"
    assert tree["layers/resid_post"].dataset.sizes["token"] == tree.attrs["rows_stored"]["layers.0.resid_post"] > 0


def test_best_effort_survives_the_writer_process_dying(tmp_path, encoded):
    """kill -9 of the writer under best_effort: this process resumes the store and captures on; the
    uncommitted steps are in the drops table (reason writer), every stored row equals the thread
    writer's, and rows stored + dropped + not computed = rows selected for every site."""
    spec = SPEC | {"policy": {"mode": "best_effort"}}

    def run_with(writer: str, kill: bool):
        with torch.no_grad(), dmi.load("tiny-qwen3", hook_spec=spec | {"store": SPEC["store"] | {"writer": writer}},
                                       store=tmp_path / f"{writer}.zarr") as run:
            gen = run.model.generate
            gen(**encoded, max_new_tokens=4, do_sample=False)
            run.flush()                                   # steps 0-3 committed
            if kill:                                      # the writer stays stopped: it commits nothing more
                os.kill(run.exporter._proc.pid, signal.SIGSTOP)
            gen(**encoded, max_new_tokens=5, do_sample=False)
            if kill:
                committed = run.stats()["committed_step"]
                deadline = time.monotonic() + 30
                while run.threads.exported < run.ring.stats.steps and time.monotonic() < deadline:
                    time.sleep(0.01)                      # steps 4-8 handed to the (stopped) writer
                os.kill(run.exporter._proc.pid, signal.SIGKILL)
                run.exporter._proc.wait()
            for n in (3, 6):
                gen(**encoded, max_new_tokens=n, do_sample=False)       # no exception: capture goes on
        stats = run.stats()                               # (closed: every step handed over)
        return (stats, committed) if kill else stats

    want = run_with("thread", kill=False)
    (got, committed_before) = run_with("process", kill=True)
    tree, ref = dmi.open(tmp_path / "process.zarr"), dmi.open(tmp_path / "thread.zarr")
    a = tree.attrs
    assert a["dmi_status"] == "closed" and a["writer_failover"]["exit_code"] == -signal.SIGKILL
    lost = a["writer_failover"]["steps_lost"]
    assert committed_before == a["writer_failover"]["committed_step"] == 3 and lost == 5
    from dmi.store.inspect import format_summary, summarize
    text = format_summary(summarize(tmp_path / "process.zarr"))
    assert "failover  the writer process exited (code -9) after committing step 3" in text, text
    assert got["drops_by_reason"] == {"writer": a["writer_failover"]["captures_lost"]} and want["dropped_captures"] == 0
    drops = tree["drops"].dataset
    lost_steps = sorted(set(drops.step.values.tolist()))
    assert set(drops.reason.values.tolist()) == {"writer"} and len(lost_steps) == lost
    for site in a["rows_selected"]:
        assert a["rows_stored"][site] + a["rows_dropped"][site] + a["rows_not_computed"][site] == \
            a["rows_selected"][site] == ref.attrs["rows_selected"][site], site
    x, y = tree["layers/resid_post"].dataset, ref["layers/resid_post"].dataset
    steps = sorted(set(x.step.values.tolist()))
    assert steps == sorted(set(y.step.values.tolist()) - set(lost_steps))   # every step but the lost ones
    keep = np.isin(y.step.values, steps)
    for v in ("resid_post", "step", "position", "request"):
        np.testing.assert_array_equal(x[v].values, y[v].values[keep] if v != "resid_post"
                                      else y[v].values[keep, ...], err_msg=v)


def test_full_mode_stops_when_the_writer_process_dies_and_says_how_to_go_on(tmp_path, encoded):
    spec = SPEC | {"store": SPEC["store"] | {"writer": "process"}, "policy": {"mode": "full"}}
    run = dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr")
    with torch.no_grad():
        run.model.generate(**encoded, max_new_tokens=3, do_sample=False)
        os.kill(run.exporter._proc.pid, signal.SIGKILL)
        with pytest.raises(dmi.CaptureError, match="on_store_error: drop would resume it"):
            for _ in range(200):
                run.model.generate(**encoded, max_new_tokens=3, do_sample=False)
    with pytest.raises(dmi.DmiError):
        run.close()


# --- store.writer: pool ------------------------------------------------------------------------------

def _chunk_files(store: Path) -> dict[str, bytes]:
    """Every chunk file of a store (the ``c`` key below each array), by path."""
    return {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*")
            if p.is_file() and "c" in p.relative_to(store).parts}


@pytest.mark.parametrize("policy,chunk", [
    ({"mode": "full", "ring_bytes": "8MiB"}, "16KiB"),
    # chunks of 16 rows: a prefill step fills several, each written while the step's later rows are
    # copied; a ring far smaller than the run backs up into the model
    ({"mode": "full", "ring_bytes": "96KiB", "host_bytes": "48KiB"}, "1KiB")])
def test_pool_writer_writes_the_thread_writers_chunk_files(tmp_path, encoded, policy, chunk):
    """store.writer: pool stores exactly what the thread writer stores, chunk file for chunk file,
    and close waits for every chunk: every selected row is stored and the workers have exited."""
    model, ref = model_pair("qwen3")
    twin = copy.deepcopy(model)
    stores, procs = {}, []
    for writer, m in (("thread", twin), ("pool", model)):
        store = {"chunk_bytes": chunk, "writer": writer} | ({"writers": 2} if writer == "pool" else {})
        with torch.no_grad(), dmi.load(m, hook_spec=SPEC | {"store": store, "policy": policy},
                                       store=tmp_path / f"{writer}.zarr") as run:
            outs = [run.model.generate(**encoded, max_new_tokens=n, do_sample=False) for n in (6, 3)]
            if writer == "pool":
                procs = list(run.exporter._procs)
                assert len(procs) == 2 and all(p.poll() is None for p in procs)
        stores[writer] = dmi.open(tmp_path / f"{writer}.zarr")
        assert run.stats()["dropped_captures"] == 0
    want = [ref.generate(**encoded, max_new_tokens=n, do_sample=False) for n in (6, 3)]
    assert all(torch.equal(a, b) for a, b in zip(outs, want)), "patched model generated different tokens"
    assert all(p.poll() == 0 for p in procs), "close left a chunk writer running"
    a, b = stores["thread"].attrs, stores["pool"].attrs
    assert b["dmi_status"] == "closed" and b["hook_spec"]["store"]["writer"] == "pool"
    for site, n in a["rows_selected"].items():
        assert b["rows_stored"][site] == a["rows_stored"][site] == n > 0, site
    files = {w: _chunk_files(tmp_path / f"{w}.zarr") for w in stores}
    assert sorted(files["pool"]) == sorted(files["thread"]) and any("resid_post/c" in k for k in files["pool"])
    for name, data in files["thread"].items():
        assert files["pool"][name] == data, f"{name} differs from the thread writer's"
    x, y = (zarr.open_group(str(tmp_path / f"{w}.zarr"), mode="r") for w in ("thread", "pool"))
    got = dict(_arrays(y))
    for name, arr in _arrays(x):
        if arr.dtype == object:
            assert arr.tolist() == got[name].tolist(), name
        else:
            np.testing.assert_array_equal(got[name], arr, err_msg=name)


def test_a_killed_chunk_writer_stops_capture_naming_it(tmp_path, encoded):
    """kill -9 of one chunk writer process under policy.mode full: the caller gets a CaptureError
    naming the process and the signal (never a hang), and the store keeps its committed steps."""
    spec = SPEC | {"store": SPEC["store"] | {"writer": "pool", "writers": 2}, "policy": {"mode": "full"}}
    run = dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr")
    with torch.no_grad():
        run.model.generate(**encoded, max_new_tokens=4, do_sample=False)
        run.flush()
        committed = run.stats()["committed_step"]
        victim = run.exporter._procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(dmi.CaptureError, match=f"chunk writer process {victim.pid} was killed by SIGKILL") as info:
            for _ in range(200):
                run.model.generate(**encoded, max_new_tokens=4, do_sample=False)
    msg = str(info.value)
    assert str(tmp_path / "o.zarr") in msg and "store.writer: pool" in msg and "Fix:" in msg
    with pytest.raises(dmi.DmiError, match="was killed by SIGKILL"):
        run.close()
    assert all(p.poll() is not None for p in run.exporter._procs)
    tree = dmi.open(tmp_path / "o.zarr")           # consistent up to its last commit
    assert tree.attrs["dmi_status"] == "failed" and "SIGKILL" in tree.attrs["store_error"]
    last = tree.attrs["dmi_committed"]["step"]
    assert last >= committed >= 0
    assert np.unique(tree["layers/resid_post"].dataset.step.values).tolist() == list(range(last + 1))


def test_best_effort_counts_every_row_after_a_chunk_writer_dies(tmp_path, encoded):
    """kill -9 of a chunk writer under best_effort: the model runs on, the steps the store did not
    commit are drops (reason sink), and rows stored + dropped + not computed = rows selected."""
    spec = SPEC | {"store": SPEC["store"] | {"writer": "pool", "writers": 2}, "policy": {"mode": "best_effort"}}
    with torch.no_grad(), dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "o.zarr") as run:
        run.model.generate(**encoded, max_new_tokens=4, do_sample=False)
        run.flush()
        os.kill(run.exporter._procs[1].pid, signal.SIGKILL)
        run.exporter._procs[1].wait()
        for n in (5, 3):
            run.model.generate(**encoded, max_new_tokens=n, do_sample=False)     # no exception
    stats = run.stats()
    assert "chunk writer process" in stats["store_error"] and stats["drops_by_reason"]["sink"] > 0
    tree = dmi.open(tmp_path / "o.zarr")
    a = tree.attrs
    assert a["dmi_status"] == "closed" and "SIGKILL" in a["store_error"]
    assert set(tree["drops"].dataset.reason.values.tolist()) == {"sink"}
    for site in a["rows_selected"]:
        assert a["rows_stored"][site] + a["rows_dropped"][site] + a["rows_not_computed"][site] == \
            a["rows_selected"][site] > 0, site
    assert a["rows_stored"]["layers.0.resid_post"] == tree["layers/resid_post"].dataset.sizes["token"] > 0


def test_pool_settings_are_checked_at_load(tmp_path):
    from dmi.errors import SpecError
    from dmi.run import Run
    from dmi.models import build_tiny_model
    from dmi.plan import build_plan
    from dmi.spec import builtin_spec_dir, load_arch_spec, load_hook_spec
    model = build_tiny_model("tiny-qwen3")
    arch = load_arch_spec(builtin_spec_dir() / "qwen3.yaml")
    with pytest.raises(SpecError, match=r"store\.writers.*Fix: set store\.writer: pool"):
        build_plan(arch, load_hook_spec({"capture": [{"sites": ["final_norm"]}],
                                         "store": {"writer": "thread", "writers": 2}}),
                   model.config, model_dtype_itemsize=4)
    with pytest.raises(SpecError, match=r"store\.writer: pool cannot go with policy\.drain: process.*Fix:"):
        build_plan(arch, load_hook_spec({"capture": [{"sites": ["final_norm"]}], "store": {"writer": "pool"},
                                         "policy": {"drain": "process"}}), model.config, model_dtype_itemsize=4)
    hook = load_hook_spec({"capture": [{"sites": ["final_norm"]}], "store": {"writer": "pool"}})
    plan = build_plan(arch, hook, model.config, model_dtype_itemsize=4)
    with pytest.raises(SpecError, match=r"store\.writer: pool is not supported with tensor parallelism.*Fix:"):
        Run(model, plan, str(tmp_path / "o.zarr"), tp=object())


def test_auto_writer_is_recorded_in_the_store_and_shown_by_inspect(tmp_path):
    """store.writer left to dmi: the choice and its reason are a root attribute and a line of dmi
    inspect; a CPU model keeps the exporter's threads, a CUDA model writing a local directory gets
    the pool, and what the pool cannot write (shards, in-memory results, object stores) the thread."""
    from dmi.models import build_tiny_model
    from dmi.store.inspect import format_summary, summarize
    from dmi.store.preflight import choose_writer
    model = build_tiny_model("tiny-qwen3")
    with dmi.load(model, hook_spec={"capture": [{"sites": ["final_norm"]}]}, store=tmp_path / "a.zarr") as run:
        model(torch.randint(0, 100, (1, 4)))
    auto = dmi.open(run.store).attrs["sized_automatically"]
    assert auto == {"store.writer": {"value": "thread", "why": choose_writer("auto", torch.device("cpu"), "x", False, False)[1]}}
    assert "auto      store.writer thread: a model on the CPU" in format_summary(summarize(run.store))
    cuda = torch.device("cuda", 0)
    assert choose_writer("auto", cuda, str(tmp_path / "b.zarr"), False, False)[0] == "pool"
    assert [choose_writer("auto", cuda, *case)[0] for case in
            ((str(tmp_path / "b.zarr"), True, False), (str(tmp_path / "b.zarr"), False, True),
             ("s3://bucket/b.zarr", False, False))] == ["thread"] * 3
    assert choose_writer("process", cuda, str(tmp_path / "b.zarr"), False, False) == ("process", None)
    # store.writers given where auto picks the thread writer: said, not silently dropped
    with pytest.warns(UserWarning, match=r"store\.writers: 4 is ignored: store\.writer auto chose the thread writer "
                                         r"\(a model on the CPU.*Fix: remove store\.writers"):
        with dmi.load(model, hook_spec={"capture": [{"sites": ["final_norm"]}], "store": {"writers": 4}},
                      store=tmp_path / "c.zarr") as run:
            model(torch.randint(0, 100, (1, 4)))
