"""Sampling profiles of a running process with py-spy, per thread: where the model's thread (or
vLLM's engine core) spends its time with dmi against without, and what dmi's own threads do.

cProfile cannot answer this: in Python 3.12 it sees every thread at once (sys.monitoring), and
its own overhead lands on exactly the host-bound Python being measured. py-spy samples from
outside (``--nonblocking``: the target is never paused).

    python perf/common/pyspy.py summary FILE [--rate 250] [--top 15]
    python perf/common/pyspy.py compare BASE FILE [--top 25]      # e.g. vanilla vs dmi, same duration

FILEs are ``py-spy record --format raw --threads --full-filenames`` output (lines
``thread (TID): NAME;frame;...;frame COUNT``); :func:`record` starts one. py-spy is carried to the
GPU machine as a wheel in ``.whl`` (scripts/gpu.sh installs it); it needs ptrace rights on
the target (root, or the same user with ptrace_scope 0).
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

# a command line may hold quotes itself (vllm serve --compilation-config '{"...": ...}'): up to '";'
_LINE = re.compile(r'^((?:process \d+:".*?";)*)thread \((\d+)\): (.*) (\d+)$')
_PROC = re.compile(r'process \d+:"(.*?)";')
_POOL = re.compile(r"[_-]?\d+$")        # dmi-zarr_3 -> dmi-zarr: a pool's threads count together


def binary() -> str | None:
    """The py-spy executable: on PATH, or beside a ``--target`` install on sys.path."""
    found = shutil.which("py-spy")
    if found:
        return found
    for p in sys.path:
        cand = Path(p or ".") / "bin" / "py-spy"
        if cand.is_file():
            return str(cand)
    return None


def record(pid: int, seconds: float, out: Path, rate: int = 250, gil: bool = False,
           subprocesses: bool = False) -> subprocess.Popen | None:
    """Start recording ``pid`` (and with ``subprocesses`` its children: a server's engine core and
    workers) for ``seconds`` into ``out`` (raw format); None without py-spy."""
    exe = binary()
    if exe is None:
        return None
    cmd = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
           "--format", "raw", "--threads", "--full-filenames", "--nonblocking", "-o", str(out)]
    if gil:
        cmd.append("--gil")
    if subprocesses:
        cmd.append("--subprocesses")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def sample_while(fn, seconds: float, out: Path) -> bool:
    """Run ``fn()`` over and over while py-spy records this process for ``seconds`` into ``out``.
    False without py-spy, or when it failed (its message printed: e.g. no ptrace rights)."""
    import os
    proc = record(os.getpid(), seconds, out)
    if proc is None:
        return False
    while proc.poll() is None:
        fn()
    if proc.returncode != 0:
        print(f"py-spy failed: {proc.stderr.read().decode(errors='replace')[-500:]}", flush=True)
        return False
    return True


def sampled(fn, out: Path, gil: bool = False):
    """Run ``fn()`` once while py-spy records this process into ``out`` (stopped with SIGINT when
    ``fn`` returns, which makes py-spy write its file); ``fn``'s result."""
    import os
    import signal
    out.parent.mkdir(parents=True, exist_ok=True)        # (py-spy writes nothing into a missing folder)
    proc = record(os.getpid(), 3600, out, gil=gil)
    if proc is None:
        print(f"py-spy: not found, {out} not recorded (carry its wheel in .whl: scripts/fetch_wheels.sh)", flush=True)
    try:
        return fn()
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
            if not out.exists():
                print(f"py-spy wrote no {out}: {proc.stderr.read().decode(errors='replace')[-500:]}", flush=True)


def sampled_against_vanilla(vanilla, fn, seconds: float, name: str) -> None:
    """py-spy on this process while ``vanilla()`` runs over and over, then ``fn()``, each ``seconds``
    long, and the per-thread growth printed (raw files in $OUT or the temp directory)."""
    import os
    import tempfile
    out = Path(os.environ.get("OUT", tempfile.gettempdir()))
    a, b = out / "pyspy-vanilla.txt", out / f"pyspy-{name}.txt"
    if sample_while(vanilla, seconds, a) and sample_while(fn, seconds, b):
        print(compare(a, b), flush=True)
    else:
        print("py-spy: no profile (not found: install it, or carry its wheel in .whl, see scripts/fetch_wheels.sh; "
              "or it failed, above)", flush=True)


def load(path: Path) -> dict[str, collections.Counter]:
    """thread group -> Counter of stacks (tuples of frames) -> samples. With several processes
    (``--subprocesses``) a group is 'process: thread', the process named by its command line with
    numbers masked (pids and fds differ from run to run)."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in Path(path).read_text().splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, *frames = m.group(3).split(";")
        group = _POOL.sub("", name) or name
        procs = _PROC.findall(m.group(1))
        if procs:
            group = f"{_process_name(procs[-1])}: {group}"
        threads[group][tuple(frames)] += int(m.group(4))
    return threads


def _process_name(cmdline: str) -> str:
    """A short, run-independent name for a process: vLLM's titles (VLLM::EngineCore) as they are,
    else its command line with numbers masked, shortened."""
    title = re.search(r"VLLM::\w+", cmdline)
    if title:
        return title.group(0)
    masked = re.sub(r"\d+", "#", cmdline)
    return masked if len(masked) <= 60 else masked[:28] + "..." + masked[-28:]


def _short(frame: str) -> str:
    """'fn (/long/path/pkg/mod.py:12)' -> 'fn (pkg/mod.py:12)'."""
    m = re.match(r"^(.*) \((.*):(\d+)\)$", frame)
    if not m:
        return frame
    parts = Path(m.group(2)).parts
    return f"{m.group(1)} ({'/'.join(parts[-2:])}:{m.group(3)})"


def _is_dmi(frame: str) -> bool:
    return "/dmi/" in frame


def stats(stacks: collections.Counter) -> tuple[int, collections.Counter, int]:
    """(samples, samples per innermost frame, samples with a dmi frame on the stack)."""
    own: collections.Counter = collections.Counter()
    total = in_dmi = 0
    for stack, n in stacks.items():
        total += n
        own[_short(stack[-1]) if stack else "?"] += n
        if any(_is_dmi(f) for f in stack):
            in_dmi += n
    return total, own, in_dmi


def summary(path: Path, rate: int = 250, top: int = 15) -> str:
    lines = [f"{path}: samples per thread (active samples; {rate}/s means 1 sample = {1e3 / rate:.1f} ms)"]
    for name, stacks in sorted(load(path).items(), key=lambda kv: -sum(kv[1].values())):
        total, own, in_dmi = stats(stacks)
        lines.append(f"  {name}: {total} samples ({total / rate:.2f} s), {in_dmi} with dmi on the stack")
        for frame, n in own.most_common(top):
            lines.append(f"      {n:6d}  {100 * n / total:5.1f}%  {frame}")
    return "\n".join(lines)


def compare(base: Path, other: Path, top: int = 25) -> str:
    """Per thread, the innermost frames whose samples grew most from ``base`` to ``other`` (record
    both for the same duration)."""
    a, b = load(base), load(other)
    lines = [f"samples per thread, {base} -> {other}; innermost frames with the largest growth:"]
    for name in sorted(set(a) | set(b), key=lambda k: -sum(b.get(k, {}).values())):
        ta, oa, _ = stats(a.get(name, collections.Counter()))
        tb, ob, db = stats(b.get(name, collections.Counter()))
        lines.append(f"  {name}: {ta} -> {tb} samples ({db} with dmi on the stack)")
        grown = sorted(set(oa) | set(ob), key=lambda f: oa.get(f, 0) - ob.get(f, 0))[:top]
        for f in grown:
            d = ob.get(f, 0) - oa.get(f, 0)
            if d > 0:
                lines.append(f"      {d:+6d}  ({oa.get(f, 0)} -> {ob.get(f, 0)})  {f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary")
    s.add_argument("file", type=Path)
    s.add_argument("--rate", type=int, default=250)
    s.add_argument("--top", type=int, default=15)
    c = sub.add_parser("compare")
    c.add_argument("base", type=Path)
    c.add_argument("file", type=Path)
    c.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    print(summary(args.file, args.rate, args.top) if args.cmd == "summary" else compare(args.base, args.file, args.top))


if __name__ == "__main__":
    main()
