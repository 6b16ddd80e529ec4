"""What dmi's site op does to inductor's kernels: the generated code of a compiled forward with and
without dmi, counted.

    python perf/fusion.py [--model tiny] [--tokens 24]

Compiles the model's forward (``torch.compile(fullgraph=True)``, inductor) twice, the vanilla
model and a twin carrying dmi's hidden-states spec (every layer's ``resid_post`` and the final
norm), and prints the kernels each one's generated code launches (Triton on a GPU, C++ on the
CPU) and the calls of dmi's op. ``dmi::capture`` is opaque to inductor: a kernel that would read
the site's tensor and go on computing (a residual add and the next RMSNorm) is split around it.
Outside a CUDA graph every extra kernel is a host launch (vLLM's steps above its largest graph).

Then the same question for a capture written as traced torch ops instead: a scatter of the rows
into a ring tensor at indices read from a control tensor (``ring.index_put_``), between a
residual add and an RMSNorm. Printed: the kernels that step compiles to (one, where inductor folds
the scatter into the kernel computing the rows) and whether the ring holds the rows.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dmi   # noqa: E402
from offline import DEV, build, twin   # noqa: E402

KERNEL_CALL = re.compile(r"^\s+((?:cpp_fused|triton_)\w*?)(?:\.run)?\(", re.M)


def kernels(fn, *args, **kwargs) -> tuple[list[str], int]:
    """(kernel calls, dmi op calls) in the code inductor generates for ``fn``."""
    torch._dynamo.reset()
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args, **kwargs)
    code = "\n".join(codes)
    return KERNEL_CALL.findall(code), code.count("torch.ops.dmi.")


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
    calls, _ = kernels(step, x, r)
    s = x + r
    return calls, bool(torch.equal(ring[100:100 + rows - 3], s[:rows - 3]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="a model of perf/offline.py (random weights)")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args(argv)
    model = build(args.model)
    carrier = twin(model)
    spec = {"capture": [{"sites": ["resid_post", "final_norm"]}],
            "policy": {"mode": "full", "ring_bytes": 256 << 20, "host_bytes": 256 << 20}}
    ids = torch.randint(3, model.config.vocab_size, (2, args.tokens), device=DEV)
    with tempfile.TemporaryDirectory() as tmp, dmi.load(carrier, hook_spec=spec, store=Path(tmp) / "s.zarr") as run:
        rows = [("vanilla", *kernels(model.model, input_ids=ids)),
                (f"dmi ({len(run.plan.sites)} sites)", *kernels(carrier.model, input_ids=ids))]
    print(f"{args.model} on {DEV}, forward of 2 x {args.tokens} tokens, {model.config.num_hidden_layers} layers\n")
    print("| forward | kernel calls | dmi op calls |\n| --- | ---: | ---: |")
    for label, calls, ops in rows:
        print(f"| {label} | {len(calls)} | {ops} |")
    calls, held = scatter_step()
    print(f"\ncapture as a traced scatter (add, index_put_ into the ring, RMSNorm): {len(calls)} kernel(s) "
          f"{calls}; ring holds the rows: {held}")


if __name__ == "__main__":
    main()
