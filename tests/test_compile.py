"""torch.compile(fullgraph=True) of a patched model: no graph break, captures equal eager.

CPU CI uses the ``aot_eager`` backend: Dynamo traces the patched forward (site ops, step ops,
rewritten module code) into one graph and AOTAutograd functionalizes the ops' ``ticket``
mutation, which is what a graph break or a lost op would show; the numerics stay eager's, so the
stores compare bit for bit. (Inductor on CPU takes about 90 s here on 2 cores and rounds
differently from eager; the GPU suite runs inductor and CUDA graphs.)
"""
from __future__ import annotations

import numpy as np
import torch

import dmi
from conftest import model_pair


def _arrays(tree):
    return {(node.path, v): node.dataset[v].values for node in tree.subtree for v in node.dataset.data_vars}


def test_compiled_forward_has_no_graph_break_and_captures_equal_eager(encoded, write_spec, tmp_path):
    spec = write_spec("""
        capture:
          - sites: [resid_post, final_norm, attn.q, attn.z, mlp.out]
          - sites: [attn.pattern]
            layers: [1]
            max_keys: 64
          - sites: [logits]
            tokens: last
            reduce: {topk: 4}
    """)
    model, ref = model_pair("qwen3", attn="sdpa")
    with torch.no_grad():
        model(**encoded)    # transformers' first forward installs its output-capturing hooks (under a lock)
    with torch.no_grad(), dmi.load(ref, hook_spec=spec, store=tmp_path / "eager.zarr") as run:
        want = run.model(**encoded).logits
    torch._dynamo.reset()
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "compiled.zarr") as run:
        explain = torch._dynamo.explain(run.model.forward)(**encoded)
        assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
        torch._dynamo.reset()
        forward = torch.compile(run.model.forward, fullgraph=True, backend="aot_eager")
        first = forward(**encoded).logits
        second = forward(**encoded).logits          # the compiled graph runs again: a second step
        steps = run.stats()["steps"]
    torch._dynamo.reset()
    assert torch.equal(first, want) and torch.equal(second, want)
    assert steps == 3       # explain's trace, then two compiled calls: every call is one fresh step
    eager, compiled = _arrays(dmi.open(tmp_path / "eager.zarr")), _arrays(dmi.open(tmp_path / "compiled.zarr"))
    for key, e in eager.items():
        if key[0] == "/drops":
            continue
        c = compiled[key]
        assert c.shape[0] == 3 * e.shape[0], key
        for k in range(3):
            np.testing.assert_array_equal(c[k * len(e):(k + 1) * len(e)], e, err_msg=str(key))
