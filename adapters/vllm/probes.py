"""Linear probes a request may ask back under ``vllm serve`` (``requests.return.probes``).

The operator names, per probe, a captured site of one layer and a weight file: a vector ``[D]``
(one output) or a matrix ``[k, D]`` (k outputs), ``D`` the site's features per token (the hidden
size for ``resid_post``), and an optional bias (a number, or k of them). The probe is computed in
the forward, on the device, from the value the capture reads at that site (after the site's
interventions unless they say ``capture: before``), in fp32: ``x @ W.T + b`` for every row of the
step into a buffer of the most rows a step carries (allocated at load: a CUDA graph writes it at a
fixed address), through the op ``dmi::probe`` (opaque to torch.compile, like the capture ops).
After the step, :class:`dmi.adapters.vllm.returns.StepReturns` reads the rows of the requests that
asked: the value of their last token.

Checked at load (:func:`plan_probes`), before anything runs, each error naming the hook spec's key
and the fix: the site and layer are captured by the hook spec and read at a module's input or
output on vLLM, the file exists and holds ``[D]`` or ``[k, D]`` numbers, the bias fits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ...graph_inputs import static_inputs
from ...interventions.plan import load_values

_LIB = torch.library.Library("dmi", "FRAGMENT")
_LIB.define("probe(Tensor x, Tensor? y, Tensor(a!) out, Tensor weight, Tensor bias) -> ()")


def _probe(x: torch.Tensor, y, out: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    n = min(x.shape[0], out.shape[0])
    v = x[:n].reshape(n, -1).float()
    if y is not None:
        v = v + y[:n].reshape(n, -1).float()
    torch.addmm(bias, v, weight, out=out[:n])


_LIB.impl("probe", _probe, "CompositeExplicitAutograd")
torch.library.register_fake("dmi::probe", lambda *args, **kwargs: None, lib=_LIB)


@dataclass(frozen=True)
class ProbePlan:
    name: str
    canonical: str
    layer: int | None
    weight: np.ndarray        # [k, D] float32
    bias: np.ndarray          # [k] float32
    vector: bool              # given as [D]: its value is one number, not a list


def _probe_problem(anchor: dict) -> str | None:
    """Why a captured site's value cannot be probed on vLLM (None: it can): the probe reads the
    tensor a module's input or output hands the capture."""
    if "compute" in anchor:
        return "dmi recomputes it for capture only"
    if "assign" in anchor:
        return "it is read inside a module's source, not at a module's input or output"
    if "rows" in anchor:
        return "the engine computes it for the sampled rows only (ask top_logits for the logits)"
    if "order_by" in anchor:
        return "it is a router's choice, not an activation"
    return None


def plan_probes(hook, plan) -> list[ProbePlan]:
    """The hook spec's ``requests.return.probes``, checked against the plan (its sites carry their
    vLLM anchors). Raises :class:`dmi.errors.SpecError` naming file, line and key, with the fix."""
    entries = ((hook.data.get("requests") or {}).get("return") or {}).get("probes") or {}
    sites = plan.by_layer_site()
    out = []
    for name, entry in entries.items():
        path = ("requests", "return", "probes", name)
        canonical, layer = entry["site"], entry.get("layer")
        s = sites.get((canonical, layer))
        if s is None:
            where = f"{canonical!r}" + (f" of layer {layer}" if layer is not None else "")
            captured = sorted({c for c, _ in sites})
            raise hook.error(path + ("site",), f"site {where} is not captured by this hook spec (captured: {captured})",
                             fix=f"add a capture entry for it (capture: [{{sites: [{canonical}]"
                                 f"{f', layers: [{layer}]' if layer is not None else ''}}}]), or probe a captured site")
        why = _probe_problem(s.anchor)
        if why:
            raise hook.error(path + ("site",), f"site {canonical!r} cannot be probed on vLLM: {why}",
                             fix="probe a site read at a module's input or output (resid_post, mlp.out, attn.out, ...)")
        if any(o.kind == "int32" for o in s.outputs):
            raise hook.error(path + ("site",), f"site {canonical!r} holds no activations", fix="probe a float site")
        d = math.prod(s.shape)
        w = load_values(entry["weights"], hook, path + ("weights",))
        if w.ndim not in (1, 2) or w.shape[-1] != d:
            raise hook.error(path + ("weights",), f"the weights have shape {list(w.shape)}; {canonical} has {d} "
                             f"features per token ({' x '.join(map(str, s.shape))})",
                             fix=f"give a vector [{d}] or a matrix [k, {d}] (one row per output)")
        if not np.isfinite(w).all():
            raise hook.error(path + ("weights",), "the weights hold NaN or infinite values", fix="give finite numbers")
        weight = np.atleast_2d(w).astype(np.float32)
        k = weight.shape[0]
        b = np.asarray(entry.get("bias", 0.0), np.float64)
        if b.ndim == 0:
            b = np.full(k, float(b))
        if b.shape != (k,):
            raise hook.error(path + ("bias",), f"the bias has {b.size} values; the probe has {k} output(s)",
                             fix=f"give one number, or a list of {k}")
        out.append(ProbePlan(name, canonical, layer, weight, b.astype(np.float32), vector=w.ndim == 1))
    return out


class Probe:
    """One probe's device state: ``weight`` [D, k], ``bias`` [k] and ``out`` [rows, k], fp32."""

    def __init__(self, plan: ProbePlan, device, rows: int):
        self.plan = plan
        self.weight = torch.tensor(plan.weight.T.copy(), device=device)
        self.bias = torch.tensor(plan.bias, device=device)
        self.out = torch.zeros(rows, plan.weight.shape[0], dtype=torch.float32, device=device)
        static_inputs(self.weight, self.bias, self.out)      # read and written by CUDA graphs

    def __call__(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        """In the forward: the probe of every row of ``x`` (``+ y``: a site held as two tensors)."""
        torch.ops.dmi.probe(x, y, self.out, self.weight, self.bias)

    def values(self, rows) -> np.ndarray:
        """[len(rows), k] of the step's token ``rows`` (a device tensor of indices)."""
        return self.out[rows].cpu().numpy()


class Probes:
    """Every probe of a run, by (canonical, layer) of its site."""

    def __init__(self, plans: list[ProbePlan], device, rows: int):
        self.by_name = {p.name: Probe(p, device, rows) for p in plans}
        self.at: dict[tuple, list[Probe]] = {}
        for p in self.by_name.values():
            self.at.setdefault((p.plan.canonical, p.plan.layer), []).append(p)

    def __bool__(self) -> bool:
        return bool(self.by_name)
