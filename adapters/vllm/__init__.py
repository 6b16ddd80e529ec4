"""vLLM adapter: the architecture specs' ``vllm`` anchors patched into vLLM's model classes.

Offline::

    run = dmi.load("path/or/hub-id", hook_spec="hooks.yaml", store="out.zarr", backend="vllm",
                   kv_cache_memory_bytes=256 << 20)       # other keywords go to vllm.LLM
    run.llm.generate(prompts, SamplingParams(...))        # a normal vllm.LLM; every step is captured
    run.close()

Online: ``vllm serve`` with the plugin (``dmi.adapters.vllm.plugin``). Modules: ``compat`` (every
vLLM internal dmi reads, one file), ``patch`` (anchors -> model), ``steps`` (scheduler batch ->
token rows), ``worker`` (the run inside the worker process), ``policy`` (per-request control and
the operator's limits), ``plugin`` (entry point and configuration). Gap report: docs/vllm.md.
"""
from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

from ...errors import DmiError, SpecError


class VllmRun:
    """What ``dmi.load(..., backend="vllm")`` returns: ``.llm`` is a normal ``vllm.LLM``."""

    def __init__(self, llm, token: str, store: str, session=None):
        self.llm, self.token, self.store, self._session = llm, token, store, session
        self._closed = False

    @property
    def run(self):
        """The :class:`dmi.run.Run` when the engine runs in this process (else None)."""
        return self._session.run if self._session is not None else None

    @property
    def plan(self):
        return self.run.plan if self.run is not None else None

    def stats(self) -> dict:
        return self.run.stats() if self.run is not None else {}

    def subscribe(self, fn, sites=None):
        """:meth:`dmi.run.Run.subscribe` on the engine's run: needs the engine in this process
        (``dmi.load`` sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless told otherwise)."""
        if self.run is None:
            raise DmiError("subscribe: vLLM's engine runs in another process, where the captures are drained. "
                           "Fix: load with VLLM_ENABLE_V1_MULTIPROCESSING=0 (dmi.load's default), or read the store")
        return self.run.subscribe(fn, sites)

    def set_intervention(self, name: str, **values) -> None:
        """:meth:`dmi.run.Run.set_intervention` on the engine's run (in-process engines): new values
        from the next step on, with the engine's compiled graphs and CUDA graphs as they are."""
        if self.run is None:
            raise DmiError("set_intervention: vLLM's engine runs in another process. Fix: load with "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 (dmi.load's default)")
        self.run.set_intervention(name, **values)

    def refused_requests(self) -> dict[str, str]:
        """Request id -> why its dmi options were narrowed in the worker (in-process engines)."""
        return dict(self._session.gate.refused) if self._session is not None else {}

    def close(self) -> None:
        """Flush and close the store (the LLM stays usable, without capture)."""
        if self._closed:
            return
        self._closed = True
        if self._session is not None:
            self._session.close()
        else:               # the engine runs in other processes: close there (a Worker method dmi adds)
            self.llm.collective_rpc("dmi_close_session", kwargs={"token": self.token})

    def shutdown(self) -> None:
        """Close the store, then shut the engine down (frees its memory; the LLM is unusable after)."""
        from . import compat
        try:
            self.close()
        finally:
            compat.shutdown_llm(self.llm)

    def __enter__(self) -> "VllmRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<dmi.VllmRun store={self.store!r}{' closed' if self._closed else ''}>"


def load(model: Any, hook_spec, store=None, *, arch_spec=None, overwrite: bool = False, dtype=None,
         **llm_kwargs) -> VllmRun:
    """Start a ``vllm.LLM`` with dmi's capture on. ``model``: a path, a hub id or a built-in tiny
    model name (saved to a temporary directory first). Keywords go to ``vllm.LLM``."""
    from ...store.preflight import check_store_writer, check_writable
    from ...spec import load_hook_spec
    from . import compat, plugin
    from .worker import SESSIONS
    hook = load_hook_spec(hook_spec)                  # errors before the engine starts
    store = store if store is not None else hook.data.get("store", {}).get("path")
    if store is None and not hook.data.get("capture"):
        store = f"memory://dmi-{uuid.uuid4().hex}"     # interventions only: nothing to keep, no store needed
    if store is None:
        raise SpecError("no store given (an in-memory result, store=None, is for backend='hf')", file=hook.file,
                        key="store.path", fix="pass store='out.zarr' to dmi.load, or set store.path in the hook spec")
    options = (hook.data.get("store") or {}).get("storage_options")
    check_store_writer(store, hook)
    check_writable(store, overwrite, options)
    check_parallel_kwargs(llm_kwargs)                 # refused here, not as "WorkerProc initialization failed"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")    # engine core in this process: the run lives here
    compat.prefer_v1_runner()
    plugin.register()
    from vllm import LLM
    token = uuid.uuid4().hex
    spec_arg = hook.data if isinstance(hook_spec, dict) else str(Path(hook_spec).resolve())
    extra = dict(llm_kwargs.pop("additional_config", None) or {})
    from ...store.location import Local, open_location
    loc = open_location(store, options)                # (file:// is a local directory; an object store's URL as given)
    store = str(loc.path.resolve()) if isinstance(loc, Local) else loc.url
    extra["dmi"] = {"hook_spec": spec_arg, "store": store, "overwrite": bool(overwrite),
                    "token": token, "serving": False, **({"arch_spec": str(arch_spec)} if arch_spec is not None else {})}
    if dtype is not None:
        llm_kwargs["dtype"] = dtype
    llm = LLM(model=_model_path(model), additional_config=extra, **llm_kwargs)
    session = SESSIONS.get(token)
    return VllmRun(llm, token, store, session)


def check_parallel_kwargs(llm_kwargs: dict) -> int:
    """Refuse, before the engine starts, a parallel layout dmi cannot merge (``dmi.store.shards.check_parallel``:
    pipeline / data / decode-context / expert parallelism, sequence parallelism) and, on vLLM's CPU
    backend, a tensor parallel engine vLLM cannot bind (fewer NUMA nodes than ranks and no
    ``VLLM_CPU_OMP_THREADS_BIND``). Returns the tensor parallel size. The workers check the engine's
    resolved config again (``worker.start``)."""
    from types import SimpleNamespace

    from ...store import shards
    from . import compat
    bad = {k: llm_kwargs[k] for k in compat.PARALLEL_KEYS if k in llm_kwargs and k != "enable_expert_parallel"
           and not (isinstance(llm_kwargs[k], int) and not isinstance(llm_kwargs[k], bool) and llm_kwargs[k] >= 1)}
    if bad:
        k, v = next(iter(bad.items()))
        raise DmiError(f"dmi.load(backend='vllm'): {k}={v!r}: expected an integer >= 1. Fix: pass {k}=1 (or leave it out)")
    comp = llm_kwargs.get("compilation_config")
    if isinstance(comp, dict):
        passes = comp.get("pass_config")
        comp = SimpleNamespace(pass_config=SimpleNamespace(**passes) if isinstance(passes, dict) else passes)
    try:
        world = shards.check_parallel(SimpleNamespace(**{k: llm_kwargs.get(k) for k in compat.PARALLEL_KEYS}), comp)
    except DmiError as e:
        keys = [k for k in compat.PARALLEL_KEYS[1:] if llm_kwargs.get(k) is True or
                (type(llm_kwargs.get(k)) is int and llm_kwargs[k] > 1)]
        fix = ", ".join(f"{k}={'False' if k == 'enable_expert_parallel' else 1}" for k in keys) or \
            "compilation_config without the sequence-parallelism pass"
        raise DmiError(f"dmi.load(backend='vllm'): {e.args[0].split('. Fix:')[0]}. Fix: pass {fix} "
                       f"(tensor_parallel_size > 1 is supported)") from None
    if world > 1 and compat.is_cpu_platform():
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        nodes = compat.cpu_numa_nodes()
        if bind in ("", "auto") and nodes < world:
            cores = os.cpu_count() or world
            per = max(1, cores // world)
            example = "|".join(f"{r * per}" if per == 1 else f"{r * per}-{(r + 1) * per - 1}" for r in range(world))
            raise DmiError(f"dmi.load(backend='vllm'): tensor_parallel_size={world} on vLLM's CPU backend binds each "
                           f"rank to its own NUMA node, and this machine has {nodes}: vLLM's workers would fail to "
                           f"start. Fix: set VLLM_CPU_OMP_THREADS_BIND to one core list per rank, e.g. "
                           f"VLLM_CPU_OMP_THREADS_BIND={example!r}, or pass tensor_parallel_size=1")
    return world


def _model_path(model) -> str:
    from ...models import BUILTIN
    if isinstance(model, str) and model in BUILTIN:
        return save_builtin(model)
    if isinstance(model, (str, Path)):
        return str(model)
    raise DmiError(f"dmi.load(backend='vllm'): model: vLLM loads models from a path or hub id, not a "
                   f"{type(model).__name__}. Fix: save it with save_pretrained(dir) (and its tokenizer) and pass dir")


def save_builtin(name: str, seed: int = 0, directory: str | None = None) -> str:
    """Save a built-in tiny model and the tiny tokenizer where vLLM can load them (once per name/seed).

    vLLM's CPU attention needs head_dim >= 32: a built-in config with a smaller one (tiny-qwen3_moe
    derives 16) is saved with head_dim=32. Load the same directory with transformers for HF."""
    import torch
    import transformers as tf
    from ...models import BUILTIN, tiny_config, tiny_tokenizer
    config = tiny_config(BUILTIN[name])
    if (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) < 32:
        config.head_dim = 32
    root = Path(directory or os.path.join(tempfile.gettempdir(), "dmi-tiny-models"))
    path = root / f"{name}-seed{seed}"
    if not (path / "config.json").exists():
        tmp = root / f".{name}-{uuid.uuid4().hex}"
        torch.manual_seed(seed)
        tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp)
        tiny_tokenizer().save_pretrained(tmp)
        try:
            tmp.rename(path)
        except OSError:       # another process saved it first
            pass
    return str(path)
