"""dmi.load(..., store=None): an in-memory result with a store's layout, bounded by store.memory_bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dmi
from conftest import model_pair
from storecheck import expected_rows

NEW_TOKENS = 3
SPEC = {"capture": [{"sites": ["resid_post", "final_norm"]}, {"sites": ["logits"], "tokens": "last"}],
        "policy": {"ring_bytes": "8MiB"}}


def _names(tree) -> dict:
    return {node.path: sorted(list(node.dataset.data_vars) + list(node.dataset.coords)) for node in tree.subtree}


def test_memory_result_equals_reference_and_store(encoded, tmp_path):
    model, ref = model_pair("qwen3")
    with torch.no_grad():
        want = ref.generate(**encoded, max_new_tokens=NEW_TOKENS, do_sample=False, output_hidden_states=True,
                            return_dict_in_generate=True)
        with dmi.load(model, hook_spec=SPEC) as run:
            assert run.in_memory and "in memory" in repr(run)
            run.model.generate(**encoded, max_new_tokens=NEW_TOKENS, do_sample=False)
        tree = run.result()
        stats = run.stats()
    assert stats["steps"] == NEW_TOKENS and stats["dropped_captures"] == 0 and stats["store_error"] is None
    assert not run.exporter.tmp.exists(), "the temporary store is removed once the result is in memory"
    # in memory: every variable reads with its directory gone
    sizes = {(node.path, k): v.values.size for node in tree.subtree for k, v in node.dataset.variables.items()}
    assert sizes[("/layers/resid_post", "resid_post")] > 0
    assert tree.attrs["dmi_status"] == "closed"

    mask = encoded["attention_mask"].bool()
    hs = want.hidden_states
    resid = tree["layers/resid_post"].dataset.resid_post
    for layer in range(model.config.num_hidden_layers - 1):
        exp = expected_rows(hs, mask, lambda st, b, s: st[layer + 1][b, s].numpy())
        np.testing.assert_array_equal(resid.sel(layer=layer).values, exp)
    exp = expected_rows(hs, mask, lambda st, b, s: st[-1][b, s].numpy())
    np.testing.assert_array_equal(tree["final_norm"].dataset.final_norm.values, exp)

    # the same run into a directory store: the same groups, variables, coordinates and values
    model2, _ = model_pair("qwen3")
    with torch.no_grad(), dmi.load(model2, hook_spec=SPEC, store=tmp_path / "out.zarr") as run2:
        run2.model.generate(**encoded, max_new_tokens=NEW_TOKENS, do_sample=False)
    disk = dmi.open(tmp_path / "out.zarr")
    assert _names(tree) == _names(disk)
    for node in disk.subtree:
        got = tree[node.path].dataset
        for v in list(node.dataset.data_vars) + list(node.dataset.coords):
            a, b = got[v], node.dataset[v]
            assert a.dims == b.dims and a.dtype == b.dtype, (node.path, v)
            np.testing.assert_array_equal(a.values, b.values)
    assert run2.result().attrs["sites"] == tree.attrs["sites"]


def test_memory_budget_error_names_the_key(encoded):
    model, _ = model_pair("qwen3")
    spec = {**SPEC, "store": {"memory_bytes": "4KiB"}}
    run = dmi.load(model, hook_spec=spec)
    with pytest.raises(dmi.DmiError, match=r"store\.memory_bytes") as err:
        with torch.no_grad(), run:
            for _ in range(4):     # the failure reaches the model's thread at a later step or at close
                run.model.generate(**encoded, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert "over its budget of 4,096 bytes" in str(err.value)
    assert not run.exporter.tmp.exists()


def test_memory_budget_refused_past_host_memory(encoded):
    model, _ = model_pair("qwen3")
    with pytest.raises(dmi.SpecError, match=r"store\.memory_bytes.*more than this host's memory"):
        dmi.load(model, hook_spec={**SPEC, "store": {"memory_bytes": "1000TiB"}})


@pytest.mark.parametrize("section, key", [("policy", "drain"), ("store", "writer")])
def test_memory_result_refuses_a_writer_process(section, key):
    model, _ = model_pair("qwen3")
    with pytest.raises(dmi.SpecError, match=rf"{section}\.{key}: process writes a store from another process"):
        dmi.load(model, hook_spec={**SPEC, section: {key: "process"}})
