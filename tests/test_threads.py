"""One loaded run, several Python threads: a run's step bookkeeping (request table, decode state,
token filter counters, the open step) belongs to one thread at a time. A second thread that enters
a step while another thread's generate() (or step) is in flight gets a CaptureError naming the
problem and the fix, at once (no blocking, so no deadlock), and the first thread's capture is
untouched. Real threads, real tiny model."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import dmi
from conftest import PROMPTS
from dmi.errors import CaptureError
from dmi.models import build_tiny_model, tiny_tokenizer
from test_policy import as_tuples, check_accounting, generate_rows, store_rows

SPEC = {"capture": [{"sites": ["resid_post"], "layers": [1]},
                    {"sites": ["logits"], "tokens": "last", "reduce": {"topk": 2}}]}
JOIN_S = 120          # a thread still alive after this is a deadlock


@pytest.fixture(autouse=True)
def one_torch_thread():
    # several Python threads each calling torch with an intra-op pool of 2 oversubscribe the 2 CI
    # cores (a tiny model's decode step went from ~5 ms to ~200 ms); its matmuls gain nothing from it
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def run(tmp_path):
    r = dmi.load(build_tiny_model("tiny-qwen3"), hook_spec=SPEC, store=tmp_path / "o.zarr")
    yield r
    r.close()


@pytest.fixture(scope="module")
def enc():
    return tiny_tokenizer()(PROMPTS, return_tensors="pt", padding=True)


def _lengths(enc) -> list[int]:
    return enc["attention_mask"].sum(1).tolist()


def _generate(run, enc, ids, new):
    run.set_request_ids(ids)
    with torch.no_grad():
        run.model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False)


class Worker(threading.Thread):
    """A thread running ``fn``; keeps its exception."""

    def __init__(self, fn, name):
        super().__init__(name=name, daemon=True)
        self.fn, self.error = fn, None

    def run(self):
        try:
            self.fn()
        except BaseException as e:      # noqa: BLE001 - handed to the test
            self.error = e


def _wait_for_steps(run, n: int, worker: Worker) -> None:
    deadline = time.monotonic() + JOIN_S
    while run.stats()["steps"] < n:
        assert worker.is_alive() and time.monotonic() < deadline, worker.error
        time.sleep(0.005)


def _check_store(path, expected: list[dict]) -> None:
    tree = dmi.open(path)
    assert tree.attrs["dmi_status"] == "closed"
    assert store_rows(tree["layers/resid_post"].dataset) == as_tuples(expected)
    assert store_rows(tree["logits"].dataset) == as_tuples([r for r in expected if r["last"]])
    check_accounting(tree)


def test_second_generate_is_refused_while_the_first_runs(run, enc, tmp_path):
    first = Worker(lambda: _generate(run, enc, ["a0", "a1", "a2"], 120), "gen-A")
    first.start()
    _wait_for_steps(run, 3, first)
    # the main thread tries while A's generate is in flight: its ids are its own (per thread) and
    # the refusal comes before any step of it begins
    with pytest.raises(CaptureError) as info:
        _generate(run, enc, ["b0", "b1", "b2"], 5)
    assert first.is_alive(), "A finished before B tried: make A's generate longer"
    msg = str(info.value)
    for says in ("one generate at a time per dmi run", "'MainThread' began generate", "'gen-A' is running generate",
                 "Fix: serialize the calls", "own model and dmi.load run"):
        assert says in msg, msg
    with pytest.raises(CaptureError, match="began a forward while thread 'gen-A'"):   # a bare forward too
        with torch.no_grad():
            run.model(input_ids=torch.tensor([[5, 6, 7]]))
    first.join(JOIN_S)
    assert not first.is_alive() and first.error is None, first.error
    _generate(run, enc, ["b0", "b1", "b2"], 5)       # free again: the same ids, still pending, now work
    run.close()
    n = _lengths(enc)
    _check_store(tmp_path / "o.zarr", generate_rows(n, 120, ["a0", "a1", "a2"], 0)
                 + generate_rows(n, 5, ["b0", "b1", "b2"], 120))


def test_many_threads_race_without_deadlock_and_keep_attribution(run, enc, tmp_path):
    """Four threads each try three generate() calls at once: every call either runs whole (its rows,
    under its own ids, complete) or is refused before it begins (its ids never appear)."""
    done: list[tuple[list[str], int]] = []       # (ids, first step) of the calls that ran
    refused = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def worker(k):
        start.wait()
        for j in range(3):
            ids = [f"t{k}.{j}.{b}" for b in range(3)]
            try:
                _generate(run, enc, ids, 6)
            except CaptureError as e:
                with lock:
                    refused.append(str(e))
                continue
            with lock:
                done.append(ids)

    workers = [Worker(lambda k=k: worker(k), f"w{k}") for k in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(JOIN_S)
    assert not any(w.is_alive() for w in workers), "deadlock"
    assert all(w.error is None for w in workers), [w.error for w in workers]
    assert done and refused and len(done) + len(refused) == 12
    assert all("one generate at a time" in m and "Fix: " in m for m in refused)
    run.close()
    tree = dmi.open(tmp_path / "o.zarr")
    ds = tree["layers/resid_post"].dataset
    got = store_rows(ds)
    # each call ran whole: its rows are contiguous in the store and exactly those of one generate
    order = list(dict.fromkeys(r[0].rsplit(".", 1)[0] for r in got))
    assert sorted(order) == sorted(ids[0].rsplit(".", 1)[0] for ids in done)
    expected, step = [], 0
    for call in order:
        expected += generate_rows(_lengths(enc), 6, [f"{call}.{b}" for b in range(3)], step)
        step += 6
    assert got == as_tuples(expected)
    check_accounting(tree)


def test_an_owner_thread_that_died_mid_step_is_taken_over(run, enc, tmp_path):
    # a thread begins a step from outside the forward (as for a CUDA graph replay) and exits
    # without ending it: the next thread takes the run over and the orphaned step is aborted
    ids = torch.tensor([[5, 6, 7]])
    orphan = Worker(lambda: run.begin_step(ids, torch.ones_like(ids)), "orphan")
    orphan.start()
    orphan.join(JOIN_S)
    assert orphan.error is None
    _generate(run, enc, ["a", "b", "c"], 4)
    run.close()
    tree = dmi.open(tmp_path / "o.zarr")
    assert "a" in set(map(str, tree["logits"].dataset.request.values))
    check_accounting(tree)


def test_a_forward_that_raises_frees_the_run(run, enc, tmp_path):
    layer = run.model.model.layers[2]
    forward = layer.forward

    def broken(*a, **k):
        raise RuntimeError("boom")
    layer.forward = broken
    failing = Worker(lambda: _generate(run, enc, ["x0", "x1", "x2"], 4), "failing")
    failing.start()
    failing.join(JOIN_S)
    assert isinstance(failing.error, RuntimeError)
    layer.forward = forward
    _generate(run, enc, ["a", "b", "c"], 4)           # another thread (main) may go on at once
    with torch.no_grad():
        other = Worker(lambda: run.model(**enc), "plain")    # and a plain forward of a third thread
        other.start()
        other.join(JOIN_S)
    assert other.error is None, other.error
    run.close()
    check_accounting(dmi.open(tmp_path / "o.zarr"))


def test_a_batch_is_continued_only_by_the_thread_that_started_it(run):
    ids = torch.tensor([[5, 6, 7, 8]])
    out = {}

    def prefill():
        with torch.no_grad():
            out["o"] = run.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    w = Worker(prefill, "prefill")
    w.start()
    w.join(JOIN_S)
    assert w.error is None, w.error
    nxt = torch.tensor([[9]])
    with pytest.raises(CaptureError, match=r"continues a batch .* another thread started.*Fix: .*run.exclusive"):
        with torch.no_grad():
            run.model(input_ids=nxt, attention_mask=torch.ones(1, 5, dtype=torch.long),
                      past_key_values=out["o"].past_key_values)


def test_exclusive_block_holds_the_run_across_a_manual_decode_loop(run, tmp_path):
    """``with run.exclusive():`` gives a hand-written prefill + decode loop what generate() has."""
    inside, release = threading.Event(), threading.Event()

    def loop():
        ids = torch.tensor([[5, 6, 7, 8]])
        with run.exclusive("a decode loop"), torch.no_grad():
            run.set_request_ids(["m"])
            o = run.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
            inside.set()
            release.wait(JOIN_S)
            for k in range(3):
                nxt = o.logits[:, -1:].argmax(-1)
                o = run.model(input_ids=nxt, attention_mask=torch.ones(1, 5 + k, dtype=torch.long),
                              past_key_values=o.past_key_values, use_cache=True)
    w = Worker(loop, "loop")
    w.start()
    assert inside.wait(JOIN_S)
    with pytest.raises(CaptureError, match="while thread 'loop' is running a decode loop"):
        with torch.no_grad():
            run.model(input_ids=torch.tensor([[1, 2]]))
    release.set()
    w.join(JOIN_S)
    assert w.error is None, w.error
    run.close()
    ds = dmi.open(tmp_path / "o.zarr")["layers/resid_post"].dataset
    assert store_rows(ds) == [("m", p, s, "prefill" if s == 0 else "decode")
                              for s, p in [(0, 0), (0, 1), (0, 2), (0, 3), (1, 4), (2, 5), (3, 6)]]


def test_graph_stepped_forwards_open_drain_windows_and_only_they_wake_the_drain(run, enc, monkeypatch):
    """Run.stepped (HF's compiled generate) opens a drain window after each forward it brackets, at
    most one per DRAIN_WINDOW_S, none in null mode. With the drain's timer out of the way, a window
    is what drains the step; a forward inside the spacing leaves its step for the next wake-up."""
    import dmi.run.steps as run_module
    run.threads.drain_interval = 3600.0               # the timer never fires during the test ...
    time.sleep(0.3)                           # ... once the drain's first 100 ms wait is over
    forward = run.stepped(run.model.forward, lambda a, k: (k["input_ids"], k["attention_mask"], None, 0))
    inputs = dict(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])

    def drained(within: float) -> bool:
        deadline = time.monotonic() + within
        while run.ring.pending and time.monotonic() < deadline:
            time.sleep(0.005)
        return not run.ring.pending

    monkeypatch.setattr(run_module, "DRAIN_WINDOW_S", 0.0)
    with torch.no_grad():
        forward(**inputs)
        assert run.drain_windows == 1 and drained(JOIN_S)          # the window woke the drain
        monkeypatch.setattr(run_module, "DRAIN_WINDOW_S", 3600.0)
        forward(**inputs)
        assert run.drain_windows == 1 and not drained(0.3)         # inside the spacing: no window, no drain
        run.flush()
        run.set_enabled(False)
        monkeypatch.setattr(run_module, "DRAIN_WINDOW_S", 0.0)
        forward(**inputs)
        assert run.drain_windows == 1                              # null mode: nothing to drain, no window
    assert run.stats()["steps"] == 2 and run.stats()["records"] > 0
