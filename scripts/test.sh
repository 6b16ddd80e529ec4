#!/usr/bin/env bash
# The README's test command runs this: the CPU test suite (GPU tests are marked `gpu`).
# -n 2 --dist loadgroup: two pytest-xdist workers (CI's two cores; tests/conftest.py gives each its
# share of torch's threads), tests marked with one xdist_group in one worker (they share an
# expensive module fixture). `-n 0` after it runs everything in this process.
# --durations: the log names the slowest tests, where the suite's time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=40 "$@"
