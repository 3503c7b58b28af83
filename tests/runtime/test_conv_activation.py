"""The runtime conv's activation epilogue (blade_abi.h BladeActivation) in each of its kernels:
the fused result must be bit for bit the kernel's unfused result with the engine's Max-then-Min
clamp (or ReLU) applied after, NaN and infinities included."""
import math

import pytest
import torch

from blade._C import _testing

NONE, RELU, CLAMP = 0, 1, 2   # blade_abi.h BLADE_ACTIVATION_*


def engine_clamp(v, lo, hi):
    """optable's Max(v, lo) then Min(v, hi): NaN stays NaN, a tie keeps v."""
    v = torch.where(v.isnan() | (v >= lo), v, torch.tensor(lo))
    return torch.where(v.isnan() | (v <= hi), v, torch.tensor(hi))


# (name, kernel that must compute it or None for oneDNN/ATen, x shape, weight shape, groups, pads, layout, pack)
CONVS = [
    ("patch-1x1", "patch", (2, 24, 5, 7), (40, 24, 1, 1), 1, [0] * 4, 3, True),
    ("patch-3x3-nchw-in", "patch", (2, 5, 7, 6), (21, 5, 3, 3), 1, [1, 0, 1, 1], 2, False),
    ("pointwise-nchw", "pointwise", (2, 16, 6, 5), (40, 16, 1, 1), 1, [0] * 4, 0, True),
    ("depthwise", "depthwise", (1, 150, 10, 10), (150, 1, 3, 3), 150, [1] * 4, 3, True),
    ("depthwise-strided", "depthwise", (1, 40, 9, 9), (40, 1, 3, 3), 40, [0, 0, 1, 1], 3, False),
    ("winograd", "winograd", (1, 64, 12, 12), (64, 64, 3, 3), 1, [1] * 4, 3, True),
    ("patch-3x3", "patch", (1, 16, 9, 9), (16, 16, 3, 3), 1, [1] * 4, 3, True),
    ("onednn-packed", None, (1, 288, 5, 5), (16, 288, 3, 3), 1, [1] * 4, 3, True),
    ("aten-nchw", None, (1, 16, 9, 9), (16, 16, 3, 3), 1, [1] * 4, 0, False),
    ("aten-asymmetric-pads", None, (1, 16, 9, 9), (16, 16, 3, 3), 1, [0, 1, 1, 0], 0, False),
]
ACTIVATIONS = [(RELU, 0.0, 0.0), (CLAMP, 0.0, 6.0), (CLAMP, -0.5, 0.8), (CLAMP, -math.inf, 0.25),
               (CLAMP, 0.5, math.inf)]


def run_conv(case, x, weight, bias, residual, activation):
    _, _, _, _, groups, pads, layout, pack = case
    fmt = lambda t, bit: t.contiguous(memory_format=torch.channels_last if layout & bit else torch.contiguous_format)
    h = (x.shape[2] + pads[0] + pads[2] - weight.shape[2]) + 1
    w = (x.shape[3] + pads[1] + pads[3] - weight.shape[3]) + 1
    out = fmt(torch.full((x.shape[0], weight.shape[0], h, w), float("nan")), 2)
    kind, lo, hi = activation
    _testing.conv(fmt(x, 1), weight, bias, [1, 1], pads, [1, 1], groups, out, layout, pack,
                  None if residual is None else fmt(residual, 2), kind, lo, hi)
    return out


@pytest.mark.parametrize("case", CONVS, ids=[c[0] for c in CONVS])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: f"{a[0]}-{a[1]}-{a[2]}")
@pytest.mark.parametrize("with_sum", [False, True])
def test_conv_activation_is_the_unfused_clamp(case, activation, with_sum):
    torch.manual_seed(6)
    _, kernel, x_shape, w_shape, *_ = case
    x, weight, bias = torch.randn(x_shape) * 4, torch.randn(w_shape) / 3, torch.randn(w_shape[0])
    x[0, 1, 2, 3], x[-1, 2, 4, 1] = float("nan"), float("inf")   # NaN and inf reach several outputs
    out_shape = run_conv(case, x, weight, bias, None, (NONE, 0.0, 0.0)).shape
    residual = torch.randn(out_shape) * 4 if with_sum else None
    if with_sum:
        residual[0, 0, 0, :2] = torch.tensor([float("nan"), -float("inf")])
    before = _testing.conv_kernel_calls(kernel) if kernel else 0
    unfused = run_conv(case, x, weight, bias, residual, (NONE, 0.0, 0.0))
    fused = run_conv(case, x, weight, bias, residual, activation)
    if kernel:
        assert _testing.conv_kernel_calls(kernel) - before == 2
    kind, lo, hi = activation
    expected = engine_clamp(unfused, 0.0, math.inf) if kind == RELU else engine_clamp(unfused, lo, hi)
    assert fused.isnan().any() and (fused.isnan() == expected.isnan()).all()
    torch.testing.assert_close(fused, expected, rtol=0, atol=0, equal_nan=True)


def test_conv_unknown_activation_is_refused():
    x, weight = torch.randn(1, 4, 3, 3), torch.randn(4, 4, 1, 1)
    with pytest.raises(RuntimeError, match="unknown convolution activation"):
        _testing.conv(x, weight, None, [1, 1], [0] * 4, [1, 1], 1, torch.empty(1, 4, 3, 3), 0, False, None, 7)


# Inputs over depthwise.cpp's kPrefetchInputBytes (4 MB) take the path that prefetches the next
# output row's input rows; batch 8 of MobileNetV2-like layers, every kernel width and stride it has.
@pytest.mark.parametrize("kernel_size,stride", [(3, 1), (3, 2), (5, 1), (5, 2)])
def test_depthwise_over_the_prefetch_threshold_matches_torch(kernel_size, stride):
    torch.manual_seed(7)
    x = torch.randn(8, 96, 40, 40).contiguous(memory_format=torch.channels_last)  # 4.9 MB
    weight, bias = torch.randn(96, 1, kernel_size, kernel_size) / 3, torch.randn(96)
    pad = kernel_size // 2
    expected = torch.nn.functional.conv2d(x, weight, bias, stride, pad, 1, 96)
    out = torch.full(expected.shape, float("nan")).contiguous(memory_format=torch.channels_last)
    before = _testing.conv_kernel_calls("depthwise")
    _testing.conv(x, weight, bias, [stride, stride], [pad] * 4, [1, 1], 96, out, 3, True, None, NONE, 0.0, 0.0)
    assert _testing.conv_kernel_calls("depthwise") - before == 1
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
