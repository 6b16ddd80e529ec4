"""vLLM general plugin for perf/online.py (benchmark only; not part of dmi).

perf/online.py copies this file next to a generated ``*.dist-info`` whose entry point
(``vllm.general_plugins``) names :func:`register`, and puts that folder on the server's PYTHONPATH,
so vLLM loads it in every process it starts (API server, engine core). It does nothing unless
asked through the environment:

* ``DMI_PERF_SINK=host``: dmi's exporter drops the rows it is handed (counted, not written): the
  capture path (kernels, ring, drain to pinned host memory) without the Zarr store, as the
  "-> host" rows of perf/offline.py. Run accounting (steps, bytes drained, drops) is still closed
  into the store's attributes.
* ``DMI_PERF_STEPCLOCK=PATH``: the engine process appends one JSON line per engine step to PATH
  (:class:`StepClock`): host time in ``execute_model``, ``sample_tokens`` and the wait for the
  step's sampled tokens, and GPU timestamps (CUDA timing events on the model's stream) where the
  step's work starts, around the model forward and where sampling ends. ``perf/common/stepclock.py``
  splits a window's steps into GPU time and the gaps the host left; the same few events in every
  configuration, vanilla too, and no profiler. With ``DMI_PERF_SYNCS=1`` too (and a GPU), torch's
  sync debug mode is on during each ``execute_model``: every synchronizing torch call of the engine's
  thread is counted in its step (``syncs``: [before the forward and after, inside the forward]) and
  by where it was made (printed at exit, into the server's log): a host that waits for the GPU
  inside a step shows where.
* ``DMI_PERF_HOOKS=1``: the naive baseline. After the worker loads the model, PyTorch forward hooks
  copy every decoder layer's residual stream (``hidden_states + residual``), the final norm and the
  logits to the CPU with a blocking ``.to("cpu")``. Needs ``--enforce-eager`` (hooks do not run
  inside CUDA graphs).
* ``DMI_PERF_BUSY_US=N``: the control experiment for a host-bound step. Right before the forward of
  every step with a prefill part (vLLM's mixed steps, whose forward the host paces), the engine's
  thread does N µs of Python and NumPy work of the kind dmi's step begin does (small arrays, dicts,
  lists; :func:`busy`), in a server without dmi. Whether such a step grows by N µs or by more
  tells dmi's own host time from what it does to the engine's code around it (caches, allocator).
* ``DMI_PERF_PROBE=N`` (with ``DMI_PERF_STEPCLOCK``): before every N-th step the engine's thread
  does a fixed amount of host work (:func:`probe`, the same every time, about 0.2 ms on a 2-core CPU machine)
  and the step's row records its wall and CPU ms (``probe``, ``probe_cpu``): how fast this host runs
  this thread's code at that moment, apart from what the step does. When vLLM's own host code runs
  slower with dmi in the process and the probe slows as much, the thread itself is slower (a lower clock, colder caches; CPU ms up), or waits (the GIL:
  wall up, CPU not), whatever code it runs. A second probe, ``probe_torch`` (:func:`probe_torch`),
  times a fixed number of tiny in-place torch ops (kernel launches on a GPU): slower there alone
  is torch or the CUDA driver, not the thread. Before every ``REPORT_EVERY``-th probe, and at exit,
  the engine process also rewrites ``PATH.threads.json`` (:meth:`StepClock.process_report`): its
  busiest threads' CPU seconds, the machine's busy cores and the CUDA allocator's driver calls
  since the first probe.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("dmi.perf")
_done = False
PROBE_ROUNDS = 10            # probe(): ~0.2 ms of host work on a 2-core CPU machine
PROBE_LAUNCHES = 40          # probe_torch(): in-place ops a probe launches
REPORT_EVERY = 8             # probes from one threads report to the next (reading /proc: ~1.5 ms on a 2-core CPU machine)


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    if os.environ.get("DMI_PERF_SINK") == "host":
        _host_sink()
    if os.environ.get("DMI_PERF_STEPCLOCK"):
        StepClock.install(os.environ["DMI_PERF_STEPCLOCK"])
    if float(os.environ.get("DMI_PERF_BUSY_US", "0") or 0) > 0:
        from dmi.adapters.vllm.compat import when_imported
        when_imported("vllm.v1.worker.gpu_model_runner", _busy_runner)
    if os.environ.get("DMI_PERF_HOOKS", "") not in ("", "0"):
        from dmi.adapters.vllm.compat import WORKER_MODULE, when_imported
        when_imported(WORKER_MODULE, _hook_worker)


def writer_register() -> None:
    """In the store writer's process (the hook spec's ``engine.writer_plugins``, set by perf/online.py): the host sink
    there too, where ``policy.drain: process`` runs the exporter."""
    if os.environ.get("DMI_PERF_SINK") == "host":
        _host_sink()


def _host_sink() -> None:
    from dmi.store.exporter import ZarrExporter
    if getattr(ZarrExporter.write_step, "__dmi_perf__", False):
        return

    def write_step(self, ctrl, records, *args, **kwargs) -> None:
        """The rows reached host memory: dropped, with no per-record Python (this thread shares the
        engine's GIL; the run's own accounting counts what was drained)."""

    write_step.__dmi_perf__ = True
    ZarrExporter.write_step = write_step


def _work_round() -> int:
    """One round of host work of the kind a changed batch's step begin does: short NumPy calls on
    arrays of a few hundred elements, small dicts and lists made and dropped. Returns a number made
    from its results (the work is used, not skipped)."""
    import numpy as np
    counts = np.arange(1, 61, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    rows = np.repeat(starts, counts) + np.arange(int(counts.sum())) % 7
    keep = rows[rows % 3 != 0]
    index = {int(i): k for k, i in enumerate(keep[:32])}
    return len([v for v in index.values() if v % 2]) + int(keep[-1])


def busy(us: float) -> int:
    """``us`` µs of the engine thread's time in rounds of :func:`_work_round`."""
    import time
    end, out = time.perf_counter() + us * 1e-6, 0
    while time.perf_counter() < end:
        out += _work_round()
    return out


def probe(rounds: int = PROBE_ROUNDS) -> tuple[float, float, int]:
    """(wall ms, CPU ms, a number made from the results) of a fixed amount of host work: ``rounds``
    rounds of :func:`_work_round`."""
    import time
    t0, c0, out = time.perf_counter(), time.thread_time(), 0
    for _ in range(rounds):
        out += _work_round()
    return (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3, out


def probe_torch(x, launches: int = PROBE_LAUNCHES) -> tuple[float, float]:
    """(wall ms, CPU ms) of ``launches`` in-place torch ops on ``x`` (a small tensor on the engine's
    device: each one a dispatch and, on a GPU, a kernel launch, never a sync): how fast this thread
    gets through torch and the CUDA driver, the calls vLLM's host code between its pieces is made of.
    Beside :func:`probe` it tells a thread slower at everything from a slower driver (a lock another
    thread's CUDA calls hold, a full launch queue)."""
    import time
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(launches):
        x.add_(1)
    return (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3


def _busy_runner(mod) -> None:
    us = float(os.environ["DMI_PERF_BUSY_US"])
    cls = mod.GPUModelRunner
    execute, forward = cls.execute_model, cls._model_forward

    @functools.wraps(execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        n = getattr(scheduler_output, "total_num_scheduled_tokens", 0)
        self._dmi_perf_mixed = n > len(getattr(scheduler_output, "num_scheduled_tokens", ()) or ())
        return execute(self, scheduler_output, *args, **kwargs)

    @functools.wraps(forward)
    def _model_forward(self, *args, **kwargs):
        if getattr(self, "_dmi_perf_mixed", False):      # (warm-up and capture runs never set it)
            self._dmi_perf_mixed = False
            busy(us)
        return forward(self, *args, **kwargs)
    cls.execute_model, cls._model_forward = execute_model, _model_forward


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


def thread_times() -> dict:
    """This process's threads' CPU seconds (``name/tid``: user + system, from /proc), the machine's
    busy CPU seconds (every core, /proc/stat) and the wall time they were read at."""
    import time
    ticks = os.sysconf("SC_CLK_TCK")
    named = {str(t.native_id): t.name for t in threading.enumerate()}    # Python's names (the OS's say "python")
    threads = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:             # the thread ended meanwhile
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        threads[f"{named.get(task.name, name)}/{task.name}"] = (int(rest[11]) + int(rest[12])) / ticks    # utime + stime
    total = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = (sum(total) - total[3] - total[4]) / ticks          # less idle and iowait
    return {"t": time.perf_counter(), "threads": threads, "machine_busy": busy}


class StepClock:
    """Per engine step (one ``execute_model`` + ``sample_tokens`` of the worker), appended as a
    JSON line to ``path`` in batches: ``t`` (wall time at the step's start), ``reqs``, ``tokens``,
    host ms in ``exec`` and ``sample``, ``wait`` (host ms blocked on sampled tokens after launching
    this step: the host's slack), and GPU ms on one timeline (``g`` = [step start, forward start,
    forward end, sampling end], from CUDA timing events recorded on the model's stream; null on a
    CPU). An event fires when the stream reaches it: a stream that ran dry waiting for the host
    shows as time between one step's end and the next one's start, or inside a step's span beyond
    its kernels. Also ``pre``: host ms from the step's start to the forward's launch (vLLM's input
    preparation, and dmi's step begin where dmi runs); ``launch``: host ms in the forward's call
    (a CUDA-graph replay; a piecewise step's launches, the host pacing its GPU); ``exec_cpu`` and
    ``launch_cpu``: the engine thread's CPU ms in ``execute_model`` and in the forward's call (CUDA's
    default synchronization spins, so a wait for the GPU counts as CPU: wall less CPU is a wait for
    the GIL or a blocking call); with a dmi session in the process, ``dmi``:
    host ms of its step hooks in the step ([batch, begin, end], wall: GIL waits included), and
    ``threads``: ms of CPU its drain and export threads spent meanwhile (they share the GIL)."""
    FLUSH = 256

    def __init__(self, path: str):
        import collections
        import torch
        self.path, self.torch = path, torch
        self.cuda = torch.cuda.is_available()
        self.ref = None                 # the first event: time zero of the GPU timeline
        self.pending = collections.deque()    # rows whose events have not all fired
        self.done: list = []
        self.free: list = []            # recycled events
        self.cur = self.last = None     # the step being launched; the last one launched
        self.fwd = None                 # the step whose forward call is running (its replays are timed)
        self.session = None             # dmi's session in this process, once one has started
        self.thread_clocks: list = []   # its drain and export threads' CPU clocks
        # DMI_PERF_SYNCS: where the engine's thread synchronized with the GPU in a step (place -> count)
        self.syncs = collections.Counter() if os.environ.get("DMI_PERF_SYNCS", "") not in ("", "0") else None
        self.thread = None              # the engine's thread (execute_model's)
        self.probe_every = int(os.environ.get("DMI_PERF_PROBE", "0") or 0)    # probe() before every N-th step
        self.probe_x = None             # probe_torch()'s tensor, made at the first probe
        self.threads0 = None            # thread_times() at the first probe
        self.threads_seen: dict = {}    # every thread's latest CPU seconds (process_report)
        self.probes = 0
        self.steps = 0

    @classmethod
    def install(cls, path: str) -> None:
        from dmi.adapters.vllm.compat import WORKER_MODULE, when_imported
        clock = cls(path)
        when_imported(WORKER_MODULE, clock._wrap_worker)
        when_imported("vllm.v1.worker.gpu_model_runner", clock._wrap_runner)
        clock._wrap_replay()
        if clock.syncs is not None and clock.cuda:
            clock._watch_syncs()
        import atexit
        atexit.register(clock.flush, True)

    def probe(self) -> dict:
        """The probes' figures for a step's row (:func:`probe`, :func:`probe_torch`); the first one
        also snapshots every thread's CPU time, against which every ``REPORT_EVERY``-th reports
        (:meth:`write_report`: here, where the pair before the probed step is left out of the step
        figures, not in :meth:`flush`, which lands in a counted pair)."""
        if self.probe_x is None:
            self.probe_x = self.torch.zeros(64, device="cuda" if self.cuda else "cpu")
            self.threads0 = thread_times()
        elif self.probes % REPORT_EVERY == 0:
            self.write_report()
        self.probes += 1
        wall, cpu, _ = probe()
        twall, tcpu = probe_torch(self.probe_x)
        return {"probe": round(wall, 4), "probe_cpu": round(cpu, 4),
                "probe_torch": round(twall, 4), "probe_torch_cpu": round(tcpu, 4)}

    def _event(self):
        if not self.cuda:
            return None
        if self.ref is None:            # recorded before any step's event: every time is >= 0
            self.ref = self.torch.cuda.Event(enable_timing=True)
            self.ref.record()
        e = self.free.pop() if self.free else self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _wrap_worker(self, mod) -> None:
        """The worker's step methods (the outermost in the process that runs the model: dmi's own
        step hooks, on the runner, fall inside)."""
        import time
        cls = mod.Worker
        execute, sample, shutdown = cls.execute_model, cls.sample_tokens, cls.shutdown
        clock = self

        @functools.wraps(execute)
        def execute_model(self, scheduler_output, *args, **kwargs):
            clock.resolve()
            n = getattr(scheduler_output, "total_num_scheduled_tokens", 0)
            if not n:
                return execute(self, scheduler_output, *args, **kwargs)
            probed = clock.probe_every and clock.steps % clock.probe_every == 0
            clock.steps += 1
            took = clock.probe() if probed else {}      # (before the step's clock starts: its own times stay clean)
            row = {"t": time.time(), "reqs": len(scheduler_output.num_scheduled_tokens), "tokens": n,
                   "wait": 0.0, "ev": [clock._event()], **took}
            clock.cur = row
            watching = clock.syncs is not None and clock.cuda
            if watching:
                row["syncs"], clock.thread = [0, 0], threading.get_ident()
                clock.torch.cuda.set_sync_debug_mode(1)
            t0 = row["t0"] = time.perf_counter()
            c0 = time.thread_time()
            dmi0 = clock._dmi_now()
            try:
                return execute(self, scheduler_output, *args, **kwargs)
            finally:
                if watching:
                    clock.torch.cuda.set_sync_debug_mode(0)
                row["exec"] = (time.perf_counter() - t0) * 1e3
                row["exec_cpu"] = (time.thread_time() - c0) * 1e3
                row.pop("t0", None)
                if dmi0 is not None:
                    dmi1 = clock._dmi_now()
                    row["dmi"] = [round((b - a) * 1e3, 4) for a, b in zip(dmi0[0], dmi1[0])]
                    row["threads"] = round((dmi1[1] - dmi0[1]) * 1e3, 4)

        @functools.wraps(sample)
        def sample_tokens(self, *args, **kwargs):
            row, t0 = clock.cur, time.perf_counter()
            try:
                return sample(self, *args, **kwargs)
            finally:
                if row is not None:
                    row["sample"] = (time.perf_counter() - t0) * 1e3
                    row["ev"] += [None] * (3 - len(row["ev"])) + [clock._event()]
                    clock.pending.append(row)
                    clock.cur, clock.last = None, row

        @functools.wraps(shutdown)
        def _shutdown(self, *args, **kwargs):
            clock.flush(True)
            return shutdown(self, *args, **kwargs)
        cls.execute_model, cls.sample_tokens, cls.shutdown = execute_model, sample_tokens, _shutdown

    def _wrap_runner(self, mod) -> None:
        import time
        forward = mod.GPUModelRunner._model_forward
        clock = self

        @functools.wraps(forward)
        def _model_forward(self, *args, **kwargs):
            row = clock.cur
            if row is not None and len(row["ev"]) == 1:
                t1, c1 = time.perf_counter(), time.thread_time()
                row["pre"] = (t1 - row["t0"]) * 1e3
                row["ev"].append(clock._event())
                row["graphs"], row["replay"], clock.fwd = 0, 0.0, row
                try:
                    out = forward(self, *args, **kwargs)
                finally:
                    clock.fwd = None
                row["ev"].append(clock._event())
                row["launch"] = (time.perf_counter() - t1) * 1e3
                row["launch_cpu"] = (time.thread_time() - c1) * 1e3
                return out
            return forward(self, *args, **kwargs)
        mod.GPUModelRunner._model_forward = _model_forward
        out_cls = getattr(mod, "AsyncGPUModelRunnerOutput", None)
        if out_cls is None:
            return
        get_output = out_cls.get_output

        @functools.wraps(get_output)
        def timed_get_output(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return get_output(self, *args, **kwargs)
            finally:
                if clock.last is not None:
                    clock.last["wait"] += (time.perf_counter() - t0) * 1e3
        out_cls.get_output = timed_get_output

    def _watch_syncs(self) -> None:
        """Count the sync debug mode's warnings of the engine's thread inside a step, by step and by
        place (the three innermost frames outside torch), instead of printing them."""
        import traceback
        import warnings
        shown, clock = warnings.showwarning, self
        warnings.filterwarnings("always", message=".*synchronizing CUDA operation")    # each one, not once a place

        def showwarning(message, category, filename, lineno, file=None, line=None):
            row = clock.cur
            if row is None or "syncs" not in row or threading.get_ident() != clock.thread \
                    or "synchronizing CUDA operation" not in str(message):
                return shown(message, category, filename, lineno, file, line)
            row["syncs"][1 if clock.fwd is row else 0] += 1
            frames = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}torch{os.sep}" not in f.filename
                      and "warnings" not in f.filename][-3:]
            clock.syncs[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))] += 1
        warnings.showwarning = showwarning

    def _wrap_replay(self) -> None:
        """Time every ``torch.cuda.CUDAGraph.replay`` inside a step's forward call (vLLM replays
        its graphs through it: the decode step's one, a piecewise step's pieces)."""
        import time
        graph_cls = self.torch.cuda.CUDAGraph
        replay = graph_cls.replay
        clock = self

        @functools.wraps(replay)
        def timed_replay(graph):
            row = clock.fwd
            if row is None:
                return replay(graph)
            t0 = time.perf_counter()
            try:
                return replay(graph)
            finally:
                row["replay"] += (time.perf_counter() - t0) * 1e3
                row["graphs"] += 1
        graph_cls.replay = timed_replay

    def _dmi_now(self):
        """(dmi's step-hook wall seconds so far [batch, begin, end], its threads' CPU seconds so far),
        or None where no dmi session runs in this process (vanilla servers never import dmi's worker)."""
        import sys
        import time
        if self.session is None:
            worker = sys.modules.get("dmi.adapters.vllm.worker")
            self.session = next(iter(worker.SESSIONS.values()), None) if worker is not None else None
            if self.session is None:
                return None
            run = self.session.run
            self.thread_clocks = [time.pthread_getcpuclockid(t.ident) for t in (run.threads.drain, run.threads.export) if t.ident]
        wall = self.session.clock.wall
        try:
            threads = sum(time.clock_gettime(c) for c in self.thread_clocks)
        except OSError:                 # the session closed and its threads ended
            return None
        return [wall[k] for k in ("batch", "begin", "end")], threads

    def process_report(self) -> dict:
        """Since the first probe: CPU seconds of the busiest threads of this process (by name and
        id: a thread that spins, or that shares the engine's GIL, shows here), the machine's busy
        cores on average, and the CUDA caching allocator's driver calls and retries (a server whose
        allocator keeps going back to cudaMalloc / cudaFree pays for it in host time)."""
        now = thread_times()
        self.threads_seen.update(now["threads"])       # (a thread that ended, dmi's at its close, keeps its last figure)
        span = max(now["t"] - self.threads0["t"], 1e-9)
        cpu = {k: round(v - self.threads0["threads"].get(k, 0.0), 3) for k, v in self.threads_seen.items()}
        busy = (now["machine_busy"] - self.threads0["machine_busy"]) / span
        out = {"pid": os.getpid(), "span_s": round(span, 1), "machine_busy_cores": round(busy, 2),
               "threads_cpu_s": dict(sorted(((k, v) for k, v in cpu.items() if v > 0.01), key=lambda kv: -kv[1])[:14])}
        if self.cuda:
            stats = self.torch.cuda.memory_stats()
            out["allocator"] = {k: stats.get(k) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                                          "num_sync_all_streams")}
        return out

    def write_report(self) -> None:
        """:meth:`process_report` into ``PATH.threads.json`` (rewritten: a server killed at the end
        still leaves its latest)."""
        Path(self.path + ".threads.json").write_text(json.dumps(self.process_report()) + "\n")

    def resolve(self) -> None:
        """Rows whose events have all fired, onto the GPU timeline (no waiting)."""
        while self.pending:
            row = self.pending[0]
            if row is self.last:         # its wait is still being counted
                break
            evs = row["ev"]
            if self.cuda and evs[-1] is not None and not evs[-1].query():
                break
            self.pending.popleft()
            if self.cuda and self.ref is not None:
                row["g"] = [round(self.ref.elapsed_time(e), 4) if e is not None else None for e in evs]
                self.free.extend(e for e in evs if e is not None)
            else:
                row["g"] = None
            del row["ev"]
            self.done.append(row)
        if len(self.done) >= self.FLUSH:
            self.flush()

    def flush(self, final: bool = False) -> None:
        if final:                       # (every vLLM process loads the plugin; only the engine's records)
            if self.ref is not None:
                try:
                    self.torch.cuda.synchronize()
                except RuntimeError:     # CUDA already torn down at exit: unresolved rows are left out
                    return
            self.last = None
            self.resolve()
        if final and self.threads0 is not None:
            self.write_report()
        if final and self.syncs:
            import sys
            print(f"dmi-perf: synchronizing torch calls of the engine's thread in steps, by place "
                  f"({sum(self.syncs.values())} in all):", file=sys.stderr)
            for place, n in self.syncs.most_common(15):
                print(f"dmi-perf sync {n:>8}  {place}", file=sys.stderr)
            self.syncs.clear()
        rows, self.done = self.done, []
        if rows:
            with open(self.path, "a") as f:
                f.write("".join(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}) + "\n"
                                for r in rows))
