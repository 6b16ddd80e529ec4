#!/usr/bin/env bash
# The README's test command runs this: the CPU test suite (GPU tests are marked `gpu`).
# --durations: the log names the slowest tests, where the suite's time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=40 "$@"
