"""In-place writes to temporaries rewritten out of place (blade/cluster/out_of_place.py): where
the write is not observable the op and the views it writes through compute in engines; where it
is (its base read later, an input, module state, a write inside control flow) it stays in place,
in TorchScript. Every case against eager, the inputs after the call too."""
from __future__ import annotations

import pytest
import torch

from blade.cluster.out_of_place import rewrite_writes_to_temporaries
from blade_testing import Capture, assert_close, compile_and_check


def _ops(capture) -> dict:
    """aten kind -> reason, of the ops the report left in TorchScript."""
    return {kind: reason for kind, reason in capture.report.left_out if kind.startswith("aten::")}


class ThroughViews(torch.nn.Module):
    """Funnel's relative attention: a product reshaped and sliced, then multiplied in place."""

    def forward(self, x, mask):
        scores = torch.einsum("bij,bjk->bik", x, x)
        scores = scores.reshape(scores.shape[0], -1)[:, 2:]
        scores *= mask
        scores += 1.0
        return torch.softmax(scores, -1) * 2.0


def test_a_write_through_views_of_a_temporary_computes_in_engines():
    x, mask = torch.randn(2, 4, 4), torch.randn(2, 14)
    capture = compile_and_check(ThroughViews().eval(), (x, mask))
    assert capture.report.aten_in_engines == capture.report.aten_total, capture.report.left_out


class BaseReadAfter(torch.nn.Module):
    def forward(self, x):
        base = x * 3.0
        part = base[:, 1:]
        part += 1.0           # base is read below: the write is observable through it
        return base.sum(1) * 2.0, part * 2.0


class WritesItsInput(torch.nn.Module):
    def forward(self, x):
        view = x[:, 1:]
        view.mul_(2.0)
        return view * 2.0 + 1.0


class WritesInABranch(torch.nn.Module):
    def forward(self, x):
        y = (x * 2.0)[:, 1:]
        if x.shape[0] > 1:    # dynamo specializes the branch; TorchScript keeps a scripted If
            y.add_(1.0)
        return y * 2.0


@pytest.mark.parametrize("model, kind", [(BaseReadAfter(), "aten::add_"), (WritesItsInput(), "aten::mul_")])
def test_an_observable_write_stays_in_place(model, kind):
    x = torch.randn(3, 5)
    capture = Capture()
    compiled = torch.compile(model.eval(), backend=capture)
    with torch.no_grad():
        for _ in range(2):
            want_x, got_x = x.clone(), x.clone()
            assert_close(compiled(got_x), model(want_x))
            torch.testing.assert_close(got_x, want_x, rtol=0, atol=0)   # the input written as eager writes it
    assert "mutates memory" in _ops(capture).get(kind, ""), capture.report.left_out


def test_the_kept_dtype_and_later_reads_in_control_flow():
    """An in-place op keeps its target's dtype (float32 * a float64 tensor stays float32), and a
    read of the target inside a later If reads the new value."""
    def fn(x, y, flag: bool):
        t = (x * 2.0)[1:]
        t.mul_(y)
        if flag:
            out = t + 1.0
        else:
            out = t - 1.0
        return out, t

    scripted = torch.jit.script(fn)
    graph = scripted.graph.copy()
    assert rewrite_writes_to_temporaries(graph) == 1
    assert "aten::mul_" not in str(graph) and "aten::type_as" in str(graph)
    rewritten = torch._C._create_function_from_graph("rewritten", graph)
    x, y = torch.randn(4, 3), torch.randn(3, dtype=torch.float64)
    for flag in (True, False):
        got, want = rewritten(x, y, flag), fn(x, y, flag)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype == torch.float32
            torch.testing.assert_close(g, w)


def test_a_write_inside_a_branch_is_left_alone():
    graph = torch.jit.script(WritesInABranch()).graph.copy()
    assert rewrite_writes_to_temporaries(graph) == 0 and "aten::add_" in str(graph)


def test_a_tuple_holding_the_base_read_after_the_write_keeps_it_in_place():
    """A tuple built before the write holds the base, and the tuple is read after it: the write is
    observable through the tuple (alias sets follow lists, not tuples)."""
    def fn(x, m):
        base = x * 2.0
        pair = (base, x)
        view = base[1:]
        view.mul_(m)
        return pair[0] + 1.0, view

    graph = torch.jit.script(fn).graph.copy()
    assert rewrite_writes_to_temporaries(graph) == 0 and "aten::mul_" in str(graph)
