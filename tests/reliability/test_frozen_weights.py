"""Parameters and buffers frozen into engines (Config.freeze_params) that change after compile:
the compiled graph notices (version counter, identity, data pointer), warns naming the tensor and
compiles again, so it computes with the new values like eager does."""
import warnings

import pytest
import torch

import blade
import blade.pipeline

ENGINE_CALL = 'prim::CallMethod[name="execute"]'
CHANGED = "changed after this graph was compiled"



class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 4)
        self.register_buffer("shift", torch.zeros(4))

    def forward(self, x):
        return torch.tanh(self.out(torch.relu(self.fc(x)))) + self.shift


def _replace_fc_weight(net):
    net.fc.weight = torch.nn.Parameter(torch.randn(16, 8))


def _assign_data(net):
    net.fc.weight.data = torch.randn(16, 8)


# how a user changes a frozen tensor -> (change, the name the warning gives)
CHANGES = {
    "mul_": (lambda net: net.fc.weight.mul_(2), "fc.weight"),
    "copy_": (lambda net: net.out.bias.copy_(torch.randn(4)), "out.bias"),
    "load_state_dict": (lambda net: net.load_state_dict({k: torch.randn_like(v) for k, v in net.state_dict().items()}),
                        "fc.weight"),
    "buffer": (lambda net: net.shift.fill_(1.5), "shift"),
    "new_parameter": (_replace_fc_weight, "fc.weight"),
    "assign_data": (_assign_data, "fc.weight"),
}


class Capture:
    def __init__(self):
        self.results = []

    def __call__(self, gm, example_inputs):
        result = blade.dynamo.tt_infer(gm, example_inputs, options={"min_cluster_size": 1})
        self.results.append(result)
        return result


def _changed_warnings(call) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught if CHANGED in str(w.message)]


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_torch_compile_sees_changed_weights(change):
    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 8)
    capture = Capture()
    compiled = torch.compile(net, backend=capture, dynamic=False)
    mutate, name = CHANGES[change]
    with torch.no_grad():
        for _ in range(2):  # unchanged weights: no recompile
            out, changed = _changed_warnings(lambda: compiled(x))
            torch.testing.assert_close(out, net(x))
            assert not changed
        mutate(net)
        out, changed = _changed_warnings(lambda: compiled(x))
        torch.testing.assert_close(out, net(x))
        assert len(changed) == 1 and name in changed[0], changed
        out, changed = _changed_warnings(lambda: compiled(x))  # compiled again once, then stable
        torch.testing.assert_close(out, net(x))
        assert not changed
    assert all(ENGINE_CALL in str(r.module.graph) for r in capture.results)


def test_compile_model_sees_changed_attribute_weights():
    """blade.compile_model's graph reads parameters as attributes, not inputs."""
    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 8)
    with torch.no_grad():
        compiled = blade.compile_model(net, (x,), blade.Config(min_cluster_size=1))
        torch.testing.assert_close(compiled(x)[0], net(x))
        net.out.weight.mul_(-1)
        with pytest.warns(UserWarning, match=f"out.weight {CHANGED}"):
            (out,) = compiled(x)
        torch.testing.assert_close(out, net(x))
    assert ENGINE_CALL in str(compiled.module.graph)


def test_weights_changing_on_every_call_run_eagerly_after_a_few_recompiles():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 8)
    compiled = torch.compile(net, backend=Capture(), dynamic=False)
    messages = []
    with torch.no_grad():
        for _ in range(blade.pipeline.MAX_RECOMPILES + 3):
            net.fc.weight.add_(0.5)
            out, changed = _changed_warnings(lambda: compiled(x))
            torch.testing.assert_close(out, net(x))
            messages += changed
    assert len(messages) == blade.pipeline.MAX_RECOMPILES + 1
    assert "runs eagerly from now on" in messages[-1]


class Counter(torch.nn.Module):
    """Writes its own buffer: state, not a weight (no recompile on every call)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.register_buffer("calls", torch.zeros(1))
        self.register_buffer("history", torch.zeros(3))

    def forward(self, x):
        self.calls.add_(1)
        self.history[1:].mul_(0.5)
        return torch.tanh(self.fc(x)) * 2


def test_buffers_the_graph_writes_are_not_watched():
    net, x = Counter(), torch.randn(3, 8)
    compiled = torch.compile(net, backend=Capture(), dynamic=False)
    with torch.no_grad():
        for _ in range(3):
            out, changed = _changed_warnings(lambda: compiled(x))
            assert not changed
            torch.testing.assert_close(out, net(x))
        net.fc.weight.mul_(2)  # the weight is still watched
        out, changed = _changed_warnings(lambda: compiled(x))
        assert len(changed) == 1 and "fc.weight" in changed[0]
        torch.testing.assert_close(out, net(x))


def test_instances_of_one_module_class_keep_one_compile_each():
    """dynamo gives every instance of a class one graph, with that instance's weights as inputs:
    alternating calls must switch between compiled variants, not recompile (or give up) each time."""
    torch.manual_seed(0)
    nets, x = [Net() for _ in range(3)], torch.randn(3, 8)
    capture = Capture()
    compiled = [torch.compile(net, backend=capture, dynamic=False) for net in nets]
    with torch.no_grad():
        first_round = []
        for net, fn in zip(nets, compiled):
            out, changed = _changed_warnings(lambda: fn(x))
            torch.testing.assert_close(out, net(x))
            first_round += changed
        for _ in range(blade.pipeline.MAX_RECOMPILES + 2):  # round robin: no new compile, no eager
            for net, fn in zip(nets, compiled):
                out, changed = _changed_warnings(lambda: fn(x))
                torch.testing.assert_close(out, net(x))
                assert not changed, changed
    assert len(first_round) <= len(nets) - 1  # at most one variant compiled per further instance
    assert all(ENGINE_CALL in str(r.module.graph) for r in capture.results)
