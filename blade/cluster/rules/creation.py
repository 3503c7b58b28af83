"""Tensor creation rules: zeros/ones/full and their _like/new_ forms, shaped as the frontend
measured (run-time sizes where the graph has them)."""
from __future__ import annotations

import torch

from blade.cluster.rules.base import (
    LowerCtx, LoweringError, Rule, is_constant, named_args, node_args, out_dtype, run_time_size_list)


def _filled(ctx: LowerCtx, node, value) -> list:
    """A tensor of the output's shape and dtype holding `value` everywhere: a broadcast scalar."""
    dtype = out_dtype(node)
    return [ctx.b.op("Expand", [ctx.scalar(value, dtype), _fill_shape(ctx, node)])]


def _fill_shape(ctx: LowerCtx, node) -> str:
    """The shape a fill op makes: its static output shape; with run-time dims, a *_like op's input's
    shape read at run time, or a new_* op's run-time size list."""
    if not ctx.run_time.get(node.output()):
        return ctx.b.ints(ctx.shape(node.output()))
    if node.kind().endswith("_like"):
        return ctx.b.op("Shape", [ctx.tensor(node_args(node)[0])])
    sizes = named_args(node)["size"]
    items = run_time_size_list(sizes)
    if items is None:
        raise LoweringError(f"{node.kind()} to run-time dims not given as a list of sizes")
    return ctx.sizes(items)


FILL_VALUES = {"aten::zeros_like": 0, "aten::new_zeros": 0, "aten::ones_like": 1, "aten::new_ones": 1}


# zeros/ones/full(size): constant sizes fold to a constant in the frontend; these rules take the
# ones over run-time sizes (``torch.ones(seq, seq)`` of a causal mask)
CREATE_VALUES = {"aten::zeros": 0, "aten::ones": 1}


def _create(ctx: LowerCtx, node):
    args = named_args(node)
    value = CREATE_VALUES[node.kind()] if node.kind() in CREATE_VALUES else ctx.const(args["fill_value"])
    sizes = args["size"]
    shape = ctx.b.ints(ctx.const(sizes)) if is_constant(sizes) else ctx.sizes(run_time_size_list(sizes))
    return [ctx.b.op("Expand", [ctx.scalar(value, out_dtype(node)), shape])]


def _create_check(node):
    args = named_args(node)
    sizes = args.get("size")
    if sizes is None or not (is_constant(sizes) or run_time_size_list(sizes) is not None):
        return f"{node.kind()} of sizes that are neither constants nor a list of run-time sizes"
    if "fill_value" in args and not is_constant(args["fill_value"]):
        return f"{node.kind()} with a computed fill value"
    return None


def _fill(ctx: LowerCtx, node):
    """zeros_like/ones_like/full_like and new_*: the fill value is in the table or the fill_value arg."""
    if node.kind() in FILL_VALUES:
        return _filled(ctx, node, FILL_VALUES[node.kind()])
    return _filled(ctx, node, ctx.const(named_args(node)["fill_value"]))


# tensor creation from a tensor's shape (constant arguments; shape and dtype as measured)
RULES: dict[str, Rule] = {
    **{kind: Rule(_fill, size_args=True) for kind in (*FILL_VALUES, "aten::full_like", "aten::new_full")},
    **{kind: Rule(_create, _create_check, size_args=True) for kind in (*CREATE_VALUES, "aten::full")},
}
