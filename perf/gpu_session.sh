#!/usr/bin/env bash
# One device call on the lent GPU machine: install carried wheels (zarr & co are missing there),
# then run a part: `check` (GPU tests, drain microbenchmark, quick offline perf) or `perf` (the
# offline matrix, arguments passed on), or `vllm` (perf/gpu_vllm.sh: vLLM GPU tests + online
# serving benchmark). Full logs go to $OUT; the tail of each is printed.
set -u
# `vllm [all|tests|online ...]`: vLLM 0.25.1 (staged first, ../shared/device/vllm/README.md), its own script
[ "${1:-}" = vllm ] && { shift; exec bash perf/gpu_vllm.sh "$@"; }
OUT=${OUT:-/tmp/dmi-out}
mkdir -p "$OUT"
if [ -d .whl ]; then   # own folder (vLLM's staged tree is /tmp/site), shared with perf/gpu_vllm.sh
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
  diag)
    TAIL=200 step diag 300 python3 perf/diagnose.py "$@"
    TAIL=30 step tests2 200 python3 -m pytest -m gpu tests/gpu -q -ra -p no:cacheprovider -k "fullgraph or null"
    ;;
  traced)   # compiled captures as traced ops: the ring's GPU tests, then inductor's kernels with and without dmi
    TAIL=25 step tests 330 python3 -m pytest -m gpu tests/gpu/test_cuda_ring.py -q -ra -p no:cacheprovider
    TAIL=15 step fusion 200 python3 perf/fusion.py "$@"
    ;;
  nullgap)   # where null mode's cost goes (perf/nullgap.py), then the ring's GPU tests
    TAIL=40 step nullgap 330 python3 perf/nullgap.py "$@"
    TAIL=12 step tests 170 python3 -m pytest -m gpu tests/gpu/test_cuda_ring.py tests/gpu/test_policy_gpu.py -q -ra -p no:cacheprovider
    ;;
  probe)
    TAIL=30 step tests 300 python3 -m pytest -m gpu tests/gpu -q -ra --durations=6 -p no:cacheprovider
    TAIL=20 step ablate 270 python3 perf/ablate.py "$@"
    ;;
  final)   # GPU tests (copy_at_step both ways), head-of-line table, compiled Qwen3-8B rows paired with vanilla
    TAIL=25 step tests 150 python3 -m pytest -m gpu tests/gpu/test_cuda_ring.py tests/gpu/test_policy_gpu.py -q -ra -p no:cacheprovider
    TAIL=10 step drain 40 python3 perf/drain_bench.py --hol
    TAIL=20 step perf "${PERF_LIMIT:-330}" python3 perf/offline.py --models qwen3-8b --batches 32 --modes compiled --no-internals \
      --repeats 5 ${ZARR:---no-zarr} --results "$OUT/RESULTS.md" --json "$OUT/offline.json"
    ;;
  writer)  # where the host cost goes, with the Zarr row's exporter in its own process (store.writer: process)
    TAIL=20 step ablate "${PERF_LIMIT:-290}" python3 perf/ablate.py --model qwen3-8b --batch 32 --new 96 --repeats 3 \
      --writer process "$@"
    ;;
  profile) # GPU tests of the ring, dmi's host calls inside generate(), and py-spy on the model thread (vanilla vs
           # the host row, compiled Qwen3-8B): carry [".whl"] with py-spy in it (perf/fetch_wheels.sh)
    TAIL=12 step tests 170 python3 -m pytest -m gpu tests/gpu/test_cuda_ring.py tests/gpu/test_policy_gpu.py -q -ra -p no:cacheprovider
    TAIL=2 step ingen 150 python3 perf/hostcost.py --in-generate 64   # (60 s was too short on a fresh machine: Triton compiles)
    TAIL=60 step pyspy "${PERF_LIMIT:-240}" python3 perf/ablate.py --model qwen3-8b --batch 32 --new 96 --repeats 3 \
      --only-stores --pyspy 8 "$@"
    ;;
  hostvllm) # the ring's GPU tests, then a vLLM engine step's host work without vLLM (perf/hostcost.py --engine vllm,
            # 5 ms between steps as a serving GPU leaves the host's caches: a steady decode batch, a batch with prefill
            # chunks, the same laid out anew each step, a churning batch whose two shapes alternate, and with every
            # site captured eagerly), timed per function
    TAIL=12 step tests 170 python3 -m pytest -m gpu tests/gpu/test_cuda_ring.py tests/gpu/test_policy_gpu.py -q -ra -p no:cacheprovider
    TAIL=3 step hoststeady 60 python3 perf/hostcost.py --engine vllm --batch 32 --prefill 0 --gap 5 --breakdown "$@"
    TAIL=2 step hostmixed 60 python3 perf/hostcost.py --engine vllm --batch 32 --prefill 4 --gap 5 --breakdown "$@"
    TAIL=2 step hostfresh 60 python3 perf/hostcost.py --engine vllm --batch 32 --prefill 4 --fresh --gap 5 --breakdown "$@"
    TAIL=2 step hostcycle 60 python3 perf/hostcost.py --engine vllm --batch 32 --prefill 0 --cycle --gap 5 --breakdown "$@"
    TAIL=2 step hosteager 60 python3 perf/hostcost.py --engine vllm --batch 32 --prefill 4 --eager --gap 5 "$@"
    ;;
  paced)   # the ring's GPU tests with PDL off (DMI_PDL=0), then a changed batch's host work (perf/hostcost.py
           # --engine vllm --fresh: 60 requests, one in a 256-token prefill chunk, every graph site's record published
           # as the kernels would) with the drain on its timer and in drain windows, a steady decode batch in windows;
           # and, where $BASE_DMI holds an earlier checkout (its dmi/ and perf/), the same fresh step on that one
    TAIL=12 step tests 200 env DMI_PDL=0 python3 -m pytest -m gpu tests/gpu/test_cuda_ring.py tests/gpu/test_policy_gpu.py -q -ra -p no:cacheprovider
    fresh="--engine vllm --batch 60 --prefill 1 --chunk 256 --fresh --gap 5"
    for run in 1 2; do
      if [ -n "${BASE_DMI:-}" ] && [ -d "$BASE_DMI/dmi" ]; then
        TAIL=3 step "hostfresh-base$run" 90 python3 "$BASE_DMI/perf/hostcost.py" $fresh --breakdown
      fi
      TAIL=3 step "hostfresh$run" 90 python3 perf/hostcost.py $fresh --breakdown
      TAIL=3 step "hostfresh-win$run" 90 python3 perf/hostcost.py $fresh --windows
    done
    TAIL=3 step hoststeady-win 90 python3 perf/hostcost.py --engine vllm --batch 60 --prefill 0 --gap 5 --windows
    ;;
  pdl)     # programmatic dependent launch and cold caches: the ring's GPU tests with PDL off (DMI_PDL=0; on is the
           # default on Hopper), then perf/sitecost.py back to back and with a layer's weights read before each site
    TAIL=12 step tests 200 env DMI_PDL=0 python3 -m pytest -m gpu tests/gpu/test_cuda_ring.py tests/gpu/test_policy_gpu.py -q -ra -p no:cacheprovider
    TAIL=8 step sitecost 120 python3 perf/sitecost.py
    TAIL=8 step sitecost-cold "${PERF_LIMIT:-240}" python3 perf/sitecost.py --evict-mb 400 --replays 40 "$@"
    ;;
  replay)  # the host's cost of launching a piecewise forward's graphs with dmi's capture nodes in them (perf/replaycost.py:
           # ordinary, PDL, disarmed), against the same pieces without
    TAIL=10 step replaycost 120 python3 perf/replaycost.py "$@"
    ;;
  budget)  # the bandwidth-cap benchmark (perf/budget.py ARGS)
    TAIL=14 step budget "${PERF_LIMIT:-300}" python3 perf/budget.py "$@"
    ;;
  perf)
    TAIL=40 step perf "${PERF_LIMIT:-540}" python3 perf/offline.py --results "$OUT/RESULTS.md" "$@"
    ;;
  *)
    "$part" "$@"
    ;;
esac
