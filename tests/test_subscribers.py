"""Live subscribers: each drained step's captures handed to a user's function on the export
thread, equal to what the unpatched model computes and to what the store holds."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import dmi
from conftest import model_pair
from dmi.zdtype import BF16
from storecheck import expected_rows

NEW_TOKENS = 4
SPEC = """
    capture:
      - sites: [resid_post, final_norm]
      - sites: [logits]
        tokens: last
    policy: {mode: full, ring_bytes: 8MiB}
"""


class Recorder:
    """A subscriber keeping every call's captures and the thread it ran on."""

    def __init__(self):
        self.calls: list[dict] = []
        self.threads: set[str] = set()

    def __call__(self, captures):
        self.threads.add(threading.current_thread().name)
        self.calls.append(captures)

    def rows(self, site: str, field: str = None):
        got = [c[site] for c in self.calls if site in c]
        if field is None:
            return np.concatenate([g.values[site.split(".")[-1]] for g in got])
        if field == "step":      # one a capture: the store repeats it on every row
            return np.concatenate([np.full(len(g.request), g.step) for g in got])
        return np.concatenate([getattr(g, field) for g in got])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subscriber_gets_every_step_equal_to_the_model_and_the_store(dtype, encoded, write_spec, tmp_path):
    model, ref = model_pair("qwen3")
    model, ref = model.to(dtype), ref.to(dtype)
    every, layer1 = Recorder(), Recorder()
    with torch.no_grad():
        want = ref.generate(**encoded, max_new_tokens=NEW_TOKENS, do_sample=False, output_hidden_states=True,
                            output_logits=True, return_dict_in_generate=True)
        with dmi.load(model, hook_spec=write_spec(SPEC), store=tmp_path / "o.zarr") as run:
            run.subscribe(every)
            sub = run.subscribe(layer1, sites=["layers.1.*"])
            got = run.model.generate(**encoded, max_new_tokens=NEW_TOKENS, do_sample=False)
            run.flush()
            assert sub.steps == NEW_TOKENS
            n_layers = len(run.plan.sites) - 2
    assert torch.equal(got, want.sequences)

    # one call a step, in order, on the export thread; layer1 saw only its site
    assert [sorted({c.step for c in call.values()}) for call in every.calls] == [[t] for t in range(NEW_TOKENS)]
    assert every.threads == layer1.threads and all(t.startswith("dmi-export-") for t in every.threads)
    assert [list(call) for call in layer1.calls] == [["layers.1.resid_post"]] * NEW_TOKENS

    # values: the unpatched model's hidden states (padding left out), bit for bit
    mask = encoded["attention_mask"].bool()
    hs = want.hidden_states
    for layer in range(n_layers - 1):        # the last layer's output is final_norm's input, not in hidden_states
        exp = expected_rows(hs, mask, lambda st, b, s: st[layer + 1][b, s].float().numpy())
        np.testing.assert_array_equal(every.rows(f"layers.{layer}.resid_post").astype(np.float32), exp)
    exp = expected_rows(hs, mask, lambda st, b, s: st[-1][b, s].float().numpy())
    np.testing.assert_array_equal(every.rows("final_norm").astype(np.float32), exp)
    np.testing.assert_array_equal(every.rows("logits").astype(np.float32), torch.cat(want.logits).float().numpy())
    assert every.rows("final_norm").dtype == (BF16 if dtype == torch.bfloat16 else np.float32)
    np.testing.assert_array_equal(layer1.rows("layers.1.resid_post"), every.rows("layers.1.resid_post"))

    # and exactly what the store holds, coordinates included
    tree = dmi.open(tmp_path / "o.zarr")
    ds = tree["layers/resid_post"].dataset
    for layer in range(n_layers):
        np.testing.assert_array_equal(every.rows(f"layers.{layer}.resid_post"),
                                      ds.resid_post.sel(layer=layer).values.astype(every.rows("final_norm").dtype))
    for field in ("request", "position", "step", "phase", "token_id"):
        np.testing.assert_array_equal(every.rows("layers.0.resid_post", field), ds[field].values)
        np.testing.assert_array_equal(every.rows("logits", field), tree["logits"].dataset[field].values)
    # each row's input token: the generated sequence's token at that position (after the left padding)
    pads = (~mask).sum(1).tolist()
    rows = zip(every.rows("layers.0.resid_post", "request").tolist(), every.rows("layers.0.resid_post", "position").tolist())
    batch = {f"r{b}": b for b in range(len(pads))}          # generate()'s rows' default request ids
    want_ids = [int(got[batch[r], pads[batch[r]] + p]) for r, p in rows]
    assert every.rows("layers.0.resid_post", "token_id").tolist() == want_ids


def test_a_failing_subscriber_reaches_the_caller(encoded, write_spec, tmp_path):
    model, _ = model_pair("qwen3")

    def probe(captures):
        if any(c.step == 1 for c in captures.values()):
            raise ValueError("probe out of range")

    run = dmi.load(model, hook_spec=write_spec(SPEC), store=tmp_path / "o.zarr")
    run.subscribe(probe, sites="final_norm")
    with torch.no_grad(), pytest.raises(dmi.CaptureError, match=r"subscriber .*probe failed on step 1: "
                                        r"ValueError: probe out of range"):
        run.model.generate(**encoded, max_new_tokens=NEW_TOKENS, do_sample=False)
        run.flush()
    with pytest.raises(dmi.CaptureError, match="probe failed on step 1"):
        run.close()
    tree = dmi.open(tmp_path / "o.zarr")      # the store closed consistent, marked as not clean
    assert tree.attrs["dmi_status"] == "failed"
    assert set(tree["final_norm"].dataset.step.values) >= {0, 1}


def test_subscribe_refuses_sites_not_captured_and_cancel_stops_calls(encoded, write_spec, tmp_path):
    model, _ = model_pair("qwen3")
    rec = Recorder()
    with dmi.load(model, hook_spec=write_spec(SPEC), store=tmp_path / "o.zarr") as run:
        with pytest.raises(dmi.SpecError, match=r"'attn.q' matches none of the captured sites "
                           r"\(final_norm, logits, resid_post\).*Fix: name a site the hook spec captures"):
            run.subscribe(rec, sites=["resid_post", "attn.q"])
        with pytest.raises(TypeError, match="not callable"):
            run.subscribe("resid_post")
        sub = run.subscribe(rec, sites="logits")
        with torch.no_grad():
            run.model.generate(**encoded, max_new_tokens=2, do_sample=False)
            run.flush()
            sub.cancel()
            run.model.generate(**encoded, max_new_tokens=2, do_sample=False)
    assert len(rec.calls) == 2 and sub.steps == 2
    with pytest.raises(dmi.CaptureError, match="closed"):
        run.subscribe(rec)


def test_a_slow_subscriber_under_best_effort_drops_and_counts_what_it_never_saw(encoded, write_spec, tmp_path):
    """A subscriber slower than the model holds host staging as a slow store does: under
    ``best_effort`` the ring then drops whole captures (never stalls), each one counted; the
    subscriber sees exactly the rows the store keeps, and stored + dropped = selected per site."""
    model, _ = model_pair("qwen3")
    spec = write_spec("""
        capture:
          - sites: [resid_post, final_norm]
        policy: {mode: best_effort, ring_bytes: 40KiB, host_bytes: 16KiB}
    """)
    seen, released = Recorder(), threading.Event()

    def slow(captures):
        released.wait(30)          # holds the first step's staging until generate() returned
        seen(captures)

    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr") as run:
        run.subscribe(slow)
        run.model.generate(**encoded, max_new_tokens=40, do_sample=False)     # never waits for the subscriber
        released.set()
        stats = run.stats()
    assert stats["dropped_captures"] > 0 and stats["stall_seconds"] == 0
    tree = dmi.open(tmp_path / "o.zarr")
    a = tree.attrs
    for site, n in a["rows_selected"].items():
        assert n == a["rows_stored"][site] + a["rows_dropped"][site] + a["rows_not_computed"][site], site
    assert a["rows_dropped"]["final_norm"] > 0
    fin = tree["final_norm"].dataset
    np.testing.assert_array_equal(seen.rows("final_norm"), fin.final_norm.values)
    np.testing.assert_array_equal(seen.rows("final_norm", "step"), fin.step.values)
    np.testing.assert_array_equal(seen.rows("final_norm", "position"), fin.position.values)
