"""Reading a store: the token_id coordinate (HF generate and forward), dmi.request (lazy, with and
without dask), and dmi.open's float dtype (bfloat16 read as float32, lazily)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import dmi
from conftest import model_pair
from dmi.zdtype import BF16

PAD = 0          # the tiny tokenizer's <pad>


def _seq_index(mask: torch.Tensor, b: int, position: int) -> int:
    """Column of request ``b``'s ``position`` in the left-padded [batch, columns] grid."""
    return int((~mask[b]).sum()) + position


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_token_id_is_each_rows_input_id(encoded, write_spec, tmp_path, writer):
    """Every stored row's token_id is the input id of that (request, position): for generate() the
    prompt, then each generated token fed back (a finished request's filler rows carry the pad id),
    and for a plain forward the input_ids; the logits of the last token each step too."""
    model, ref = model_pair("qwen3")
    with torch.no_grad():
        first = ref.generate(**encoded, max_new_tokens=1, do_sample=False, pad_token_id=PAD)[:, -1]
    # request r0's first generated token ends it (eos): generate() goes on feeding it the pad id
    eos = int(first[0])
    assert (first[1:] != eos).any(), "every request would stop at once: no filler rows to check"
    spec = write_spec(f"capture: [{{sites: [final_norm]}}, {{sites: [logits], tokens: last}}]\n"
                      f"store: {{writer: {writer}}}\n")
    store = tmp_path / "o.zarr"
    mask = encoded["attention_mask"].bool()
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=store) as run:
        seqs = run.model.generate(**encoded, max_new_tokens=4, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
        run.set_request_ids([f"f{b}" for b in range(len(mask))])
        run.model(**encoded)
    tree = dmi.open(store)
    for group in ("final_norm", "logits"):
        ds = tree[group].dataset
        assert ds.token_id.dtype == np.int64 and ds.token_id.dims == ("token",)
        for r, p, t in zip(ds.request.values, ds.position.values, ds.token_id.values):
            b, grid = int(r[1:]), (seqs if r[0] == "r" else encoded["input_ids"])
            assert t == int(grid[b, _seq_index(mask, b, int(p))]), (group, r, p)
    ds = tree["final_norm"].dataset
    r0 = ds.token_id.values[(ds.request.values == "r0") & (ds.phase.values == "decode")]
    assert r0[0] == eos and (r0[1:] == PAD).all() and len(r0) > 1       # eos fed once, then fillers
    assert "token_id" in ds.final_norm.coords


def test_request_selects_rows_lazily(encoded, write_spec, tmp_path):
    """dmi.request picks one request's rows in position order from a DataTree, a Dataset or a
    DataArray; with chunks={} everything stays dask (a boolean mask would be refused there)."""
    model, _ = model_pair("qwen3")
    spec = write_spec("capture: [{sites: [resid_post], layers: [0, 1]}, {sites: [final_norm]}]\n")
    store = tmp_path / "o.zarr"
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=store) as run:
        run.model.generate(**encoded, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    plain = dmi.open(store)["layers/resid_post"].dataset
    for chunks in (None, {}):
        tree = dmi.open(store, chunks=chunks)
        got = dmi.request(tree, "r1")
        ds = got["layers/resid_post"].dataset
        assert (ds.resid_post.chunks is not None) == (chunks is not None)      # still lazy: dask stays dask
        want = np.flatnonzero(plain.request.values == "r1")
        want = want[np.argsort(plain.position.values[want], kind="stable")]
        assert set(ds.request.values) == {"r1"} and list(ds.position.values) == sorted(ds.position.values)
        np.testing.assert_array_equal(ds.resid_post.values, plain.resid_post.values[want])
        np.testing.assert_array_equal(got["final_norm"].dataset.position.values, ds.position.values)
        grp = tree["layers/resid_post"].dataset
        np.testing.assert_array_equal(dmi.request(grp, "r1").resid_post.values, ds.resid_post.values)
        one = dmi.request(grp.resid_post.sel(layer=1), "r1")
        np.testing.assert_array_equal(one.values, plain.resid_post.sel(layer=1).values[want])
        with pytest.raises(KeyError, match="'nope' has no rows here; the requests stored are 'r0', 'r1'"):
            dmi.request(tree, "nope")
    with pytest.raises(TypeError, match="a 'token' dim"):
        dmi.request(np.zeros(3), "r0")


def _bf16_store(path, values: np.ndarray) -> None:
    g = zarr.open_group(str(path), mode="w", zarr_format=3)
    x = g.create_array("resid", shape=values.shape, chunks=(2, values.shape[1]), dtype=BF16,
                       dimension_names=["token", "hidden"], fill_value=float("nan"))
    x[...] = values
    x.attrs["coordinates"] = "request position"
    g.create_array("request", shape=(len(values),), dtype=str, dimension_names=["token"])[...] = \
        np.array(["a", "b"] * (len(values) // 2))
    g.create_array("position", shape=(len(values),), dtype="int64", dimension_names=["token"])[...] = \
        np.arange(len(values)) // 2


def test_open_reads_bfloat16_as_float32_lazily(tmp_path):
    """bfloat16 arrays come as float32 (exact) unless dtype=None; the cast happens as values are
    read, not at open (chunk files removed after open are read as missing: the fill value)."""
    values = (np.arange(24, dtype=np.float32).reshape(6, 4) / 7).astype(BF16)
    store = tmp_path / "bf.zarr"
    _bf16_store(store, values)
    raw = dmi.open(store, dtype=None)["resid"]
    assert raw.dtype == BF16
    for chunks in (None, {}):
        x = dmi.open(store, chunks=chunks)["resid"]
        assert x.dtype == np.float32 and (x.chunks is None) == (chunks is None)
        np.testing.assert_array_equal(x.values, values.astype(np.float32))
        np.testing.assert_allclose(x.mean("token").values, values.astype(np.float64).mean(0), rtol=1e-6)
        assert torch.from_numpy(dmi.request(x.to_dataset(), "b").resid.values).dtype == torch.float32
    x = dmi.open(store)["resid"]            # lazy: nothing read yet
    for f in (store / "resid" / "c").rglob("*"):
        if f.is_file():
            f.unlink()
    assert np.isnan(x.values).all()
    with pytest.raises(dmi.StoreError, match="not a float dtype"):
        dmi.open(store, dtype="int32")


def test_open_store_cut_mid_commit_reads_its_committed_steps(encoded, write_spec, tmp_path):
    """A writer killed while a commit grew its arrays one at a time leaves a group's value column
    ahead of its ``request`` coordinate. dmi.open reads such an open store as of its last commit:
    every array cut to the committed rows, values equal to those of the whole store."""
    import json
    model, _ = model_pair("qwen3")
    spec = write_spec("capture: [{sites: [resid_post], layers: [0, 1]}, {sites: [final_norm]}]\n")
    store = tmp_path / "o.zarr"
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=store) as run:
        run.model.generate(**encoded, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    whole = dmi.open(store)
    total = whole["final_norm"].dataset.sizes["token"]
    committed = total // 2
    # the commit that grew final_norm from `committed` rows to `total` stopped after its value
    # column: the request coordinate and the root's dmi_committed still say `committed`
    root = json.loads((store / "zarr.json").read_text())
    rows = root["attributes"]["dmi_committed"]["rows"]
    rows["final_norm"] = committed
    root["attributes"]["dmi_status"] = "open"
    root.pop("consolidated_metadata", None)
    (store / "zarr.json").write_text(json.dumps(root))
    meta_path = store / "final_norm" / "request" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"][0] = committed
    meta_path.write_text(json.dumps(meta))
    cut = dmi.open(store)
    ds, ref = cut["final_norm"].dataset, whole["final_norm"].dataset
    assert ds.sizes["token"] == committed and ds.final_norm.shape[0] == committed
    np.testing.assert_array_equal(ds.final_norm.values, ref.final_norm.values[:committed])
    np.testing.assert_array_equal(ds.request.values, ref.request.values[:committed])
    assert cut["layers/resid_post"].dataset.sizes["token"] == rows["layers/resid_post"]


def test_commits_rewrite_the_root_keeping_every_attribute(encoded, tmp_path):
    """Each commit rewrites the root's zarr.json with its new marker (dmi encodes only what changed):
    mid-run and after close, zarr reads the hook spec as given (steering vectors to the last bit)
    and the marker of the last commit."""
    import json
    model, _ = model_pair("qwen3")
    vec = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(3)).tolist()
    spec = {"capture": [{"sites": ["final_norm"]}],
            "interventions": [{"name": "steer", "site": "resid_post", "layers": [0], "kind": "add", "vector": vec,
                               "enabled": False}]}
    store = tmp_path / "o.zarr"
    marks = []
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=store) as run:
        for _ in range(2):
            run.model.generate(**encoded, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
            run.flush()
            attrs = zarr.open_group(store, mode="r").attrs.asdict()
            assert attrs["dmi_status"] == "open" and attrs["hook_spec"]["interventions"][0]["vector"] == vec
            assert attrs["dmi_committed"]["step"] == run.stats()["committed_step"]
            marks.append(attrs["dmi_committed"]["step"])
    assert marks[0] < marks[1]
    doc = json.loads((store / "zarr.json").read_text())
    assert doc["zarr_format"] == 3 and doc["node_type"] == "group" and doc["consolidated_metadata"] is not None
    tree = dmi.open(store)
    assert tree.attrs["dmi_status"] == "closed" and tree.attrs["hook_spec"]["interventions"][0]["vector"] == vec
    assert tree.attrs["dmi_committed"]["step"] == marks[1] and tree.attrs["steps"] == marks[1] + 1
