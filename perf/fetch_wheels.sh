#!/usr/bin/env bash
# The wheels the GPU machine lacks (it has torch, transformers, triton and cuda-python; no zarr,
# jsonschema, xarray, ml_dtypes or py-spy), downloaded here into .whl (git-ignored) for the device calls to
# carry: perf/gpu_session.sh and perf/gpu_vllm.sh install them with pip --no-index.
#   bash perf/fetch_wheels.sh          # then run(..., carry=[".whl"])
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
pick=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl)
python3 -m pip download -q "${pick[@]}" "zarr>=3.1,<3.2" numcodecs donfig google-crc32c jsonschema \
  jsonschema-specifications referencing rpds-py "xarray>=2025.9" "ml_dtypes>=0.5"
python3 -m pip download -q --no-deps -d .whl "py-spy>=0.4"     # a static binary in a py2.py3-none wheel
ls .whl
