"""policy.drain: process — the writer's child drains the ring itself (payload and meta ring in
shared memory on CPU; CUDA IPC on GPUs: tests/gpu). It stores what the in-process drain stores,
frees ring space for backpressure and best_effort alike (a killed child: tests/test_writer.py)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import dmi
from conftest import model_pair
from storecheck import assert_stores_equal
from test_writer import SPEC


def _capture(encoded, store, drain: str, policy: dict):
    model, ref = model_pair("qwen3")
    spec = SPEC | {"policy": policy | {"drain": drain}}
    with torch.no_grad():
        with dmi.load(model, hook_spec=spec, store=store) as run:
            outs = [run.model.generate(**encoded, max_new_tokens=n, do_sample=False) for n in (6, 3)]
            if drain == "process":      # the child drains: this process's drain thread copied nothing
                assert run.threads.remote and run.ring.share is not None and run.exporter._proc.poll() is None
        want = [ref.generate(**encoded, max_new_tokens=n, do_sample=False) for n in (6, 3)]
        hidden = ref(**encoded, output_hidden_states=True).hidden_states[-1]    # (after the final norm)
    assert all(torch.equal(a, b) for a, b in zip(outs, want)), "patched model generated different tokens"
    return run.stats(), hidden


@pytest.mark.parametrize("policy", [
    {"mode": "full", "ring_bytes": "8MiB"},
    # a ring far smaller than the run: every few steps wait for the child to free space
    {"mode": "full", "ring_bytes": "96KiB", "host_bytes": "48KiB", "meta_records": 64}])
def test_drain_process_stores_what_the_drain_thread_stores(tmp_path, encoded, policy, shared_files_made):
    (thread, _), (process, hidden) = (_capture(encoded, tmp_path / f"{d}.zarr", d, policy) for d in ("thread", "process"))
    assert process["dropped_captures"] == thread["dropped_captures"] == 0
    for key in ("steps", "records", "bytes_captured", "bytes_drained", "not_run"):
        assert process[key] == thread[key], key
    assert assert_stores_equal(tmp_path / "thread.zarr", tmp_path / "process.zarr") > 10
    a, b = (zarr.open_group(str(tmp_path / f"{d}.zarr"), mode="r") for d in ("thread", "process"))
    timing = {"stall_seconds", "stall_bandwidth_seconds"}
    skip = {"dmi_writer", "created", "store_bytes", "hook_spec", "policy", "sized_automatically"} | timing
    assert {k: v for k, v in b.attrs.asdict().items() if k not in skip} == \
        {k: v for k, v in a.attrs.asdict().items() if k not in skip}
    assert b.attrs["policy"] == a.attrs["policy"] | {"drain": "process"}
    # the thread run's writer was left to dmi; policy.drain: process decides the other's
    assert a.attrs["sized_automatically"]["store.writer"]["value"] == "thread"
    assert b.attrs["sized_automatically"] == {}
    assert b.attrs["dmi_status"] == "closed" and b.attrs["dmi_writer"]["pid"] != os.getpid()
    # and against the unpatched model itself: the first prefill step's final_norm rows
    final = dmi.open(tmp_path / "process.zarr")["final_norm"].dataset
    first = final.step.values == 0
    mask = encoded["attention_mask"].bool()
    # (generate()'s prefill and a plain forward differ in the last ulp; bit-equality is the thread store's, above)
    np.testing.assert_allclose(final["final_norm"].values[first], hidden[mask].numpy(), rtol=0, atol=1e-5)
    rings = [p for p in shared_files_made if Path(p).name.startswith("dmi-ring-")]
    assert rings and not any(Path(p).exists() for p in rings), f"the ring's shared file outlived the run: {rings}"


def test_best_effort_with_a_drain_process_accounts_every_row(tmp_path, encoded):
    """A ring too small for the run under best_effort: the child frees space as it drains, what
    does not fit is dropped whole and recorded; stored + dropped + not computed = selected, and
    every stored row equals the in-process drain's row for the same step and token."""
    policy = {"mode": "best_effort", "ring_bytes": "40KiB", "meta_records": 32}
    (thread, _), (process, _) = (_capture(encoded, tmp_path / f"{d}.zarr", d, policy if d == "process" else
                                          {"mode": "full"}) for d in ("thread", "process"))
    tree, ref = dmi.open(tmp_path / "process.zarr"), dmi.open(tmp_path / "thread.zarr")
    a = tree.attrs
    assert process["dropped_captures"] > 0 and thread["dropped_captures"] == 0
    for site in a["rows_selected"]:
        assert a["rows_stored"][site] + a["rows_dropped"][site] + a["rows_not_computed"][site] == \
            a["rows_selected"][site] == ref.attrs["rows_selected"][site], site
    x, y = tree["layers/resid_post"].dataset, ref["layers/resid_post"].dataset
    key = lambda d: list(zip(d.step.values.tolist(), d.request.values.tolist(), d.position.values.tolist()))
    where = {k: i for i, k in enumerate(key(y))}
    rows = [where[k] for k in key(x)]
    assert rows, "nothing stored"
    got, want = x["resid_post"].values, y["resid_post"].values[rows]
    held = ~np.isnan(got)               # (a layer whose capture was dropped is NaN in its token's row)
    assert held.any() and not np.isnan(want).any()
    np.testing.assert_array_equal(got[held], want[held])


def test_drain_process_refusals(tmp_path, write_spec):
    """Each combination it cannot serve is refused with the key and the fix."""
    path = write_spec("""\
        capture:
          - sites: [final_norm]
        store:
          writer: thread
        policy:
          drain: process
        """)
    with pytest.raises(dmi.SpecError, match=r"hooks\.yaml:4: store\.writer: store\.writer: thread cannot go with "
                                            r"policy\.drain: process.*Fix: remove store\.writer"):
        dmi.load("tiny-qwen3", hook_spec=path, store=tmp_path / "a.zarr")
    spec = {"capture": [{"sites": ["final_norm"]}], "policy": {"drain": "process"}}
    with dmi.load("tiny-qwen3", hook_spec=spec, store=tmp_path / "b.zarr") as run:
        with pytest.raises(dmi.CaptureError, match=r"policy\.drain: process drains the ring in another process.*"
                                                   r"Fix: use policy\.drain: thread"):
            run.subscribe(lambda captures: None)
    from dmi.errors import SpecError
    from dmi.models import build_tiny_model
    from dmi.plan import build_plan
    from dmi.run import Run
    from dmi.spec import builtin_spec_dir, load_arch_spec, load_hook_spec
    model = build_tiny_model("tiny-qwen3")
    plan = build_plan(load_arch_spec(builtin_spec_dir() / "qwen3.yaml"), load_hook_spec(spec), model.config,
                      model_dtype_itemsize=4)
    with pytest.raises(SpecError, match=r"policy\.drain: process is not supported with tensor parallelism.*Fix:"):
        Run(model, plan, str(tmp_path / "c.zarr"), tp=object())
