"""The side-stream chain (``dmi.kernels.side``) in inductor's generated code, on the CPU.

A capture kernel forked onto a side stream reads its tensor after the op returns, so nothing in
the graph may be written over that tensor before the join. These tests read the code inductor
generates for a small graph of matmuls (whose outputs inductor reuses) with and without the
chain: without it a captured buffer is reused right after its capture, or written in place by
a mutable op after it (the hazards); with it no captured buffer is reused, the mutable op writes a
copy, each capture takes the previous one's tensors, and the graph ends with the join. The run id names no open run: the ops' kernels do nothing here (the ring's side of the
chain runs in test_kernels_interpret.py and on the GPU).
"""
from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

from dmi.siteop import run_of       # (importing it registers the dmi ops)
from dmi.kernels.side import chain_captures

NO_RUN = 999_999


class Chain(CustomGraphPass):
    marked: list = []

    def __call__(self, graph):
        Chain.marked.append(chain_captures(graph))

    def uuid(self):
        return "dmi-test-side-chain"


def _model(ticket):
    def f(a, w):
        x = torch.mm(a, w)
        torch.ops.dmi.capture(x, ticket, NO_RUN, 0, None)
        y = torch.mm(x, w)
        z = torch.mm(y, w)
        torch.ops.dmi.capture_sum(z, y, ticket, NO_RUN, 1, None)
        return torch.mm(z, w)
    return f


def _code(options):
    assert run_of(NO_RUN) is None
    torch._dynamo.reset()
    ticket = torch.zeros(1, dtype=torch.int64)
    a, w = torch.randn(8, 8), torch.randn(8, 8)
    f = _model(ticket)
    out, code = run_and_get_code(torch.compile(f, fullgraph=True, options=options), a, w)
    torch.testing.assert_close(out, f(a, w))
    return "\n".join(code)


def _calls(code, op):
    """The buffers each call of ``torch.ops.dmi.<op>`` passes (its tensor arguments, in order)."""
    return [re.findall(r"\bbuf\d+\b", m) for m in re.findall(rf"torch\.ops\.dmi\.{op}\.default\((.*)\)", code)]


# vLLM compiles with auto_functionalized v1, torch's default is v2: the chain must hold under both
FUNCTIONALIZED = pytest.mark.parametrize("v2", [False, True], ids=["functionalized-v1", "functionalized-v2"])


@FUNCTIONALIZED
def test_captured_buffers_are_never_reused_and_the_chain_ends_with_a_join(v2):
    with torch._inductor.config.patch(force_disable_caches=True, enable_auto_functionalized_v2=v2):
        _check_chain()


def _check_chain():
    plain = _code({})
    (x,), = _calls(plain, "capture")
    assert re.search(rf"= {x}; del {x}\s+# reuse", plain), "the hazard this guards against: a captured buffer reused"
    assert not _calls(plain, "join")

    Chain.marked.clear()
    chained = _code({"post_grad_custom_post_pass": Chain()})
    assert Chain.marked == [2]
    assert "# reuse" not in chained, chained              # no buffer reused at all in this graph
    (x,), = _calls(chained, "capture")
    (z, y, after), = _calls(chained, "capture_sum")
    assert after == x                                       # the previous capture's tensor, kept to here
    (z2, y2), = _calls(chained, "join")
    assert (z2, y2) == (z, y)                               # the last capture's tensors, kept to the join
    assert re.search(r"dmi\.join\.default\(arg\d+_1, ", chained), chained   # on the ticket itself, not a copy of it
    assert chained.index("dmi.join") > chained.index("dmi.capture_sum")
    assert re.search(r"capture(_sum)?\.default\(.*, 1\)\n", chained)     # side=1


_TEST_LIB = torch.library.Library("dmitest", "DEF")
_TEST_LIB.define("scale_(Tensor(a!) x) -> ()")        # a mutable op, as engines' fused in-place kernels are


def _scale_(x: torch.Tensor) -> None:
    x.mul_(2)


_TEST_LIB.impl("scale_", _scale_, "CompositeExplicitAutograd")
torch.library.register_fake("dmitest::scale_", lambda x: None, lib=_TEST_LIB)


@FUNCTIONALIZED
def test_a_captured_tensor_is_not_mutated_in_place_before_the_next_capture(v2):
    """A mutable op on a captured tensor after its capture: plain, inductor reinplaces it (the
    captured buffer itself is written, while a forked capture kernel may still read it); chained,
    the next capture's ``after`` keeps the tensor in use, so the op writes a copy instead."""
    def f(a, w, ticket):
        x = torch.mm(a, w)
        torch.ops.dmi.capture(x, ticket, NO_RUN, 0, None)
        torch.ops.dmitest.scale_(x)
        y = torch.mm(x, w)
        torch.ops.dmi.capture(y, ticket, NO_RUN, 1, None)
        return y

    a, w = torch.randn(8, 8), torch.randn(8, 8)
    mutated = {}
    for name, options in (("plain", {}), ("chained", {"post_grad_custom_post_pass": Chain()})):
        torch._dynamo.reset()
        with torch._inductor.config.patch(force_disable_caches=True, enable_auto_functionalized_v2=v2):
            out, code = run_and_get_code(torch.compile(f, fullgraph=True, options=options), a, w, torch.zeros(1, dtype=torch.int64))
        torch.testing.assert_close(out, f(a, w, torch.zeros(1, dtype=torch.int64)))
        code = "\n".join(code)
        captured = _calls(code, "capture")[0][0]
        written = re.findall(r"torch\.ops\.dmitest\.scale_\.default\((?:reinterpret_tensor\()?(buf\d+)", code)
        mutated[name] = written == [captured]
    assert mutated == {"plain": True, "chained": False}, mutated


def test_a_graph_without_captures_is_left_alone():
    g = torch.fx.symbolic_trace(lambda a: a.sin() + 1).graph
    before = str(g)
    assert chain_captures(g) == 0 and str(g) == before
