"""Indexing and data-movement rules: embedding, index, index_select, gather (indices range-checked
at run time), tril/triu, repeat, repeat_interleave, roll, flip and diff."""
from __future__ import annotations

import numpy as np
import torch

from blade.cluster.rules.base import (
    INT64_MAX, NOT_CONSTANT, LowerCtx, LoweringError, Rule, constant_value, int64_size, is_constant, is_tensor,
    needs_const_false, node_args, out_dtype, run_time_size_list, size_product, static_shape_of)
from blade.cluster.rules.shapes import reshape_exact, slice_onnx


def _diff(ctx: LowerCtx, node):
    """diff(x, n, dim, prepend, append): prepend and append joined to x along dim, then n times the
    neighbours' difference x[1:] - x[:-1] (!= for bools, as torch)."""
    x, n, dim, prepend, append = node_args(node)[:5]
    dtype, axis = out_dtype(node), ctx.const(dim) % len(ctx.shape(x))
    parts = [ctx.as_dtype(v, dtype) for v in (prepend, x, append) if is_tensor(v)]
    out = parts[0] if len(parts) == 1 else ctx.b.op("Concat", parts, axis=axis)
    for _ in range(ctx.const(n)):
        later, earlier = slice_onnx(ctx, out, axis, 1, INT64_MAX), slice_onnx(ctx, out, axis, 0, -1)
        out = ctx.b.op("Xor" if dtype == np.bool_ else "Sub", [later, earlier])
    return [out if out != ctx.tensor(x) else ctx.b.op("Identity", [out])]


def _diff_check(node):
    x, n, _, prepend, append = node_args(node)[:5]
    if not is_constant(n) or constant_value(n) < 0:
        return "aten::diff with a run-time or negative n"
    if any(is_tensor(v) and v.type().dim() != x.type().dim() for v in (prepend, append)):
        return "aten::diff with a prepend/append of another rank than the input (a 0-d one is expanded)"
    return None


def _embedding(ctx: LowerCtx, node):
    weight, indices = node_args(node)[:2]
    rows = ctx.shape(weight)[0]
    ids = _index_in_range(ctx, _int64(ctx, indices), rows, wraps=False, past_end=rows)
    return [ctx.b.op("Gather", [ctx.tensor(weight), ids], axis=0)]


def _index_tensors(ctx: LowerCtx, value) -> list:
    """The entries of an index list: ONNX names of index tensors (int64), None for `:`."""
    if value in ctx.names:
        return [None if name is None else ctx.cast(name, ctx.dtype(v), np.dtype("int64"))
                for name, v in zip(ctx.names[value], value.node().inputs())]
    return [None if t is None else ctx.b.constant(t.to(torch.int64).numpy(), "index") for t in ctx.const(value)]


def _index(ctx: LowerCtx, node):
    """x[..., i, j, ...] with integer index tensors on adjacent dims: one Gather along the
    flattened indexed dims, at the linear index sum(i_k * stride_k) (negatives wrapped first).
    Run-time dims of x (the padding mask ``mask[batch_idx, kv_idx]``) are read from its shape."""
    x, index_list = node_args(node)[:2]
    rank = len(ctx.shape(x))
    size = [ctx.dim_size(x, d) for d in range(rank)]  # ints, or ONNX sizes for run-time dims
    entries = _index_tensors(ctx, index_list)
    dims = [d for d, e in enumerate(entries) if e is not None]
    first, last = dims[0], dims[-1] + 1
    linear, stride = None, 1
    extent = size_product(ctx, [size[d] for d in dims])  # of the flattened dims the Gather reads
    for d in reversed(dims):
        i = _index_in_range(ctx, entries[d], size[d], wraps=True, past_end=extent)
        term = i if isinstance(stride, int) and stride == 1 else ctx.b.op("Mul", [i, int64_size(ctx, stride)])
        linear = term if linear is None else ctx.b.op("Add", [linear, term])
        stride = size_product(ctx, [stride, size[d]])
    target = size[:first] + [stride] + size[last:]
    flat = reshape_exact(ctx, ctx.tensor(x), target) if all(isinstance(n, int) for n in target) else \
        ctx.b.op("Reshape", [ctx.tensor(x), ctx.sizes(target)], allowzero=1)
    return [ctx.b.op("Gather", [flat, linear], axis=first)]


def _index_check(node):
    entries = node_args(node)[1]
    if entries.node().kind() == "prim::ListConstruct":
        items = [v if is_tensor(v) else None for v in entries.node().inputs()]
        dtypes = [v.type().dtype() for v in items if v is not None]
    else:
        items = constant_value(entries)
        if items is NOT_CONSTANT:
            return "aten::index with an index list built at run time"
        dtypes = [t.dtype for t in items if t is not None]
    dims = [d for d, item in enumerate(items) if item is not None]
    if any(dt not in (torch.int64, torch.int32) for dt in dtypes):
        return "aten::index with bool (mask) indices: the output shape depends on the data"
    if not dims or dims != list(range(dims[0], dims[-1] + 1)):
        return "aten::index with index tensors on non-adjacent dims"
    return None


def _wrap_negative(ctx: LowerCtx, index: str, n) -> str:
    """index + n where index < 0 (torch's negative indexing), on an int64 ONNX value."""
    size = int64_size(ctx, n)
    return ctx.b.op("Where", [ctx.b.op("Less", [index, ctx.scalar(0, np.int64)]), ctx.b.op("Add", [index, size]), index])


def _index_in_range(ctx: LowerCtx, index: str, n: int, *, wraps: bool, past_end: int) -> str:
    """An int64 index into a dim of size n, read as eager reads it: negatives count from the end
    only where the op allows that (aten::index does; embedding, index_select and gather raise),
    and an index outside the dim becomes past_end, a position past the end of the Gather that
    reads it. ONNX Gather would wrap a negative one and a linearized multi-dim index can land
    inside the tensor, so without this a bad index reads another element; the engine's range
    check on past_end fails the call instead, as eager raises."""
    if wraps:
        index = _wrap_negative(ctx, index, n)
    outside = ctx.b.op("Or", [ctx.b.op("Less", [index, ctx.scalar(0, np.int64)]),
                              ctx.b.op("GreaterOrEqual", [index, int64_size(ctx, n)])])
    past = ctx.scalar(max(past_end, 1), np.int64) if isinstance(past_end, int) else \
        ctx.b.op("Max", [past_end, ctx.scalar(1, np.int64)])
    return ctx.b.op("Where", [outside, past, index])


def _int64(ctx: LowerCtx, index: torch.Value) -> str:
    return ctx.cast(ctx.tensor(index), ctx.dtype(index), np.dtype("int64"))


def _dim_arg(ctx: LowerCtx, node, index: int, rank: int) -> int:
    return ctx.const(node_args(node)[index]) % max(rank, 1)


def _index_select(ctx: LowerCtx, node):
    x, _, index = node_args(node)[:3]
    dim = _dim_arg(ctx, node, 1, len(ctx.shape(x)))
    n = ctx.dim_size(x, dim) if ctx.shape(x) else 1  # (a run-time dim: its size read at run time)
    i = _index_in_range(ctx, _int64(ctx, index), n, wraps=False, past_end=n)
    if not ctx.shape(x):  # a 0-d input reads as [1] (ONNX Gather needs rank >= 1); the result is 0-d
        picked = ctx.b.op("Gather", [reshape_exact(ctx, ctx.tensor(x), [1]), i], axis=0)
        return [reshape_exact(ctx, picked, [])]
    return [ctx.b.op("Gather", [ctx.tensor(x), i], axis=dim)]


def _gather(ctx: LowerCtx, node):
    """torch.gather(x, dim, index): out[..i..] = x[.. index[..i..] at dim ..], via a flat Gather."""
    x, _, index = node_args(node)[:3]
    shape, ishape = ctx.shape(x), ctx.shape(index)
    dim = _dim_arg(ctx, node, 1, len(shape))
    if ctx.run_time.get(x) or ctx.run_time.get(index):
        return [_gather_run_time(ctx, x, index, dim)]
    strides = [int(np.prod(shape[d + 1:])) for d in range(len(shape))]
    position = np.zeros(ishape, np.int64)   # the linear offset of every index position, but at dim
    for d, n in enumerate(ishape):
        if d != dim:
            position += (np.arange(n) * strides[d]).reshape([-1 if k == d else 1 for k in range(len(ishape))])
    i = _index_in_range(ctx, _int64(ctx, index), shape[dim], wraps=False, past_end=int(np.prod(shape)))
    linear = ctx.b.op("Add", [ctx.b.op("Mul", [i, ctx.scalar(strides[dim], np.int64)]), ctx.b.constant(position)])
    flat = ctx.b.op("Reshape", [ctx.tensor(x), ctx.b.ints([-1])])
    return [ctx.b.op("Gather", [flat, linear], axis=0)]


def _gather_run_time(ctx: LowerCtx, x: torch.Value, index: torch.Value, dim: int) -> str:
    """_gather with run-time dims: the same flat Gather, its offsets built from the sizes read at
    run time (a Range per index dim times x's stride there) instead of one constant."""
    rank = len(ctx.shape(x))
    dims = [ctx.dim_size(x, d) for d in range(rank)]
    strides = [size_product(ctx, dims[d + 1:]) for d in range(rank)]
    i = _index_in_range(ctx, _int64(ctx, index), dims[dim], wraps=False, past_end=size_product(ctx, dims))
    linear = ctx.b.op("Mul", [i, int64_size(ctx, strides[dim])])
    for d in range(rank):
        if d == dim:
            continue
        steps = ctx.b.op("Range", [ctx.scalar(0, np.int64), int64_size(ctx, ctx.dim_size(index, d)),
                                   ctx.scalar(1, np.int64)])
        offsets = ctx.b.op("Mul", [steps, int64_size(ctx, strides[d])])
        along = ctx.b.op("Reshape", [offsets, ctx.b.ints([-1 if k == d else 1 for k in range(rank)])])
        linear = ctx.b.op("Add", [linear, along])
    flat = ctx.b.op("Reshape", [ctx.tensor(x), ctx.b.ints([-1])])
    return ctx.b.op("Gather", [flat, linear], axis=0)


def _triangle(ctx: LowerCtx, node):
    """tril/triu(x, diagonal): a Where against a constant mask over the last two dims."""
    x, diagonal = node_args(node)[:2]
    rank = len(ctx.shape(x))
    rows, cols = ctx.dim_size(x, rank - 2), ctx.dim_size(x, rank - 1)
    keep = triangle_mask(ctx, rows, cols, ctx.const(diagonal), lower=node.kind() == "aten::tril")
    return [ctx.b.op("Where", [keep, ctx.tensor(x), ctx.scalar(0, ctx.dtype(x))])]


def triangle_mask(ctx: LowerCtx, rows, cols, diagonal: int, lower: bool, name: str = "mask") -> str:
    """[rows, cols] bools: column - row <= diagonal (lower) or >= diagonal. Static sizes: a
    constant. Run-time sizes (torch.ones(s, s).triu(1), sdpa's is_causal over the sequence): the
    rows and columns counted at run time (Range) and compared."""
    if isinstance(rows, int) and isinstance(cols, int):
        pick = np.tril if lower else np.triu
        return ctx.b.constant(pick(np.ones((rows, cols), bool), diagonal), name)

    def positions(n):
        return ctx.b.op("Range", [ctx.scalar(0, np.int64), int64_size(ctx, n), ctx.scalar(1, np.int64)])
    row = ctx.b.op("Unsqueeze", [positions(rows), ctx.b.ints([1])])
    offset = ctx.b.op("Sub", [positions(cols), row])
    return ctx.b.op("LessOrEqual" if lower else "GreaterOrEqual", [offset, ctx.scalar(diagonal, np.int64)])


def _repeat(ctx: LowerCtx, node):
    """x.repeat(r): view x as [1, a, 1, b], expand to [r0, a, r1, b], flatten pairs. Static: those
    shapes as constants. With run-time sizes (in x, or counts: ``positions.unsqueeze(0).repeat(batch,
    1)``, Whisper) the same three steps with shapes computed from x's dims and the counts."""
    x, repeats = node_args(node)[:2]
    run_time = ctx.run_time.get(x, set())
    if is_constant(repeats) and not run_time:
        repeats = ctx.const(repeats)
        shape = [1] * (len(repeats) - len(ctx.shape(x))) + ctx.shape(x)
        spread = reshape_exact(ctx, ctx.tensor(x), [v for n in shape for v in (1, n)])
        wide = ctx.b.op("Expand", [spread, ctx.b.ints([v for r, n in zip(repeats, shape) for v in (r, n)])])
        return [reshape_exact(ctx, wide, ctx.shape(node.output()))]
    counts = run_time_size_list(repeats) if not is_constant(repeats) else ctx.const(repeats)
    if counts is None:
        raise LoweringError("repeat counts that are not a list of sizes")
    counts = [c if isinstance(c, int) else ctx.const(c) if is_constant(c) else ctx.size(c) for c in counts]
    rank = len(ctx.shape(x))
    if any(n == 0 for n in ctx.shape(x)):
        raise LoweringError("repeat of an empty tensor with run-time sizes")
    shape = [1] * (len(counts) - rank) + [ctx.dim_size(x, d) for d in range(rank)]
    spread = ctx.b.op("Reshape", [ctx.tensor(x), ctx.sizes([v for n in shape for v in (1, n)])], allowzero=0)
    wide = ctx.b.op("Expand", [spread, ctx.sizes([v for r, n in zip(counts, shape) for v in (r, n)])])
    merged = [size_product(ctx, [r, n]) for r, n in zip(counts, shape)]
    return [ctx.b.op("Reshape", [wide, ctx.sizes(merged)], allowzero=0)]


def _repeat_interleave(ctx: LowerCtx, node):
    """repeat_interleave(x, r, dim): each element r times in a row: view x as [.., n, 1, ..],
    expand to [.., n, r, ..], merge the pair (dim None: of the flattened x)."""
    x, repeats, dim = node_args(node)[:3]
    shape, r, dim = ctx.shape(x), ctx.const(repeats), ctx.const(dim)
    name = ctx.tensor(x)
    if dim is None:
        shape, dim, name = [int(np.prod(shape))], 0, reshape_exact(ctx, name, [int(np.prod(shape))])
    dim %= max(len(shape), 1)
    spread = reshape_exact(ctx, name, shape[:dim + 1] + [1] + shape[dim + 1:])
    wide = ctx.b.op("Expand", [spread, ctx.b.ints(shape[:dim + 1] + [r] + shape[dim + 1:])])
    return [reshape_exact(ctx, wide, ctx.shape(node.output()))]


def _repeat_interleave_check(node):
    args = node_args(node)
    if len(args) < 3 or is_tensor(args[1]) or not isinstance(constant_value(args[1]), int):
        return "repeat_interleave with per-element (tensor) repeats"
    if static_shape_of(args[0]) == [] and constant_value(args[2]) is not None:
        return "repeat_interleave along a dim of a 0-d tensor (eager raises)"
    return None


def _roll(ctx: LowerCtx, node):
    """roll(x, shifts, dims): per dim, the last `shift` elements move to the front."""
    x, shifts, dims = node_args(node)[:3]
    shape = ctx.shape(x)
    name = ctx.tensor(x)
    shifts, dims = ctx.const(shifts), ctx.const(dims)
    shifts = [shifts] if isinstance(shifts, int) else shifts
    dims = [dims] if isinstance(dims, int) else dims
    if not dims:  # roll of the flattened tensor
        flat = ctx.b.op("Reshape", [name, ctx.b.ints([-1])])
        if not ctx.run_time.get(x):
            return [reshape_exact(ctx, _roll_axis(ctx, flat, 0, shifts[0], int(np.prod(shape))), shape)]
        # with run-time dims, the element count and the shape back are read at run time
        rolled = _roll_axis(ctx, flat, 0, shifts[0], _element_count(ctx, x))
        return [ctx.b.op("Reshape", [rolled, ctx.b.op("Shape", [name])], allowzero=1)]
    for shift, dim in zip(shifts, dims):
        name = _roll_axis(ctx, name, dim % len(shape), shift, ctx.dim_size(x, dim % len(shape)))
    return [name]


def _element_count(ctx: LowerCtx, x: torch.Value) -> str:
    """x's element count as a 0-d int64 ONNX size: the product of its dims, run-time ones read
    from its shape (size arithmetic the engine computes from its size symbols)."""
    static = int(np.prod([n for d, n in enumerate(ctx.shape(x)) if d not in ctx.run_time.get(x, {})]))
    count = ctx.scalar(static, np.int64)
    for d in sorted(ctx.run_time.get(x, {})):
        count = ctx.b.op("Mul", [count, ctx.read_dim(x, d)])
    return count


def _flip(ctx: LowerCtx, node):
    """flip(x, dims): each dim read backwards, a Slice from the last element by step -1 (the
    engine's view of it, also along a run-time dim)."""
    x, dims = node_args(node)[:2]
    rank = len(ctx.shape(x))
    dims = sorted({d % rank for d in ctx.const(dims)}) if rank else []
    if not dims:
        return [ctx.b.op("Identity", [ctx.tensor(x)])]
    return [ctx.b.op("Slice", [ctx.tensor(x), ctx.b.ints([-1] * len(dims)), ctx.b.ints([-INT64_MAX - 1] * len(dims)),
                               ctx.b.ints(dims), ctx.b.ints([-1] * len(dims))])]


def _roll_axis(ctx: LowerCtx, name: str, dim: int, shift: int, n) -> str:
    """x rolled by shift along a dim of size n: Concat(x[k:], x[:k]) with k = -shift mod n. A
    run-time n (the ONNX name of a size) reads k = n - shift % n (shift > 0) or -shift % n as size
    arithmetic (dividends >= 0: the engine's remainders are exact) and takes [k, k + n) of
    Concat(x, x), which the engine reads as a roll view of x (no copy, blade/engine/ir.py's
    _rolled); the two parts' lengths n - k and k would be 0 at some sizes."""
    if shift == 0 or n == 0:
        return ctx.b.op("Identity", [name])
    if isinstance(n, int):
        k = -shift % n
        if k == 0:
            return ctx.b.op("Identity", [name])
        return ctx.b.op("Concat", [slice_onnx(ctx, name, dim, k, n), slice_onnx(ctx, name, dim, 0, k)], axis=dim)
    if shift > 0:
        k = ctx.b.op("Sub", [n, ctx.b.op("Mod", [ctx.scalar(shift, np.int64), n])])
    else:
        k = ctx.b.op("Mod", [ctx.scalar(-shift, np.int64), n])
    twice = ctx.b.op("Concat", [name, name], axis=dim)
    return slice_onnx(ctx, twice, dim, k, ctx.b.op("Add", [k, n]))


RULES: dict[str, Rule] = {
    "aten::embedding": Rule(_embedding),
    "aten::index": Rule(_index, _index_check, tensor_lists=True),
    "aten::index_select": Rule(_index_select),
    "aten::gather": Rule(_gather, needs_const_false(3, "gather with sparse_grad")),
    "aten::tril": Rule(_triangle),
    "aten::triu": Rule(_triangle),
    "aten::repeat": Rule(_repeat, size_args=True),
    "aten::repeat_interleave": Rule(_repeat_interleave, _repeat_interleave_check),
    "aten::diff": Rule(_diff, _diff_check),
    "aten::roll": Rule(_roll),
    "aten::flip": Rule(_flip),
}

# Ops whose rules read through _index_in_range: an index from the model's data that is out of
# range fails the engine's call (blade/errors.py names these ops in the error).
RANGE_CHECKED = ("aten::embedding", "aten::index", "aten::index_select", "aten::gather")
assert all(kind in RULES for kind in RANGE_CHECKED)
