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

# The oneDNN tests need libtorch's oneDNN matmul, which wants AVX-512 here (torch's own CPU
# capability check says whether it is there); the panels kernel runs on AVX2 + FMA too.
needs_onednn = pytest.mark.skipif(
    not (_testing.gemm_onednn_usable() and torch.backends.cpu.get_cpu_capability() == "AVX512"),
    reason="needs libtorch's oneDNN matmul and AVX-512")
needs_panels = pytest.mark.skipif(blade._C.host_isa() not in ("x86-64-v3", "x86-64-v4"),
                                  reason="the panels kernel needs AVX2 and FMA")

ROWS = [40, 57, 64, 33, 50]  # one power-of-two bucket (33-64 rows) and its neighbour: new exact shapes


def onednn_calls() -> int:
    return _testing.gemm_kernel_calls("onednn-matmul") + _testing.gemm_kernel_calls("onednn-packed")


def linear_model(width=256):
    """Two Linears of one shape. The GEMM choices are process-wide, keyed by shape: a test that
    watches a bucket settle takes a width of its own, or an earlier test in the same process
    (BERT's 256 x 256 projections) may have settled that bucket or its neighbours already."""
    torch.manual_seed(0)
    # 2 x rows x 256 x 256 flops: above the 2 MFLOP under which "auto" takes MKL untimed
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)).eval()


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


@needs_onednn
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


@needs_onednn
def test_static_engine_still_samples_onednn(auto_gemm):
    model = linear_model()
    compiled = blade.compile_model(model, (torch.randn(64, 256),))
    before = onednn_calls()
    run_shapes(compiled, model, [64])
    assert onednn_calls() > before


@needs_onednn
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


@needs_panels
def test_a_bucket_settles_over_new_row_counts_and_its_other_weight_runs_the_panels_kernel(auto_gemm):
    """A server calls each row count about once. Two Linears of one shape are one bucket of GEMMs
    (the first weight samples, the second runs the panels kernel, packed at load, meanwhile); 20 new
    row counts of the bucket (33-64) settle it, and from then on no call samples. Before, a kernel's
    first call at each new row count was no sample (it would pack or JIT elsewhere): 20 such calls
    recorded nothing, and a bucket of a server kept sampling MKL, 1.4-2.2x slower, on half of its
    sampling calls for up to 24 calls. One thread: with more, an engine call that meets a stall runs
    serially (oversubscription.h), and its GEMMs are a bucket of their own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_new_row_counts()
    finally:
        torch.set_num_threads(threads)


def run_new_row_counts(width=248):
    model = linear_model(width)
    rows = torch.export.Dim("rows", min=1, max=128)
    compiled = blade.compile_model(model, (torch.randn(64, width),), dynamic_shapes=((rows, None),))

    def calls_at(row_counts):
        with torch.no_grad():
            for m in row_counts:
                x = torch.randn(m, width)
                assert_close(compiled(x), model(x))

    def choice():
        found = [c for c in blade._C.gemm_choices() if "rows 33-64" in c["shape"] and "B constant" in c["shape"]
                 and f"@ [{width}, {width}]" in c["shape"]]
        assert len(found) == 1, blade._C.gemm_choices()
        return found[0]

    calls_at(range(33, 53))
    settled = choice()
    # Only the sampling weight's calls sample: one GEMM of the two per call. (Not a count of MKL
    # calls: the other weight runs the kernel measured fastest so far, MKL when a busy machine
    # slowed the panels kernel's first samples.)
    assert 5 <= settled["timings"] <= 20, settled
    panels_before, mkl_before = _testing.gemm_kernel_calls("panels"), _testing.gemm_kernel_calls("mkl")
    calls_at(range(53, 65))
    assert choice()["timings"] == settled["timings"]  # settled: no call samples any more
    ran = {"panels": _testing.gemm_kernel_calls("panels") - panels_before,
           "mkl": _testing.gemm_kernel_calls("mkl") - mkl_before}
    assert ran[settled["kernel"]] == 2 * 12, ran  # both weights run the bucket's kernel


@needs_panels
def test_a_new_buckets_other_weights_run_the_kernel_its_settled_neighbour_chose(auto_gemm):
    """While a new row bucket samples on one weight, its other weights run the kernel the nearest
    settled bucket chose, not always the panels kernel: where MKL won the neighbours (an Intel
    Xeon, by 1.3x) every new bucket's first ~10 calls ran its other weights on the slower kernel
    (a server's first calls at each new row bucket up to 1.25x the settled call). Where the panels
    kernel wins, this is what ran before. One thread, as above (a stall's serial mode is a bucket
    of its own)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        width = 240
        model = linear_model(width)
        rows = torch.export.Dim("rows", min=1, max=128)
        compiled = blade.compile_model(model, (torch.randn(64, width),), dynamic_shapes=((rows, None),))
        with torch.no_grad():
            for m in range(33, 65):  # settles the 33-64 bucket (20 calls did, above)
                compiled(torch.randn(m, width))
            settled = [c for c in blade._C.gemm_choices() if "rows 33-64" in c["shape"] and "B constant" in c["shape"]
                       and f"@ [{width}, {width}]" in c["shape"]]
            assert len(settled) == 1, blade._C.gemm_choices()
            winner = settled[0]["kernel"]
            before = {k: _testing.gemm_kernel_calls(k) for k in ("panels", "mkl")}
            calls = 4  # fewer than the new bucket needs to settle (5 samples of each candidate)
            for m in range(65, 65 + calls):
                x = torch.randn(m, width)
                assert_close(compiled(x), model(x))
        ran = {k: _testing.gemm_kernel_calls(k) - before[k] for k in before}
        sampling = [c for c in blade._C.gemm_choices() if "rows 65-128" in c["shape"] and f"@ [{width}, {width}]" in c["shape"]]
        assert all(c["timings"] < 10 for c in sampling), sampling  # still sampling
        assert sum(ran.values()) == 2 * calls, ran
        assert ran[winner] >= calls, (winner, ran)  # the other weight's GEMM in every call, and some samples
    finally:
        torch.set_num_threads(threads)
