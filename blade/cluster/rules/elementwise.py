"""Elementwise rules: arithmetic with torch's alpha and type promotion, unary math, activations,
clamps, comparisons, selection (where, masked_fill), bitwise ops and casts; the rule kinds
(binary, unary, compare, rounding) the other families reuse."""
from __future__ import annotations

import numpy as np
import torch

from blade.cluster.rules.base import LowerCtx, Rule, constant_value, is_tensor, node_args, out_dtype, promoted_dtype


def binary(onnx_op: str, reverse: bool = False):
    """out = a <op> b*alpha (alpha when the schema has one), computed in the output dtype;
    reversed (rsub): out = b <op> a*alpha, alpha scaling self as torch's rsub does."""
    def lower(ctx: LowerCtx, node):
        args = node_args(node)
        dtype = out_dtype(node)
        a, b = ctx.as_dtype(args[0], dtype), ctx.as_dtype(args[1], dtype)
        if reverse:
            a, b = b, a
        if len(args) > 2:  # alpha
            alpha = ctx.const(args[2])
            if alpha != 1:
                b = ctx.b.op("Mul", [b, ctx.scalar(alpha, dtype)])
        return [ctx.b.op(onnx_op, [a, b])]
    return lower


def compare(onnx_op: str, negate: bool = False):
    def lower(ctx: LowerCtx, node):
        a_val, b_val = node_args(node)[:2]
        dtype = promoted_dtype(a_val, b_val)
        out = ctx.b.op(onnx_op, [ctx.as_dtype(a_val, dtype), ctx.as_dtype(b_val, dtype)])
        return [ctx.b.op("Not", [out]) if negate else out]
    return lower


def unary(*onnx_ops: str):
    """A chain of unary ONNX ops applied to the input cast to the output dtype."""
    def lower(ctx: LowerCtx, node):
        x = ctx.as_dtype(node_args(node)[0], out_dtype(node))
        for op in onnx_ops:
            x = ctx.b.op(op, [x])
        return [x]
    return lower


def rounding(onnx_op: str):
    """floor/ceil: integers are already integral (through a float they would lose precision, and
    int64 max would overflow)."""
    def lower(ctx: LowerCtx, node):
        x = ctx.as_dtype(node_args(node)[0], out_dtype(node))
        return [ctx.b.op("Identity" if np.issubdtype(out_dtype(node), np.integer) else onnx_op, [x])]
    return lower


def _sign(ctx: LowerCtx, node):
    """sign/sgn: a bool is its own sign (the engine's Sign is for numbers)."""
    x = ctx.as_dtype(node_args(node)[0], out_dtype(node))
    return [ctx.b.op("Identity" if out_dtype(node) == np.bool_ else "Sign", [x])]


def identity(ctx: LowerCtx, node):
    return [ctx.b.op("Identity", [ctx.tensor(node_args(node)[0])])]


def cast_to_output(ctx: LowerCtx, node):
    x = node_args(node)[0]
    name = ctx.cast(ctx.tensor(x), ctx.dtype(x), out_dtype(node))
    return [name if name != ctx.tensor(x) else ctx.b.op("Identity", [name])]


def _div(ctx: LowerCtx, node):
    args = node_args(node)
    mode = ctx.const(args[2]) if len(args) > 2 else None
    dtype = out_dtype(node)
    a, b = ctx.as_dtype(args[0], dtype), ctx.as_dtype(args[1], dtype)
    if mode is None:
        return [ctx.b.op("Div", [a, b])]
    rounding = _integer_division if np.issubdtype(dtype, np.integer) else _float_division
    return [rounding(ctx, a, b, mode, dtype)]


def _integer_division(ctx: LowerCtx, a: str, b: str, mode: str, dtype) -> str:
    """Exact integer trunc/floor division: the engine's integer Div truncates (and fails the call
    on a zero divisor, where eager raises ZeroDivisionError); floor steps down by one where the
    remainder is nonzero and its sign differs from the divisor's."""
    quotient = ctx.b.op("Div", [a, b])
    if mode == "trunc":
        return quotient
    remainder = ctx.b.op("Sub", [a, ctx.b.op("Mul", [quotient, b])])
    step_down = _off_sign(ctx, remainder, b, dtype)
    return ctx.b.op("Where", [step_down, ctx.b.op("Sub", [quotient, ctx.scalar(1, dtype)]), quotient])


def _off_sign(ctx: LowerCtx, remainder: str, divisor: str, dtype) -> str:
    """Where a truncated remainder is nonzero with a sign other than the divisor's: there floor
    division is one below truncation, and Python's remainder is the truncated one plus the divisor."""
    zero = ctx.scalar(0, dtype)
    signs_differ = ctx.b.op("Not", [ctx.b.op("Equal", [ctx.b.op("Less", [remainder, zero]),
                                                       ctx.b.op("Less", [divisor, zero])])])
    return ctx.b.op("And", [ctx.b.op("Not", [ctx.b.op("Equal", [remainder, zero])]), signs_differ])


def _integer_remainder(ctx: LowerCtx, node):
    """torch.fmod (C's remainder: the dividend's sign) and torch.remainder (Python's %: the
    divisor's) of integers: a - trunc(a / b) * b, the engine's integer Div failing the call on a
    zero divisor as eager raises; remainder then adds the divisor where the signs differ."""
    args = node_args(node)
    dtype = out_dtype(node)
    a, b = ctx.as_dtype(args[0], dtype), ctx.as_dtype(args[1], dtype)
    truncated = ctx.b.op("Sub", [a, ctx.b.op("Mul", [ctx.b.op("Div", [a, b]), b])])
    if node.kind() == "aten::fmod":
        return [truncated]
    return [ctx.b.op("Where", [_off_sign(ctx, truncated, b, dtype), ctx.b.op("Add", [truncated, b]), truncated])]


def _integer_remainder_check(node):
    dtype = node.output().type().dtype()
    if dtype is None or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return (f"{node.kind()} with a {dtype} result: only integers (a float remainder is C's fmod, a "
                "scalar loop in an engine where eager's is vectorized)")
    return None


def _float_division(ctx: LowerCtx, a: str, b: str, mode: str, dtype) -> str:
    q = ctx.b.op("Div", [a, b])
    if mode == "floor":
        return _float_floor_division(ctx, a, b, q, dtype)
    # trunc: floor for positives, ceil for negatives
    return ctx.b.op("Where", [ctx.b.op("Less", [q, ctx.scalar(0, dtype)]), ctx.b.op("Ceil", [q]), ctx.b.op("Floor", [q])])


def _float_floor_division(ctx: LowerCtx, a: str, b: str, q: str, dtype) -> str:
    """torch's float floor division (div_floor_floating), not floor(a / b), which rounds a/b first
    and is one off for some quotients: (a - fmod(a, b)) / b, one less where the remainder's sign
    differs from the divisor's, rounded to the nearest integer; 0 keeps the sign of a / b and a
    zero divisor gives a / b."""
    op, zero = ctx.b.op, ctx.scalar(0, dtype)
    mod = op("Mod", [a, b], fmod=1)
    div = op("Div", [op("Sub", [a, mod]), b])
    div = op("Where", [_off_sign(ctx, mod, b, dtype), op("Sub", [div, ctx.scalar(1, dtype)]), div])
    floored = op("Floor", [div])
    rounds_up = op("Greater", [op("Sub", [div, floored]), ctx.scalar(0.5, dtype)])
    floored = op("Where", [rounds_up, op("Add", [floored, ctx.scalar(1, dtype)]), floored])
    floored = op("Where", [op("Equal", [div, zero]), op("Mul", [q, zero]), floored])
    return op("Where", [op("Equal", [b, zero]), q, floored])


def _pow(ctx: LowerCtx, node):
    base, exponent = node_args(node)[:2]
    dtype = out_dtype(node)  # (the engine turns small constant exponents into multiplies)
    return [ctx.b.op("Pow", [ctx.as_dtype(base, dtype), ctx.as_dtype(exponent, dtype)])]


def _gelu(ctx: LowerCtx, node):
    args = node_args(node)
    approximate = ctx.const(args[1]) if len(args) > 1 else "none"
    return [ctx.b.op("Gelu", [ctx.tensor(args[0])], approximate=approximate)]


def _where(ctx: LowerCtx, node):
    cond, x, y = node_args(node)[:3]
    dtype = out_dtype(node)
    return [ctx.b.op("Where", [ctx.tensor(cond), ctx.as_dtype(x, dtype), ctx.as_dtype(y, dtype)])]


def _masked_fill(ctx: LowerCtx, node):
    x, mask, value = node_args(node)[:3]
    dtype = out_dtype(node)
    return [ctx.b.op("Where", [ctx.tensor(mask), ctx.as_dtype(value, dtype), ctx.tensor(x)])]


def _clamp(ctx: LowerCtx, node):
    args = node_args(node)
    dtype = out_dtype(node)
    x = ctx.as_dtype(args[0], dtype)
    bounds = {"aten::clamp": (1, 2), "aten::clamp_min": (1, None), "aten::clamp_max": (None, 1)}[node.kind()]
    for onnx_op, index in zip(("Max", "Min"), bounds):
        if index is None:
            continue
        bound = args[index]
        if not is_tensor(bound) and ctx.const(bound) is None:
            continue
        x = ctx.b.op(onnx_op, [x, ctx.as_dtype(bound, dtype)])
    return [x]


def _activation(build):
    """A rule from build(ctx, x, dtype, *constant args) -> ONNX name."""
    def lower(ctx: LowerCtx, node):
        args = node_args(node)
        dtype = out_dtype(node)
        return [build(ctx, ctx.as_dtype(args[0], dtype), dtype, *(ctx.const(a) for a in args[1:]))]
    return lower


def _softplus_expr(ctx, x, dtype, beta=1.0, threshold=20.0):
    scaled = ctx.b.op("Mul", [x, ctx.scalar(beta, dtype)])
    soft = ctx.b.op("Div", [ctx.b.op("Log", [ctx.b.op("Add", [ctx.b.op("Exp", [scaled]), ctx.scalar(1, dtype)])]),
                            ctx.scalar(beta, dtype)])
    return ctx.b.op("Where", [ctx.b.op("Greater", [scaled, ctx.scalar(threshold, dtype)]), x, soft])


def _clip(ctx, x, dtype, low, high):
    return ctx.b.op("Min", [ctx.b.op("Max", [x, ctx.scalar(low, dtype)]), ctx.scalar(high, dtype)])


def _hardsigmoid_expr(ctx, x, dtype):
    return ctx.b.op("Div", [_clip(ctx, ctx.b.op("Add", [x, ctx.scalar(3, dtype)]), dtype, 0, 6), ctx.scalar(6, dtype)])


def _elu_expr(ctx, x, dtype, alpha=1.0, scale=1.0, input_scale=1.0):
    negative = ctx.b.op("Sub", [ctx.b.op("Exp", [ctx.b.op("Mul", [x, ctx.scalar(input_scale, dtype)])]),
                                ctx.scalar(1, dtype)])
    negative = ctx.b.op("Mul", [negative, ctx.scalar(alpha * scale, dtype)])
    positive = ctx.b.op("Mul", [x, ctx.scalar(scale, dtype)])
    # x < 0 picks the exp branch, so -0 keeps its sign through x * scale like torch's elu
    return ctx.b.op("Where", [ctx.b.op("Less", [x, ctx.scalar(0, dtype)]), negative, positive])


ACTIVATIONS = {
    # x * clip(x + 3, 0, 6) / 6 in torch's order: x * 6 overflows to inf for |x| > FLT_MAX / 6 as in eager
    "aten::hardswish": lambda ctx, x, dt: ctx.b.op("Div", [
        ctx.b.op("Mul", [x, _clip(ctx, ctx.b.op("Add", [x, ctx.scalar(3, dt)]), dt, 0, 6)]), ctx.scalar(6, dt)]),
    "aten::hardsigmoid": _hardsigmoid_expr,
    "aten::hardtanh": _clip,
    "aten::relu6": lambda ctx, x, dt: _clip(ctx, x, dt, 0, 6),
    "aten::leaky_relu": lambda ctx, x, dt, slope=0.01: ctx.b.op(
        "Where", [ctx.b.op("Greater", [x, ctx.scalar(0, dt)]), x, ctx.b.op("Mul", [x, ctx.scalar(slope, dt)])]),
    "aten::elu": _elu_expr,
    "aten::softplus": _softplus_expr,
    "aten::mish": lambda ctx, x, dt: ctx.b.op("Mul", [x, ctx.b.op("Tanh", [_softplus_expr(ctx, x, dt)])]),
    "aten::silu": lambda ctx, x, dt: ctx.b.op("Mul", [x, ctx.b.op("Sigmoid", [x])]),
    "aten::square": lambda ctx, x, dt: ctx.b.op("Mul", [x, x]),   # a bool squares in int64, as eager's
}


def _to_check(node):
    out = node.output().type()
    if out.device() is not None and out.device().type != "cpu":
        return "aten::to a non-CPU device"
    return None


def bitwise(logical: str, integer: str):
    """and/or/xor/not: ONNX's logical op on bools, its Bitwise op on integers (the operands in the
    result's dtype: a bool tensor & an int scalar computes in int64, as in eager)."""
    def lower(ctx: LowerCtx, node):
        dtype = out_dtype(node)
        operands = [ctx.as_dtype(a, dtype) for a in node_args(node)]
        return [ctx.b.op(logical if dtype == np.bool_ else integer, operands)]
    return lower


def _bitwise_check(node):
    dtype = node.output().type().dtype()
    if dtype is not None and (dtype.is_floating_point or dtype.is_complex):
        return f"{node.kind()} with a {dtype} result (bitwise ops are for bools and integers)"
    return None


def _div_check(node):
    args = node_args(node)
    if len(args) > 2 and constant_value(args[2]) not in (None, "floor", "trunc"):
        return "aten::div with an unknown rounding_mode"
    return None


RULES: dict[str, Rule] = {
    # arithmetic (tensor and scalar operands; alpha; broadcasting; type promotion via dtypes)
    "aten::add": Rule(binary("Add")),
    "aten::sub": Rule(binary("Sub")),
    "aten::rsub": Rule(binary("Sub", reverse=True)),
    "aten::mul": Rule(binary("Mul")),
    "aten::div": Rule(_div, _div_check),
    "aten::maximum": Rule(binary("Max")),
    "aten::minimum": Rule(binary("Min")),
    "aten::pow": Rule(_pow),
    "aten::remainder": Rule(_integer_remainder, _integer_remainder_check),
    "aten::fmod": Rule(_integer_remainder, _integer_remainder_check),
    # unary math
    "aten::neg": Rule(unary("Neg")),
    "aten::abs": Rule(unary("Abs")),
    "aten::relu": Rule(unary("Relu")),
    "aten::sigmoid": Rule(unary("Sigmoid")),
    "aten::tanh": Rule(unary("Tanh")),
    "aten::exp": Rule(unary("Exp")),
    "aten::log": Rule(unary("Log")),
    "aten::sqrt": Rule(unary("Sqrt")),
    "aten::rsqrt": Rule(unary("Sqrt", "Reciprocal")),
    "aten::reciprocal": Rule(unary("Reciprocal")),
    "aten::erf": Rule(unary("Erf")),
    "aten::floor": Rule(rounding("Floor")),
    "aten::ceil": Rule(rounding("Ceil")),
    "aten::sign": Rule(_sign),
    "aten::sgn": Rule(_sign),   # sign for real dtypes (complex never reaches a rule)
    "aten::sin": Rule(unary("Sin")),
    "aten::cos": Rule(unary("Cos")),
    "aten::gelu": Rule(_gelu),
    **{kind: Rule(_activation(build)) for kind, build in ACTIVATIONS.items()},
    "aten::clamp": Rule(_clamp),
    "aten::clamp_min": Rule(_clamp),
    "aten::clamp_max": Rule(_clamp),
    # selection and comparison
    "aten::where": Rule(_where),
    "aten::masked_fill": Rule(_masked_fill),
    "aten::eq": Rule(compare("Equal")),
    "aten::ne": Rule(compare("Equal", negate=True)),
    "aten::lt": Rule(compare("Less")),
    "aten::le": Rule(compare("LessOrEqual")),
    "aten::gt": Rule(compare("Greater")),
    "aten::ge": Rule(compare("GreaterOrEqual")),
    "aten::logical_not": Rule(unary("Not")),
    "aten::logical_and": Rule(binary("And")),
    "aten::logical_or": Rule(binary("Or")),
    **{kind: Rule(bitwise(logical, integer), _bitwise_check) for kinds, logical, integer in (
        (("aten::__and__", "aten::bitwise_and"), "And", "BitwiseAnd"),
        (("aten::__or__", "aten::bitwise_or"), "Or", "BitwiseOr"),
        (("aten::__xor__", "aten::bitwise_xor"), "Xor", "BitwiseXor"),
        (("aten::bitwise_not",), "Not", "BitwiseNot")) for kind in kinds},
    # casts
    "aten::to": Rule(cast_to_output, _to_check),
    "aten::type_as": Rule(cast_to_output),
}
