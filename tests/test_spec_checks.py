"""A contributor's architecture spec is checked at dmi.load against the real model: mistakes of a
spec copied from another family (a layout that does not fit, an ``args`` attribute the module
lacks, a module path typo) are errors or warnings naming the spec file, line, site and fix,
raised by dmi.load before the model is handed back or a store written. And the attention variants
a family needs (Gemma 2's logit soft cap and query_pre_attn_scalar scaling) match eager attention."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf

import dmi
from dmi.errors import SpecError
from dmi.spec import builtin_spec_dir

from conftest import patched_modules
from test_errors import check, line_of

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def spec_copy(tmp_path: Path, source: str, name: str, *replace: tuple[str, str]) -> Path:
    """A built-in spec as a contributor copies it: every ``old`` replaced by ``new``."""
    text = (builtin_spec_dir() / source).read_text()
    for old, new in replace:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


def tiny(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def refused(model, arch: Path, sites: list[str], store: Path) -> pytest.ExceptionInfo:
    """dmi.load that must fail with a SpecError, leaving no store and nothing patched."""
    with pytest.raises(SpecError) as info:
        dmi.load(model, hook_spec={"capture": [{"sites": sites}]}, store=store, arch_spec=arch)
    assert not store.exists(), "a refused load wrote a store"
    assert not patched_modules(model), "a refused load left modules patched"
    return info


# --- layouts: a Llama spec copied for Phi-3 (fused qkv_proj) ---------------------------------------

def phi3_from_llama(tmp_path: Path) -> Path:
    return spec_copy(tmp_path, "llama3_1.yaml", "phi3.yaml", ("family: llama3_1", "family: phi3"),
                     ("model_type: [llama]", "model_type: [phi3]"), ("[LlamaForCausalLM]", "[Phi3ForCausalLM]"))


def test_llama_spec_copied_for_phi3_is_refused_at_load_naming_the_layout(tmp_path):
    """Phi-3 slices q, k, v from one fused qkv_proj: the first assignment of query_states is a
    [batch, seq, head*head_dim] slice, not the [batch, head, seq, head_dim] the Llama anchor reads.
    Without the check this loaded and failed at the first forward inside dmi's gather
    (``shape '[6, 4, 16]' is invalid for input of size 36``)."""
    model = tiny(tf.Phi3Config(**COMMON))
    arch = phi3_from_llama(tmp_path)
    info = refused(model, arch, ["resid_post", "attn.q", "attn.k", "attn.v"], tmp_path / "o.zarr")
    check(info, SpecError, file=arch, line=line_of(arch, "assign: query_states, occurrence: 0"),
          key="sites.attn.q.hf.layout",
          says=("Phi3Attention at model.layers.0.self_attn", "has shape [2, 5, 64]",
                "`layout: [batch, head, seq, head_dim]` says [batch=2, head=4, seq=5, head_dim=16]",
                "(and site(s) attn.k, attn.v)", "the tensor fits `layout: [batch, seq, head, head_dim]`"))


def test_the_fix_the_layout_error_names_loads_and_captures_q(tmp_path):
    """The layout the error proposes reads Phi-3's q slice right: it equals q_proj's part of qkv_proj."""
    model = tiny(tf.Phi3Config(**COMMON))
    ref = tiny(tf.Phi3Config(**COMMON))
    arch = phi3_from_llama(tmp_path)
    text = arch.read_text().replace("assign: query_states, occurrence: 0, layout: [batch, head, seq, head_dim]",
                                    "assign: query_states, occurrence: 0, layout: [batch, seq, head, head_dim]")
    arch.write_text(text)
    ids = torch.arange(3, 10)[None]
    with torch.no_grad():
        with dmi.load(model, hook_spec={"capture": [{"sites": ["attn.q"], "layers": [0]}]}, store=tmp_path / "o.zarr",
                      arch_spec=arch) as run:
            run.model(input_ids=ids)
        x = ref.model.layers[0].input_layernorm(ref.model.embed_tokens(ids))
        want = ref.model.layers[0].self_attn.qkv_proj(x)[..., :64].reshape(-1, 4, 16)
    got = dmi.open(tmp_path / "o.zarr")["layers/attn/q"].dataset.q.sel(layer=0).values
    np.testing.assert_array_equal(got, want.numpy())


# --- args: a copied `sliding_window: self.sliding_window` ------------------------------------------

def qwen2_moe(**extra):
    return tf.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64, **extra)


def qwen2_moe_from_qwen3_moe(tmp_path: Path) -> Path:
    return spec_copy(tmp_path, "qwen3_moe.yaml", "qwen2_moe.yaml", ("family: qwen3_moe", "family: qwen2_moe"),
                     ("model_type: [qwen3_moe]", "model_type: [qwen2_moe]"))


def test_copied_args_attribute_the_module_lacks_is_refused_at_load(tmp_path):
    """Qwen2MoeAttention sets self.sliding_window only on sliding layers (none here): the copied
    args raised AttributeError from the model's own file at the first forward."""
    model = tiny(qwen2_moe())
    arch = qwen2_moe_from_qwen3_moe(tmp_path)
    info = refused(model, arch, ["attn.pattern"], tmp_path / "o.zarr")
    check(info, SpecError, file=arch, line=line_of(arch, "sliding_window: self.sliding_window"),
          key="sites.attn.pattern.hf.args.sliding_window",
          says=("`self.sliding_window` fails on layer 0's Qwen2MoeAttention (model.layers.0.self_attn)",
                "AttributeError", "(also on layers [1, 2])", "no attribute 'sliding_window' on any layer",
                "getattr(self, 'sliding_window', None)"))


def test_args_attribute_on_some_layers_only_names_them_and_the_fix_loads(tmp_path):
    """With some layers sliding (max_window_layers), the attribute exists there only: the error names those
    layers and the getattr fix, which then loads and matches eager attention on every layer."""
    config = qwen2_moe(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model = tiny(config)
    arch = qwen2_moe_from_qwen3_moe(tmp_path)
    info = refused(model, arch, ["attn.pattern"], tmp_path / "o.zarr")
    sliding = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    assert 0 < len(sliding) < 3, config.layer_types
    first_global = min(set(range(3)) - set(sliding))
    check(info, SpecError, file=arch, key="sites.attn.pattern.hf.args.sliding_window",
          says=(f"layer {first_global}'s Qwen2MoeAttention", f"exists only on layers {sliding}",
                "getattr(self, 'sliding_window', None)"))
    arch.write_text(arch.read_text().replace("sliding_window: self.sliding_window",
                                             "sliding_window: \"getattr(self, 'sliding_window', None)\""))
    ref = tiny(config)
    ids = torch.arange(3, 12)[None]
    with torch.no_grad():
        with dmi.load(model, hook_spec={"capture": [{"sites": ["attn.pattern"], "max_keys": 16}]},
                      store=tmp_path / "o.zarr", arch_spec=arch) as run:
            run.model(input_ids=ids)
        want = ref(input_ids=ids, output_attentions=True).attentions
    got = dmi.open(tmp_path / "o.zarr")["layers/attn/pattern"].dataset.pattern
    for layer in range(3):
        np.testing.assert_array_equal(got.sel(layer=layer).values[:, :, :9], want[layer][0].transpose(0, 1).numpy())


@pytest.mark.parametrize("args, key, says", [
    ("softcapping: self.scaling", "args.softcapping", ("attention_pattern takes no argument 'softcapping'",
                                                       "did you mean 'softcap'?", "sliding_window, softcap")),
    ("sliding_window: query_sates", "args.sliding_window", ("'query_sates' is not a variable of Qwen3Attention.forward",
                                                            "did you mean 'query_states'")),
    ("sliding_window: self.sliding_windw", "args.sliding_window", ("no attribute 'sliding_windw'",
                                                                   "did you mean self.sliding_window?")),
    ('sliding_window: "self.("', "args.sliding_window", ("is not a Python expression",)),
])
def test_bad_args_are_refused_at_load(tmp_path, args, key, says):
    arch = spec_copy(tmp_path, "qwen3.yaml", "qwen3_args.yaml", ("sliding_window: self.sliding_window}", args + "}"))
    info = refused(dmi.models.build_tiny_model("tiny-qwen3"), arch, ["attn.pattern"], tmp_path / "o.zarr")
    check(info, SpecError, file=arch, line=line_of(arch, "args: {query: query_states"),
          key=f"sites.attn.pattern.hf.{key}", says=says)


def test_missing_args_are_refused_at_load(tmp_path):
    arch = spec_copy(tmp_path, "llama3_1.yaml", "llama_args.yaml", (", groups: self.num_key_value_groups}", "}"))
    info = refused(dmi.models.build_tiny_model("tiny-llama3_1"), arch, ["attn.pattern"], tmp_path / "o.zarr")
    check(info, SpecError, file=arch, key="sites.attn.pattern.hf.args",
          says=("attention_pattern needs argument(s) groups", "add groups: <expression>"))


def test_an_anchor_that_is_no_tensor_is_refused_at_load(tmp_path):
    """Output 1 of an sdpa attention module is None (no weights): the probe forward sees it."""
    arch = spec_copy(tmp_path, "qwen3.yaml", "qwen3_out.yaml",
                     ('hf: {module: "model.layers.{i}.self_attn", output: 0,', 'hf: {module: "model.layers.{i}.self_attn", output: 1,'))
    info = refused(dmi.models.build_tiny_model("tiny-qwen3"), arch, ["attn.out"], tmp_path / "o.zarr")
    check(info, SpecError, file=arch, key="sites.attn.out.hf", says=("gives a NoneType, not a tensor",))


def test_layout_axes_that_are_not_the_sites_dims_are_refused_when_the_spec_loads(tmp_path):
    arch = spec_copy(tmp_path, "qwen3.yaml", "qwen3_dims.yaml",
                     ("output: 0, layout: [batch, seq, hidden]}\n    vllm: {module: \"model.layers.{i}.self_attn\"",
                      "output: 0, layout: [batch, seq, mlp]}\n    vllm: {module: \"model.layers.{i}.self_attn\""))
    with pytest.raises(SpecError) as info:
        dmi.spec.load_arch_spec(arch)
    check(info, SpecError, file=arch, key="sites.attn.out.hf.layout",
          says=("feature axes ['mlp'] are not the site's dims after token ['hidden']",))


def test_a_spec_file_parsed_once_is_read_anew_when_it_changes_and_each_load_is_its_own(tmp_path):
    """load_arch_spec keeps a file's checked spec: a later load of the same content is an equal
    copy that its caller may change; the same file rewritten (same size, within the clock's tick)
    loads its new content, and a broken rewrite is refused again with its line."""
    arch = spec_copy(tmp_path, "qwen3.yaml", "mine.yaml")
    first = dmi.spec.load_arch_spec(arch)
    first.data["sites"].pop("resid_post")
    first.lines.clear()
    again = dmi.spec.load_arch_spec(arch)
    assert "resid_post" in again.data["sites"] and again.lines and again.file == str(arch)
    assert again.data == dmi.spec.load_yaml(arch, what="architecture spec").data
    arch.write_text(arch.read_text().replace("family: qwen3", "family: qwen4"))
    assert dmi.spec.load_arch_spec(arch).data["family"] == "qwen4"
    attn_out = 'layout: [batch, seq, {}]}}\n    vllm: {{module: "model.layers.{{i}}.self_attn"'
    arch.write_text(arch.read_text().replace(attn_out.format("hidden"), attn_out.format("mlp")))
    for _ in range(2):
        with pytest.raises(SpecError) as info:
            dmi.spec.load_arch_spec(arch)
        check(info, SpecError, file=arch, key="sites.attn.out.hf.layout", says=("feature axes ['mlp']",))


def test_the_builtin_specs_pass_the_load_checks(tmp_path):
    """Every site of every built-in family goes through the probe forward (no false alarm)."""
    models = {f: f"tiny-{f}" for f in ("qwen3", "llama3_1", "qwen3_moe", "mixtral")}
    models["gemma2"] = tiny(gemma2_config())
    for family, model in models.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")        # no site left out either
            run = dmi.load(model, hook_spec={"capture": [{"sites": ["*"]}]}, store=tmp_path / f"{family}.zarr")
        assert {s.canonical for s in run.plan.sites} == set(dmi.spec.load_arch_spec(run.plan.arch_file).data["sites"])
        run.close()


# --- a module path typo ------------------------------------------------------------------------------

def typo_spec(tmp_path: Path) -> Path:
    return spec_copy(tmp_path, "llama3_1.yaml", "llama_typo.yaml", ('"model.layers.{i}.mlp.down_proj", input: 0, layout',
                                                                     '"model.layers.{i}.mlp.down_prj", input: 0, layout'))


@pytest.mark.parametrize("pattern", ["mlp.act", "layers.1.mlp.act", "mlp.a*"])
def test_a_site_whose_module_path_has_a_typo_is_named_with_its_path(tmp_path, pattern):
    """Asked for by name (or by a glob that matches nothing else), the site is refused naming its
    module path and the spec line; never 'did you mean mlp.act' for the very name asked."""
    arch = typo_spec(tmp_path)
    info = refused(dmi.models.build_tiny_model("tiny-llama3_1"), arch, [pattern], tmp_path / "o.zarr")
    msg = check(info, SpecError, file=arch, line=line_of(arch, "down_prj"), key="sites.mlp.act.hf.module",
                says=("site 'mlp.act' is in the spec but its module path 'model.layers.{i}.mlp.down_prj' matches "
                      "nothing in this model", "print(model) lists them"))
    assert "did you mean" not in msg


def test_a_glob_over_a_site_whose_module_path_has_a_typo_warns(tmp_path):
    """A glob that matches other sites too leaves the site out, with a warning naming the path
    (it was dropped silently)."""
    arch = typo_spec(tmp_path)
    with pytest.warns(UserWarning) as record:
        run = dmi.load("tiny-llama3_1", hook_spec={"capture": [{"sites": ["mlp.*"]}]}, store=tmp_path / "o.zarr",
                       arch_spec=arch)
    run.close()
    assert {s.canonical for s in run.plan.sites} == {"mlp.in", "mlp.out"}
    text = " ".join(str(w.message) for w in record)
    assert f"{arch}:{line_of(arch, 'down_prj')}: sites.mlp.act.hf.module: site 'mlp.act' is in the spec but its " \
           f"module path 'model.layers.{{i}}.mlp.down_prj' matches nothing in this model, so 'mlp.*'" in text, text
    assert "Fix: " in text


# --- Gemma 2: soft-capped logits, query_pre_attn_scalar, sliding and global layers ----------------------

WINDOW, MAX_KEYS = 4, 64


def gemma2_config(softcap: float | None = 2.0):
    # initializer_range 0.2: logits large enough that the soft cap changes the weights (by ~0.5)
    return tf.Gemma2Config(**COMMON, head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=softcap,
                           sliding_window=WINDOW, initializer_range=0.2)


def test_gemma2_pattern_with_softcap_equals_eager_attention_past_the_window(encoded, write_spec, tmp_path):
    """attn.pattern of the gemma2 spec (softcap, scaling query_pre_attn_scalar ** -0.5, sliding
    layers 0 and 2, global layer 1) equals output_attentions of eager attention bit for bit, through
    decode steps well past the window on left-padded prompts; without the soft cap it would not."""
    from test_capture_hf import _at_positions
    from storecheck import generate_rows
    model, ref = tiny(gemma2_config()), tiny(gemma2_config())
    assert model.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    spec = write_spec(f"""
        capture:
          - sites: [attn.pattern]
            max_keys: {MAX_KEYS}
        policy: {{mode: full, ring_bytes: 8MiB}}
    """)
    new = 2 * WINDOW
    gen = dict(max_new_tokens=new, do_sample=False)
    with torch.no_grad():
        want = ref.generate(**encoded, **gen, output_attentions=True, return_dict_in_generate=True)
        with dmi.load(model, hook_spec=spec, store=tmp_path / "o.zarr") as run:
            assert Path(run.plan.arch_file).name == "gemma2.yaml"
            got = run.model.generate(**encoded, **gen)
    assert torch.equal(got, want.sequences)
    mask = encoded["attention_mask"].bool()
    pad, total = (~mask).sum(1).tolist(), mask.shape[1]
    pattern = dmi.open(tmp_path / "o.zarr")["layers/attn/pattern"].dataset.pattern
    for layer in range(3):
        rows = {}
        for t in range(new):
            keys = total + t
            for b, s in generate_rows(mask, t):
                at = (f"r{b}", s - pad[b] if t == 0 else total - pad[b] + t - 1)
                w = want.attentions[t][layer][b, :, s].numpy()
                rows[at] = _at_positions(w, pad[b] - max(keys - w.shape[-1], 0))
        stored = pattern.sel(layer=layer)
        at = list(zip(stored.request.values.tolist(), stored.position.values.tolist()))
        assert sorted(at) == sorted(rows), layer
        np.testing.assert_array_equal(stored.values, np.stack([rows[k] for k in at]), err_msg=f"layer {layer}")
        late = [k for k in at if k[1] > 2 * WINDOW]
        if layer != 1:     # sliding: a late row weighs only the window's keys
            assert late and all(np.count_nonzero(rows[k].sum(0)) <= WINDOW for k in late), layer
    # the soft cap matters here: the same weights without it are far from eager's
    from dmi.adapters.hf.derived import attention_pattern
    attn = ref.model.layers[1].self_attn
    q, k = torch.randn(1, 4, 6, 32), torch.randn(1, 2, 6, 32)
    capped = attention_pattern(q * 5, k * 5, None, attn.scaling, 2, softcap=attn.attn_logit_softcapping)
    plain = attention_pattern(q * 5, k * 5, None, attn.scaling, 2)
    assert (capped - plain).abs().max() > 0.1


def test_gemma2_sandwich_norm_sites_chain_as_documented(encoded, tmp_path):
    """gemma2's residual sites equal output_hidden_states (embed scaled by sqrt(hidden)), and the
    sandwich norms sit where docs/sites.md says: attn.out = post_attention_layernorm(attn.out_pre_norm),
    mlp.out = post_feedforward_layernorm(mlp.out_pre_norm), resid_mid = resid_pre + attn.out and
    resid_post = resid_mid + mlp.out; q_rot is the rotary embedding of q."""
    model, ref = tiny(gemma2_config()), tiny(gemma2_config())
    sites = ["embed", "resid_pre", "attn.q", "attn.q_rot", "attn.out_pre_norm", "attn.out", "resid_mid",
             "mlp.out_pre_norm", "mlp.out", "resid_post"]
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        with dmi.load(model, hook_spec={"capture": [{"sites": sites}]}, store=tmp_path / "o.zarr") as run:
            run.model(input_ids=ids, attention_mask=mask)
    tree = dmi.open(tmp_path / "o.zarr")
    valid = mask.bool().reshape(-1).numpy()

    def site(name, layer=None):
        ds = tree[("layers/" if layer is not None else "") + name.replace(".", "/")].dataset
        x = ds[name.split(".")[-1]]
        return torch.from_numpy((x.sel(layer=layer) if layer is not None else x).values)

    def hidden(i):
        return want.hidden_states[i].reshape(-1, 64)[valid]
    np.testing.assert_array_equal(site("embed").numpy(), hidden(0).numpy())
    for i in range(3):
        layer = ref.model.layers[i]
        np.testing.assert_array_equal(site("resid_pre", i).numpy(), hidden(i).numpy())
        with torch.no_grad():
            attn_out = layer.post_attention_layernorm(site("attn.out_pre_norm", i))
            mlp_out = layer.post_feedforward_layernorm(site("mlp.out_pre_norm", i))
        np.testing.assert_array_equal(site("attn.out", i).numpy(), attn_out.numpy())
        np.testing.assert_array_equal(site("mlp.out", i).numpy(), mlp_out.numpy())
        mid = site("resid_pre", i) + site("attn.out", i)
        post = site("resid_mid", i) + site("mlp.out", i)
        torch.testing.assert_close(site("resid_mid", i), mid, rtol=0, atol=1e-6)
        torch.testing.assert_close(site("resid_post", i), post, rtol=0, atol=1e-6)
        if i < 2:     # (the last layer's output goes through the final norm in hidden_states)
            np.testing.assert_array_equal(site("resid_post", i).numpy(), hidden(i + 1).numpy())
    # q_rot: q rotated by the model's rotary embedding at each token's position
    from transformers.models.gemma2.modeling_gemma2 import apply_rotary_pos_emb
    b, s = ids.shape
    positions = torch.arange(s)[None].expand(b, s)        # (a forward given no position_ids: cache columns)
    cos, sin = ref.model.rotary_emb(torch.zeros(1), positions)
    q = torch.zeros(b * s, 4, 32)
    q[torch.from_numpy(valid)] = site("attn.q", 0)
    q = q.reshape(b, s, 4, 32).transpose(1, 2)
    q_rot, _ = apply_rotary_pos_emb(q, q[:, :2], cos, sin)
    torch.testing.assert_close(site("attn.q_rot", 0), q_rot.transpose(1, 2).reshape(b * s, 4, 32)[torch.from_numpy(valid)],
                               rtol=0, atol=1e-6)
