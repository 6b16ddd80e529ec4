"""Where dmi's per-step overhead goes on a GPU: micro-timings of the site-op path, and profiles of
eager and compiled (reduce-overhead) decode steps, vanilla vs dmi null.

    python perf/diagnose.py [--layers 4]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dmi   # noqa: E402
import dmi.siteop   # noqa: E402,F401  (registers the ops)
from offline import MODELS, gen_kwargs, prompts   # noqa: E402


def per_call(fn, n=2000) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def build(layers: int):
    import transformers as tf
    cls, kw = MODELS["qwen3-0.6b"]
    cfg = getattr(tf, cls)(**{**kw, "num_hidden_layers": layers}, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def profile(label, fn, rows=18):
    from torch.profiler import ProfilerActivity, profile as prof
    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    ka = p.key_averages()
    launches = {k.key: k.count for k in ka if k.key in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel",
                                                           "cuLaunchKernelEx", "cudaLaunchKernelExC")}
    print(f"\n### {label}: launches {launches}")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new", type=int, default=16)
    args = ap.parse_args()
    from dmi.kernels import capture as K

    model = build(args.layers)
    enc, _ = prompts(16, 16, 64, model.config.vocab_size)
    spec = {"capture": [{"sites": ["resid_post", "final_norm"]}, {"sites": ["logits"], "tokens": "last"}]}
    new = args.new

    # --- micro: the pieces of one eager capture --------------------------------------------------
    x = torch.randn(16, 1, 1024, dtype=torch.bfloat16, device="cuda")
    ticket = torch.zeros(1, dtype=torch.int64, device="cuda")
    print(f"op dispatch, no run registered: {per_call(lambda: torch.ops.dmi.capture(x, ticket, 99999, -1, ticket)):.1f} us/call")
    run = dmi.load(model, hook_spec=spec, store="/tmp/diag.zarr", overwrite=True)
    run.set_enabled(False)
    site = run.plan.sites[0]
    print(f"ring.capture (null, launch):    {per_call(lambda: run.ring.capture(site, x)):.1f} us/call")
    print(f"op -> ring.capture (null):      {per_call(lambda: torch.ops.dmi.capture(x, run.ticket, run.id, -1, run.site_tensors[0])):.1f} us/call")
    launcher = run.ring.sites[0]
    print(f"_SiteLaunch.launch (null):      {per_call(lambda: launcher.launch(run.ring, x, None)):.1f} us/call")
    r = run.ring
    geo = K.direct_geometry(x, ["batch", "seq", "hidden"], 16)
    print(f"K.launch (null):                {per_call(lambda: K.launch(x, r.payload, r.ctrl, r.meta_dev, site_index=0, meta_records=r.meta_records, K=16, src_seq=1, geometry=geo[1:], mode=K.DIRECT, row_bytes0=2048)):.1f} us/call")
    print(f"device_end:                     {per_call(r.device_end):.1f} us/call")

    def gen():
        model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    profile("eager dmi null", gen)
    run.close()
    profile("eager vanilla", gen)

    # --- compiled ----------------------------------------------------------------------------------
    from torch._dynamo.utils import counters
    kw = gen_kwargs("compiled", new)

    def cgen():
        model.generate(**enc, **kw)

    import logging
    torch._logging.set_logs(perf_hints=True, graph_breaks=True, recompiles=True)
    cases = (("compiled vanilla", None, True), ("compiled dmi null", "null", True), ("compiled dmi hidden", "on", True),
             ("compiled dmi null, graph_partition=False", "null", False))
    for label, setup, partition in cases:
        torch._inductor.config.graph_partition = partition
        torch._dynamo.reset()
        counters.clear()
        run = None
        if setup:
            run = dmi.load(model, hook_spec=spec, store="/tmp/diag.zarr", overwrite=True)
            run.set_enabled(setup == "on")
        cgen()
        cgen()
        ts = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            cgen()
            if run is not None:
                run.flush()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        print(f"\n{label}: {np.median(ts) * 1e3 / new:.3f} ms/step  counters: "
              f"{ {k: dict(v) for k, v in counters.items() if k in ('inductor', 'stats', 'graph_break')} }")
        profile(label, cgen, rows=14)
        if run is not None:
            print(run.stats())
            run.close()
    torch._dynamo.reset()
    del logging


if __name__ == "__main__":
    main()
