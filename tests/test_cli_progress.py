"""`dmi capture`: -q silences every progress bar, the bar moves with each generated token, and a
missing local model path says "no such directory"."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dmi.cli import PromptProgress, main
from dmi.models import build_tiny_model, load_failure, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]


def test_bar_moves_with_every_decode_step():
    """Two prompts in one batch of four new tokens: four updates of half a prompt each."""
    tok = tiny_tokenizer()
    model = build_tiny_model("tiny-qwen3")
    enc = tok(["Hello world", "Paris"], return_tensors="pt", padding=True)
    bar = PromptProgress(total=2, max_new_tokens=4, disable=False)
    seen = []
    update = bar.bar.update
    bar.bar.update = lambda k: (seen.append(k), update(k))      # tqdm's own counting, observed
    bar.batch(2)
    with torch.no_grad():
        model.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id,
                       logits_processor=bar.processors())
    assert seen == [0.5, 0.5, 0.5, 0.5] and bar.bar.n == 2.0
    bar.done(2)
    assert bar.bar.n == 2
    bar.close()


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("model") / "tiny"
    build_tiny_model("tiny-qwen3").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.mark.parametrize("quiet", [False, True])
def test_quiet_silences_every_bar(local_model, tmp_path, quiet):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "dmi.cli", "capture", "--model", str(local_model), "--out", str(tmp_path / "o.zarr"),
           "--max-new-tokens", "2"] + (["-q"] if quiet else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    bars = [s for s in ("Loading weights", "prompts [", "%|") if s in r.stderr]
    if quiet:
        assert bars == [], r.stderr
    else:      # the bars -q silences are there without it: transformers' weight loading and the capture's
        assert bars == ["Loading weights", "prompts [", "%|"], r.stderr


def test_missing_local_model_path_says_no_such_directory(tmp_path, capsys, monkeypatch):
    import transformers

    def looked_up(*args, **kwargs):
        raise AssertionError("a hub lookup for a path into a local directory")
    for cls in (transformers.AutoTokenizer, transformers.AutoConfig, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", looked_up)
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["capture", "--model", "models/my-model", "--out", "o.zarr", "-q"]) == 2
    err = capsys.readouterr().err
    assert "no such directory: 'models/my-model' (the local directory 'models/' has no 'my-model')" in err, err


def test_failed_hub_load_says_no_such_directory_first():
    said = load_failure("someone/missing-model", OSError("We couldn't connect to 'https://huggingface.co'.\nmore"))
    assert said == "no such directory: 'someone/missing-model', and as a hub id: We couldn't connect to " \
                   "'https://huggingface.co'"
    assert load_failure(".", ValueError("bad config")) == "bad config"
