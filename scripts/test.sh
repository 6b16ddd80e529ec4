#!/usr/bin/env bash
# The README's test command runs this: the CPU test suite (GPU tests are marked `gpu`).
# -n 2 --dist loadfile: two pytest-xdist workers (CI's two cores; tests/conftest.py gives each its
# share of torch's threads), each test file in one worker (its module fixtures are built once),
# handed out in the order tests/conftest.py puts them (the longest files first, not xdist's order
# by test count). `-n 0` after it runs everything in this process.
# --durations: the log names the slowest tests, where the suite's time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=40 "$@"
