"""Which GEMM kernels an engine with run-time sizes may run (cpp/gemm_choice.cpp, issue 12's "peak
RSS flat after the largest shape"): oneDNN JIT-compiles and caches a primitive per exact shape
(1-5 MiB each), and such an engine meets a new shape on almost every call, so where the runtime's
panels kernel can run a GEMM oneDNN is no candidate there. A static engine still times oneDNN. The
test knob that lets oneDNN back in shows the rule is what keeps it out (the same engine, the same
shapes, oneDNN runs)."""
import pytest
import torch

import blade
from blade._C import _testing
from blade_testing import assert_close

# The panels kernel needs AVX-512 (torch's own CPU capability check says whether it is there).
pytestmark = pytest.mark.skipif(
    not (_testing.gemm_onednn_usable() and torch.backends.cpu.get_cpu_capability() == "AVX512"),
    reason="needs libtorch's oneDNN matmul and AVX-512 (the panels kernel)")

ROWS = [40, 57, 64, 33, 50]  # one power-of-two bucket (33-64 rows) and its neighbour: new exact shapes


def onednn_calls() -> int:
    return _testing.gemm_kernel_calls("onednn-matmul") + _testing.gemm_kernel_calls("onednn-packed")


def linear_model():
    torch.manual_seed(0)
    # 2 x rows x 256 x 256 flops: above the 2 MFLOP under which "auto" takes MKL untimed
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)).eval()


@pytest.fixture
def auto_gemm():
    _testing.set_gemm_backend("auto")
    yield
    _testing.set_gemm_jit_at_run_time_sizes(False)
    _testing.set_gemm_backend("")


def run_shapes(compiled, model, rows, calls_per_shape=12):
    with torch.no_grad():
        for m in rows:
            x = torch.randn(m, 256)
            for _ in range(calls_per_shape):
                got = compiled(x)
            assert_close(got, model(x))


def test_engine_with_run_time_sizes_runs_no_onednn(auto_gemm):
    model = linear_model()
    rows = torch.export.Dim("rows", min=1, max=128)
    compiled = blade.compile_model(model, (torch.randn(64, 256),), dynamic_shapes=((rows, None),))
    panels_before, onednn_before = _testing.gemm_kernel_calls("panels"), onednn_calls()
    run_shapes(compiled, model, ROWS)
    assert onednn_calls() == onednn_before
    assert _testing.gemm_kernel_calls("panels") > panels_before
    # The knob lets oneDNN be sampled on the same engine: the rule above, not the shapes, kept it out.
    _testing.set_gemm_jit_at_run_time_sizes(True)
    run_shapes(compiled, model, ROWS)
    assert onednn_calls() > onednn_before


def test_static_engine_still_samples_onednn(auto_gemm):
    model = linear_model()
    compiled = blade.compile_model(model, (torch.randn(64, 256),))
    before = onednn_calls()
    run_shapes(compiled, model, [64])
    assert onednn_calls() > before


def test_pinned_onednn_mode_is_honoured_with_run_time_sizes():
    """BLADE_GEMM=onednn leaves no other candidate: the rule gives way to the user's pin."""
    _testing.set_gemm_backend("onednn")
    try:
        model = linear_model()
        rows = torch.export.Dim("rows", min=1, max=128)
        compiled = blade.compile_model(model, (torch.randn(64, 256),), dynamic_shapes=((rows, None),))
        before = onednn_calls()
        run_shapes(compiled, model, ROWS[:2], calls_per_shape=3)
        assert onednn_calls() > before
    finally:
        _testing.set_gemm_backend("")
