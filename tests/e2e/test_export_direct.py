"""blade.load's direct call (blade/direct.py): an archive whose forward is exactly one engine call
is served by the engine without TorchScript, with the same results, checks, warnings and fallback;
any other archive keeps its forward."""
from __future__ import annotations

import pytest
import torch

import blade
from blade.config import Config


class _TwoInputs(torch.nn.Module):
    def forward(self, x, y):
        return (torch.sigmoid(x) * y + 1.0,)


class _TwoOutputs(torch.nn.Module):
    """Each output is its own cluster: two engine calls."""

    def forward(self, x, y):
        return torch.sigmoid(x) * y + 1.0, x - y


class _Single(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2.0


class _TwoEngines(torch.nn.Module):
    """sort has no lowering: it stays in TorchScript between two engines."""

    def forward(self, x):
        return torch.sort(torch.relu(x) * 2.0, dim=1).values.sigmoid() + 1.0


def _load(tmp_path, model, inputs, **config):
    path = str(tmp_path / "m.blade.pt")
    blade.export(model, inputs, path, Config(min_cluster_size=1, **config))
    return blade.load(path)


def test_one_engine_archive_is_called_directly_with_the_forwards_results(tmp_path):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    loaded = _load(tmp_path, _TwoInputs(), (x, y))
    assert loaded._direct is not None
    got = loaded(x, y)
    assert isinstance(got, tuple) and len(got) == 1
    assert torch.equal(got[0], loaded.script.forward(x, y)[0])
    torch.testing.assert_close(got, _TwoInputs()(x, y), rtol=1e-5, atol=1e-6)
    single = _load(tmp_path, _Single(), (x,))
    assert single._direct is not None and isinstance(single(x), torch.Tensor)
    assert torch.equal(single(x), torch.relu(x) * 2.0)


def test_direct_call_keeps_the_engines_input_checks(tmp_path):
    x = torch.randn(4, 8)
    loaded = _load(tmp_path, _Single(), (x,))
    with pytest.raises(RuntimeError, match=r"input 0 .* expected float32\[4, 8\] on cpu, got float32\[4, 9\]"):
        loaded(torch.randn(4, 9))
    with pytest.raises(RuntimeError, match=r"expected float32\[4, 8\] on cpu, got float64\[4, 8\]"):
        loaded(x.double())
    with pytest.raises(TypeError, match="expected 1 tensors"):
        loaded._direct([x, x])
    with pytest.raises(TypeError, match="expected 1 tensors"):
        loaded._direct([x.tolist()])
    # a non-contiguous input is copied, as through the forward
    wide = torch.randn(8, 4).t()
    assert torch.equal(loaded(wide), torch.relu(wide) * 2.0)


def test_direct_call_follows_the_fallback_mode_and_warns_in_python(tmp_path):
    x = torch.randn(4, 8)
    loaded = _load(tmp_path, _Single(), (x,), fallback="fallback")
    assert loaded._direct is not None
    other = torch.randn(3, 5)  # the engine refuses the shape; its subgraph computes it
    with pytest.warns(UserWarning, match="runs its TorchScript subgraph instead"):
        got = loaded(other)
    assert torch.equal(got, torch.relu(other) * 2.0)
    loaded.script.cluster_0.set_fallback_mode("off")  # the direct call sees the engine's new mode
    with pytest.raises(RuntimeError, match=r"expected float32\[4, 8\]"):
        loaded(other)


def test_other_archives_keep_their_forward(tmp_path):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    loaded = _load(tmp_path, _TwoEngines(), (x,))
    assert loaded._direct is None
    torch.testing.assert_close(loaded(x), _TwoEngines()(x), rtol=1e-5, atol=1e-5)
    loaded = _load(tmp_path, _TwoOutputs(), (x, y))
    assert loaded._direct is None
    got = loaded(x, y)
    assert isinstance(got, tuple) and len(got) == 2
    torch.testing.assert_close(got, _TwoOutputs()(x, y), rtol=1e-5, atol=1e-6)


def test_torch_compile_graph_of_one_engine_is_called_directly():
    """torch.compile's graphs return a tuple and carry complete tensor types: recognized too."""
    from blade.direct import direct_call
    from blade.dynamo import tt_infer
    compiled = []

    def backend(gm, example_inputs):
        compiled.append(tt_infer(gm, example_inputs, {"min_cluster_size": 1}))
        return compiled[-1]
    fn = torch.compile(lambda x, y: torch.sigmoid(x) * y + 1.0, backend=backend)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        got = fn(x, y)
    direct = direct_call(compiled[0].module)
    assert direct is not None
    flat = direct((x, y))
    assert isinstance(flat, tuple) and torch.equal(flat[0], compiled[0].module.forward(x, y)[0])
    torch.testing.assert_close(got, torch.sigmoid(x) * y + 1.0, rtol=1e-5, atol=1e-6)


class _SecondOnly(torch.nn.Module):
    """The engine takes the second argument only: the direct call picks it out of the call's args."""

    def forward(self, x, y):
        return torch.relu(y) - 1.0


class _Subclass(torch.Tensor):
    pass


def test_positional_call_picks_its_inputs_in_cpp_and_leaves_other_calls_to_the_signature(tmp_path):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    loaded = _load(tmp_path, _SecondOnly(), (x, y))
    assert loaded._fast is not None
    expected = torch.relu(y) - 1.0
    assert torch.equal(loaded(x, y), expected)
    with pytest.raises(TypeError, match="exported for inputs structured as"):
        loaded(x, y=y)  # keywords: the signature's pytree path, which checks the structure
    sub = y.as_subclass(_Subclass)  # not a plain tensor: the signature's path too
    assert torch.equal(torch.Tensor(loaded(x, sub)), expected)
    with pytest.raises(TypeError, match="exported for inputs structured as"):
        loaded(x)
    with pytest.raises(TypeError, match="exported for inputs structured as"):
        loaded(x, y, y)
    with pytest.raises(TypeError, match="expected 2 tensors"):
        loaded._direct([1.0, y])   # an argument the engine does not read is checked too
    two = _load(tmp_path, _TwoInputs(), (x, y))
    got = two(x, y)
    assert two._fast is not None and isinstance(got, tuple) and len(got) == 1
    assert torch.equal(got[0], two.script.forward(x, y)[0])
