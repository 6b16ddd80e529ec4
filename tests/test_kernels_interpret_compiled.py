"""The interpreted kernel sections that compile (dynamo, inductor; tests/test_kernels_interpret.py
says how they run): one subprocess for the module, each test reads its own section's outcome. (A
file of its own: pytest-xdist hands whole files to its workers, and this one runs beside the eager
sections' file.)"""
from __future__ import annotations

import pytest

from test_kernels_interpret import COMPILED, _check, _sections


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return _sections(tmp_path_factory, COMPILED)


def test_compiled_forwards_capture_as_traced_ops_equal_to_the_cpu_path(outcomes):
    _check(outcomes, "traced")


def test_captures_rewritten_into_traced_ops_by_a_compile_pass_equal_the_cpu_path(outcomes):
    _check(outcomes, "rewrite")


def test_captures_chained_onto_a_side_stream_by_a_compile_pass_equal_the_plain_compile(outcomes):
    _check(outcomes, "side")


def test_compiled_generate_chains_its_captures_unless_dmi_side_is_0(outcomes):
    _check(outcomes, "side_generate")
