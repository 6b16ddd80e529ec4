"""Start-up of the ``dmi capture`` subprocesses whose stores tests compare bit for bit with an
in-process reference (tests/test_reliability.py, ``_cli_env`` puts this folder first on
PYTHONPATH): oneMKL's vector-math kernels are settled before any model runs, as in every test
process. Without it the CLI's first forward can take a low-accuracy ``cos`` on one of its two
threads (pytorch/pytorch#188792; conftest.settle_mkl_vml) and its first batch's rows differ from
the reference by ~1e-5: seen once in CI, 12.9 % of a kill -9 test's rows."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import settle_mkl_vml  # noqa: E402

settle_mkl_vml()          # (importing conftest did so already; said here, where it matters)
