"""What do interventions cost when declared but disabled, and when on? (compiled generate, CUDA graphs)

Three instances sharing one model's weights run ``generate()`` in turn, each round (the order
rotating from round to round): vanilla; dmi capturing one small site (the final norm at each
request's last token) and nothing else (``capture``); the same plus ``--sites`` interventions (an
``add`` at each layer's ``resid_post``, and as many ``zero`` ablations at ``attn.z`` with a token
window) declared with ``enabled: false`` (``disabled``); and, last, the same interventions
switched on between rounds with ``run.set_intervention`` (``enabled``: the same compiled graph,
no recompile). The disabled
interventions' null cost is ``(disabled - capture) / vanilla``; the target is at most 0.5 %.

``--gpu-busy`` adds, per configuration, one generate() under torch.profiler (a diagnostic: the
profiler's own cost is in its wall time): GPU busy ms per decode step, kernels per step, the host
µs of Dynamo's cache lookups, and the kernels whose GPU time differs most between ``disabled`` and
``capture``. It tells a graph that replays slower from host work between the replays.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]   # common; this checkout's dmi

import dmi  # noqa: E402
from common import (DEV, build, config, gen_kwargs, gpu_profile, md_header, md_row, prompts, rotated, store_dir,  # noqa: E402
                    timed, twin)


def spec(model, layers: int, enabled: bool) -> dict:
    cfg = model.config
    hidden = cfg.hidden_size
    ivs = []
    for i in range(layers):
        ivs.append({"name": f"steer{i}", "site": "resid_post", "layers": [i], "kind": "add",
                    "vector": [0.01] * hidden, "enabled": enabled})
        ivs.append({"name": f"ablate{i}", "site": "attn.z", "layers": [i], "kind": "zero", "heads": [0],
                    "tokens": {"positions": [0, 8]}, "enabled": enabled})
    return {"capture": [{"sites": ["final_norm"], "tokens": "last"}], "interventions": ivs,
            "policy": {"ring_bytes": "256MiB"}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    ap.add_argument("--sites", type=int, default=0, help="layers with interventions (default: every layer)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gpu-busy", action="store_true", help="profile one more generate() per configuration")
    args = ap.parse_args(argv)

    model = build(args.model)
    layers = args.sites or config(args.model).num_hidden_layers
    inputs, _ = prompts(args.batch, 16, 192, model.config.vocab_size)
    kw = gen_kwargs(args.mode, args.new_tokens)
    root = store_dir()
    cap_model, iv_model = twin(model), twin(model)
    cap_run = dmi.load(cap_model, hook_spec={k: v for k, v in spec(model, layers, False).items() if k != "interventions"},
                       store=root / "capture.zarr")
    iv_run = dmi.load(iv_model, hook_spec=spec(model, layers, False), store=root / "interventions.zarr")
    configs = {"vanilla": lambda: model.generate(**inputs, **kw),
               "capture": lambda: cap_run.model.generate(**inputs, **kw),
               "disabled": lambda: iv_run.model.generate(**inputs, **kw)}
    steps = kw["max_new_tokens"]
    n = 2 * layers
    with torch.no_grad():
        for fn in configs.values():          # compile and capture the graphs
            fn()
        times: dict[str, list[float]] = {k: [] for k in [*configs, "enabled"]}
        for r in range(args.rounds):
            for name in rotated(list(configs), r):
                times[name].append(timed(configs[name]))
        names = list(iv_run.interventions.by_name)
        for name in names:
            iv_run.set_intervention(name, enabled=True)
        iv_run.model.generate(**inputs, **kw)
        for _ in range(args.rounds):
            times["enabled"].append(timed(configs["disabled"]))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{args.model}, batch {args.batch}, {args.new_tokens} new tokens, {args.mode}, {DEV}; "
              f"{n} interventions on {layers} layers; median of {args.rounds} rounds\n")
        print(md_header(["config", "seconds", "vs vanilla", "vs capture"]))
        for name, t in med.items():
            print(md_row([name, f"{t:.3f}", f"{t / med['vanilla']:.4f}", f"{t / med['capture']:.4f}"]))
        null = (med["disabled"] - med["capture"]) / med["vanilla"]
        print(f"\nnull cost of the disabled interventions: {null:+.2%} of vanilla (target <= 0.5%); "
              f"declared off against vanilla itself: {med['disabled'] / med['vanilla'] - 1:+.2%}")
        print(f"per intervention and generated token: declared off "
              f"{(med['disabled'] - med['capture']) / n / steps * 1e6:+.2f} µs, "
              f"switched on {(med['enabled'] - med['disabled']) / n / steps * 1e6:+.2f} µs more", flush=True)
        if args.gpu_busy:            # after the table: profiling is slow, and a time limit keeps what came before
            print("\nunder torch.profiler, per decode step (diagnostic)\n")
            print(md_header(["config", "wall ms", "GPU busy ms", "compute ms", "kernels", "cache lookup µs"]))
            busy = {"enabled": gpu_profile(configs["disabled"], steps)}
            for name in names:
                iv_run.set_intervention(name, enabled=False)
            for k, fn in configs.items():
                busy[k] = gpu_profile(fn, steps)
            for name, b in busy.items():
                print(md_row([name, f"{b['wall_ms']:.3f}", f"{b['busy_ms']:.3f}", f"{b['compute_ms']:.3f}",
                              f"{b['kernels']:.1f}", f"{b['lookup_us']:.1f}"]))
            off, cap = busy["disabled"]["by_name"], busy["capture"]["by_name"]
            delta = sorted(((off.get(k, 0) - cap.get(k, 0), k) for k in {*off, *cap}), key=lambda d: -abs(d[0]))
            print("\nkernels, disabled - capture, µs per step:")
            for d, k in delta[:12]:
                print(f"  {d:+9.1f}  {k}")
    cap_run.close()
    iv_run.close()

if __name__ == "__main__":
    main()
