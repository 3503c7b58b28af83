"""What every lowering rule shares: the lowering context (TorchScript values of one cluster -> ONNX
names), the value helpers its checks read (static tensor info, constant arguments, run-time sizes)
and ``Rule`` itself (a lowering with its own check). The op families import from here only, and
blade/cluster/support.py joins their tables."""
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


NOT_CONSTANT = object()


def constant_value(value: torch.Value):
    """The Python value of a constant argument (through lists of constants), else NOT_CONSTANT."""
    node = value.node()
    if node.kind() == "prim::Constant":
        return value.toIValue()
    if node.kind() == "prim::ListConstruct" and not is_tensor_list(value) and not _written(value):
        items = [constant_value(v) for v in node.inputs()]
        return NOT_CONSTANT if any(i is NOT_CONSTANT for i in items) else items
    return NOT_CONSTANT


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
    return constant_value(value) is not NOT_CONSTANT


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
    if c is not NOT_CONSTANT:
        return type(c) is int and (c > 0 if positive else c >= 0)
    node = value.node()
    if node.kind() == "aten::size":
        return True
    if is_size_arithmetic(node) and node.kind() in ("aten::add", "aten::mul"):
        return all(is_nonnegative_size(v, positive) for v in node.inputs())
    if is_size_arithmetic(node) and node.kind() == "aten::floordiv":
        return not positive and is_nonnegative_size(node.inputsAt(0)) and is_nonnegative_size(node.inputsAt(1), True)
    return False


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
        if result is NOT_CONSTANT:
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
        return name if have == want else self.b.op("Cast", [name], to=onnx_type(want))

    def as_dtype(self, value: torch.Value, want: np.dtype) -> str:
        """A tensor or scalar argument as an ONNX value of dtype `want`."""
        if is_tensor(value):
            return self.cast(self.tensor(value), self.dtype(value), want)
        return self.scalar(self.const(value), want)

    def scalar(self, number, dtype: np.dtype) -> str:
        return self.b.constant(np.asarray(number, dtype=dtype), "s")


def onnx_type(dtype: np.dtype) -> int:
    from blade.cluster.onnx_builder import NP_TO_ONNX
    return NP_TO_ONNX[np.dtype(dtype)]


def out_dtype(node) -> np.dtype:
    return TORCH_TO_NP[node.output().type().dtype()]


def node_args(node) -> list:
    return list(node.inputs())


def promoted_dtype(a: torch.Value, b: torch.Value) -> np.dtype:
    """torch's result type of two operands (what a comparison computes in): tensors stand in as
    tiny tensors of the same dtype and dimensionality class, scalars as themselves."""
    def probe(value):
        if is_tensor(value):
            return torch.empty((1,) if value.type().dim() else (), dtype=value.type().dtype())
        return constant_value(value)
    return TORCH_TO_NP[torch.result_type(probe(a), probe(b))]


@dataclass(frozen=True)
class Rule:
    lower: Callable[[LowerCtx, torch.Node], list]
    # Extra condition beyond the generic ones: returns a reason when the node is NOT supported.
    check: Optional[Callable[[torch.Node], Optional[str]]] = None
    tensor_lists: bool = False  # the node consumes or produces Tensor[] values
    # its non-tensor arguments may be run-time sizes (is_size_value), read with LowerCtx.size(s)
    size_args: bool = False


def int64_size(ctx: LowerCtx, n) -> str:
    """A size (an int, or the ONNX name of a run-time one) as a 0-d int64 ONNX value."""
    return ctx.scalar(n, np.int64) if isinstance(n, int) else n


def size_product(ctx: LowerCtx, sizes: list):
    """The product of sizes: an int while they are static, else an ONNX value."""
    if all(isinstance(n, int) for n in sizes):
        return int(np.prod(sizes))
    product = None
    for n in sizes:
        product = int64_size(ctx, n) if product is None else ctx.b.op("Mul", [product, int64_size(ctx, n)])
    return product


def dims_to_axes(dims, rank: int) -> list:
    """A dim argument (int, list, None or []) as sorted non-negative axes; none given = all."""
    if dims is None or dims == []:
        return list(range(rank))
    return sorted(d % max(rank, 1) for d in ([dims] if isinstance(dims, int) else dims))


def static_shape_of(value):
    info = tensor_info(value) if is_tensor(value) else None
    return info[1] if info else None


def named_args(node) -> dict:
    """The node's inputs by schema argument name (factories have several overloads)."""
    schema = torch._C.parse_schema(node.schema())
    return {arg.name: value for arg, value in zip(schema.arguments, node.inputs())}


def needs_const_false(index: int, what: str):
    def check(node):
        args = node_args(node)
        if len(args) > index and constant_value(args[index]) not in (False, None):
            return f"{what} is not supported (inference only)"
        return None
    return check
