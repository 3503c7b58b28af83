"""Reduction and normalization rules: sum/mean/amax/prod and their torch argument forms, softmax,
min/max/argmin/argmax with torch's tie and NaN rules, var/std, norms, logsumexp, cumsum, and
layer/batch/group/instance norm."""
from __future__ import annotations

import numpy as np
import torch

from blade.cluster.rules.base import (
    LowerCtx, LoweringError, Rule, constant_value, dims_to_axes, is_constant, is_tensor, named_args,
    needs_const_false, node_args, onnx_type, out_dtype, run_time_size_list)
from blade.cluster.rules.elementwise import binary
from blade.cluster.rules.shapes import reshape_exact


def _reduce_axes(ctx: LowerCtx, node, dim_index: int) -> list[int]:
    args = node_args(node)
    rank = len(ctx.shape(args[0]))
    dims = ctx.const(args[dim_index]) if len(args) > dim_index else None
    if dims is None or dims == []:
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else dims
    return sorted(d % rank if rank else 0 for d in dims)


def reduce(onnx_op: str):
    """sum/mean/amax/amin(x, dim, keepdim, dtype?) -- also the dim-less sum(x, dtype) overload."""
    def lower(ctx: LowerCtx, node):
        args = node_args(node)
        x = ctx.as_dtype(args[0], out_dtype(node))
        if len(args) <= 2 and (len(args) == 1 or not isinstance(constant_value(args[1]), (list, int))):
            axes, keepdims = list(range(len(ctx.shape(args[0])))), 0   # sum(x, dtype=None)
        else:
            axes = _reduce_axes(ctx, node, 1)
            keepdims = int(bool(ctx.const(args[2]))) if len(args) > 2 else 0
        if not axes:  # reducing a 0-d tensor over "all" dims is the identity
            return [ctx.b.op("Identity", [x])]
        return [ctx.b.op(onnx_op, [x, ctx.b.ints(axes)], keepdims=keepdims)]
    return lower


def softmax(onnx_op: str):
    def lower(ctx: LowerCtx, node):
        x, dim = node_args(node)[:2]
        return [ctx.b.op(onnx_op, [ctx.as_dtype(x, out_dtype(node))], axis=ctx.const(dim))]
    return lower


def _layer_norm(ctx: LowerCtx, node):
    x, normalized_shape, weight, bias, eps = node_args(node)[:5]
    dtype = ctx.dtype(x)
    items = run_time_size_list(normalized_shape)
    if items is None:
        norm_shape = ctx.const(normalized_shape)
        ones = np.ones(norm_shape, dtype)
    else:  # x.shape[-k:] over run-time dims: ONNX normalizes over the last k, whatever their sizes
        _check_trailing_dims(ctx, x, items)
        norm_shape, ones = items, np.ones([1] * len(items), dtype)  # (a scale broadcast over them)
    scale = ctx.tensor(weight) if is_tensor(weight) else ctx.b.constant(ones)
    inputs = [ctx.tensor(x), scale] + ([ctx.tensor(bias)] if is_tensor(bias) else [])
    return [ctx.b.op("LayerNormalization", inputs, axis=-len(norm_shape), epsilon=float(ctx.const(eps)))]


def _check_trailing_dims(ctx: LowerCtx, x: torch.Value, items: list) -> None:
    """layer_norm's normalized_shape as a list of sizes must be x's last dims, as eager checks (an
    engine normalizes over the last len(items) dims without looking at the values): each item a
    constant equal to a static dim of x, or the size of a dim that has x's sizes at every probe."""
    shape, first = ctx.shape(x), len(ctx.shape(x)) - len(items)
    for i, item in enumerate(items):
        d = first + i
        static = d >= 0 and d not in ctx.run_time.get(x, {})
        if is_constant(item):
            same = static and ctx.const(item) == shape[d]
        else:
            of, dim = item.node().inputsAt(0), item.node().inputsAt(1)
            dim = ctx.const(dim) % len(ctx.shape(of)) if d >= 0 else None
            same = d >= 0 and item.node().kind() == "aten::size" and (
                ctx.same_run_time_dim(of, dim, x, d) or
                static and dim not in ctx.run_time.get(of, {}) and ctx.shape(of)[dim] == shape[d])
        if not same:
            raise LoweringError(f"layer_norm's normalized_shape item {i} is not provably dim {d} of its input")


def _channel_param(ctx: LowerCtx, value, default: float, rank: int, dtype) -> str:
    """A per-channel [C] parameter (or its default) shaped [C, 1, ...] to broadcast over NC*."""
    name = ctx.tensor(value) if is_tensor(value) else ctx.scalar(default, dtype)
    if is_tensor(value) and rank > 2:
        name = ctx.b.op("Unsqueeze", [name, ctx.b.ints(list(range(1, rank - 1)))])
    return name


def _batch_norm(ctx: LowerCtx, node):
    """Inference batch norm: x * scale + shift, scale = weight / sqrt(var + eps), per channel."""
    x, weight, bias, mean, var = node_args(node)[:5]
    eps = ctx.const(node_args(node)[7])
    rank, dtype = len(ctx.shape(x)), ctx.dtype(x)
    param = lambda v, default: _channel_param(ctx, v, default, rank, dtype)
    inv_std = ctx.b.op("Reciprocal", [ctx.b.op("Sqrt", [ctx.b.op("Add", [param(var, 1.0), ctx.scalar(eps, dtype)])])])
    scale = ctx.b.op("Mul", [param(weight, 1.0), inv_std])
    shift = ctx.b.op("Sub", [param(bias, 0.0), ctx.b.op("Mul", [param(mean, 0.0), scale])])
    return [ctx.b.op("Add", [ctx.b.op("Mul", [ctx.tensor(x), scale]), shift])]


def _normalize(ctx: LowerCtx, x: str, axes: list, eps: float, dtype) -> str:
    """(x - mean) / sqrt(var + eps) over axes (biased variance), the core of every *_norm."""
    mean = ctx.b.op("ReduceMean", [x, ctx.b.ints(axes)], keepdims=1)
    centered = ctx.b.op("Sub", [x, mean])
    var = ctx.b.op("ReduceMean", [ctx.b.op("Mul", [centered, centered]), ctx.b.ints(axes)], keepdims=1)
    return ctx.b.op("Div", [centered, ctx.b.op("Sqrt", [ctx.b.op("Add", [var, ctx.scalar(eps, dtype)])])])


def _affine(ctx: LowerCtx, y: str, weight, bias, rank: int, dtype) -> str:
    if is_tensor(weight):
        y = ctx.b.op("Mul", [y, _channel_param(ctx, weight, 1.0, rank, dtype)])
    if is_tensor(bias):
        y = ctx.b.op("Add", [y, _channel_param(ctx, bias, 0.0, rank, dtype)])
    return y


def _group_norm(ctx: LowerCtx, node):
    x, groups, weight, bias, eps = node_args(node)[:5]
    shape, dtype, eps = ctx.shape(x), ctx.dtype(x), float(ctx.const(eps))
    varying = ctx.run_time.get(x, set())
    if 1 in varying:
        raise LoweringError("group_norm over a run-time channel count")
    # a run-time batch is ONNX's 0 ("copy the input's dim"), run-time spatial dims the -1; back
    # to the input's shape as the engine reads it (Shape)
    batch = 0 if 0 in varying else shape[0]
    groups = ctx.const(groups)
    reshape = (lambda v, to: ctx.b.op("Reshape", [v, ctx.b.ints(to)])) if 0 in varying else \
        (lambda v, to: reshape_exact(ctx, v, to))   # a static 0 is an empty dim, not "copy"
    dims = [batch, groups, shape[1] // groups, *shape[2:]]
    if any(d != 0 for d in varying) or (0 in varying and 0 in shape[2:]):
        # each group's values as one flattened row (run-time spatial dims, or a static empty one
        # beside a run-time batch, which ONNX's 0 would copy)
        y = _normalize(ctx, ctx.b.op("Reshape", [ctx.tensor(x), ctx.b.ints([batch, groups, -1])]), [2], eps, dtype)
    elif groups == 1:
        # the channel dim split, [N, 1, C, *spatial], reduced over its last dims, which the view
        # strides express in any layout x has. Flattened to [N, 1, C * H * W], a channels-last x (a
        # convolution's output) was read across its layout, element by element, and the result
        # written back the same way (PoolFormer-S12's group norms: 9.2 ms of loops in a 24 ms call).
        y = _normalize(ctx, reshape(ctx.tensor(x), dims), list(range(2, len(shape) + 1)), eps, dtype)
    else:
        return [_affine(ctx, _grouped_normalize(ctx, ctx.tensor(x), reshape, shape, dims, eps, dtype), weight, bias,
                        len(shape), dtype)]
    y = ctx.b.op("Reshape", [y, ctx.b.op("Shape", [ctx.tensor(x)])], allowzero=1) if varying else \
        reshape_exact(ctx, y, shape)
    return [_affine(ctx, y, weight, bias, len(shape), dtype)]


def _grouped_normalize(ctx: LowerCtx, x: str, reshape, shape: list, dims: list, eps: float, dtype) -> str:
    """_normalize over each group of channels of x [N, C, *spatial] (dims: [N, G, C / G, *spatial]),
    with statistics per channel: each sum over the spatial dims first (x read as it lies, along
    its channels when channels-last: a global pool), then over the group's channels, and each
    group's mean and deviation computed for each of its channels, a C-float table the engine
    stores (read through a reshape of a broadcast, the loops over channels indexed it c / (C / G)
    and stayed scalar: BiT's max pool after its stem's group norm, 9.8 ms). The elementwise parts
    stay on x's own shape, so no value of x's size is reshaped: over a split [N, G, C / G, *spatial]
    view each group's sum read the whole activation for its few channels (32 groups of 2: 32
    passes), and flattened to [N, G, C / G * H * W] a channels-last x was read across its layout
    (6.7 ms after BiT's stem)."""
    spatial = list(range(2, len(shape)))
    count = ctx.scalar(float(np.prod(dims[2:])), dtype)

    def per_channel(v, finish):   # finish(the group sums of v, one per channel [N, G, C / G, 1, ...]) as [N, C, 1, ...]
        sums = ctx.b.op("ReduceSum", [v, ctx.b.ints(spatial)], keepdims=1) if spatial else v   # (ONNX: [] is all)
        sums = ctx.b.op("ReduceSum", [reshape(sums, [*dims[:3], *[1] * len(spatial)]), ctx.b.ints([2])], keepdims=1)
        table = finish(ctx.b.op("Expand", [sums, ctx.b.ints([1, *dims[1:3], *[1] * len(spatial)])]))
        return reshape(table, [dims[0], shape[1], *[1] * len(spatial)])

    centered = ctx.b.op("Sub", [x, per_channel(x, lambda sums: ctx.b.op("Div", [sums, count]))])
    std = per_channel(ctx.b.op("Mul", [centered, centered]), lambda sums: ctx.b.op(
        "Sqrt", [ctx.b.op("Add", [ctx.b.op("Div", [sums, count]), ctx.scalar(eps, dtype)])]))
    return ctx.b.op("Div", [centered, std])


def _instance_norm(ctx: LowerCtx, node):
    x, weight, bias = node_args(node)[:3]
    shape, dtype = ctx.shape(x), ctx.dtype(x)
    y = _normalize(ctx, ctx.tensor(x), list(range(2, len(shape))), float(ctx.const(node_args(node)[7])), dtype)
    return [_affine(ctx, y, weight, bias, len(shape), dtype)]


def _instance_norm_check(node):
    if constant_value(node_args(node)[5]) is not True:
        return "instance_norm with running statistics (use_input_stats=False)"
    return None


def _cumsum(ctx: LowerCtx, node):
    """cumsum(x, dim): ONNX CumSum (the engine's scan: a running sum along the axis)."""
    x, dim = node_args(node)[:2]
    dtype = out_dtype(node)
    rank = len(ctx.shape(x))
    if rank == 0:
        return [ctx.as_dtype(x, dtype)]
    axis = ctx.b.constant(np.asarray(ctx.const(dim) % rank, dtype=np.int64), "axis")
    return [ctx.b.op("CumSum", [ctx.as_dtype(x, dtype), axis])]


def _var_std(ctx: LowerCtx, node):
    """var/std(x, dim, correction|unbiased, keepdim): mean of squared deviations / (n - correction)."""
    named = named_args(node)
    x = named["self"]
    dtype = out_dtype(node)
    shape = ctx.shape(x)
    axes = dims_to_axes(ctx.const(named["dim"]) if "dim" in named else None, len(shape))
    if "correction" in named:
        correction = ctx.const(named["correction"])
        correction = 1 if correction is None else correction
    else:
        correction = int(ctx.const(named["unbiased"])) if "unbiased" in named else 1
    keepdim = bool(ctx.const(named["keepdim"])) if "keepdim" in named else False
    # in float64, as torch accumulates: float32 squares of deviations above 1.8e19 would overflow
    f64 = np.dtype("float64")
    xs = ctx.as_dtype(x, f64)
    mean = ctx.b.op("ReduceMean", [xs, ctx.b.ints(axes)], keepdims=1)
    centered = ctx.b.op("Sub", [xs, mean])
    total = ctx.b.op("ReduceSum", [ctx.b.op("Mul", [centered, centered]), ctx.b.ints(axes)], keepdims=int(keepdim))
    var = ctx.b.op("Div", [total, _var_divisor(ctx, x, axes, correction)])
    return [ctx.cast(ctx.b.op("Sqrt", [var]) if node.kind() == "aten::std" else var, f64, dtype)]


def _var_divisor(ctx: LowerCtx, x: torch.Value, axes: list, correction) -> str:
    """max(n - correction, 0) in float64, n the count over axes; over run-time dims computed from
    the shape at run time (an integer correction then: the sizes' arithmetic is exact in int64)."""
    f64 = np.dtype("float64")
    if not any(a in ctx.run_time.get(x, set()) for a in axes):
        return ctx.scalar(max(int(np.prod([ctx.shape(x)[a] for a in axes])) - correction, 0), f64)
    if correction != int(correction):
        raise LoweringError(f"a correction of {correction} over run-time dims (only integers are exact on sizes)")
    def as_onnx(size):  # a 0-d int64: a run-time dim's ONNX name as is, an int as a constant
        return size if isinstance(size, str) else ctx.b.constant(np.asarray(size, dtype=np.int64), "n")
    count = as_onnx(ctx.dim_size(x, axes[0]))
    for a in axes[1:]:
        count = ctx.b.op("Mul", [count, as_onnx(ctx.dim_size(x, a))])
    divisor = ctx.b.op("Max", [ctx.b.op("Sub", [count, as_onnx(int(correction))]), as_onnx(0)])
    return ctx.b.op("Cast", [divisor], to=onnx_type(f64))


def _norm(ctx: LowerCtx, node):
    """norm / linalg_vector_norm with p = 2 (sqrt of sum of squares), 1, inf."""
    named = named_args(node)
    x = named.get("self", named.get("input"))
    p = ctx.const(named["p"]) if "p" in named else ctx.const(named["ord"]) if "ord" in named else 2
    p = 2 if p is None else p
    keepdim = int(bool(ctx.const(named["keepdim"]))) if "keepdim" in named else 0
    axes = dims_to_axes(ctx.const(named["dim"]) if "dim" in named else None, len(ctx.shape(x)))
    xs = ctx.b.op("Abs", [ctx.as_dtype(x, out_dtype(node))])
    if p == float("inf"):
        return [ctx.b.op("ReduceMax", [xs, ctx.b.ints(axes)], keepdims=keepdim)]
    if p == 1:
        return [ctx.b.op("ReduceSum", [xs, ctx.b.ints(axes)], keepdims=keepdim)]
    return [ctx.b.op("Sqrt", [ctx.b.op("ReduceSum", [ctx.b.op("Mul", [xs, xs]), ctx.b.ints(axes)], keepdims=keepdim)])]


def _norm_check(node):
    named = named_args(node)
    p = constant_value(named["p"]) if "p" in named else constant_value(named["ord"]) if "ord" in named else 2
    if p not in (None, 1, 2, float("inf")):
        return f"norm with p={p} (1, 2 and inf are supported)"
    if "dtype" in named and constant_value(named["dtype"]) is not None:
        return "norm with a dtype argument"
    return None


def _logsumexp(ctx: LowerCtx, node):
    x, dims, keepdim = node_args(node)[:3]
    axes = dims_to_axes(ctx.const(dims), len(ctx.shape(x)))
    xs = ctx.as_dtype(x, out_dtype(node))
    peak = ctx.b.op("ReduceMax", [xs, ctx.b.ints(axes)], keepdims=1)
    # an infinite peak (an all -inf slice, or a +inf element) shifts by 0 instead, as torch does:
    # -inf - -inf and inf - inf would be NaN where the result is -inf or inf
    safe = ctx.b.op("Where", [ctx.b.op("Equal", [ctx.b.op("Abs", [peak]), ctx.scalar(np.inf, out_dtype(node))]),
                              ctx.scalar(0, out_dtype(node)), peak])
    total = ctx.b.op("ReduceSum", [ctx.b.op("Exp", [ctx.b.op("Sub", [xs, safe])]), ctx.b.ints(axes)], keepdims=1)
    out = ctx.b.op("Add", [ctx.b.op("Log", [total]), safe])
    return [out if ctx.const(keepdim) else ctx.b.op("Squeeze", [out, ctx.b.ints(axes)])]


def _bool_reduce(onnx_op: str):
    """any/all: max/min of the input as bool."""
    def lower(ctx: LowerCtx, node):
        args = node_args(node)
        x = ctx.cast(ctx.tensor(args[0]), ctx.dtype(args[0]), np.dtype(bool))
        x = ctx.b.op("Cast", [x], to=onnx_type(np.dtype("int32")))
        rank = len(ctx.shape(args[0]))
        keepdim = int(bool(ctx.const(args[2]))) if len(args) > 2 else 0
        axes = dims_to_axes(ctx.const(args[1]) if len(args) > 1 else None, rank)
        if not axes:
            return [ctx.cast(x, np.dtype("int32"), np.dtype(bool))]
        out = ctx.b.op(onnx_op, [x, ctx.b.ints(axes)], keepdims=keepdim)
        return [ctx.cast(out, np.dtype("int32"), np.dtype(bool))]
    return lower


def _min_max(onnx_op: str):
    """max(x) / min(x) (all elements), max/min(x, y) (elementwise) and max/min(x, dim, keepdim)
    (values and indices: ONNX ArgMax/ArgMin, which the engine computes with torch's first-index
    and NaN rules)."""
    def lower(ctx: LowerCtx, node):
        args = node_args(node)
        if len(args) == 1:
            return reduce(onnx_op)(ctx, node)
        if is_tensor(args[1]):
            return binary("Max" if onnx_op == "ReduceMax" else "Min")(ctx, node)
        x, dim = ctx.tensor(args[0]), ctx.const(args[1]) % len(ctx.shape(args[0]))
        keepdims = int(bool(ctx.const(args[2]))) if len(args) > 2 else 0
        values = ctx.b.op(onnx_op, [x, ctx.b.ints([dim])], keepdims=keepdims)
        arg_op = "ArgMax" if onnx_op == "ReduceMax" else "ArgMin"
        return [values, ctx.b.op(arg_op, [x], axis=dim, keepdims=keepdims)]
    return lower


def _min_max_check(node):
    args = node_args(node)
    if len(args) >= 2 and not is_tensor(args[1]):
        if not args[0].type().sizes():
            return f"{node.kind()} along a dim of a 0-d tensor"
        if args[0].type().dtype() == torch.bool:
            return f"{node.kind()} along a dim of a bool tensor"
    return None


def _arg_min_max(onnx_op: str):
    """argmax/argmin(x, dim=None, keepdim): over one dim, or over the flattened tensor."""
    def lower(ctx: LowerCtx, node):
        x, dim = node_args(node)[:2]
        keepdims = int(bool(ctx.const(node_args(node)[2]))) if len(node_args(node)) > 2 else 0
        rank = len(ctx.shape(x))
        if ctx.const(dim) is None:
            flat = ctx.b.op("Reshape", [ctx.tensor(x), ctx.b.ints([-1])])
            out = ctx.b.op(onnx_op, [flat], axis=0, keepdims=0)
            return [ctx.b.op("Reshape", [out, ctx.b.ints([1] * rank)]) if keepdims else out]
        return [ctx.b.op(onnx_op, [ctx.tensor(x)], axis=ctx.const(dim) % max(rank, 1), keepdims=keepdims)]
    return lower


def _arg_min_max_check(node):
    x = node_args(node)[0]
    if not x.type().sizes():
        return f"{node.kind()} of a 0-d tensor"
    if x.type().dtype() == torch.bool:
        return f"{node.kind()} of a bool tensor"
    return None


RULES: dict[str, Rule] = {
    "aten::sum": Rule(reduce("ReduceSum")),
    "aten::mean": Rule(reduce("ReduceMean")),
    "aten::amax": Rule(reduce("ReduceMax")),
    "aten::amin": Rule(reduce("ReduceMin")),
    "aten::softmax": Rule(softmax("Softmax")),
    "aten::log_softmax": Rule(softmax("LogSoftmax")),
    "aten::layer_norm": Rule(_layer_norm, size_args=True),
    "aten::prod": Rule(reduce("ReduceProd")),
    "aten::max": Rule(_min_max("ReduceMax"), _min_max_check),
    "aten::min": Rule(_min_max("ReduceMin"), _min_max_check),
    "aten::any": Rule(_bool_reduce("ReduceMax")),
    "aten::all": Rule(_bool_reduce("ReduceMin")),
    "aten::var": Rule(_var_std),
    "aten::std": Rule(_var_std),
    "aten::norm": Rule(_norm, _norm_check),
    "aten::linalg_vector_norm": Rule(_norm, _norm_check),
    "aten::logsumexp": Rule(_logsumexp),
    "aten::cumsum": Rule(_cumsum),
    "aten::argmax": Rule(_arg_min_max("ArgMax"), _arg_min_max_check),
    "aten::argmin": Rule(_arg_min_max("ArgMin"), _arg_min_max_check),
    "aten::batch_norm": Rule(_batch_norm, needs_const_false(5, "batch_norm in training mode")),
    "aten::group_norm": Rule(_group_norm),
    "aten::instance_norm": Rule(_instance_norm, _instance_norm_check),
}
