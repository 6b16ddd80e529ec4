"""dmi.plot and `dmi plot`: PNGs of the right size with something drawn; the logit lens equals a hand
computation from the model's weights; the researcher example runs end to end."""
from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch

import dmi
import dmi.plot
from dmi.cli import main
from dmi.models import build_tiny_model

pytest.importorskip("matplotlib")
import matplotlib.image  # noqa: E402

SPEC = {"capture": [{"sites": ["resid_post", "final_norm"]}, {"sites": ["attn.pattern"], "layers": [0, 1]}]}


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """A tiny-qwen3 capture of two prompts (in memory), the model and a store of the same run."""
    from dmi.models import tiny_tokenizer
    tok = tiny_tokenizer()
    enc = tok(["Hello world! How are you", "Paris"], return_tensors="pt", padding=True)
    model = build_tiny_model("tiny-qwen3", seed=0)
    store = tmp_path_factory.mktemp("plot") / "out.zarr"
    with torch.no_grad():
        for where in (None, store):
            with dmi.load(model, hook_spec=SPEC, store=where) as run:
                run.set_request_ids(["hello", "paris"])
                run.model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
            if where is None:
                tree = run.result()
    return {"tree": tree, "model": model, "tok": tok, "store": store}


def _check_png(path, fig):
    """The file is a PNG of the figure's size in pixels, and not one flat color."""
    img = matplotlib.image.imread(str(path))
    width, height = fig.get_size_inches() * dmi.plot.DPI
    assert img.shape[:2] == (round(height), round(width)), (img.shape, width, height)
    assert img[..., :3].std() > 0.01, "nothing drawn"


def test_pictures_are_written(captured, tmp_path):
    tree, tok = captured["tree"], captured["tok"]
    fig = dmi.plot.attention(tree, request="paris", layer=1, head=1, tokenizer=tok, out=tmp_path / "a.png")
    _check_png(tmp_path / "a.png", fig)
    fig = dmi.plot.resid_norms(tree, out=tmp_path / "n.png")
    _check_png(tmp_path / "n.png", fig)
    fig = dmi.plot.logit_lens(tree, captured["model"], request="hello", tokenizer=tok, out=tmp_path / "l.png")
    _check_png(tmp_path / "l.png", fig)


def test_attention_draws_the_stored_pattern(captured):
    tree = captured["tree"]
    fig = dmi.plot.attention(tree, request="paris", layer=0, head=0)
    drawn = np.ma.getdata(fig.axes[0].images[0].get_array())
    ds = tree["layers/attn/pattern"].to_dataset(inherit=False)
    rows = np.flatnonzero(ds.request.values.astype(object) == "paris")
    want = ds.pattern.sel(layer=0).isel(head=0).values[rows]
    np.testing.assert_array_equal(drawn, want[:, :drawn.shape[1]])
    assert drawn.shape == (len(rows), int(ds.position.values[rows].max()) + 1)


def test_logit_lens_equals_hand_computation(captured):
    tree, model = captured["tree"], captured["model"]
    lens = dmi.plot.lens_values(tree, model, request="hello", k=3)
    ds = tree["layers/resid_post"].to_dataset(inherit=False)
    rows = np.flatnonzero(ds.request.values.astype(object) == "hello")
    rows = rows[np.argsort(ds.position.values[rows])]
    norm, w_u = model.model.norm, model.lm_head.weight.detach()
    for layer in ds.layer.values.tolist():
        x = torch.from_numpy(ds.resid_post.sel(layer=layer).values[rows]).float()
        # RMSNorm by hand: x / sqrt(mean(x^2) + eps) * weight, then the unembedding
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.detach()
        probs = torch.softmax(normed @ w_u.T, dim=-1)
        top = torch.topk(probs, 3, dim=-1)
        np.testing.assert_array_equal(lens.top_id.sel(layer=layer).values, top.indices.numpy())
        np.testing.assert_allclose(lens.top_prob.sel(layer=layer).values, top.values.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(lens.position.values, np.sort(ds.position.values[rows]))


def test_token_labels_from_token_ids(captured):
    """A store with a token_id coordinate names the axes by the tokens' text; without, by positions."""
    tok = captured["tok"]
    ds = captured["tree"]["layers/attn/pattern"].to_dataset(inherit=False)
    rows, _ = dmi.plot.request_rows(ds, "paris", "test")
    rows = rows.drop_vars("token_id", errors="ignore")      # a store written without token ids
    assert dmi.plot.token_labels(rows) == {p: str(p) for p in rows.position.values.tolist()}
    ids = tok("Paris is a city in France and more")["input_ids"][: rows.sizes["token"]]
    rows = rows.assign_coords(token_id=("token", np.array(ids, np.int64)))
    labels = dmi.plot.token_labels(rows, tok)
    assert list(labels.values()) == [dmi.plot.printable(tok.decode([i])) for i in ids]
    assert dmi.plot.token_labels(rows) == {p: str(i) for p, i in zip(rows.position.values.tolist(), ids)}


def test_unknown_request_and_layer_are_named(captured):
    with pytest.raises(dmi.DmiError, match=r"request 'nope' is not in the capture \(requests: hello, paris\)"):
        dmi.plot.attention(captured["tree"], request="nope")
    with pytest.raises(dmi.DmiError, match=r"layer 2 is not captured \(layers: \[0, 1\]\)"):
        dmi.plot.attention(captured["tree"], layer=2)


def test_cli_plot(captured, tmp_path):
    store = str(captured["store"])
    for argv in (["attention", store, "--request", "paris", "--layer", "1", "--head", "0", "--tokenizer",
                  "tiny-qwen3"], ["resid-norms", store], ["logit-lens", store, "--model", "tiny-qwen3"]):
        out = tmp_path / f"{argv[0]}.png"
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["plot", *argv, "-o", str(out)]) == 0
        assert f"wrote {out}" in buf.getvalue()
        img = matplotlib.image.imread(str(out))
        assert img.shape[0] > 100 and img[..., :3].std() > 0.01
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["plot", "logit-lens", store, "-o", str(tmp_path / "x.png")]) == 2
    assert "Fix: pass --model" in err.getvalue()


def test_researcher_example_runs(tmp_path, capsys):
    from dmi.examples import researcher
    paths = researcher.main(str(tmp_path / "pictures"))
    assert [p.name for p in paths] == ["attention_fox_layer1_head0.png", "resid_norms.png", "logit_lens_capital.png"]
    for p in paths:
        assert matplotlib.image.imread(str(p))[..., :3].std() > 0.01
    assert "captured 6 steps" in capsys.readouterr().out
