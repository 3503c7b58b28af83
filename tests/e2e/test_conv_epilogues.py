"""Activations after convolutions (ReLU6, hardtanh, clamp) computed in the convolution's own
output pass, through tt_infer against eager, with NaN and infinities in the input: every runtime
kernel (patch: 1x1 and 3x3 as register-tiled GEMMs, depthwise, grouped, Winograd, oneDNN) in
channels-last and NCHW."""
import pytest
import torch
import torch.nn.functional as F

from blade._C import _testing
from blade_testing import Capture

KERNELS = ("patch", "depthwise", "winograd")


class InvertedResidual(torch.nn.Module):
    """MobileNetV2's block (1x1 expand, depthwise 3x3, 1x1 project, residual), then a 3x3 conv with
    64 channels each way (Winograd) and a 16-channel one (patch), each with its activation; the last
    convolution feeds no convolution, so it writes NCHW from a channels-last input (oneDNN)."""

    def __init__(self, act):
        super().__init__()
        self.act = act
        self.expand, self.depthwise = torch.nn.Conv2d(16, 64, 1), torch.nn.Conv2d(64, 64, 3, padding=1, groups=64)
        self.project, self.wide = torch.nn.Conv2d(64, 16, 1), torch.nn.Conv2d(16, 64, 1)
        self.winograd, self.general = torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.Conv2d(64, 16, 3, padding=1)
        self.head = torch.nn.Conv2d(16, 8, 1)

    def forward(self, x):
        y = self.act(self.depthwise(self.act(self.expand(x))))
        y = self.project(y) + x
        y = self.act(self.general(self.act(self.winograd(self.act(self.wide(y))))))
        return self.act(self.head(y))


ACTIVATIONS = {
    "relu6": F.relu6,
    "hardtanh": lambda x: F.hardtanh(x, -0.5, 0.8),
    "clamp-min": lambda x: torch.clamp(x, min=0.25),
    "clamp-max": lambda x: torch.clamp(x, max=1.5),
    "relu": F.relu,
}


@pytest.mark.parametrize("size", [(12, 10), (24, 20)], ids=["12x10", "24x20"])  # 24x20: Winograd's 4x4 tiles would take it
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_epilogues_match_eager_with_nan_and_inf(name, size):
    torch.manual_seed(0)
    model = InvertedResidual(ACTIVATIONS[name]).eval()
    x = torch.randn(2, 16, *size) * 3
    x[0, 3, 4, 5], x[1, 7, 0, 0], x[1, 2, 9, 9] = float("nan"), float("inf"), -float("inf")
    calls = {k: _testing.conv_kernel_calls(k) for k in KERNELS}
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend=Capture())(x)
    assert {k: _testing.conv_kernel_calls(k) > calls[k] for k in KERNELS} == dict.fromkeys(KERNELS, True)
    assert expected.isnan().any() and (actual.isnan() == expected.isnan()).all()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, equal_nan=True)


class ExpandThenDepthwise(torch.nn.Module):
    """MobileNetV2's expansion and depthwise convolution with ReLU6 at a size where the runtime
    computes the two together (an expanded tensor of 1.2 MB: conv_pair), after a stem convolution
    (so the expansion reads a channels-last input), optionally also returning the expanded value,
    which then must be stored (no pair)."""

    def __init__(self, stride, also_expanded):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.expand = torch.nn.Conv2d(16, 96, 1)
        self.depthwise = torch.nn.Conv2d(96, 96, 3, stride=stride, padding=1, groups=96)
        self.project = torch.nn.Conv2d(96, 24, 1)
        self.also_expanded = also_expanded

    def forward(self, x):
        expanded = F.relu6(self.expand(F.relu6(self.stem(x))))
        y = self.project(F.relu6(self.depthwise(expanded)))
        return (y, expanded) if self.also_expanded else y


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("also_expanded", [False, True])
def test_expand_depthwise_pair_matches_eager_and_apart(stride, also_expanded):
    torch.manual_seed(1)
    model = ExpandThenDepthwise(stride, also_expanded).eval()
    x = torch.randn(2, 3, 40, 40) * 3
    x[0, 1, 4, 5], x[1, 2, 0, 0] = float("nan"), float("inf")
    results, together = [], []
    try:
        for enabled in (True, False):
            _testing.set_conv_kernel_enabled("expand_depthwise", enabled)
            before = _testing.conv_kernel_calls("expand_depthwise")
            torch._dynamo.reset()
            with torch.no_grad():
                results.append(torch.compile(model, backend=Capture())(x))
            together.append(_testing.conv_kernel_calls("expand_depthwise") - before)
    finally:
        _testing.set_conv_kernel_enabled("expand_depthwise", True)
    assert together == [0 if also_expanded else 1, 0]
    with torch.no_grad():
        expected = model(x)
    for actual in results:
        for a, e in zip(*(torch.utils._pytree.tree_leaves(v) for v in (actual, expected))):
            assert e.isnan().any() and (a.isnan() == e.isnan()).all()
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, equal_nan=True)
    for a, b in zip(*(torch.utils._pytree.tree_leaves(v) for v in results)):
        assert torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0))  # together is bitwise apart


class GroupedBottleneck(torch.nn.Module):
    """RegNet-Y's block: 1x1, a grouped 3x3 (stride 2) with ReLU, squeeze-and-excitation, 1x1, plus
    a strided 1x1 shortcut; after a stem convolution, so the grouped one reads and writes
    channels-last (the grouped kernel). Groups of 4 are ResNeXt 32x4d's first stage's."""

    def __init__(self, width=48, group_width=8):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 32, 3, padding=1)
        self.reduce = torch.nn.Conv2d(32, width, 1)
        self.grouped = torch.nn.Conv2d(width, width, 3, stride=2, padding=1, groups=width // group_width)
        self.squeeze, self.excite = torch.nn.Conv2d(width, 8, 1), torch.nn.Conv2d(8, width, 1)
        self.expand, self.shortcut = torch.nn.Conv2d(width, 64, 1), torch.nn.Conv2d(32, 64, 1, stride=2)

    def forward(self, x):
        x = F.relu(self.stem(x))
        y = F.relu(self.grouped(F.relu(self.reduce(x))))
        y = y * torch.sigmoid(self.excite(F.relu(self.squeeze(y.mean((2, 3), keepdim=True)))))
        return F.relu(self.expand(y) + self.shortcut(x))


@pytest.mark.parametrize("group_width", [4, 8, 16, 24])
def test_grouped_block_matches_eager(group_width):
    torch.manual_seed(2)
    model = GroupedBottleneck(48, group_width).eval()
    x = torch.randn(2, 3, 20, 18) * 3
    x[0, 1, 4, 5], x[1, 2, 0, 0] = float("nan"), float("inf")
    before = _testing.conv_kernel_calls("grouped")
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend=Capture())(x)
    assert _testing.conv_kernel_calls("grouped") == before + 1
    assert expected.isnan().any() and (actual.isnan() == expected.isnan()).all()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, equal_nan=True)


class DownsampleFewPixels(torch.nn.Module):
    """ResNet's last downsampling block in small, after a 1x1 convolution (so that the block reads
    a channels-last input): 36 output pixels, so each thread gathers them all and computes a share
    of the weight's panels (cpp/conv_patch.cpp few_gathered_pixels): the 3x3 stride-2 convolution
    at depth 4608 (past 2304: the patch kernel's where its 590 KB panels fit half the L2, oneDNN's
    elsewhere), the 1x1 stride-2 shortcut, and the second 3x3."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(32, 512, 1)
        self.conv1 = torch.nn.Conv2d(512, 64, 3, stride=2, padding=1)
        self.shortcut = torch.nn.Conv2d(512, 64, 1, stride=2)
        self.conv2 = torch.nn.Conv2d(64, 64, 3, padding=1)

    def forward(self, x):
        x = F.relu(self.stem(x))
        return F.relu(self.conv2(F.relu(self.conv1(x))) + self.shortcut(x))


@pytest.mark.parametrize("threads", [1, 2])
def test_few_pixel_convolutions_match_eager(threads):
    torch.manual_seed(3)
    model = DownsampleFewPixels().eval()
    x = torch.randn(1, 32, 12, 12)
    x[0, 5, 4, 5], x[0, 30, 0, 0] = float("nan"), float("inf")
    before, saved = _testing.conv_kernel_calls("patch"), torch.get_num_threads()
    torch.set_num_threads(threads)
    _testing.set_l2_cache_bytes(2 << 20)  # conv1's 590 KB panels fit half of it on any CPU
    try:
        with torch.no_grad():
            expected = model(x)
            _testing.force_serial_for(0)
            actual = torch.compile(model, backend=Capture())(x)
    finally:
        torch.set_num_threads(saved)
        _testing.set_l2_cache_bytes(-1)
    assert _testing.conv_kernel_calls("patch") == before + 4  # the stem, conv1, the shortcut, conv2
    assert expected.isnan().any() and (actual.isnan() == expected.isnan()).all()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("groups", [1, 8, 32])
def test_group_norms_between_convolutions_read_along_the_channels(tmp_path, groups):
    """BiT's stem (conv, group norm, ReLU, max pool, conv): the norm's statistics are sums over the
    spatial dims per channel, [1, C, 1, 1], read along the channels of the channels-last conv
    output, then over each group's channels (several groups; one group reduces its split view), and
    nothing is stored flattened as [1, G, C / G * H * W] rows (read across the layout, 6.7 ms, and a
    pool reading that NCHW result, 6.9 ms, in BiT)."""
    from blade_testing import compile_and_check
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.GroupNorm(groups, 32),
                                torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2), torch.nn.Conv2d(32, 16, 1)).eval()
    compile_and_check(model, [torch.randn(1, 16, 20, 20)], dump_dir=str(tmp_path))
    plan = (tmp_path / "cluster_0" / "plan.txt").read_text()
    reduces = [line for line in plan.splitlines() if " = reduce sum over " in line]
    assert not any(f"[1, {groups}, {32 // groups * 400}]" in line for line in plan.splitlines()), plan
    if groups > 1:
        assert sum("= reduce sum over [2, 3](" in line and "[1, 32, 1, 1] float32" in line for line in reduces) == 2, plan
    assert "= conv(" in plan and "channels-last" in plan.split("= reduce max over")[1].split("\n")[0], plan
