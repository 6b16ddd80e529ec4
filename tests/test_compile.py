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


def test_patched_layers_compile_to_one_graph(encoded, write_spec, tmp_path):
    """A site's identity is a tensor the site op takes (``Run.site_tensors``), not a constant of the
    graph: each decoder layer, compiled on its own, reuses the first layer's graph, as unpatched
    layers do. vLLM relies on the same sameness to compile one piece for all layers (an int site
    made every layer's piece a compile of its own: 94 s against 12 s for Qwen3-8B on the H200);
    the captures still land in each layer's own site."""
    spec = write_spec("""
        capture:
          - sites: [resid_post, attn.q, mlp.out]
    """)
    model, ref = model_pair("qwen3", attn="sdpa")
    with torch.no_grad(), dmi.load(ref, hook_spec=spec, store=tmp_path / "eager.zarr") as run:
        run.model(**encoded, use_cache=False)
    graphs = {"vanilla": [], "dmi": []}

    def compiled_layers(m, key):
        backend = lambda gm, inputs: graphs[key].append(gm) or gm.forward      # noqa: E731 (one for all layers)
        for layer in m.model.layers:
            layer.compile(backend=backend)

    torch._dynamo.reset()
    vanilla, _ = model_pair("qwen3", attn="sdpa")
    compiled_layers(vanilla, "vanilla")
    with torch.no_grad():
        vanilla(**encoded, use_cache=False)
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp_path / "compiled.zarr") as run:
        compiled_layers(run.model, "dmi")
        run.model(**encoded, use_cache=False)
    torch._dynamo.reset()
    assert len(model.model.layers) > 1 and len(graphs["vanilla"]) == 1, graphs["vanilla"]
    assert len(graphs["dmi"]) == 1, [g.code for g in graphs["dmi"]]
    assert "torch.ops.dmi.capture" in graphs["dmi"][0].code
    eager, compiled = _arrays(dmi.open(tmp_path / "eager.zarr")), _arrays(dmi.open(tmp_path / "compiled.zarr"))
    assert len(eager) > 3
    for key, e in eager.items():
        np.testing.assert_array_equal(compiled[key], e, err_msg=str(key))
