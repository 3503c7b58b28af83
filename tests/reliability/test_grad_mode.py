"""When autograd would record (grad enabled and an input or parameter requires grad), tt_infer
runs the graph eagerly with one warning, so backward() works; without recording, engines run."""
import warnings

import pytest
import torch

import blade
from blade.aot import PrecompiledModule

ENGINE_CALL = 'prim::CallMethod[name="execute"]'
RECORDING = "autograd is recording"



def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4), torch.nn.Tanh())


def _grads(model, x, out):
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    grads += [x.grad.clone()] if x.requires_grad else []
    model.zero_grad()
    x.grad = None
    return grads


def _recording_warnings(caught) -> list:
    return [w for w in caught if RECORDING in str(w.message)]


class Capture:
    """tt_infer, remembering what it returned per call."""

    def __init__(self):
        self.results = []

    def __call__(self, gm, example_inputs):
        result = blade.dynamo.tt_infer(gm, example_inputs, options={"min_cluster_size": 1})
        self.results.append(result)
        return result

    def engine_graphs(self) -> int:
        return sum(ENGINE_CALL in str(r.module.graph) for r in self.results if hasattr(r, "module"))


@pytest.mark.parametrize("what", ["parameters", "input"])
def test_recording_graph_runs_eagerly_with_one_warning(what):
    model = _model()
    x = torch.randn(3, 8, requires_grad=what == "input")
    if what == "input":
        model.requires_grad_(False)
    capture = Capture()
    compiled = torch.compile(model, backend=capture, dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [compiled(x) for _ in range(2)]
    assert len(_recording_warnings(caught)) == 1
    assert "torch.no_grad()" in str(_recording_warnings(caught)[0].message)
    expected = model(x)
    expected_grads = _grads(model, x, model(x))
    for out in outs:
        assert out.requires_grad and out.grad_fn is not None
        torch.testing.assert_close(_grads(model, x, out), expected_grads)
    with torch.no_grad():  # the same compiled model without recording: engines
        torch.testing.assert_close(compiled(x), expected.detach())
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), expected.detach())
    assert capture.engine_graphs() >= 1


def test_engines_run_when_autograd_records_nothing():
    model = _model().requires_grad_(False)
    capture = Capture()
    compiled = torch.compile(model, backend=capture, dynamic=False)
    x = torch.randn(3, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)  # grad mode on, nothing requires grad
    assert not _recording_warnings(caught)
    assert capture.engine_graphs() == 1 and not out.requires_grad
    torch.testing.assert_close(out, model(x))


def test_compiled_module_called_while_recording_runs_eagerly():
    """blade.compile_model's CompiledModule (no dynamo guards) checks at each call."""
    model = _model()
    x = torch.randn(3, 8)
    with torch.no_grad():
        compiled = blade.compile_model(model, (x,), blade.Config(min_cluster_size=1))
    assert ENGINE_CALL in str(compiled.module.graph)
    with pytest.warns(UserWarning, match=RECORDING):
        (out,) = compiled(x)
    assert out.grad_fn is not None
    torch.testing.assert_close(_grads(model, x, out), _grads(model, x, model(x)))


def test_deserialized_graph_refuses_to_drop_gradients():
    """A precompiled function loaded from disk has no FX graph to run eagerly: a clear error."""
    model = _model()
    x = torch.randn(3, 8)
    with torch.no_grad():
        compiled = blade.compile_model(model, (x,), blade.Config(min_cluster_size=1))
    wrapped = PrecompiledModule.wrap(compiled, "off")
    loaded = PrecompiledModule.deserialize_compile_artifacts(PrecompiledModule.serialize_compile_artifacts(wrapped))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x)[0], model(x))
    with pytest.raises(RuntimeError, match=f"{RECORDING}(.|\n)*torch.no_grad()"):
        loaded(x.requires_grad_())  # its parameters are constants inside the engines now

