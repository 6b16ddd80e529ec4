"""Captured values equal what the unpatched model computes, for every family; outputs unchanged."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dmi
from conftest import FAMILIES, SPECS, WINDOWED, model_pair, windowed_pair
from storecheck import expected_rows as _expected, generate_rows as _rows

NEW_TOKENS = 4


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_captures_equal_reference(family, encoded, write_spec, tmp_path):
    model, ref = model_pair(family, attn="eager")
    spec = write_spec("""
        capture:
          - sites: [resid_pre, resid_post, final_norm]
          - sites: [attn.pattern]
            layers: [0, 1]
            max_keys: 64
          - sites: [logits]
            tokens: last
        policy: {mode: full, ring_bytes: 8MiB}
    """)
    with torch.no_grad():
        want = ref.generate(**encoded, max_new_tokens=NEW_TOKENS, do_sample=False, output_hidden_states=True,
                            output_attentions=True, output_logits=True, return_dict_in_generate=True)
        with dmi.load(model, hook_spec=spec, store=tmp_path / "out.zarr") as run:
            got = run.model.generate(**encoded, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(got, want.sequences), "patched model generated different tokens"

    tree = dmi.open(tmp_path / "out.zarr")
    mask = encoded["attention_mask"].bool()
    n_layers = model.config.num_hidden_layers
    hs = want.hidden_states          # step -> (embeds, layer 0 out, ..., final norm)
    resid_post = tree["layers/resid_post"].dataset
    resid_pre = tree["layers/resid_pre"].dataset
    for layer in range(n_layers - 1):
        exp = _expected(hs, mask, lambda st, b, s: st[layer + 1][b, s].numpy())
        np.testing.assert_array_equal(resid_post.resid_post.sel(layer=layer).values, exp)
    for layer in range(n_layers):
        exp = _expected(hs, mask, lambda st, b, s: st[layer][b, s].numpy())
        np.testing.assert_array_equal(resid_pre.resid_pre.sel(layer=layer).values, exp)
    exp = _expected(hs, mask, lambda st, b, s: st[-1][b, s].numpy())
    np.testing.assert_array_equal(tree["final_norm"].dataset.final_norm.values, exp)

    # coordinates: requests r0.., positions count from each prompt's first real token
    pad = (~mask).sum(1)
    exp_pos = [s - int(pad[b]) if t == 0 else mask.shape[1] - int(pad[b]) + t - 1
               for t in range(NEW_TOKENS) for b, s in _rows(mask, t)]
    np.testing.assert_array_equal(resid_post.position.values, exp_pos)
    exp_req = [f"r{b}" for t in range(NEW_TOKENS) for b, _ in _rows(mask, t)]
    assert list(resid_post.request.values) == exp_req
    assert set(resid_post.phase.values[: int(mask.sum())]) == {"prefill"}
    assert set(resid_post.phase.values[int(mask.sum()):]) == {"decode"}

    # attention patterns: eager output_attentions, keys re-indexed from cache columns to positions
    pattern = tree["layers/attn/pattern"].dataset.pattern
    for layer in (0, 1):
        def pick(st, b, s, layer=layer):
            row = st[layer][b, :, s].numpy()                     # [head, key columns]
            out = np.zeros((row.shape[0], 64), row.dtype)
            cols = row[:, int(pad[b]):]
            out[:, : cols.shape[1]] = cols
            return out
        np.testing.assert_array_equal(pattern.sel(layer=layer).values, _expected(want.attentions, mask, pick))

    # logits of the last token of each step = generate's raw logits (lm_head's output: a family
    # with a final soft cap, Gemma 2, applies it after, as its ForCausalLM does)
    logits = torch.from_numpy(tree["logits"].dataset.logits.values)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    np.testing.assert_array_equal(logits.numpy(), torch.cat(want.logits).numpy())


WINDOW, MAX_KEYS = 4, 64


def _at_positions(weights: np.ndarray, first: int) -> np.ndarray:
    """[head, key columns] weights as [head, MAX_KEYS] over key positions, ``first`` the column of
    position 0 (negative: the columns hold later positions only); 0 where no column is."""
    out = np.zeros((weights.shape[0], MAX_KEYS), weights.dtype)
    cols = np.arange(MAX_KEYS) + first
    held = (cols >= 0) & (cols < weights.shape[-1])
    out[:, held] = weights[:, cols[held]]
    return out


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_window_pattern_equals_reference(family, cache, encoded, write_spec, tmp_path):
    """attn.pattern of sliding-window layers through decode steps well past the window, left-padded
    prompts: a sliding cache layer hands attention only the step's last keys (transformers'
    DynamicSlidingWindowLayer the last window - 1 and the new one, StaticSlidingWindowLayer the last
    window), and each stored row (request, position) holds its weights at their key positions, 0
    outside the window. Bit for bit against output_attentions of the unpatched model on the same
    cache (its last columns placed at the step's last positions); to float rounding against a cache
    that keeps every key, where a request's key position j is column padding + j (nothing to place)."""
    from transformers import DynamicCache
    model, ref = windowed_pair(family, WINDOW)
    spec = write_spec(f"""
        capture:
          - sites: [attn.pattern]
            max_keys: {MAX_KEYS}
        policy: {{mode: full, ring_bytes: 8MiB}}
    """)
    new = 2 * WINDOW
    gen = dict(max_new_tokens=new, do_sample=False)
    out = dict(output_attentions=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = ref.generate(**encoded, **gen, **out, cache_implementation=cache)
        whole = ref.generate(**encoded, **gen, **out, past_key_values=DynamicCache())
        with dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr") as run:
            got = run.model.generate(**encoded, **gen, cache_implementation=cache)
    assert torch.equal(got, want.sequences) and torch.equal(got, whole.sequences)
    kinds = {type(layer).__name__ for layer in want.past_key_values.layers}
    assert kinds >= {"dynamic": {"DynamicSlidingWindowLayer"}, "static": {"StaticSlidingWindowLayer"}}[cache], kinds

    mask = encoded["attention_mask"].bool()
    pad, total = (~mask).sum(1).tolist(), mask.shape[1]
    pattern = dmi.open(tmp_path / "o.zarr")["layers/attn/pattern"].dataset.pattern
    for layer in range(model.config.num_hidden_layers):
        same, every = {}, {}           # (request, position) -> reference row
        for t in range(new):
            keys = total + t           # the step's key columns, padding included
            for b, s in _rows(mask, t):
                at = (f"r{b}", s - pad[b] if t == 0 else total - pad[b] + t - 1)
                w = want.attentions[t][layer][b, :, s].numpy()
                same[at] = _at_positions(w, pad[b] - max(keys - w.shape[-1], 0))
                every[at] = _at_positions(whole.attentions[t][layer][b, :, s].numpy(), pad[b])
        stored = pattern.sel(layer=layer)
        at = list(zip(stored.request.values.tolist(), stored.position.values.tolist()))
        assert sorted(at) == sorted(same), layer
        np.testing.assert_array_equal(stored.values, np.stack([same[k] for k in at]), err_msg=f"layer {layer}")
        np.testing.assert_allclose(stored.values, np.stack([every[k] for k in at]), rtol=0, atol=1e-6,
                                   err_msg=f"layer {layer}, against every key")


# sites compared with the stream itself (hidden_states) or recomputed from q and k elsewhere
_NOT_INTERNAL = {"embed", "resid_pre", "resid_post", "final_norm", "logits", "attn.pattern"}


@pytest.mark.parametrize("family", FAMILIES)
def test_internal_sites_equal_reference(family, encoded, write_spec, tmp_path):
    """Every other per-layer site of the family's spec (q/k/v or MLA's latents, z, mlp sites, MoE
    routing, shared experts, sandwich norms) on every layer, against values recorded
    from the unpatched modules: each (site, layer) the reference has is stored, and only those."""
    model, ref = model_pair(family, attn="sdpa")
    sites = [s for s in SPECS[family]["sites"] if s not in _NOT_INTERNAL]
    layers = list(range(model.config.num_hidden_layers))
    spec = write_spec(f"capture:\n  - sites: {sites}\n    layers: {layers}\n")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    refs = {(name, i): v for i in layers for name, v in _reference_internals(ref, ids, mask, i).items()}
    assert {name for name, _ in refs} == set(sites), "the reference misses sites of the spec"
    moe_layers = [i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        with dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr") as run:
            out = run.model(input_ids=ids, attention_mask=mask)
        want = ref(input_ids=ids, attention_mask=mask, output_router_logits=bool(moe_layers))
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=0)
    tree = dmi.open(tmp_path / "o.zarr")
    valid = mask.bool().reshape(-1).numpy()
    stored = set()
    for name in sites:
        ds = tree["layers/" + name.replace(".", "/")].dataset
        stored |= {(name, int(i)) for i in ds.layer.values}
        for i in ds.layer.values.tolist():
            got = ds[name.split(".")[-1]].sel(layer=i).values
            np.testing.assert_array_equal(got, refs[(name, i)].reshape(valid.shape[0], *got.shape[1:])[valid],
                                          err_msg=f"{name} layer {i}")
    assert stored == set(refs)
    for i in set(layers) & set(moe_layers):     # the model's own router logits output
        rl = want.router_logits[moe_layers.index(i)].reshape(valid.shape[0], -1)[valid].numpy()
        np.testing.assert_array_equal(tree["layers/moe/router_logits"].dataset.router_logits.sel(layer=i).values, rl)


def by_weight(x, weights):
    """x's top-k axis by descending routing weight, ties in the router's order (DeepSeek-V3's
    router returns its top-k unsorted, the others sorted already)."""
    return torch.gather(x, -1, torch.from_numpy(np.argsort(-weights.float().numpy(), axis=-1, kind="stable")))


def _reference_internals(ref, ids, mask, index):
    """Internals of layer ``index`` of the unpatched model, recorded with temporary forward hooks on
    a copy (test-only reference; dmi itself never uses hooks), as [batch*seq, ...] arrays: only the
    sites this layer has (MoE routing on MoE layers, mlp.act on dense ones, MLA's latents...)."""
    out, hooks = {}, []
    layer = ref.model.layers[index]
    attn = layer.self_attn
    b, s = ids.shape

    def save(name, fn):
        return lambda m, a, kw, o: out.__setitem__(name, fn(a, kw, o).detach().reshape(b * s, -1).numpy())

    def hook(module, name, fn):
        hooks.append(module.register_forward_hook(save(name, fn), with_kwargs=True))

    hook(attn.o_proj, "attn.z", lambda a, kw, o: a[0])
    hook(layer.mlp, "mlp.in", lambda a, kw, o: a[0])
    if hasattr(layer, "pre_feedforward_layernorm"):      # sandwich norms (Gemma 3): the blocks' outputs are normed
        hook(attn, "attn.out_pre_norm", lambda a, kw, o: o[0])
        hook(layer.post_attention_layernorm, "attn.out", lambda a, kw, o: o)
        hook(layer.pre_feedforward_layernorm, "resid_mid", lambda a, kw, o: a[0])
        hook(layer.mlp, "mlp.out_pre_norm", lambda a, kw, o: o)
        hook(layer.post_feedforward_layernorm, "mlp.out", lambda a, kw, o: o)
    else:
        hook(attn, "attn.out", lambda a, kw, o: o[0])
        hook(layer.post_attention_layernorm, "resid_mid", lambda a, kw, o: a[0])
        hook(layer.mlp, "mlp.out", lambda a, kw, o: o)
    if hasattr(layer.mlp, "gate"):
        hook(layer.mlp.gate, "moe.router_logits", lambda a, kw, o: o[0])
        hook(layer.mlp.gate, "moe.topk_weights", lambda a, kw, o: by_weight(o[1], o[1]))
        hook(layer.mlp.gate, "moe.topk_ids", lambda a, kw, o: by_weight(o[2], o[1]).to(torch.int32))
    if hasattr(layer.mlp, "shared_experts"):
        hook(layer.mlp.shared_experts, "moe.shared_out", lambda a, kw, o: o)
    if hasattr(layer.mlp, "down_proj"):
        hook(layer.mlp.down_proj, "mlp.act", lambda a, kw, o: a[0])

    def per_head(x, d):          # [b, s, n*d] -> [b, n, s, d], as the attention forward views it
        return x.view(b, s, -1, d).transpose(1, 2)

    # q/k/v from the projections, as the attention forward computes them
    def qkv(m, a, kw, o):
        x = kw["hidden_states"] if "hidden_states" in kw else a[0]
        if hasattr(m, "kv_a_proj_with_mqa"):             # MLA: the query per head, the latent and the RoPE key
            q = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x))) if m.q_lora_rank else m.q_proj(x)
            latent, k_rope = m.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
            found = {"attn.q": per_head(q, m.qk_head_dim), "attn.kv_latent": m.kv_a_layernorm(latent)[:, None],
                     "attn.k_rope": k_rope[:, None]}
        else:
            hd = m.head_dim
            if hasattr(m, "qkv_proj"):                   # fused (Phi-3): q, then k, then v
                q, k, v = m.qkv_proj(x).split([m.config.num_attention_heads * hd] + 2 * [m.num_key_value_heads * hd], dim=-1)
            else:
                q, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)
            q, k, v = per_head(q, hd), per_head(k, hd), per_head(v, hd)
            if hasattr(m, "q_norm"):
                q, k = m.q_norm(q), m.k_norm(k)
            cos, sin = kw["position_embeddings"]
            import sys
            rope = sys.modules[type(m).__module__].apply_rotary_pos_emb
            q_rot, k_rot = rope(q, k, cos, sin)
            found = {"attn.q": q, "attn.k": k, "attn.v": v, "attn.q_rot": q_rot, "attn.k_rot": k_rot}
        for name, t in found.items():
            out[name] = t.transpose(1, 2).reshape(b * s, -1).detach().numpy()
    hooks.append(attn.register_forward_hook(qkv, with_kwargs=True))
    with torch.no_grad():
        ref(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_sites_follow_the_modules(family, encoded, write_spec, tmp_path):
    """mlp.act exists on dense-MLP layers only and moe.* on MoE layers only (Qwen3-MoE mixes both);
    on every layer that has them they equal the unpatched modules' values."""
    model, ref = model_pair(family, attn="sdpa")
    dense = [i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "down_proj")]
    sparse = [i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "gate")]
    assert dense or sparse
    sites = (["mlp.act"] if dense else []) + (["moe.router_logits", "moe.topk_ids"] if sparse else [])
    spec = write_spec(f"capture:\n  - sites: {sites}\n")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    seen, hooks = {}, []
    for i in dense:
        hooks.append(ref.model.layers[i].mlp.down_proj.register_forward_hook(
            lambda m, a, o, i=i: seen.__setitem__(("act", i), a[0].reshape(-1, a[0].shape[-1]).numpy())))
    for i in sparse:
        hooks.append(ref.model.layers[i].mlp.gate.register_forward_hook(
            lambda m, a, o, i=i: seen.update({("router_logits", i): o[0].numpy(),
                                              ("topk_ids", i): by_weight(o[2], o[1]).numpy()})))
    with torch.no_grad():
        ref(input_ids=ids, attention_mask=mask)
        with dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr") as run:
            run.model(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    tree = dmi.open(tmp_path / "o.zarr")
    valid = mask.bool().reshape(-1).numpy()
    for group, layers in (("layers/mlp/act", dense), ("layers/moe/router_logits", sparse), ("layers/moe/topk_ids", sparse)):
        if not layers:
            continue
        leaf = group.rsplit("/", 1)[1]
        ds = tree[group].dataset
        assert list(ds.layer.values) == layers, group
        for i in layers:
            np.testing.assert_array_equal(ds[leaf].sel(layer=i).values, seen[(leaf, i)][valid], err_msg=f"{group} layer {i}")


def test_a_site_whose_module_never_ran_is_named_at_close(encoded, write_spec, tmp_path, caplog):
    """A forward given ``inputs_embeds`` never calls the embedding module: the embed site selects
    the step's rows and stores none (all counted as not computed, nothing dropped). The run says so
    at close (a warning, the store's ``sites_never_computed``, ``dmi inspect``), and the other sites
    capture the embeddings' forward as the unpatched model computes it."""
    from dmi.store.inspect import format_summary, summarize
    model, ref = model_pair("qwen3", attn="sdpa")
    spec = write_spec("capture:\n  - sites: [embed, resid_post]\n")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    with torch.no_grad():
        embeds = ref.get_input_embeddings()(ids)
        want = ref(inputs_embeds=embeds, attention_mask=mask, output_hidden_states=True).hidden_states
        with caplog.at_level("WARNING", logger="dmi"), dmi.load(model, hook_spec=spec, store=tmp_path / "e.zarr") as run:
            run.model(inputs_embeds=embeds, attention_mask=mask)
    tree = dmi.open(tmp_path / "e.zarr")
    valid = mask.bool().reshape(-1).numpy()
    assert tree.attrs["sites_never_computed"] == ["embed"]
    assert tree.attrs["rows_not_computed"]["embed"] == tree.attrs["rows_selected"]["embed"] == valid.sum()
    assert "1 site(s)" in caplog.text and "embed" in caplog.text and "inputs_embeds" in caplog.text
    assert "no row computed: embed" in format_summary(summarize(tmp_path / "e.zarr"))
    resid = tree["layers/resid_post"].dataset.resid_post
    for i in range(len(ref.model.layers) - 1):       # (the last layer's output is normed in hidden_states)
        np.testing.assert_allclose(resid.sel(layer=i).values, want[i + 1].reshape(-1, want[i + 1].shape[-1])[valid].numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=f"layer {i}")
