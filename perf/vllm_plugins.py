"""vLLM general plugin for perf/online.py (benchmark only; not part of dmi).

perf/online.py copies this file next to a generated ``*.dist-info`` whose entry point
(``vllm.general_plugins``) names :func:`register`, and puts that folder on the server's PYTHONPATH,
so vLLM loads it in every process it starts (API server, engine core). It does nothing unless
asked through the environment:

* ``DMI_PERF_SINK=host``: dmi's exporter drops the rows it is handed (counted, not written): the
  capture path (kernels, ring, drain to pinned host memory) without the Zarr store, as the
  "-> host" rows of perf/offline.py. Run accounting (steps, bytes drained, drops) is still closed
  into the store's attributes.
* ``DMI_PERF_HOOKS=1``: the naive baseline. After the worker loads the model, PyTorch forward hooks
  copy every decoder layer's residual stream (``hidden_states + residual``), the final norm and the
  logits to the CPU with a blocking ``.to("cpu")``. Needs ``--enforce-eager`` (hooks do not run
  inside CUDA graphs).
"""
from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger("dmi.perf")
_done = False


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    if os.environ.get("DMI_PERF_SINK") == "host":
        _host_sink()
    if os.environ.get("DMI_PERF_HOOKS", "") not in ("", "0"):
        from dmi.adapters.vllm.compat import WORKER_MODULE, when_imported
        when_imported(WORKER_MODULE, _hook_worker)


def _host_sink() -> None:
    from dmi.exporter import ZarrExporter
    if getattr(ZarrExporter.write_step, "__dmi_perf__", False):
        return

    def write_step(self, ctrl, records, *args, **kwargs) -> None:
        """The rows reached host memory: dropped, with no per-record Python (this thread shares the
        engine's GIL; the run's own accounting counts what was drained)."""

    write_step.__dmi_perf__ = True
    ZarrExporter.write_step = write_step


class Sink:
    """Bytes the hooks copied to the CPU (logged every 500 forwards)."""
    bytes = 0
    calls = 0

    @classmethod
    def take(cls, t) -> None:
        cls.bytes += t.element_size() * t.numel()
        t.detach().to("cpu")


def _hook_worker(mod) -> None:
    cls = mod.Worker
    inner = cls.load_model

    @functools.wraps(inner)
    def load_model(self, *args, **kwargs):
        out = inner(self, *args, **kwargs)
        model = self.model_runner.get_model()
        _install_hooks(model)
        return out
    cls.load_model = load_model


def _install_hooks(model) -> None:
    import torch

    def layer_hook(module, args, out):
        if isinstance(out, tuple):
            h, r = out[0], out[1] if len(out) > 1 else None
            Sink.take(h + r if isinstance(r, torch.Tensor) else h)
        else:
            Sink.take(out)

    def first(module, args, out):
        Sink.take(out[0] if isinstance(out, tuple) else out)

    def logits_hook(module, args, out):
        if isinstance(out, torch.Tensor):
            Sink.take(out)
        Sink.calls += 1
        if Sink.calls % 500 == 0:
            log.warning("dmi perf hooks: %d logits calls, %.2f GB copied to the CPU", Sink.calls, Sink.bytes / 1e9)

    inner = getattr(model, "model", model)
    layers = list(getattr(inner, "layers", []))
    for layer in layers:
        layer.register_forward_hook(layer_hook)
    if getattr(inner, "norm", None) is not None:
        inner.norm.register_forward_hook(first)
    if getattr(model, "logits_processor", None) is not None:
        model.logits_processor.register_forward_hook(logits_hook)
    log.warning("dmi perf hooks: %d layer hooks + final norm + logits, copying to the CPU", len(layers))
