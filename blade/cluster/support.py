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
    vtype = value.type()
    return isinstance(vtype, torch.ListType) and isinstance(vtype.getElementType(), torch.TensorType)


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
    if node.kind() == "prim::ListConstruct" and not is_tensor_list(value):
        items = [constant_value(v) for v in node.inputs()]
        return _NOT_CONSTANT if any(i is _NOT_CONSTANT for i in items) else items
    return _NOT_CONSTANT


def is_constant(value: torch.Value) -> bool:
    return constant_value(value) is not _NOT_CONSTANT


# ---------------------------------------------------------------------------------------------
# Lowering context: maps TorchScript values of one cluster to ONNX names
# ---------------------------------------------------------------------------------------------

class LowerCtx:
    def __init__(self, builder: OnnxBuilder, names: dict):
        self.b = builder
        self.names = names  # torch.Value -> ONNX name (or list of names for Tensor[])

    def tensor(self, value: torch.Value) -> str:
        """ONNX name of a tensor value; constant tensors become initializers on first use."""
        if value not in self.names:
            if value.node().kind() != "prim::Constant":
                raise LoweringError(f"value %{value.debugName()} is not available in the cluster")
            tensor = torch.as_tensor(value.toIValue()).detach().contiguous()
            self.names[value] = self.b.constant(tensor.numpy(), "w")
        return self.names[value]

    def const(self, value: torch.Value):
        result = constant_value(value)
        if result is _NOT_CONSTANT:
            raise LoweringError(f"argument %{value.debugName()} is not a constant")
        return result

    def dtype(self, value: torch.Value) -> np.dtype:
        return TORCH_TO_NP[value.type().dtype()]

    def shape(self, value: torch.Value) -> list[int]:
        return list(value.type().sizes())

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
    # Indices of non-tensor arguments that may be non-constant (none, so far, for any op).
    tensor_lists: bool = False  # the node consumes or produces Tensor[] values


def binary(onnx_op: str, reverse: bool = False):
    """out = a <op> b*alpha (alpha when the schema has one), computed in the output dtype."""
    def lower(ctx: LowerCtx, node):
        args = _args(node)
        dtype = _out_dtype(node)
        a, b = ctx.as_dtype(args[0], dtype), ctx.as_dtype(args[1], dtype)
        if len(args) > 2:  # alpha
            alpha = ctx.const(args[2])
            if alpha != 1:
                b = ctx.b.op("Mul", [b, ctx.scalar(alpha, dtype)])
        if reverse:
            a, b = b, a
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


def identity(ctx: LowerCtx, node):
    return [ctx.b.op("Identity", [ctx.tensor(_args(node)[0])])]


def cast_to_output(ctx: LowerCtx, node):
    x = _args(node)[0]
    name = ctx.cast(ctx.tensor(x), ctx.dtype(x), _out_dtype(node))
    return [name if name != ctx.tensor(x) else ctx.b.op("Identity", [name])]


def reshape_to_output(ctx: LowerCtx, node):
    """view/reshape/flatten/expand-free reshapes: the output's static shape says it all."""
    return [ctx.b.op("Reshape", [ctx.tensor(_args(node)[0]), ctx.b.ints(ctx.shape(node.output()))])]


# ---------------------------------------------------------------------------------------------
# Op-specific rules
# ---------------------------------------------------------------------------------------------

def _div(ctx: LowerCtx, node):
    args = _args(node)
    mode = ctx.const(args[2]) if len(args) > 2 else None
    dtype = _out_dtype(node)
    if mode is None:
        return [ctx.b.op("Div", [ctx.as_dtype(args[0], dtype), ctx.as_dtype(args[1], dtype)])]
    if np.issubdtype(dtype, np.integer):
        # integer floor/trunc division: exact through float64 for |values| < 2**53
        q = ctx.b.op("Div", [ctx.as_dtype(args[0], np.float64), ctx.as_dtype(args[1], np.float64)])
    else:
        q = ctx.b.op("Div", [ctx.as_dtype(args[0], dtype), ctx.as_dtype(args[1], dtype)])
    if mode == "floor":
        q = ctx.b.op("Floor", [q])
    else:  # trunc: floor for positives, ceil for negatives
        zero = ctx.scalar(0, np.float64 if np.issubdtype(dtype, np.integer) else dtype)
        q = ctx.b.op("Where", [ctx.b.op("Less", [q, zero]), ctx.b.op("Ceil", [q]), ctx.b.op("Floor", [q])])
    return [ctx.cast(q, np.float64 if np.issubdtype(dtype, np.integer) else dtype, dtype)]


def _pow(ctx: LowerCtx, node):
    base, exponent = _args(node)[:2]
    dtype = _out_dtype(node)
    if not is_tensor(exponent) and ctx.const(exponent) == 2:
        x = ctx.as_dtype(base, dtype)
        return [ctx.b.op("Mul", [x, x])]
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
    norm_shape = ctx.const(normalized_shape)
    scale = ctx.tensor(weight) if is_tensor(weight) else ctx.b.constant(np.ones(norm_shape, dtype))
    inputs = [ctx.tensor(x), scale] + ([ctx.tensor(bias)] if is_tensor(bias) else [])
    return [ctx.b.op("LayerNormalization", inputs, axis=-len(norm_shape), epsilon=float(ctx.const(eps)))]


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
    return [ctx.b.op("Transpose", [ctx.tensor(x)], perm=[d % rank for d in ctx.const(dims)])]


def _transpose(ctx: LowerCtx, node):
    args = _args(node)
    rank = len(ctx.shape(args[0]))
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
    return [ctx.b.op("Expand", [ctx.tensor(_args(node)[0]), ctx.b.ints(ctx.shape(node.output()))])]


def _slice_onnx(ctx: LowerCtx, x: str, dim: int, start: int, end: int, step: int = 1) -> str:
    return ctx.b.op("Slice", [x, ctx.b.ints([start]), ctx.b.ints([end]), ctx.b.ints([dim]), ctx.b.ints([step])])


def _slice(ctx: LowerCtx, node):
    x, dim, start, end, step = _args(node)[:5]
    rank = len(ctx.shape(x))
    start = ctx.const(start)
    end = ctx.const(end)
    return [_slice_onnx(ctx, ctx.tensor(x), ctx.const(dim) % rank, 0 if start is None else start,
                        INT64_MAX if end is None else end, ctx.const(step))]


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


def _embedding(ctx: LowerCtx, node):
    weight, indices = _args(node)[:2]
    return [ctx.b.op("Gather", [ctx.tensor(weight), ctx.tensor(indices)], axis=0)]


def _split(ctx: LowerCtx, node):
    """split(x, size, dim) / split_with_sizes(x, sizes, dim) / chunk(x, n, dim) -> a list."""
    x, sizes, dim = _args(node)[:3]
    shape = ctx.shape(x)
    dim = ctx.const(dim) % len(shape)
    extent = shape[dim]
    sizes = ctx.const(sizes)
    if node.kind() == "aten::chunk":
        step = -(-extent // sizes) if extent else 1
        sizes = [min(step, extent - b) for b in range(0, extent, step)] or [0]
    elif isinstance(sizes, int):
        sizes = [min(sizes, extent - b) for b in range(0, extent, sizes)] if sizes else [extent]
    outputs, begin = [], 0
    for size in sizes:
        outputs.append(_slice_onnx(ctx, ctx.tensor(x), dim, begin, begin + size))
        begin += size
    return [outputs]


def _list_construct(ctx: LowerCtx, node):
    return [[ctx.tensor(v) for v in node.inputs()]]


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
    k_t = _transpose_last2(ctx, ctx.tensor(k), len(ctx.shape(k)))
    scores = ctx.b.op("Mul", [ctx.b.op("MatMul", [ctx.tensor(q), k_t]), ctx.scalar(scale, dtype)])
    if ctx.const(is_causal):
        length, source = q_shape[-2], ctx.shape(k)[-2]
        keep = np.tril(np.ones((length, source), dtype=bool))
        mask_name = ctx.b.constant(keep, "causal")
        scores = ctx.b.op("Where", [mask_name, scores, ctx.scalar(-np.inf, dtype)])
    elif is_tensor(mask):
        if ctx.dtype(mask) == np.dtype(bool):
            scores = ctx.b.op("Where", [ctx.tensor(mask), scores, ctx.scalar(-np.inf, dtype)])
        else:
            scores = ctx.b.op("Add", [scores, ctx.as_dtype(mask, dtype)])
    probs = ctx.b.op("Softmax", [scores], axis=-1)
    return [ctx.b.op("MatMul", [probs, ctx.tensor(v)])]


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
    if len(args) > 7 and constant_value(args[7]) not in (False, None):
        return "scaled_dot_product_attention with enable_gqa"
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


def _bool_only(node):
    if any(is_tensor(v) and v.type().dtype() != torch.bool for v in node.inputs()):
        return f"{node.kind()} on non-bool tensors (bitwise integer ops are not supported)"
    return None


def _div_check(node):
    args = _args(node)
    if len(args) > 2 and constant_value(args[2]) not in (None, "floor", "trunc"):
        return "aten::div with an unknown rounding_mode"
    return None


# ---------------------------------------------------------------------------------------------
# THE TABLE
# ---------------------------------------------------------------------------------------------

LOWERING: dict[str, Rule] = {
    # arithmetic (tensor and scalar operands; alpha; broadcasting; type promotion via dtypes)
    "aten::add": Rule(binary("Add")),
    "aten::sub": Rule(binary("Sub")),
    "aten::rsub": Rule(binary("Sub", reverse=True)),
    "aten::mul": Rule(binary("Mul")),
    "aten::div": Rule(_div, _div_check),
    "aten::true_divide": Rule(_div),
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
    "aten::floor": Rule(unary("Floor")),
    "aten::ceil": Rule(unary("Ceil")),
    "aten::sin": Rule(unary("Sin")),
    "aten::cos": Rule(unary("Cos")),
    "aten::gelu": Rule(_gelu),
    "aten::silu": Rule(lambda ctx, node: [ctx.b.op("Mul", [ctx.tensor(_args(node)[0]),
                                                         ctx.b.op("Sigmoid", [ctx.tensor(_args(node)[0])])])]),
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
    "aten::__and__": Rule(binary("And"), _bool_only),
    "aten::__or__": Rule(binary("Or"), _bool_only),
    "aten::bitwise_and": Rule(binary("And"), _bool_only),
    "aten::bitwise_or": Rule(binary("Or"), _bool_only),
    "aten::bitwise_not": Rule(unary("Not"), _bool_only),
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
    "aten::layer_norm": Rule(_layer_norm),
    # linear algebra
    "aten::linear": Rule(_linear),
    "aten::matmul": Rule(_matmul),
    "aten::bmm": Rule(_matmul),
    "aten::mm": Rule(_matmul),
    "aten::addmm": Rule(_addmm),
    "aten::baddbmm": Rule(_addmm),
    "aten::scaled_dot_product_attention": Rule(_sdpa, _sdpa_check),
    # shapes and data movement
    "aten::view": Rule(reshape_to_output),
    "aten::reshape": Rule(reshape_to_output),
    "aten::flatten": Rule(reshape_to_output),
    "aten::view_as": Rule(reshape_to_output),
    "aten::reshape_as": Rule(reshape_to_output),
    "aten::permute": Rule(_permute),
    "aten::transpose": Rule(_transpose),
    "aten::t": Rule(_transpose),
    "aten::unsqueeze": Rule(_unsqueeze),
    "aten::squeeze": Rule(_squeeze),
    "aten::expand": Rule(_expand),
    "aten::expand_as": Rule(_expand),
    "aten::contiguous": Rule(identity),
    "aten::clone": Rule(identity),
    "aten::detach": Rule(identity),
    "aten::dropout": Rule(identity, _needs_const_false(2, "dropout in training mode")),
    "aten::feature_dropout": Rule(identity, _needs_const_false(2, "dropout in training mode")),
    "aten::slice": Rule(_slice),
    "aten::narrow": Rule(_narrow),
    "aten::select": Rule(_select),
    "aten::cat": Rule(_cat, _cat_check, tensor_lists=True),
    "aten::concat": Rule(_cat, _cat_check, tensor_lists=True),
    "aten::embedding": Rule(_embedding),
    "aten::split": Rule(_split, tensor_lists=True),
    "aten::split_with_sizes": Rule(_split, tensor_lists=True),
    "aten::chunk": Rule(_split, tensor_lists=True),
    # Tensor[] glue: lives inside a cluster only together with its producer/consumers
    "prim::ListConstruct": Rule(_list_construct, tensor_lists=True),
    "prim::ListUnpack": Rule(_list_unpack, tensor_lists=True),
    "aten::__getitem__": Rule(_list_getitem, tensor_lists=True),
}

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
    rule = LOWERING.get(kind)
    if rule is None:
        return False, f"unsupported op {kind}"
    if kind == "prim::ListConstruct" and not is_tensor_list(node.output()):
        return False, "a list of non-tensors (folded into its users as a constant)"
    for value in list(node.inputs()) + list(node.outputs()):
        if is_tensor(value):
            if tensor_info(value) is None:
                return False, f"%{value.debugName()} has no static shape, an unsupported dtype " \
                              f"({value.type().dtype()}) or is not on the CPU"
        elif is_tensor_list(value):
            if not rule.tensor_lists:
                return False, f"takes a Tensor[] argument %{value.debugName()}"
        elif value in set(node.inputs()) and not is_constant(value):
            return False, f"argument %{value.debugName()} is not a compile-time constant"
    if rule.check is not None:
        reason = rule.check(node)
        if reason:
            return False, reason
    return True, ""
