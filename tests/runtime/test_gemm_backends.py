"""The runtime's GEMM kernels (cpp/gemm_*.cpp), each pinned with _testing.set_gemm_backend (BLADE_GEMM's
values), against float64 numpy over the sgemm contract: transposed operands, padded leading
dimensions, batch strides (shared operands, the weight shared by row-stacked batches that folds into
one GEMM, attention's strided heads), alpha != 1, beta accumulation, K not a multiple of 16, long
K, one row; a pinned kernel must really run (its rounding differs); BLADE_GEMM is read from the
environment; "auto" records what it timed, one choice per bucket of shapes."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import blade._C
from blade._C import _testing
from runtime_testing import PANELS_USABLE, REPO, run_sgemm, torch_threads

# torch's fp32 oneDNN matmul wants AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere the oneDNN
# modes fall back to MKL, which the tests above still check, but nothing tells the kernels apart.
needs_onednn = pytest.mark.skipif(not _testing.gemm_onednn_usable(), reason="libtorch's oneDNN matmul refuses this CPU")
# what "auto" samples for a constant B with oneDNN usable: MKL, oneDNN's two, and the panels kernel
CANDIDATES = 3 + PANELS_USABLE
# the fewest samples that settle a bucket: 5 of the winner's, 2 of each candidate over 1.5x its best
# (cpp/gemm_choice.cpp kRejectSamples), 5 of each that stays close
FEWEST_TIMINGS = 5 + 2 * (CANDIDATES - 1)


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("alpha, beta", [(1.0, 0.0), (1.0, 1.0), (-2.5, 0.5)])
@pytest.mark.parametrize("pack", [False, True])
def test_single_gemm(gemm_backend, trans_a, trans_b, alpha, beta, pack):
    run_sgemm(1, 19, 23, 37, alpha, beta, trans_a, trans_b, pack=pack)


@pytest.mark.parametrize("m, n, k", [(1, 256, 256), (1, 5, 3), (7, 1, 33), (64, 48, 1024), (33, 40, 4096)])
@pytest.mark.parametrize("pack", [False, True])
def test_sizes(gemm_backend, m, n, k, pack):
    """One row (a decode step), one column, and long K: oneDNN and MKL accumulate in their own order."""
    run_sgemm(1, m, n, k, 1.0, 0.0, False, True, pack=pack, pad=0)
    run_sgemm(1, m, n, k, 0.5, 1.0, False, False, pack=pack, pad=2, seed=1)


@pytest.mark.parametrize("shared_a, shared_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("pack", [False, True])
def test_batches(gemm_backend, shared_a, shared_b, trans_a, trans_b, pack):
    """Batch strides; a shared B with untransposed A folds into one GEMM of batch * m rows (pad=0:
    the batches' rows follow on), and with padded rows (pad=3) it stays a batch."""
    for pad in (0, 3):
        run_sgemm(3, 6, 21, 17, 1.5, 0.0, trans_a, trans_b, shared_a=shared_a, shared_b=shared_b, pad=pad, pack=pack)
        run_sgemm(3, 6, 21, 17, -1.0, 1.0, trans_a, trans_b, shared_a=shared_a, shared_b=shared_b, pad=pad,
                  pack=pack, seed=1)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("m", [1, 7, 197])
def test_batch_the_threads_do_not_divide(gemm_backend, trans_a, m):
    """3 heads on 2 threads: MKL's batch path splits each GEMM in row blocks (uneven for odd m)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_sgemm(3, m, 13, 19, 1.0, 0.0, trans_a, True, pad=2)
        run_sgemm(3, m, 13, 19, -0.5, 1.0, trans_a, False, shared_b=True, pad=3, seed=1)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("alpha", [1.0, 0.125])
def test_attention_heads(gemm_backend, alpha):
    """Q @ K^T and P @ V as codegen passes them for [batch, heads, seq, 64] attention: the heads of
    one batch entry as a GEMM batch, Q/K/V read in place from the fused QKV projection's output
    (row stride 3 * hidden, head stride 64), scores dense, the context written head-interleaved."""
    torch.manual_seed(0)
    heads, seq, dim = 4, 24, 64
    hidden = heads * dim
    qkv = torch.randn(seq, 3 * hidden)
    scores = torch.full((heads, seq, seq), float("nan"))
    flat = qkv.flatten()  # _testing.sgemm takes contiguous tensors: K and V start further in
    _testing.sgemm(heads, seq, seq, dim, alpha, flat, 3 * hidden, dim, False, flat[hidden:], 3 * hidden, dim, True,
                   0.0, scores, seq, seq * seq)
    q, k, v = (qkv[:, i * hidden:(i + 1) * hidden].reshape(seq, heads, dim).transpose(0, 1).double() for i in range(3))
    torch.testing.assert_close(scores.double(), alpha * q @ k.transpose(1, 2), rtol=1e-4, atol=1e-4)
    probs = torch.softmax(scores, -1).contiguous()
    context = torch.full((seq, hidden), float("nan"))
    _testing.sgemm(heads, seq, dim, seq, 1.0, probs, seq, seq * seq, False, flat[2 * hidden:], 3 * hidden, dim, False,
                   0.0, context, hidden, dim)
    want = (probs.double() @ v).transpose(0, 1).reshape(seq, hidden)
    torch.testing.assert_close(context.double(), want, rtol=1e-4, atol=1e-4)


def gemm_with(backend_name, m=64, n=96, k=1024, pack=False):
    """C = A @ B^T on fixed operands with the kernels of backend_name (None: as currently set)."""
    generator = torch.Generator().manual_seed(3)
    a, b = torch.randn(m, k, generator=generator), torch.randn(n, k, generator=generator)
    c = torch.full((m, n), float("nan"))
    if backend_name is not None:
        _testing.set_gemm_backend(backend_name)
    try:
        # parallel mode: a serial window opened by load (an earlier test's stall) would run the GEMM
        # on one thread, whose blocking rounds differently from the 2-thread call it is compared with
        _testing.force_serial_for(0)
        _testing.sgemm(1, m, n, k, 1.0, a, k, 0, False, b, k, 0, True, 0.0, c, n, 0, pack=pack)
    finally:
        if backend_name is not None:
            _testing.set_gemm_backend("")
    torch.testing.assert_close(c.double(), a.double() @ b.double().T, rtol=1e-4, atol=1e-4)
    return c


@needs_onednn
def test_pinned_kernels_really_run():
    """Over K = 1024 each library rounds its own way: the pinned kernels must not all agree bitwise,
    or the pin did not reach the GEMM."""
    mkl = gemm_with("mkl")
    matmul, packed = gemm_with("onednn-matmul"), gemm_with("onednn-packed", pack=True)
    assert not torch.equal(mkl, matmul)
    assert not torch.equal(mkl, packed)


class FixedGemm:
    """C = A @ B^T with one B (a constant weight, as an engine's) and A of m rows, on every call."""

    def __init__(self, n=136, k=200, rows=128):
        generator = torch.Generator().manual_seed(3)
        self.a, self.b = torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator)

    def __call__(self, m):
        n, k = self.b.shape
        c = torch.full((m, n), float("nan"))
        _testing.sgemm(1, m, n, k, 1.0, self.a[:m].contiguous(), k, 0, False, self.b, k, 0, True, 0.0, c, n, 0, pack=True)
        torch.testing.assert_close(c.double(), self.a[:m].double() @ self.b.double().T, rtol=1e-4, atol=1e-4)


def choices_serving(text):
    return [c for c in blade._C.gemm_choices() if text in c["shape"]]


@pytest.fixture
def one_thread():
    """The choice tests count a bucket's entries, and the thread count is part of a bucket's key: on
    a loaded machine a stall puts the calls in serial mode (1 thread) part of the way through, and
    the 2-thread calls before it had made an entry of their own (seen where oneDNN runs, so these
    tests do: 2 entries for one bucket). At 1 thread serial mode changes nothing in the key."""
    with torch_threads(1):
        yield


@pytest.mark.usefixtures("one_thread")
@needs_onednn
def test_auto_records_what_it_timed():
    """Until a shape's bucket is settled each call runs one candidate (the least sampled) and times
    it; a kernel's first call at a shape (packing, JIT-compiling) is no sample. Every call's result
    is the GEMM's, whichever kernel ran it."""
    gemm = FixedGemm()
    _testing.set_gemm_backend("auto")
    try:
        for _ in range(CANDIDATES):  # each candidate's first call
            gemm(40)
        assert choices_serving("[40, 200] @ [200, 136]^T") == []
        for _ in range(CANDIDATES * 5):  # five samples each settle it (unless stalled)
            gemm(40)
        choices = choices_serving("[40, 200] @ [200, 136]^T")
    finally:
        _testing.set_gemm_backend("")
    assert len(choices) == 1, blade._C.gemm_choices()
    timed = dict(choices[0]["microseconds"])
    assert choices[0]["kernel"] in timed and "B constant" in choices[0]["shape"]
    assert {"mkl", "onednn-packed"} <= set(timed) and all(us > 0 for us in timed.values())
    # 5 samples each settle it (2 of a candidate far behind); a best call that looks like a stall (a
    # loaded machine) samples up to 12 each
    assert timed[choices[0]["kernel"]] == min(timed.values())
    assert FEWEST_TIMINGS <= choices[0]["timings"] <= 12 * CANDIDATES


@pytest.mark.usefixtures("one_thread")
@needs_onednn
def test_auto_choice_serves_a_bucket_of_row_counts():
    """A choice serves every row count up to the next power of two (an engine with run-time sizes
    meets a new one on almost every call): the other row counts of the bucket share its samples and
    add no entry; the next power of two is a bucket of its own."""
    gemm = FixedGemm()
    _testing.set_gemm_backend("auto")
    try:
        for m in (40, 50, 33, 64, 61):
            for _ in range(3 * CANDIDATES):  # each candidate's first call at each shape is no sample
                gemm(m)
        bucket = choices_serving("rows 33-64, columns 129-256, depth 129-256")
        for _ in range(CANDIDATES + 1):
            gemm(65)
        next_bucket = choices_serving("rows 65-128")
        choices = blade._C.gemm_choices()
    finally:
        _testing.set_gemm_backend("")
    assert len(choices) == 2, choices
    assert len(bucket) == 1 and FEWEST_TIMINGS <= bucket[0]["timings"] <= 10 * CANDIDATES, choices
    assert len(next_bucket) == 1 and next_bucket[0]["timings"] == 1, choices  # first calls, then one sample


def weights_of_one_bucket(count):
    """`count` FixedGemms of one shape, each with a weight of its own (an engine's layers)."""
    gemms = [FixedGemm() for _ in range(count)]
    for i, gemm in enumerate(gemms):
        gemm.b = gemm.b.roll(i, 0).contiguous()
    return gemms


@pytest.mark.usefixtures("one_thread")
@needs_onednn
def test_auto_samples_each_candidate_on_a_weight_of_its_own():
    """With a constant B each candidate samples on one weight (else each candidate would pack every
    weight of the bucket): the first weight takes them all, the next weights one each, so one round
    of the bucket's weights (one engine call) samples every candidate and the bucket settles in a
    few rounds, where one weight sampling them in turn took a round per sample (GPT-2 small ran 23
    of its 24 weights pack-free, 2x slower, for 24 calls). Weights past the candidates sample
    nothing and run unpacked kernels meanwhile, exactly."""
    gemms = weights_of_one_bucket(CANDIDATES + 2)
    _testing.set_gemm_backend("auto")
    try:
        rounds = 0
        while not any(c["settled"] for c in choices_serving("rows 33-64")) and rounds < 13:
            for gemm in gemms:
                gemm(40)
            rounds += 1
        choices = choices_serving("rows 33-64")
    finally:
        _testing.set_gemm_backend("")
    # a round of first calls (packing or compiling), then kSamples rounds (up to kMaxSamples
    # where the winner's best call looks like a stall)
    assert len(choices) == 1 and choices[0]["settled"], choices
    assert 1 + 5 <= rounds <= 1 + 12, (rounds, choices)
    assert FEWEST_TIMINGS <= choices[0]["timings"] <= 12 * CANDIDATES, choices


@pytest.mark.usefixtures("one_thread")
@needs_onednn
def test_weights_that_do_not_sample_run_the_leaders_library_unpacked():
    """While a bucket samples, a weight that samples no candidate runs a kernel that packs and
    compiles nothing: oneDNN's matmul where a oneDNN kernel leads the samples so far, else MKL
    (GPT-2's [128, 768] @ [768, 3072] pack-free: MKL 1.5 ms, oneDNN's matmul 3.1 on an Intel Xeon)."""
    gemms = weights_of_one_bucket(CANDIDATES + 1)
    _testing.set_gemm_backend("auto")
    try:
        for _ in range(3):  # rounds as engine calls make them: first calls, then samples
            for gemm in gemms:
                gemm(40)
        for gemm in gemms[:CANDIDATES]:
            gemm(40)
        (choice,) = choices_serving("rows 33-64")
        before = kernel_calls()
        gemms[-1](40)
        ran = ran_since(before)
    finally:
        _testing.set_gemm_backend("")
    if choice["settled"]:
        pytest.skip(f"settled already (candidates rejected): {choice}")
    leader = min(choice["microseconds"], key=lambda entry: entry[1])[0]
    assert ran == {"onednn-matmul" if leader.startswith("onednn") else "mkl": 1}, (choice, ran)


@pytest.mark.usefixtures("one_thread")
@needs_onednn
def test_auto_samples_every_candidate_on_a_bucket_of_one_weight():
    """A bucket of one weight (one Linear of its shape) samples every candidate on it, in turn."""
    gemm = FixedGemm()
    _testing.set_gemm_backend("auto")
    try:
        for _ in range(6 * CANDIDATES):
            gemm(40)
        choices = choices_serving("rows 33-64")
    finally:
        _testing.set_gemm_backend("")
    assert len(choices) == 1 and choices[0]["settled"], choices
    assert FEWEST_TIMINGS <= choices[0]["timings"] <= 5 * CANDIDATES, choices


@pytest.mark.usefixtures("one_thread")
@needs_onednn
@pytest.mark.parametrize("calls", [64 + 8 * CANDIDATES, 1 + 8 * CANDIDATES], ids=["past the idle rule", "cycling"])
def test_a_bucket_settles_when_its_sampling_weight_stops_running(calls):
    """The weight that samples may never run again (its module freed, dynamo recompiled the graph
    into a new module with its own weights, or a conv's transformed weight packed per _testing.conv
    call moved to a new address): another weight takes over its sampling, after 64 engine calls
    without it or as soon as it runs twice since the sampler last ran, and the bucket settles.
    Before, it never did, and every weight ran the unmeasured pack-free kernel for good (a 2.5x
    slower MLP in bench/run.py; a 64-channel 56x56 Winograd conv at 2x its time in 1 process of 3)."""
    gone, kept = FixedGemm(), FixedGemm()
    kept.b = kept.b.flip(0).contiguous()
    _testing.set_gemm_backend("auto")
    try:
        gone(40)  # samples first: the bucket's sampling weight
        for _ in range(calls):
            kept(40)
        choices = choices_serving("rows 33-64")
    finally:
        _testing.set_gemm_backend("")
    assert len(choices) == 1 and choices[0]["timings"] >= FEWEST_TIMINGS, choices


@pytest.mark.usefixtures("one_thread")
@needs_onednn
def test_a_bucket_keeps_its_sampling_weights_while_they_run_between_the_others():
    """Weights that each run once between a sampling weight's calls (a Winograd conv's 16 GEMMs)
    leave each candidate's sampling where it is: the samples are the sampling weights' calls but
    each candidate's first, none of the other weights' (which would repack as they took over)."""
    gemms = weights_of_one_bucket(3 * CANDIDATES)
    _testing.set_gemm_backend("auto")
    try:
        for gemm in gemms:  # the first CANDIDATES weights take a candidate each; their first calls
            gemm(40)
        gemms[0](40)  # the first weight's candidate: its first sample
        choices = choices_serving("rows 33-64")
    finally:
        _testing.set_gemm_backend("")
    assert len(choices) == 1 and choices[0]["timings"] == 1 and not choices[0]["settled"], choices


KERNELS = ("mkl", "onednn-matmul", "onednn-packed", "panels")
JIT_KERNELS = ("onednn-matmul", "onednn-packed")  # a primitive compiled per exact shape


def kernel_calls():
    return {k: _testing.gemm_kernel_calls(k) for k in KERNELS}


def ran_since(before):
    return {k: n - before[k] for k, n in kernel_calls().items() if n != before[k]}


class HeadsGemm:
    """Attention's scores: a batch of GEMMs on operands computed per call (no constant B)."""

    def __init__(self, k=128, n=64):
        generator = torch.Generator().manual_seed(5)
        self.a, self.b = torch.randn(4, 128, k, generator=generator), torch.randn(4, k, n, generator=generator)

    def __call__(self, m):
        _, k, n = self.b.shape
        a, c = self.a[:, :m].contiguous(), torch.full((4, m, n), float("nan"))
        _testing.sgemm(4, m, n, k, 1.0, a, k, m * k, False, self.b, n, k * n, False, 0.0, c, n, m * n, pack=False)
        torch.testing.assert_close(c.double(), a.double() @ self.b.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("one_thread")
@needs_onednn
@pytest.mark.parametrize("gemm", [FixedGemm, HeadsGemm])
def test_a_call_at_a_new_shape_runs_one_kernel_that_compiles_nothing(gemm):
    """oneDNN compiles a primitive per exact shape (the stall of an engine's first call at a new
    sequence length): a call meeting a shape for the first time runs one kernel without JIT, in a
    new bucket and in a settled one alike; the oneDNN kernels are sampled and run from the second
    call at a shape."""
    gemm = gemm()
    _testing.set_gemm_backend("auto")
    try:
        for m in (40, 100):  # a new bucket, its first call at each of two shapes
            before = kernel_calls()
            gemm(m)
            ran = ran_since(before)
            assert sum(ran.values()) == 1 and not set(ran) & set(JIT_KERNELS), ran
        before = kernel_calls()
        for _ in range(14 * CANDIDATES):  # repeats: every candidate samples, the bucket settles
            gemm(40)
        assert set(JIT_KERNELS) & set(ran_since(before)), ran_since(before)
        assert choices_serving("rows 33-64"), blade._C.gemm_choices()
        for m in (33, 47, 58):  # new shapes of the settled bucket
            before = kernel_calls()
            gemm(m)
            ran = ran_since(before)
            assert sum(ran.values()) == 1 and not set(ran) & set(JIT_KERNELS), ran
    finally:
        _testing.set_gemm_backend("")


@pytest.mark.usefixtures("one_thread")
def test_auto_takes_mkl_for_tiny_gemms_untimed():
    """Under 2 MFLOP oneDNN's per-call overhead cannot win: MKL, no timing, the same bits as MKL's."""
    _testing.set_gemm_backend("auto")
    try:
        auto = gemm_with(None, m=8, n=32, k=1024)
        assert blade._C.gemm_choices() == []
    finally:
        _testing.set_gemm_backend("")
    assert torch.equal(auto, gemm_with("mkl", m=8, n=32, k=1024))


def test_unknown_backend_is_refused():
    with pytest.raises(RuntimeError, match="BLADE_GEMM=blas: expected one of auto, mkl, onednn"):
        _testing.set_gemm_backend("blas")


SUBPROCESS_GEMM = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_gemm_backends import gemm_with
torch.set_num_threads(2)
print(json.dumps(gemm_with("").flatten().tolist()))
"""


@needs_onednn
@pytest.mark.parametrize("env_value", ["mkl", "onednn-matmul"])
def test_blade_gemm_environment_variable(env_value):
    """BLADE_GEMM pins the kernel of a fresh process: its result is bitwise the one pinned here."""
    env = {**os.environ, "BLADE_GEMM": env_value, "PYTHONPATH": str(REPO)}
    script = SUBPROCESS_GEMM.format(tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        here = gemm_with(env_value)
    finally:
        torch.set_num_threads(before)
    assert np.array_equal(np.array(json.loads(out), dtype=np.float32), here.flatten().numpy())
