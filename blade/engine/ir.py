"""The engine's primitive IR and the ONNX -> IR lowering (torch-free).

A cluster becomes a DAG of a handful of primitives, each with a static shape and dtype:

  input / const   leaves backed by memory (a graph input, an initializer)
  ew              elementwise op over arguments of the node's own shape (broadcasts are explicit views)
  view            index remapping without compute: permute, expand, slice, reshape, window (views.py)
  pad             x padded per dim: a constant fill, or reflect/edge index remapping
  reduce          sum / prod / max / min over axes, keeping the reduced dims as size 1; argmax /
                  argmin (int64, one axis): torch's index rules (the first NaN, else the first extreme)
  scan            inclusive running sum along one axis (cumsum), same shape as its argument
  matmul          float32 batched [.., m, k] @ [.., k, n] with equal batch dims (alpha scale)
  gather          data[..., indices[...], ...] along one axis (range-checked at run time)
  conv            float32 N-d convolution [n, c, *size] * [o, c/g, *k] (+ bias), through the runtime
  concat          along one axis

Every ONNX op is one entry of ``ONNX_RULES``: a function from (builder, node attributes, IR
arguments) to IR outputs. Elementwise ops are described by ``ELEMENTWISE`` (result dtype rule);
composites (Softmax, LayerNormalization, Gelu, Gemm, ...) decompose into primitives right in their
rule, so code generation only ever sees the primitives above.
"""
from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass, field
from functools import reduce

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .manifest import DTYPES
from .symbolic import Expr, Var, as_expr, constant, floordiv, maximum, minimum, mod, proves_multiple, proves_nonnegative

# ONNX model metadata naming the ranges of its dim_params: {"seq": [1, 512], ...} as JSON. A graph
# input dim that is a dim_param becomes a size symbol of the engine (a run-time dim in that range).
SIZE_RANGES_KEY = "blade.size_ranges"
# Metadata naming the dim_params of outputs that no input binds, each as a tree over the input-bound
# ones: {"2*s0": ["mul", 2, "s0"], ...} (ints, names, [op, *args] with an op of DERIVED_OPS). The
# engine computes them from the bound sizes when it is called (blade_engine_derived_sizes).
SIZE_DERIVED_KEY = "blade.size_derived"
# Metadata naming input-bound dim_params that equal a tree over other input-bound ones (dynamo's
# guards say so): the engine computes with the tree and checks the input's dim when it is called.
SIZE_EQUAL_KEY = "blade.size_equal"
DERIVED_OPS = {
    "add": lambda *a: reduce(operator.add, a),
    "mul": lambda *a: reduce(operator.mul, a),
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "max": lambda *a: reduce(maximum, a),   # x[:, 1:-1] of a length from 1: Max(0, s - 2)
    "min": lambda *a: reduce(minimum, a),
}


class UnsupportedOnnxOp(Exception):
    """The cluster contains an ONNX op (or an attribute value) the engine cannot compile."""


def _dim(d):
    """A dim of a shape: an int, or an Expr over size symbols when it is not a constant."""
    if isinstance(d, Expr):
        value = constant(d)
        return d if value is None else int(value)
    return int(d)


def is_static(shape) -> bool:
    return not any(isinstance(d, Expr) for d in shape)


@dataclass(eq=False)
class Node:
    op: str
    shape: tuple          # ints, and Exprs over the graph's size symbols (run-time dims)
    dtype: str
    args: tuple = ()
    attrs: dict = field(default_factory=dict)
    name: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:  # short: nodes print inside error messages and generated comments
        return f"{self.op}:{self.name}{list(self.shape)}{self.dtype}"


@dataclass
class Graph:
    inputs: list        # Node(op="input"), in ONNX graph-input order
    outputs: list       # (onnx name, Node), in ONNX graph-output order
    nodes: list         # every IR node, topologically sorted
    symbols: list = field(default_factory=list)   # (dim_param name, Var) of each size symbol
    derived: list = field(default_factory=list)   # (dim_param name, Expr over symbols) of output dims no input binds
    checks: list = field(default_factory=list)    # (Var, Expr over other symbols): an input-bound size equal to it


# ONNX elementwise op -> result dtype rule ("same": the first argument's, "bool", "cast": attrs["to"]).
ELEMENTWISE = {
    **{op: "same" for op in (
        "Add", "Sub", "Mul", "Div", "Pow", "Neg", "Abs", "Relu", "Sigmoid", "Tanh", "Exp", "Log",
        "Sqrt", "Reciprocal", "Erf", "Gelu", "Floor", "Ceil", "Sign", "Sin", "Cos", "Max", "Min", "Not", "And", "Or", "Xor", "Mod",
        "BitwiseNot", "BitwiseAnd", "BitwiseOr", "BitwiseXor")},
    **{op: "bool" for op in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")},
    "Where": "second",
    "Cast": "cast",
}


def broadcast_shapes(*shapes) -> tuple:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for d in range(rank):
        dims = {s[d - rank + len(s)] for s in shapes if d - rank + len(s) >= 0} - {1}
        if len(dims) > 1 and any(isinstance(n, Expr) for n in dims):
            # a run-time dim against another dim: equal or 1 only at some sizes
            raise UnsupportedOnnxOp(f"broadcasting run-time dims of shapes {shapes} (equal only at some sizes)")
        if len(dims) > 1:
            raise ValueError(f"shapes {shapes} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def normalize_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"axis {axis} out of range for rank {rank}")
    return axis % rank if rank else 0


class Builder:
    """Creates IR nodes (appending them in topological order) with the shape rules of each primitive."""

    def __init__(self):
        self.nodes: list[Node] = []
        # (kind, x, axes) -> its reduce node: the same reduction asked twice is computed once (a
        # masked softmax's row max, which the fully-masked-row check asks for again).
        self._reductions: dict = {}

    def _add(self, op, shape, dtype, args=(), **attrs) -> Node:
        args = [self._size_data(a) if a is not None and a.op == "size" else a for a in args]
        node = Node(op, tuple(_dim(d) for d in shape), dtype, tuple(args), attrs, f"v{len(self.nodes)}")
        self.nodes.append(node)
        return node

    # leaves
    def input(self, name, shape, dtype) -> Node:
        node = self._add("input", shape, dtype)
        node.name = name
        return node

    def const(self, value, dtype=None, name="") -> Node:
        value = np.asarray(value, dtype=dtype)
        # Unnamed constants are made by the lowering (e.g. pooling divisors): they are not in the
        # ONNX model, so the engine cannot receive them at run time and compiles them in.
        node = self._add("const", value.shape, value.dtype.name, value=value, derived=not name)
        node.name = name or node.name
        return node

    def _size_data(self, node: Node) -> Node:
        """A run-time size read as data (the index arithmetic of ``x[i, j]`` over run-time dims):
        a 0-d leaf the engine computes from its size symbols."""
        if node.shape != ():
            raise UnsupportedOnnxOp(f"run-time sizes {node.attrs['value'].tolist()} read as a data tensor")
        return self._add("sizeval", (), node.dtype, expr=node.attrs["value"].item())

    def sizes(self, values, dtype="int64") -> Node:
        """Ints known when the engine runs (an object array of ints and Exprs over the size
        symbols: ONNX Shape, and Gather/Concat/... of it): a "size" node, which shapes, Range,
        Slice and Expand read through const_value; all-int values are a plain constant."""
        values = np.asarray(values, dtype=object)
        folded = np.vectorize(_dim, otypes=[object])(values) if values.size else values
        if all(isinstance(v, int) for v in folded.reshape(-1)):  # (static dims: a constant, still a size)
            node = self.const(np.asarray(folded.tolist(), dtype=dtype).reshape(values.shape), dtype)
            node.attrs["sizes"] = True
            return node
        return self._add("size", values.shape, dtype, value=folded)

    @staticmethod
    def const_value(node: Node | None, what: str):
        """The numpy value of a node that must be a compile-time constant (shapes, axes, ...); a
        "size" node's is an object array holding Exprs where sizes are run-time."""
        if node is None:
            return None
        if node.op == "size":
            return node.attrs["value"]
        if node.op != "const":
            raise UnsupportedOnnxOp(f"{what} must be a constant initializer, got a computed value")
        return node.attrs["value"]

    # compute
    def ew(self, op, *args, to=None) -> Node:
        shape = broadcast_shapes(*(a.shape for a in args))
        args = [self.expand(a, shape) for a in args]
        rule = ELEMENTWISE[op]
        dtype = {"same": args[0].dtype, "bool": "bool", "cast": to,
                 "second": args[1].dtype if len(args) > 1 else None}[rule]
        return self._add("ew", shape, dtype, args, fn=op)

    def cast(self, x, dtype) -> Node:
        return x if x.dtype == dtype else self.ew("Cast", x, to=dtype)

    def scalar(self, value, dtype) -> Node:
        return self.const(np.array(value, dtype=dtype))

    def reduce(self, kind, x, axes, keepdims=True) -> Node:
        axes = sorted({normalize_axis(a, x.rank) for a in axes})
        kept = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
        key = (kind, x, tuple(axes))
        if key not in self._reductions:
            self._reductions[key] = self._add("reduce", kept, x.dtype, [x], kind=kind, axes=axes)
        out = self._reductions[key]
        if keepdims:
            return out
        return self.reshape(out, [n for d, n in enumerate(x.shape) if d not in axes])

    def arg_reduce(self, kind, x, axis, keepdims=True) -> Node:
        axis = normalize_axis(axis, x.rank)
        if x.shape[axis] == 0:
            raise UnsupportedOnnxOp(f"{kind} over an empty axis (torch raises)")
        kept = tuple(1 if d == axis else n for d, n in enumerate(x.shape))
        out = self._add("reduce", kept, "int64", [x], kind=kind, axes=[axis])
        return out if keepdims else self.reshape(out, [n for d, n in enumerate(x.shape) if d != axis])

    def scan(self, kind, x, axis) -> Node:
        return self._add("scan", x.shape, x.dtype, [x], kind=kind, axis=normalize_axis(axis, x.rank))

    def mean(self, x, axes, keepdims=True) -> Node:
        count = math.prod(x.shape[normalize_axis(a, x.rank)] for a in axes)
        total = self.reduce("sum", x, axes, keepdims)
        if isinstance(count, int):
            return self.ew("Div", total, self.scalar(count, x.dtype))
        # over run-time dims the count is read at run time and rounded to x's dtype, as ATen's
        # sum(...).div_(count) rounds its integer count
        return self.ew("Div", total, self.cast(self._add("sizeval", (), "int64", expr=count), x.dtype))

    def matmul(self, a, b, alpha=1.0) -> Node:
        """Batched matmul of operands with rank >= 2 and broadcastable batch dims."""
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
        m, k = a.shape[-2:]
        k2, n = b.shape[-2:]
        if k != k2:
            raise ValueError(f"matmul inner dims differ: {a.shape} @ {b.shape}")
        a = self.expand(a, batch + (m, k))
        b = self.expand(b, batch + (k, n))
        if a.dtype == "float32":
            return self._add("matmul", batch + (m, n), a.dtype, [a, b], alpha=float(alpha))
        # No GEMM for other dtypes: a broadcast multiply reduced over k, which the reduction
        # codegen turns into a plain loop nest.
        prod = self.ew("Mul", self.unsqueeze(a, [-1]), self.unsqueeze(b, [-3]))
        out = self.reduce("sum", prod, [-2], keepdims=False)
        return out if alpha == 1.0 else self.ew("Mul", out, self.scalar(alpha, a.dtype))

    def gather(self, data, indices, axis) -> Node:
        axis = normalize_axis(axis, data.rank)
        shape = data.shape[:axis] + indices.shape + data.shape[axis + 1:]
        return self._add("gather", shape, data.dtype, [data, indices], axis=axis)

    def conv(self, x, w, bias, strides, pads, dilations, groups) -> Node:
        spatial = x.rank - 2
        x, pads = _absorb_zero_pad(x, pads)
        size = [(x.shape[2 + d] + pads[d] + pads[spatial + d] - dilations[d] * (w.shape[2 + d] - 1) - 1)
                // strides[d] + 1 for d in range(spatial)]
        args = [x, w] + ([bias] if bias is not None else [])
        return self._add("conv", (x.shape[0], w.shape[0], *size), x.dtype, args, strides=list(strides),
                         pads=list(pads), dilations=list(dilations), groups=int(groups))

    def concat(self, args, axis) -> Node:
        axis = normalize_axis(axis, args[0].rank)
        shape = list(args[0].shape)
        shape[axis] = sum(a.shape[axis] for a in args)
        return self._add("concat", shape, args[0].dtype, args, axis=axis)

    # views
    def permute(self, x, perm) -> Node:
        perm = [normalize_axis(p, x.rank) for p in perm]
        if perm == list(range(x.rank)):
            return x
        return self._add("view", [x.shape[p] for p in perm], x.dtype, [x], view="permute", perm=perm)

    def expand(self, x, shape) -> Node:
        shape = tuple(shape)
        if x.shape == shape:
            return x
        if x.rank < len(shape):
            x = self.reshape(x, (1,) * (len(shape) - x.rank) + x.shape)
        if x.shape == shape:
            return x
        return self._add("view", shape, x.dtype, [x], view="expand")

    def slice(self, x, starts, steps, shape) -> Node:
        if shape == x.shape and all(s == 0 for s in starts) and all(s == 1 for s in steps):
            return x
        return self._add("view", shape, x.dtype, [x], view="slice", starts=list(starts), steps=list(steps))

    def roll(self, x, axis, offset) -> Node:
        """x read from `offset` on along axis, wrapping around: out[i] = x[(i + offset) % n], for
        0 <= offset <= n (torch.roll by -offset: no copy, unlike the concat of two slices)."""
        return self._add("view", x.shape, x.dtype, [x], view="roll", axis=axis, offset=offset)

    def pad(self, x, begins, ends, mode="constant", value=0.0) -> Node:
        if not any(begins) and not any(ends):
            return x
        shape = [n + lo + hi for n, lo, hi in zip(x.shape, begins, ends)]
        return self._add("pad", shape, x.dtype, [x], begins=list(begins), mode=mode,
                         value=np.asarray(value, dtype=x.dtype).item())

    def window(self, x, kernel, strides, dilations) -> Node:
        """Sliding windows over the trailing len(kernel) dims: [..., *size] -> [..., *out, *kernel]."""
        spatial = len(kernel)
        lead, size = x.shape[:-spatial], x.shape[-spatial:]
        out = [(n - d * (k - 1) - 1) // s + 1 for n, k, s, d in zip(size, kernel, strides, dilations)]
        return self._add("view", tuple(lead) + tuple(out) + tuple(kernel), x.dtype, [x], view="window",
                         strides=list(strides), dilations=list(dilations))

    def reshape(self, x, shape) -> Node:
        shape = tuple(_dim(d) for d in shape)
        if math.prod(shape) != x.numel:
            raise ValueError(f"cannot reshape {x.shape} to {shape}")
        if shape == x.shape:
            return x
        return self._add("view", shape, x.dtype, [x], view="reshape")

    def unsqueeze(self, x, axes) -> Node:
        rank = x.rank + len(axes)
        axes = {normalize_axis(a, rank) for a in axes}
        dims = iter(x.shape)
        return self.reshape(x, [1 if d in axes else next(dims) for d in range(rank)])


# ---------------------------------------------------------------------------------------------
# ONNX op rules: rule(b, attrs, *args) -> list of IR nodes, one per ONNX output (missing optional
# inputs arrive as None).

def _absorb_zero_pad(x: Node, pads) -> tuple:
    """(input, pads) of a convolution whose input is a zero padding of the spatial dims only (TF-style
    "same" padding written as F.pad before the conv): the convolution pads instead, so no padded copy
    is written (the runtime's kernels take any padding per side; the pad node is dropped when nothing
    else reads it)."""
    if x.op != "pad" or x.attrs["mode"] != "constant" or x.attrs["value"] != 0.0 or math.copysign(1.0, x.attrs["value"]) < 0:
        return x, pads
    source = x.args[0]
    begins = x.attrs["begins"]
    # (with run-time sizes a dim's end is an expression: s0 - s0 is 0, a spatial one may stay symbolic)
    ends = [_dim(n - m - lo) for n, m, lo in zip(x.shape, source.shape, begins)]
    if not is_static(begins + ends) or any(begins[:2]) or any(ends[:2]) or min(begins + ends) < 0:
        return x, pads
    return source, [p + extra for p, extra in zip(pads, begins[2:] + ends[2:])]


def _elementwise(op):
    return lambda b, attrs, *args: [b.ew(op, *args)]


def _fmod(b, attrs, x, y):
    """Mod with fmod=1 on floats: C's fmod (the remainder with the dividend's sign, exact)."""
    if attrs.get("fmod", 0) != 1 or x.dtype not in ("float32", "float64"):
        raise UnsupportedOnnxOp("Mod other than fmod=1 on floats")
    return [b.ew("Mod", x, y)]


def _variadic(op):
    def rule(b, attrs, first, *rest):
        out = first
        for arg in rest:
            out = b.ew(op, out, arg)
        return [out]
    return rule


def _cast(b, attrs, x):
    to = helper.tensor_dtype_to_np_dtype(attrs["to"]).name
    if to not in DTYPES:
        raise UnsupportedOnnxOp(f"Cast to {to}")
    return [b.cast(x, to)]


def _pow(b, attrs, x, exponent):
    if exponent.op == "const" and exponent.numel == 1:
        shape = broadcast_shapes(x.shape, exponent.shape)
        power = float(exponent.attrs["value"].reshape(()))
        fast = _small_power(b, x, power)
        if fast is not None:
            return [b.expand(fast, shape)]
    return [b.ew("Pow", x, b.cast(exponent, x.dtype))]


def _small_power(b, x, power: float):
    """x ** power as multiplies for |power| in 1..4 (negative: a reciprocal, floats only) and
    as a square root for 0.5 -- the same fast paths ATen's pow takes, and vectorizable unlike
    std::pow. None when no fast path applies."""
    is_float = x.dtype in ("float32", "float64")
    if power == 0.5 and is_float:
        return b.ew("Sqrt", x)
    if not power.is_integer() or not 1 <= abs(power) <= 4 or (power < 0 and not is_float):
        return None
    result = x
    for _ in range(int(abs(power)) - 1):
        result = b.ew("Mul", result, x)
    return b.ew("Reciprocal", result) if power < 0 else result


def _clip(b, attrs, x, low=None, high=None):
    if low is not None:
        x = b.ew("Max", x, low)
    if high is not None:
        x = b.ew("Min", x, high)
    return [x]


def _gelu(b, attrs, x):
    if attrs.get("approximate", "none") != "tanh":
        # one op, not x / 2 (1 + erf(x / sqrt 2)) of primitives: the prelude's blade_geluf is a
        # cheaper form of the same function (optable)
        return [b.ew("Gelu", x)]
    cube = b.ew("Mul", b.ew("Mul", x, x), x)
    inner = b.ew("Add", x, b.ew("Mul", cube, b.scalar(0.044715, x.dtype)))
    gate = b.ew("Tanh", b.ew("Mul", inner, b.scalar(math.sqrt(2.0 / math.pi), x.dtype)))
    return [b.ew("Mul", b.ew("Mul", x, b.scalar(0.5, x.dtype)), b.ew("Add", gate, b.scalar(1.0, x.dtype)))]


def _reduce_axes(b, attrs, x, axes_node):
    axes = b.const_value(axes_node, "reduction axes")
    axes = list(attrs.get("axes", [])) if axes is None else [int(a) for a in axes.reshape(-1)]
    if not axes:
        return None if attrs.get("noop_with_empty_axes", 0) else list(range(x.rank))
    return axes


def _reduction(kind):
    def rule(b, attrs, x, axes_node=None):
        axes = _reduce_axes(b, attrs, x, axes_node)
        if axes is None:
            return [x]
        keep = bool(attrs.get("keepdims", 1))
        return [b.mean(x, axes, keep) if kind == "mean" else b.reduce(kind, x, axes, keep)]
    return rule


def _arg_reduction(kind):
    def rule(b, attrs, x):
        if attrs.get("select_last_index", 0):
            raise UnsupportedOnnxOp(f"{kind} with select_last_index")
        return [b.arg_reduce(kind, x, int(attrs.get("axis", 0)), bool(attrs.get("keepdims", 1)))]
    return rule


def _cumsum(b, attrs, x, axis_node):
    if attrs.get("exclusive", 0) or attrs.get("reverse", 0):
        raise UnsupportedOnnxOp("CumSum with exclusive or reverse")
    return [b.scan("sum", x, int(b.const_value(axis_node, "CumSum axis").reshape(-1)[0]))]


def _softmax(log):
    def rule(b, attrs, x):
        axis = attrs.get("axis", -1)
        shifted = b.ew("Sub", x, b.reduce("max", x, [axis]))    # stable: exp never overflows
        exp = b.ew("Exp", shifted)
        total = b.reduce("sum", exp, [axis])
        if log:
            return [b.ew("Sub", shifted, b.ew("Log", total))]
        # times 1 / total, like ATen's softmax kernels: one divide a row instead of a vector divide
        # an element (bench/'s pointwise kernel, single-threaded: 2.34 -> 2.22 ns/element)
        return [b.ew("Mul", exp, b.ew("Reciprocal", total))]
    return rule


def _layer_norm(b, attrs, x, scale, bias=None):
    axes = list(range(normalize_axis(attrs.get("axis", -1), x.rank), x.rank))
    mean = b.mean(x, axes)
    centered = b.ew("Sub", x, mean)
    var = b.mean(b.ew("Mul", centered, centered), axes)
    inv_std = b.ew("Reciprocal", b.ew("Sqrt", b.ew("Add", var, b.scalar(attrs.get("epsilon", 1e-5), x.dtype))))
    y = b.ew("Mul", b.ew("Mul", centered, inv_std), scale)
    if bias is not None:
        y = b.ew("Add", y, bias)
    return [y, mean, inv_std]


def _matmul(b, attrs, x, y):
    # numpy semantics for 1-D operands: promote to a matrix, then drop the added dim.
    a = b.unsqueeze(x, [0]) if x.rank == 1 else x
    w = b.unsqueeze(y, [-1]) if y.rank == 1 else y
    out = b.matmul(a, w)
    drop = ([-2] if x.rank == 1 else []) + ([-1] if y.rank == 1 else [])
    if drop:
        out = b.reshape(out, [n for d, n in enumerate(out.shape) if d - out.rank not in drop])
    return [out]


def _gemm(b, attrs, a, w, c=None):
    a = b.permute(a, [1, 0]) if attrs.get("transA", 0) else a
    w = b.permute(w, [1, 0]) if attrs.get("transB", 0) else w
    out = b.matmul(a, w, attrs.get("alpha", 1.0))
    if c is not None:
        beta = attrs.get("beta", 1.0)
        out = b.ew("Add", out, c if beta == 1.0 else b.ew("Mul", c, b.scalar(beta, c.dtype)))
    return [out]


def _reshape(b, attrs, x, shape_node):
    shape = [_dim(d) for d in b.const_value(shape_node, "Reshape shape").reshape(-1)]
    if not attrs.get("allowzero", 0):
        shape = [x.shape[d] if isinstance(n, int) and n == 0 else n for d, n in enumerate(shape)]
    if -1 in shape:
        known = math.prod(n for n in shape if n != -1)
        if is_static(shape):
            shape[shape.index(-1)] = x.numel // known if known else 0
        elif proves_multiple(x.numel, known, 0):
            # numel = known * q at every size (e.g. [b, s, 256] to [b, 4, -1, 64]: q = s), so the
            # -1 is that exact quotient; a known product that may be 0 or may not divide is refused
            shape[shape.index(-1)] = _dim(floordiv(x.numel, known))
        else:
            raise UnsupportedOnnxOp(f"Reshape of {x.shape} to {shape}: the -1 is not provably the "
                                    f"element count over the other dims at every run-time size")
    return [b.reshape(x, shape)]


def _flatten(b, attrs, x):
    axis = attrs.get("axis", 1)
    axis = axis + x.rank if axis < 0 else axis
    return [b.reshape(x, [math.prod(x.shape[:axis]), math.prod(x.shape[axis:])])]


def _transpose(b, attrs, x):
    return [b.permute(x, attrs.get("perm", list(range(x.rank))[::-1]))]


def _unsqueeze(b, attrs, x, axes):
    return [b.unsqueeze(x, [int(a) for a in b.const_value(axes, "Unsqueeze axes").reshape(-1)])]


def _squeeze(b, attrs, x, axes=None):
    axes = b.const_value(axes, "Squeeze axes")
    drop = ({normalize_axis(int(a), x.rank) for a in axes.reshape(-1)} if axes is not None
            else {d for d, n in enumerate(x.shape) if n == 1})
    return [b.reshape(x, [n for d, n in enumerate(x.shape) if d not in drop])]


def _expand(b, attrs, x, shape):
    return [b.expand(x, broadcast_shapes(x.shape, tuple(_dim(d) for d in b.const_value(shape, "Expand shape").reshape(-1))))]


def _slice(b, attrs, x, starts, ends, axes=None, steps=None):
    starts = b.const_value(starts, "Slice starts").reshape(-1)
    ends = b.const_value(ends, "Slice ends").reshape(-1)
    axes = b.const_value(axes, "Slice axes")
    axes = range(len(starts)) if axes is None else axes.reshape(-1)
    steps = b.const_value(steps, "Slice steps")
    steps = [1] * len(starts) if steps is None else steps.reshape(-1)
    rolled = _rolled(b, x, starts, ends, axes, steps)
    if rolled is not None:
        return [rolled]
    first, step_of, shape = [0] * x.rank, [1] * x.rank, list(x.shape)
    for axis, start, end, step in zip(axes, starts, ends, steps):
        axis = normalize_axis(int(axis), x.rank)
        start, end = _dim(start), _dim(end)
        if isinstance(start, Expr) or isinstance(end, Expr):
            first[axis], shape[axis] = _slice_to_sizes(x.shape[axis], start, end, int(step))
            continue
        if isinstance(x.shape[axis], Expr):
            first[axis], shape[axis] = _run_time_slice(x.shape[axis], int(start), int(end), int(step))
            step_of[axis] = int(step)
            continue
        # ONNX clamps exactly like Python slicing does.
        picked = range(*slice(int(start), int(end), int(step)).indices(x.shape[axis]))
        first[axis], step_of[axis], shape[axis] = picked.start, picked.step, len(picked)
    return [b.slice(x, first, step_of, tuple(shape))]


def _rolled(b, x, starts, ends, axes, steps):
    """Concat(y, y)[k:k + n] along the concat's axis, 0 <= k <= n = y's length there (a roll over a
    run-time length, blade/cluster/rules/indexing.py's _roll_axis), as a roll view of y; else None."""
    if x.op != "concat" or len(x.args) != 2 or x.args[0] is not x.args[1] or len(starts) != 1 or int(steps[0]) != 1:
        return None
    axis, y = x.attrs["axis"], x.args[0]
    n, start, end = y.shape[axis], _dim(starts[0]), _dim(ends[0])
    if normalize_axis(int(axes[0]), x.rank) != axis or as_expr(end) - start != n or \
            not (proves_nonnegative(as_expr(start)) and proves_nonnegative(as_expr(n) - start)):
        return None
    return b.roll(y, axis, as_expr(start))


def _run_time_slice(n: Expr, start: int, end: int, step: int) -> tuple:
    """(first, length) of x[start:end] along a run-time dim n, as expressions of n, when Python's
    clamping makes the same choice at every n in its range; else refused."""
    lo, hi = n.bounds()
    if step == -1 and start == -1 and end < -hi:  # the whole dim reversed (torch.flip): from n - 1 down
        return n - 1, n
    if step < 1:
        raise UnsupportedOnnxOp(f"Slice with step {step} along a run-time dim")

    def position(i: int, clamp_high: bool):
        if i >= 0 and clamp_high and i >= hi:
            return n                      # past the end at every size: the end
        if 0 <= i <= lo:
            return i
        if i < 0 and -i <= lo:
            return n + i                  # from the end, never before the start
        # (a bound clamped at some sizes only would be a min/max the probes seldom tell apart from
        # n itself: x[:, :10] at probe lengths below 10 declares its output dim n)
        raise UnsupportedOnnxOp(f"Slice bound {i} of a run-time dim in [{lo}, {hi}] (clamped at some sizes only)")

    first, last = position(start, False), position(end, True)
    length = last - first
    if not proves_nonnegative(length):  # empty at some sizes (x[:, 1:-1] of a length from 1: max(n - 2, 0))
        length = maximum(length, 0)
    if step > 1:  # every step-th element from the first (x[:, ::2]): ceil(length / step) of them
        length = floordiv(length + (step - 1), step)
    return first, length


def _slice_to_sizes(n, start, end, step: int) -> tuple:
    """(first, length) of x[start:end] along a dim of size n when start or end is a run-time size
    (``position_ids[:, :seq]``): each bound a size (>= 0) or a non-negative int, clamped to n as
    Python does (provably, else through a min); refused when the slice could be empty at some
    sizes only by its bounds crossing."""
    if step != 1:
        raise UnsupportedOnnxOp(f"Slice with step {step} to a run-time size")

    def position(i):
        if not proves_nonnegative(i):
            raise UnsupportedOnnxOp(f"Slice bound {i} (negative at some sizes)")
        if proves_nonnegative(n - i):
            return i
        return n if proves_nonnegative(i - n) else minimum(i, n)

    first = position(start)
    length = position(end) - first
    if not proves_nonnegative(length):
        raise UnsupportedOnnxOp(f"Slice [{start}:{end}] of a dim of size {n} (empty at some sizes)")
    return first, length


def _number(value: np.ndarray):
    """A one-element constant or size as an int, float or Expr."""
    item = value.reshape(()).item()
    return _dim(item) if isinstance(item, (int, Expr)) else item


def _range(b, attrs, start, limit, delta):
    """Range: constant bounds are a constant. With run-time bounds (a constant step > 0), the first
    `length` elements of the constant range from the constant start (else from 0) with the most
    elements any size in range gives (a view: exact, and no code of its own), plus the start when
    that is a run-time size."""
    begin, end, step = (_integral(_number(b.const_value(v, "Range bounds"))) for v in (start, limit, delta))
    if not any(isinstance(v, Expr) for v in (begin, end, step)):
        return [b.const(np.arange(begin, end, step, dtype=start.dtype), start.dtype)]
    if not (all(isinstance(v, (int, Expr)) for v in (begin, end)) and isinstance(step, int)) or step <= 0:
        raise UnsupportedOnnxOp("Range over run-time sizes by a non-constant or non-positive step, or with "
                                "non-integer bounds")
    if not proves_nonnegative(as_expr(end) - begin):
        raise UnsupportedOnnxOp(f"Range [{begin}, {end}) (negative length at some sizes)")
    length = floordiv(as_expr(end) - begin + step - 1, step)
    most = length.bounds()[1]
    first = begin if isinstance(begin, int) else 0
    if start.dtype == "float32" and max(abs(v) for v in as_expr(begin).bounds()) + most * step > 2 ** 24:
        raise UnsupportedOnnxOp("a float32 Range past 2**24 (not every integer is a float32)")
    values = b.const(np.arange(first, first + most * step, step).astype(start.dtype), start.dtype)
    view = b.slice(values, [0], [1], (length,))
    if isinstance(begin, int):
        return [view]
    return [b.ew("Add", view, b.sizes(np.asarray(begin, dtype=object), start.dtype))]


def _integral(value):
    """A float bound that is an integer (Range of a float dtype over integers) as an int."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _is_sizes(node) -> bool:
    """A node Builder.sizes made: ints known at run time, or the static dims of a Shape."""
    return node is not None and (node.op == "size" or (node.op == "const" and node.attrs.get("sizes", False)))


def _size_arithmetic(fn):
    """An elementwise ONNX op on sizes, as Exprs."""
    def rule(b, attrs, x, y):
        values = [b.const_value(v, "size arithmetic").astype(object) for v in (x, y)]
        return [b.sizes(np.frompyfunc(fn, 2, 1)(*values), x.dtype)]
    return rule


def _size_quotient(a, d):
    """ONNX Div of two integer sizes. It truncates; the Exprs floor: the same for a >= 0 and d >= 1,
    which must hold at every size in range (else refused, never rendered as the wrong rounding)."""
    a, d = _dim(a), _dim(d)
    if isinstance(a, int) and isinstance(d, int) and a >= 0 and d >= 1:
        return a // d
    if not (proves_nonnegative(as_expr(a)) and as_expr(d).bounds()[0] >= 1):
        raise UnsupportedOnnxOp(f"Div of sizes {a} / {d}: truncation equals floor division only for a "
                                f"non-negative dividend and a divisor >= 1 at every size")
    return _dim(floordiv(a, d))


def _size_remainder(a, d):
    """ONNX Mod (fmod=0) of two integer sizes: Python's remainder, the Expr's; refused unless the
    dividend is >= 0 and the divisor >= 1 at every size (C++ % truncates; no remainder by 0)."""
    a, d = _dim(a), _dim(d)
    if not (proves_nonnegative(as_expr(a)) and as_expr(d).bounds()[0] >= 1):
        raise UnsupportedOnnxOp(f"Mod of sizes {a} % {d}: only a non-negative dividend and a divisor >= 1 "
                                f"at every size")
    return _dim(mod(a, d))


def _size_mod(b, attrs, x, y):
    if attrs.get("fmod", 0) or not np.issubdtype(np.dtype(x.dtype), np.integer):
        raise UnsupportedOnnxOp(f"Mod of {x.dtype} sizes with fmod={attrs.get('fmod', 0)} (integer remainders only)")
    return _size_arithmetic(_size_remainder)(b, attrs, x, y)


def _size_div(b, attrs, x, y):
    if not np.issubdtype(np.dtype(x.dtype), np.integer):
        raise UnsupportedOnnxOp(f"Div of {x.dtype} sizes (only integer division of sizes is exact)")
    return _size_arithmetic(_size_quotient)(b, attrs, x, y)


# ONNX ops on "size" nodes (Builder.sizes): the same op on the values, still known at run time only
SIZE_RULES = {
    "Shape": lambda b, attrs, x: [b.sizes(np.asarray(x.shape[slice(attrs.get("start", 0), attrs.get("end"))],
                                                      dtype=object))],
    "Identity": lambda b, attrs, x: [x],
    "Cast": lambda b, attrs, x: [b.sizes(b.const_value(x, "Cast"), helper.tensor_dtype_to_np_dtype(attrs["to"]).name)],
    "Squeeze": lambda b, attrs, x, axes=None: [b.sizes(
        np.squeeze(b.const_value(x, ""), tuple(int(a) for a in b.const_value(axes, "Squeeze axes").reshape(-1)))
        if axes is not None else np.squeeze(b.const_value(x, "")), x.dtype)],
    "Unsqueeze": lambda b, attrs, x, axes: [b.sizes(
        np.expand_dims(b.const_value(x, ""), tuple(int(a) for a in b.const_value(axes, "Unsqueeze axes").reshape(-1))), x.dtype)],
    "Concat": lambda b, attrs, *args: [b.sizes(
        np.concatenate([b.const_value(a, "Concat").astype(object) for a in args], axis=attrs["axis"]), args[0].dtype)],
    **{op: _size_arithmetic(fn) for op, fn in (("Add", operator.add), ("Sub", operator.sub), ("Mul", operator.mul),
                                                ("Max", maximum))},
    "Div": _size_div,
    "Mod": _size_mod,
    "Gather": lambda b, attrs, data, indices: [b.sizes(
        np.take(b.const_value(data, ""), b.const_value(indices, "Gather indices of sizes"), axis=attrs.get("axis", 0)),
        data.dtype)],
}


def _concat(b, attrs, *args):
    return [b.concat(list(args), attrs["axis"])]


def _gather(b, attrs, data, indices):
    return [b.gather(data, indices, attrs.get("axis", 0))]


def _conv(b, attrs, x, w, bias=None):
    spatial = x.rank - 2
    if x.dtype != "float32" or not 1 <= spatial <= 3:
        raise UnsupportedOnnxOp(f"Conv on {x.dtype} with {spatial} spatial dims (float32, 1-3 supported)")
    if attrs.get("auto_pad", "NOTSET") != "NOTSET":
        raise UnsupportedOnnxOp("Conv with auto_pad (explicit pads are supported)")
    strides, pads = attrs.get("strides", [1] * spatial), attrs.get("pads", [0] * 2 * spatial)
    dilations, groups = attrs.get("dilations", [1] * spatial), attrs.get("group", 1)
    if _patch_conv(x, w, strides, pads, dilations, groups):
        return [_patches_times_weight(b, x, w, bias)]
    return [b.conv(x, w, bias, strides, pads, dilations, groups)]


# A convolution whose windows tile the engine's input image (stride == kernel, no padding or
# dilation: a vision transformer's patch embedding) is one GEMM of the patches, [pixels, C * kernel]
# x [C * kernel, out]: the patches are a reordering copy of the input, no im2col duplication. One
# core, ViT's 16x16 stride-16 embedding of a 224x224 image: oneDNN's direct convolution 487 us, the
# copy plus MKL's GEMM 340. Not for a computed input (ConvNeXt's 2x2 downsampling after a layer
# norm: 3.02 -> 3.36 ms for the model, the copy then recomputes and transposes it), nor for a short
# reduction (a 4x4 stem on RGB, C * kernel = 48), where the direct convolution is the better kernel.
PATCH_GEMM_MIN_REDUCTION = 256


def _patch_conv(x, w, strides, pads, dilations, groups) -> bool:
    kernel = list(w.shape[2:])
    return (x.op == "input" and groups == 1 and list(strides) == kernel and not any(pads)
            and all(d == 1 for d in dilations) and is_static(x.shape) and is_static(w.shape)
            and math.prod(kernel) > 1 and math.prod(w.shape[1:]) >= PATCH_GEMM_MIN_REDUCTION)


def _patches_times_weight(b, x, w, bias) -> Node:
    """conv(x, w) + bias as [N * pixels, C * kernel] @ [C * kernel, out], viewed back as NCHW."""
    spatial, kernel = x.rank - 2, list(w.shape[2:])
    out = [n // k for n, k in zip(x.shape[2:], kernel)]
    if [o * k for o, k in zip(out, kernel)] != list(x.shape[2:]):   # windows drop the ragged edge
        x = b.slice(x, [0] * x.rank, [1] * x.rank, list(x.shape[:2]) + [o * k for o, k in zip(out, kernel)])
    split = b.reshape(x, [*x.shape[:2], *(n for pair in zip(out, kernel) for n in pair)])    # N, C, O1, K1, ...
    perm = [0, *(2 + 2 * d for d in range(spatial)), 1, *(3 + 2 * d for d in range(spatial))]  # N, O.., C, K..
    reduction = math.prod(w.shape[1:])
    patches = b.reshape(b.permute(split, perm), [x.shape[0] * math.prod(out), reduction])
    y = b.matmul(patches, b.permute(b.reshape(w, [w.shape[0], reduction]), [1, 0]))
    if bias is not None:
        y = b.ew("Add", y, b.reshape(bias, [1, w.shape[0]]))
    y = b.reshape(y, [x.shape[0], *out, w.shape[0]])
    return b.permute(y, [0, spatial + 1, *range(1, spatial + 1)])


def _pool(kind):
    """MaxPool / AveragePool: pad (with -inf or 0), sliding-window view, reduce over the window."""
    def rule(b, attrs, x):
        kernel = list(attrs["kernel_shape"])
        spatial = len(kernel)
        strides = list(attrs.get("strides", [1] * spatial))
        dilations = list(attrs.get("dilations", [1] * spatial))
        pads = list(attrs.get("pads", [0] * 2 * spatial))
        if attrs.get("auto_pad", "NOTSET") != "NOTSET" or attrs.get("storage_order", 0):
            raise UnsupportedOnnxOp(f"{kind} pool with auto_pad or storage_order")
        size = x.shape[-spatial:]
        for d in range(spatial):
            # A window longer than the padded input (ceil_mode lets EfficientNet's head pool a 2x2
            # map with a 320-wide kernel) has only fill past it, and that dim has one window: take
            # the taps that land in the padded input (padding 2 up to 320 made a 262 MB buffer).
            extent = size[d] + pads[d] + pads[spatial + d]
            reach = -(-extent // dilations[d]) if isinstance(extent, int) else None
            if reach is not None and kernel[d] > reach:
                kernel[d], strides[d] = reach, extent
        ends = list(pads[spatial:])
        if attrs.get("ceil_mode", 0):  # extra windows that start inside the (begin-padded) input
            for d in range(spatial):
                extent = size[d] + pads[d] + pads[spatial + d] - dilations[d] * (kernel[d] - 1) - 1
                out = -(-extent // strides[d]) + 1
                if (out - 1) * strides[d] >= size[d] + pads[d]:
                    out -= 1
                ends[d] = max(ends[d], (out - 1) * strides[d] + dilations[d] * (kernel[d] - 1) + 1 - size[d] - pads[d])
        lead = [0] * (x.rank - spatial)
        fill = -np.inf if kind == "max" else 0.0
        if kind == "max" and x.dtype not in ("float32", "float64"):
            fill = np.iinfo(x.dtype).min
        padded = b.pad(x, lead + pads[:spatial], lead + ends, value=fill)
        windows = b.window(padded, kernel, strides, dilations)
        axes = list(range(x.rank, x.rank + spatial))
        if kind == "max":
            return [b.reduce("max", windows, axes, keepdims=False)]
        total = b.reduce("sum", windows, axes, keepdims=False)
        # the divisor of each window: its taps inside x, or with count_include_pad inside x and
        # its explicit pads (never the extra end that ceil_mode adds)
        include = attrs.get("count_include_pad", 0)
        if not any(pads) and ends == list(pads[spatial:]):  # every window is whole: a constant count
            return [b.ew("Div", total, b.const(np.array(math.prod(kernel)), x.dtype))]  # (run-time sizes too)
        inside = np.zeros(padded.shape[-spatial:])
        inside[tuple(slice(0 if include else lo, lo + n + (hi if include else 0))
                     for lo, n, hi in zip(pads[:spatial], size, pads[spatial:]))] = 1
        view = np.lib.stride_tricks.sliding_window_view(
            inside, [d * (k - 1) + 1 for k, d in zip(kernel, dilations)])
        view = view[tuple(slice(None, None, s) for s in strides) + tuple(slice(None, None, d) for d in dilations)]
        counts = view.reshape(view.shape[:spatial] + (-1,)).sum(-1)
        return [b.ew("Div", total, b.const(counts, x.dtype))]
    return rule


def _global_average_pool(b, attrs, x):
    return [b.mean(x, list(range(2, x.rank)))]


def _pad(b, attrs, x, pads_node, value=None, axes_node=None):
    pads = [int(p) for p in b.const_value(pads_node, "Pad pads")]
    axes = b.const_value(axes_node, "Pad axes")
    axes = range(x.rank) if axes is None else [normalize_axis(int(a), x.rank) for a in axes]
    begins, ends = [0] * x.rank, [0] * x.rank
    for k, axis in enumerate(axes):
        begins[axis], ends[axis] = pads[k], pads[len(axes) + k]
    if min(begins + ends) < 0:
        raise UnsupportedOnnxOp("Pad with negative pads")
    mode = attrs.get("mode", "constant")
    if mode not in ("constant", "reflect", "edge"):
        raise UnsupportedOnnxOp(f"Pad mode {mode!r}")
    fill = b.const_value(value, "Pad value")
    return [b.pad(x, begins, ends, mode, 0 if fill is None else fill.reshape(()).item())]


ONNX_RULES = {
    **{op: _elementwise(op) for op in ELEMENTWISE if op not in ("Max", "Min", "Cast", "Pow", "Mod")},
    "Mod": _fmod,
    "Max": _variadic("Max"),
    "Min": _variadic("Min"),
    "Cast": _cast,
    "Pow": _pow,
    "Identity": lambda b, attrs, x: [x],
    "Clip": _clip,
    "Gelu": _gelu,
    "ReduceSum": _reduction("sum"),
    "ReduceMean": _reduction("mean"),
    "ReduceMax": _reduction("max"),
    "ReduceMin": _reduction("min"),
    "ReduceProd": _reduction("prod"),
    "CumSum": _cumsum,
    "ArgMax": _arg_reduction("argmax"),
    "ArgMin": _arg_reduction("argmin"),
    "Softmax": _softmax(log=False),
    "LogSoftmax": _softmax(log=True),
    "LayerNormalization": _layer_norm,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Transpose": _transpose,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Expand": _expand,
    "Slice": _slice,
    "Concat": _concat,
    "Gather": _gather,
    "Conv": _conv,
    "MaxPool": _pool("max"),
    "AveragePool": _pool("average"),
    "GlobalAveragePool": _global_average_pool,
    "Pad": _pad,
    "Range": _range,
    "Shape": SIZE_RULES["Shape"],
}


# ---------------------------------------------------------------------------------------------
# ONNX model -> IR graph

def _np_dtype(elem_type: int) -> str:
    return helper.tensor_dtype_to_np_dtype(elem_type).name


def constant_tensors(model: onnx.ModelProto) -> dict:
    """Every constant of the graph by value name: initializers and Constant-node outputs."""
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            attr = node.attribute[0]
            if attr.name != "value":
                raise UnsupportedOnnxOp(f"Constant with attribute {attr.name!r}")
            values[node.output[0]] = numpy_helper.to_array(attr.t)
    return values


def load_model(onnx_path_or_model) -> onnx.ModelProto:
    if isinstance(onnx_path_or_model, onnx.ModelProto):
        return onnx_path_or_model
    return onnx.load(str(onnx_path_or_model))


# The contract checks (onnx.checker, shape inference) see floating-point initializers of more than
# this many elements as graph inputs of the same type and shape. ONNX's shape inference reads
# initializer values only as shape data (int32/int64 tensors, kept whole) or as small float operands
# (Resize scales, Range bounds), so the weights decide nothing there but their type and shape; and
# both checks serialize the model they get, weights included: for GPT-2's 64 MB cluster ~0.5 s of
# CPU a check, paid by every engine compile and by blade/dynamic.py's check of run-time sizes.
SHAPE_ONLY_ELEMENTS = 64
_FLOATING = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def without_weight_values(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its large floating-point initializers as typed graph inputs (see
    SHAPE_ONLY_ELEMENTS), for the contract checks; the model itself when it has none."""
    graph = model.graph
    weights = [t for t in graph.initializer
               if t.data_type in _FLOATING and int(np.prod(t.dims, dtype=np.int64)) > SHAPE_ONLY_ELEMENTS]
    if not weights:
        return model
    names = {t.name for t in weights}
    inputs = list(graph.input) + [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                  for t in weights]
    kept = [t for t in graph.initializer if t.name not in names]
    checked = helper.make_model(
        helper.make_graph(graph.node, graph.name, inputs, graph.output, kept, value_info=graph.value_info),
        opset_imports=model.opset_import, producer_name=model.producer_name)
    checked.ir_version = model.ir_version
    return checked


def lower_onnx(model: onnx.ModelProto) -> Graph:
    """Checks the backend contract and lowers the graph into IR primitives."""
    checked = without_weight_values(model)
    onnx.checker.check_model(checked)
    inferred = onnx.shape_inference.infer_shapes(checked, strict_mode=True).graph
    typed = {v.name: v for v in list(inferred.value_info) + list(inferred.output)}
    constants = constant_tensors(model)
    graph = model.graph
    symbols, bound = _size_symbols(model)
    b = Builder()
    env: dict[str, Node] = {"": None}
    for name, value in constants.items():
        if value.dtype.name not in DTYPES:
            raise UnsupportedOnnxOp(f"constant {name!r} of dtype {value.dtype}")
        env[name] = b.const(value, name=name)
    inputs = []
    for value in graph.input:
        if value.name in constants:
            continue  # an initializer listed as input (old exporters): still a constant
        dtype = _np_dtype(value.type.tensor_type.elem_type)
        if dtype not in DTYPES:
            raise UnsupportedOnnxOp(f"graph input {value.name!r} of dtype {dtype}")
        env[value.name] = b.input(value.name, _input_shape(value, symbols), dtype)
        inputs.append(env[value.name])
    for index, node in enumerate(graph.node):
        if node.op_type == "Constant":
            continue
        try:
            _lower_node(b, node, env, typed, symbols)
        except Exception as err:
            # which ONNX node failed: the frontend (blade/dynamic.py) leaves the op that made it
            # out of the cluster rather than the whole cluster
            err.onnx_node = index
            raise
    outputs = [(v.name, env[v.name]) for v in graph.output]
    if any(node.op == "size" for _, node in outputs):
        raise UnsupportedOnnxOp("a run-time size as a graph output")
    input_dims = {d.dim_param for value in graph.input for d in value.type.tensor_type.shape.dim}
    used = {var for name, var in bound.items() if name in input_dims}
    derived = _derived_symbols(model, symbols, used, {d for _, node in outputs for d in node.shape})
    return Graph(inputs, outputs, [n for n in b.nodes if n.op != "size"],
                 [(name, var) for name, var in bound.items() if var in used], derived,
                 [(var, symbols[name]) for name, var in bound.items() if var in used and symbols[name] is not var])


def _lower_node(b: Builder, node, env: dict, typed: dict, symbols: dict) -> None:
    """One ONNX node's IR, its outputs checked against ONNX's inference and bound in env."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ONNX_RULES:
        raise UnsupportedOnnxOp(f"ONNX op {node.domain + '::' if node.domain else ''}{node.op_type} "
                                f"(node {node.name or node.output[0]!r}) is not supported by the engine")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    args = [env[name] for name in node.input]
    sizes_only = any(_is_sizes(a) for a in args) and all(a is None or _is_sizes(a) or a.op == "const" for a in args)
    rule = SIZE_RULES.get(node.op_type) if sizes_only else None
    outs = (rule or ONNX_RULES[node.op_type])(b, attrs, *args)
    for name, out in zip(node.output, outs):
        if not name:
            continue
        _check_against_inference(node, name, out, typed.get(name), symbols)
        env[name] = out


def _size_symbols(model: onnx.ModelProto) -> tuple[dict, dict]:
    """(symbols, bound) from the model's metadata. symbols: dim_param name -> its size symbol (Var
    "size<k>" in its declared range, SIZE_RANGES_KEY) or the Expr its tree builds (SIZE_EQUAL_KEY,
    SIZE_DERIVED_KEY). bound: dim_param name -> the Var an input binds it to: the symbol itself, or
    for a size equal to a tree over others a Var of its own, which the engine checks against the tree."""
    props = {p.key: p.value for p in model.metadata_props}
    ranges = json.loads(props.get(SIZE_RANGES_KEY, "{}"))
    derived = json.loads(props.get(SIZE_DERIVED_KEY, "{}"))
    equal = json.loads(props.get(SIZE_EQUAL_KEY, "{}"))
    symbols, bound = {}, {}
    for k, (name, (lo, hi)) in enumerate(ranges.items()):
        if not 0 <= lo <= hi:
            raise ValueError(f"size symbol {name!r} has the range [{lo}, {hi}]")
        if name not in derived:
            bound[name] = Var(f"size{k}", int(lo), int(hi))
        if name not in derived and name not in equal:
            symbols[name] = bound[name]

    def build(tree):  # a derived size's tree (SIZE_DERIVED_KEY) as an Expr over the bound symbols
        if isinstance(tree, int):
            return tree
        if isinstance(tree, str) and tree in symbols and tree not in derived:
            return symbols[tree]
        if isinstance(tree, list) and tree and tree[0] in DERIVED_OPS:
            return DERIVED_OPS[tree[0]](*map(build, tree[1:]))
        raise ValueError(f"derived size symbol tree {tree!r} is not over the bound size symbols")

    for name, tree in list(equal.items()) + list(derived.items()):
        if name not in ranges:
            raise ValueError(f"derived size symbol {name!r} has no range ({SIZE_RANGES_KEY})")
        symbols[name] = as_expr(build(tree))
    return symbols, bound


def _derived_symbols(model: onnx.ModelProto, symbols: dict, bound: set, output_dims: set) -> list:
    """(name, Expr) of each derived size symbol an output has; its variables must be sizes the inputs
    bind, or the engine could not compute it before the run."""
    names = json.loads({p.key: p.value for p in model.metadata_props}.get(SIZE_DERIVED_KEY, "{}"))
    derived = [(name, symbols[name]) for name in names if symbols[name] in output_dims]
    for name, expr in derived:
        if not expr.free_vars() <= bound:
            raise UnsupportedOnnxOp(f"output dim {name!r} is over size symbols no input binds")
    return derived


def _input_shape(value_info, symbols: dict) -> tuple:
    """A graph input's shape: its dim_params as size symbols (each must have a declared range)."""
    shape = []
    for d in value_info.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            shape.append(d.dim_value)
        elif d.HasField("dim_param") and d.dim_param in symbols:
            shape.append(symbols[d.dim_param])
        elif d.HasField("dim_param"):
            raise UnsupportedOnnxOp(f"input {value_info.name!r} dim {d.dim_param!r} has no declared range "
                                    f"(model metadata {SIZE_RANGES_KEY})")
        else:
            raise ValueError(f"value {value_info.name!r} has no static shape")
    return tuple(shape)


def _check_against_inference(node, name, out: Node, value_info, symbols: dict) -> None:
    """Our shape rules must agree with ONNX's: a mismatch is a bug in a rule, caught at compile time.
    ONNX names a run-time dim by its dim_param where it can, else leaves it unknown (not compared)."""
    if value_info is None:
        return
    dims, dtype = value_info.type.tensor_type.shape.dim, _np_dtype(value_info.type.tensor_type.elem_type)
    shape = [d.dim_value if d.HasField("dim_value") else symbols.get(d.dim_param) for d in dims]
    if len(shape) != out.rank or dtype != out.dtype or any(
            n is not None and n != m for n, m in zip(shape, out.shape)):
        raise AssertionError(f"{node.op_type} rule for {name!r} gives {out.shape} {out.dtype}, "
                             f"ONNX infers {shape} {dtype}")
