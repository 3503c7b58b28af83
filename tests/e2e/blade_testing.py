"""Shared helpers: compile with tt_infer, compare with eager, prove engines really ran."""
from __future__ import annotations

import contextlib

import torch

import blade  # noqa: F401  (registers tt_infer)
from blade.pipeline import CompiledModule


class Capture:
    """A tt_infer wrapper that remembers the CompiledModule(s) it produced."""

    def __init__(self, **options):
        self.options = options
        self.compiled: list = []

    def __call__(self, gm, example_inputs):
        from blade.dynamo import tt_infer
        result = tt_infer(gm, example_inputs, options=self.options)
        assert isinstance(result, CompiledModule), "tt_infer fell back to eager for a whole graph"
        self.compiled.append(result)
        return result

    @property
    def report(self):
        assert len(self.compiled) == 1, f"expected one graph, dynamo produced {len(self.compiled)}"
        return self.compiled[0].report

    @property
    def graph_text(self) -> str:
        return "\n".join(str(c.module.graph) for c in self.compiled)

    def engine_calls(self) -> int:
        return self.graph_text.count('prim::CallMethod[name="execute"]')


def _flatten(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _flatten(item)]
    if isinstance(out, dict) or hasattr(out, "to_tuple"):
        items = out.to_tuple() if hasattr(out, "to_tuple") else tuple(out.values())
        return _flatten(items)
    return []


def assert_close(actual, expected, rtol=1e-4, atol=1e-5):
    got, want = _flatten(actual), _flatten(expected)
    assert len(got) == len(want), f"{len(got)} outputs, eager has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}"
        if w.dtype.is_floating_point:
            special = ~torch.isfinite(w)  # NaN and inf where eager has them, the same ones
            assert torch.equal(~torch.isfinite(g), special) and \
                torch.equal(g[special].nan_to_num(), w[special].nan_to_num()), f"output {i}: NaN/inf differ"
            g, w = g.masked_fill(special, 0), w.masked_fill(special, 0)
            scale = w.abs().max().item() if w.numel() else 0.0
            err = (g - w).abs().max().item() if w.numel() else 0.0
            assert err <= atol + rtol * scale, f"output {i}: max abs err {err:.3g} (scale {scale:.3g})"
        else:
            assert torch.equal(g, w), f"output {i} differs"


def compile_and_check(model, inputs, *, min_engines=1, rtol=1e-4, atol=1e-5, **options):
    """torch.compile(model, backend=tt_infer) vs eager; returns the Capture for more checks."""
    capture = Capture(**options)
    with torch.no_grad():
        expected = model(*inputs)
        compiled = torch.compile(model, backend=capture)
        actual = compiled(*inputs)
        again = compiled(*inputs)  # second call: engines reused, no recompile
    assert len(capture.compiled) >= 1
    assert capture.engine_calls() >= min_engines, f"only {capture.engine_calls()} engine call(s) in:\n{capture.graph_text}"
    assert_close(actual, expected, rtol, atol)
    assert_close(again, expected, rtol, atol)
    return capture


def compile_dynamic_and_check(model, shapes, rtol=1e-4, atol=1e-5):
    """torch.compile(model, backend=tt_infer, dynamic=True) vs eager on torch.randn(*shape) for each
    of shapes (one compile is meant to serve them all); returns the Capture for more checks."""
    capture = Capture()
    compiled = torch.compile(model, backend=capture, dynamic=True)
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(*shape)
            assert_close(compiled(x), model(x), rtol, atol)
    return capture


# The runtime picks each GEMM shape's kernel (MKL or oneDNN) by timing them once per process, so
# two processes can round a GEMM differently. Tests that compare outputs bitwise across processes
# pin one kernel on both sides: this in the test process, PINNED_GEMM_ENV in the other's environment.
PINNED_GEMM = "mkl"
PINNED_GEMM_ENV = {"BLADE_GEMM": PINNED_GEMM}


@contextlib.contextmanager
def pinned_gemm():
    from blade._C import _testing
    _testing.set_gemm_backend(PINNED_GEMM)
    try:
        yield
    finally:
        _testing.set_gemm_backend("")
