"""Frontend rewrites of the frozen TorchScript graph, checked on the graph and against eager."""
import torch
import torch.fx

import blade
from blade.frontend import to_torchscript
from blade_testing import assert_close


class SharedInputLinears(torch.nn.Module):
    """Attention-style projections: three linears on one input (one without bias), one elsewhere."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8), torch.nn.Linear(16, 4, bias=False)
        self.out = torch.nn.Linear(8, 16)

    def forward(self, x):
        scores = (self.q(x) * self.k(x)).sum(-1, keepdim=True)
        return self.out(self.q(x) + scores) + self.v(x).mean(-1, keepdim=True)


def kinds(graph):
    return [node.kind() for node in graph.nodes()]


def test_linears_sharing_an_input_become_one_sliced_linear():
    torch.manual_seed(0)
    model, x = SharedInputLinears().eval(), torch.randn(2, 5, 16)
    frontend = to_torchscript(torch.fx.symbolic_trace(model), [x])
    # q, k and v (q used twice) merge into one [20, 16] linear; `out` reads another input
    assert kinds(frontend.graph).count("aten::linear") == 2
    assert kinds(frontend.graph).count("aten::slice") == 3
    with torch.no_grad():
        assert_close(frontend.module(x), model(x))
        assert_close(torch.compile(model, backend="tt_infer")(x), model(x))
        assert_close(blade.compile_model(model, (x,))(x)[0], model(x))
