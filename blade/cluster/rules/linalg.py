"""Linear algebra rules: linear, matmul/bmm/mm, addmm/baddbmm, einsum and
scaled_dot_product_attention (causal and boolean masks, GQA head repeats, fully masked rows)."""
from __future__ import annotations

import numpy as np

from blade.cluster import einsum
from blade.cluster.rules.base import (
    LowerCtx, Rule, constant_value, is_constant, is_tensor, node_args, out_dtype, static_shape_of)
from blade.cluster.rules.indexing import triangle_mask


def _transpose_last2(ctx: LowerCtx, name: str, rank: int) -> str:
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return ctx.b.op("Transpose", [name], perm=perm)


def _linear(ctx: LowerCtx, node):
    x, weight, bias = node_args(node)[:3]
    out = ctx.b.op("MatMul", [ctx.tensor(x), _transpose_last2(ctx, ctx.tensor(weight), len(ctx.shape(weight)))])
    if is_tensor(bias):
        out = ctx.b.op("Add", [out, ctx.tensor(bias)])
    return [out]


def _matmul(ctx: LowerCtx, node):
    a, b = node_args(node)[:2]
    return [ctx.b.op("MatMul", [ctx.tensor(a), ctx.tensor(b)])]


def _einsum(ctx: LowerCtx, node):
    """einsum(equation, tensors, path=None): pairwise batched products (blade/cluster/einsum.py);
    a contraction path only reorders them, so it is not read."""
    equation, tensors = node_args(node)[:2]
    members = list(tensors.node().inputs())
    return [einsum.lower(ctx, ctx.const(equation), members)]


def _einsum_check(node):
    equation, tensors = node_args(node)[:2]
    if tensors.node().kind() != "prim::ListConstruct" or not is_constant(equation):
        return "aten::einsum of a list not built by prim::ListConstruct or a computed equation"
    shapes = [static_shape_of(v) for v in tensors.node().inputs()]
    if any(shape is None for shape in shapes):
        return "aten::einsum of an operand without a static shape"
    return einsum.refusal(constant_value(equation), shapes)


def _scaled_add(ctx: LowerCtx, node, product: str):
    """beta * input + alpha * product (addmm/baddbmm epilogue)."""
    args = node_args(node)
    dtype = out_dtype(node)
    beta, alpha = ctx.const(args[3]), ctx.const(args[4])
    if alpha != 1:
        product = ctx.b.op("Mul", [product, ctx.scalar(alpha, dtype)])
    if beta == 0:
        return [product]
    bias = ctx.tensor(args[0])
    if beta != 1:
        bias = ctx.b.op("Mul", [bias, ctx.scalar(beta, dtype)])
    return [ctx.b.op("Add", [product, bias])]


def _addmm(ctx: LowerCtx, node):
    args = node_args(node)
    return _scaled_add(ctx, node, ctx.b.op("MatMul", [ctx.tensor(args[1]), ctx.tensor(args[2])]))


def _sdpa(ctx: LowerCtx, node):
    """softmax(q @ k^T * scale + mask) @ v, with a causal or explicit (bool/float) mask."""
    q, k, v, mask, _dropout, is_causal = node_args(node)[:6]
    scale_arg = node_args(node)[6] if len(node_args(node)) > 6 else None
    q_shape = ctx.shape(q)
    dtype = ctx.dtype(q)
    scale = ctx.const(scale_arg) if scale_arg is not None else None
    if scale is None:
        scale = 1.0 / float(np.sqrt(q_shape[-1]))
    keys, values = ctx.tensor(k), ctx.tensor(v)
    if len(node_args(node)) > 7 and ctx.const(node_args(node)[7]):  # enable_gqa: each K/V head serves a group of query heads
        keys, values = (_repeat_heads(ctx, name, ctx.shape(t), q_shape[-3]) for name, t in ((keys, k), (values, v)))
    k_t = _transpose_last2(ctx, keys, len(ctx.shape(k)))
    scores = ctx.b.op("Mul", [ctx.b.op("MatMul", [ctx.tensor(q), k_t]), ctx.scalar(scale, dtype)])
    if ctx.const(is_causal):
        rows, cols = ctx.dim_size(q, len(q_shape) - 2), ctx.dim_size(k, len(ctx.shape(k)) - 2)
        keep = triangle_mask(ctx, rows, cols, 0, lower=True, name="causal")
        scores = ctx.b.op("Where", [keep, scores, ctx.scalar(-np.inf, dtype)])
    elif is_tensor(mask):
        if ctx.dtype(mask) == np.dtype(bool):
            scores = ctx.b.op("Where", [ctx.tensor(mask), scores, ctx.scalar(-np.inf, dtype)])
        else:
            scores = ctx.b.op("Add", [scores, ctx.as_dtype(mask, dtype)])
    probs = ctx.b.op("Softmax", [scores], axis=-1)
    if is_tensor(mask) and not ctx.const(is_causal):
        probs = _zero_fully_masked_rows(ctx, scores, probs, len(ctx.shape(node.output())), dtype)
    return [ctx.b.op("MatMul", [probs, values])]


def _repeat_heads(ctx: LowerCtx, name: str, shape: list, heads: int) -> str:
    """[..., kv_heads, s, d] -> [..., heads, s, d], each head repeated heads // kv_heads times in a
    row (sdpa's enable_gqa, repeat_interleave along the heads): unsqueeze, expand the new dim,
    merge it into the heads. Leading dims (the batch, which may be run-time) are copied (ONNX's 0)
    and the sequence inferred."""
    kv_heads = shape[-3]
    if kv_heads == heads:
        return name
    spread = ctx.b.op("Unsqueeze", [name, ctx.b.ints([len(shape) - 2])])
    wide = ctx.b.op("Expand", [spread, ctx.b.ints([1] * (len(shape) - 2) + [heads // kv_heads, 1, 1])])
    return ctx.b.op("Reshape", [wide, ctx.b.ints([0] * (len(shape) - 3) + [heads, -1, shape[-1]])], allowzero=0)


def _zero_fully_masked_rows(ctx: LowerCtx, scores: str, probs: str, rank: int, dtype) -> str:
    """A query row whose scores are all -inf (every key masked) attends to nothing: eager's safe
    softmax gives 0 there, a plain softmax NaN."""
    peak = ctx.b.op("ReduceMax", [scores, ctx.b.ints([rank - 1])], keepdims=1)
    nothing_kept = ctx.b.op("Equal", [peak, ctx.scalar(-np.inf, dtype)])
    return ctx.b.op("Where", [nothing_kept, ctx.scalar(0, dtype), probs])


def _sdpa_check(node):
    args = node_args(node)
    if constant_value(args[4]) not in (0, 0.0):
        return "scaled_dot_product_attention with dropout_p != 0"
    if len(args) > 7 and constant_value(args[7]) not in (False, None, True):
        return "scaled_dot_product_attention with a computed enable_gqa"
    if is_tensor(args[3]) and constant_value(args[5]):
        return "scaled_dot_product_attention with both attn_mask and is_causal"
    return None


RULES: dict[str, Rule] = {
    "aten::linear": Rule(_linear),
    "aten::matmul": Rule(_matmul),
    "aten::bmm": Rule(_matmul),
    "aten::mm": Rule(_matmul),
    "aten::addmm": Rule(_addmm),
    "aten::einsum": Rule(_einsum, _einsum_check, tensor_lists=True),
    "aten::baddbmm": Rule(_addmm),
    "aten::scaled_dot_product_attention": Rule(_sdpa, _sdpa_check),
}
