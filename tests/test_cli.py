"""The ``dmi`` command line: capture -> inspect round trip, specs list/validate, bad input (exit 2)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import zarr

import dmi
from dmi.cli import main, read_prompts, UsageError
from dmi.examples import example_path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [{"id": "alpha", "prompt": "Hello world! How are you"},
           {"prompt": "The quick brown fox jumps over the lazy dog"},       # default id: p1
           {"id": "gamma", "prompt": "Paris"}]
IDS = ["alpha", "p1", "gamma"]


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def _one_error_line(err: str) -> str:
    """Bad input: exactly one 'dmi: error: ...' line first, never a traceback."""
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and lines[0].startswith("dmi: error: "), err
    assert all(ln.startswith("dmi: note: ") for ln in lines[1:]), err
    return lines[0]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """One capture with the packaged example hook spec: 3 prompts, batches of 2, 3 new tokens."""
    d = tmp_path_factory.mktemp("cli")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:2]) + "\n" + json.dumps(PROMPTS[2]) + "\n")
    store = d / "out.zarr"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["capture", "--model", "tiny-qwen3", "--prompts", str(prompts), "--out", str(store),
                   "--max-new-tokens", "3", "--batch-size", "2"])
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(), "store": store, "dir": d}


# --- capture + inspect -------------------------------------------------------------------------

def test_capture_writes_store_with_request_ids(captured):
    assert captured["rc"] == 0, captured["stderr"]
    root = zarr.open_group(str(captured["store"]), mode="r")
    assert root.attrs["dmi_status"] == "closed"
    assert root.attrs["model"]["name_or_path"] == "tiny-qwen3"
    for group in ("layers/resid_post", "final_norm", "logits", "layers/attn/pattern"):
        req = np.asarray(root[f"{group}/request"][:]).astype(object)
        assert list(dict.fromkeys(req)) == IDS, group
    # logits: last token of each request in each of the 3 steps of each of the 2 batches
    assert root["logits/request"].shape[0] == 3 * len(IDS)
    tree = dmi.open(captured["store"])          # the store opens as a whole with xarray
    assert tree["layers/resid_post"].ds.sizes["layer"] == 3


def test_capture_records_texts_generation_seed_and_start(captured, tmp_path):
    """The store's root attributes say what the run generated: each request's prompt and generated
    text (equal to the same model's own generate(), decoded), the generation arguments, the seed and
    the start time; --resume adds its run and its requests' texts to them."""
    import datetime

    import torch

    from dmi.models import build_tiny_model, tiny_tokenizer
    attrs = dmi.open(captured["store"]).attrs
    (run,) = attrs["cli"]
    assert run["model"] == "tiny-qwen3" and run["seed"] == 0 and run["requests"] == IDS and run["batch_size"] == 2
    tok = tiny_tokenizer()
    assert run["generation"] == {"max_new_tokens": 3, "do_sample": False, "pad_token_id": tok.pad_token_id,
                                 "eos_token_id": tok.eos_token_id}
    started = datetime.datetime.fromisoformat(run["started"])
    assert started.utcoffset() == datetime.timedelta(0) and started <= datetime.datetime.now(datetime.timezone.utc)
    model = build_tiny_model("tiny-qwen3", seed=0)
    texts = [p["prompt"] for p in PROMPTS]
    want = {}
    for i in range(0, 3, 2):            # the CLI's batches of 2
        enc = tok(texts[i:i + 2], return_tensors="pt", padding=True)
        with torch.no_grad():
            seqs = model.generate(**enc, **run["generation"])
        for rid, ids in zip(IDS[i:i + 2], seqs[:, enc["input_ids"].shape[1]:]):
            want[rid] = tok.decode(ids, skip_special_tokens=True)
    assert attrs["texts"] == {rid: {"prompt": t, "generated": want[rid]} for rid, t in zip(IDS, texts)}
    assert all(want.values())

    import shutil
    store = tmp_path / "out.zarr"
    shutil.copytree(captured["store"], store)
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"id": "delta", "prompt": "One more"}) + "\n")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["capture", "--resume", "--prompts", str(more), "--out", str(store), "--max-new-tokens", "2",
                     "--seed", "0", "-q"]) == 0
    attrs = dmi.open(store).attrs
    assert [r["requests"] for r in attrs["cli"]] == [IDS, ["delta"]]
    assert attrs["cli"][1]["generation"]["max_new_tokens"] == 2
    assert list(attrs["texts"]) == IDS + ["delta"] and attrs["texts"]["delta"]["prompt"] == "One more"


def test_capture_prints_summary_and_progress(captured):
    out = captured["stdout"]
    assert "captured 3 prompt(s)" in out
    assert "layers/resid_post" in out and "logits" in out
    assert "requests  3: alpha, p1, gamma" in out
    assert "prompt" in captured["stderr"]         # the tqdm bar goes to stderr
    assert "Traceback" not in captured["stderr"]


def test_inspect_text(captured, capsys):
    assert main(["inspect", str(captured["store"])]) == 0
    out = capsys.readouterr().out
    for text in ("tiny-qwen3", "family    qwen3", "status    closed", "requests  3: alpha, p1, gamma",
                 "layers/resid_post", "layers/attn/pattern", "final_norm", "topk_indices", "drops     0 captures",
                 "stall", "steps     6"):
        assert text in out, text


def test_inspect_json(captured, capsys):
    assert main(["inspect", str(captured["store"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["status"] == "closed" and info["family"] == "qwen3" and info["steps"] == 6
    assert info["requests"] == {"count": 3, "first": IDS}
    sites = {s["group"]: s for s in info["sites"]}
    assert set(sites) == {"layers/resid_post", "layers/attn/pattern", "final_norm", "logits"}
    assert sites["layers/resid_post"]["layers"] == [0, 1, 2]
    assert sites["layers/attn/pattern"]["layers"] == [0, 1]
    assert sites["logits"]["tokens"] == 9
    (resid,) = sites["layers/resid_post"]["arrays"]
    assert resid["dims"] == ["token", "layer", "hidden"] and resid["dtype"] == "float32"
    assert info["total_bytes"] >= sum(s["bytes"] for s in info["sites"]) > 0   # + the drops group's arrays
    assert info["drops"]["count"] == 0 and info["drops"]["bytes"] == 0


def test_inspect_through_subprocess(captured):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "dmi.cli", "inspect", str(captured["store"]), "--json"],
                          capture_output=True, text=True, cwd=captured["dir"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["requests"]["first"] == IDS


def test_inspect_missing_and_foreign_store(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.zarr")]) == 2
    assert "missing.zarr" in _one_error_line(capsys.readouterr().err)
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 2
    assert "not a Zarr v3 store" in _one_error_line(capsys.readouterr().err)
    zarr.open_group(str(tmp_path / "plain.zarr"), mode="w", zarr_format=3)
    assert main(["inspect", str(tmp_path / "plain.zarr")]) == 2
    assert "not a dmi store" in _one_error_line(capsys.readouterr().err)


def test_capture_refuses_existing_store(captured, capsys):
    assert main(["capture", "--out", str(captured["store"]), "-q"]) == 2
    assert "already exists" in _one_error_line(capsys.readouterr().err)


# --- bad prompts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expect", [
    ('{"prompt": "a"}\n{"prompt": "b"\n', ":2: not valid JSON"),
    ('{"prompt": "a"}\n\n{"id": "x", "text": "b"}\n', ':3: missing "prompt"'),
    ('["a"]\n', ":1: expected a JSON object"),
    ('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n', ":2: id 'x' is already used on line 1"),
    ('{"prompt": ""}\n', ':1: "prompt" must be a non-empty string'),
    ("\n\n", ": no prompts"),
])
def test_capture_bad_prompts_file(tmp_path, capsys, text, expect):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(text)
    assert main(["capture", "--prompts", str(prompts), "--out", str(tmp_path / "o.zarr"), "-q"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{prompts}{expect}" in line, line
    assert not (tmp_path / "o.zarr").exists()


def test_capture_missing_prompts_file(tmp_path, capsys):
    assert main(["capture", "--prompts", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o.zarr")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "nope.jsonl" in line and "does not exist" in line


def test_capture_bad_spec_is_usage_error(tmp_path, capsys):
    spec = _write(tmp_path / "hooks.yaml", """
        capture:
          - sites: [resid_post]
            tokenz: last
    """)
    assert main(["capture", "--spec", str(spec), "--out", str(tmp_path / "o.zarr"), "-q"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{spec}:" in line and "'tokenz'" in line and "did you mean 'tokens'" in line


def test_read_prompts_default_ids_and_examples(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a"}\n# a comment\n\n{"prompt": "b", "id": 5}\n{"prompt": "c"}\n')
    got = read_prompts(p)
    assert [(x.id, x.text, x.line) for x in got] == [("p0", "a", 1), ("5", "b", 4), ("p2", "c", 5)]
    example = read_prompts(example_path("prompts.jsonl"))
    assert len(example) >= 3 and len({x.id for x in example}) == len(example)
    with pytest.raises(UsageError):
        read_prompts(tmp_path / "missing.jsonl")


# --- specs ----------------------------------------------------------------------------------------------

def test_specs_list(capsys):
    assert main(["specs", "list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["family", "model_types", "sites", "source", "file"]
    row = next(ln for ln in out.splitlines() if ln.startswith("qwen3 "))
    assert "qwen3.yaml" in row and int(row.split()[2]) > 5 and " built-in " in row
    assert main(["specs", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["family"] == "qwen3" and r["model_types"] == ["qwen3"] for r in rows)


def test_validate_example_hook_spec(capsys):
    assert main(["specs", "validate", str(example_path("hooks.yaml"))]) == 0
    out = capsys.readouterr().out
    assert "ok: hook spec" in out and "tiny-qwen3" in out
    assert "layers/resid_post" in out and "bytes/row" in out
    # resid_post: hidden=64 float32 -> 256 bytes a row, 3 layers
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("layers/resid_post"))
    assert "256" in row and "768" in row


def test_validate_arch_spec(capsys):
    qwen3 = next(p for p in dmi.spec.list_specs() if p.stem == "qwen3")
    assert main(["specs", "validate", str(qwen3)]) == 0
    out = capsys.readouterr().out
    assert "ok: architecture spec" in out and "family qwen3" in out and "resid_post" in out
    assert "captured from a real tiny Qwen3Config model (3 layers, prefill and decode)" in out


def test_validate_arch_spec_against_a_real_tiny_model(tmp_path, capsys):
    """A spec is all a family needs: its tiny config comes from the spec (the model_type's config
    class, its dims, its `tiny:` block) and validate captures every site from a real model of it.
    A Phi-3 spec whose q anchors the slice of the fused qkv_proj, not its per-head view, is refused
    there, by file, line and site, with the layout that fits (dmi.load's check against the model)."""
    phi3 = next(p for p in dmi.spec.list_specs() if p.stem == "phi3")
    assert main(["specs", "validate", str(phi3)]) == 0
    assert "captured from a real tiny Phi3Config model" in capsys.readouterr().out
    bad = tmp_path / "phi3.yaml"
    bad.write_text(phi3.read_text().replace("assign: query_states, occurrence: 1", "assign: query_states, occurrence: 0"))
    assert main(["specs", "validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "sites.attn.q.hf.layout" in err and "Phi3Attention" in err, err
    assert "Fix: the tensor fits `layout: [batch, seq, head, head_dim]`" in err


def test_validate_bad_yaml_names_line(tmp_path, capsys):
    spec = _write(tmp_path / "hooks.yaml", """
        capture:
          - sites: [resid_post
            layers: [0]
    """)
    assert main(["specs", "validate", str(spec)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"dmi: error: {spec}:3: ") and "YAML" in line and "Fix:" in line


def test_validate_unknown_site_did_you_mean(tmp_path, capsys):
    spec = _write(tmp_path / "hooks.yaml", """
        capture:
          - sites: [resid_post]
          - sites: [attn.patern]
    """)
    assert main(["specs", "validate", str(spec)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{spec}:3: capture[1].sites[0]:" in line
    assert "did you mean 'attn.pattern'" in line and "Fix:" in line


def test_validate_layer_out_of_range_notes_tiny_config(tmp_path, capsys):
    spec = _write(tmp_path / "hooks.yaml", """
        capture:
          - sites: [resid_post]
            layers: [0, 20]
    """)
    assert main(["specs", "validate", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "layer 20 is out of range" in _one_error_line(err)
    assert "dmi: note:" in err and "--model" in err


@pytest.mark.parametrize("model, says", [
    ("tiny-qwen4", ("did you mean 'tiny-qwen3'", "tiny-deepseek_v3, tiny-gemma2, tiny-gemma3_text, tiny-llama3_1, "
                    "tiny-mistral, tiny-mixtral, tiny-phi3, tiny-qwen2, tiny-qwen3, tiny-qwen3_moe")),
    ("./no/such/model", ("no such directory: 'no/such/model'",)),
    ("/no/such/model", ("no such directory: '/no/such/model'",)),
])
def test_capture_bad_model_fails_before_any_lookup(tmp_path, capsys, monkeypatch, model, says):
    import socket

    import transformers

    def looked_up(*args, **kwargs):
        raise AssertionError("a tokenizer or config was looked up for a model name that cannot load")
    for cls in (transformers.AutoTokenizer, transformers.AutoConfig, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", looked_up)

    def connected(*args, **kwargs):
        raise AssertionError("the network was reached for a model name that cannot load")
    monkeypatch.setattr(socket.socket, "connect", connected)      # (a hub lookup by any other way)
    monkeypatch.setattr(socket, "create_connection", connected)
    assert main(["capture", "--model", model, "--out", str(tmp_path / "o.zarr"), "-q"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--model {model}: " in line and "Fix: " in line and all(s in line for s in says), line
    assert main(["specs", "validate", str(example_path("hooks.yaml")), "--model", model]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert all(s in line for s in says), line
    assert not (tmp_path / "o.zarr").exists()


def test_validate_arch_of_another_family_than_the_model(capsys):
    hooks = str(example_path("hooks.yaml"))
    assert main(["specs", "validate", hooks, "--arch", "qwen3", "--model", "tiny-llama3_1"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "qwen3.yaml:" in line and "match.model_type" in line and "config.model_type is 'llama'" in line, line


def test_validate_unknown_kind_and_arch(tmp_path, capsys):
    spec = _write(tmp_path / "x.yaml", "foo: 1\n")
    assert main(["specs", "validate", str(spec)]) == 2
    assert "cannot tell the kind of spec" in _one_error_line(capsys.readouterr().err)
    hooks = str(example_path("hooks.yaml"))
    assert main(["specs", "validate", hooks, "--arch", "qwen"]) == 2
    assert "--arch qwen" in _one_error_line(capsys.readouterr().err)
    assert main(["specs", "validate", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in _one_error_line(capsys.readouterr().err)


# --- usage ----------------------------------------------------------------------------------------------

def test_help_and_usage_errors(capsys):
    for argv in (["--help"], ["capture", "--help"], ["inspect", "--help"], ["specs", "--help"],
                 ["specs", "list", "--help"], ["specs", "validate", "--help"]):
        assert main(argv) == 0, argv
        assert "usage: dmi" in capsys.readouterr().out
    assert main([]) == 2
    assert "usage: dmi" in capsys.readouterr().err
    assert main(["capture", "--bogus"]) == 2
    assert "--bogus" in _one_error_line(capsys.readouterr().err)
    assert main(["inspect"]) == 2
    _one_error_line(capsys.readouterr().err)
    assert main(["capture", "--dtype", "int8"]) == 2
    _one_error_line(capsys.readouterr().err)


def test_runtime_failure_exits_1(tmp_path, capsys, monkeypatch):
    import transformers

    def boom(self, *args, **kwargs):
        raise RuntimeError("simulated failure\nsecond line")
    monkeypatch.setattr(transformers.GenerationMixin, "generate", boom)
    store = tmp_path / "o.zarr"
    assert main(["capture", "--out", str(store), "-q"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "failed after 0 of" in err and "RuntimeError: simulated failure" in err and "--traceback" in err
    assert zarr.open_group(str(store), mode="r").attrs["dmi_format"] == 1   # closed, readable
    assert main(["--traceback", "capture", "--out", str(store), "--overwrite", "-q"]) == 1
    assert "Traceback" in capsys.readouterr().err
