"""What do interventions cost when declared but disabled, and when on? (compiled generate, CUDA graphs)

Three instances sharing one model's weights run ``generate()`` in turn, each round (the order
rotating from round to round): vanilla; dmi capturing one small site (the final norm at each
request's last token) and nothing else (``capture``); the same plus ``--sites`` interventions (an
``add`` at each layer's ``resid_post``, and as many ``zero`` ablations at ``attn.z`` with a token
window) declared with ``enabled: false`` (``disabled``); and, last, the same interventions switched on between rounds with
``run.set_intervention`` (``enabled``: the same compiled graph, no recompile). The disabled
interventions' null cost is ``(disabled - capture) / vanilla``; the target is at most 0.5 %.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]   # common; this checkout's dmi

import dmi  # noqa: E402
from common import DEV, build, config, gen_kwargs, md_header, md_row, prompts, rotated, store_dir, timed, twin  # noqa: E402


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
    with torch.no_grad():
        for fn in configs.values():          # compile and capture the graphs
            fn()
        times: dict[str, list[float]] = {k: [] for k in [*configs, "enabled"]}
        for r in range(args.rounds):
            for name in rotated(list(configs), r):
                times[name].append(timed(configs[name]))
        for name in [n for n in iv_run.interventions.by_name]:
            iv_run.set_intervention(name, enabled=True)
        iv_run.model.generate(**inputs, **kw)
        for _ in range(args.rounds):
            times["enabled"].append(timed(configs["disabled"]))
    cap_run.close()
    iv_run.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.model}, batch {args.batch}, {args.new_tokens} new tokens, {args.mode}, {DEV}; "
          f"{2 * layers} interventions on {layers} layers; median of {args.rounds} rounds\n")
    print(md_header(["config", "seconds", "vs vanilla", "vs capture"]))
    for name, t in med.items():
        print(md_row([name, f"{t:.3f}", f"{t / med['vanilla']:.4f}", f"{t / med['capture']:.4f}"]))
    null = (med["disabled"] - med["capture"]) / med["vanilla"]
    print(f"\nnull cost of the disabled interventions: {null:+.2%} of vanilla (target <= 0.5%); "
          f"declared off against vanilla itself: {med['disabled'] / med['vanilla'] - 1:+.2%}")


if __name__ == "__main__":
    main()
