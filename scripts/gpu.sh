#!/usr/bin/env bash
# GPU tests and benchmarks on a CUDA machine, each with a time limit: installs the wheels in .whl
# (scripts/fetch_wheels.sh; for a machine that lacks zarr & co), then runs a part. Full logs go to
# $OUT; the tail of each is printed.
#
#   bash scripts/gpu.sh [check]          GPU tests, drain throughput, a quick offline run
#   bash scripts/gpu.sh tests [ARGS]     the GPU tests (pytest -m gpu tests/gpu ARGS)
#   bash scripts/gpu.sh headline [ARGS]  perf/offline.py --headline ARGS (default: Qwen3-8B, batch 32, compiled)
#   bash scripts/gpu.sh perf [ARGS]      perf/offline.py ARGS (the diagnostic matrix)
#   bash scripts/gpu.sh budget [ARGS]    perf/budget.py ARGS
#   bash scripts/gpu.sh drain [ARGS]     perf/drain_bench.py ARGS
#   bash scripts/gpu.sh vllm ...         scripts/gpu_vllm.sh ... (vLLM's GPU tests, perf/online.py)
set -u
cd "$(dirname "$0")/.."
[ "${1:-}" = vllm ] && { shift; exec bash scripts/gpu_vllm.sh "$@"; }
OUT=${OUT:-/tmp/dmi-out}
mkdir -p "$OUT"
if [ -d .whl ]; then   # a folder of their own (a staged vLLM keeps its own), shared with scripts/gpu_vllm.sh
  [ -f /tmp/dmi-whl/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/dmi-whl .whl/*.whl && touch /tmp/dmi-whl/.done; } || exit 1
  export PYTHONPATH=/tmp/dmi-whl${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRITON_DEFAULT_FP_FUSION=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import sys, torch, triton, transformers, zarr, numpy, cuda.bindings as cb; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'zarr', zarr.__version__, 'numpy', numpy.__version__, 'cuda-bindings', cb.__version__)"
  df -h /dev/shm /tmp | tail -2
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step() {   # step NAME TIMEOUT CMD...: run with a time limit, log to $OUT/NAME.log, print its tail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  # (a test's failure is written to $OUT/NAME.failures as it happens: tests/failure_log.py)
  rm -f "$OUT/$name.failures"
  DMI_TEST_FAILURES="$OUT/$name.failures" timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t0)) s"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  if [ -s "$OUT/$name.failures" ]; then tail -n 60 "$OUT/$name.failures"; fi
}

part=${1:-check}; shift || true
case "$part" in
  check)
    step drain 100 python3 perf/drain_bench.py --gib 4 --repeats 3
    TAIL=40 step tests 320 python3 -m pytest -m gpu tests/gpu -q -ra --durations=8 -p no:cacheprovider
    TAIL=30 step quick 150 python3 perf/offline.py --quick --no-internals --results "$OUT/RESULTS_quick.md" "$@"
    ;;
  tests)
    TAIL=40 step tests "${TEST_LIMIT:-540}" python3 -m pytest -m gpu tests/gpu -q -ra --durations=8 -p no:cacheprovider "$@"
    ;;
  headline)
    [ $# -gt 0 ] || set -- --models qwen3-8b --batches 32 --modes compiled --new-tokens 128 --store-dir /tmp
    TAIL=20 step headline "${PERF_LIMIT:-540}" python3 perf/offline.py --headline --json "$OUT/headline.json" "$@"
    ;;
  perf)
    TAIL=40 step perf "${PERF_LIMIT:-540}" python3 perf/offline.py --results "$OUT/RESULTS.md" "$@"
    ;;
  budget)
    TAIL=14 step budget "${PERF_LIMIT:-300}" python3 perf/budget.py "$@"
    ;;
  drain)
    TAIL=20 step drain "${PERF_LIMIT:-120}" python3 perf/drain_bench.py "$@"
    ;;
  *)
    echo "usage: gpu.sh [check|tests|headline|perf|budget|drain|vllm] [ARGS]"; exit 2
    ;;
esac
