"""Shape and view rules: reshape/view/flatten, permute/transpose, (un)squeeze, expand, slice,
narrow, select, cat/stack/unbind/split, the Tensor[] glue that lives in a cluster with its
producers and consumers, and run-time sizes (aten::size, arange, int arithmetic on sizes)."""
from __future__ import annotations

import numpy as np

from blade.cluster.rules.base import (
    INT64_MAX, NOT_CONSTANT, SIZE_ARITHMETIC_OPS, LowerCtx, LoweringError, Rule, constant_value, is_constant,
    is_nonnegative_size, is_size_value, is_tensor, named_args, node_args, out_dtype, run_time_size_list,
    size_product, static_shape_of)
from blade.cluster.rules.elementwise import identity


def reshape_exact(ctx: LowerCtx, name: str, shape: list) -> str:
    """Reshape to a fully known shape. allowzero: a 0 in it is an empty dim, not ONNX's default
    "copy this dim of the input" (a (0, 3) tensor viewed as (3, 0) would become (3, 3))."""
    return ctx.b.op("Reshape", [name, ctx.b.ints(shape)], allowzero=1)


def reshape_to_output(ctx: LowerCtx, node):
    """view/reshape/flatten/expand-free reshapes: the output's static shape says it all (with
    run-time sizes, ctx.target_shape, else the run-time sizes the view takes)."""
    source = node_args(node)[0]
    try:
        shape, allowzero = ctx.target_shape(node.output(), source)
    except LoweringError:
        if node.kind() in ("aten::view_as", "aten::reshape_as"):  # to the other tensor's run-time shape
            return [ctx.b.op("Reshape", [ctx.tensor(source), ctx.b.op("Shape", [ctx.tensor(node_args(node)[1])])],
                             allowzero=1)]
        if node.kind() in ("aten::flatten", "aten::unflatten"):  # the shape from the source's dims
            return [ctx.b.op("Reshape", [ctx.tensor(source), _regrouped_shape(ctx, node)], allowzero=0)]
        sizes = node_args(node)[1] if len(node_args(node)) > 1 else None
        items = run_time_size_list(sizes)
        if items is None:
            raise
        # a -1 among them is ONNX's inferred dim; the engine takes it only where it proves the
        # element count a multiple of the other dims at every size (ir._reshape)
        return [ctx.b.op("Reshape", [ctx.tensor(source), ctx.sizes(items)], allowzero=0)]
    return [ctx.b.op("Reshape", [ctx.tensor(source), ctx.b.ints(shape)], allowzero=allowzero)]


def _permute(ctx: LowerCtx, node):
    x, dims = node_args(node)[:2]
    rank = len(ctx.shape(x))
    if rank == 0:  # ONNX cannot spell an empty perm attribute
        return identity(ctx, node)
    return [ctx.b.op("Transpose", [ctx.tensor(x)], perm=[d % rank for d in ctx.const(dims)])]


def _transpose(ctx: LowerCtx, node):
    args = node_args(node)
    rank = len(ctx.shape(args[0]))
    if rank == 0:  # t() of a 0-d tensor; ONNX cannot spell an empty perm attribute
        return identity(ctx, node)
    perm = list(range(rank))
    if node.kind() == "aten::t":
        perm = perm[::-1]
    else:
        d0, d1 = ctx.const(args[1]) % rank, ctx.const(args[2]) % rank
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return [ctx.b.op("Transpose", [ctx.tensor(args[0])], perm=perm)]


def _unsqueeze(ctx: LowerCtx, node):
    x, dim = node_args(node)[:2]
    rank = len(ctx.shape(x)) + 1
    return [ctx.b.op("Unsqueeze", [ctx.tensor(x), ctx.b.ints([ctx.const(dim) % rank])])]


def _squeeze(ctx: LowerCtx, node):
    args = node_args(node)
    shape = ctx.shape(args[0])
    if len(args) == 1:
        dims = [d for d, size in enumerate(shape) if size == 1]
    else:
        dims = ctx.const(args[1])
        dims = [dims] if isinstance(dims, int) else dims
        dims = [d % len(shape) for d in dims if shape[d % len(shape)] == 1] if shape else []
    if not dims:
        return [ctx.b.op("Identity", [ctx.tensor(args[0])])]
    return [ctx.b.op("Squeeze", [ctx.tensor(args[0]), ctx.b.ints(dims)])]


def _expand(ctx: LowerCtx, node):
    source = node_args(node)[0]
    try:
        shape = ctx.b.ints(ctx.expand_shape(node.output(), source))
    except LoweringError:
        if node.kind() == "aten::expand_as":  # to the other tensor's run-time shape (its ONNX Shape)
            return [ctx.b.op("Expand", [ctx.tensor(source), ctx.b.op("Shape", [ctx.tensor(node_args(node)[1])])])]
        sizes = run_time_size_list(node_args(node)[1])
        if node.kind() != "aten::expand" or sizes is None:
            raise
        # the run-time sizes expanded to; -1 (keep the source's dim) is 1 to ONNX's broadcast
        items = [1 if is_constant(v) and ctx.const(v) == -1 else v for v in sizes]
        shape = ctx.sizes(items)
    return [ctx.b.op("Expand", [ctx.tensor(source), shape])]


def slice_onnx(ctx: LowerCtx, x: str, dim: int, start, end, step: int = 1) -> str:
    """x[start:end:step] along dim; start and end: ints, or run-time sizes (is_size_value)."""
    return ctx.b.op("Slice", [x, ctx.sizes([start]), ctx.sizes([end]), ctx.b.ints([dim]), ctx.b.ints([step])])


def _slice(ctx: LowerCtx, node):
    x, dim, start, end, step = node_args(node)[:5]
    rank = len(ctx.shape(x))
    start = start if is_size_value(start) else ctx.const(start)
    end = end if is_size_value(end) else ctx.const(end)
    return [slice_onnx(ctx, ctx.tensor(x), ctx.const(dim) % rank, 0 if start is None else start,
                        INT64_MAX if end is None else end, ctx.const(step))]


def _size(ctx: LowerCtx, node):
    """aten::size(x, dim) of a run-time dim: read from x's shape (0-d int64), so ops reading the
    size compute at every size in range."""
    x, dim = node_args(node)
    return [ctx.read_dim(x, ctx.const(dim) % len(ctx.shape(x)))]


def _size_check(node):
    x, dim = (list(node.inputs()) + [None])[:2]
    if dim is None or not is_constant(dim) or not is_tensor(x):
        return "aten::size of all dims (an int list) or of a computed dim"
    return None


def _arange(ctx: LowerCtx, node):
    """arange(end) / arange(start, end[, step]): ONNX Range, its start and end constants or
    run-time sizes (the engine's Range takes them as expressions of its size symbols)."""
    args = named_args(node)
    dtype = out_dtype(node)

    def bound(key: str, default: int) -> str:
        if key not in args or is_constant(args[key]):
            return ctx.scalar(ctx.const(args[key]) if key in args else default, dtype)
        return ctx.cast(ctx.size(args[key]), np.dtype("int64"), dtype)
    return [ctx.b.op("Range", [bound("start", 0), bound("end", 0), bound("step", 1)])]


def _arange_check(node):
    args = named_args(node)
    if "end" not in args:
        return "arange without an end"
    bounds = {key: constant_value(args[key]) if key in args else default
              for key, default in (("start", 0), ("end", 0), ("step", 1))}
    run_time = [key for key, value in bounds.items() if value is NOT_CONSTANT]
    for key in run_time:
        if not is_size_value(args[key]):
            return f"argument %{args[key].debugName()} is not a compile-time constant"
    step = bounds["step"]
    if run_time:  # (the engine proves end >= start over the sizes' ranges, else refuses the sizes)
        if "step" in run_time or type(step) is not int or step <= 0 or \
                any(type(bounds[key]) is not int for key in ("start", "end") if key not in run_time):
            return "arange of run-time sizes by a run-time, non-integer or non-positive step, or from a non-integer"
    elif not all(type(v) is int for v in bounds.values()) or step <= 0 or bounds["end"] < bounds["start"]:
        return "arange with non-integer, decreasing or empty bounds"
    return None


def size_arithmetic(onnx_op: str):
    def lower(ctx: LowerCtx, node):
        a, b = node_args(node)
        return [ctx.b.op(onnx_op, [ctx.size(a), ctx.size(b)])]
    return lower


def _floordiv_check(node):
    a, b = node_args(node)
    if not (is_nonnegative_size(a) and is_nonnegative_size(b, positive=True)):
        return "floordiv of sizes whose operands are not provably non-negative (ONNX Div truncates)"
    return None


def _narrow(ctx: LowerCtx, node):
    x, dim, start, length = node_args(node)[:4]
    rank = len(ctx.shape(x))
    dim = ctx.const(dim) % rank
    begin = ctx.const(start) % ctx.shape(x)[dim] if ctx.shape(x)[dim] else 0
    return [slice_onnx(ctx, ctx.tensor(x), dim, begin, begin + ctx.const(length))]


def _select(ctx: LowerCtx, node):
    x, dim, index = node_args(node)[:3]
    rank = len(ctx.shape(x))
    dim = ctx.const(dim) % rank
    index = ctx.const(index) % ctx.shape(x)[dim]
    sliced = slice_onnx(ctx, ctx.tensor(x), dim, index, index + 1)
    return [ctx.b.op("Squeeze", [sliced, ctx.b.ints([dim])])]


def _cat(ctx: LowerCtx, node):
    tensors, dim = node_args(node)[:2]
    members = list(tensors.node().inputs())
    # torch.cat skips 1-D empty tensors (legacy behaviour that e.g. an empty KV cache relies on)
    kept = [ctx.tensor(v) for v in members if ctx.shape(v) != [0]]
    rank = len(ctx.shape(node.output()))
    if len(kept) == 1:
        return [ctx.b.op("Identity", kept)]
    return [ctx.b.op("Concat", kept, axis=ctx.const(dim) % rank)]


def _split(ctx: LowerCtx, node):
    """split(x, size, dim) / split_with_sizes(x, sizes, dim) / chunk(x, n, dim) -> a list."""
    x, sizes, dim = node_args(node)[:3]
    shape = ctx.shape(x)
    dim = ctx.const(dim) % len(shape)
    extent = shape[dim]
    sizes = ctx.const(sizes)
    if node.kind() == "aten::chunk":  # (an empty dim: torch gives all n chunks, each empty)
        step = -(-extent // sizes) if extent else 1
        sizes = [min(step, extent - b) for b in range(0, extent, step)] or [0] * sizes
    elif isinstance(sizes, int):  # (an empty dim splits into one empty piece)
        sizes = [min(sizes, extent - b) for b in range(0, extent, sizes)] or [extent] if sizes else [extent]
    outputs, begin = [], 0
    for size in sizes:
        outputs.append(slice_onnx(ctx, ctx.tensor(x), dim, begin, begin + size))
        begin += size
    return [outputs]


def _glu(ctx: LowerCtx, node):
    """glu(x, dim): the first half of dim times the sigmoid of the second (Speech2Text's subsampler)."""
    x, dim = node_args(node)[:2]
    shape = ctx.shape(x)
    dim = ctx.const(dim) % len(shape)
    half = shape[dim] // 2
    gate = ctx.b.op("Sigmoid", [slice_onnx(ctx, ctx.tensor(x), dim, half, 2 * half)])
    return [ctx.b.op("Mul", [slice_onnx(ctx, ctx.tensor(x), dim, 0, half), gate])]


def _glu_check(node):
    x, dim = node_args(node)[:2]
    shape, dim = x.type().sizes() if is_tensor(x) else None, constant_value(dim)
    if not shape or not isinstance(dim, int) or not -len(shape) <= dim < len(shape) or shape[dim] is None:
        return "aten::glu over a dim of unknown size"
    if shape[dim] % 2:   # torch raises for it
        return "aten::glu over a dim of odd size"
    return None


def _list_construct(ctx: LowerCtx, node):
    """A Tensor[] (names of its tensors), or a list of run-time sizes (read by its consumer's rule
    from the TorchScript list itself)."""
    return [[ctx.tensor(v) if is_tensor(v) else None for v in node.inputs()]]


def _regrouped_shape(ctx: LowerCtx, node) -> str:
    """flatten(x, start, end) / unflatten(x, dim, sizes) as a shape computed from x's dims (read at
    run time where they are run-time): the dims kept, the product of the merged ones, the sizes a
    dim splits into (one -1 among them is inferred). DeBERTa's [b, h, s, d] -> [b * h, s, d] has
    two run-time dims no single -1 infers."""
    x, rank = node_args(node)[0], len(ctx.shape(node_args(node)[0]))
    dims = [ctx.dim_size(x, d) for d in range(rank)]
    if node.kind() == "aten::flatten":
        start, end = (ctx.const(a) % max(rank, 1) for a in node_args(node)[1:3])
        items = dims[:start] + [size_product(ctx, dims[start:end + 1])] + dims[end + 1:]
    else:
        dim, sizes = ctx.const(node_args(node)[1]) % rank, ctx.const(node_args(node)[2])
        if any(n == 0 for n in sizes):
            raise LoweringError("unflatten into an empty dim with run-time sizes")
        items = dims[:dim] + list(sizes) + dims[dim + 1:]
    return ctx.sizes(items)


def _list_unpack(ctx: LowerCtx, node):
    return list(ctx.names[node_args(node)[0]])


def _list_getitem(ctx: LowerCtx, node):
    items, index = node_args(node)[:2]
    return [ctx.b.op("Identity", [ctx.names[items][ctx.const(index)]])]


def _stack(ctx: LowerCtx, node):
    tensors, dim = node_args(node)[:2]
    rank = len(ctx.shape(node.output()))
    axis = ctx.const(dim) % rank
    parts = [ctx.b.op("Unsqueeze", [ctx.tensor(v), ctx.b.ints([axis])]) for v in tensors.node().inputs()]
    return [ctx.b.op("Concat", parts, axis=axis) if len(parts) > 1 else ctx.b.op("Identity", parts)]


def _unbind(ctx: LowerCtx, node):
    x, dim = node_args(node)[:2]
    shape = ctx.shape(x)
    dim = ctx.const(dim) % len(shape)
    return [[ctx.b.op("Squeeze", [slice_onnx(ctx, ctx.tensor(x), dim, k, k + 1), ctx.b.ints([dim])])
             for k in range(shape[dim])]]


def _unfold(ctx: LowerCtx, node):
    """Tensor.unfold(dim, size, step): the windows x[l * step : l * step + size] along dim, as a
    new last dim (an STFT's frames, UnivNet's overlapping hops). x along dim viewed as blocks of
    `step` (cut, or zero-padded past its end where no window reads); window l is blocks l ..
    l + B - 1 joined (B = ceil(size / step)) and cut to size: B slices of the blocks, concatenated."""
    x, dim, size, step = node_args(node)[:4]
    shape = list(ctx.shape(x))
    dim, size, step = ctx.const(dim) % len(shape), ctx.const(size), ctx.const(step)
    windows, per_window = (shape[dim] - size) // step + 1, -(-size // step)
    blocks = windows + per_window - 1
    v = ctx.tensor(x)
    if blocks * step > shape[dim]:
        pads = [0] * (2 * len(shape))
        pads[len(shape) + dim] = blocks * step - shape[dim]
        v = ctx.b.op("Pad", [v, ctx.b.ints(pads), ctx.scalar(0, ctx.dtype(x))], mode="constant")
    elif blocks * step < shape[dim]:
        v = slice_onnx(ctx, v, dim, 0, blocks * step)
    v = reshape_exact(ctx, v, shape[:dim] + [blocks, step] + shape[dim + 1:])
    joined = [slice_onnx(ctx, v, dim, j, j + windows) for j in range(per_window)]
    v = ctx.b.op("Concat", joined, axis=dim + 1) if per_window > 1 else joined[0]
    if per_window * step != size:
        v = slice_onnx(ctx, v, dim + 1, 0, size)
    last = len(shape)   # the window's dim (dim + 1) moves to the end
    return [v if dim + 1 == last else
            ctx.b.op("Transpose", [v], perm=[d for d in range(last + 1) if d != dim + 1] + [dim + 1])]


def _unfold_check(node):
    x, dim, size, step = node_args(node)[:4]
    shape, (size, step) = static_shape_of(x), (constant_value(size), constant_value(step))
    if not isinstance(size, int) or not isinstance(step, int) or not is_constant(dim):
        return "aten::unfold with run-time window arguments"
    if not shape:
        return "aten::unfold of a 0-d tensor or of one with run-time sizes"
    if size < 1 or step < 1 or size > shape[constant_value(dim) % len(shape)]:
        return "aten::unfold with an empty window, a step below 1 or a window longer than the dim"
    if -(-size // step) > 64:
        return "aten::unfold with windows of more than 64 steps (a slice each)"
    return None


def _cat_check(node):
    producer = node_args(node)[0].node()
    if producer.kind() != "prim::ListConstruct":
        return "aten::cat of a list not built by prim::ListConstruct"
    return None


RULES: dict[str, Rule] = {
    "aten::view": Rule(reshape_to_output, size_args=True),
    "aten::reshape": Rule(reshape_to_output, size_args=True),
    "aten::flatten": Rule(reshape_to_output),
    "aten::unflatten": Rule(reshape_to_output),
    "aten::view_as": Rule(reshape_to_output),
    "aten::reshape_as": Rule(reshape_to_output),
    "aten::permute": Rule(_permute),
    "aten::transpose": Rule(_transpose),
    "aten::t": Rule(_transpose),
    "aten::unsqueeze": Rule(_unsqueeze),
    "aten::squeeze": Rule(_squeeze),
    "aten::expand": Rule(_expand, size_args=True),
    "aten::expand_as": Rule(_expand),
    "aten::contiguous": Rule(identity),
    "aten::clone": Rule(identity),
    "aten::detach": Rule(identity),   # (freezing drops it, unless the graph compares tensors with `is`)
    "aten::slice": Rule(_slice, size_args=True),
    "aten::size": Rule(_size, _size_check),
    "aten::arange": Rule(_arange, _arange_check, size_args=True),
    "aten::narrow": Rule(_narrow),
    "aten::unfold": Rule(_unfold, _unfold_check),
    "aten::select": Rule(_select),
    "aten::cat": Rule(_cat, _cat_check, tensor_lists=True),
    "aten::stack": Rule(_stack, _cat_check, tensor_lists=True),
    "aten::unbind": Rule(_unbind, tensor_lists=True),
    "aten::split": Rule(_split, tensor_lists=True),
    "aten::split_with_sizes": Rule(_split, tensor_lists=True),
    "aten::chunk": Rule(_split, tensor_lists=True),
    "aten::glu": Rule(_glu, _glu_check),
    # Tensor[] glue: lives inside a cluster only together with its producer/consumers
    "prim::ListConstruct": Rule(_list_construct, tensor_lists=True, size_args=True),
    "prim::ListUnpack": Rule(_list_unpack, tensor_lists=True),
    "aten::__getitem__": Rule(_list_getitem, tensor_lists=True),
}

# int arithmetic on run-time sizes (is_size_arithmetic), looked up before the table (support.rule_for)
SIZE_ARITHMETIC: dict[str, Rule] = {
    kind: Rule(size_arithmetic(op), _floordiv_check if kind == "aten::floordiv" else None, size_args=True)
    for kind, op in SIZE_ARITHMETIC_OPS.items()}
