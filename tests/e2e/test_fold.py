"""Input-independent regions that write into the tensors they make (blade/fold.py): folded into
constants at compile time, each reader seeing the value it saw in eager; left to run when the
region touches model state, an input-dependent write reaches it, or it draws random numbers."""
import pytest
import torch

from blade.fold import fold_input_independent
from blade_testing import Capture, assert_close


class RelativePositions(torch.nn.Module):
    """BEiT's relative-position bias: an index made with zeros and filled by slice assignments
    on every call, then a gather from a bias table (a parameter)."""

    def __init__(self, window=3, heads=2):
        super().__init__()
        self.window = window
        self.table = torch.nn.Parameter(torch.randn((2 * window - 1) ** 2 + 3, heads))

    def index(self):
        w = self.window
        coords = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(w), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        relative[:, :, 0] += w - 1
        relative[:, :, 1] += w - 1
        relative[:, :, 0] *= 2 * w - 1
        index = torch.zeros((w * w + 1,) * 2, dtype=relative.dtype)
        index[1:, 1:] = relative.sum(-1)
        index[0, 0:] = self.table.shape[0] - 3
        index[0:, 0] = self.table.shape[0] - 2
        index[0, 0] = self.table.shape[0] - 1
        return index

    def forward(self, scores):
        n = self.window * self.window + 1
        bias = self.table[self.index().view(-1)].view(n, n, -1).permute(2, 0, 1)
        return (scores + bias).softmax(-1)


def test_a_region_rebuilt_by_writes_from_constants_folds_and_every_op_computes_in_engines():
    torch.manual_seed(0)
    model, capture = RelativePositions().eval(), Capture()
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        for _ in range(2):
            scores = torch.randn(4, 2, 10, 10)
            assert_close(compiled(scores), model(scores))
    report = capture.report
    assert report.coverage == 1.0 and report.aten_in_engines > 0, report.left_out


class ReadersAcrossWrites(torch.nn.Module):
    """A constant read before and after a write to it: each reader keeps the value it saw. (A
    view of a weight read beside it is no copy of the weight.)"""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        t = torch.zeros(4)
        before = x + t
        t += 1.0
        t[0] = 5.0
        return before, x * t, (x - t).relu() @ self.weight.t()


class WrittenWithInput(torch.nn.Module):
    """A tensor the graph makes from constants, then written with input data: not a constant."""

    def forward(self, x):
        t = torch.zeros(4)
        t[3] = 7.0
        t[:2] = x[:2]
        return t * 2.0 + x


class AddedThroughAView(torch.nn.Module):
    """... also when the input is added by an operator into a view of it."""

    def forward(self, x):
        u = torch.ones(4)
        u[1] = 3.0
        head = u[:3]
        head += x[1:]
        return u * x


class RandomRegion(torch.nn.Module):
    def forward(self, x):
        r = torch.rand(4)
        r[0] = 1.0
        return x + r


def test_each_reader_of_a_folded_constant_sees_its_value_in_eager():
    model, capture = ReadersAcrossWrites(), Capture(min_cluster_size=1)
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4)
            assert_close(compiled(x), model(x))


@pytest.mark.parametrize("model", [WrittenWithInput(), AddedThroughAView()], ids=["setitem", "iadd_view"])
def test_a_region_an_input_writes_into_is_not_folded(model):
    compiled = torch.compile(model, backend=Capture(min_cluster_size=1))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4)
            assert_close(compiled(x), model(x))


def test_a_random_region_draws_on_every_call():
    compiled = torch.compile(RandomRegion(), backend=Capture(min_cluster_size=1))
    with torch.no_grad():
        x = torch.zeros(4)
        first, second = compiled(x), compiled(x)
    assert first[0] == second[0] == 1.0 and not torch.equal(first, second)


def test_a_region_writing_model_state_is_left_as_it_is():
    """calls[0] = 5 on a frozen buffer (an FX graph written by hand: symbolic_trace would run the
    write itself while tracing)."""
    import operator
    root = torch.nn.Module()
    root.register_buffer("calls", torch.zeros(2))
    graph = torch.fx.Graph()
    x, calls = graph.placeholder("x"), graph.get_attr("calls")
    made = graph.call_function(torch.ones, (2,))
    graph.call_function(operator.setitem, (made, 1, 3.0))
    graph.call_function(operator.setitem, (calls, 0, 5.0))
    graph.output(graph.call_function(operator.add, (graph.call_function(operator.add, (x, calls)), made)))
    gm = torch.fx.GraphModule(root, graph)
    before = gm.code
    assert fold_input_independent(gm) == 0 and gm.code == before
    assert torch.equal(gm.calls, torch.zeros(2))  # refused before the write reached the model
    assert torch.equal(gm(torch.zeros(2)), torch.tensor([6.0, 3.0]))


def test_the_frontend_folds_with_weights_frozen_and_keeps_the_graph_runnable():
    from blade.frontend import _plain_graph_module
    model, x, plain = ReadersAcrossWrites(), torch.randn(4), []

    def backend(gm, example_inputs):
        plain.append(_plain_graph_module(gm, example_inputs, freeze=True))
        return gm.forward
    torch.compile(model, backend=backend)(x)
    (module, runtime_inputs), = plain
    assert runtime_inputs == [0]  # x; the weight is an attribute
    assert not any(n.op == "call_function" and n.target is torch.zeros for n in module.graph.nodes)
    folded = [b for name, b in module.named_buffers() if name.startswith("_blade_folded_")]
    assert folded and all(b.numel() == 4 for b in folded)  # t's snapshots; no copy of the weight
    with torch.no_grad():
        for got, want in zip(module(x), model(x)):
            assert torch.equal(got, want)
