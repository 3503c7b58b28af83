"""The runtime's own GEMM on B in 32-column panels (cpp/gemm_panels.cpp): a constant B packed once, a
computed one (any batch) read in place or packed per call; without AVX-512, an AVX2 kernel (blocks
of 6 rows x 16 columns, 16-column panels) does both. Against
float64 numpy over the sgemm contract where it applies: row counts around its register blocks of 8
(and their remainders) and its row chunks, column counts around the panel width (the last panel's
padding is computed and must not be stored), K down to 1, transposed and padded operands, alpha
folded into the pack, beta accumulation, NaN and infinities, two threads; a pinned run must differ
bitwise from MKL's (it really ran), and "auto" times it against the libraries."""
import numpy as np
import pytest
import torch

import blade._C
from blade._C import _testing
from runtime_testing import PANELS_USABLE, run_sgemm, torch_threads


needs_avx2 = pytest.mark.skipif(not PANELS_USABLE, reason="the panels kernel needs AVX2 and FMA (MKL runs instead)")


def _panels_calls():
    return _testing.gemm_kernel_calls("panels")


@pytest.fixture
def panels():
    _testing.set_gemm_backend("panels")
    yield
    _testing.set_gemm_backend("")


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 8, 9, 13, 17, 32, 129])
@pytest.mark.parametrize("n", [1, 8, 15, 16, 17, 24, 32, 33, 100])
def test_rows_and_columns(panels, m, n):
    """Around both register blocks (8 rows x 32 columns with AVX-512, 6 x 16 with AVX2) and their
    remainders; the kernel really runs where the CPU has it."""
    before = _panels_calls()
    run_sgemm(1, m, n, 37, 1.0, 0.0, False, True, pack=True, pad=0)
    run_sgemm(1, m, n, 37, -1.5, 0.5, True, False, pack=True, pad=3, seed=1)
    assert _panels_calls() == before + 2 * PANELS_USABLE


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("alpha, beta", [(1.0, 0.0), (1.0, 1.0), (0.25, -2.0)])
@pytest.mark.parametrize("k", [1, 3, 256, 1024])
def test_transposes_and_scales(panels, trans_a, trans_b, alpha, beta, k):
    run_sgemm(1, 8, 40, k, alpha, beta, trans_a, trans_b, pack=True)


@needs_avx2
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("m, n", [(1, 1), (7, 15), (9, 33), (128, 64), (61, 100)])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False), (True, True)])
def test_computed_b_per_call(panels, batch, m, n, trans_a, trans_b):
    """B not an engine constant (attention's K^T and V, a batch of heads): read in place
    (untransposed; the last panel's loads masked to B's columns) or packed per call (transposed),
    with padded rows, alpha not folded into any pack, beta, and the kernel really running."""
    before = _panels_calls()
    run_sgemm(batch, m, n, 37, 1.0, 0.0, trans_a, trans_b, pack=False, pad=0)
    run_sgemm(batch, m, n, 64, 0.125, 0.0, trans_a, trans_b, pack=False, pad=3, seed=1)
    run_sgemm(batch, m, n, 5, -1.5, 0.5, trans_a, trans_b, pack=False, pad=2, seed=2)
    assert _panels_calls() == before + 3


@needs_avx2
@pytest.mark.parametrize("k", [1, 7, 8, 9, 15, 16, 17, 33, 64, 65])
@pytest.mark.parametrize("n", [1, 8, 9, 15, 16, 17, 31, 32, 47, 70])
def test_computed_transposed_b_packing(panels, k, n):
    """A computed B^T (attention's K) is packed per panel in blocks transposed in registers (16 x 16
    with AVX-512, 8 x 8 with AVX2): depths and panel widths around the blocks (partial blocks masked;
    B's NaN row padding and the memory past its last row must never reach C), batches apart by a
    stride, alpha applied."""
    before = _panels_calls()
    run_sgemm(2, 9, n, k, 0.5, 0.0, False, True, pack=False, pad=1, seed=k + n)
    run_sgemm(1, 3, n, k, 1.0, 1.0, True, True, pack=False, pad=0, seed=k * n)
    assert _panels_calls() == before + 2


@needs_avx2
@pytest.mark.parametrize("k, n", [(2048, 70), (4100, 40)])
def test_computed_b_in_groups_of_panels(panels, k, n):
    """A computed B too deep for all its panels to be packed at once (AVX2: 256 KB of panels a
    task) runs in groups of panels, the last group short: every column of C is written once."""
    before = _panels_calls()
    run_sgemm(2, 13, n, k, 0.5, 0.0, False, True, pack=False, pad=1, seed=4)
    run_sgemm(2, 13, n, k, 1.0, 1.0, False, False, pack=False, pad=0, seed=5)
    assert _panels_calls() == before + 2


@needs_avx2
def test_computed_b_shared_operands(panels):
    """A batch sharing a computed A or B (B shared without folding: A transposed) runs per call; a
    constant B shared by a batch that does not fold is MKL's (the packed path is for one GEMM)."""
    before = _panels_calls()
    run_sgemm(3, 8, 40, 64, 1.0, 0.0, False, True, shared_a=True, pad=1)
    run_sgemm(3, 8, 40, 64, 0.5, 0.0, True, False, shared_b=True, pad=0, seed=3)
    assert _panels_calls() == before + 2
    run_sgemm(3, 8, 40, 64, 1.0, 1.0, True, True, pack=True, shared_b=True, pad=2)  # A transposed: no fold
    assert _panels_calls() == before + 2


def _nonfinite_gemm(m, n, k, trans_b=False, pack=True):
    """A with a NaN, +inf and -inf in separate rows, B with an inf column: C as IEEE sums give it.
    B stored transposed when trans_b; an engine constant (packed once) when pack, else computed."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    a[1, 3], a[2, 0], a[3, k - 1] = np.nan, np.inf, -np.inf
    b[2, n - 1] = np.inf
    stored = np.ascontiguousarray(b.T) if trans_b else b
    c = torch.full((m, n), float("nan"))
    _testing.sgemm(1, m, n, k, 1.0, torch.from_numpy(a), k, 0, False, torch.from_numpy(stored), k if trans_b else n,
                   0, trans_b, 0.0, c, n, 0, pack=pack)
    with np.errstate(invalid="ignore", over="ignore"):
        want = a.astype(np.float64) @ b.astype(np.float64)
    return c.double().numpy(), want


@pytest.mark.parametrize("trans_b, pack", [pytest.param(False, True, marks=needs_avx2),
                                           pytest.param(False, False, marks=needs_avx2),
                                           pytest.param(True, False, marks=needs_avx2)])
def test_nan_and_infinities(panels, trans_b, pack):
    """A constant B, and a computed one read in place or packed per call."""
    got, want = _nonfinite_gemm(9, 35, 20, trans_b, pack)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got) & (got > 0), np.isinf(want) & (want > 0))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-4)


def _gemm(backend, m=8, n=96, k=1024):
    generator = torch.Generator().manual_seed(3)
    a, b = torch.randn(m, k, generator=generator), torch.randn(n, k, generator=generator)
    c = torch.full((m, n), float("nan"))
    _testing.set_gemm_backend(backend)
    try:
        _testing.sgemm(1, m, n, k, 1.0, a, k, 0, False, b, k, 0, True, 0.0, c, n, 0, pack=True)
        return c, blade._C.gemm_choices()
    finally:
        _testing.set_gemm_backend("")


@needs_avx2
def test_pinned_kernel_really_runs():
    """Over K = 1024 the kernel's sum order (one FMA chain per output) rounds unlike MKL's."""
    few, _ = _gemm("panels")
    mkl, _ = _gemm("mkl")
    torch.testing.assert_close(few, mkl, rtol=1e-4, atol=1e-4)
    assert not torch.equal(few, mkl)


@needs_avx2
def test_auto_times_it():
    """8 rows x a constant [1024, 128]: above auto's 2 MFLOP, so the bucket's calls sample every
    kernel, this one too (each kernel's first call at the shape is no sample). On one thread: the
    thread count is part of a bucket's key, and a serial window opened by load mid-test (GEMMs then
    run on one thread) split 2-thread calls between two buckets, neither of which got a sample (a
    loaded CI run found no choice at all)."""
    m, n, k = 8, 128, 1024
    a, b, c = torch.randn(m, k), torch.randn(n, k), torch.empty(m, n)
    _testing.set_gemm_backend("auto")
    try:
        with torch_threads(1):
            for _ in range(2 * 4):  # one weight's calls sample (four candidates, a first call each)
                _testing.sgemm(1, m, n, k, 1.0, a, k, 0, False, b, k, 0, True, 0.0, c, n, 0, pack=True)
        choices = blade._C.gemm_choices()
    finally:
        _testing.set_gemm_backend("")
    (choice,) = [c for c in choices if c["shape"].startswith("[8, 1024] @ [1024, 128]^T")]
    assert "panels" in dict(choice["microseconds"])


@needs_avx2
@pytest.mark.parametrize("m, n", [(8, 2048), (197, 40), (61, 33)])
def test_threads_split_the_tasks(m, n):
    """Two threads: many panels (whole panels per task), or two panels or fewer (row chunks too,
    the last one short): the same result, for a constant B and a computed batch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _testing.set_gemm_backend("panels")
        run_sgemm(1, m, n, 1024, 1.0, 0.0, False, True, pack=True, pad=1)
        run_sgemm(1, m, n, 64, 0.5, 1.0, True, False, pack=True, pad=2, seed=1)
        run_sgemm(3, m, n, 64, 1.0, 0.0, False, True, pad=1, seed=2)
        run_sgemm(3, m, n, 64, 0.5, 1.0, False, False, pad=0, seed=3)
    finally:
        _testing.set_gemm_backend("")
        torch.set_num_threads(threads)


@needs_avx2
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m, n, k", [(300, 70, 600), (1030, 33, 1024), (7, 17, 257), (128, 200, 256)])
@pytest.mark.parametrize("alpha, beta", [(1.0, 0.0), (0.5, 1.0), (1.0, -2.0)])
def test_constant_b_many_rows_and_deep(panels, threads, m, n, k, alpha, beta):
    """A constant B at many rows (row chunks on two threads when panels are few, the last one short)
    and deep K (a panel larger than L1), on one and two threads, beta applied once (0: C's NaN
    never enters)."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run_sgemm(1, m, n, k, alpha, beta, False, True, pack=True, pad=1, seed=m + k)
        run_sgemm(1, m, n, k, alpha, beta, True, False, pack=True, pad=0, seed=n)
    finally:
        torch.set_num_threads(threads_before)


@needs_avx2
@pytest.mark.parametrize("m, n, k", [(1030, 580, 192), (700, 1000, 256), (13, 2049, 64)])
def test_constant_b_in_groups_of_panels(panels, m, n, k):
    """A constant B of many panels runs each row block across a group of them (AVX2: 37 panels of
    K = 192 in groups of 10, 10, 10 and 7), over row chunks: right on one and two threads, and
    bitwise the same on both (every output is still one FMA chain over the whole of K)."""
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(run_sgemm(1, m, n, k, 1.0, 0.0, False, True, pack=True, pad=1, seed=m))
        np.testing.assert_array_equal(results[0], results[1])
    finally:
        torch.set_num_threads(threads)


@needs_avx2
@pytest.mark.parametrize("batch, pack", [(1, True), (3, False)])
def test_results_do_not_depend_on_which_thread_runs_a_task(batch, pack):
    """Threads claim tasks as they go (cpp/timed_parallel.h), so which thread runs which rows changes
    from call to call: every task computes its outputs whole (the same k-order), so two threads give
    bitwise what one gives, call after call."""
    m, n, k = 197, 300, 1000
    torch.manual_seed(0)
    a = torch.randn(batch, m, k)
    b = torch.randn(1 if pack else batch, k, n)

    def run():
        c = torch.full((batch, m, n), float("nan"))
        _testing.sgemm(batch, m, n, k, 1.0, a, k, m * k, False, b, n, 0 if pack else k * n, False, 0.0,
                       c, n, m * n, pack=pack)
        return c

    threads = torch.get_num_threads()
    _testing.set_gemm_backend("panels")
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        _testing.force_serial_for(0)
        for _ in range(5):
            assert torch.equal(run(), one)
    finally:
        _testing.set_gemm_backend("")
        torch.set_num_threads(threads)
