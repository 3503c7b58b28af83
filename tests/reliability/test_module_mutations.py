"""A model changed after torch.compile(backend="tt_infer") computes what eager computes.

blade keeps dynamo's guards as they are (README.md, "Dynamo's own per-call cost"): dynamo notices
a changed training flag, a swapped submodule or a changed Python attribute and traces again, and
blade's own check (blade/guards.py FrozenWeights) notices parameters replaced or written in place.
With torch's opt-in that drops the guards on nn.Modules (guard_filter_fn=
skip_guard_on_all_nn_modules_unsafe) blade's check still sees every parameter change."""
import copy
import warnings

import pytest
import torch

import blade  # noqa: F401  (registers tt_infer)

ENGINE_CALL = 'prim::CallMethod[name="execute"]'
OPTIONS = {"min_cluster_size": 1}  # small graphs compile to engines too


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.act = torch.nn.ReLU()
        self.out = torch.nn.Linear(16, 4)
        self.scale = 2.0

    def forward(self, x):
        return self.out(self.act(self.norm(self.fc(x)))) * self.scale


def _set_scale(net):
    net.scale = -0.5


def _swap_activation(net):
    net.act = torch.nn.Tanh()


def _replace_parameter(net):
    net.out.weight = torch.nn.Parameter(torch.randn(4, 16))


# mutations dynamo's guards notice (blade's defaults keep them)
GUARDED = {
    "train": lambda net: net.train(),
    "attribute": _set_scale,
    "submodule": _swap_activation,
}
# mutations blade's FrozenWeights notices itself, with or without dynamo's module guards
WEIGHTS = {
    "in_place": lambda net: net.fc.weight.mul_(-1),
    "buffer": lambda net: net.norm.running_mean.add_(3.0),
    "replaced": _replace_parameter,
    "load_state_dict": lambda net: net.load_state_dict(
        {k: torch.rand_like(v) + 0.5 if v.is_floating_point() else v for k, v in net.state_dict().items()}),
}


class Capture:
    """tt_infer, keeping what it returns (to check the engines ran)."""

    def __init__(self):
        self.results = []

    def __call__(self, gm, example_inputs):
        result = blade.dynamo.tt_infer(gm, example_inputs, options=OPTIONS)
        self.results.append(result)
        return result


def _run_changed(mutate, compile_options=None):
    """Compile, call twice, mutate the model and an eager copy alike, call twice more: every
    output must be eager's."""
    torch.manual_seed(0)
    net, x = Net().eval(), torch.randn(5, 8)
    reference = copy.deepcopy(net)
    capture = Capture()
    compiled = torch.compile(net, backend=capture, dynamic=False, options=compile_options)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "changed after this graph was compiled": expected here
        for _ in range(2):
            torch.testing.assert_close(compiled(x), reference(x))
        for model in (net, reference):  # the same random values for both
            torch.manual_seed(1)
            mutate(model)
        for _ in range(2):
            torch.testing.assert_close(compiled(x), reference(x))
    assert any(ENGINE_CALL in str(r.module.graph) for r in capture.results if hasattr(r, "module"))


@pytest.mark.parametrize("change", sorted(GUARDED))
def test_guarded_mutation_gives_eagers_answer(change):
    _run_changed(GUARDED[change])


@pytest.mark.parametrize("filter_name", [None, "skip_guard_on_all_nn_modules_unsafe"])
@pytest.mark.parametrize("change", sorted(WEIGHTS))
def test_weight_change_gives_eagers_answer(change, filter_name):
    options = {"guard_filter_fn": getattr(torch.compiler, filter_name)} if filter_name else None
    _run_changed(WEIGHTS[change], options)
