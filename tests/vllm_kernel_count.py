"""The kernels of vLLM's compiled model with and without dmi, counted from inductor's generated
code (tests/test_vllm_compiled.py pins that a capture adds no kernel). The engines run one after
another in one process with ``TORCH_LOGS=output_code`` and no compile cache of vLLM's or inductor's
whole graphs (each engine compiles, and logs, all its code; C++ kernels built from the same source
are shared); this file is that process's entry point too (``python tests/vllm_kernel_count.py
SITES ENGINE...``)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HIDDEN = "resid_post,final_norm"          # the hidden-states spec's sites (with last-token logits)
# tests/test_vllm.py's prompts, greedy: the vanilla engine's tokens are also the reference of the
# compiled engine with dmi there (one compile of vanilla for both tests)
PROMPTS = ["Hello world! How are you", "Paris", "The quick brown fox jumps over the lazy dog today"]
MAX_TOKENS = 8
KERNEL_CALL = re.compile(r"^\s+((?:cpp_fused|triton_)\w*?)(?:\.run)?\(", re.M)


def engine(which: str, sites: str = HIDDEN) -> None:
    """One engine, vanilla or with dmi capturing ``sites`` (and last-token logits); prints its tokens.
    ``dmi``: the site op inline; ``dmi-side``: the capture ops chained onto a side stream
    (``dmi.kernels.side``; on the CPU, where no graph is captured, the chain pass on the whole graph)."""
    import torch
    import dmi
    from dmi.adapters.vllm import save_builtin
    from vllm import LLM, SamplingParams
    path = save_builtin("tiny-qwen3")
    kw = dict(kv_cache_memory_bytes=256 << 20, enforce_eager=False, max_model_len=64, enable_prefix_caching=False,
              dtype="bfloat16" if torch.cuda.is_available() else "float32")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    prompts = PROMPTS
    options = {"side": "off"} if which == "dmi" else {}        # the hook spec's engine section
    if which == "dmi-side":
        if torch.cuda.is_available():
            options = {"side": "all"}
        else:
            from vllm.compilation.passes.inductor_pass import CallableInductorPass
            from dmi.kernels.side import chain_captures
            kw["compilation_config"] = {"inductor_compile_config": {
                "post_grad_custom_post_pass": CallableInductorPass(chain_captures, uuid="dmi-fusion-side")}}
    if which == "vanilla":
        outs = LLM(path, **kw).generate(prompts, params, use_tqdm=False)
    else:
        spec = {"capture": [{"sites": sites.split(",")}, {"sites": ["logits"], "tokens": "last"}], "engine": options}
        with tempfile.TemporaryDirectory() as tmp:
            run = dmi.load(path, hook_spec=spec, store=Path(tmp) / "v.zarr", backend="vllm", **kw)
            try:
                outs = run.llm.generate(prompts, params, use_tqdm=False)
            finally:
                run.shutdown()
    print("TOKENS", [list(o.outputs[0].token_ids) for o in outs], flush=True)


MARK = "=== engine "         # the child's line before each engine, on stdout and stderr


def rows(sites: str = HIDDEN, engines: tuple = ("vanilla", "dmi")) -> list[tuple]:
    """(engine, compiled graphs, kernel calls, dmi op calls, tokens, graphs calling dmi ops) of each
    engine's compiled code (``engines``: vanilla, dmi, dmi-side)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCH_LOGS="output_code", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_DISABLE_COMPILE_CACHE="1", TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0", VLLM_CACHE_ROOT=cache,
                   TORCHINDUCTOR_CACHE_DIR=str(Path(cache) / "inductor"))
        got = subprocess.run([sys.executable, __file__, sites, *engines], env=env,
                             capture_output=True, text=True, timeout=1800)
    if got.returncode:
        raise AssertionError(f"engines {engines} failed ({got.returncode}):\n{got.stderr[-3000:]}")
    logs = dict(_by_engine(got.stderr)), dict(_by_engine(got.stdout))
    out = []
    for which in engines:
        err, std = logs[0][which], logs[1][which]
        code = "\n".join(line.split("[__output_code]", 1)[1][1:] for line in err.splitlines()
                         if "[__output_code]" in line)
        tokens = next(line[7:] for line in std.splitlines() if line.startswith("TOKENS "))
        graphs = code.split("Output code:")[1:]
        out.append((which, len(graphs), len(KERNEL_CALL.findall(code)), code.count("torch.ops.dmi."), tokens,
                    sum("torch.ops.dmi." in g for g in graphs)))
    return out


def _by_engine(text: str):
    """(engine, its part of ``text``) for each ``MARK`` line of the child's output."""
    parts = text.split("\n" + MARK)
    for part in parts[1:]:
        which, _, rest = part.partition("\n")
        yield which.strip(), rest


def main(sites: str, *engines: str) -> None:
    """Each engine in turn, from Dynamo's initial state, its output marked."""
    import torch
    for which in engines:
        torch._dynamo.reset()
        for stream in (sys.stdout, sys.stderr):
            print(f"\n{MARK}{which}", file=stream, flush=True)
        engine(which, sites)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this checkout's dmi
    main(*sys.argv[1:])
