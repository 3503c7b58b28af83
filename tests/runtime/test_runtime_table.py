"""The BladeRuntime table engines call back into: sgemm against numpy over its whole contract, and
parallel_for's chunking on ATen's pool."""
import contextlib
import itertools

import pytest
import torch

from blade._C import _testing
from runtime_testing import run_sgemm, torch_threads

# _testing.conv's activation kinds (blade_abi.h BLADE_ACTIVATION_*: none, ReLU, a clamp, SiLU, the
# exact GELU), the clamp's bounds the ones the tests pass (-0.5, 0.75).
ACTIVATIONS = {0: lambda t: t, 1: lambda t: t.clamp(min=0), 2: lambda t: t.clamp(-0.5, 0.75),
               3: torch.nn.functional.silu, 4: torch.nn.functional.gelu}


@pytest.mark.parametrize("trans_a, trans_b", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("alpha, beta", [(1.0, 0.0), (1.0, 1.0), (-2.5, 0.5)])
def test_sgemm_matches_numpy(trans_a, trans_b, batch, alpha, beta):
    run_sgemm(batch, 5, 7, 6, alpha, beta, trans_a, trans_b)


@pytest.mark.parametrize("shared_a, shared_b", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, True)])
def test_sgemm_batch_stride_zero(shared_a, shared_b, trans_a, trans_b):
    run_sgemm(4, 6, 5, 8, 1.5, 1.0, trans_a, trans_b, shared_a=shared_a, shared_b=shared_b)


@pytest.mark.parametrize("batch, m, n, k", [(1, 1, 1, 1), (1, 64, 48, 96), (12, 32, 32, 64), (2, 3, 4, 0)])
def test_sgemm_sizes(batch, m, n, k):
    run_sgemm(batch, m, n, k, 1.0, 0.0, False, True, pad=0)
    run_sgemm(batch, m, n, k, 0.5, 1.0, True, False, pad=1)


@pytest.fixture
def two_threads_mkl():
    """GEMMs with few rows are split into column blocks only when the pool has threads to run them,
    and only by the MKL kernel (pinned: left to choose, the runtime may time oneDNN faster)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    _testing.set_gemm_backend("mkl")
    yield
    torch.set_num_threads(before)
    _testing.set_gemm_column_split_rows(-1)
    _testing.set_gemm_backend("")


# Rows at and past the column-split limit (32), widths that divide into cache lines and ones that
# do not, a packed constant weight and a plain one, and B stored both ways (a Linear's weight is
# stored transposed): every block must land in its own columns of C, padding untouched.
@pytest.mark.parametrize("m, n", [(1, 256), (8, 1000), (32, 300), (33, 512)])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("split", [True, False])
def test_sgemm_few_rows_in_column_blocks(two_threads_mkl, m, n, trans_b, pack, split):
    _testing.set_gemm_column_split_rows(-1 if split else 0)
    run_sgemm(1, m, n, 24, 1.0, 0.0, False, trans_b, pack=pack)
    run_sgemm(1, m, n, 24, -2.5, 0.5, False, trans_b, pack=pack, seed=1)


def test_parallel_for_covers_range_in_grain_sized_chunks():
    for begin, end, grain in [(0, 1000, 7), (5, 105, 10), (0, 3, 1)]:
        chunks = _testing.parallel_for_chunks(begin, end, grain)
        assert chunks[0][0] == begin and chunks[-1][1] == end
        assert all(prev[1] == nxt[0] for prev, nxt in zip(chunks, chunks[1:])), chunks
        assert all(e - b >= grain for b, e in chunks[:-1]), chunks


def test_parallel_for_runs_short_loops_inline_and_empty_loops_not_at_all():
    assert _testing.parallel_for_chunks(0, 5, 10) == [(0, 5)]
    assert _testing.parallel_for_chunks(4, 4, 1) == []


def test_parallel_for_follows_torch_set_num_threads():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _testing.parallel_for_chunks(0, 100, 10) == [(0, 100)]
        torch.set_num_threads(2)
        _testing.force_serial_for(0)  # a stall seen on a loaded machine would make it serial
        assert len(_testing.parallel_for_chunks(0, 100, 10)) > 1
    finally:
        torch.set_num_threads(before)


def test_a_slow_thread_leaves_its_share_of_a_parallel_for_to_the_others():
    """Threads claim chunks as they go (cpp/timed_parallel.h): when one thread stops for a while (its
    core held by another process), the calling thread does the rest instead of waiting for it at the
    end of the region. ATen's fixed split gave each thread one half whatever happened."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _testing.force_serial_for(0)
        chunks = _testing.parallel_for_threads(0, 1000, 10, slow_ms=50)
        assert [b for b, _, _ in chunks[1:]] == [e for _, e, _ in chunks[:-1]], chunks  # the range, once
        assert chunks[0][0] == 0 and chunks[-1][1] == 1000
        assert all(e - b >= 10 for b, e, _ in chunks[:-1]), chunks
        by_caller = sum(e - b for b, e, thread in chunks if thread == 0)
        assert by_caller > 1000 * 3 // 4, chunks
    finally:
        torch.set_num_threads(before)


# conv: every layout combination (NCHW / channels-last input and output), with and without the
# weight counting as an engine constant (the oneDNN pre-packed path and its ATen fallback), plus
# asymmetric padding (explicitly padded first) and groups, against torch's conv2d.
@pytest.mark.parametrize("layout", [0, 1, 2, 3])
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("c_in, c_out, groups, pads, stride", [(3, 16, 1, [3, 3, 3, 3], 2), (16, 16, 1, [1, 1, 1, 1], 1),
                                                                (16, 8, 4, [0, 1, 1, 0], 1)])
def test_conv_layouts(layout, pack, c_in, c_out, groups, pads, stride):
    torch.manual_seed(0)
    x = torch.randn(2, c_in, 11, 9)
    k = 7 if c_in == 3 else 3
    w, b = torch.randn(c_out, c_in // groups, k, k), torch.randn(c_out)
    expected = torch.conv2d(torch.nn.functional.pad(x, [pads[1], pads[3], pads[0], pads[2]]), w, b, stride,
                            groups=groups)
    channels_last = lambda t, bit: t.contiguous(memory_format=torch.channels_last if layout & bit else torch.contiguous_format)
    out = channels_last(torch.full_like(expected, float("nan")), 2)
    _testing.conv(channels_last(x, 1), w, b, [stride] * 2, pads, [1, 1], groups, out, layout, pack)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", [0, 3])
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("with_sum, activation", [(True, 0), (False, 1), (True, 1), (True, 3)])
def test_conv_epilogue(layout, pack, with_sum, activation):
    """The fused epilogue: + sum (a residual, in the output's layout), then ReLU."""
    torch.manual_seed(1)
    x, w, b = torch.randn(1, 16, 9, 9), torch.randn(16, 16, 3, 3), torch.randn(16)
    memory_format = torch.channels_last if layout else torch.contiguous_format
    residual = torch.randn(1, 16, 9, 9).contiguous(memory_format=memory_format)
    expected = torch.conv2d(x, w, b, padding=1) + (residual if with_sum else 0)
    expected = ACTIVATIONS[activation](expected)
    out = torch.full_like(residual, float("nan"))
    _testing.conv(x.contiguous(memory_format=memory_format), w, b, [1, 1], [1, 1, 1, 1], [1, 1], 1, out, layout,
                  pack, residual if with_sum else None, activation)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def conv_with_and_without_winograd(x, weight, bias, pads, out_shape, pack, residual=None, activation=0, tile4=True):
    """The runtime's stride-1 channels-last conv, run once letting it take Winograd (in 4x4 output
    tiles where it picks them, unless not `tile4`) and once not."""
    outputs = []
    try:
        _testing.set_conv_kernel_enabled("winograd4", tile4)
        for winograd in (True, False):
            _testing.set_conv_kernel_enabled("winograd", winograd)
            out = torch.full(out_shape, float("nan")).contiguous(memory_format=torch.channels_last)
            _testing.conv(x.contiguous(memory_format=torch.channels_last), weight, bias, [1, 1], pads, [1, 1], 1, out,
                          3, pack, residual, activation)
            outputs.append(out)
    finally:
        _testing.set_conv_kernel_enabled("winograd", True)
        _testing.set_conv_kernel_enabled("winograd4", True)
    return outputs


def winograd4_taken(n, c_in, c_out, out_h, out_w):
    """Whether the runtime runs the shape as F(4x4, 3x3) (cpp/runtime.cpp, winograd_tile): 32 or more
    4x4 output tiles and at most 128 x 128 channels."""
    return n * -(-out_h // 4) * -(-out_w // 4) >= 32 and c_in * c_out <= 128 * 128


def assert_winograd_close(out, expected, tile4):
    """F(2x2, 3x3) within 1e-5 of float64 per element; F(4x4, 3x3) rounds ~15x more (its transforms'
    constants up to 8 and 1/24): within 2e-5 of the largest output (max errors seen 3-7e-6 of it)."""
    atol = 2e-5 * expected.abs().max().item() if tile4 else 1e-5
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=atol)


# Winograd F(2x2, 3x3): the runtime's conv takes it for 3x3 stride-1 ungrouped convolutions with a
# constant weight, channels-last in and out, >= 64 channels each way and >= 32 output tiles; F(4x4,
# 3x3) from 32 4x4 tiles up to 128 x 128 channels (winograd4_taken), here both ways where it does.
# Checked against a float64 convolution on edge cases of its tiling (odd and 1x1 images, asymmetric
# pads, batches) and its epilogue; it must also actually differ from oneDNN's direct convolution
# (in rounding only), or the dispatch never took it. Up to 64 x 64 channels (a 256 KiB transformed
# weight) it runs in blocks of tiles, above in three passes over all tiles (cpp/winograd.cpp, tile_blocks): both are here.
@pytest.mark.parametrize("n, c_in, c_out, h, w, pads", [(1, 64, 64, 12, 12, [1, 1, 1, 1]), (2, 64, 96, 9, 7, [1, 1, 1, 1]),
                                                         (1, 80, 64, 13, 11, [0, 1, 2, 0]), (32, 64, 64, 1, 1, [1, 1, 1, 1]),
                                                         (40, 128, 64, 3, 3, [0, 0, 0, 0]), (1, 96, 128, 11, 13, [1, 0, 0, 2]),
                                                         (2, 64, 64, 29, 31, [1, 1, 1, 1]),
                                                         (1, 128, 96, 30, 29, [1, 1, 1, 1])])
@pytest.mark.parametrize("with_bias, with_sum, activation", [(True, False, 0), (False, True, 1), (True, True, 1),
                                                             (True, True, 3)])
@pytest.mark.parametrize("tile4", [True, False], ids=["tile4", "tile2"])
def test_conv_winograd(n, c_in, c_out, h, w, pads, with_bias, with_sum, activation, tile4):
    torch.manual_seed(2)
    x, weight = torch.randn(n, c_in, h, w), torch.randn(c_out, c_in, 3, 3) / (9 * c_in) ** 0.5
    bias = torch.randn(c_out) if with_bias else None
    padded = torch.nn.functional.pad(x, [pads[1], pads[3], pads[0], pads[2]]).double()
    expected = torch.conv2d(padded, weight.double(), bias.double() if with_bias else None)
    residual = torch.randn(expected.shape).contiguous(memory_format=torch.channels_last) if with_sum else None
    expected = expected + residual.double() if with_sum else expected
    expected = ACTIVATIONS[activation](expected)
    taken4 = tile4 and winograd4_taken(n, c_in, c_out, *expected.shape[2:])
    if tile4 and not taken4:
        pytest.skip("F(2x2) only: the tile2 case covers it")
    calls4 = _testing.conv_kernel_calls("winograd4")
    with_winograd, without = conv_with_and_without_winograd(x, weight, bias, pads, expected.shape, True, residual,
                                                            activation, tile4)
    assert _testing.conv_kernel_calls("winograd4") == calls4 + int(taken4)
    assert_winograd_close(with_winograd, expected, taken4)
    torch.testing.assert_close(without.double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(with_winograd, without)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n, c_in, c_out, h, w", [(1, 256, 128, 14, 14), (3, 64, 80, 9, 11), (2, 64, 64, 29, 31),
                                                  (1, 96, 128, 28, 28)])
@pytest.mark.parametrize("tile4", [True, False], ids=["tile4", "tile2"])
def test_conv_winograd_threads(threads, n, c_in, c_out, h, w, tile4):
    """In three passes (256 -> 128, 64 -> 80): the 16 point GEMMs split across the threads (3
    threads: 6, 6 and 4 points) and transforms in equal shares of few tiles (49 for 14x14). In
    blocks of tiles (64 -> 64): 480 tiles at 29x31 in 8 blocks, 9 on 3 threads, their last tiles
    past the image's edge."""
    torch.manual_seed(4)
    x, weight, bias = torch.randn(n, c_in, h, w), torch.randn(c_out, c_in, 3, 3) / (9 * c_in) ** 0.5, torch.randn(c_out)
    expected = torch.conv2d(x.double(), weight.double(), bias.double(), padding=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        calls = _testing.conv_kernel_calls("winograd")
        calls4 = _testing.conv_kernel_calls("winograd4")
        with_winograd, _ = conv_with_and_without_winograd(x, weight, bias, [1, 1, 1, 1], expected.shape, True,
                                                          tile4=tile4)
        assert _testing.conv_kernel_calls("winograd") == calls + 1
        taken4 = tile4 and winograd4_taken(n, c_in, c_out, h, w)
        assert _testing.conv_kernel_calls("winograd4") == calls4 + int(taken4)
    finally:
        torch.set_num_threads(before)
    assert_winograd_close(with_winograd, expected, taken4)


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("where", [(0, 0), (13, 17), (27, 30)])
def test_conv_winograd4_declines_non_finite_input(bad, where):
    """An infinity or NaN anywhere in the input: F(4x4)'s transforms would spread it over its whole
    4x4 output tile, so the shape runs as F(2x2) for that call (bitwise F(2x2)'s result), whose
    outputs are non-finite where a float64 direct convolution's are."""
    torch.manual_seed(6)
    x, weight, bias = torch.randn(1, 64, 28, 31), torch.randn(64, 64, 3, 3) / 24, torch.randn(64)
    x[0, 5, where[0], where[1]] = bad
    expected = torch.conv2d(x.double(), weight.double(), bias.double(), padding=1)
    calls4, calls = _testing.conv_kernel_calls("winograd4"), _testing.conv_kernel_calls("winograd")
    with_tile4, _ = conv_with_and_without_winograd(x, weight, bias, [1, 1, 1, 1], expected.shape, True)
    assert _testing.conv_kernel_calls("winograd4") == calls4
    assert _testing.conv_kernel_calls("winograd") == calls + 1
    with_tile2, _ = conv_with_and_without_winograd(x, weight, bias, [1, 1, 1, 1], expected.shape, True, tile4=False)
    assert torch.equal(with_tile4.isfinite(), with_tile2.isfinite())
    torch.testing.assert_close(with_tile4, with_tile2, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(with_tile4.isfinite(), expected.isfinite())


@pytest.mark.parametrize("threads, n, c_in, h, w, pack", [(1, 1, 64, 7, 7, True), (2, 1, 64, 7, 5, True),
                                                            (2, 1, 16, 12, 12, True), (2, 1, 64, 12, 12, False)])
def test_conv_winograd_not_taken(threads, n, c_in, h, w, pack):
    """Few tiles (16 for 7x7 on one thread, 12 for 7x5 on two), few channels or a weight that is no
    engine constant: oneDNN's conv."""
    torch.manual_seed(3)
    x, weight = torch.randn(n, c_in, h, w), torch.randn(64, c_in, 3, 3)
    with torch_threads(threads):
        with_winograd, without = conv_with_and_without_winograd(x, weight, None, [1, 1, 1, 1], (n, 64, h, w), pack)
    assert torch.equal(with_winograd, without)


@pytest.mark.parametrize("threads", [2, 3])
def test_conv_winograd_few_tiles_threaded_is_timed(threads):
    """On more than one thread 16-31 tiles (ResNet-18's 512-channel 7x7 stage at batch 1) are where
    Winograd won on an AMD EPYC and lost 2x to oneDNN on an Intel Xeon: the first call at the shape
    times both ways (each's first call packs, then 3 timed calls each, into a scratch output) and
    the faster serves the shape from then on. The call's result is the winner's, bitwise the same
    on every later call; serially (oversubscribed) the one-thread rule holds (oneDNN's)."""
    torch.manual_seed(5)
    c_in = 64 + threads  # a shape of its own per parameter: the process decides each shape once
    x, weight, bias = torch.randn(1, c_in, 7, 7), torch.randn(96, c_in, 3, 3) / (9 * c_in) ** 0.5, torch.randn(96)
    residual = torch.randn(1, 96, 7, 7).contiguous(memory_format=torch.channels_last)
    expected = (torch.conv2d(x.double(), weight.double(), bias.double(), padding=1) + residual.double()).relu()
    with torch_threads(threads):
        _testing.force_serial_for(0)  # a stall seen on a loaded machine runs calls serially: oneDNN's then
        calls = _testing.conv_kernel_calls("winograd")
        first, without = conv_with_and_without_winograd(x, weight, bias, [1, 1, 1, 1], expected.shape, True, residual, 1)
        timed = _testing.conv_kernel_calls("winograd") - calls
        assert timed in (4, 5), timed  # 1 packing + 3 timed calls, + 1 if it won
        won = timed == 5
        _testing.force_serial_for(0)  # a stall in the timing's own calls (CI saw one) would make this call serial
        calls = _testing.conv_kernel_calls("winograd")
        again, _ = conv_with_and_without_winograd(x, weight, bias, [1, 1, 1, 1], expected.shape, True, residual, 1)
        assert _testing.conv_kernel_calls("winograd") - calls == int(won)  # decided: no more timing
    for out in (first, without):
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(first, again)
    assert torch.equal(first, without) != won  # Winograd's rounding differs from oneDNN's
    try:  # serial (oversubscribed): one thread's rule
        _testing.force_serial_for(10_000)
        with torch_threads(threads):
            serial, _ = conv_with_and_without_winograd(x, weight, bias, [1, 1, 1, 1], expected.shape, True, residual, 1)
    finally:
        _testing.force_serial_for(0)
    assert torch.equal(serial, without)


@pytest.mark.parametrize("threads", [1, 2])
def test_conv_winograd_few_channels_is_timed(threads):
    """24-63 channels either way (DPT's head: 32 -> 32 at 224x224) is where Winograd won at some
    shapes and lost at others on an Intel Xeon: the first call at the shape times it against the
    other kernels (each's first call packs, then 3 timed calls each) and the faster serves the shape
    from then on; serially (oversubscribed, one thread's rule) Winograd, untimed."""
    torch.manual_seed(8)
    c_out = 38 + threads  # a shape of its own per parameter: the process decides each shape once
    x, weight, bias = torch.randn(1, 24, 20, 20), torch.randn(c_out, 24, 3, 3) / 15, torch.randn(c_out)
    expected = torch.conv2d(x.double(), weight.double(), bias.double(), padding=1)
    with torch_threads(threads):
        _testing.force_serial_for(0)
        decided, calls = _testing.timed_conv_shapes(), _testing.conv_kernel_calls("winograd")
        first, without = conv_with_and_without_winograd(x, weight, bias, [1, 1, 1, 1], expected.shape, True)
        timed = _testing.conv_kernel_calls("winograd") - calls
        assert _testing.timed_conv_shapes() == decided + 1 and timed in (4, 5), timed
        won = timed == 5
        _testing.force_serial_for(0)
        calls = _testing.conv_kernel_calls("winograd")
        again, _ = conv_with_and_without_winograd(x, weight, bias, [1, 1, 1, 1], expected.shape, True)
        assert _testing.conv_kernel_calls("winograd") - calls == int(won)  # decided: no more timing
        try:
            _testing.force_serial_for(10_000)
            calls = _testing.conv_kernel_calls("winograd")
            serial, _ = conv_with_and_without_winograd(x, weight, bias, [1, 1, 1, 1], expected.shape, True)
            assert _testing.conv_kernel_calls("winograd") - calls == 1
        finally:
            _testing.force_serial_for(0)
    assert_winograd_close(first, expected, False)
    torch.testing.assert_close(without.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(first, again)
    assert torch.equal(first, without) != won


def test_conv_patch_into_few_channels_is_timed():
    """A gathered window of >= 32 input channels into < 64 output channels (DPT's head: 32 -> 32 at
    224x224) is where oneDNN ran 5-22% faster than the patch kernel on an Intel Xeon: the first
    call at the shape times the two (first_is_faster) and the faster serves it from then on. Either
    computes the convolution; the decision holds on later calls."""
    torch.manual_seed(6)
    x, weight, bias = torch.randn(1, 40, 13, 11), torch.randn(20, 40, 3, 3) / 19, torch.randn(20)  # < 24: no Winograd
    expected = torch.conv2d(x.double(), weight.double(), bias.double(), padding=1)
    args = (x, weight, bias, [1, 1], [1, 1, 1, 1], [1, 1], 1, expected.shape, True)
    _testing.force_serial_for(0)  # serially the patch kernel runs untimed
    decided = _testing.timed_conv_shapes()
    (first, won), (library, _) = conv_with_and_without_kernel("patch", *args)
    assert _testing.timed_conv_shapes() == decided + 1 and won in (0, 1)
    _testing.force_serial_for(0)
    (again, calls), _ = conv_with_and_without_kernel("patch", *args)
    assert _testing.timed_conv_shapes() == decided + 1 and calls == won   # decided: the same way
    for out in (first, library):
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(first, again)


def conv_with_and_without_kernel(kernel, x, weight, bias, strides, pads, dilations, groups, out_shape, pack,
                                 residual=None, activation=0):
    """The runtime's channels-last conv, once letting it take its own `kernel` and once not, and how
    many convolutions that kernel computed in the first run."""
    outputs = []
    try:
        for enabled in (True, False):
            _testing.set_conv_kernel_enabled(kernel, enabled)
            before = _testing.conv_kernel_calls(kernel)
            out = torch.full(out_shape, float("nan")).contiguous(memory_format=torch.channels_last)
            _testing.conv(x.contiguous(memory_format=torch.channels_last), weight, bias, strides, pads, dilations,
                          groups, out, 3, pack, residual, activation)
            outputs.append((out, _testing.conv_kernel_calls(kernel) - before))
    finally:
        _testing.set_conv_kernel_enabled(kernel, True)
    return outputs


# The depthwise kernel: every 2-D depthwise convolution between channels-last tensors, whatever its
# kernel size, stride, dilation and (asymmetric) padding; channel counts around its 64-channel
# blocks; rows cut into runs of 8 and 4 pixels (stride 1 and 2) and single ones; bias, residual and
# ReLU; a weight that is an engine constant (re-laid out once) or not.
@pytest.mark.parametrize("n, c, h, w, k, stride, dilation, pads", [
    (1, 144, 10, 10, 3, 1, 1, [1, 1, 1, 1]), (2, 96, 9, 11, 3, 2, 1, [0, 0, 1, 1]),
    (1, 17, 8, 8, 5, 1, 1, [2, 2, 2, 2]), (1, 200, 7, 7, 7, 1, 1, [3, 3, 3, 3]),
    (3, 64, 6, 5, 3, 1, 2, [2, 1, 0, 2]), (1, 2, 1, 1, 3, 1, 1, [1, 1, 1, 1]), (1, 65, 4, 4, 1, 2, 1, [0, 0, 0, 0]),
    (2, 48, 12, 14, 7, 1, 1, [3, 3, 3, 3]), (1, 40, 5, 13, 3, 1, 1, [1, 0, 1, 2]),
    (2, 33, 4, 14, 3, 1, 1, [1, 1, 1, 1]), (1, 20, 3, 21, 5, 1, 1, [2, 2, 2, 2]),
    # stride 2 in runs: runs of 8 and 4 then single pixels, left pads of 0-2, 5 wide, channels off 16
    (1, 96, 6, 40, 3, 2, 1, [0, 0, 1, 1]), (2, 24, 7, 30, 3, 2, 1, [1, 1, 1, 1]),
    (1, 40, 9, 23, 5, 2, 1, [2, 2, 2, 2]), (1, 16, 5, 9, 3, 2, 1, [1, 2, 1, 0]), (1, 16, 5, 4, 5, 2, 1, [0, 0, 0, 1])])
@pytest.mark.parametrize("with_bias, with_sum, activation, pack", [(True, False, 0, True), (False, True, 1, False),
                                                                    (True, True, 1, True), (True, True, 3, True)])
def test_conv_depthwise(n, c, h, w, k, stride, dilation, pads, with_bias, with_sum, activation, pack):
    torch.manual_seed(4)
    x, weight = torch.randn(n, c, h, w), torch.randn(c, 1, k, k)
    bias = torch.randn(c) if with_bias else None
    padded = torch.nn.functional.pad(x, [pads[1], pads[3], pads[0], pads[2]]).double()
    expected = torch.conv2d(padded, weight.double(), bias.double() if with_bias else None, stride, 0, dilation, c)
    residual = torch.randn(expected.shape).contiguous(memory_format=torch.channels_last) if with_sum else None
    expected = expected + residual.double() if with_sum else expected
    expected = ACTIVATIONS[activation](expected)
    (ours, ours_calls), (onednn, onednn_calls) = conv_with_and_without_kernel(
        "depthwise", x, weight, bias, [stride] * 2, pads, [dilation] * 2, c, expected.shape, pack, residual, activation)
    assert (ours_calls, onednn_calls) == (1, 0)
    for out in (ours, onednn):
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_conv_depthwise_relu_keeps_nan():
    """ReLU of NaN is NaN in torch; the fused epilogue must not turn it into 0."""
    x = torch.randn(1, 16, 3, 3)
    x[0, 5, 1, 1] = float("nan")
    weight = torch.ones(16, 1, 1, 1)
    (out, calls), _ = conv_with_and_without_kernel("depthwise", x, weight, None, [1, 1], [0, 0, 0, 0], [1, 1], 16,
                                                   (1, 16, 3, 3), True, None, 1)
    assert calls == 1
    torch.testing.assert_close(out, x.relu().contiguous(memory_format=torch.channels_last), equal_nan=True)


def test_conv_depthwise_not_taken():
    """A channel multiplier (out channels = 2 x groups) or an NCHW tensor: oneDNN's convolution."""
    x, weight = torch.randn(1, 8, 6, 6), torch.randn(16, 1, 3, 3)
    (_, calls), _ = conv_with_and_without_kernel("depthwise", x, weight, None, [1, 1], [1, 1, 1, 1], [1, 1], 8,
                                                 (1, 16, 6, 6), True)
    assert calls == 0
    before = _testing.conv_kernel_calls("depthwise")
    x, weight = torch.randn(1, 8, 6, 6), torch.randn(8, 1, 3, 3)
    _testing.conv(x, weight, None, [1, 1], [1, 1, 1, 1], [1, 1], 8, torch.empty(1, 8, 6, 6), 0, True)
    assert _testing.conv_kernel_calls("depthwise") == before


# The grouped kernel: 2-D grouped convolutions between channels-last tensors whose groups have a
# multiple of 4 output channels (8 as one vector, 16 and 24 as one tile of 2 and 3, 32 and 40 as
# several; 4 and 12 as 4-float vectors), group input channels of 8 and 16 (unrolled) and others (1 is a channel multiplier of 8,
# 3, 24), any kernel size, stride, dilation and (asymmetric) padding; rows cut into tiles of 8, 6 or
# 4 pixels and the even shorter ones of narrow images; bias, residual and ReLU; a weight that is an
# engine constant (laid out once) or not. Against a float64 convolution, and oneDNN's.
@pytest.mark.parametrize("n, c_in, c_out, groups, h, w, k, stride, dilation, pads", [
    (1, 48, 48, 6, 14, 14, 3, 2, 1, [1, 1, 1, 1]), (2, 32, 32, 4, 9, 11, 3, 1, 1, [1, 1, 1, 1]),
    (1, 64, 64, 4, 7, 7, 3, 1, 1, [1, 1, 1, 1]), (1, 48, 48, 2, 6, 13, 3, 1, 1, [0, 1, 2, 1]),
    (1, 24, 64, 8, 5, 5, 1, 1, 1, [0, 0, 0, 0]), (1, 8, 64, 8, 6, 6, 3, 1, 1, [1, 1, 1, 1]),
    (3, 96, 96, 4, 5, 9, 3, 2, 1, [1, 1, 1, 1]), (1, 64, 80, 2, 8, 3, 5, 1, 2, [4, 4, 4, 4]),
    (1, 16, 16, 2, 1, 1, 3, 1, 1, [1, 1, 1, 1]), (1, 40, 40, 5, 4, 17, 3, 1, 1, [1, 1, 1, 1]),
    (1, 16, 48, 2, 5, 20, 3, 1, 1, [1, 1, 1, 1]), (2, 32, 16, 2, 4, 4, 2, 2, 1, [0, 0, 0, 0]),
    (1, 6, 16, 2, 9, 9, 3, 3, 1, [1, 0, 1, 0]),
    # groups of 4 output channels (4-float vectors): ResNeXt 32x4d's, unrolled (4 in) or not (6 in,
    # 12 out: three vectors one after another)
    (2, 128, 128, 32, 6, 7, 3, 2, 1, [1, 1, 1, 1]), (1, 16, 16, 4, 7, 19, 3, 1, 1, [1, 1, 1, 1]),
    (1, 12, 24, 2, 5, 6, 3, 1, 2, [2, 1, 2, 2])])
@pytest.mark.parametrize("with_bias, with_sum, activation, pack", [(True, False, 0, True), (False, True, 1, False),
                                                                    (True, True, 1, True), (True, True, 3, False)])
def test_conv_grouped(n, c_in, c_out, groups, h, w, k, stride, dilation, pads, with_bias, with_sum, activation, pack):
    torch.manual_seed(6)
    x, weight = torch.randn(n, c_in, h, w), torch.randn(c_out, c_in // groups, k, k)
    bias = torch.randn(c_out) if with_bias else None
    padded = torch.nn.functional.pad(x, [pads[1], pads[3], pads[0], pads[2]]).double()
    expected = torch.conv2d(padded, weight.double(), bias.double() if with_bias else None, stride, 0, dilation, groups)
    residual = torch.randn(expected.shape).contiguous(memory_format=torch.channels_last) if with_sum else None
    expected = expected + residual.double() if with_sum else expected
    expected = ACTIVATIONS[activation](expected)
    (ours, ours_calls), (onednn, onednn_calls) = conv_with_and_without_kernel(
        "grouped", x, weight, bias, [stride] * 2, pads, [dilation] * 2, groups, expected.shape, pack, residual,
        activation)
    assert (ours_calls, onednn_calls) == (1, 0)
    for out in (ours, onednn):
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_conv_grouped_keeps_nan_and_inf():
    """NaN and infinities in the input reach the output as in torch (ReLU keeps NaN); padding taps
    add zeros."""
    x = torch.randn(1, 16, 5, 5)
    x[0, 3, 2, 2], x[0, 12, 0, 4], x[0, 9, 4, 0] = float("nan"), float("inf"), -float("inf")
    weight = torch.rand(16, 8, 3, 3) + 0.1  # positive: an infinity is not cancelled
    expected = torch.conv2d(x, weight, None, 1, 1, 1, 2).relu().contiguous(memory_format=torch.channels_last)
    (out, calls), _ = conv_with_and_without_kernel("grouped", x, weight, None, [1, 1], [1, 1, 1, 1], [1, 1], 2,
                                                   (1, 16, 5, 5), True, None, 1)
    assert calls == 1
    torch.testing.assert_close(out, expected, equal_nan=True)


def test_conv_grouped_not_taken():
    """Groups of 2 output channels, or NCHW tensors: oneDNN's convolution."""
    x, weight = torch.randn(1, 16, 6, 6), torch.randn(16, 2, 3, 3)
    (_, calls), _ = conv_with_and_without_kernel("grouped", x, weight, None, [1, 1], [1, 1, 1, 1], [1, 1], 8,
                                                 (1, 16, 6, 6), True)
    assert calls == 0
    before = _testing.conv_kernel_calls("grouped")
    x, weight = torch.randn(1, 16, 6, 6), torch.randn(16, 8, 3, 3)
    _testing.conv(x, weight, None, [1, 1], [1, 1, 1, 1], [1, 1], 2, torch.empty(1, 16, 6, 6), 0, True)
    assert _testing.conv_kernel_calls("grouped") == before


# 1x1 convolutions as one GEMM: channels-last (2-D) or NCHW (1-3 spatial dims) in and out, with
# bias, residual and ReLU, against a float64 convolution; the kernel must have computed them. The
# patch kernel (below) takes channels-last outputs first: it is off here.
@pytest.mark.parametrize("shape, layout", [((2, 24, 5, 7), 3), ((1, 3, 4, 4), 3), ((2, 16, 6, 5), 0), ((3, 8, 10), 0),
                                           ((1, 4, 3, 2, 5), 0), ((1, 144, 1, 1), 3)])
@pytest.mark.parametrize("with_bias, with_sum, activation", [(False, False, 0), (True, False, 1), (False, True, 0),
                                                             (True, True, 3),
                                                             (True, True, 1)])
def test_conv_pointwise(shape, layout, with_bias, with_sum, activation):
    torch.manual_seed(5)
    c_in, c_out, spatial = shape[1], 40, len(shape) - 2
    x, weight = torch.randn(shape), torch.randn(c_out, c_in, *([1] * spatial)) / c_in ** 0.5
    bias = torch.randn(c_out) if with_bias else None
    conv = {1: torch.conv1d, 2: torch.conv2d, 3: torch.conv3d}[spatial]
    expected = conv(x.double(), weight.double(), bias.double() if with_bias else None)
    memory_format = torch.channels_last if layout else torch.contiguous_format
    residual = torch.randn(expected.shape).contiguous(memory_format=memory_format) if with_sum else None
    expected = expected + residual.double() if with_sum else expected
    expected = ACTIVATIONS[activation](expected)
    outputs = []
    try:
        _testing.set_conv_kernel_enabled("patch", False)
        for enabled in (True, False):
            _testing.set_conv_kernel_enabled("pointwise", enabled)
            before = _testing.conv_kernel_calls("pointwise")
            out = torch.full(expected.shape, float("nan")).contiguous(memory_format=memory_format)
            _testing.conv(x.contiguous(memory_format=memory_format), weight, bias, [1] * spatial, [0] * 2 * spatial,
                          [1] * spatial, 1, out, layout, True, residual, activation)
            outputs.append((out, _testing.conv_kernel_calls("pointwise") - before))
    finally:
        _testing.set_conv_kernel_enabled("pointwise", True)
        _testing.set_conv_kernel_enabled("patch", True)
    assert [calls for _, calls in outputs] == [1, 0]
    for out, _ in outputs:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


# With groups (SqueezeBERT's 4-group 1x1 Conv1d), one GEMM per group: NCL/NCHW (batch 2: per image
# too) and channels-last (the grouped kernel, which takes those first, off); one pixel an image
# (a squeeze-and-excitation at batch 8), NCHW rows as one GEMM over the images.
@pytest.mark.parametrize("shape, layout, groups", [((1, 64, 12), 0, 4), ((2, 32, 3, 5), 0, 2), ((2, 32, 5, 7), 3, 2),
                                                   ((8, 32, 1, 1), 0, 1), ((8, 32, 1, 1), 0, 2), ((3, 32, 1), 0, 2)])
def test_conv_pointwise_grouped(shape, layout, groups):
    torch.manual_seed(6)
    c_in, c_out, spatial = shape[1], 64, len(shape) - 2
    x, weight = torch.randn(shape), torch.randn(c_out, c_in // groups, *([1] * spatial))
    bias = torch.randn(c_out)
    conv = {1: torch.conv1d, 2: torch.conv2d}[spatial]
    expected = conv(x.double(), weight.double(), bias.double(), groups=groups).relu()
    memory_format = torch.channels_last if layout else torch.contiguous_format
    out = torch.full(expected.shape, float("nan")).contiguous(memory_format=memory_format)
    try:
        _testing.set_conv_kernel_enabled("patch", False)
        _testing.set_conv_kernel_enabled("grouped", False)
        before = _testing.conv_kernel_calls("pointwise")
        _testing.conv(x.contiguous(memory_format=memory_format), weight, bias, [1] * spatial, [0] * 2 * spatial,
                      [1] * spatial, groups, out, layout, True, None, 1)
        assert _testing.conv_kernel_calls("pointwise") == before + 1
    finally:
        _testing.set_conv_kernel_enabled("patch", True)
        _testing.set_conv_kernel_enabled("grouped", True)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strides, pads, groups, layout", [([2, 2], [0, 0, 0, 0], 1, 3), ([1, 1], [0, 1, 0, 0], 1, 3),
                                                           ([1, 1], [0, 0, 0, 0], 2, 0), ([1, 1], [0, 0, 0, 0], 1, 1)])
def test_conv_pointwise_not_taken(strides, pads, groups, layout):
    """Strided, padded, narrowly grouped (4 channels a group) or layout-changing 1x1 convolutions
    stay oneDNN's."""
    x, weight = torch.randn(1, 8, 6, 6), torch.randn(8, 8 // groups, 1, 1)
    expected = torch.conv2d(torch.nn.functional.pad(x, [pads[1], pads[3], pads[0], pads[2]]), weight, None, strides,
                            groups=groups)
    out = torch.empty(expected.shape).contiguous(memory_format=torch.channels_last if layout & 2 else torch.contiguous_format)
    before = _testing.conv_kernel_calls("pointwise")
    try:
        _testing.set_conv_kernel_enabled("patch", False)
        _testing.conv(x.contiguous(memory_format=torch.channels_last if layout & 1 else torch.contiguous_format),
                      weight, None, strides, pads, [1, 1], groups, out, layout, True)
    finally:
        _testing.set_conv_kernel_enabled("patch", True)
    assert _testing.conv_kernel_calls("pointwise") == before
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


# The patch kernel (conv_patch.h): every ungrouped 2-D convolution with a channels-last output (or
# an NCHW output from a channels-last input) and at most 2304 values per receptive field, as
# register tiles of 6 pixels x 32 channels with the epilogue in registers. Edge cases of its tiling
# and gather against a float64 convolution: pixel counts under, at and past a tile and a 48-pixel
# block, channel counts off the 16/32 vectors, strides, dilation, asymmetric padding, NCHW inputs,
# NCHW outputs (pixel runs crossing images), batches, a weight packed once or per call.
PATCH_CASES = [  # x shape, out channels, kernel, stride, pads (top, left, bottom, right), dilation, input channels-last
    ((1, 24, 5, 5), 40, 1, 1, [0, 0, 0, 0], 1, True),
    ((2, 7, 3, 5), 7, 1, 1, [0, 0, 0, 0], 1, True),
    ((1, 16, 1, 1), 144, 1, 1, [0, 0, 0, 0], 1, True),
    ((3, 33, 7, 9), 24, 1, 1, [0, 0, 0, 0], 1, True),
    ((2, 40, 7, 5), 56, 1, 1, [0, 0, 0, 0], 1, True),   # a panel of 32, one of 24 (AVX2: 3 vectors x 4 pixels)
    ((1, 3, 17, 16), 32, 3, 2, [0, 0, 1, 1], 1, False),
    ((2, 3, 15, 15), 16, 7, 2, [3, 3, 3, 3], 1, False),
    ((1, 3, 16, 16), 48, 4, 4, [0, 0, 0, 0], 1, False),
    ((2, 5, 9, 8), 16, 3, 2, [1, 1, 1, 1], 1, False),   # an NCHW input of other than 3 channels
    ((2, 48, 8, 6), 96, 2, 2, [0, 0, 0, 0], 1, True),
    ((1, 8, 11, 9), 20, 3, 1, [1, 2, 0, 1], 1, True),
    ((1, 8, 11, 9), 17, 3, 2, [2, 2, 2, 2], 2, True),
    ((1, 64, 9, 7), 64, 1, 2, [0, 0, 0, 0], 1, True),
    ((1, 256, 4, 4), 33, 3, 1, [1, 1, 1, 1], 1, True),   # depth 2304: the limit
]


def patch_reference(x, weight, bias, stride, pads, dilation, residual, activation):
    padded = torch.nn.functional.pad(x.double(), [pads[1], pads[3], pads[0], pads[2]])
    expected = torch.conv2d(padded, weight.double(), None if bias is None else bias.double(), stride,
                            dilation=dilation)
    expected = expected + residual.double() if residual is not None else expected
    return ACTIVATIONS[activation](expected)


def patch_output(shape, channels_last):
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return torch.full(shape, float("nan")).contiguous(memory_format=memory_format)


@contextlib.contextmanager
def patch_kernel_wherever_it_applies():
    """The patch kernel wherever it applies: not oneDNN or Winograd where either may time faster
    (patch_marginal, winograd_marginal), so a test's shape takes the kernel it tests."""
    _testing.set_patch_timing(False)
    _testing.set_conv_kernel_enabled("winograd", False)
    try:
        yield
    finally:
        _testing.set_patch_timing(True)
        _testing.set_conv_kernel_enabled("winograd", True)


@pytest.mark.parametrize("case", PATCH_CASES, ids=lambda c: "x".join(map(str, c[0])) + f"-o{c[1]}k{c[2]}s{c[3]}d{c[5]}")
@pytest.mark.parametrize("with_bias, with_sum, activation", [(True, False, 0), (False, True, 1), (True, True, 2),
                                                             (True, True, 3)])
@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("output_channels_last", [True, False], ids=["out_cl", "out_nchw"])
def test_conv_patch(case, with_bias, with_sum, activation, pack, output_channels_last):
    torch.manual_seed(7)
    x_shape, c_out, k, stride, pads, dilation, input_channels_last = case
    if not (input_channels_last or output_channels_last):
        pytest.skip("NCHW to NCHW is not the patch kernel's (test_conv_patch_not_taken)")
    x = torch.randn(x_shape)
    weight = torch.randn(c_out, x_shape[1], k, k) / (x_shape[1] * k * k) ** 0.5
    bias = torch.randn(c_out) if with_bias else None
    shape = patch_reference(x, weight, None, stride, pads, dilation, None, 0).shape
    residual = patch_output(shape, output_channels_last).normal_() if with_sum else None
    expected = patch_reference(x, weight, bias, stride, pads, dilation, residual, activation)
    out = patch_output(shape, output_channels_last)
    before = _testing.conv_kernel_calls("patch")
    with patch_kernel_wherever_it_applies():
        _testing.conv(x.contiguous(memory_format=torch.channels_last) if input_channels_last else x, weight, bias,
                      [stride] * 2, pads, [dilation] * 2, 1, out, 2 * int(output_channels_last) | int(input_channels_last),
                      pack, residual, activation, -0.5, 0.75)
    assert _testing.conv_kernel_calls("patch") == before + 1
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


# How the patch kernel splits its work across threads (pixel blocks split evenly; with few pixels
# one equal run of panel x pixel-block units a thread; the next panel prefetched, always on a
# weight past 512 KB) and its
# gather's whole-vector copies (short runs ending at the input's last float, channel counts off
# the 16-float vectors): on 1 and 2 threads, against float64.
PATCH_SPLIT_CASES = [  # x shape, out channels, kernel, stride, pads, input channels-last
    ((1, 96, 10, 10), 576, 1, 1, [0, 0, 0, 0], True),      # 100 pixels: 4 blocks of 25
    ((1, 32, 20, 20), 70, 1, 1, [0, 0, 0, 0], True),       # 400 pixels: 10 blocks of 40, last panel 6 wide
    ((1, 320, 5, 5), 1280, 1, 1, [0, 0, 0, 0], True),      # 25 pixels, 40 panels split, a 1.6 MB weight
    ((1, 160, 5, 5), 150, 1, 1, [0, 0, 0, 0], True),       # 5 panels: pixels cut in 2 blocks, 5 units a thread
    ((1, 96, 5, 5), 320, 1, 1, [0, 0, 0, 0], True),        # 10 panels: 5 a thread, each run in one call
    ((1, 40, 8, 8), 70, 1, 1, [0, 0, 0, 0], True),         # 64 pixels, 3 panels: 2 blocks x 3 panels, a shared panel
    ((1, 24, 1, 1), 70, 1, 1, [0, 0, 0, 0], True),         # one pixel: too little work for a second thread
    ((3, 17, 7, 5), 33, 1, 1, [0, 0, 0, 0], True),         # 105 pixels over images
    ((1, 3, 9, 9), 32, 3, 1, [0, 0, 0, 0], False),         # runs of 9 floats, the last one ends the input
    ((1, 20, 6, 7), 24, 3, 1, [0, 0, 0, 0], True),         # runs of 60 floats, ending the input
    ((2, 5, 8, 8), 19, 3, 2, [1, 1, 1, 1], True),          # taps of 5 floats, padded borders
    ((1, 64, 12, 12), 600, 3, 2, [0, 0, 1, 1], True),      # gathered rows, a 1.4 MB weight
    ((1, 256, 14, 14), 128, 1, 2, [0, 0, 0, 0], True),     # 49 gathered pixels, 4 panels: all gathered a thread
    ((2, 40, 7, 7), 64, 3, 2, [1, 1, 1, 1], True),         # 32 gathered pixels over images, 2 panels
    ((1, 64, 7, 7), 96, 3, 2, [1, 1, 1, 1], True),         # 16 gathered pixels, 3 panels (2 threads: by blocks)
    ((8, 144, 40, 40), 24, 1, 1, [0, 0, 0, 0], True),      # a 7.4 MB input: the next block's rows prefetched
    # Deeper than two chunks of 96 (panel_in_chunks): sums carried between chunks in the output
    ((1, 37, 9, 9), 40, 3, 2, [1, 1, 1, 1], True),         # depth 333: chunks 96, 96, 96, 45; the 8-wide panel in one pass
    ((2, 72, 10, 10), 48, 3, 1, [1, 1, 1, 1], True),       # depth 648 over 200 pixels in blocks (48 outputs: not Winograd)
    ((4, 400, 28, 28), 64, 1, 1, [0, 0, 0, 0], True),      # 1x1, a 5 MB input: the first panel in one pass (rows ahead)
]


@pytest.mark.parametrize("case", PATCH_SPLIT_CASES, ids=lambda c: "x".join(map(str, c[0])) + f"-o{c[1]}k{c[2]}s{c[3]}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("output_channels_last", [True, False], ids=["out_cl", "out_nchw"])
@pytest.mark.parametrize("activation", [2, 3, 4], ids=["clamp", "silu", "gelu"])
def test_conv_patch_threads_and_gather(case, threads, output_channels_last, activation):
    torch.manual_seed(9)
    x_shape, c_out, k, stride, pads, input_channels_last = case
    check_patch_conv(x_shape, c_out, (k, k), (stride, stride), pads, (1, 1), input_channels_last, output_channels_last,
                     threads, activation)


# Each ISA version of the patch kernel's block functions (conv_patch_blocks.h) this CPU can run, not
# only its best one: 16-float vectors (one tile a panel) with AVX-512, 8-float ones (two tiles a
# panel) with AVX2 and the baseline, on cases of PATCH_CASES and PATCH_SPLIT_CASES that take each
# path (one pass and chunks over the depth, gathered and direct, few pixels, NCHW output).
ISA_CASES = [PATCH_CASES[4], PATCH_CASES[6], PATCH_CASES[13]] + [c[:5] + (1,) + c[5:] for c in PATCH_SPLIT_CASES[-7:]]


@pytest.mark.parametrize("isa", ["x86-64", "x86-64-v3", "x86-64-v4"])
@pytest.mark.parametrize("case", ISA_CASES, ids=lambda c: "x".join(map(str, c[0])) + f"-o{c[1]}k{c[2]}s{c[3]}")
@pytest.mark.parametrize("output_channels_last", [True, False], ids=["out_cl", "out_nchw"])
def test_conv_patch_each_isa(isa, case, output_channels_last):
    x_shape, c_out, k, stride, pads, dilation, input_channels_last = case

    def run():
        torch.manual_seed(10)
        return check_patch_conv(x_shape, c_out, (k, k), (stride, stride), pads, (dilation, dilation),
                                input_channels_last, output_channels_last, 2)

    if not _testing.set_patch_isa(isa):
        pytest.skip(f"this CPU lacks {isa}")
    try:
        out = run()
    finally:
        _testing.set_patch_isa("")
    if isa == "x86-64" and _testing.set_patch_isa("x86-64-v3"):
        # the baseline multiplies and adds apart where AVX2/AVX-512 fuse them: its result differs in
        # rounding, so the switch did run another version
        _testing.set_patch_isa("")
        assert not torch.equal(out, run())


# Pair tiles (AVX-512 only: two adjacent whole panels, 64 channels, summed in one tile, for blocks
# of at least 32 pixels): each output sums the same products in the same order as two single
# tiles do, so the result is bitwise the same with pair tiles on and off, and against float64.
# Cases where a block's panels pair and where a single panel is left over (odd or partial panels),
# one pass and chunks over the depth, direct and gathered rows, the few-pixels runs, the
# rows-ahead first panel; blocks too small, image rows and an NCHW output (no pairs).
PAIR_CASES = [  # x shape, out channels, kernel, stride, pads, input channels-last, pairs on (1, 2 threads)
    ((1, 64, 14, 14), 128, 1, 1, [0, 0, 0, 0], True, (True, True)),      # 2 pairs a block, one pass
    ((1, 48, 12, 12), 96, 1, 1, [0, 0, 0, 0], True, (True, True)),       # a pair and a single panel
    ((1, 40, 12, 12), 70, 1, 1, [0, 0, 0, 0], True, (True, True)),       # a pair and a 6-wide last panel
    ((1, 256, 14, 14), 160, 1, 1, [0, 0, 0, 0], True, (True, True)),     # chunks of 96 over depth 256, 5 panels
    ((1, 40, 14, 14), 96, 3, 1, [1, 1, 1, 1], True, (True, True)),       # gathered 3x3: depth 360 in chunks (not Winograd: 40 in)
    ((4, 400, 28, 28), 128, 1, 1, [0, 0, 0, 0], True, (True, True)),     # a 5 MB input: the first pair in one pass, rows ahead
    ((1, 512, 14, 14), 192, 1, 2, [0, 0, 0, 0], True, (False, True)),    # 49 gathered pixels: 2 threads' runs of 3 panels
                                                                          # over one block; 1 thread: blocks of 24, 25
    ((1, 256, 10, 10), 160, 1, 1, [0, 0, 0, 0], True, (True, False)),    # 100 pixels: 3 blocks on 1 thread, 4 of 25 on 2
    ((1, 320, 5, 5), 1280, 1, 1, [0, 0, 0, 0], True, (False, False)),    # 25 pixels: too few
    ((1, 3, 20, 20), 64, 3, 2, [1, 1, 1, 1], False, (False, False)),     # an NCHW image read as image rows
]


@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: "x".join(map(str, c[0])) + f"-o{c[1]}k{c[2]}s{c[3]}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("output_channels_last", [True, False], ids=["out_cl", "out_nchw"])
@pytest.mark.parametrize("activation", [2, 3, 4], ids=["clamp", "silu", "gelu"])
def test_conv_patch_pair_tiles(case, threads, output_channels_last, activation):
    x_shape, c_out, k, stride, pads, input_channels_last, pairs_on = case
    if not _testing.set_patch_isa("x86-64-v4"):  # (the AVX-512 version is the one with pair tiles)
        pytest.skip("this CPU (or this build) has no AVX-512 version of the patch kernel")

    def run(pairs):
        torch.manual_seed(11)
        _testing.set_patch_pair_tiles(pairs)
        try:
            return check_patch_conv(x_shape, c_out, (k, k), (stride, stride), pads, (1, 1), input_channels_last,
                                    output_channels_last, threads, activation)
        finally:
            _testing.set_patch_pair_tiles(True)

    try:
        before = _testing.patch_pair_tile_panels()
        with_pairs = run(True)
        paired = _testing.patch_pair_tile_panels() - before
        assert torch.equal(with_pairs, run(False))
        assert _testing.patch_pair_tile_panels() == before + paired  # off: none
    finally:
        _testing.set_patch_isa("")
    assert (paired > 0) == (output_channels_last and pairs_on[threads - 1])


def check_patch_conv(x_shape, c_out, kernel, stride, pads, dilation, input_channels_last, output_channels_last,
                     threads, activation=2, taken=True):
    """The patch kernel (another one unless `taken`) on `threads` threads, with bias, a residual and
    `activation` (a clamp: each value as it is stored; SiLU: over each block stored), against float64."""
    if not (input_channels_last or output_channels_last):
        pytest.skip("NCHW to NCHW is not the patch kernel's (test_conv_patch_not_taken)")
    x = torch.randn(x_shape)
    weight = torch.randn(c_out, x_shape[1], *kernel) / (x_shape[1] * kernel[0] * kernel[1]) ** 0.5
    bias = torch.randn(c_out)
    shape = patch_reference(x, weight, None, stride, pads, dilation, None, 0).shape
    residual = patch_output(shape, output_channels_last).normal_()
    expected = patch_reference(x, weight, bias, stride, pads, dilation, residual, activation)
    out = patch_output(shape, output_channels_last)
    before_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with patch_kernel_wherever_it_applies():
            _testing.force_serial_for(0)  # a stall seen on a loaded machine would make it one thread
            before = _testing.conv_kernel_calls("patch")
            _testing.conv(x.contiguous(memory_format=torch.channels_last) if input_channels_last else x, weight,
                          bias, list(stride), pads, list(dilation), 1, out,
                          2 * int(output_channels_last) | int(input_channels_last), True, residual, activation, -0.5, 0.75)
            assert _testing.conv_kernel_calls("patch") == before + int(taken)
    finally:
        torch.set_num_threads(before_threads)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    return out


# Past 2304 values per receptive field the patch kernel takes a convolution whose pixels each
# thread gathers all of (fewer blocks of 48 than two a thread, panels the threads divide) when a
# panel (depth x 32 floats) fits half the CPU's L2 (set here: 2 MB, or 512 KB, where it does not);
# other deep ones stay oneDNN's. ResNet-50's 512-channel 3x3 stride 2 at 7x7 (depth 4608: 590 KB
# panels) in small.
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("x_shape, c_out, few_on", [  # few on (1 thread, 2 threads)
    ((1, 512, 12, 12), 64, (True, True)),     # 36 pixels, 2 panels: one block
    ((1, 512, 14, 14), 64, (False, True)),    # 49 pixels: two blocks, two threads' runs
    ((1, 512, 12, 12), 80, (True, False)),    # 3 panels (the last 16 wide): 2 threads do not divide them
    ((1, 512, 24, 24), 64, (False, False)),   # 144 pixels
])
@pytest.mark.parametrize("l2_bytes", [2 << 20, 512 << 10], ids=["l2_2mb", "l2_512kb"])
@pytest.mark.parametrize("activation", [2, 3, 4], ids=["clamp", "silu", "gelu"])
def test_conv_patch_deep_few_pixels(threads, x_shape, c_out, few_on, l2_bytes, activation):
    torch.manual_seed(12)
    _testing.set_l2_cache_bytes(l2_bytes)
    try:
        check_patch_conv(x_shape, c_out, (3, 3), (2, 2), [1, 1, 1, 1], (1, 1), True, True, threads, activation,
                         taken=few_on[threads - 1] and 2 * x_shape[1] * 9 * 32 * 4 <= l2_bytes)
    finally:
        _testing.set_l2_cache_bytes(-1)


def run_conv_chain_twice(first, layers, size, threads):
    """Runs layers [(weight, bias, groups, pads)] (stride 1, clamp [-0.5, 0.75]) as a chain from
    `first` twice on `threads` threads: each result against float64 of its input, the second pass
    bitwise equal to the first (the chains' prefetches must not change a result)."""
    before_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        passes = []
        for _ in range(2):
            x, outs = first, []
            for weight, bias, groups, pads in layers:
                out = patch_output((1, weight.shape[0], size, size), True)
                _testing.conv(x, weight, bias, [1, 1], pads, [1, 1], groups, out, 3, True, None, 2, -0.5, 0.75)
                padded = torch.nn.functional.pad(x.double(), [pads[1], pads[3], pads[0], pads[2]])
                expected = torch.conv2d(padded, weight.double(), bias.double(), 1, 0, 1, groups).clamp(-0.5, 0.75)
                torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
                outs.append(out)
                x = out
            passes.append(outs)
    finally:
        torch.set_num_threads(before_threads)
    for a, b in zip(*passes):
        assert torch.equal(a, b)


# A chain of patch convolutions with few pixels (MobileNetV2's 5x5 stage), run twice: from the
# second pass on, each one's last panels prefetch the panel its thread starts the next one with
# (conv_patch.cpp, Successors; the packs of these calls are freed after each, so the pointers it
# learnt may be stale: a prefetch never faults), of another depth than its own. On 1 and 2
# threads, each result against float64 of its input, and the second pass bitwise equal to the first.
@pytest.mark.parametrize("threads", [1, 2])
def test_conv_patch_chain_of_few_pixels(threads):
    torch.manual_seed(11)
    channels = [576, 160, 960, 320, 1280, 24]
    layers = [(torch.randn(o, i, 1, 1) / i ** 0.5, torch.randn(o), 1, [0, 0, 0, 0]) for i, o in zip(channels, channels[1:])]
    first = torch.randn(1, channels[0], 5, 5).contiguous(memory_format=torch.channels_last)
    run_conv_chain_twice(first, layers, 5, threads)


# MobileNetV2's inverted residual blocks at 10x10 and 5x5 (1x1 expand, depthwise 3x3, 1x1 reduce),
# run twice: from the second pass on, each depthwise convolution prefetches, pixel by pixel, the
# weight lines its thread will read first in the patch convolution after it (depthwise.cpp,
# WeightPrefetch, from conv_patch.cpp's learnt successors; one that follows a patch convolution on
# the other path (10x10: every thread reads every panel) and one on the few-pixels path (5x5: each
# its share). On 1 and 2 threads, each result against float64 of its input, the second pass
# bitwise equal to the first (prefetches only).
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("size, channels", [(10, [96, 576, 96, 576, 96]), (5, [160, 960, 160, 960, 320])])
def test_depthwise_prefetches_next_patch_weights(threads, size, channels):
    torch.manual_seed(12)
    layers = []  # (weight, bias, groups, pads) in order: expand, depthwise, reduce, ...
    for c_in, c_out in zip(channels, channels[1:]):
        layers.append((torch.randn(c_out, c_in, 1, 1) / c_in ** 0.5, torch.randn(c_out), 1, [0, 0, 0, 0]))
        if c_out > c_in:
            layers.append((torch.randn(c_out, 1, 3, 3) / 3, torch.randn(c_out), c_out, [1, 1, 1, 1]))
    first = torch.randn(1, channels[0], size, size).contiguous(memory_format=torch.channels_last)
    depthwise_before = _testing.conv_kernel_calls("depthwise")
    run_conv_chain_twice(first, layers, size, threads)
    assert _testing.conv_kernel_calls("depthwise") - depthwise_before == 2 * (len(channels) // 2)


# The patch kernel's rows read straight from the image (conv_patch.cpp, image_block): on inputs of
# at most 4 channels, the pixels of an image row whose taps all lie inside the width, at least a
# tile of them, skip the gather. Their borders (merged across rows and images), kernel rows in the
# top/bottom padding (some rows with the whole kernel there), dilation along the height, strides,
# non-square kernels, kernels wider than the image and runs too short for the image path, 1 to 4
# channels, on 1 and 2 threads, both output layouts, against float64.
IMAGE_ROW_CASES = [  # x shape, out channels, kernel (h, w), stride (h, w), pads, dilation (h, w), input channels-last
    ((1, 3, 20, 37), 32, (3, 3), (2, 2), [0, 0, 1, 1], (1, 1), False),   # MobileNetV2's stem, narrower
    ((2, 3, 23, 30), 24, (7, 7), (2, 2), [3, 3, 3, 3], (1, 1), False),   # ResNet's stem, 24 channels
    ((1, 3, 9, 31), 64, (7, 7), (2, 2), [3, 3, 3, 3], (1, 1), True),     # two panels
    ((1, 1, 6, 25), 40, (3, 3), (1, 1), [1, 1, 1, 1], (1, 1), True),     # one channel, a 8-wide last panel
    ((1, 2, 11, 28), 17, (3, 3), (1, 2), [4, 0, 4, 2], (3, 1), True),    # dilated along the height only
    ((1, 4, 4, 40), 16, (5, 3), (2, 1), [6, 1, 6, 1], (1, 1), True),     # whole kernels in the padding
    ((2, 4, 7, 12), 9, (2, 3), (1, 1), [0, 0, 0, 0], (1, 1), True),      # rows of 10: tiles of 5
    ((1, 3, 5, 9), 8, (3, 3), (1, 1), [1, 1, 1, 1], (1, 1), True),       # 7 inside a row of 9
    ((1, 3, 5, 7), 8, (3, 3), (1, 1), [1, 1, 1, 1], (1, 1), True),       # 5 inside: all gathered
    ((1, 3, 5, 4), 8, (3, 6), (1, 1), [1, 1, 1, 1], (1, 1), True),       # the kernel wider than the image
    ((2, 3, 41, 40), 33, (3, 3), (2, 2), [1, 1, 1, 1], (1, 1), True),    # many blocks, a 1-wide last panel
    ((1, 2, 6, 20), 12, (3, 3), (1, 1), [1, 1, 1, 1], (1, 2), True),     # dilated along the width: gathered
]


@pytest.mark.parametrize("case", IMAGE_ROW_CASES, ids=lambda c: "x".join(map(str, c[0])) + f"-o{c[1]}k{c[2][0]}{c[2][1]}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("output_channels_last", [True, False], ids=["out_cl", "out_nchw"])
def test_conv_patch_image_rows(case, threads, output_channels_last):
    torch.manual_seed(10)
    x_shape, c_out, kernel, stride, pads, dilation, input_channels_last = case
    check_patch_conv(x_shape, c_out, kernel, stride, pads, dilation, input_channels_last, output_channels_last, threads)


def test_conv_patch_nan_and_inf():
    """A NaN or inf input reaches exactly the outputs whose receptive field holds it (the zero-padded
    lanes of the last panel never mix into stored channels), as torch computes them."""
    x = torch.randn(1, 5, 9, 9)
    x[0, 1, 2, 3], x[0, 4, 8, 8] = float("nan"), float("inf")
    weight, bias = torch.randn(21, 5, 3, 3).abs(), torch.randn(21)
    expected = torch.conv2d(x, weight, bias, 2, padding=1)
    out = torch.full(expected.shape, 0.0).contiguous(memory_format=torch.channels_last)
    _testing.conv(x, weight, bias, [2, 2], [1, 1, 1, 1], [1, 1], 1, out, 2, True)
    assert (out.isnan() == expected.isnan()).all() and (out.isinf() == expected.isinf()).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("x_shape, w_shape, groups, layout", [((1, 8, 6, 6), (8, 4, 1, 1), 2, 3),
                                                               ((1, 8, 6, 6), (8, 8, 1, 1), 1, 0),
                                                               ((1, 8, 6, 6), (8, 8, 3, 3), 1, 0),
                                                               ((1, 288, 12, 12), (16, 288, 3, 3), 1, 3)])
def test_conv_patch_not_taken(x_shape, w_shape, groups, layout):
    """Grouped convolutions, NCHW to NCHW and receptive fields past 2304 values (with more pixels
    than test_conv_patch_deep_few_pixels's) stay the others'."""
    torch.manual_seed(8)
    x, weight = torch.randn(x_shape), torch.randn(w_shape)
    expected = torch.conv2d(x, weight, None, 1, padding=w_shape[2] // 2, groups=groups)
    out = torch.empty(expected.shape).contiguous(memory_format=torch.channels_last if layout & 2 else torch.contiguous_format)
    before = _testing.conv_kernel_calls("patch")
    _testing.conv(x.contiguous(memory_format=torch.channels_last if layout & 1 else torch.contiguous_format), weight,
                  None, [1, 1], [w_shape[2] // 2] * 4, [1, 1], groups, out, layout, True)
    assert _testing.conv_kernel_calls("patch") == before
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


# A 1x1 convolution and the depthwise one that reads its output, computed together
# (expand_depthwise.h: the expanded rows a thread's output rows read, in a buffer of its own, kept
# from one step of rows to the next) against the two runtime convs apart: bitwise the same, with
# NaN and infinities. Strides, dilation, 3x3/5x5/3x5 kernels, TF-style and symmetric pads, channel
# counts off the vector width, steps that cross images (batch 3 of small images), rows of 80 (a few
# rows a buffer), a residual sum, on 1 and 2 threads (a thread's chunks continue its buffer; a
# chunk another thread claims starts its own).
EXPAND_DEPTHWISE_CASES = [  # n, c_in, c_exp, h, w, (kh, kw), stride, dilation, pads
    (1, 16, 96, 80, 80, (3, 3), 2, 1, [0, 0, 1, 1]),
    (1, 24, 144, 40, 40, (3, 3), 1, 1, [1, 1, 1, 1]),
    (3, 8, 36, 7, 9, (3, 3), 1, 1, [1, 1, 1, 1]),
    (2, 5, 20, 11, 6, (5, 5), 2, 1, [2, 2, 2, 2]),
    (1, 12, 40, 17, 23, (3, 5), 1, 2, [2, 4, 1, 3]),
    (2, 3, 17, 9, 30, (3, 3), 2, 1, [1, 0, 0, 1]),
    (1, 32, 192, 20, 20, (3, 3), 1, 1, [0, 0, 0, 0]),
]


@pytest.mark.parametrize("case", EXPAND_DEPTHWISE_CASES,
                         ids=lambda c: f"n{c[0]}-{c[1]}to{c[2]}-{c[3]}x{c[4]}-k{c[5][0]}{c[5][1]}s{c[6]}d{c[7]}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_sum", [False, True])
@pytest.mark.parametrize("activation", [2, 3, 4], ids=["clamp", "silu", "gelu"])
def test_expand_depthwise_together_is_bitwise_apart(case, threads, with_sum, activation):
    n, c_in, c_exp, h, w, (kh, kw), stride, dilation, pads = case
    torch.manual_seed(13)
    x = torch.randn(n, c_in, h, w) * 3
    x[0, 0, 1, 2], x[-1, -1, -1, 0], x[0, -1, 0, -1] = float("nan"), float("inf"), -float("inf")
    x = x.contiguous(memory_format=torch.channels_last)
    w1, b1 = torch.randn(c_exp, c_in, 1, 1) / c_in ** 0.5, torch.randn(c_exp)
    w2, b2 = torch.randn(c_exp, 1, kh, kw) / (kh * kw) ** 0.5, torch.randn(c_exp)
    out_h = (h + pads[0] + pads[2] - dilation * (kh - 1) - 1) // stride + 1
    out_w = (w + pads[1] + pads[3] - dilation * (kw - 1) - 1) // stride + 1
    residual = torch.randn(n, c_exp, out_h, out_w).contiguous(memory_format=torch.channels_last) if with_sum else None
    outputs = []
    with torch_threads(threads):
        for together in (True, False):
            out = torch.full((n, c_exp, out_h, out_w), 7.0).contiguous(memory_format=torch.channels_last)
            for _ in range(2):  # the second call finds the first call's buffers
                _testing.expand_depthwise(x, w1, b1, 0.0, 6.0, w2, b2, [stride] * 2, pads, [dilation] * 2, out,
                                          -1.0, 4.0, together, 1, residual, activation)
            outputs.append(out)
    first, second = ((lambda t: t.clamp(0, 6), lambda t: t.clamp(-1, 4)) if activation == 2
                     else (ACTIVATIONS[activation],) * 2)
    expanded = first(torch.conv2d(x.double(), w1.double(), b1.double()))
    expected = torch.conv2d(torch.nn.functional.pad(expanded, [pads[1], pads[3], pads[0], pads[2]]), w2.double(),
                            b2.double(), stride, 0, dilation, c_exp)
    expected = second(expected + residual.double() if with_sum else expected)
    assert outputs[0].isnan().any()
    assert torch.equal(outputs[0].nan_to_num(123.0), outputs[1].nan_to_num(123.0))
    torch.testing.assert_close(outputs[0].double(), expected, rtol=1e-5, atol=1e-5, equal_nan=True)


# A 1-D convolution runs as a 2-D one of unit height ([n, c, l] is [n, c, 1, l]; channels-last
# [n, l, c] is [n, 1, l, c]), so the 2-D kernels take it: depthwise (Mamba's, ConvBERT's), grouped
# (wav2vec2's positional convolution), patch (an audio feature extractor's strided one), and oneDNN's
# (a computed weight) in the same layouts. Against a float64 conv1d, with bias, residual and ReLU.
@pytest.mark.parametrize("kernel, c_in, c_out, k, stride, dilation, pads, groups, layout, pack", [
    ("depthwise", 32, 32, 4, 1, 1, [3, 0], 32, 3, True), ("grouped", 32, 64, 5, 1, 1, [2, 2], 4, 3, True),
    ("patch", 24, 40, 3, 2, 1, [0, 0], 1, 3, True), ("patch", 1, 40, 10, 5, 1, [0, 0], 1, 2, True),
    ("patch", 16, 24, 3, 1, 2, [2, 2], 1, 3, False), (None, 16, 24, 3, 2, 1, [1, 1], 1, 0, True)])
def test_conv_1d_runs_as_2d_of_unit_height(kernel, c_in, c_out, k, stride, dilation, pads, groups, layout, pack):
    torch.manual_seed(7)
    x, weight, bias = torch.randn(2, c_in, 29), torch.randn(c_out, c_in // groups, k), torch.randn(c_out)
    expected = torch.conv1d(torch.nn.functional.pad(x.double(), pads), weight.double(), bias.double(), stride, 0,
                            dilation, groups)
    lay = lambda t, channels_last: t.transpose(1, 2).contiguous().transpose(1, 2) if channels_last else t.contiguous()
    residual = lay(torch.randn(expected.shape), layout & 2)
    expected = (expected + residual.double()).relu()
    out = lay(torch.full(expected.shape, float("nan")), layout & 2)
    before = _testing.conv_kernel_calls(kernel) if kernel else 0
    _testing.conv(lay(x, layout & 1), weight, bias, [stride], pads, [dilation], groups, out, layout, pack, residual, 1)
    if kernel:
        assert _testing.conv_kernel_calls(kernel) == before + 1
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
