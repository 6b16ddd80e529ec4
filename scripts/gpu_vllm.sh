#!/usr/bin/env bash
# vLLM on a CUDA machine: the GPU vLLM tests, then the online serving benchmark, each with a time
# limit; full logs go to $OUT, compact tails are printed. vLLM comes from a build staged in
# .vbundle/tools (its env.sh puts it on the paths); the wheels in .whl (scripts/fetch_wheels.sh)
# are installed beside it.
#
#   bash scripts/gpu_vllm.sh [all]            tests (<= $T_TESTS s), then perf/online.py in what is left of $DEADLINE_S
#   bash scripts/gpu_vllm.sh tests            tests only
#   bash scripts/gpu_vllm.sh online [ARGS]    perf/online.py ARGS (default: --model qwen3-8b) in $DEADLINE_S
#   bash scripts/gpu_vllm.sh side [ARGS]      engine.side: all (capture kernels on a side stream in every graph): the
#                                             manual-graph ring test and vLLM's every-site tests of Qwen3 with it
#                                             (<= $T_TESTS s), then perf/online.py ARGS when given
#   bash scripts/gpu_vllm.sh bench [ARGS]     the CUDA ring's wrap-around GPU test, the drain's head-of-line table
#                                             (perf/drain_bench.py --hol), the bandwidth-cap benchmark (perf/budget.py,
#                                             <= $T_BUDGET s), then perf/online.py ARGS in what is left
#
# Environment: OUT, DEADLINE_S (default 585), T_TESTS (default 260), TESTS_K (a pytest -k expression:
# some of the tests), ONLINE_ARGS (for `all`), BUDGET_ARGS (perf/budget.py's, for `bench`).
set -u
cd "$(dirname "$0")/.."
START=$SECONDS
OUT=${OUT:-/tmp/dmi-out}
DEADLINE_S=${DEADLINE_S:-585}
T_TESTS=${T_TESTS:-260}
mkdir -p "$OUT"
part=${1:-all}; shift || true

if [ ! -f .vbundle/tools/env.sh ]; then
  echo "no .vbundle/tools/env.sh: stage a vLLM build there first"; exit 2
fi
source .vbundle/tools/env.sh
if [ -d .whl ]; then   # zarr, numcodecs, xarray, jsonschema & co: their own folder, away from vLLM's
  [ -f /tmp/dmi-whl/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/dmi-whl .whl/*.whl && touch /tmp/dmi-whl/.done; } || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/dmi-whl
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_USE_V2_MODEL_RUNNER=0
python3 - <<'EOF' 2>&1 | tee "$OUT/vllm-env.txt" | tail -3
import sys, torch, triton, transformers, zarr
try:
    import vllm
    v = vllm.__version__
except Exception as e:        # not staged (or stage 2 missing): say so, the steps below fail fast
    v = f"NOT IMPORTABLE ({type(e).__name__}: {e})"
print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers",
      transformers.__version__, "zarr", zarr.__version__, "vllm", v)
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
EOF

step() {   # step NAME LIMIT CMD...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  # (a test's failure is written to $OUT/NAME.failures as it happens: tests/failure_log.py)
  rm -f "$OUT/$name.failures"
  DMI_TEST_FAILURES="$OUT/$name.failures" timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)"
  if [ -s "$OUT/$name.failures" ]; then tail -n 60 "$OUT/$name.failures"; fi
  return $rc
}

tests() {
  local limit=$1
  # -v: each test's outcome in the log as it ends (a run cut by its limit still says which passed)
  step vllm-tests "$limit" python3 -m pytest -m gpu tests/gpu/test_vllm_gpu.py -v -ra -p no:cacheprovider \
    --durations=8 --junitxml "$OUT/vllm-tests.xml" ${TESTS_K:+-k "$TESTS_K"}
  # the outcome lines (the failures' tracebacks were printed by step), not the whole log
  grep -E "(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|skipped|error|slowest|s (call|setup|teardown) " \
    "$OUT/vllm-tests.log" | tail -n 24
}

online() {
  local limit=$(($1 - 10)); shift     # timeout -k 10: killed by the deadline at the latest
  step vllm-online "$limit" python3 perf/online.py --time-limit-s "$((limit - 15))" --results "$OUT/ONLINE.md" \
    --json "$OUT/online.json" "$@"
  # a server the deadline's SIGKILL left behind would hold the GPU's memory for the next run
  # ("[v]": the pattern must not match this shell's own command line)
  pkill -9 -f "[v]llm.entrypoints.openai.api_server" || true
  grep -E "^\[" "$OUT/vllm-online.log" | grep -vE "starting \(" | tail -n 30
  [ -f "$OUT/ONLINE.md" ] && cat "$OUT/ONLINE.md"
  for f in /tmp/dmi-online/server-*.log; do    # the servers' own logs, their tails
    [ -f "$f" ] && tail -n 150 "$f" > "$OUT/$(basename "$f")"
  done
  # --probe: each engine's threads as of its latest report (every 8th probe and exit: perf/common/vllm_plugins.py), and which cores are hyperthread siblings
  for f in /tmp/dmi-online/stepclock-*.jsonl.threads.json; do
    [ -f "$f" ] && echo "$(basename "$f" .jsonl.threads.json): $(cat "$f")"
  done | tee "$OUT/threads.txt"
  echo "cores $(nproc), siblings: $(sort -u /sys/devices/system/cpu/cpu*/topology/thread_siblings_list 2>/dev/null | tr '\n' ' ')"
}

left() { echo $((DEADLINE_S - (SECONDS - START))); }

case "$part" in
  tests)  tests "$(( $(left) < T_TESTS ? $(left) : T_TESTS ))" ;;
  online)
    [ $# -gt 0 ] || set -- --model qwen3-8b
    online "$(left)" "$@" ;;
  all)
    tests "$T_TESTS"
    l=$(left)
    if [ "$l" -gt 150 ]; then
      # shellcheck disable=SC2086
      online "$l" ${ONLINE_ARGS:---model qwen3-8b --rates 4,32 --duration 8 --grace 4}
    else
      echo "== vllm-online: skipped, only $l s left"
    fi
    ;;
  side)     # engine.side: all on the GPU: the ring's manual graph (a compiled forward captured with the chain pass), vLLM's graphs
    step ringside 150 python3 -m pytest -m gpu tests/gpu/test_cuda_ring.py -k manual_cuda_graph -q -ra -p no:cacheprovider
    tail -n 5 "$OUT/ringside.log"
    TESTS_K="${TESTS_K:-every_site and qwen3 and not traced}" tests "$T_TESTS"
    [ $# -gt 0 ] && online "$(left)" "$@" ;;
  bench)
    step ringtest 90 python3 -m pytest -m gpu tests/gpu/test_cuda_ring.py -k wraparound -q -p no:cacheprovider
    tail -n 3 "$OUT/ringtest.log"
    step drain 90 python3 perf/drain_bench.py --hol
    grep -E "^\|" "$OUT/drain.log"
    step budget "${T_BUDGET:-170}" python3 perf/budget.py ${BUDGET_ARGS:---model qwen3-8b --caps 0.5 --repeats 3}
    grep -E "^\||^vanilla" "$OUT/budget.log"
    [ $# -gt 0 ] || set -- --model qwen3-8b
    online "$(left)" "$@" ;;
  *) echo "usage: gpu_vllm.sh [all|tests|online|side|bench [perf/online.py args]]"; exit 2 ;;
esac
echo "== total $((SECONDS - START)) s"
