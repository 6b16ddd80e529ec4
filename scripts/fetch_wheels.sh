#!/usr/bin/env bash
# The wheels a GPU machine with torch, transformers, triton and cuda-python may lack (zarr,
# jsonschema, xarray, ml_dtypes, py-spy), downloaded into .whl (git-ignored) for a machine without
# a package index: scripts/gpu.sh and scripts/gpu_vllm.sh install them with pip --no-index.
#   bash scripts/fetch_wheels.sh
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
pick=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl)
python3 -m pip download -q "${pick[@]}" "zarr>=3.1,<3.2" numcodecs donfig google-crc32c jsonschema \
  jsonschema-specifications referencing rpds-py "xarray>=2025.9" "ml_dtypes>=0.5"
python3 -m pip download -q --no-deps -d .whl "py-spy>=0.4"     # a static binary in a py2.py3-none wheel
ls .whl
