"""Convolution, pooling, padding and upsampling rules (1-3 spatial dims as torch's ops take them)."""
from __future__ import annotations

import numpy as np
import torch

from blade.cluster.rules.base import (
    INT64_MAX, LowerCtx, Rule, constant_value, is_tensor, named_args, node_args, static_shape_of)
from blade.cluster.rules.shapes import reshape_exact


def _spatial_list(value, spatial: int) -> list:
    value = [value] if isinstance(value, int) else list(value)
    return value * spatial if len(value) == 1 else value


def _conv(ctx: LowerCtx, node):
    """conv1d/2d/3d (padding ints, "same" or "valid") and the generic (_)convolution."""
    args = node_args(node)
    x, w, bias = args[:3]
    if node.kind() in GENERIC_CONVOLUTIONS:
        stride, padding, dilation, groups = (ctx.const(args[i]) for i in (3, 4, 5, 8))
    else:
        stride, padding, dilation, groups = (ctx.const(a) for a in args[3:7])
    w_shape = ctx.shape(w)
    spatial = len(w_shape) - 2
    stride, dilation = _spatial_list(stride, spatial), _spatial_list(dilation, spatial)
    if padding == "valid":
        pads = [0] * 2 * spatial
    elif padding == "same":  # torch puts the odd extra pad at the end
        total = [d * (k - 1) for d, k in zip(dilation, w_shape[2:])]
        pads = [t // 2 for t in total] + [t - t // 2 for t in total]
    else:
        pads = _spatial_list(padding, spatial) * 2
    unbatched = len(ctx.shape(x)) == spatial + 1
    inp = ctx.b.op("Unsqueeze", [ctx.tensor(x), ctx.b.ints([0])]) if unbatched else ctx.tensor(x)
    inputs = [inp, ctx.tensor(w)] + ([ctx.tensor(bias)] if is_tensor(bias) else [])
    out = ctx.b.op("Conv", inputs, strides=stride, pads=pads, dilations=dilation, group=groups)
    return [ctx.b.op("Squeeze", [out, ctx.b.ints([0])]) if unbatched else out]


def _pool_args(ctx: LowerCtx, node, spatial: int):
    args = node_args(node)
    kernel = _spatial_list(ctx.const(args[1]), spatial)
    stride = ctx.const(args[2]) or kernel
    return kernel, _spatial_list(stride, spatial), _spatial_list(ctx.const(args[3]), spatial) * 2


def _max_pool(ctx: LowerCtx, node):
    """max_pool1d/2d(x, kernel, stride, padding, dilation, ceil_mode)."""
    spatial = 1 if node.kind() == "aten::max_pool1d" else 2
    kernel, stride, pads = _pool_args(ctx, node, spatial)
    dilation = _spatial_list(ctx.const(node_args(node)[4]), spatial)
    return [_batched(ctx, node_args(node)[0], spatial, lambda x: ctx.b.op(
        "MaxPool", [x], kernel_shape=kernel, strides=stride, pads=pads, dilations=dilation,
        ceil_mode=int(ctx.const(node_args(node)[5]))))]


def _batched(ctx: LowerCtx, x, spatial: int, pool) -> str:
    """pool(name) of an (N, C, *spatial) input; an unbatched (C, *spatial) one gets a batch dim
    of 1 around it (ONNX's pools read the first two dims as N and C)."""
    if len(ctx.shape(x)) > spatial + 1:
        return pool(ctx.tensor(x))
    out = pool(ctx.b.op("Unsqueeze", [ctx.tensor(x), ctx.b.ints([0])]))
    return ctx.b.op("Squeeze", [out, ctx.b.ints([0])])


def _avg_pool(ctx: LowerCtx, node):
    """avg_pool1d/2d(x, kernel, stride, padding, ceil_mode, count_include_pad[, divisor_override])."""
    spatial = 1 if node.kind() == "aten::avg_pool1d" else 2
    kernel, stride, pads = _pool_args(ctx, node, spatial)
    args = node_args(node)
    return [_batched(ctx, args[0], spatial, lambda x: ctx.b.op(
        "AveragePool", [x], kernel_shape=kernel, strides=stride, pads=pads, ceil_mode=int(ctx.const(args[4])),
        count_include_pad=int(ctx.const(args[5]))))]


def _avg_pool_check(node):
    args = node_args(node)
    if len(args) > 6 and constant_value(args[6]) is not None:
        return "avg_pool with divisor_override"
    return None


def _adaptive_avg_pool(ctx: LowerCtx, node):
    """Output sizes that divide the input: a plain average pool (a global one for size 1)."""
    x = node_args(node)[0]
    spatial = 1 if node.kind().endswith("1d") else 2
    size, out = ctx.shape(x)[-spatial:], ctx.shape(node.output())[-spatial:]
    if all(o == 1 for o in out):
        return [ctx.b.op("ReduceMean", [ctx.tensor(x), ctx.b.ints(list(range(-len(size), 0)))], keepdims=1)]
    kernel = [n // o for n, o in zip(size, out)]
    return [_batched(ctx, x, spatial, lambda name: ctx.b.op("AveragePool", [name], kernel_shape=kernel, strides=kernel))]


def _adaptive_avg_pool_check(node):
    x = node_args(node)[0]
    size = static_shape_of(x)
    out = static_shape_of(node.output())
    if size and out and any(n % o for n, o in zip(size[-2:], out[-2:]) if o):
        return "adaptive_avg_pool with an output size that does not divide the input"
    return None


def _pad(ctx: LowerCtx, node):
    """aten::pad / constant_pad_nd / reflection_pad / replication_pad: torch lists the last dim first."""
    args = node_args(node)
    x = args[0]
    rank = len(ctx.shape(x))
    pad = ctx.const(args[1])
    kind = node.kind()
    mode = {"aten::constant_pad_nd": "constant"}.get(kind) or \
        ("reflect" if "reflection" in kind else "edge" if "replication" in kind else None)
    value = 0.0
    if kind == "aten::pad":
        mode = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}[ctx.const(args[2])]
        value = ctx.const(args[3]) if len(args) > 3 else None
    elif kind == "aten::constant_pad_nd":
        value = ctx.const(args[2])
    begins, ends = [0] * rank, [0] * rank
    for k in range(len(pad) // 2):
        begins[rank - 1 - k], ends[rank - 1 - k] = pad[2 * k], pad[2 * k + 1]
    name = ctx.tensor(x)
    cropped = [d for d in range(rank) if begins[d] < 0 or ends[d] < 0]
    if cropped:   # a negative constant pad crops that side (RWKV's time shift: one row in, one out)
        # ends counted from the end (no size in the ONNX, so run-time sizes take it too)
        name = ctx.b.op("Slice", [name, ctx.b.ints([-min(begins[d], 0) for d in cropped]),
                                  ctx.b.ints([ends[d] if ends[d] < 0 else INT64_MAX for d in cropped]),
                                  ctx.b.ints(cropped)])
        begins, ends = [max(b, 0) for b in begins], [max(e, 0) for e in ends]
    inputs = [name, ctx.b.ints(begins + ends)]
    if mode == "constant":
        inputs.append(ctx.scalar(value or 0, ctx.dtype(x)))
    return [ctx.b.op("Pad", inputs, mode=mode)]


def _conv_check(node):
    if node.output().type().dtype() != torch.float32:
        return "convolution on a dtype other than float32"
    return None


class _NumpyOps:
    """The weight regrouping of _conv_transpose on a constant weight, at compile time."""
    weight = staticmethod(lambda ctx, w: torch.as_tensor(w.toIValue()).detach().numpy())
    reshape = staticmethod(np.reshape)
    pad = staticmethod(lambda x, kept, padded: np.pad(x, [(0, 0)] * kept + [(0, 1)] * padded))
    take = staticmethod(lambda x, index, axis: np.take(x, index, axis=axis))
    transpose = staticmethod(np.transpose)
    finish = staticmethod(lambda ctx, x: ctx.b.constant(np.ascontiguousarray(x), "w"))


class _OnnxOps:
    """The same steps as ONNX ops, for a weight computed at run time."""
    def __init__(self, ctx: LowerCtx):
        self.ctx, self.b = ctx, ctx.b

    def weight(self, ctx, w):
        return ctx.tensor(w)

    def reshape(self, x, shape):
        return self.b.op("Reshape", [x, self.b.ints(list(shape))], allowzero=1)

    def pad(self, x, kept, padded):
        return self.b.op("Pad", [x, self.b.ints([0] * (kept + padded) + [0] * kept + [1] * padded),
                                 self.ctx.scalar(0, np.float32)], mode="constant")

    def take(self, x, index, axis):
        return self.b.op("Gather", [x, self.b.constant(index.astype(np.int64), "index")], axis=axis)

    def transpose(self, x, perm):
        return self.b.op("Transpose", [x], perm=perm)

    def finish(self, ctx, x):
        return x


def _conv_transpose(ctx: LowerCtx, node):
    """conv_transpose1d/2d/3d (and (_)convolution with transposed=True) as one convolution and a
    pixel shuffle: output position u = l * stride + k * dilation (before the padding's crop) is, per
    phase r = u % stride, a stride-1 correlation of the input with the taps k of that phase, so the
    weight regrouped per phase ([C_out * prod(stride), C_in / groups, *taps]: a tap no k lands on is
    0) makes every phase one output channel block of a single convolution; interleaving the phases
    (reshape, transpose, reshape), cropping `padding` (output_padding: zeros past the last tap) and
    adding the bias give the result. Only the multiplies a transposed convolution does, unlike a
    convolution over the input with zeros inserted (stride^spatial times as many)."""
    args = node_args(node)
    x, w, bias = args[:3]
    if node.kind() in GENERIC_CONVOLUTIONS:
        stride, padding, dilation, groups = (ctx.const(args[i]) for i in (3, 4, 5, 8))
    else:   # output_padding (argument 5) shows in the output's shape
        stride, padding, groups, dilation = (ctx.const(args[i]) for i in (3, 4, 6, 7))
    w_shape = ctx.shape(w)   # [C_in, C_out / groups, *kernel]
    spatial = len(w_shape) - 2
    stride, padding, dilation = (_spatial_list(v, spatial) for v in (stride, padding, dilation))
    c_in, c_out = w_shape[0], w_shape[1] * groups
    reach = [d * (k - 1) // s for k, s, d in zip(w_shape[2:], stride, dilation)]   # taps per phase - 1
    # a constant weight is regrouped here, a run-time one by the same steps in the engine
    ops = _NumpyOps() if w.node().kind() == "prim::Constant" else _OnnxOps(ctx)
    phased = ops.pad(ops.reshape(ops.weight(ctx, w), [groups, c_in // groups, c_out // groups, *w_shape[2:]]),
                     3, spatial)
    for t, (k, s, d, a_max) in enumerate(zip(w_shape[2:], stride, dilation, reach)):
        taps = np.full((s, a_max + 1), k)   # [phase, tap] -> kernel index (k: the added zero tap)
        for tap in range(k):
            a, r = divmod(tap * d, s)
            taps[r, a_max - a] = tap
        phased = ops.take(phased, taps, 3 + 2 * t)   # that dim becomes (phase, tap)
    # [g, in, out, s1, j1, s2, j2, ...] -> [g, out, s1, s2, ..., in, j1, j2, ...]
    perm = [0, 2] + [3 + 2 * t for t in range(spatial)] + [1] + [4 + 2 * t for t in range(spatial)]
    phases = int(np.prod(stride))
    regrouped = ops.finish(ctx, ops.reshape(ops.transpose(phased, perm),
                                            [c_out * phases, c_in // groups, *(a + 1 for a in reach)]))
    unbatched = len(ctx.shape(x)) == spatial + 1
    inp = ctx.b.op("Unsqueeze", [ctx.tensor(x), ctx.b.ints([0])]) if unbatched else ctx.tensor(x)
    z = ctx.b.op("Conv", [inp, regrouped], strides=[1] * spatial, pads=reach * 2,
                 dilations=[1] * spatial, group=groups)
    n, lengths = 1 if unbatched else ctx.shape(x)[0], ctx.shape(x)[-spatial:]
    cells = [length + a for length, a in zip(lengths, reach)]   # z's positions per phase
    z = reshape_exact(ctx, z, [n, c_out, *stride, *cells])
    z = ctx.b.op("Transpose", [z], perm=[0, 1] + [p for t in range(spatial) for p in (2 + spatial + t, 2 + t)])
    full = [q * s for q, s in zip(cells, stride)]
    z = reshape_exact(ctx, z, [n, c_out, *full])
    out = ctx.shape(node.output())[-spatial:]
    ends = [min(p + o, f) for p, o, f in zip(padding, out, full)]
    z = ctx.b.op("Slice", [z, ctx.b.ints(padding), ctx.b.ints(ends), ctx.b.ints(list(range(2, 2 + spatial)))])
    short = [p + o - e for p, o, e in zip(padding, out, ends)]   # output_padding past the last tap
    if any(short):
        z = ctx.b.op("Pad", [z, ctx.b.ints([0] * (2 + spatial) + [0, 0] + short), ctx.scalar(0, np.float32)],
                     mode="constant")
    if is_tensor(bias):
        z = ctx.b.op("Add", [z, reshape_exact(ctx, ctx.tensor(bias), [c_out] + [1] * spatial)])
    return [ctx.b.op("Squeeze", [z, ctx.b.ints([0])]) if unbatched else z]


def _conv_transpose_check(node):
    args = node_args(node)
    refused = _conv_check(node)
    if refused is None and any(static_shape_of(v) is None for v in (args[0], args[1], node.output())):
        refused = "transposed convolution of a tensor with run-time sizes"
    return refused


GENERIC_CONVOLUTIONS = ("aten::convolution", "aten::_convolution")   # transposed or not: argument 6


def _transposed(node) -> bool:
    return node.kind().startswith("aten::conv_transpose") or (
        node.kind() in GENERIC_CONVOLUTIONS and constant_value(node_args(node)[6]) is True)


def _any_conv(ctx: LowerCtx, node):
    return (_conv_transpose if _transposed(node) else _conv)(ctx, node)


def _any_conv_check(node):
    if node.kind() in GENERIC_CONVOLUTIONS and constant_value(node_args(node)[6]) not in (True, False):
        return "convolution whose transposed flag is computed at run time"
    return (_conv_transpose_check if _transposed(node) else _conv_check)(node)

def _pad_check(node):
    args = node_args(node)
    pad = constant_value(args[1])
    constant = node.kind() == "aten::constant_pad_nd" or (node.kind() == "aten::pad" and constant_value(args[2]) == "constant")
    if isinstance(pad, list) and any(p < 0 for p in pad) and not constant:
        return "reflect or replicate pad with negative (cropping) amounts"
    sizes = args[0].type().sizes() if isinstance(pad, list) and any(p < 0 for p in pad) else None
    if sizes is not None and any(n is not None and n + min(pad[2 * k], 0) + min(pad[2 * k + 1], 0) < 0
                                 for k, n in enumerate(reversed(sizes[-(len(pad) // 2):]))):
        return "pad cropping more than a dim has"
    if node.kind() == "aten::pad" and constant_value(args[2]) not in ("constant", "reflect", "replicate"):
        return f"pad mode {constant_value(args[2])!r}"
    return None


def _upsample(ctx: LowerCtx, node):
    """upsample_nearest1d/2d and upsample_(bi)linear1d/2d, as torch computes source positions."""
    named = named_args(node)
    x = named["input"] if "input" in named else named["self"]
    shape, out_shape = ctx.shape(x), ctx.shape(node.output())
    dtype = ctx.dtype(x)
    align = bool(ctx.const(named["align_corners"])) if "align_corners" in named else False
    spatial = len(shape) - 2
    factors = _resize_factors(ctx, named, spatial)
    name = ctx.tensor(x)
    for k in reversed(range(spatial)):   # the last axis first, as torch's kernel nests its sums
        axis, n_in, n_out = 2 + k, shape[2 + k], out_shape[2 + k]
        scale = 1.0 / factors[k] if factors[k] else n_in / n_out
        dst = np.arange(n_out, dtype=np.float64)
        if "nearest" in node.kind():
            index = np.minimum(np.floor(dst * np.float32(scale)).astype(np.int64), n_in - 1)
            name = ctx.b.op("Gather", [name, ctx.b.constant(index, "index")], axis=axis)
            continue
        low, high, weight = _linear_taps(n_in, n_out, factors[k], align, dtype)
        weight = weight.reshape([n_out] + [1] * (spatial - 1 - k))
        gathered = [ctx.b.op("Gather", [name, ctx.b.constant(i, "index")], axis=axis) for i in (low, high)]
        name = ctx.b.op("Add", [ctx.b.op("Mul", [gathered[0], ctx.b.constant(1 - weight, "w")]),
                                ctx.b.op("Mul", [gathered[1], ctx.b.constant(weight, "w")])])
    return [name]


def _im2col(ctx: LowerCtx, node):
    """F.unfold: [N, C, H, W] -> [N, C * kh * kw, L], column l holding the kernel's taps at output
    position l over the zero-padded input: each tap's strided slice, [N, C, out_h, out_w], stacked
    after C and the result viewed as columns (MobileViTV2 unfolds 2x2 patches)."""
    x, kernel, dilation, padding, stride = node_args(node)[:5]
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = (ctx.const(a) for a in (kernel, dilation, padding, stride))
    shape = ctx.shape(x)
    batched = len(shape) == 4
    n, c, h, w = shape if batched else [1, *shape]
    v = ctx.tensor(x) if batched else ctx.b.op("Unsqueeze", [ctx.tensor(x), ctx.b.ints([0])])
    if ph or pw:
        v = ctx.b.op("Pad", [v, ctx.b.ints([0, 0, ph, pw, 0, 0, ph, pw]), ctx.scalar(0, ctx.dtype(x))], mode="constant")
    out_h, out_w = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    taps = [ctx.b.op("Unsqueeze", [ctx.b.op("Slice", [
        v, ctx.b.ints([i * dh, j * dw]), ctx.b.ints([i * dh + sh * (out_h - 1) + 1, j * dw + sw * (out_w - 1) + 1]),
        ctx.b.ints([2, 3]), ctx.b.ints([sh, sw])]), ctx.b.ints([2])]) for i in range(kh) for j in range(kw)]
    stacked = ctx.b.op("Concat", taps, axis=2) if len(taps) > 1 else taps[0]
    columns = ctx.b.op("Reshape", [stacked, ctx.b.ints([n, c * kh * kw, out_h * out_w])], allowzero=1)
    return [columns if batched else ctx.b.op("Squeeze", [columns, ctx.b.ints([0])])]


def _col2im(ctx: LowerCtx, node):
    """F.fold of windows that do not overlap (stride = kernel, no dilation: _col2im_check): each
    output pixel comes from one column, so [N, C * kh * kw, out_h * out_w] is a permutation of the
    padded image's blocks, cropped by the padding (pixels no window covers are 0)."""
    x, size, kernel, dilation, padding, stride = node_args(node)[:6]
    (height, width), (kh, kw), (ph, pw) = (ctx.const(a) for a in (size, kernel, padding))
    shape = ctx.shape(x)
    batched = len(shape) == 3
    n = shape[0] if batched else 1
    c = shape[-2] // (kh * kw)
    out_h, out_w = (height + 2 * ph - kh) // kh + 1, (width + 2 * pw - kw) // kw + 1
    blocks = ctx.b.op("Reshape", [ctx.tensor(x), ctx.b.ints([n, c, kh, kw, out_h, out_w])], allowzero=1)
    image = ctx.b.op("Reshape", [ctx.b.op("Transpose", [blocks], perm=[0, 1, 4, 2, 5, 3]),
                                 ctx.b.ints([n, c, out_h * kh, out_w * kw])], allowzero=1)
    short_h, short_w = height + ph - out_h * kh, width + pw - out_w * kw   # rows/columns past the last window
    if short_h > 0 or short_w > 0:
        image = ctx.b.op("Pad", [image, ctx.b.ints([0, 0, 0, 0, 0, 0, max(short_h, 0), max(short_w, 0)]),
                                 ctx.scalar(0, ctx.dtype(x))], mode="constant")
    image = ctx.b.op("Slice", [image, ctx.b.ints([ph, pw]), ctx.b.ints([ph + height, pw + width]), ctx.b.ints([2, 3])])
    return [image if batched else ctx.b.op("Squeeze", [image, ctx.b.ints([0])])]


def _im2col_check(node):
    args = [constant_value(a) for a in node_args(node)[1:5]]
    if not all(isinstance(a, list) and len(a) == 2 for a in args):
        return "aten::im2col with run-time window arguments"
    if static_shape_of(node_args(node)[0]) is None:
        return "aten::im2col of a tensor with run-time sizes"
    if args[0][0] * args[0][1] > 64:
        return "aten::im2col with more than 64 kernel taps"
    return None


def _col2im_check(node):
    size, kernel, dilation, padding, stride = (constant_value(a) for a in node_args(node)[1:6])
    if not all(isinstance(a, list) and len(a) == 2 for a in (size, kernel, dilation, padding, stride)):
        return "aten::col2im with run-time window arguments"
    if static_shape_of(node_args(node)[0]) is None:
        return "aten::col2im of a tensor with run-time sizes"
    if stride != kernel or dilation != [1, 1]:
        return "aten::col2im with overlapping or dilated windows (only stride = kernel folds as a permutation)"
    return None


# The scale arguments of the overloads with an output size, per spatial axis (scripted F.interpolate
# calls these with the scale_factor the user gave).
RESIZE_SCALE_ARGS = {1: ("scales",), 2: ("scales_h", "scales_w"), 3: ("scales_d", "scales_h", "scales_w")}


def _resize_factors(ctx: LowerCtx, named: dict, spatial: int) -> list:
    """Per spatial axis the scale factor torch's kernel takes its source positions from (output over
    input), or None where it takes them from the sizes: the given factor wins over the sizes' ratio
    (a scale of 1.7 resizes 243 to 413, and 1/1.7 is not 243/413)."""
    if "scale_factors" in named:
        given = ctx.const(named["scale_factors"])
        return list(given) if given else [None] * spatial
    given = [ctx.const(named[arg]) if arg in named else None for arg in RESIZE_SCALE_ARGS[spatial]]
    return [f if f is not None and f > 0 else None for f in given]


def _linear_taps(n_in: int, n_out: int, factor, align: bool, dtype):
    """(low, high, weight of high) per output position of a linear resize, in the arithmetic of
    torch's CPU kernel: positions and weights in the input's float type (float32 positions of a
    large resize differ from exact ones by more than the tolerance of the result)."""
    real = np.dtype(dtype).type
    dst = np.arange(n_out).astype(real)
    if align:
        src = dst * (real(n_in - 1) / real(n_out - 1) if n_out > 1 else real(0))
    else:
        scale = real(1.0 / factor) if factor else real(n_in) / real(n_out)
        # one rounding of the exact scale * (dst + 0.5) - 0.5: the fused multiply-add torch's build does
        src = np.maximum((np.float64(scale) * (dst + real(0.5)).astype(np.float64) - 0.5).astype(real), real(0))
    low = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    weight = np.clip(src - low.astype(real), real(0), real(1))
    return low, np.minimum(low + 1, n_in - 1), weight


RULES: dict[str, Rule] = {
    **{kind: Rule(_any_conv, _any_conv_check) for kind in (
        "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::conv_transpose1d", "aten::conv_transpose2d",
        "aten::conv_transpose3d", *GENERIC_CONVOLUTIONS)},
    "aten::max_pool1d": Rule(_max_pool),
    "aten::max_pool2d": Rule(_max_pool),
    "aten::avg_pool1d": Rule(_avg_pool, _avg_pool_check),
    "aten::avg_pool2d": Rule(_avg_pool, _avg_pool_check),
    "aten::adaptive_avg_pool1d": Rule(_adaptive_avg_pool, _adaptive_avg_pool_check),
    "aten::adaptive_avg_pool2d": Rule(_adaptive_avg_pool, _adaptive_avg_pool_check),
    "aten::im2col": Rule(_im2col, _im2col_check),
    "aten::col2im": Rule(_col2im, _col2im_check),
    **{kind: Rule(_pad, _pad_check) for kind in (
        "aten::pad", "aten::constant_pad_nd", "aten::reflection_pad1d", "aten::reflection_pad2d",
        "aten::replication_pad1d", "aten::replication_pad2d")},
    **{kind: Rule(_upsample) for kind in ("aten::upsample_nearest1d", "aten::upsample_nearest2d",
                                          "aten::upsample_linear1d", "aten::upsample_bilinear2d")},
}
