"""``dmi.load`` and ``dmi.open``."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import DmiError, SpecError, StoreError
from .pipeline import build_run, find_arch, plan_run
from .plan import check_memory
from .run import Run
from .spec import load_hook_spec
from .store.preflight import check_resumable, check_store_writer, check_writable


def load(model: Any, hook_spec: str | Path | dict, store: str | Path | None = None, *, backend: str = "hf",
         arch_spec: str | Path | dict | None = None, overwrite: bool = False, resume: bool = False, dtype=None,
         device=None, **engine_kwargs) -> Run:
    """Load (or take) a model, patch the hook spec's sites into it and start capturing into ``store``.

    model: a transformers model, a ``PretrainedConfig``, a built-in tiny model name (``tiny-qwen3``,
    ``tiny-llama3_1``, ``tiny-qwen3_moe``, ``tiny-mixtral``) or a path / hub id for ``from_pretrained``.
    store: the Zarr store's directory; None (and no ``store.path`` in the hook spec): the rows are
    kept for an in-memory result, ``run.result()`` (an ``xarray.DataTree`` shaped as ``dmi.open``
    gives), bounded by ``store.memory_bytes`` (default 2GiB).
    resume: append to an existing store (one whose run crashed, or a closed one) after its last
    committed step; the hook spec and the model must be the ones it was written with.
    """
    if store is not None and not isinstance(store, (str, os.PathLike)):
        raise StoreError(f"dmi.load: store: a {type(store).__name__} ({store!r:.40}) is not a store path. Fix: pass "
                         f"the store's directory as a str or a pathlib.Path (e.g. store='out.zarr'), an object "
                         f"store URL (store='s3://bucket/run.zarr'), or leave it out and set store.path in the hook "
                         f"spec")
    if backend == "vllm":     # engine keywords go to vllm.LLM; the run's .llm is that LLM
        from .adapters import vllm as vllm_adapter
        return vllm_adapter.load(model, hook_spec, store, arch_spec=arch_spec, overwrite=overwrite, dtype=dtype,
                                 **engine_kwargs)
    if backend != "hf":
        raise DmiError(f"backend {backend!r} is not available. Fix: use backend='hf' or backend='vllm'")
    from .adapters import hf
    from .adapters.hf.engine import HFEngine
    hook = load_hook_spec(hook_spec)
    store = store if store is not None else hook.data.get("store", {}).get("path")
    memory_bytes = None
    if store is None:                     # an in-memory result: run.result() (dmi.store.memory)
        if resume:
            raise SpecError("resume=True needs a store to append to", file=hook.file, key="store.path",
                            fix="pass the store's path to dmi.load (store='out.zarr')")
        memory_bytes = _memory_budget(hook)
    if resume and overwrite:
        raise DmiError("dmi.load: resume=True and overwrite=True contradict each other. Fix: pass one of them")
    options = (hook.data.get("store") or {}).get("storage_options")
    if memory_bytes is None:
        check_store_writer(store, hook)
    if memory_bytes is None and resume:   # before the model loads: a store that cannot be resumed fails fast
        check_resumable(store, {"hook_spec": hook.data}, hook.file, options)
    elif memory_bytes is None:
        check_writable(store, overwrite, options)  # before the model loads: a bad store path fails fast
    engine = HFEngine()
    m = engine.resolve_model(model, dtype=dtype, device=device, **engine_kwargs)
    hf.check_unpatched(m)
    arch = find_arch(arch_spec, getattr(m.config, "model_type", None))
    itemsize = m.dtype.itemsize if hasattr(getattr(m, "dtype", None), "itemsize") else 4
    plan = plan_run(engine, m, arch, hook, m.config, itemsize)
    check_memory(plan, _device_of(m), hook)      # before the ring is allocated
    from .adapters.hf.probe import check_sites
    check_sites(m, plan, arch)                   # spec mistakes at load, not at the first forward
    return build_run(engine, m, plan, arch, store, keep_store=resume, overwrite=overwrite, resume=resume,
                     memory_bytes=memory_bytes)


def _memory_budget(hook) -> int:
    """store.memory_bytes (the in-memory result's budget), refused past the host's memory."""
    from .spec import parse_bytes
    from .store.memory import DEFAULT_MEMORY_BYTES, KEY, host_memory_bytes
    for path, value in ((("policy", "drain"), hook.data.get("policy", {}).get("drain")),
                        (("store", "writer"), hook.data.get("store", {}).get("writer"))):
        if value in ("process", "pool"):       # before the model loads
            raise hook.error(path, f"{'.'.join(path)}: {value} writes a store from another process; an in-memory "
                                   f"result (no store path) is written by this one",
                             fix=f"remove {'.'.join(path)}, or pass a store path to dmi.load")
    value = hook.data.get("store", {}).get("memory_bytes")
    budget = DEFAULT_MEMORY_BYTES if value is None else parse_bytes(value)
    host = host_memory_bytes()
    if value is not None and host is not None and budget > host:
        raise hook.error(("store", "memory_bytes"), f"{KEY} is {budget:,} bytes, more than this host's memory "
                         f"({host:,} bytes)", fix="lower store.memory_bytes, or pass a store path to dmi.load to "
                                                  "write a store on disk")
    return budget


def _device_of(model):
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else None
