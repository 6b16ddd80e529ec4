"""dmi.load entry points, detaching, and attn.pattern without switching the model to eager."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import dmi
from dmi.models import build_tiny_model, tiny_config
from dmi.store.inspect import format_summary, summarize
from dmi.zdtype import BF16
from conftest import model_pair, patched_modules


def test_pattern_on_sdpa_model_equals_eager_output_attentions(encoded, write_spec, tmp_path):
    model, _ = model_pair("qwen3", attn="sdpa")
    eager, _ = model_pair("qwen3", attn="eager")
    spec = write_spec("capture: [{sites: [attn.pattern], layers: [0, 1], max_keys: 64}]\n")
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr") as run:
        run.model(**encoded)
        assert run.model.config._attn_implementation == "sdpa"     # the model was not switched to eager
        attentions = eager(**encoded, output_attentions=True).attentions   # [batch, head, q, k] per layer
    pattern = dmi.open(tmp_path / "o.zarr")["layers/attn/pattern"].dataset.pattern
    # layer 0 sees identical q and k in both models: bit-exact
    np.testing.assert_array_equal(pattern.sel(layer=0).values, _by_position(attentions[0], encoded))
    # layer 1's inputs differ by sdpa-vs-eager rounding of layer 0
    np.testing.assert_allclose(pattern.sel(layer=1).values, _by_position(attentions[1], encoded), atol=1e-5)


def _by_position(want, encoded):
    """[batch, head, q, k columns] -> rows of real tokens, keys re-indexed to positions 0..63."""
    mask = encoded["attention_mask"].bool()
    pad = (~mask).sum(1)
    exp = []
    for b in range(mask.shape[0]):
        for s in range(mask.shape[1]):
            if mask[b, s]:
                row = np.zeros((want.shape[1], 64), np.float32)
                cols = want[b, :, s, int(pad[b]):].numpy()
                row[:, : cols.shape[1]] = cols
                exp.append(row)
    return np.stack(exp)


def test_load_from_config_and_from_pretrained_dir(tokenizer, write_spec, tmp_path):
    spec = write_spec("capture: [{sites: [final_norm]}]\n")
    enc = tokenizer(["Hello world"], return_tensors="pt")
    with torch.no_grad(), dmi.load(tiny_config("llama3_1"), hook_spec=spec, store=tmp_path / "a.zarr") as run:
        run.model(**enc)
    assert dmi.open(tmp_path / "a.zarr").attrs["family"] == "llama3_1"

    saved = tmp_path / "saved"
    build_tiny_model("tiny-qwen3", seed=3).save_pretrained(saved)
    ref = build_tiny_model("tiny-qwen3", seed=3)
    with torch.no_grad(), dmi.load(str(saved), hook_spec=spec, store=tmp_path / "b.zarr", dtype=torch.float32) as run:
        out = run.model(**enc)
    with torch.no_grad():
        want = ref(**enc, output_hidden_states=True)
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=0)
    got = dmi.open(tmp_path / "b.zarr")["final_norm"].dataset.final_norm.values
    np.testing.assert_array_equal(got, want.hidden_states[-1][0].numpy())


def test_close_detaches_and_model_is_unchanged(encoded, write_spec, tmp_path):
    model, ref = model_pair("qwen3_moe")
    spec = write_spec("capture: [{sites: ['*']}]\n")
    classes = {m: type(m) for m in model.modules()}
    run = dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr")
    assert len(patched_modules(model)) > 10
    # a patched module is still what it was: its class's name, an instance of that class
    assert all(type(m).__name__ == cls.__name__ and isinstance(m, cls) for m, cls in classes.items())
    run.close()
    assert not patched_modules(model)
    assert all(type(m) is cls for m, cls in classes.items())
    with torch.no_grad():
        torch.testing.assert_close(model(**encoded).logits, ref(**encoded).logits, rtol=0, atol=0)
    # every site of the family was captured, and each group has rows
    tree = dmi.open(tmp_path / "o.zarr")
    assert tree.attrs["dmi_status"] == "closed" and tree.attrs["steps"] == 0


def test_a_module_with_a_forward_of_its_own_keeps_it(encoded, write_spec, tmp_path):
    """A module whose instance already has a forward (accelerate's offload hooks put one there)
    keeps calling it with dmi's sites around it, and has it back after close."""
    model, ref = model_pair("qwen3")
    layer = model.model.layers[1]
    calls = []

    def own_forward(*args, **kwargs):           # stands in for accelerate's hook
        calls.append(1)
        return type(layer).forward(layer, *args, **kwargs)

    layer.forward = own_forward
    spec = write_spec("capture: [{sites: [resid_pre, resid_post, attn.q], layers: [1]}]\n")
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr") as run:
        out = run.model(**encoded, output_hidden_states=True)
        assert calls and type(layer) is type(model.model.layers[0])     # bound on the instance, not by class
    with torch.no_grad():
        want = ref(**encoded, output_hidden_states=True)
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=0)
    # only the module's own forward is left (the helper counts any instance forward)
    assert layer.__dict__["forward"] is own_forward and patched_modules(model) == [layer]
    assert set(layer.__dict__) & {"_dmi_sites", "_dmi_prior_forward"} == set()
    tree = dmi.open(tmp_path / "o.zarr")
    valid = encoded["attention_mask"].bool().reshape(-1).numpy()
    for name, hidden in (("resid_pre", want.hidden_states[1]), ("resid_post", want.hidden_states[2])):
        got = tree[f"layers/{name}"].dataset[name].sel(layer=1).values
        np.testing.assert_array_equal(got, hidden.reshape(-1, hidden.shape[-1])[valid].numpy())


def test_a_model_an_open_run_patched_is_refused(write_spec, tmp_path):
    model, _ = model_pair("qwen3")
    spec = write_spec("capture: [{sites: [resid_post]}]\n")
    with dmi.load(model, hook_spec=spec, store=tmp_path / "a.zarr"):
        with pytest.raises(dmi.errors.DmiError, match=r"already patched by an open run .*a\.zarr.*Fix: close that run"):
            dmi.load(model, hook_spec=spec, store=tmp_path / "b.zarr")
        assert not (tmp_path / "b.zarr").exists()
    with dmi.load(model, hook_spec=spec, store=tmp_path / "b.zarr"):    # closed: loads again
        pass


def test_moe_ids_and_float32_weights_keep_their_dtype_in_bf16(encoded, write_spec, tmp_path):
    """Expert ids are stored as int32 and Mixtral's float32 routing weights as float32, even when
    the model runs in bfloat16 (a bf16 cast would round ids above 256 and the weights)."""
    import copy
    model = build_tiny_model("tiny-mixtral", dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    seen = {}
    ref.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, o: seen.update(w=o[1], ids=o[2]))
    spec = write_spec("capture: [{sites: [moe.topk_ids, moe.topk_weights], layers: [0]}]\n")
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr") as run:
        run.model(**encoded)
        ref(**encoded)
    tree = dmi.open(tmp_path / "o.zarr")
    valid = encoded["attention_mask"].bool().reshape(-1).numpy()
    ids = tree["layers/moe/topk_ids"].dataset.topk_ids.sel(layer=0)
    weights = tree["layers/moe/topk_weights"].dataset.topk_weights.sel(layer=0)
    assert ids.dtype == np.int32 and weights.dtype == np.float32 and seen["w"].dtype == torch.float32
    np.testing.assert_array_equal(ids.values, seen["ids"].numpy()[valid])
    np.testing.assert_array_equal(weights.values, seen["w"].numpy()[valid])


def test_a_failing_with_block_marks_the_store_failed(encoded, write_spec, tmp_path):
    model, _ = model_pair("qwen3")
    spec = write_spec("capture: [{sites: [final_norm]}]\n")
    try:
        with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr") as run:
            run.model(**encoded)
            raise KeyError("user code failed")
    except KeyError:
        pass
    tree = dmi.open(tmp_path / "o.zarr")
    assert tree.attrs["dmi_status"] == "failed" and "user code failed" in tree.attrs["error"]
    # what was captured before the failure is all there
    assert tree["final_norm"].dataset.sizes["token"] == int(encoded["attention_mask"].sum())


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_bf16_is_stored_as_bf16_bits_or_widened_to_float32(encoded, write_spec, tmp_path, writer):
    """A bfloat16 model's floats are stored as the Zarr bfloat16 data type (store.dtype native,
    two bytes a value) bit for bit, or widened exactly to float32 (store.dtype float32); both equal
    the unpatched model's own hidden states."""
    model = build_tiny_model("tiny-qwen3", dtype=torch.bfloat16)
    ref = build_tiny_model("tiny-qwen3", dtype=torch.bfloat16)
    with torch.no_grad():
        want = ref(**encoded, output_hidden_states=True).hidden_states
    valid = encoded["attention_mask"].bool().reshape(-1).numpy()
    n = model.config.num_hidden_layers
    for dtype, stored in (("native", BF16), ("float32", np.dtype(np.float32))):
        spec = write_spec(f"capture: [{{sites: [resid_post, final_norm]}}]\n"
                          f"store: {{dtype: {dtype}, writer: {writer}, compression: none}}\n")
        store = tmp_path / f"{dtype}.zarr"
        with torch.no_grad(), dmi.load(model, hook_spec=spec, store=store) as run:
            run.model(**encoded)
        meta = json.loads((store / "final_norm" / "final_norm" / "zarr.json").read_text())
        assert meta["data_type"] == ("bfloat16" if dtype == "native" else "float32")
        tree = dmi.open(store, dtype=None)                                 # as stored
        resid = tree["layers/resid_post"].dataset.resid_post.values       # [token, layer, hidden]
        norm = tree["final_norm"].dataset.final_norm.values
        assert resid.dtype == stored and norm.dtype == stored
        # by default dmi.open reads them as float32 (exactly), which numpy, xarray and torch compute with
        for chunks in (None, {}):
            f32 = dmi.open(store, chunks=chunks)["layers/resid_post"].dataset.resid_post
            assert f32.dtype == np.float32 and (f32.chunks is None) == (chunks is None)
            np.testing.assert_array_equal(f32.values, resid.astype(np.float32))
            np.testing.assert_allclose(f32.mean("token").values, resid.astype(np.float64).mean(0), rtol=1e-5)
            assert torch.from_numpy(f32.values).dtype == torch.float32
        # dmi inspect tells a reader what opens bf16 arrays
        assert ("import dmi`" in format_summary(summarize(store))) == (dtype == "native")
        for layer in range(n - 1):     # HF's last hidden state is after the final norm
            expect = want[layer + 1].reshape(-1, want[0].shape[-1])[torch.from_numpy(valid)]
            _equal_bits(resid[:, layer], expect)
        _equal_bits(norm, want[-1].reshape(-1, want[0].shape[-1])[torch.from_numpy(valid)])
    # bf16 halves the bytes of a row: a chunk of store.chunk_bytes holds twice the rows
    (f32_rows, f32_bytes), (bf16_rows, bf16_bytes) = (_chunks(tmp_path / f"{d}.zarr") for d in ("float32", "native"))
    assert bf16_rows == 2 * f32_rows and bf16_bytes / bf16_rows == f32_bytes / f32_rows / 2


def _equal_bits(got: np.ndarray, expect: torch.Tensor) -> None:
    if got.dtype == BF16:
        np.testing.assert_array_equal(got.view(np.uint16), expect.view(torch.int16).numpy().view(np.uint16))
    else:
        np.testing.assert_array_equal(got, expect.float().numpy())


def _chunks(store) -> tuple[int, int]:
    """(rows per chunk, bytes of a chunk file) of resid_post (compression: none)."""
    arr = store / "layers" / "resid_post" / "resid_post"
    rows = json.loads((arr / "zarr.json").read_text())["chunk_grid"]["configuration"]["chunk_shape"][0]
    files = [f for f in (arr / "c").rglob("*") if f.is_file()]
    assert files and len({f.stat().st_size for f in files}) == 1
    return rows, files[0].stat().st_size


def test_a_bf16_store_resumes_bit_exact(encoded, write_spec, tmp_path):
    """Resume reads the open bfloat16 chunk back and appends after it: every row of both runs
    equals the unpatched model's."""
    model = build_tiny_model("tiny-qwen3", dtype=torch.bfloat16)
    ref = build_tiny_model("tiny-qwen3", dtype=torch.bfloat16)
    spec = write_spec("capture: [{sites: [final_norm]}]\nstore: {chunk_bytes: 4KiB}\n")
    valid = torch.from_numpy(encoded["attention_mask"].bool().reshape(-1).numpy())
    want = []
    for resume, ids in ((False, encoded["input_ids"]), (True, encoded["input_ids"].flip(1))):
        batch = dict(encoded, input_ids=ids)
        with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "s.zarr", resume=resume) as run:
            run.model(**batch)
            hidden = ref(**batch, output_hidden_states=True).hidden_states[-1]
        want.append(hidden.reshape(-1, hidden.shape[-1])[valid])
    got = dmi.open(tmp_path / "s.zarr", dtype=None)["final_norm"].dataset.final_norm.values   # as stored
    assert got.dtype == BF16 and got.shape[0] == 2 * int(valid.sum())
    _equal_bits(got, torch.cat(want))
