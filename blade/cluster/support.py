"""The one lowering table (DESIGN.md contract 4): aten op -> ONNX nodes, with its conditions.

A TorchScript node is clusterable exactly when ``LOWERING`` has a rule for its kind, the generic
conditions hold (static shapes, supported dtypes, CPU, constant non-tensor arguments) and the rule's
own check passes. The partitioner asks ``can_lower``; there is no second list. Adding an op is one
entry here (plus engine support for any new ONNX op it emits) and one line in the op test table.

A rule's ``lower(ctx, node)`` returns, per node output, the ONNX name of that output (or a Python
list of names for a ``Tensor[]`` output). Type promotion is never re-derived here: every value
carries its exact dtype (measured by the frontend), so operands are cast to the dtype torch
computed in, then the ONNX op runs on uniform types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from blade.cluster import einsum
from blade.cluster.onnx_builder import OnnxBuilder

TORCH_TO_NP = {
    torch.float32: np.dtype("float32"),
    torch.float64: np.dtype("float64"),
    torch.int64: np.dtype("int64"),
    torch.int32: np.dtype("int32"),
    torch.bool: np.dtype("bool"),
}
INT64_MAX = 2**63 - 1


class LoweringError(RuntimeError):
    """A rule met a case its check should have rejected."""


# ---------------------------------------------------------------------------------------------
# Value helpers shared by the checks and the rules
# ---------------------------------------------------------------------------------------------

def is_tensor(value: torch.Value) -> bool:
    return isinstance(value.type(), torch.TensorType)


def is_tensor_list(value: torch.Value) -> bool:
    """Tensor[] or Tensor?[] (the index list of aten::index)."""
    vtype = value.type()
    if not isinstance(vtype, torch.ListType):
        return False
    element = vtype.getElementType()
    if isinstance(element, torch.OptionalType):
        element = element.getElementType()
    return isinstance(element, torch.TensorType)


def tensor_info(value: torch.Value):
    """(numpy dtype, shape) of a statically typed CPU tensor value, else None."""
    vtype = value.type()
    sizes = vtype.sizes()
    dtype = vtype.dtype()
    if sizes is None or any(s is None for s in sizes) or dtype not in TORCH_TO_NP:
        return None
    device = vtype.device()
    if device is not None and device.type != "cpu":
        return None
    return TORCH_TO_NP[dtype], list(sizes)


_NOT_CONSTANT = object()


def constant_value(value: torch.Value):
    """The Python value of a constant argument (through lists of constants), else _NOT_CONSTANT."""
    node = value.node()
    if node.kind() == "prim::Constant":
        return value.toIValue()
    if node.kind() == "prim::ListConstruct" and not is_tensor_list(value) and not _written(value):
        items = [constant_value(v) for v in node.inputs()]
        return _NOT_CONSTANT if any(i is _NOT_CONSTANT for i in items) else items
    return _NOT_CONSTANT


def _written(value: torch.Value) -> bool:
    """Whether an op writes the list in place: a scripted F.interpolate builds its scale_factors by
    aten::append in a loop onto an empty ListConstruct, whose items are no longer its inputs (read
    as [], the resize took its positions from the sizes instead of the given scale)."""
    for use in value.uses():
        schema = use.user.schema()
        if schema == "(no schema)":
            continue  # prim ops read lists (ListUnpack, a Loop's or If's carried value)
        arguments = torch._C.parse_schema(schema).arguments
        alias = arguments[use.offset].alias_info if use.offset < len(arguments) else None
        if alias is not None and alias.is_write:
            return True
    return False


def is_constant(value: torch.Value) -> bool:
    return constant_value(value) is not _NOT_CONSTANT


def is_size_value(value: torch.Value) -> bool:
    """A run-time size an op may read inside a cluster: an int ``aten::size(x, dim)`` (which the
    cluster computes from x's shape), or an int list of those and constants (``expand(batch,
    seq)``). The frontend gives every op its own (frontend._sizes_per_use)."""
    node = value.node()
    if node.kind() == "aten::size":
        return isinstance(value.type(), torch.IntType) and len(list(node.inputs())) == 2
    if is_size_arithmetic(node):
        return all(is_constant(v) or is_size_value(v) for v in node.inputs())
    return node.kind() == "prim::ListConstruct" and isinstance(value.type(), torch.ListType) and \
        isinstance(value.type().getElementType(), torch.IntType) and \
        all(is_constant(v) or is_size_value(v) for v in node.inputs()) and not is_constant(value)


def run_time_size_list(value) -> list | None:
    """The items of an int list of run-time sizes and constants built in the graph
    (``prim::ListConstruct``, e.g. ``expand(batch, seq)``), or None for any other value."""
    if value is None or not is_size_value(value) or value.node().kind() != "prim::ListConstruct":
        return None
    return list(value.node().inputs())


# Python int arithmetic on run-time sizes (``mask.size(0) * mask.size(1) // ids.size(0)``): kind ->
# the ONNX op on 0-d int64 sizes. floordiv is ONNX Div, which truncates: equal to Python's floor
# only for a non-negative dividend and a positive divisor, so its rule checks both (and the engine
# proves them from the size ranges, blade/engine/ir.py SIZE_RULES). A subtraction may go negative,
# so nothing divides a difference.
SIZE_ARITHMETIC_OPS = {"aten::add": "Add", "aten::sub": "Sub", "aten::mul": "Mul", "aten::floordiv": "Div"}


def is_size_arithmetic(node: torch.Node) -> bool:
    """An int-valued op of SIZE_ARITHMETIC_OPS (two int operands, e.g. ``aten::mul.int``)."""
    return node.kind() in SIZE_ARITHMETIC_OPS and isinstance(node.output().type(), torch.IntType) and \
        all(isinstance(v.type(), torch.IntType) for v in node.inputs())


def is_nonnegative_size(value: torch.Value, positive: bool = False) -> bool:
    """Whether an int is >= 0 (> 0 with positive) by construction: a constant, a size (0 only at an
    empty dim, which a size range's minimum of 1 excludes where it divides), or a sum, product or
    floor quotient of such."""
    c = constant_value(value)
    if c is not _NOT_CONSTANT:
        return type(c) is int and (c > 0 if positive else c >= 0)
    node = value.node()
    if node.kind() == "aten::size":
        return True
    if is_size_arithmetic(node) and node.kind() in ("aten::add", "aten::mul"):
        return all(is_nonnegative_size(v, positive) for v in node.inputs())
    if is_size_arithmetic(node) and node.kind() == "aten::floordiv":
        return not positive and is_nonnegative_size(node.inputsAt(0)) and is_nonnegative_size(node.inputsAt(1), True)
    return False


# ---------------------------------------------------------------------------------------------
# Lowering context: maps TorchScript values of one cluster to ONNX names
# ---------------------------------------------------------------------------------------------

class LowerCtx:
    def __init__(self, builder: OnnxBuilder, names: dict, run_time: dict | None = None):
        self.b = builder
        self.names = names  # torch.Value -> ONNX name (or list of names for Tensor[])
        # value -> {dim: its sizes at every probe point} for the dims that are run-time sizes
        # (blade/dynamic.py); a rule writing a shape into the ONNX graph writes those so that the
        # graph holds at every size (target_shape). Two run-time dims are the same size when they
        # agree at every probe, not at the one being lowered (seq 1 makes batch * seq = batch).
        self.run_time = run_time or {}

    def same_run_time_dim(self, a: torch.Value, da: int, b: torch.Value, db: int) -> bool:
        """Whether dim da of a and dim db of b are run-time dims of equal sizes at every probe."""
        column = self.run_time.get(a, {}).get(da)
        return column is not None and column == self.run_time.get(b, {}).get(db)

    def tensor(self, value: torch.Value) -> str:
        """ONNX name of a tensor value; constant tensors become initializers on first use."""
        if value not in self.names:
            if value.node().kind() != "prim::Constant":
                raise LoweringError(f"value %{value.debugName()} is not available in the cluster")
            tensor = torch.as_tensor(value.toIValue()).detach().contiguous()
            self.names[value] = self.b.constant(tensor.numpy(), "w")
        return self.names[value]

    def size(self, value: torch.Value) -> str:
        """A constant or run-time int argument as a 0-d int64 ONNX value (is_size_value: the
        ``aten::size`` computing it is in the cluster)."""
        if is_constant(value):
            return self.scalar(self.const(value), np.int64)
        if value not in self.names:
            raise LoweringError(f"size %{value.debugName()} is not computed in the cluster")
        return self.names[value]

    def sizes(self, values: list) -> str:
        """Ints (Python ints, int arguments, or ONNX names of 0-d int64 sizes) as a 1-d int64 ONNX
        value: a constant when they all are, else the run-time ones computed from shapes."""
        if all(isinstance(v, int) or (not isinstance(v, str) and is_constant(v)) for v in values):
            return self.b.ints([v if isinstance(v, int) else self.const(v) for v in values])
        # constants as 1-d constants (an Unsqueeze of one would be data to the engine, and a Concat
        # of sizes with data is no longer sizes), run-time ones unsqueezed
        parts = [self.b.ints([v if isinstance(v, int) else self.const(v)])
                 if isinstance(v, int) or (not isinstance(v, str) and is_constant(v)) else
                 self.b.op("Unsqueeze", [v if isinstance(v, str) else self.size(v), self.b.ints([0])]) for v in values]
        return self.b.op("Concat", parts, axis=0)

    def dim_size(self, value: torch.Value, d: int):
        """Dim d of a tensor: an int, or for a run-time dim the ONNX name of a 0-d int64 read
        from its shape (the same ONNX at every size)."""
        if d not in self.run_time.get(value, set()):
            return self.shape(value)[d]
        return self.read_dim(value, d)

    def read_dim(self, value: torch.Value, d: int) -> str:
        """Dim d of a tensor read from its shape at run time: the ONNX name of a 0-d int64."""
        return self.b.op("Squeeze", [self.b.op("Shape", [self.tensor(value)], start=d, end=d + 1), self.b.ints([0])])

    def const(self, value: torch.Value):
        result = constant_value(value)
        if result is _NOT_CONSTANT:
            raise LoweringError(f"argument %{value.debugName()} is not a constant")
        return result

    def dtype(self, value: torch.Value) -> np.dtype:
        return TORCH_TO_NP[value.type().dtype()]

    def shape(self, value: torch.Value) -> list[int]:
        return list(value.type().sizes())

    def target_shape(self, value: torch.Value, source: torch.Value) -> tuple[list, int]:
        """(shape, allowzero) of an ONNX Reshape from source to value's shape. Static: the shape
        itself (allowzero=1: a 0 is an empty dim). With run-time dims: each one is 0 ("copy the
        input's dim") where the source has the same run-time dim at that position, and at most one
        other is -1 (inferred), so the constant holds at every size."""
        out = self.shape(value)
        varying = self.run_time.get(value, set())
        if not varying:
            return out, 1
        src = self.shape(source)
        target, rest = list(out), []
        for d in sorted(varying):
            if d < len(src) and self.same_run_time_dim(value, d, source, d):
                target[d] = 0
            else:
                rest.append(d)
        if len(rest) > 1 or any(out[d] == 0 for d in range(len(out)) if d not in varying):
            raise LoweringError(f"a reshape to {out} with run-time dims {sorted(rest)} that no single -1 infers")
        if rest:
            target[rest[0]] = -1
        return target, 0

    def expand_shape(self, value: torch.Value, source: torch.Value) -> list:
        """The shape of an ONNX Expand from source to value's shape: a run-time dim the source
        already has is 1 (broadcasting keeps the source's), so the constant holds at every size."""
        out = self.shape(value)
        varying = self.run_time.get(value, set())
        src = self.shape(source)
        target = list(out)
        for d in varying:
            s = d - (len(out) - len(src))
            if s < 0 or not self.same_run_time_dim(value, d, source, s):
                raise LoweringError(f"an expand to run-time dim {d} of {out} from {src}")
            target[d] = 1
        return target

    def cast(self, name: str, have: np.dtype, want: np.dtype) -> str:
        return name if have == want else self.b.op("Cast", [name], to=_onnx_type(want))

    def as_dtype(self, value: torch.Value, want: np.dtype) -> str:
        """A tensor or scalar argument as an ONNX value of dtype `want`."""
        if is_tensor(value):
            return self.cast(self.tensor(value), self.dtype(value), want)
        return self.scalar(self.const(value), want)

    def scalar(self, number, dtype: np.dtype) -> str:
        return self.b.constant(np.asarray(number, dtype=dtype), "s")


def _onnx_type(dtype: np.dtype) -> int:
    from blade.cluster.onnx_builder import NP_TO_ONNX
    return NP_TO_ONNX[np.dtype(dtype)]


def _out_dtype(node) -> np.dtype:
    return TORCH_TO_NP[node.output().type().dtype()]


def _args(node) -> list:
    return list(node.inputs())


def _promoted_dtype(a: torch.Value, b: torch.Value) -> np.dtype:
    """torch's result type of two operands (what a comparison computes in): tensors stand in as
    tiny tensors of the same dtype and dimensionality class, scalars as themselves."""
    def probe(value):
        if is_tensor(value):
            return torch.empty((1,) if value.type().dim() else (), dtype=value.type().dtype())
        return constant_value(value)
    return TORCH_TO_NP[torch.result_type(probe(a), probe(b))]


# ---------------------------------------------------------------------------------------------
# Rule kinds
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    lower: Callable[[LowerCtx, torch.Node], list]
    # Extra condition beyond the generic ones: returns a reason when the node is NOT supported.
    check: Optional[Callable[[torch.Node], Optional[str]]] = None
    tensor_lists: bool = False  # the node consumes or produces Tensor[] values
    # its non-tensor arguments may be run-time sizes (is_size_value), read with LowerCtx.size(s)
    size_args: bool = False


def binary(onnx_op: str, reverse: bool = False):
    """out = a <op> b*alpha (alpha when the schema has one), computed in the output dtype;
    reversed (rsub): out = b <op> a*alpha, alpha scaling self as torch's rsub does."""
    def lower(ctx: LowerCtx, node):
        args = _args(node)
        dtype = _out_dtype(node)
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
        a_val, b_val = _args(node)[:2]
        dtype = _promoted_dtype(a_val, b_val)
        out = ctx.b.op(onnx_op, [ctx.as_dtype(a_val, dtype), ctx.as_dtype(b_val, dtype)])
        return [ctx.b.op("Not", [out]) if negate else out]
    return lower


def unary(*onnx_ops: str):
    """A chain of unary ONNX ops applied to the input cast to the output dtype."""
    def lower(ctx: LowerCtx, node):
        x = ctx.as_dtype(_args(node)[0], _out_dtype(node))
        for op in onnx_ops:
            x = ctx.b.op(op, [x])
        return [x]
    return lower


def rounding(onnx_op: str):
    """floor/ceil: integers are already integral (through a float they would lose precision, and
    int64 max would overflow)."""
    def lower(ctx: LowerCtx, node):
        x = ctx.as_dtype(_args(node)[0], _out_dtype(node))
        return [ctx.b.op("Identity" if np.issubdtype(_out_dtype(node), np.integer) else onnx_op, [x])]
    return lower


def _sign(ctx: LowerCtx, node):
    """sign/sgn: a bool is its own sign (the engine's Sign is for numbers)."""
    x = ctx.as_dtype(_args(node)[0], _out_dtype(node))
    return [ctx.b.op("Identity" if _out_dtype(node) == np.bool_ else "Sign", [x])]


def identity(ctx: LowerCtx, node):
    return [ctx.b.op("Identity", [ctx.tensor(_args(node)[0])])]


def cast_to_output(ctx: LowerCtx, node):
    x = _args(node)[0]
    name = ctx.cast(ctx.tensor(x), ctx.dtype(x), _out_dtype(node))
    return [name if name != ctx.tensor(x) else ctx.b.op("Identity", [name])]


def reshape_exact(ctx: LowerCtx, name: str, shape: list) -> str:
    """Reshape to a fully known shape. allowzero: a 0 in it is an empty dim, not ONNX's default
    "copy this dim of the input" (a (0, 3) tensor viewed as (3, 0) would become (3, 3))."""
    return ctx.b.op("Reshape", [name, ctx.b.ints(shape)], allowzero=1)


def reshape_to_output(ctx: LowerCtx, node):
    """view/reshape/flatten/expand-free reshapes: the output's static shape says it all (with
    run-time sizes, ctx.target_shape, else the run-time sizes the view takes)."""
    source = _args(node)[0]
    try:
        shape, allowzero = ctx.target_shape(node.output(), source)
    except LoweringError:
        if node.kind() in ("aten::view_as", "aten::reshape_as"):  # to the other tensor's run-time shape
            return [ctx.b.op("Reshape", [ctx.tensor(source), ctx.b.op("Shape", [ctx.tensor(_args(node)[1])])],
                             allowzero=1)]
        if node.kind() in ("aten::flatten", "aten::unflatten"):  # the shape from the source's dims
            return [ctx.b.op("Reshape", [ctx.tensor(source), _regrouped_shape(ctx, node)], allowzero=0)]
        sizes = _args(node)[1] if len(_args(node)) > 1 else None
        items = run_time_size_list(sizes)
        if items is None:
            raise
        # a -1 among them is ONNX's inferred dim; the engine takes it only where it proves the
        # element count a multiple of the other dims at every size (ir._reshape)
        return [ctx.b.op("Reshape", [ctx.tensor(source), ctx.sizes(items)], allowzero=0)]
    return [ctx.b.op("Reshape", [ctx.tensor(source), ctx.b.ints(shape)], allowzero=allowzero)]


# ---------------------------------------------------------------------------------------------
# Op-specific rules
# ---------------------------------------------------------------------------------------------

def _div(ctx: LowerCtx, node):
    args = _args(node)
    mode = ctx.const(args[2]) if len(args) > 2 else None
    dtype = _out_dtype(node)
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
    zero = ctx.scalar(0, dtype)
    remainder = ctx.b.op("Sub", [a, ctx.b.op("Mul", [quotient, b])])
    signs_differ = ctx.b.op("Not", [ctx.b.op("Equal", [ctx.b.op("Less", [remainder, zero]),
                                                       ctx.b.op("Less", [b, zero])])])
    inexact = ctx.b.op("Not", [ctx.b.op("Equal", [remainder, zero])])
    step_down = ctx.b.op("And", [inexact, signs_differ])
    return ctx.b.op("Where", [step_down, ctx.b.op("Sub", [quotient, ctx.scalar(1, dtype)]), quotient])


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
    signs_differ = op("Not", [op("Equal", [op("Less", [b, zero]), op("Less", [mod, zero])])])
    step_down = op("And", [op("Not", [op("Equal", [mod, zero])]), signs_differ])
    div = op("Where", [step_down, op("Sub", [div, ctx.scalar(1, dtype)]), div])
    floored = op("Floor", [div])
    rounds_up = op("Greater", [op("Sub", [div, floored]), ctx.scalar(0.5, dtype)])
    floored = op("Where", [rounds_up, op("Add", [floored, ctx.scalar(1, dtype)]), floored])
    floored = op("Where", [op("Equal", [div, zero]), op("Mul", [q, zero]), floored])
    return op("Where", [op("Equal", [b, zero]), q, floored])


def _pow(ctx: LowerCtx, node):
    base, exponent = _args(node)[:2]
    dtype = _out_dtype(node)  # (the engine turns small constant exponents into multiplies)
    return [ctx.b.op("Pow", [ctx.as_dtype(base, dtype), ctx.as_dtype(exponent, dtype)])]


def _gelu(ctx: LowerCtx, node):
    args = _args(node)
    approximate = ctx.const(args[1]) if len(args) > 1 else "none"
    return [ctx.b.op("Gelu", [ctx.tensor(args[0])], approximate=approximate)]


def _where(ctx: LowerCtx, node):
    cond, x, y = _args(node)[:3]
    dtype = _out_dtype(node)
    return [ctx.b.op("Where", [ctx.tensor(cond), ctx.as_dtype(x, dtype), ctx.as_dtype(y, dtype)])]


def _masked_fill(ctx: LowerCtx, node):
    x, mask, value = _args(node)[:3]
    dtype = _out_dtype(node)
    return [ctx.b.op("Where", [ctx.tensor(mask), ctx.as_dtype(value, dtype), ctx.tensor(x)])]


def _clamp(ctx: LowerCtx, node):
    args = _args(node)
    dtype = _out_dtype(node)
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


def _reduce_axes(ctx: LowerCtx, node, dim_index: int) -> list[int]:
    args = _args(node)
    rank = len(ctx.shape(args[0]))
    dims = ctx.const(args[dim_index]) if len(args) > dim_index else None
    if dims is None or dims == []:
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else dims
    return sorted(d % rank if rank else 0 for d in dims)


def reduce(onnx_op: str):
    """sum/mean/amax/amin(x, dim, keepdim, dtype?) -- also the dim-less sum(x, dtype) overload."""
    def lower(ctx: LowerCtx, node):
        args = _args(node)
        x = ctx.as_dtype(args[0], _out_dtype(node))
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
        x, dim = _args(node)[:2]
        return [ctx.b.op(onnx_op, [ctx.as_dtype(x, _out_dtype(node))], axis=ctx.const(dim))]
    return lower


def _layer_norm(ctx: LowerCtx, node):
    x, normalized_shape, weight, bias, eps = _args(node)[:5]
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


def _transpose_last2(ctx: LowerCtx, name: str, rank: int) -> str:
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return ctx.b.op("Transpose", [name], perm=perm)


def _linear(ctx: LowerCtx, node):
    x, weight, bias = _args(node)[:3]
    out = ctx.b.op("MatMul", [ctx.tensor(x), _transpose_last2(ctx, ctx.tensor(weight), len(ctx.shape(weight)))])
    if is_tensor(bias):
        out = ctx.b.op("Add", [out, ctx.tensor(bias)])
    return [out]


def _matmul(ctx: LowerCtx, node):
    a, b = _args(node)[:2]
    return [ctx.b.op("MatMul", [ctx.tensor(a), ctx.tensor(b)])]


def _einsum(ctx: LowerCtx, node):
    """einsum(equation, tensors, path=None): pairwise batched products (blade/cluster/einsum.py);
    a contraction path only reorders them, so it is not read."""
    equation, tensors = _args(node)[:2]
    members = list(tensors.node().inputs())
    return [einsum.lower(ctx, ctx.const(equation), members)]


def _einsum_check(node):
    equation, tensors = _args(node)[:2]
    if tensors.node().kind() != "prim::ListConstruct" or not is_constant(equation):
        return "aten::einsum of a list not built by prim::ListConstruct or a computed equation"
    shapes = [static_shape_of(v) for v in tensors.node().inputs()]
    if any(shape is None for shape in shapes):
        return "aten::einsum of an operand without a static shape"
    return einsum.refusal(constant_value(equation), shapes)


def _scaled_add(ctx: LowerCtx, node, product: str):
    """beta * input + alpha * product (addmm/baddbmm epilogue)."""
    args = _args(node)
    dtype = _out_dtype(node)
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
    args = _args(node)
    return _scaled_add(ctx, node, ctx.b.op("MatMul", [ctx.tensor(args[1]), ctx.tensor(args[2])]))


def _permute(ctx: LowerCtx, node):
    x, dims = _args(node)[:2]
    rank = len(ctx.shape(x))
    if rank == 0:  # ONNX cannot spell an empty perm attribute
        return identity(ctx, node)
    return [ctx.b.op("Transpose", [ctx.tensor(x)], perm=[d % rank for d in ctx.const(dims)])]


def _transpose(ctx: LowerCtx, node):
    args = _args(node)
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
    x, dim = _args(node)[:2]
    rank = len(ctx.shape(x)) + 1
    return [ctx.b.op("Unsqueeze", [ctx.tensor(x), ctx.b.ints([ctx.const(dim) % rank])])]


def _squeeze(ctx: LowerCtx, node):
    args = _args(node)
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
    source = _args(node)[0]
    try:
        shape = ctx.b.ints(ctx.expand_shape(node.output(), source))
    except LoweringError:
        if node.kind() == "aten::expand_as":  # to the other tensor's run-time shape (its ONNX Shape)
            return [ctx.b.op("Expand", [ctx.tensor(source), ctx.b.op("Shape", [ctx.tensor(_args(node)[1])])])]
        sizes = run_time_size_list(_args(node)[1])
        if node.kind() != "aten::expand" or sizes is None:
            raise
        # the run-time sizes expanded to; -1 (keep the source's dim) is 1 to ONNX's broadcast
        items = [1 if is_constant(v) and ctx.const(v) == -1 else v for v in sizes]
        shape = ctx.sizes(items)
    return [ctx.b.op("Expand", [ctx.tensor(source), shape])]


def _slice_onnx(ctx: LowerCtx, x: str, dim: int, start, end, step: int = 1) -> str:
    """x[start:end:step] along dim; start and end: ints, or run-time sizes (is_size_value)."""
    return ctx.b.op("Slice", [x, ctx.sizes([start]), ctx.sizes([end]), ctx.b.ints([dim]), ctx.b.ints([step])])


def _slice(ctx: LowerCtx, node):
    x, dim, start, end, step = _args(node)[:5]
    rank = len(ctx.shape(x))
    start = start if is_size_value(start) else ctx.const(start)
    end = end if is_size_value(end) else ctx.const(end)
    return [_slice_onnx(ctx, ctx.tensor(x), ctx.const(dim) % rank, 0 if start is None else start,
                        INT64_MAX if end is None else end, ctx.const(step))]


def _size(ctx: LowerCtx, node):
    """aten::size(x, dim) of a run-time dim: read from x's shape (0-d int64), so ops reading the
    size compute at every size in range."""
    x, dim = _args(node)
    return [ctx.read_dim(x, ctx.const(dim) % len(ctx.shape(x)))]


def _size_check(node):
    x, dim = (list(node.inputs()) + [None])[:2]
    if dim is None or not is_constant(dim) or not is_tensor(x):
        return "aten::size of all dims (an int list) or of a computed dim"
    return None


def _arange(ctx: LowerCtx, node):
    """arange(end) / arange(start, end[, step]): ONNX Range, its start and end constants or
    run-time sizes (the engine's Range takes them as expressions of its size symbols)."""
    args = _named(node)
    dtype = _out_dtype(node)

    def bound(key: str, default: int) -> str:
        if key not in args or is_constant(args[key]):
            return ctx.scalar(ctx.const(args[key]) if key in args else default, dtype)
        return ctx.cast(ctx.size(args[key]), np.dtype("int64"), dtype)
    return [ctx.b.op("Range", [bound("start", 0), bound("end", 0), bound("step", 1)])]


def _arange_check(node):
    args = _named(node)
    if "end" not in args:
        return "arange without an end"
    bounds = {key: constant_value(args[key]) if key in args else default
              for key, default in (("start", 0), ("end", 0), ("step", 1))}
    run_time = [key for key, value in bounds.items() if value is _NOT_CONSTANT]
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
        a, b = _args(node)
        return [ctx.b.op(onnx_op, [ctx.size(a), ctx.size(b)])]
    return lower


def _floordiv_check(node):
    a, b = _args(node)
    if not (is_nonnegative_size(a) and is_nonnegative_size(b, positive=True)):
        return "floordiv of sizes whose operands are not provably non-negative (ONNX Div truncates)"
    return None


def _narrow(ctx: LowerCtx, node):
    x, dim, start, length = _args(node)[:4]
    rank = len(ctx.shape(x))
    dim = ctx.const(dim) % rank
    begin = ctx.const(start) % ctx.shape(x)[dim] if ctx.shape(x)[dim] else 0
    return [_slice_onnx(ctx, ctx.tensor(x), dim, begin, begin + ctx.const(length))]


def _select(ctx: LowerCtx, node):
    x, dim, index = _args(node)[:3]
    rank = len(ctx.shape(x))
    dim = ctx.const(dim) % rank
    index = ctx.const(index) % ctx.shape(x)[dim]
    sliced = _slice_onnx(ctx, ctx.tensor(x), dim, index, index + 1)
    return [ctx.b.op("Squeeze", [sliced, ctx.b.ints([dim])])]


def _cat(ctx: LowerCtx, node):
    tensors, dim = _args(node)[:2]
    members = list(tensors.node().inputs())
    # torch.cat skips 1-D empty tensors (legacy behaviour that e.g. an empty KV cache relies on)
    kept = [ctx.tensor(v) for v in members if ctx.shape(v) != [0]]
    rank = len(ctx.shape(node.output()))
    if len(kept) == 1:
        return [ctx.b.op("Identity", kept)]
    return [ctx.b.op("Concat", kept, axis=ctx.const(dim) % rank)]


def _diff(ctx: LowerCtx, node):
    """diff(x, n, dim, prepend, append): prepend and append joined to x along dim, then n times the
    neighbours' difference x[1:] - x[:-1] (!= for bools, as torch)."""
    x, n, dim, prepend, append = _args(node)[:5]
    dtype, axis = _out_dtype(node), ctx.const(dim) % len(ctx.shape(x))
    parts = [ctx.as_dtype(v, dtype) for v in (prepend, x, append) if is_tensor(v)]
    out = parts[0] if len(parts) == 1 else ctx.b.op("Concat", parts, axis=axis)
    for _ in range(ctx.const(n)):
        later, earlier = _slice_onnx(ctx, out, axis, 1, INT64_MAX), _slice_onnx(ctx, out, axis, 0, -1)
        out = ctx.b.op("Xor" if dtype == np.bool_ else "Sub", [later, earlier])
    return [out if out != ctx.tensor(x) else ctx.b.op("Identity", [out])]


def _diff_check(node):
    x, n, _, prepend, append = _args(node)[:5]
    if not is_constant(n) or constant_value(n) < 0:
        return "aten::diff with a run-time or negative n"
    if any(is_tensor(v) and v.type().dim() != x.type().dim() for v in (prepend, append)):
        return "aten::diff with a prepend/append of another rank than the input (a 0-d one is expanded)"
    return None


def _embedding(ctx: LowerCtx, node):
    weight, indices = _args(node)[:2]
    rows = ctx.shape(weight)[0]
    ids = _index_in_range(ctx, _int64(ctx, indices), rows, wraps=False, past_end=rows)
    return [ctx.b.op("Gather", [ctx.tensor(weight), ids], axis=0)]


def _split(ctx: LowerCtx, node):
    """split(x, size, dim) / split_with_sizes(x, sizes, dim) / chunk(x, n, dim) -> a list."""
    x, sizes, dim = _args(node)[:3]
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
        outputs.append(_slice_onnx(ctx, ctx.tensor(x), dim, begin, begin + size))
        begin += size
    return [outputs]


def _list_construct(ctx: LowerCtx, node):
    """A Tensor[] (names of its tensors), or a list of run-time sizes (read by its consumer's rule
    from the TorchScript list itself)."""
    return [[ctx.tensor(v) if is_tensor(v) else None for v in node.inputs()]]


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
    x, index_list = _args(node)[:2]
    rank = len(ctx.shape(x))
    size = [ctx.dim_size(x, d) for d in range(rank)]  # ints, or ONNX sizes for run-time dims
    entries = _index_tensors(ctx, index_list)
    dims = [d for d, e in enumerate(entries) if e is not None]
    first, last = dims[0], dims[-1] + 1
    linear, stride = None, 1
    extent = _size_product(ctx, [size[d] for d in dims])  # of the flattened dims the Gather reads
    for d in reversed(dims):
        i = _index_in_range(ctx, entries[d], size[d], wraps=True, past_end=extent)
        term = i if isinstance(stride, int) and stride == 1 else ctx.b.op("Mul", [i, _int64_size(ctx, stride)])
        linear = term if linear is None else ctx.b.op("Add", [linear, term])
        stride = _size_product(ctx, [stride, size[d]])
    target = size[:first] + [stride] + size[last:]
    flat = reshape_exact(ctx, ctx.tensor(x), target) if all(isinstance(n, int) for n in target) else \
        ctx.b.op("Reshape", [ctx.tensor(x), ctx.sizes(target)], allowzero=1)
    return [ctx.b.op("Gather", [flat, linear], axis=first)]


def _int64_size(ctx: LowerCtx, n) -> str:
    """A size (an int, or the ONNX name of a run-time one) as a 0-d int64 ONNX value."""
    return ctx.scalar(n, np.int64) if isinstance(n, int) else n


def _regrouped_shape(ctx: LowerCtx, node) -> str:
    """flatten(x, start, end) / unflatten(x, dim, sizes) as a shape computed from x's dims (read at
    run time where they are run-time): the dims kept, the product of the merged ones, the sizes a
    dim splits into (one -1 among them is inferred). DeBERTa's [b, h, s, d] -> [b * h, s, d] has
    two run-time dims no single -1 infers."""
    x, rank = _args(node)[0], len(ctx.shape(_args(node)[0]))
    dims = [ctx.dim_size(x, d) for d in range(rank)]
    if node.kind() == "aten::flatten":
        start, end = (ctx.const(a) % max(rank, 1) for a in _args(node)[1:3])
        items = dims[:start] + [_size_product(ctx, dims[start:end + 1])] + dims[end + 1:]
    else:
        dim, sizes = ctx.const(_args(node)[1]) % rank, ctx.const(_args(node)[2])
        if any(n == 0 for n in sizes):
            raise LoweringError("unflatten into an empty dim with run-time sizes")
        items = dims[:dim] + list(sizes) + dims[dim + 1:]
    return ctx.sizes(items)


def _size_product(ctx: LowerCtx, sizes: list):
    """The product of sizes: an int while they are static, else an ONNX value."""
    if all(isinstance(n, int) for n in sizes):
        return int(np.prod(sizes))
    product = None
    for n in sizes:
        product = _int64_size(ctx, n) if product is None else ctx.b.op("Mul", [product, _int64_size(ctx, n)])
    return product


def _index_check(node):
    entries = _args(node)[1]
    if entries.node().kind() == "prim::ListConstruct":
        items = [v if is_tensor(v) else None for v in entries.node().inputs()]
        dtypes = [v.type().dtype() for v in items if v is not None]
    else:
        items = constant_value(entries)
        if items is _NOT_CONSTANT:
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
    size = _int64_size(ctx, n)
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
                              ctx.b.op("GreaterOrEqual", [index, _int64_size(ctx, n)])])
    past = ctx.scalar(max(past_end, 1), np.int64) if isinstance(past_end, int) else \
        ctx.b.op("Max", [past_end, ctx.scalar(1, np.int64)])
    return ctx.b.op("Where", [outside, past, index])


def _int64(ctx: LowerCtx, index: torch.Value) -> str:
    return ctx.cast(ctx.tensor(index), ctx.dtype(index), np.dtype("int64"))


def _dims_to_axes(dims, rank: int) -> list:
    """A dim argument (int, list, None or []) as sorted non-negative axes; none given = all."""
    if dims is None or dims == []:
        return list(range(rank))
    return sorted(d % max(rank, 1) for d in ([dims] if isinstance(dims, int) else dims))


def _list_unpack(ctx: LowerCtx, node):
    return list(ctx.names[_args(node)[0]])


def _list_getitem(ctx: LowerCtx, node):
    items, index = _args(node)[:2]
    return [ctx.b.op("Identity", [ctx.names[items][ctx.const(index)]])]


def _sdpa(ctx: LowerCtx, node):
    """softmax(q @ k^T * scale + mask) @ v, with a causal or explicit (bool/float) mask."""
    q, k, v, mask, _dropout, is_causal = _args(node)[:6]
    scale_arg = _args(node)[6] if len(_args(node)) > 6 else None
    q_shape = ctx.shape(q)
    dtype = ctx.dtype(q)
    scale = ctx.const(scale_arg) if scale_arg is not None else None
    if scale is None:
        scale = 1.0 / float(np.sqrt(q_shape[-1]))
    keys, values = ctx.tensor(k), ctx.tensor(v)
    if len(_args(node)) > 7 and ctx.const(_args(node)[7]):  # enable_gqa: each K/V head serves a group of query heads
        keys, values = (_repeat_heads(ctx, name, ctx.shape(t), q_shape[-3]) for name, t in ((keys, k), (values, v)))
    k_t = _transpose_last2(ctx, keys, len(ctx.shape(k)))
    scores = ctx.b.op("Mul", [ctx.b.op("MatMul", [ctx.tensor(q), k_t]), ctx.scalar(scale, dtype)])
    if ctx.const(is_causal):
        rows, cols = ctx.dim_size(q, len(q_shape) - 2), ctx.dim_size(k, len(ctx.shape(k)) - 2)
        keep = _triangle_mask(ctx, rows, cols, 0, lower=True, name="causal")
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


def _spatial_list(value, spatial: int) -> list:
    value = [value] if isinstance(value, int) else list(value)
    return value * spatial if len(value) == 1 else value


def _conv(ctx: LowerCtx, node):
    """conv1d/2d/3d (padding ints, "same" or "valid") and the generic (_)convolution."""
    args = _args(node)
    x, w, bias = args[:3]
    if node.kind() in ("aten::convolution", "aten::_convolution"):
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


def _channel_param(ctx: LowerCtx, value, default: float, rank: int, dtype) -> str:
    """A per-channel [C] parameter (or its default) shaped [C, 1, ...] to broadcast over NC*."""
    name = ctx.tensor(value) if is_tensor(value) else ctx.scalar(default, dtype)
    if is_tensor(value) and rank > 2:
        name = ctx.b.op("Unsqueeze", [name, ctx.b.ints(list(range(1, rank - 1)))])
    return name


def _batch_norm(ctx: LowerCtx, node):
    """Inference batch norm: x * scale + shift, scale = weight / sqrt(var + eps), per channel."""
    x, weight, bias, mean, var = _args(node)[:5]
    eps = ctx.const(_args(node)[7])
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
    x, groups, weight, bias, eps = _args(node)[:5]
    shape, dtype = ctx.shape(x), ctx.dtype(x)
    varying = ctx.run_time.get(x, set())
    if 1 in varying:
        raise LoweringError("group_norm over a run-time channel count")
    # a run-time batch is ONNX's 0 ("copy the input's dim"), run-time spatial dims the -1; back
    # to the input's shape as the engine reads it (Shape)
    batch = 0 if 0 in varying else shape[0]
    grouped = ctx.b.op("Reshape", [ctx.tensor(x), ctx.b.ints([batch, ctx.const(groups), -1])])
    y = _normalize(ctx, grouped, [2], float(ctx.const(eps)), dtype)
    y = ctx.b.op("Reshape", [y, ctx.b.op("Shape", [ctx.tensor(x)])], allowzero=1) if varying else \
        reshape_exact(ctx, y, shape)
    return [_affine(ctx, y, weight, bias, len(shape), dtype)]


def _instance_norm(ctx: LowerCtx, node):
    x, weight, bias = _args(node)[:3]
    shape, dtype = ctx.shape(x), ctx.dtype(x)
    y = _normalize(ctx, ctx.tensor(x), list(range(2, len(shape))), float(ctx.const(_args(node)[7])), dtype)
    return [_affine(ctx, y, weight, bias, len(shape), dtype)]


def _pool_args(ctx: LowerCtx, node, spatial: int):
    args = _args(node)
    kernel = _spatial_list(ctx.const(args[1]), spatial)
    stride = ctx.const(args[2]) or kernel
    return kernel, _spatial_list(stride, spatial), _spatial_list(ctx.const(args[3]), spatial) * 2


def _max_pool(ctx: LowerCtx, node):
    """max_pool1d/2d(x, kernel, stride, padding, dilation, ceil_mode)."""
    spatial = 1 if node.kind() == "aten::max_pool1d" else 2
    kernel, stride, pads = _pool_args(ctx, node, spatial)
    dilation = _spatial_list(ctx.const(_args(node)[4]), spatial)
    return [_batched(ctx, _args(node)[0], spatial, lambda x: ctx.b.op(
        "MaxPool", [x], kernel_shape=kernel, strides=stride, pads=pads, dilations=dilation,
        ceil_mode=int(ctx.const(_args(node)[5]))))]


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
    args = _args(node)
    return [_batched(ctx, args[0], spatial, lambda x: ctx.b.op(
        "AveragePool", [x], kernel_shape=kernel, strides=stride, pads=pads, ceil_mode=int(ctx.const(args[4])),
        count_include_pad=int(ctx.const(args[5]))))]


def _avg_pool_check(node):
    args = _args(node)
    if len(args) > 6 and constant_value(args[6]) is not None:
        return "avg_pool with divisor_override"
    return None


def _adaptive_avg_pool(ctx: LowerCtx, node):
    """Output sizes that divide the input: a plain average pool (a global one for size 1)."""
    x = _args(node)[0]
    spatial = 1 if node.kind().endswith("1d") else 2
    size, out = ctx.shape(x)[-spatial:], ctx.shape(node.output())[-spatial:]
    if all(o == 1 for o in out):
        return [ctx.b.op("ReduceMean", [ctx.tensor(x), ctx.b.ints(list(range(-len(size), 0)))], keepdims=1)]
    kernel = [n // o for n, o in zip(size, out)]
    return [_batched(ctx, x, spatial, lambda name: ctx.b.op("AveragePool", [name], kernel_shape=kernel, strides=kernel))]


def _adaptive_avg_pool_check(node):
    x = _args(node)[0]
    size = static_shape_of(x)
    out = static_shape_of(node.output())
    if size and out and any(n % o for n, o in zip(size[-2:], out[-2:]) if o):
        return "adaptive_avg_pool with an output size that does not divide the input"
    return None


def static_shape_of(value):
    info = tensor_info(value) if is_tensor(value) else None
    return info[1] if info else None


def _pad(ctx: LowerCtx, node):
    """aten::pad / constant_pad_nd / reflection_pad / replication_pad: torch lists the last dim first."""
    args = _args(node)
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
    inputs = [ctx.tensor(x), ctx.b.ints(begins + ends)]
    if mode == "constant":
        inputs.append(ctx.scalar(value or 0, ctx.dtype(x)))
    return [ctx.b.op("Pad", inputs, mode=mode)]


def _conv_check(node):
    if node.output().type().dtype() != torch.float32:
        return "convolution on a dtype other than float32"
    if node.kind() in ("aten::convolution", "aten::_convolution") and constant_value(_args(node)[6]):
        return "transposed convolution"
    return None


def _instance_norm_check(node):
    if constant_value(_args(node)[5]) is not True:
        return "instance_norm with running statistics (use_input_stats=False)"
    return None


def _pad_check(node):
    args = _args(node)
    pad = constant_value(args[1])
    if isinstance(pad, list) and any(p < 0 for p in pad):
        return "pad with negative (cropping) amounts"
    if node.kind() == "aten::pad" and constant_value(args[2]) not in ("constant", "reflect", "replicate"):
        return f"pad mode {constant_value(args[2])!r}"
    return None


# ---- upsampling: per spatial axis, Gathers at constant indices (and constant weights) ----

def _upsample(ctx: LowerCtx, node):
    """upsample_nearest1d/2d and upsample_(bi)linear1d/2d, as torch computes source positions."""
    named = _named(node)
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


# ---- tensor creation: the output's measured shape/dtype plus constant arguments ----

def _named(node) -> dict:
    """The node's inputs by schema argument name (factories have several overloads)."""
    schema = torch._C.parse_schema(node.schema())
    return {arg.name: value for arg, value in zip(schema.arguments, node.inputs())}


def _filled(ctx: LowerCtx, node, value) -> list:
    """A tensor of the output's shape and dtype holding `value` everywhere: a broadcast scalar."""
    dtype = _out_dtype(node)
    return [ctx.b.op("Expand", [ctx.scalar(value, dtype), _fill_shape(ctx, node)])]


def _fill_shape(ctx: LowerCtx, node) -> str:
    """The shape a fill op makes: its static output shape; with run-time dims, a *_like op's input's
    shape read at run time, or a new_* op's run-time size list."""
    if not ctx.run_time.get(node.output()):
        return ctx.b.ints(ctx.shape(node.output()))
    if node.kind().endswith("_like"):
        return ctx.b.op("Shape", [ctx.tensor(_args(node)[0])])
    sizes = _named(node)["size"]
    items = run_time_size_list(sizes)
    if items is None:
        raise LoweringError(f"{node.kind()} to run-time dims not given as a list of sizes")
    return ctx.sizes(items)


FILL_VALUES = {"aten::zeros_like": 0, "aten::new_zeros": 0, "aten::ones_like": 1, "aten::new_ones": 1}
# zeros/ones/full(size): constant sizes fold to a constant in the frontend; these rules take the
# ones over run-time sizes (``torch.ones(seq, seq)`` of a causal mask)
CREATE_VALUES = {"aten::zeros": 0, "aten::ones": 1}


def _create(ctx: LowerCtx, node):
    args = _named(node)
    value = CREATE_VALUES[node.kind()] if node.kind() in CREATE_VALUES else ctx.const(args["fill_value"])
    sizes = args["size"]
    shape = ctx.b.ints(ctx.const(sizes)) if is_constant(sizes) else ctx.sizes(run_time_size_list(sizes))
    return [ctx.b.op("Expand", [ctx.scalar(value, _out_dtype(node)), shape])]


def _create_check(node):
    args = _named(node)
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
    return _filled(ctx, node, ctx.const(_named(node)["fill_value"]))


# ---- indexing and data movement composed of ONNX ops ----

def _dim_arg(ctx: LowerCtx, node, index: int, rank: int) -> int:
    return ctx.const(_args(node)[index]) % max(rank, 1)


def _index_select(ctx: LowerCtx, node):
    x, _, index = _args(node)[:3]
    dim = _dim_arg(ctx, node, 1, len(ctx.shape(x)))
    n = ctx.dim_size(x, dim) if ctx.shape(x) else 1  # (a run-time dim: its size read at run time)
    i = _index_in_range(ctx, _int64(ctx, index), n, wraps=False, past_end=n)
    if not ctx.shape(x):  # a 0-d input reads as [1] (ONNX Gather needs rank >= 1); the result is 0-d
        picked = ctx.b.op("Gather", [reshape_exact(ctx, ctx.tensor(x), [1]), i], axis=0)
        return [reshape_exact(ctx, picked, [])]
    return [ctx.b.op("Gather", [ctx.tensor(x), i], axis=dim)]


def _gather(ctx: LowerCtx, node):
    """torch.gather(x, dim, index): out[..i..] = x[.. index[..i..] at dim ..], via a flat Gather."""
    x, _, index = _args(node)[:3]
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
    strides = [_size_product(ctx, dims[d + 1:]) for d in range(rank)]
    i = _index_in_range(ctx, _int64(ctx, index), dims[dim], wraps=False, past_end=_size_product(ctx, dims))
    linear = ctx.b.op("Mul", [i, _int64_size(ctx, strides[dim])])
    for d in range(rank):
        if d == dim:
            continue
        steps = ctx.b.op("Range", [ctx.scalar(0, np.int64), _int64_size(ctx, ctx.dim_size(index, d)),
                                   ctx.scalar(1, np.int64)])
        offsets = ctx.b.op("Mul", [steps, _int64_size(ctx, strides[d])])
        along = ctx.b.op("Reshape", [offsets, ctx.b.ints([-1 if k == d else 1 for k in range(rank)])])
        linear = ctx.b.op("Add", [linear, along])
    flat = ctx.b.op("Reshape", [ctx.tensor(x), ctx.b.ints([-1])])
    return ctx.b.op("Gather", [flat, linear], axis=0)


def _triangle(ctx: LowerCtx, node):
    """tril/triu(x, diagonal): a Where against a constant mask over the last two dims."""
    x, diagonal = _args(node)[:2]
    rank = len(ctx.shape(x))
    rows, cols = ctx.dim_size(x, rank - 2), ctx.dim_size(x, rank - 1)
    keep = _triangle_mask(ctx, rows, cols, ctx.const(diagonal), lower=node.kind() == "aten::tril")
    return [ctx.b.op("Where", [keep, ctx.tensor(x), ctx.scalar(0, ctx.dtype(x))])]


def _triangle_mask(ctx: LowerCtx, rows, cols, diagonal: int, lower: bool, name: str = "mask") -> str:
    """[rows, cols] bools: column - row <= diagonal (lower) or >= diagonal. Static sizes: a
    constant. Run-time sizes (torch.ones(s, s).triu(1), sdpa's is_causal over the sequence): the
    rows and columns counted at run time (Range) and compared."""
    if isinstance(rows, int) and isinstance(cols, int):
        pick = np.tril if lower else np.triu
        return ctx.b.constant(pick(np.ones((rows, cols), bool), diagonal), name)

    def positions(n):
        return ctx.b.op("Range", [ctx.scalar(0, np.int64), _int64_size(ctx, n), ctx.scalar(1, np.int64)])
    row = ctx.b.op("Unsqueeze", [positions(rows), ctx.b.ints([1])])
    offset = ctx.b.op("Sub", [positions(cols), row])
    return ctx.b.op("LessOrEqual" if lower else "GreaterOrEqual", [offset, ctx.scalar(diagonal, np.int64)])


def _repeat(ctx: LowerCtx, node):
    """x.repeat(r): view x as [1, a, 1, b], expand to [r0, a, r1, b], flatten pairs. Static: those
    shapes as constants. With run-time sizes (in x, or counts: ``positions.unsqueeze(0).repeat(batch,
    1)``, Whisper) the same three steps with shapes computed from x's dims and the counts."""
    x, repeats = _args(node)[:2]
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
    merged = [_size_product(ctx, [r, n]) for r, n in zip(counts, shape)]
    return [ctx.b.op("Reshape", [wide, ctx.sizes(merged)], allowzero=0)]


def _repeat_interleave(ctx: LowerCtx, node):
    """repeat_interleave(x, r, dim): each element r times in a row: view x as [.., n, 1, ..],
    expand to [.., n, r, ..], merge the pair (dim None: of the flattened x)."""
    x, repeats, dim = _args(node)[:3]
    shape, r, dim = ctx.shape(x), ctx.const(repeats), ctx.const(dim)
    name = ctx.tensor(x)
    if dim is None:
        shape, dim, name = [int(np.prod(shape))], 0, reshape_exact(ctx, name, [int(np.prod(shape))])
    dim %= max(len(shape), 1)
    spread = reshape_exact(ctx, name, shape[:dim + 1] + [1] + shape[dim + 1:])
    wide = ctx.b.op("Expand", [spread, ctx.b.ints(shape[:dim + 1] + [r] + shape[dim + 1:])])
    return [reshape_exact(ctx, wide, ctx.shape(node.output()))]


def _repeat_interleave_check(node):
    args = _args(node)
    if len(args) < 3 or is_tensor(args[1]) or not isinstance(constant_value(args[1]), int):
        return "repeat_interleave with per-element (tensor) repeats"
    if static_shape_of(args[0]) == [] and constant_value(args[2]) is not None:
        return "repeat_interleave along a dim of a 0-d tensor (eager raises)"
    return None


def _roll(ctx: LowerCtx, node):
    """roll(x, shifts, dims): per dim, the last `shift` elements move to the front."""
    x, shifts, dims = _args(node)[:3]
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
    x, dims = _args(node)[:2]
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
        return ctx.b.op("Concat", [_slice_onnx(ctx, name, dim, k, n), _slice_onnx(ctx, name, dim, 0, k)], axis=dim)
    if shift > 0:
        k = ctx.b.op("Sub", [n, ctx.b.op("Mod", [ctx.scalar(shift, np.int64), n])])
    else:
        k = ctx.b.op("Mod", [ctx.scalar(-shift, np.int64), n])
    twice = ctx.b.op("Concat", [name, name], axis=dim)
    return _slice_onnx(ctx, twice, dim, k, ctx.b.op("Add", [k, n]))


def _stack(ctx: LowerCtx, node):
    tensors, dim = _args(node)[:2]
    rank = len(ctx.shape(node.output()))
    axis = ctx.const(dim) % rank
    parts = [ctx.b.op("Unsqueeze", [ctx.tensor(v), ctx.b.ints([axis])]) for v in tensors.node().inputs()]
    return [ctx.b.op("Concat", parts, axis=axis) if len(parts) > 1 else ctx.b.op("Identity", parts)]


def _unbind(ctx: LowerCtx, node):
    x, dim = _args(node)[:2]
    shape = ctx.shape(x)
    dim = ctx.const(dim) % len(shape)
    return [[ctx.b.op("Squeeze", [_slice_onnx(ctx, ctx.tensor(x), dim, k, k + 1), ctx.b.ints([dim])])
             for k in range(shape[dim])]]


def _cumsum(ctx: LowerCtx, node):
    """cumsum(x, dim): ONNX CumSum (the engine's scan: a running sum along the axis)."""
    x, dim = _args(node)[:2]
    dtype = _out_dtype(node)
    rank = len(ctx.shape(x))
    if rank == 0:
        return [ctx.as_dtype(x, dtype)]
    axis = ctx.b.constant(np.asarray(ctx.const(dim) % rank, dtype=np.int64), "axis")
    return [ctx.b.op("CumSum", [ctx.as_dtype(x, dtype), axis])]


# ---- reductions composed of ONNX ops ----

def _var_std(ctx: LowerCtx, node):
    """var/std(x, dim, correction|unbiased, keepdim): mean of squared deviations / (n - correction)."""
    named = _named(node)
    x = named["self"]
    dtype = _out_dtype(node)
    shape = ctx.shape(x)
    axes = _dims_to_axes(ctx.const(named["dim"]) if "dim" in named else None, len(shape))
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
    return ctx.b.op("Cast", [divisor], to=_onnx_type(f64))


def _norm(ctx: LowerCtx, node):
    """norm / linalg_vector_norm with p = 2 (sqrt of sum of squares), 1, inf."""
    named = _named(node)
    x = named.get("self", named.get("input"))
    p = ctx.const(named["p"]) if "p" in named else ctx.const(named["ord"]) if "ord" in named else 2
    p = 2 if p is None else p
    keepdim = int(bool(ctx.const(named["keepdim"]))) if "keepdim" in named else 0
    axes = _dims_to_axes(ctx.const(named["dim"]) if "dim" in named else None, len(ctx.shape(x)))
    xs = ctx.b.op("Abs", [ctx.as_dtype(x, _out_dtype(node))])
    if p == float("inf"):
        return [ctx.b.op("ReduceMax", [xs, ctx.b.ints(axes)], keepdims=keepdim)]
    if p == 1:
        return [ctx.b.op("ReduceSum", [xs, ctx.b.ints(axes)], keepdims=keepdim)]
    return [ctx.b.op("Sqrt", [ctx.b.op("ReduceSum", [ctx.b.op("Mul", [xs, xs]), ctx.b.ints(axes)], keepdims=keepdim)])]


def _norm_check(node):
    named = _named(node)
    p = constant_value(named["p"]) if "p" in named else constant_value(named["ord"]) if "ord" in named else 2
    if p not in (None, 1, 2, float("inf")):
        return f"norm with p={p} (1, 2 and inf are supported)"
    if "dtype" in named and constant_value(named["dtype"]) is not None:
        return "norm with a dtype argument"
    return None


def _logsumexp(ctx: LowerCtx, node):
    x, dims, keepdim = _args(node)[:3]
    axes = _dims_to_axes(ctx.const(dims), len(ctx.shape(x)))
    xs = ctx.as_dtype(x, _out_dtype(node))
    peak = ctx.b.op("ReduceMax", [xs, ctx.b.ints(axes)], keepdims=1)
    # an infinite peak (an all -inf slice, or a +inf element) shifts by 0 instead, as torch does:
    # -inf - -inf and inf - inf would be NaN where the result is -inf or inf
    safe = ctx.b.op("Where", [ctx.b.op("Equal", [ctx.b.op("Abs", [peak]), ctx.scalar(np.inf, _out_dtype(node))]),
                              ctx.scalar(0, _out_dtype(node)), peak])
    total = ctx.b.op("ReduceSum", [ctx.b.op("Exp", [ctx.b.op("Sub", [xs, safe])]), ctx.b.ints(axes)], keepdims=1)
    out = ctx.b.op("Add", [ctx.b.op("Log", [total]), safe])
    return [out if ctx.const(keepdim) else ctx.b.op("Squeeze", [out, ctx.b.ints(axes)])]


def _bool_reduce(onnx_op: str):
    """any/all: max/min of the input as bool."""
    def lower(ctx: LowerCtx, node):
        args = _args(node)
        x = ctx.cast(ctx.tensor(args[0]), ctx.dtype(args[0]), np.dtype(bool))
        x = ctx.b.op("Cast", [x], to=_onnx_type(np.dtype("int32")))
        rank = len(ctx.shape(args[0]))
        keepdim = int(bool(ctx.const(args[2]))) if len(args) > 2 else 0
        axes = _dims_to_axes(ctx.const(args[1]) if len(args) > 1 else None, rank)
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
        args = _args(node)
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
    args = _args(node)
    if len(args) >= 2 and not is_tensor(args[1]):
        if not args[0].type().sizes():
            return f"{node.kind()} along a dim of a 0-d tensor"
        if args[0].type().dtype() == torch.bool:
            return f"{node.kind()} along a dim of a bool tensor"
    return None


def _arg_min_max(onnx_op: str):
    """argmax/argmin(x, dim=None, keepdim): over one dim, or over the flattened tensor."""
    def lower(ctx: LowerCtx, node):
        x, dim = _args(node)[:2]
        keepdims = int(bool(ctx.const(_args(node)[2]))) if len(_args(node)) > 2 else 0
        rank = len(ctx.shape(x))
        if ctx.const(dim) is None:
            flat = ctx.b.op("Reshape", [ctx.tensor(x), ctx.b.ints([-1])])
            out = ctx.b.op(onnx_op, [flat], axis=0, keepdims=0)
            return [ctx.b.op("Reshape", [out, ctx.b.ints([1] * rank)]) if keepdims else out]
        return [ctx.b.op(onnx_op, [ctx.tensor(x)], axis=ctx.const(dim) % max(rank, 1), keepdims=keepdims)]
    return lower


def _arg_min_max_check(node):
    x = _args(node)[0]
    if not x.type().sizes():
        return f"{node.kind()} of a 0-d tensor"
    if x.type().dtype() == torch.bool:
        return f"{node.kind()} of a bool tensor"
    return None


# ---- activations composed of elementwise ONNX ops ----

def _activation(build):
    """A rule from build(ctx, x, dtype, *constant args) -> ONNX name."""
    def lower(ctx: LowerCtx, node):
        args = _args(node)
        dtype = _out_dtype(node)
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
}


# ---------------------------------------------------------------------------------------------
# Checks (return a reason when the node is not supported)
# ---------------------------------------------------------------------------------------------

def _needs_const_false(index: int, what: str):
    def check(node):
        args = _args(node)
        if len(args) > index and constant_value(args[index]) not in (False, None):
            return f"{what} is not supported (inference only)"
        return None
    return check


def _sdpa_check(node):
    args = _args(node)
    if constant_value(args[4]) not in (0, 0.0):
        return "scaled_dot_product_attention with dropout_p != 0"
    if len(args) > 7 and constant_value(args[7]) not in (False, None, True):
        return "scaled_dot_product_attention with a computed enable_gqa"
    if is_tensor(args[3]) and constant_value(args[5]):
        return "scaled_dot_product_attention with both attn_mask and is_causal"
    return None


def _to_check(node):
    out = node.output().type()
    if out.device() is not None and out.device().type != "cpu":
        return "aten::to a non-CPU device"
    return None


def _cat_check(node):
    producer = _args(node)[0].node()
    if producer.kind() != "prim::ListConstruct":
        return "aten::cat of a list not built by prim::ListConstruct"
    return None


def bitwise(logical: str, integer: str):
    """and/or/xor/not: ONNX's logical op on bools, its Bitwise op on integers (the operands in the
    result's dtype: a bool tensor & an int scalar computes in int64, as in eager)."""
    def lower(ctx: LowerCtx, node):
        dtype = _out_dtype(node)
        operands = [ctx.as_dtype(a, dtype) for a in _args(node)]
        return [ctx.b.op(logical if dtype == np.bool_ else integer, operands)]
    return lower


def _bitwise_check(node):
    dtype = node.output().type().dtype()
    if dtype is not None and (dtype.is_floating_point or dtype.is_complex):
        return f"{node.kind()} with a {dtype} result (bitwise ops are for bools and integers)"
    return None


def _div_check(node):
    args = _args(node)
    if len(args) > 2 and constant_value(args[2]) not in (None, "floor", "trunc"):
        return "aten::div with an unknown rounding_mode"
    return None


# ---------------------------------------------------------------------------------------------
# THE TABLE
# ---------------------------------------------------------------------------------------------
# Kinds the frontend never hands the partitioner have no rule (tests/e2e/test_frontend.py checks
# each): TorchScript normalizes aten::true_divide to div and aten::concat to cat; freezing drops
# aten::detach and eval-mode aten::dropout / feature_dropout (training mode was refused anyway);
# constant propagation folds creation ops without tensor arguments (aten::zeros, ones, full,
# arange) into constants: their rules here are for run-time sizes.

LOWERING: dict[str, Rule] = {
    # arithmetic (tensor and scalar operands; alpha; broadcasting; type promotion via dtypes)
    "aten::add": Rule(binary("Add")),
    "aten::sub": Rule(binary("Sub")),
    "aten::rsub": Rule(binary("Sub", reverse=True)),
    "aten::mul": Rule(binary("Mul")),
    "aten::div": Rule(_div, _div_check),
    "aten::maximum": Rule(binary("Max")),
    "aten::minimum": Rule(binary("Min")),
    "aten::pow": Rule(_pow),
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
    # reductions and normalizations
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
    "aten::batch_norm": Rule(_batch_norm, _needs_const_false(5, "batch_norm in training mode")),
    "aten::group_norm": Rule(_group_norm),
    "aten::instance_norm": Rule(_instance_norm, _instance_norm_check),
    # convolution and pooling
    **{kind: Rule(_conv, _conv_check) for kind in (
        "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::convolution", "aten::_convolution")},
    "aten::max_pool1d": Rule(_max_pool),
    "aten::max_pool2d": Rule(_max_pool),
    "aten::avg_pool1d": Rule(_avg_pool, _avg_pool_check),
    "aten::avg_pool2d": Rule(_avg_pool, _avg_pool_check),
    "aten::adaptive_avg_pool1d": Rule(_adaptive_avg_pool, _adaptive_avg_pool_check),
    "aten::adaptive_avg_pool2d": Rule(_adaptive_avg_pool, _adaptive_avg_pool_check),
    **{kind: Rule(_pad, _pad_check) for kind in (
        "aten::pad", "aten::constant_pad_nd", "aten::reflection_pad1d", "aten::reflection_pad2d",
        "aten::replication_pad1d", "aten::replication_pad2d")},
    # linear algebra
    "aten::linear": Rule(_linear),
    "aten::matmul": Rule(_matmul),
    "aten::bmm": Rule(_matmul),
    "aten::mm": Rule(_matmul),
    "aten::addmm": Rule(_addmm),
    "aten::einsum": Rule(_einsum, _einsum_check, tensor_lists=True),
    "aten::baddbmm": Rule(_addmm),
    "aten::scaled_dot_product_attention": Rule(_sdpa, _sdpa_check),
    # shapes and data movement
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
    "aten::slice": Rule(_slice, size_args=True),
    "aten::size": Rule(_size, _size_check),
    "aten::arange": Rule(_arange, _arange_check, size_args=True),
    "aten::narrow": Rule(_narrow),
    "aten::select": Rule(_select),
    "aten::cat": Rule(_cat, _cat_check, tensor_lists=True),
    "aten::embedding": Rule(_embedding),
    "aten::index": Rule(_index, _index_check, tensor_lists=True),
    "aten::index_select": Rule(_index_select),
    "aten::gather": Rule(_gather, _needs_const_false(3, "gather with sparse_grad")),
    "aten::tril": Rule(_triangle),
    "aten::triu": Rule(_triangle),
    "aten::repeat": Rule(_repeat, size_args=True),
    "aten::repeat_interleave": Rule(_repeat_interleave, _repeat_interleave_check),
    "aten::diff": Rule(_diff, _diff_check),
    "aten::roll": Rule(_roll),
    "aten::flip": Rule(_flip),
    "aten::stack": Rule(_stack, _cat_check, tensor_lists=True),
    "aten::unbind": Rule(_unbind, tensor_lists=True),
    # tensor creation from a tensor's shape (constant arguments; shape and dtype as measured)
    **{kind: Rule(_fill, size_args=True) for kind in (*FILL_VALUES, "aten::full_like", "aten::new_full")},
    **{kind: Rule(_create, _create_check, size_args=True) for kind in (*CREATE_VALUES, "aten::full")},
    **{kind: Rule(_upsample) for kind in ("aten::upsample_nearest1d", "aten::upsample_nearest2d",
                                          "aten::upsample_linear1d", "aten::upsample_bilinear2d")},
    "aten::split": Rule(_split, tensor_lists=True),
    "aten::split_with_sizes": Rule(_split, tensor_lists=True),
    "aten::chunk": Rule(_split, tensor_lists=True),
    # Tensor[] glue: lives inside a cluster only together with its producer/consumers
    "prim::ListConstruct": Rule(_list_construct, tensor_lists=True, size_args=True),
    "prim::ListUnpack": Rule(_list_unpack, tensor_lists=True),
    "aten::__getitem__": Rule(_list_getitem, tensor_lists=True),
}

# int arithmetic on run-time sizes (is_size_arithmetic), looked up before LOWERING (rule_for)
SIZE_ARITHMETIC: dict[str, Rule] = {
    kind: Rule(size_arithmetic(op), _floordiv_check if kind == "aten::floordiv" else None, size_args=True)
    for kind, op in SIZE_ARITHMETIC_OPS.items()}


def rule_for(node: torch.Node) -> Optional[Rule]:
    """The node's rule: SIZE_ARITHMETIC for int arithmetic on sizes, else LOWERING's."""
    return SIZE_ARITHMETIC[node.kind()] if is_size_arithmetic(node) else LOWERING.get(node.kind())


# Ops whose rules read through _index_in_range: an index from the model's data that is out of
# range fails the engine's call (blade/errors.py names these ops in the error).
RANGE_CHECKED = ("aten::embedding", "aten::index", "aten::index_select", "aten::gather")
assert all(kind in LOWERING for kind in RANGE_CHECKED)

# Node kinds that are never "ops" (they are absorbed into whatever uses them).
IGNORED_KINDS = {"prim::Constant"}


# ---------------------------------------------------------------------------------------------
# The question the partitioner asks
# ---------------------------------------------------------------------------------------------

def can_lower(node: torch.Node, excluded_ops=()) -> tuple[bool, str]:
    """(True, "") if the engine can take this node, else (False, reason)."""
    kind = node.kind()
    if kind in excluded_ops:
        return False, "excluded by config (excluded_ops)"
    rule = rule_for(node)
    if rule is None:
        return False, f"unsupported op {kind}"
    if kind == "prim::ListConstruct" and not is_tensor_list(node.output()) and not is_size_value(node.output()):
        return False, "a list of non-tensors (folded into its users as a constant)"
    for value in list(node.inputs()) + list(node.outputs()):
        if is_tensor(value):
            if tensor_info(value) is None:
                return False, f"%{value.debugName()} has no static shape, an unsupported dtype " \
                              f"({value.type().dtype()}) or is not on the CPU"
        elif is_tensor_list(value):
            if not rule.tensor_lists:
                return False, f"takes a Tensor[] argument %{value.debugName()}"
        elif value in set(node.inputs()) and not is_constant(value) and not (rule.size_args and is_size_value(value)):
            return False, f"argument %{value.debugName()} is not a compile-time constant"
    if rule.check is not None:
        reason = rule.check(node)
        if reason:
            return False, reason
    return True, ""
