"""vLLM adapter pieces that need no vLLM: scheduler batch -> token rows, per-request policy.

The engine tests (tests/test_vllm.py) check the same bookkeeping end to end against HF; these pin
each rule on hand-made batches, and every refusal of the operator policy, in milliseconds.
"""
from __future__ import annotations

import collections
from types import SimpleNamespace

import numpy as np
import pytest

from dmi.adapters.vllm.compat import Batch, client_request_id, repeats_last_step
from dmi.adapters.vllm.policy import RequestRefused, ServePolicy, Want, check, options, resolve
from dmi.adapters.vllm.steps import StepBuilder
from dmi.tokens import RequestTable

ALL = Want(None, None)


def batch(req_ids, sched, computed, prompt, finished=()):
    return Batch(req_ids=list(req_ids), num_scheduled=np.asarray(sched, np.int64),
                 num_computed=np.asarray(computed, np.int64), num_prompt=np.asarray(prompt, np.int64),
                 finished=set(finished), spec_decode=False)


def rows_of(st, table):
    return [(table.ids[r], int(p), int(row)) for r, p, row in zip(st.request, st.position, st.rows)]


def test_chunked_prefill_and_decode_rows():
    """Rows are grouped by request in batch order; positions continue from num_computed."""
    table = RequestTable()
    sb = StepBuilder(table)
    # a: prompt chunk 0..3 of 6; b: decode at position 9 (prompt 5); c: whole prompt of 2
    st, keep, held = sb.build(batch(["a", "b", "c"], [4, 1, 2], [0, 9, 0], [6, 5, 2]), 8, lambda r: ALL, 3)
    assert rows_of(st, table) == [("a", 0, 0), ("a", 1, 1), ("a", 2, 2), ("a", 3, 3), ("b", 9, 4), ("c", 0, 5), ("c", 1, 6)]
    assert st.seq == 8 and st.batch == 1 and keep is None            # padded to 8 rows: rows 7 never copied
    assert list(st.phase) == [0, 0, 0, 0, 1, 0, 0]                   # prompt tokens prefill, b decodes
    index, n = held["sampled"]                                      # logits: one row per request, its last token
    assert n == 3 and list(index) == [-1, -1, -1, 0, 1, -1, 2]
    assert [int(st.local[i]) for i in (3, 4, 6)] == [8 - 3 + 0, 8 - 3 + 1, 8 - 3 + 2]
    # the next chunk of a continues at position 4
    st, _, _ = sb.build(batch(["a"], [2], [4], [6]), 2, lambda r: ALL, 3)
    assert rows_of(st, table) == [("a", 4, 0), ("a", 5, 1)]


def test_prefix_cache_hit_rows_start_at_the_hit():
    table = RequestTable()
    st, _, _ = StepBuilder(table).build(batch(["p"], [3], [128], [131]), 3, lambda r: ALL, 1)
    assert [int(p) for p in st.position] == [128, 129, 130]


def test_preemption_recompute_is_not_stored_twice():
    table = RequestTable()
    sb = StepBuilder(table)
    sb.build(batch(["a"], [5], [0], [5]), 5, lambda r: ALL, 1)             # prompt 0..4
    sb.build(batch(["a"], [1], [5], [5]), 1, lambda r: ALL, 1)             # decode 5
    st, _, held = sb.build(batch(["a"], [7], [0], [5]), 7, lambda r: ALL, 1)   # preempted: recompute 0..6
    assert [int(p) for p in st.position] == [6] and list(st.rows) == [6]
    assert sb.recomputed_rows == 6
    assert list(held["sampled"][0]) == [0]                            # row 6 is the request's logits row


def test_finished_requests_forget_their_positions():
    table = RequestTable()
    sb = StepBuilder(table)
    sb.build(batch(["a"], [3], [0], [3]), 3, lambda r: ALL, 1)
    st, _, _ = sb.build(batch(["b"], [1], [0], [1], finished=["a"]), 1, lambda r: ALL, 1)
    assert "a" not in sb.captured_upto and table.ids == ["a", "b"]


def test_opt_out_site_sets_and_row_caps():
    table = RequestTable()
    wants = {"a": ALL, "b": Want(frozenset(), None), "c": Want(frozenset({1}), None), "d": Want(None, 2)}
    st, keep, held = StepBuilder(table).build(batch(list("abcd"), [2, 2, 2, 3], [0, 0, 0, 0], [2, 2, 2, 3]), 9,
                                              wants.__getitem__, 2)
    assert [table.ids[r] for r in st.request] == ["a", "a", "c", "c", "d", "d"]     # b opted out: not a row
    assert list(keep[0]) == [True, True, False, False, True, True]                  # c captures site 1 only
    assert list(keep[1]) == [True] * 6
    assert [int(p) for p, r in zip(st.position, st.request) if table.ids[r] == "d"] == [0, 1]   # capped at 2


def reference_rows(state, b, want):
    """One request at a time, as the rules read: rows (request id, position, flat row, phase, is the
    request's logits row, sites or None). ``state``: {id: [captured up to, rows taken]}."""
    for rid in b.finished:
        state.pop(rid, None)
    out, start = [], 0
    for j, rid in enumerate(b.req_ids):
        n, first = int(b.num_scheduled[j]), int(b.num_computed[j])
        w = want(rid)
        if n and not (w.sites is not None and not w.sites):
            upto, taken = state.get(rid, [0, 0])
            fresh = [p for p in range(first, first + n) if p >= upto]
            if w.max_rows is not None:
                fresh = fresh[:max(w.max_rows - taken, 0)]
                taken += len(fresh)
            state[rid] = [max(upto, first + n), taken]
            out += [(rid, p, start + p - first, int(p >= b.num_prompt[j]), p == first + n - 1, w.sites) for p in fresh]
        start += n
    return out


@pytest.mark.parametrize("seed", range(6))
def test_step_rows_match_a_per_request_reference(seed):
    """Continuous batching with joins, finishes, preemptions, opt-outs, site sets and row caps: the
    step builder's whole-step array version keeps exactly the rows the per-request rules keep."""
    rng = np.random.default_rng(seed)
    table, state = RequestTable(), {}
    sb = StepBuilder(table)
    wants = {}
    live: dict[str, list[int]] = {}          # id -> [computed, prompt]
    for step in range(40):
        finished = [r for r in live if rng.random() < 0.1]
        for r in finished:
            del live[r]
        for _ in range(rng.integers(0, 4)):
            rid = f"s{seed}.{step}.{len(live)}"
            live[rid] = [int(rng.integers(0, 3)) * 8, int(rng.integers(1, 40))]   # a prefix-cache hit now and then
            wants[rid] = [ALL, Want(frozenset(), None), Want(frozenset({1}), None), Want(None, int(rng.integers(0, 9))),
                          Want(frozenset({0, 2}), 5)][rng.integers(0, 5)]
        for r, v in live.items():
            if rng.random() < 0.05:
                v[0] = 0                      # preempted: recomputed from the start
        ids = list(live)
        sched = [0 if rng.random() < 0.1 else (min(int(rng.integers(1, 17)), max(live[r][1] - live[r][0], 1))
                                                if live[r][0] < live[r][1] else 1) for r in ids]
        b = batch(ids, sched, [live[r][0] for r in ids], [live[r][1] for r in ids], finished)
        want = wants.__getitem__
        expected = reference_rows(state, b, want)
        st, keep, held = sb.build(b, int(sum(sched)) + 3, want, 3)
        got = [(table.ids[r], int(p), int(row), int(ph)) for r, p, row, ph in zip(st.request, st.position, st.rows, st.phase)]
        assert got == [e[:4] for e in expected]
        index, n = held["sampled"]
        assert n == len(ids)
        assert [int(i) >= 0 for i in index] == [e[4] for e in expected]
        assert [ids[i] for i in index if i >= 0] == [e[0] for e in expected if e[4]]
        for site in range(3):
            mask = np.ones(len(expected), bool) if keep is None else keep[site]
            assert list(mask) == [e[5] is None or site in e[5] for e in expected]
        for r, k in zip(ids, sched):
            live[r][0] += k


@pytest.mark.parametrize("seed", range(4))
def test_steady_decode_steps_reuse_the_last_rows_and_match_the_reference(seed):
    """A serving batch mostly decodes the same requests one token at a time: those steps take the
    builder's steady path (the last step's rows, positions plus one). Now and then a request joins,
    finishes, is preempted or skips a step, and the padded size changes: every step's rows must
    still equal the per-request reference, and the steady path must have been taken."""
    rng = np.random.default_rng(100 + seed)
    table, state = RequestTable(), {}
    sb = StepBuilder(table)
    wants: dict = {}
    live: dict[str, list[int]] = {}
    steady = 0
    for step in range(120):
        churn = rng.random() < 0.08
        finished = [r for r in live if churn and rng.random() < 0.2]
        for r in finished:
            del live[r]
        if churn or not live:
            for _ in range(rng.integers(1, 3)):
                rid = f"t{seed}.{step}.{len(live)}"
                live[rid] = [0, int(rng.integers(1, 12))]
                wants[rid] = [ALL, ALL, Want(frozenset({1}), None), Want(None, int(rng.integers(5, 40)))][rng.integers(0, 4)]
        if churn and live and rng.random() < 0.3:
            live[next(iter(live))][0] = 0                     # preempted: recomputed from the start
        ids = list(live)
        sched = [1 if live[r][0] >= live[r][1] else min(4, live[r][1] - live[r][0]) for r in ids]
        if churn and rng.random() < 0.3:
            sched[0] = 0                                      # a request not scheduled this step
        padded = int(sum(sched)) + (3 if churn and rng.random() < 0.5 else 0)
        b = batch(ids, sched, [live[r][0] for r in ids], [live[r][1] for r in ids], finished)
        want = wants.__getitem__
        expected = reference_rows(state, b, want)
        before = sb._last
        st, keep, held = sb.build(b, padded, want, 3)
        steady += before is not None and st.rows is before[3].rows
        got = [(table.ids[r], int(p), int(row), int(ph)) for r, p, row, ph in zip(st.request, st.position, st.rows, st.phase)]
        assert got == [e[:4] for e in expected], step
        index, n = held["sampled"]
        assert n == len(ids) and [int(i) >= 0 for i in index] == [e[4] for e in expected]
        assert [int(x) for x in st.local] == [padded - n + int(i) if i >= 0 else int(r) for i, r in zip(index, st.rows)]
        for site in range(3):
            mask = np.ones(len(expected), bool) if keep is None else keep[site]
            assert list(mask) == [e[5] is None or site in e[5] for e in expected]
        for r, k in zip(ids, sched):
            live[r][0] += k
    assert steady > 20


@pytest.mark.parametrize("seed", range(3))
def test_repeated_steps_match_the_reference(seed):
    """The session's fastest path: when the engine's step is the last one's requests decoding one
    token each (``compat.repeats_last_step``), ``StepBuilder.repeat`` gives the rows without
    reading the batch, and the per-request positions are settled when a general step comes. Every
    step's rows, repeated or built, equal the per-request reference, through joins, finishes,
    preemptions and row caps."""
    rng = np.random.default_rng(200 + seed)
    table, state = RequestTable(), {}
    sb = StepBuilder(table)
    wants: dict = {}
    live: dict[str, list[int]] = {}
    repeated = 0
    for step in range(150):
        churn = rng.random() < 0.1
        finished = [r for r in live if churn and rng.random() < 0.3]
        for r in finished:
            del live[r]
        if churn or not live:
            rid = f"r{seed}.{step}"
            live[rid] = [0, int(rng.integers(1, 10))]
            wants[rid] = [ALL, ALL, Want(None, int(rng.integers(5, 30)))][rng.integers(0, 3)]
        if churn and rng.random() < 0.3:
            live[next(iter(live))][0] = 0                     # preempted: recomputed from the start
        ids = list(live)
        sched = [1 if live[r][0] >= live[r][1] else min(3, live[r][1] - live[r][0]) for r in ids]
        b = batch(ids, sched, [live[r][0] for r in ids], [live[r][1] for r in ids], finished)
        expected = reference_rows(state, b, wants.__getitem__)
        got = None
        so = SimpleNamespace(total_num_scheduled_tokens=sum(sched), num_scheduled_tokens=dict(zip(ids, sched)),
                             scheduled_new_reqs=[], finished_req_ids=set(finished), preempted_req_ids=None,
                             scheduled_spec_decode_tokens={})
        runner = SimpleNamespace(input_batch=SimpleNamespace(num_reqs=len(ids), req_ids=ids))
        # (a churn step here may preempt a request in place; vLLM takes it out of the batch, which the check sees)
        if sb.last_ids is not None and not churn and repeats_last_step(runner, so, sb.last_ids):
            got = sb.repeat(len(ids))
            repeated += got is not None
        st, _, held = got or sb.build(b, len(ids), wants.__getitem__, 3)
        assert [(table.ids[r], int(p), int(row)) for r, p, row in zip(st.request, st.position, st.rows)] == \
            [e[:3] for e in expected], step
        assert held["sampled"][1] == len(ids)
        for r, k in zip(ids, sched):
            live[r][0] += k
    assert repeated > 30


def test_repeats_last_step_only_for_the_same_requests_decoding_one_token_each():
    ids = ["a", "b", "c"]

    def check(**changes):
        so = dict(total_num_scheduled_tokens=3, num_scheduled_tokens=dict.fromkeys(ids, 1), scheduled_new_reqs=[],
                  finished_req_ids=set(), preempted_req_ids=None, scheduled_spec_decode_tokens={})
        batch_ids = changes.pop("batch_ids", ids)
        so.update(changes)
        runner = SimpleNamespace(input_batch=SimpleNamespace(num_reqs=len(batch_ids), req_ids=list(batch_ids)))
        return repeats_last_step(runner, SimpleNamespace(**so), ids)
    assert check()
    assert not check(batch_ids=["b", "a", "c"])                                  # reordered
    assert not check(batch_ids=["a", "b", "c", "d"])                             # one joined
    assert not check(batch_ids=["a", "b"])                                       # one left
    assert not check(scheduled_new_reqs=["d"])
    assert not check(finished_req_ids={"x"})
    assert not check(preempted_req_ids={"x"})
    assert not check(total_num_scheduled_tokens=4, num_scheduled_tokens={"a": 2, "b": 1, "c": 1})   # a chunk
    assert not check(num_scheduled_tokens={"a": 2, "b": 1})                      # c not scheduled
    assert not check(scheduled_spec_decode_tokens={"a": [5]})


def test_steady_path_is_left_when_requests_swap_places_or_jump_ahead():
    """Two requests at the same position swap places in the batch (vLLM reorders its persistent
    batch), then one jumps two positions: counts and positions alone would look steady."""
    table = RequestTable()
    sb = StepBuilder(table)
    sb.build(batch(["a", "b"], [1, 1], [10, 10], [5, 5]), 2, lambda r: ALL, 1)
    st, _, _ = sb.build(batch(["a", "b"], [1, 1], [11, 11], [5, 5]), 2, lambda r: ALL, 1)     # steady
    assert rows_of(st, table) == [("a", 11, 0), ("b", 11, 1)] and sb._last is not None
    st, _, _ = sb.build(batch(["b", "a"], [1, 1], [12, 12], [5, 5]), 2, lambda r: ALL, 1)     # swapped
    assert rows_of(st, table) == [("b", 12, 0), ("a", 12, 1)]
    st, _, _ = sb.build(batch(["b", "a"], [1, 1], [15, 13], [5, 5]), 2, lambda r: ALL, 1)     # b jumped
    assert rows_of(st, table) == [("b", 15, 0), ("a", 13, 1)]
    assert sb.captured_upto == {"a": 14, "b": 16}


# --- per-request policy: every refusal -------------------------------------------------------------
DEFAULT = {"layers.0.resid_post", "logits"}
EXTRA = {"layers.1.attn.q"}


@pytest.mark.parametrize("args, policy, words", [
    ({"sites": ["layers.2.attn.q"]}, ServePolicy(), "not captured on this server and not offered"),   # widening
    ({"sites": ["attn.k"]}, ServePolicy(), "not captured on this server"),
    ({"return": True}, ServePolicy(), "never returned to API clients"),
    ({"max_rows": 100}, ServePolicy(max_rows=10), "above this server's per-request cap 10"),
    ({"capture": False}, ServePolicy(narrow=False), "opting out is not allowed"),
    ({"sites": ["logits"]}, ServePolicy(narrow=False), "picking fewer is not allowed"),
    ({"bogus": 1}, ServePolicy(), "unknown request option"),
    ({"capture": "maybe"}, ServePolicy(), "'capture' must be true or false"),
    ({"sites": []}, ServePolicy(), "non-empty list"),
    ({"max_rows": -1}, ServePolicy(), "non-negative integer"),
])
def test_each_refusal(args, policy, words):
    with pytest.raises(RequestRefused, match=words.replace("(", r"\(")) as info:
        check(args, policy, DEFAULT, EXTRA)
    # a refusal says what is refused, never what the operator captures or offers
    assert not any(name in str(info.value) for name in DEFAULT | EXTRA), info.value


def test_engine_request_ids_are_stored_bounded_printable_and_distinct():
    """A client picks its request id (X-Request-Id), which goes into every row of its request."""
    from dmi.tokens import MAX_ID_CHARS, bounded_id
    table = RequestTable()
    long_a, long_b, odd = "a" * 100_000, "a" * 99_999 + "b", "cmpl-\x00\n\u00e9\ud800"
    idx = table.intern(["cmpl-1-0", long_a, long_b, odd, long_a])
    assert idx == [0, 1, 2, 3, 1]
    assert table.ids[0] == "cmpl-1-0"                       # an ordinary id is stored as given
    stored = table.ids[1:]
    assert len(set(stored)) == 3 and all(len(r) <= MAX_ID_CHARS and r.isascii() and r.isprintable() for r in stored)
    assert all(bounded_id(r) == r for r in table.ids)       # stored ids are their own bounded form (resume)


@pytest.mark.parametrize("args", [
    None, {"capture": False}, {"sites": ["logits"]}, {"sites": ["attn.q"]}, {"max_rows": 5}, {"capture": True},
])
def test_allowed_requests(args):
    check(args, ServePolicy(max_rows=10), DEFAULT, EXTRA)


def test_http_forms_of_the_options():
    """vllm_xargs values are flat: dmi_<option> keys, comma lists, 0/1, or dmi as a JSON string."""
    assert options({"dmi_capture": 0}) == {"capture": False}
    assert options({"dmi_sites": "resid_post, logits", "dmi_max_rows": "3"}) == {"sites": ["resid_post", "logits"],
                                                                                 "max_rows": 3}
    assert options({"dmi": '{"capture": true}'}) == {"capture": True}
    assert options({"other": 1}) is None and options(None) is None
    with pytest.raises(RequestRefused, match="not JSON"):
        options({"dmi": "{capture"})


class _Site:
    def __init__(self, index, name):
        self.index, self.name = index, name


class _Plan:
    sites = [_Site(0, "layers.0.resid_post"), _Site(1, "logits"), _Site(2, "layers.1.attn.q")]


@pytest.mark.parametrize("args, policy, sites, refused", [
    (None, ServePolicy(), frozenset({0, 1}), False),                     # on_request sites stay off by default
    ({"sites": ["attn.q"]}, ServePolicy(), frozenset({2}), False),       # ... unless the request names them
    ({"capture": False}, ServePolicy(), frozenset(), False),
    (None, ServePolicy(default="skip"), frozenset(), False),
    ({"capture": True}, ServePolicy(default="skip"), frozenset({0, 1}), False),
    ({"sites": ["layers.5.*"]}, ServePolicy(), frozenset({0, 1}), True),  # refused in the worker: default, not more
    ({"capture": False}, ServePolicy(narrow=False), frozenset({0, 1}), True),
])
def test_worker_resolution_never_widens(args, policy, sites, refused):
    want, refusal = resolve(args, policy, _Plan, EXTRA)
    assert want.sites == sites and bool(refusal) == refused


def test_run_held_rows_and_site_masks(tmp_path):
    """Run.begin_tokens(keep=, held=) (the vLLM adapter's additions to the engine-agnostic step
    entry): a tensor holding one row per request lands under the right rows; rows outside it count
    as not computed; a site mask narrows one site only."""
    from dataclasses import replace

    import torch

    import dmi
    from dmi.models import build_tiny_model
    from dmi.plan import build_plan
    from dmi.run import Run
    from dmi.spec import find_arch_spec, load_hook_spec

    model = build_tiny_model("tiny-qwen3")
    arch = find_arch_spec("qwen3")
    plan = build_plan(arch, load_hook_spec({"capture": [{"sites": ["final_norm", "logits"]}]}), model.config)
    plan.sites = [replace(s, anchor=dict(arch.data["sites"][s.canonical]["vllm"], layout=["token"])) for s in plan.sites]
    norm, logits = plan.sites
    assert logits.anchor["rows"] == "sampled"
    table = RequestTable()
    run = Run(model, plan, str(tmp_path / "o.zarr"))
    run.requests = table
    sb = StepBuilder(table)
    wants = {"a": ALL, "b": ALL, "c": Want(frozenset({norm.index}), None)}
    st, keep, held = sb.build(batch(["a", "b", "c"], [3, 1, 2], [0, 4, 0], [3, 1, 2]), 8, wants.__getitem__, 2)
    hidden = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)        # [padded tokens, hidden]
    vocab = torch.arange(3 * 512, dtype=torch.float32).reshape(3, 512)       # one row per request
    run.begin_tokens(st, np.zeros(1, np.int64), keep=keep, held=held)
    run.capture(norm.index, hidden)
    run.capture(logits.index, vocab)
    run.end_step()
    run.close()
    tree = dmi.open(tmp_path / "o.zarr")
    fn, lg = tree["final_norm"].dataset, tree["logits"].dataset
    assert list(fn.position.values) == [0, 1, 2, 4, 0, 1]
    np.testing.assert_array_equal(fn.final_norm.values, hidden[[0, 1, 2, 3, 4, 5]].numpy())
    # logits: a's row 2 and b's row 3 are the sampled rows; c does not capture logits
    assert list(lg.request.values) == ["a", "b"] and list(lg.position.values) == [2, 4]
    np.testing.assert_array_equal(lg.logits.values, vocab[[0, 1]].numpy())
    a = tree.attrs
    assert a["rows_selected"]["logits"] == 4 and a["rows_not_computed"]["logits"] == 2 and a["rows_stored"]["logits"] == 2


def test_run_reuses_the_layout_of_a_row_structure_seen_before(tmp_path):
    """A churning batch (a request out of the batch every other step, another batch of the same
    shape later) never repeats the last step, but its row structures come back: Run keeps the layouts
    of recent ones (keyed by rows, phases, local rows, request boundaries, held rows), whichever
    requests fill them. Every row still lands under its own request and position, ``last``
    selects each request's last row, and the accounting holds."""
    from dataclasses import replace

    import torch

    import dmi
    from dmi.models import build_tiny_model
    from dmi.plan import build_plan
    from dmi.run import Run
    from dmi.spec import find_arch_spec, load_hook_spec

    model = build_tiny_model("tiny-qwen3")
    arch = find_arch_spec("qwen3")
    hook = {"capture": [{"sites": ["final_norm", "logits"]}, {"sites": ["resid_post"], "layers": [0], "tokens": "last"}]}
    plan = build_plan(arch, load_hook_spec(hook), model.config)
    plan.sites = [replace(s, anchor=dict(arch.data["sites"][s.canonical]["vllm"], layout=["token"])) for s in plan.sites]
    table = RequestTable()
    run = Run(model, plan, str(tmp_path / "o.zarr"))
    run.requests = table
    sb = StepBuilder(table)
    layouts, want = [], {}
    steps = [(["a", "b", "c"], [1, 1, 1], [5, 7, 9]), (["a", "b"], [1, 1], [6, 8]),      # c not scheduled
             (["a", "b", "c"], [1, 1, 1], [7, 9, 10]), (["a", "b"], [1, 1], [8, 10]),
             (["d", "e"], [2, 1], [0, 3]), (["d", "e"], [1, 1], [2, 4]), (["f", "g"], [2, 1], [0, 6])]
    for k, (ids, sched, computed) in enumerate(steps):
        st, keep, held = sb.build(batch(ids, sched, computed, [2] * len(ids)), int(sum(sched)), lambda r: ALL, 3)
        real = int(sum(sched))
        hidden = torch.full((real, 64), float(k)) + torch.arange(real, dtype=torch.float32)[:, None]
        vocab = torch.full((len(ids), 512), float(k)) + torch.arange(len(ids), dtype=torch.float32)[:, None]
        run.begin_tokens(st, np.zeros(1, np.int64), keep=keep, held=held)
        layouts.append(run.ring.current.layout)
        for site in plan.sites:
            run.capture(site.index, vocab if site.canonical == "logits" else hidden)
        run.end_step()
        for j, rid in enumerate(ids):
            rows = [r for r in range(real) if sum(sched[:j]) <= r < sum(sched[:j + 1])]
            for i, r in enumerate(rows):
                want[(k, rid, computed[j] + i)] = (float(k + r), r == rows[-1], float(k + j) if r == rows[-1] else None)
    run.close()
    # steps 2, 3 repeat the structures of steps 0, 1; steps 5 and 6 (other requests) those of steps 1 and 4
    assert layouts[2] is layouts[0] and layouts[3] is layouts[1] and layouts[6] is layouts[4]
    assert layouts[5] is layouts[1] and len({id(x) for x in layouts}) == 3
    tree = dmi.open(tmp_path / "o.zarr")
    fn, lg, rp = tree["final_norm"].dataset, tree["logits"].dataset, tree["layers/resid_post"].dataset
    got = {(int(s), str(r), int(p)): float(v[0]) for s, r, p, v in zip(fn.step.values, fn.request.values,
                                                                    fn.position.values, fn.final_norm.values)}
    assert got == {key: v[0] for key, v in want.items()}
    got_last = {(int(s), str(r), int(p)) for s, r, p in zip(rp.step.values, rp.request.values, rp.position.values)}
    assert got_last == {key for key, v in want.items() if v[1]}
    got_logits = {(int(s), str(r), int(p)): float(v[0]) for s, r, p, v in zip(lg.step.values, lg.request.values,
                                                                           lg.position.values, lg.logits.values)}
    assert got_logits == {key: v[2] for key, v in want.items() if v[2] is not None}
    a = tree.attrs
    for site in a["rows_selected"]:
        assert a["rows_stored"][site] + a["rows_dropped"][site] + a["rows_not_computed"][site] == a["rows_selected"][site]


def test_gate_resolves_a_batch_at_once_and_shares_equal_wants():
    """RequestGate.want_all (a step's batch at once) gives what want gives request by request; equal
    wants are one object, so StepBuilder tells a batch of default requests by identity."""
    from dmi.adapters.vllm.policy import RequestGate
    from dmi.models import build_tiny_model
    from dmi.plan import build_plan
    from dmi.spec import find_arch_spec, load_hook_spec

    hook = load_hook_spec({"capture": [{"sites": ["final_norm", "logits"]}]})
    plan = build_plan(find_arch_spec("qwen3"), hook, build_tiny_model("tiny-qwen3").config)

    def req(extra):
        return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra))
    runner = SimpleNamespace(requests={"a": req(None), "b": req({"dmi": {"capture": False}}), "c": req(None),
                                       "d": req({"dmi": {"max_rows": 3}}), "e": req({"dmi": {"max_rows": 3}})})
    ids = ["a", "b", "c", "d", "e"]
    gate = RequestGate(ServePolicy.from_hook(hook), plan, runner)
    got = gate.want_all(ids)
    assert got == [gate.want(r) for r in ids] == gate.want_all(ids)
    assert got[0] is got[2] and got[3] is got[4] and got[0] == Want(None, None)
    assert got[1] == Want(frozenset(), None) and got[3].max_rows == 3
    table = RequestTable()
    sb = StepBuilder(table)
    st, _, _ = sb.build(batch(ids, [1] * 5, [4] * 5, [2] * 5), 5, gate.want, len(plan.sites), wants_all=gate.want_all)
    assert [table.ids[r] for r in st.request] == ["a", "c", "d", "e"]      # b opted out: its row is not a row


@pytest.mark.parametrize("seed", range(3))
def test_a_fresh_layout_equals_the_per_site_path(tmp_path, seed):
    """A step laid out anew (Run._layout_of: whole-array operations over the sites, what every
    mixed step of a serving engine takes) wants exactly what the per-site path (Run._wanted) wants:
    the same captures in the same order with the same rows, bytes and priorities, the same
    accounting (rows selected, rows the engine's held tensor lacks), and on the kernel ring the same
    control words, including steps where a filter selects nothing and held rows are missing."""
    from dataclasses import replace

    from dmi.kernels.kernel_ring import InterpretRing
    from dmi.models import build_tiny_model
    from dmi.plan import build_plan
    from dmi.ring.layout import StepControl, StepLayout
    from dmi.run import Run
    from dmi.spec import find_arch_spec, load_hook_spec

    model = build_tiny_model("tiny-qwen3")
    arch = find_arch_spec("qwen3")
    hook = {"capture": [{"sites": ["resid_post", "final_norm"]}, {"sites": ["logits"]},
                        {"sites": ["mlp.out"], "layers": [0], "tokens": "last", "priority": 3},
                        {"sites": ["resid_mid"], "layers": [1], "tokens": "decode"}]}
    if seed == 2:        # logits the only site of its filter: that filter's own rows are never placed
        hook["capture"][1]["tokens"] = {"phase": "all", "last": True, "positions": [0, 10 ** 6]}
    plan = build_plan(arch, load_hook_spec(hook), model.config)
    plan.sites = [replace(s, anchor=dict(arch.data["sites"][s.canonical]["vllm"], layout=["token"])) for s in plan.sites]
    run = Run(model, plan, str(tmp_path / "o.zarr"))
    ring = InterpretRing(1 << 20, 64)
    ring.setup(plan, run.dtype, "cpu")
    rng = np.random.default_rng(seed)
    sb = StepBuilder(run.requests)
    empty = missing = unused = 0
    try:
        for k in range(12):
            n = int(rng.integers(1, 9))
            ids = [f"s{seed}.{k}.{j}" for j in range(n)]
            sched = rng.integers(1, 6, n) if k % 3 else np.ones(n, np.int64)    # every third step decodes only
            computed = rng.integers(0, 40, n)
            prompt = computed + (rng.integers(0, 8, n) if k % 2 else 0)          # odd steps: some rows prefill
            if k % 4 == 1:
                prompt = computed + 100                     # every row prefills: the decode site selects nothing
            st, keep, held = sb.build(batch(ids, sched, computed, prompt), int(sched.sum()) + k % 3, lambda r: ALL,
                                      len(plan.sites))
            assert keep is None
            fresh = run.layouts.layout_of(st, held)
            wanted, counts = run.layouts.wanted(st, None, held)
            assert len(fresh.wanted) == len(wanted)
            for a, b in zip(fresh.wanted, wanted):
                assert (a[0], a[3], a[4]) == (b[0], b[3], b[4])
                np.testing.assert_array_equal(a[1], b[1])
                np.testing.assert_array_equal(a[2], b[2])
            for a, b in zip(fresh.cache["counts"], counts):
                np.testing.assert_array_equal(a, b)
            empty += len(fresh) < len(plan.sites)
            missing += int(counts[2].sum())
            unused += len(set(fresh.src.tolist())) < len(fresh.arrays)
            words = []
            for layout in (fresh, StepLayout(wanted)):
                h = np.zeros(ring.ctrl_words, np.int64)
                ctrl = StepControl(k, st, np.zeros(1, np.int64), {}, 0, 0, 0, layout=layout)
                rel, starts, end = ring._layout_words(ctrl, h, ring.site_words + 1)
                words.append((rel, starts, end, h[:end]))
            np.testing.assert_array_equal(words[0][0], words[1][0])
            assert words[0][1:3] == words[1][1:3]
            np.testing.assert_array_equal(words[0][3], words[1][3])
    finally:
        run.close()
    assert empty                    # a site with no rows came up; and held rows the engine lacks, or (seed 2)
    assert (missing > 0) if seed != 2 else (unused > 0 and missing == 0)     # a filter no site reads rows of


# --- seams added for vLLM 0.25.1 on the GPU (tests/gpu/test_vllm_gpu.py runs them for real) ---------
def test_dummy_run_launches_the_kernel_ring_as_a_graph_with_a_flat_geometry():
    """vLLM warms up and captures its CUDA graphs in _dummy_run with no dmi step open: the graph
    launches must happen there (Triton loads its kernels before the capture), each graph bakes
    its own token count as row bound, and the end-marker kernel is compiled there too."""
    import types

    from dmi.adapters.vllm import compat
    from dmi.adapters.vllm.worker import Session
    seen = []
    from dmi.kernels.kernel_ring import KernelRing
    ring = types.SimpleNamespace(null=False, graph_mode=False, geometry=(1, 37), is_cuda=False, end_warm=False,
                                 device_end=lambda: seen.append("end kernel"))   # a kernel ring after a step
    ring.launching_without_step = types.MethodType(KernelRing.launching_without_step, ring)
    runner = types.SimpleNamespace(
        _prepare_inputs=lambda *a, **k: None, _model_forward=lambda **k: None, execute_model=lambda *a, **k: None,
        shutdown=lambda: None, _dummy_run=lambda n, **k: seen.append((n, ring.graph_mode, ring.geometry)) or "out")
    session = types.SimpleNamespace(closed=False, capturing=True, run=types.SimpleNamespace(ring=ring))
    unwrap = compat.wrap_runner(runner, on_batch=None, on_forward=None, on_step_end=None, on_shutdown=None,
                                dummy_run=lambda: Session.on_dummy_run(session))
    assert runner._dummy_run(64, is_graph_capturing=True) == "out"
    assert runner._dummy_run(32) == "out"
    # only inside, restored after; the end-marker kernel launched once after the first (compiled at
    # start-up, not at the first served step: a step's armed flag is off there, so it exits)
    assert seen == [(64, True, (1, None)), "end kernel", (32, True, (1, None))] and ring.graph_mode is False
    unwrap()
    assert "_dummy_run" not in vars(runner)
    cpu = types.SimpleNamespace(null=False)                                # the CPU ring: untouched
    with Session.on_dummy_run(types.SimpleNamespace(closed=False, capturing=True, run=types.SimpleNamespace(ring=cpu))):
        assert vars(cpu) == {"null": False}


def test_next_layer_anchor_hands_the_last_layer_to_the_final_norm():
    """resid_post lives where vLLM materializes the residual stream's sum: the next layer's fused
    add+RMSNorm (output 1), the last layer's in the final norm; resid_pre in the layer's own, layer
    0's at its input; the plan's anchors spell it out."""
    from dmi.adapters.vllm.patch import layer_anchor, module_path
    from dmi.adapters.vllm.worker import _vllm_anchor
    from dmi.spec import builtin_spec_dir, load_arch_spec
    arch = load_arch_spec(builtin_spec_dir() / "qwen3.yaml")
    spec = arch.data["sites"]["resid_post"]["vllm"]
    assert module_path(spec["module"], 2) == "model.layers.3.input_layernorm"
    assert layer_anchor(spec, 2, 4) is spec and layer_anchor(spec, None, 4) is spec
    assert _vllm_anchor(arch, "resid_post", 2, 4) == {**spec, "module": "model.layers.3.input_layernorm",
                                                       "layout": ["token"]}
    last = _vllm_anchor(arch, "resid_post", 3, 4)
    assert last == {"module": "model.norm", "output": 1, "layout": ["token"]}
    assert _vllm_anchor(arch, "resid_mid", 3, 4)["module"] == "model.layers.3.post_attention_layernorm"
    # resid_pre: the layer's own fused add+RMSNorm, but layer 0's adds nothing (its input is the stream)
    assert _vllm_anchor(arch, "resid_pre", 2, 4)["module"] == "model.layers.2.input_layernorm"
    assert _vllm_anchor(arch, "resid_pre", 0, 4) == {"module": "model.layers.0", "input": "hidden_states",
                                                      "layout": ["token"]}


def test_cuda_graphs_on_reads_the_compilation_config():
    import enum
    import types

    from dmi.adapters.vllm.compat import cuda_graphs_on
    Mode = enum.Enum("CUDAGraphMode", "NONE PIECEWISE FULL_AND_PIECEWISE")
    cfg = lambda m: types.SimpleNamespace(compilation_config=types.SimpleNamespace(cudagraph_mode=m))  # noqa: E731
    assert not cuda_graphs_on(cfg(Mode.NONE)) and not cuda_graphs_on(cfg(None)) and not cuda_graphs_on(object())
    assert cuda_graphs_on(cfg(Mode.PIECEWISE)) and cuda_graphs_on(cfg(Mode.FULL_AND_PIECEWISE))


def test_request_check_wraps_validate_params_where_the_validator_builder_is_absent(monkeypatch):
    """0.25.1's InputProcessor has no _build_logits_processors_params_validator: dmi's check runs in
    _validate_params instead, before vLLM's own, and its refusal is a ValueError (HTTP 400)."""
    import sys
    import types

    from dmi.adapters.vllm import compat
    calls = []

    class InputProcessor:                       # the 0.25.1 shape
        def __init__(self):
            self.vllm_config = "cfg"

        def _validate_params(self, params, supported_tasks):
            calls.append(("vllm", params.extra_args))

    def make_validator(config):
        assert config == "cfg"

        def check(params):
            calls.append(("dmi", params.extra_args))
            if params.extra_args.get("dmi_capture") == "bad":
                raise RequestRefused("dmi: 'capture' must be true or false")
        return check
    mod = types.ModuleType(compat.INPUT_MODULE)
    mod.InputProcessor = InputProcessor
    monkeypatch.setitem(sys.modules, compat.INPUT_MODULE, mod)
    compat.wrap_request_validation(make_validator)
    compat.wrap_request_validation(make_validator)          # idempotent
    proc = InputProcessor()
    proc._validate_params(types.SimpleNamespace(extra_args=None), ())
    proc._validate_params(types.SimpleNamespace(extra_args={"dmi_capture": 0}), ())
    with pytest.raises(ValueError, match="must be true or false"):
        proc._validate_params(types.SimpleNamespace(extra_args={"dmi_capture": "bad"}), ())
    assert calls == [("vllm", None), ("dmi", {"dmi_capture": 0}), ("vllm", {"dmi_capture": 0}),
                     ("dmi", {"dmi_capture": "bad"})]


def test_a_step_larger_than_the_kernel_rings_control_block_is_refused_at_load():
    import types

    from dmi.adapters.vllm.worker import _check_step_tokens
    from dmi.errors import PolicyError
    from dmi.spec import Document
    hook = Document({"capture": [], "policy": {"max_step_tokens": 2048}}, "hooks.yaml",
                    {("policy", "max_step_tokens"): 7})
    config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_batched_tokens=8192))
    with pytest.raises(PolicyError, match="max_num_batched_tokens=8192.*max_step_tokens=2048") as e:
        _check_step_tokens(types.SimpleNamespace(ring=types.SimpleNamespace(max_rows=2048)), config, hook)
    assert e.value.line == 7 and "max_step_tokens: 8192" in str(e.value)
    _check_step_tokens(types.SimpleNamespace(ring=types.SimpleNamespace(max_rows=8192)), config, hook)
    _check_step_tokens(types.SimpleNamespace(ring=types.SimpleNamespace()), config, hook)     # the CPU ring: no bound


def test_hook_clock_splits_repeated_begins_and_times_gc_pauses():
    """Session.clock: the begin time of steps that repeated the last one apart from the others, and
    the process's garbage-collection pauses while the session is open (a pause stops every thread)."""
    import gc
    import time
    from dmi.adapters.vllm.worker import HookClock
    clock = HookClock()
    try:
        gc.collect()                           # before the first step: the engine's start-up, not counted
        assert clock.gc_summary()["gen2"]["count"] == 0
        for repeated, sleep in ((True, 0.002), (False, 0.006), (True, 0.002)):
            clock.steps += 1
            t0 = clock.now()
            time.sleep(sleep)
            clock.add("begin", t0, repeated=repeated)
        kinds = clock.begin_by_kind_us(2)
        assert 1500 < kinds["repeat"] < kinds["other"] and kinds["other"] > 5500, kinds
        held = [[i] for i in range(100_000)]   # objects for the full pass to walk (a measurable pause)
        gc.collect()                           # a full collection: generation 2
        del held
        summary = clock.gc_summary()
        assert summary["gen2"]["count"] >= 1 and summary["gen2"]["total_ms"] > 0, summary
    finally:
        clock.stop()
    before = clock.gc_summary()["gen2"]
    gc.collect()                               # after stop(): no longer counted
    after = clock.gc_summary()
    assert after["gen2"] == before and after["tracked"] > 0 and after["top_types"], after


def test_inspect_vllm_line_reports_step_kinds_captures_outside_graphs_and_thread_cpu():
    """`dmi inspect`'s vllm line: what the store's vllm attribute says about where a step's host time
    went (a CUDA ring's captures outside graphs by kind; kinds that never ran are left out)."""
    from dmi.store.inspect import vllm_line
    line = vllm_line({"steps": 10, "steps_repeated": 7, "host_us_per_step": {"wall": {"begin": 200.0}, "cpu": {"begin": 190.0}},
                       "begin_us_by_step_kind": {"repeat": 96.2, "other": 574.3},
                       "eager_captures": {"eager": {"count": 40, "us": 48.5}, "replay": {"count": 9, "us": 6.1},
                                          "capture": {"count": 0, "us": 0.0}},
                       "thread_cpu_s": {"drain": 0.763, "export": 0.324}})
    assert "7 of 10 steps repeating the last" in line and "begin 200 (190 CPU)" in line, line
    assert "begin µs: repeated steps 96.2, others 574.3" in line, line
    assert "captures outside graphs: eager 40 x 48.5 µs, replay 9 x 6.1 µs;" in line and "capture 0" not in line, line
    assert "drain thread 0.763 s CPU, export thread 0.324 s CPU" in line, line


def test_engine_requests_map_to_their_client_request():
    """vLLM 0.32's engine request ids: the unique suffix, `{k}_` for sample k of `n`, `-{i}` for
    prompt i of an OpenAI list request (a single prompt too): all map to the client request."""
    from dmi.adapters.vllm.compat import client_request_id
    assert client_request_id("cmpl-abc-0-1f2e3d4c") == "cmpl-abc"
    assert client_request_id("15_cmpl-abc-0-1f2e3d4c") == "cmpl-abc"
    assert client_request_id("cmpl-abc-12-1f2e3d4c") == "cmpl-abc"
    assert client_request_id("3_chatcmpl-xyz-1f2e3d4c") == "chatcmpl-xyz"
    assert client_request_id("7") == "7" and client_request_id("2_7-aaaaaaaa") == "7"    # LLM.generate's ids


def test_a_row_cap_counts_every_engine_request_of_a_client_request():
    """Sixteen samples of one request decoding side by side share its cap, on the general and the
    steady path; another client request has its own; a finished client request's count is kept."""
    table = RequestTable()
    sb = StepBuilder(table)
    cap = Want(None, 10)
    ids = [f"{k}_cmpl-a-0-0000000{k % 10}" for k in range(4)] + ["cmpl-b-0-12345678"]
    stored = collections.Counter()
    computed = [3] * 5
    for step in range(6):
        st, _, _ = sb.build(batch(ids, [1] * 5, computed, [3] * 5), 5, lambda r: cap, 1)
        stored.update(client_request_id(table.ids[r]) for r in st.request)
        computed = [c + 1 for c in computed]
    assert stored == {"cmpl-a": 10, "cmpl-b": 6}
    sb.build(batch(["cmpl-c-0-00000000"], [1], [3], [3], finished=ids), 1, lambda r: cap, 1)
    st, _, _ = sb.build(batch(["9_cmpl-a-0-00000009"], [4], [0], [4]), 4, lambda r: cap, 1)
    assert len(st.request) == 0                      # cmpl-a's cap was reached before its samples finished
