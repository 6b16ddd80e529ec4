"""Tensor-parallel capture merged into one store (dmi.store.shards), with two real ranks on CPU.

Two processes (rank 1 started with ``torch.multiprocessing`` spawn, rank 0 the test process;
``torch.distributed`` gloo) run layer 0 of a tiny Qwen3 the way vLLM does under
``tensor_parallel_size=2``: the fused q/k/v weight and the gate/up weight split column-parallel (``QKVParallelLinear`` — kv heads replicated when there are fewer
than ranks —, ``MergedColumnParallelLinear``), ``o_proj`` and ``down_proj`` row-parallel with an
all-reduce of the partial sums. Each rank writes its shard of every split site and rank 0 the
replicated ones, concurrently, into one store; the merged arrays must equal the unsharded
(TP=1) computation, which itself equals the transformers layer.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dmi.store import shards
from dmi.errors import DmiError

SITES = ["resid_pre", "attn.q", "attn.k", "attn.k_rot", "attn.v", "attn.z", "attn.out", "resid_mid",
         "mlp.in", "mlp.act", "mlp.out", "resid_post"]
SPLIT = {"attn.q": "head", "attn.z": "head", "attn.k": "kv_head", "attn.k_rot": "kv_head", "attn.v": "kv_head",
         "mlp.act": "mlp"}
HEADS = [3, 0, 1]                         # attn.q keeps these heads, in this order (not rank-contiguous)
STEPS = [[5, 3], [6]]                     # tokens per request: step 0 starts r0 and r1, step 1 starts r2
CASES = {"kv2": 2, "kv1": 1}              # num_key_value_heads: one kv head per rank / one replicated on both
CHUNK_ROWS = 4                            # 14 rows: chunks end mid-step, and a tail


def _case(kv_heads: int) -> dict:
    """Layer 0 of a seeded tiny Qwen3 (its weights as plain tensors), the plan, the TP=2 layout and
    the steps' batches (replicated inputs: the same on every rank). Built once, in the parent:
    the ranks import neither transformers nor the model code."""
    import transformers as tf
    from dmi.models import tiny_config
    from dmi.plan import build_plan
    from dmi.spec import find_arch_spec, load_hook_spec
    config = tiny_config("qwen3")
    config.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    w = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    dims = {"H": config.num_attention_heads, "K": kv_heads, "D": config.head_dim, "M": config.intermediate_size,
            "eps": config.rms_norm_eps, "scaling": layer.self_attn.scaling}
    hook = load_hook_spec({"capture": [{"sites": [s for s in SITES if s != "attn.q"], "layers": [0]},
                                       {"sites": ["attn.q"], "layers": [0], "heads": HEADS}]})
    arch = find_arch_spec("qwen3")
    plan = build_plan(arch, hook, config)
    steps = []
    for step, lens in enumerate(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(sum(lens), config.hidden_size, generator=g)
        pos = torch.cat([torch.arange(n) for n in lens])
        first = sum(len(s) for s in STEPS[:step])
        req = torch.cat([torch.full((n,), first + i) for i, n in enumerate(lens)])
        with torch.no_grad():
            cos, sin = rotary(x[None], pos[None])
        steps.append({"x": x, "pos": pos, "req": req, "cos": cos[0], "sin": sin[0]})
    return {"w": w, "dims": dims, "plan": plan, "layout": shards.TPLayout.derive(arch, config, 2), "steps": steps,
            "layer": layer, "rotary": rotary}


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, cos, sin):                    # x [token, heads, D]; cos/sin [token, D] (HF's rotate_half form)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


@torch.no_grad()
def tp_layer(w: dict, d: dict, b: dict, rank: int, world: int, all_reduce) -> dict[str, torch.Tensor]:
    """One Qwen3 decoder layer on one rank's weight shards, as vLLM runs it under TP=world."""
    H, K, D, M, eps = d["H"], d["K"], d["D"], d["M"], d["eps"]
    x, pos, req = b["x"], b["pos"], b["req"]
    hq, hk, rep = H // world, max(1, K // world), max(1, world // K)        # vLLM: num_kv_head_replicas
    q0, k0 = rank * hq, (rank // rep) * hk
    qkv_w = torch.cat([w["self_attn.q_proj.weight"][q0 * D:(q0 + hq) * D],   # QKVParallelLinear's local weight
                       w["self_attn.k_proj.weight"][k0 * D:(k0 + hk) * D],
                       w["self_attn.v_proj.weight"][k0 * D:(k0 + hk) * D]])
    out = {"resid_pre": x}
    h = _rms(x, w["input_layernorm.weight"], eps)
    q, k, v = (h @ qkv_w.T).split([hq * D, hk * D, hk * D], dim=-1)
    q = _rms(q.view(-1, hq, D), w["self_attn.q_norm.weight"], eps)
    k = _rms(k.view(-1, hk, D), w["self_attn.k_norm.weight"], eps)
    v = v.view(-1, hk, D)
    out.update({"attn.q": q, "attn.k": k, "attn.v": v})
    qr, kr = _rope(q, b["cos"], b["sin"]), _rope(k, b["cos"], b["sin"])
    out["attn.k_rot"] = kr
    kk = kr.transpose(0, 1).repeat_interleave(hq // hk, 0)                  # GQA: local q heads -> local kv head
    vv = v.transpose(0, 1).repeat_interleave(hq // hk, 0)
    mask = (req[:, None] == req[None, :]) & (pos[None, :] <= pos[:, None])   # causal, within a request
    scores = qr.transpose(0, 1) @ kk.transpose(-1, -2) * d["scaling"]
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    z = (p @ vv).transpose(0, 1)                                             # [token, local heads, D]
    out["attn.z"] = z
    o_w = w["self_attn.o_proj.weight"][:, q0 * D:(q0 + hq) * D]              # RowParallelLinear: input columns
    out["attn.out"] = attn_out = all_reduce(z.reshape(len(x), -1) @ o_w.T)  # partial sums -> all-reduce
    out["resid_mid"] = resid_mid = x + attn_out
    out["mlp.in"] = hm = _rms(resid_mid, w["post_attention_layernorm.weight"], eps)
    m, c0 = M // world, rank * (M // world)
    gate_up_w = torch.cat([w["mlp.gate_proj.weight"][c0:c0 + m], w["mlp.up_proj.weight"][c0:c0 + m]])
    gate, up = (hm @ gate_up_w.T).split([m, m], dim=-1)                      # MergedColumnParallelLinear
    out["mlp.act"] = act = F.silu(gate) * up
    out["mlp.out"] = mlp_out = all_reduce(act @ w["mlp.down_proj.weight"][:, c0:c0 + m].T)
    out["resid_post"] = resid_mid + mlp_out
    return out


def _coords(step: int, req: torch.Tensor, pos: torch.Tensor) -> dict:
    return {"request": np.array([f"r{int(r)}" for r in req]), "position": pos.numpy().astype(np.int64),
            "step": np.full(len(req), step, np.int64), "phase": np.array(["prefill"] * len(req)),
            "token_id": (100 * req + pos).numpy().astype(np.int64)}     # (stands for the rows' input ids)


def _capture(rank: int, world: int, case: dict, store: str, out: str, barrier, all_reduce) -> None:
    """What a rank's exporter does under TP: rank 0 lays the store out, every rank writes its part."""
    plan, layout = case["plan"], case["layout"]
    if rank == 0:
        shards.create_store(store, plan, layout, "float32", {"model": "tiny-qwen3", "family": "qwen3"},
                            chunk_rows=CHUNK_ROWS)
    barrier()                                  # once, at load: the layout exists before anyone opens it
    local = layout.local_plan(plan, rank)
    writer = shards.ShardWriter(store, plan, layout, rank)
    start = 0
    for step, b in enumerate(case["steps"]):
        acts = tp_layer(case["w"], case["dims"], b, rank, world, all_reduce)
        for s in local.sites:
            t = acts[s.canonical]
            if s.heads is not None:            # head selection in the rank's own (engine-local) indices
                t = t[:, list(s.heads)]
            coords = _coords(step, b["req"], b["pos"]) if writer.writes_coords(s.group) else None
            writer.write(s.group, start, {s.outputs[0].name: t.numpy()[:, None]}, coords)
        start += len(b["x"])
        if step == 0:                          # mid-run commit: the extents cover rows every rank has on disk
            writer.checkpoint()
            barrier()                          # (only so the test knows both checkpoints landed)
            if rank == 0:
                rows = shards.commit(store)
                assert set(rows.values()) == {sum(STEPS[0])}, rows
                import zarr
                q = zarr.open_group(store, mode="r")["layers/attn/q/q"]
                assert q.shape[0] == sum(STEPS[0]) and not np.isnan(q[:]).any()
            barrier()
    writer.close({"sites": [s.name for s in local.sites]})
    Path(out).write_text(json.dumps({k: sorted(v) for k, v in writer.chunks_written.items()}))
    barrier()                                  # every rank closed: rank 0 sets the final extents
    if rank == 0:
        shards.finalize(store, {"rows_stored": start})


def _rank_main(index: int, rank: int, world: int, init: str, tmp: str) -> None:
    """One rank: joins the gloo group, then captures every case as soon as the parent has built it."""
    import datetime

    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))

    def all_reduce(t):
        t = t.contiguous()
        dist.all_reduce(t)
        return t
    try:
        for name in CASES:
            path = Path(f"{tmp}/{name}.pt")
            deadline = time.monotonic() + 120
            while not path.exists():           # the parent builds the cases while the ranks start up
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} never appeared")
                time.sleep(0.02)
            case = torch.load(path, weights_only=False)
            _capture(rank, world, case, f"{tmp}/{name}.zarr", f"{tmp}/{name}.rank{rank}.json", dist.barrier, all_reduce)
    finally:
        dist.destroy_process_group()


def _reference(case: dict) -> dict:
    """TP=1 activations of every step, concatenated (checked against the transformers layer)."""
    steps = [tp_layer(case["w"], case["dims"], b, 0, 1, lambda t: t) for b in case["steps"]]
    b = case["steps"][1]                      # one request: the transformers layer with a causal mask
    n = len(b["x"])
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        rope = case["rotary"](b["x"][None], b["pos"][None])
        hf = case["layer"](b["x"][None], attention_mask=mask, position_embeddings=rope)
    hf = hf[0] if isinstance(hf, tuple) else hf
    np.testing.assert_allclose(steps[1]["resid_post"].numpy(), hf[0].numpy(), atol=2e-5, rtol=1e-5)
    return {k: torch.cat([s[k] for s in steps]).numpy() for k in steps[0]}


def _chunk_files(array_dir: Path) -> set[tuple[int, ...]]:
    root = array_dir / "c"
    return {tuple(int(p) for p in f.relative_to(root).parts) for f in root.rglob("*") if f.is_file()}


def test_two_ranks_write_one_merged_store(tmp_path):
    import torch.multiprocessing as mp
    import xarray as xr
    import zarr
    # rank 1 in a spawned process, rank 0 in this one (it already has torch: one import less)
    other = mp.spawn(_rank_main, args=(1, 2, str(tmp_path / "init"), str(tmp_path)), nprocs=1, join=False)
    try:
        cases = {name: _case(kv) for name, kv in CASES.items()}      # while rank 1 imports torch
        for name, c in cases.items():
            torch.save({k: v for k, v in c.items() if k not in ("layer", "rotary")}, tmp_path / f"{name}.tmp")
            os.replace(tmp_path / f"{name}.tmp", tmp_path / f"{name}.pt")
        threads = torch.get_num_threads()
        try:
            _rank_main(0, 0, 2, str(tmp_path / "init"), str(tmp_path))
        finally:
            torch.set_num_threads(threads)
    except BaseException:
        for p in other.processes:
            p.terminate()
        raise
    while not other.join():
        pass

    for case, kv in CASES.items():
        ref = _reference(cases[case])
        store = tmp_path / f"{case}.zarr"
        root = zarr.open_group(str(store), mode="r")
        assert root.attrs["dmi_status"] == "closed"
        tp = root.attrs["tp"]
        assert tp["world_size"] == 2 and set(tp["sharded_dims"]) == {"head", "kv_head", "mlp"}
        assert tp["sharded_dims"]["kv_head"]["replicas"] == (2 if kv == 1 else 1)
        tree = xr.open_datatree(str(store), engine="zarr", consolidated=True)
        n = sum(map(sum, STEPS))
        for site in SITES:
            grp = "layers/" + site.replace(".", "/")
            da = tree[grp].dataset[site.split(".")[-1]]
            assert da.sizes["token"] == n and da.sizes["layer"] == 1
            want = ref[site][:, HEADS] if site == "attn.q" else ref[site]
            tol = 1e-6 if site in SPLIT or site in ("resid_pre", "mlp.in") else 2e-6
            np.testing.assert_allclose(da.values[:, 0], want, atol=tol, rtol=1e-5, err_msg=f"{case} {site}")
            assert list(tree[grp].dataset["request"].values) == [f"r{i}" for i, n_ in enumerate(sum(STEPS, []))
                                                                for _ in range(n_)]
            steps = [s for s, lens in enumerate(STEPS) for _ in range(sum(lens))]
            assert list(tree[grp].dataset["step"].values) == steps
            ds = tree[grp].dataset
            np.testing.assert_array_equal(ds.token_id.values, 100 * ds.request.str.slice(1).astype(int) + ds.position)
            note = root[grp][site.split(".")[-1]].attrs["tp"]
            assert note["kind"] == ("split" if site in SPLIT else "replicated"), site
        assert list(tree["layers/attn/q"].dataset["head"].values) == HEADS

        # rank notes: who wrote which region; replicated sites by rank 0 only, once
        q = root["layers/attn/q/q"].attrs["tp"]
        assert q["rank"] == {"0": [[1, 3]], "1": [[0, 1]]} and q["chunk"] == 1    # heads [3 | 0, 1]
        z = root["layers/attn/z/z"].attrs["tp"]
        assert z["rank"] == {"0": [[0, 2]], "1": [[2, 4]]} and z["chunk"] == 2
        k = root["layers/attn/k/k"].attrs["tp"]
        assert k["rank"] == ({"0": [[0, 1]], "1": [[1, 2]]} if kv == 2 else {"0": [[0, 1]]})   # kv1: one writer
        notes = [dict(root[f"tp/rank{r}"].attrs) for r in range(2)]
        assert all(nt["status"] == "closed" for nt in notes)
        written = [set(nt["rows"]) for nt in notes]
        replicated = {"layers/" + s.replace(".", "/") for s in SITES if s not in SPLIT}
        assert replicated <= written[0] and not replicated & written[1]
        assert ("layers/attn/k" in written[1]) == (kv == 2)
        # ranks never touched the same chunk file, and every chunk on disk was written by one rank
        chunks = [json.loads((tmp_path / f"{case}.rank{r}.json").read_text()) for r in range(2)]
        for key in set(chunks[0]) | set(chunks[1]):
            a, b = ({tuple(c) for c in ch.get(key, [])} for ch in chunks)
            assert not a & b, f"{case} {key}: both ranks wrote chunks {sorted(a & b)}"
            on_disk = _chunk_files(store / key)        # chunks equal to the fill value are not stored
            assert on_disk <= a | b and (key.rsplit("/", 1)[1] in shards.COORDS or on_disk == a | b), key


def test_layout_of_every_family_and_refusals():
    """Derived shardings: heads, kv heads (replicated below the world size), MLP columns; the rest
    replicated. Reductions over a split dim, uneven splits and other parallelism are refused."""
    from types import SimpleNamespace

    from dmi.models import tiny_config
    from dmi.plan import build_plan
    from dmi.spec import find_arch_spec, load_hook_spec
    for family in ("qwen3", "llama3_1", "qwen3_moe", "mixtral"):
        config = tiny_config(family)
        arch = find_arch_spec(config.model_type)
        lay = shards.TPLayout.derive(arch, config, 4)             # 4 heads, 2 kv heads
        kinds = {c: (s.kind, s.dim) for c, s in lay.sites.items()}
        assert kinds["attn.q"] == kinds["attn.z"] == kinds["attn.pattern"] == ("split", "head")
        assert kinds["attn.k"] == kinds["attn.v"] == ("split", "kv_head")
        assert lay.of("attn.k").replicas == 2 and lay.of("attn.k").holders() == (0, 2)
        assert lay.of("attn.k").engine_slice(3) == (1, 2)
        for c in ("embed", "resid_pre", "resid_mid", "resid_post", "attn.out", "mlp.in", "mlp.out", "final_norm",
                  "logits", "moe.router_logits", "moe.topk_ids", "moe.topk_weights"):
            if c in kinds:
                assert kinds[c] == ("replicated", None), (family, c)
        if "mlp.act" in kinds:
            assert kinds["mlp.act"] == ("split", "mlp")
    config = tiny_config("qwen3")
    arch = find_arch_spec("qwen3")
    with pytest.raises(DmiError, match="not divisible by tensor parallel size 3"):
        shards.TPLayout.derive(arch, config, 3)
    lay = shards.TPLayout.derive(arch, config, 2)
    plan = build_plan(arch, load_hook_spec({"capture": [{"sites": ["mlp.act"], "reduce": {"topk": 4}}]}), config)
    with pytest.raises(DmiError, match="reduce topk runs over mlp"):
        lay.check_plan(plan)
    ok = build_plan(arch, load_hook_spec({"capture": [{"sites": ["attn.q"], "reduce": {"norm": True}}]}), config)
    lay.check_plan(ok)                                            # a norm over head_dim: per head, fine
    local = lay.local_plan(ok, 1)
    assert [o.shape for o in local.sites[0].outputs] == [(2,)]    # this rank's 2 of 4 heads
    with pytest.raises(DmiError, match="pipeline_parallel_size=2"):
        shards.check_parallel(SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=2))
    assert shards.check_parallel(SimpleNamespace(tensor_parallel_size=2)) == 2

    class RowParallelLinear:                                       # the name is what anchor_kind reads
        tp_size, reduce_results = 2, False
    assert "partial sum" in shards.anchor_kind(RowParallelLinear())
    RowParallelLinear.reduce_results = True
    assert shards.anchor_kind(RowParallelLinear()) is None
    root = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(mlp=RowParallelLinear())]))
    RowParallelLinear.reduce_results = False
    plan = build_plan(arch, load_hook_spec({"capture": [{"sites": ["mlp.out"], "layers": [0]}]}), config)
    plan.sites = [replace(s, anchor=arch.data["sites"]["mlp.out"]["vllm"]) for s in plan.sites]
    from dmi.adapters.vllm.patch import resolve
    with pytest.raises(DmiError, match="output of RowParallelLinear .* partial sum"):
        lay.verify_anchors(root, plan, resolve)
    # attn.z is o_proj's (row-parallel) input: a head shard, as derived -> accepted
    attn = SimpleNamespace(o_proj=type("RowParallelLinear", (), {"tp_size": 2, "input_is_parallel": True})())
    root = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(self_attn=attn)]))
    plan = build_plan(arch, load_hook_spec({"capture": [{"sites": ["attn.z"], "layers": [0]}]}), config)
    plan.sites = [replace(s, anchor=arch.data["sites"]["attn.z"]["vllm"]) for s in plan.sites]
    lay.verify_anchors(root, plan, resolve)
    with pytest.raises(DmiError, match="sequence-parallelism compile pass"):
        shards.check_parallel(SimpleNamespace(tensor_parallel_size=2),
                              SimpleNamespace(pass_config=SimpleNamespace(enable_sequence_parallelism=True)))
