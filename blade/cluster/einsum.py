"""aten::einsum as ONNX Transpose / Reshape / MatMul / Mul / ReduceSum / Expand.

The engine has no einsum of its own: like torch's CPU kernel, the operands are contracted left to
right, two at a time, each pair as one batched matrix product [batch, left, k] @ [batch, k, right]
(an outer product, k empty, is a broadcast Mul the engine fuses). Before a pair is contracted, a
label that neither the rest of the operands nor the output needs is summed out of the operand that
alone holds it. A label of size 1 in one operand and n in another broadcasts (torch's rule), so
the operand holding 1 is expanded first.

Refused (the node stays in TorchScript, with the reason): a label repeated within one operand
(a diagonal) and anything torch itself rejects.
"""
from __future__ import annotations

import math

ELLIPSIS = "..."


def parse(equation: str, ranks: list[int]) -> tuple[list[list[str]], list[str]]:
    """(each operand's labels, the output's labels) of an einsum equation; an ellipsis becomes
    labels '...0', '...1', ... aligned to the right (the broadcast dims, in front of the implicit
    output as torch puts them)."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ValueError(f"einsum equation {equation!r} names {len(terms)} operands, got {len(ranks)}")
    broadcast = max((rank - len(term.replace(ELLIPSIS, "")) for term, rank in zip(terms, ranks)
                     if ELLIPSIS in term), default=0)
    ellipsis = [f"{ELLIPSIS}{k}" for k in range(broadcast)]

    def labels(term: str, rank: int) -> list[str]:
        head, dots, tail = term.partition(ELLIPSIS)
        middle = ellipsis[len(ellipsis) - (rank - len(head) - len(tail)):] if dots else []
        if not dots and len(term) != rank or any(not c.isalpha() for c in head + tail):
            raise ValueError(f"einsum term {term!r} does not fit an operand of rank {rank}")
        return list(head) + middle + list(tail)

    operands = [labels(term, rank) for term, rank in zip(terms, ranks)]
    if arrow:
        output = labels(rhs, len(rhs.replace(ELLIPSIS, "")) + (broadcast if ELLIPSIS in rhs else 0))
    else:  # implicit: the broadcast dims, then the labels used once, in alphabetical order
        used = [label for term in operands for label in term if not label.startswith(ELLIPSIS)]
        output = ellipsis + sorted(label for label in set(used) if used.count(label) == 1)
    return operands, output


def refusal(equation: str, shapes: list[list[int]]) -> str | None:
    """Why einsum(equation, operands of these shapes) cannot be lowered, else None."""
    try:
        operands, output = parse(equation, [len(s) for s in shapes])
    except ValueError as err:
        return str(err)
    if any(len(set(term)) != len(term) for term in operands):
        return "einsum with a label repeated in one operand (a diagonal)"
    if len(set(output)) != len(output) or not set(output) <= {label for term in operands for label in term}:
        return f"einsum output {output} repeats a label or names one no operand has"
    if not all(isinstance(size, int) for shape in shapes for size in shape):
        return "einsum over a run-time size"
    try:
        label_sizes(operands, shapes)
    except ValueError as err:
        return str(err)
    return None


def label_sizes(terms: list[list[str]], shapes: list[list[int]]) -> dict:
    """Each label's size: the one size other than 1 its dims have (1 broadcasts, as in torch)."""
    return {label: size for label, (size, _) in _label_dims(terms, shapes).items()}


def _label_dims(terms: list[list[str]], shapes: list[list[int]]) -> dict:
    """label -> (its size, (operand, dim) that has it: the first that has it other than 1)."""
    found: dict = {}
    for k, (term, shape) in enumerate(zip(terms, shapes)):
        for d, (label, size) in enumerate(zip(term, shape)):
            if label not in found or found[label][0] == 1 and size != 1:
                found[label] = (size, (k, d))
            elif size not in (1, found[label][0]):
                raise ValueError(f"einsum label {label!r} has sizes {found[label][0]} and {size}")
    return found


class _Operand:
    """An ONNX value and the label of each of its dims."""

    def __init__(self, name: str, labels: list[str], shape: list[int]):
        self.name, self.labels, self.shape = name, list(labels), list(shape)


class _Sizes:
    """Each label's size at the example (ints: what the lowering decides on) and as the ONNX
    reshapes and expands take it: the int, or for a run-time dim its size read at run time, so
    the same ONNX holds at every size. ONNX is made only for the shapes a node takes."""

    def __init__(self, ctx, terms: list, values: list):
        self.ctx = ctx
        dims = _label_dims(terms, [ctx.shape(v) for v in values])
        self.static = {label: size for label, (size, _) in dims.items()}
        self.run_time = {label: (values[k], d) for label, (_, (k, d)) in dims.items()
                         if d in ctx.run_time.get(values[k], {})}
        self._read: dict = {}   # label -> the ONNX size read for it, once

    def of(self, groups: list) -> list:
        """The static shape of dims that are each the product of a group of labels."""
        return [math.prod(self.static[label] for label in group) for group in groups]

    def onnx(self, groups: list) -> str:
        """That shape as an ONNX value (computed from the run-time sizes where it has some)."""
        if not self.any_run_time(groups):
            return self.ctx.b.ints(self.of(groups))
        return self.ctx.sizes([self._product(group) for group in groups])

    def any_run_time(self, groups: list) -> bool:
        return any(label in self.run_time for group in groups for label in group)

    def _product(self, group: list):
        product = math.prod(self.static[label] for label in group if label not in self.run_time)
        for label in group:
            if label in self.run_time:
                if label not in self._read:
                    self._read[label] = self.ctx.read_dim(*self.run_time[label])
                product = self._read[label] if product == 1 else \
                    self.ctx.b.op("Mul", [product if isinstance(product, str) else self.ctx.scalar(product, "int64"),
                                          self._read[label]])
        return product


def lower(ctx, equation: str, values: list) -> str:
    """The ONNX name of einsum(equation, operands) built into LowerCtx ctx (refusal() is None)."""
    b = ctx.b
    shapes = [ctx.shape(v) for v in values]
    terms, output = parse(equation, [len(s) for s in shapes])
    sizes = _Sizes(ctx, terms, values)
    operands = [_Operand(ctx.tensor(v), term, shape) for v, term, shape in zip(values, terms, shapes)]
    result = operands[0]
    for k, other in enumerate(operands[1:], start=1):
        needed = set(output).union(*(op.labels for op in operands[k + 1:]))
        result = _sum_out(b, result, set(result.labels) - needed - set(other.labels))
        other = _sum_out(b, other, set(other.labels) - needed - set(result.labels))
        result = _contract(b, result, other, needed, sizes)
    result = _sum_out(b, result, set(result.labels) - set(output))
    return _transpose(b, result, output).name


def _sum_out(b, x: _Operand, labels: set) -> _Operand:
    if not labels:
        return x
    axes = [d for d, label in enumerate(x.labels) if label in labels]
    name = b.op("ReduceSum", [x.name, b.ints(axes)], keepdims=0)
    kept = [d for d in range(len(x.labels)) if d not in axes]
    return _Operand(name, [x.labels[d] for d in kept], [x.shape[d] for d in kept])


def _transpose(b, x: _Operand, order: list[str]) -> _Operand:
    perm = [x.labels.index(label) for label in order]
    if perm == list(range(len(perm))):
        return x
    return _Operand(b.op("Transpose", [x.name], perm=perm), order, [x.shape[d] for d in perm])


def _reshape(b, x: _Operand, groups: list, sizes: _Sizes) -> str:
    """x reshaped to dims that are each the product of a group of labels (x.labels: each of its
    dims' label, or for a product's dims their groups). Left out where the shape is x's at every
    size: the same groups, or the same static shape without run-time sizes."""
    same_groups = [tuple(g) for g in groups] == [tuple(g) if isinstance(g, list) else (g,) for g in x.labels]
    if sizes.of(groups) == x.shape and (same_groups or not sizes.any_run_time(groups)):
        return x.name
    return b.op("Reshape", [x.name, sizes.onnx(groups)], allowzero=1)


def _expand(b, x: _Operand, sizes: _Sizes) -> _Operand:
    """x with its size-1 dims broadcast to the label's size elsewhere."""
    groups = [[label] for label in x.labels]
    full = sizes.of(groups)
    if full == x.shape:
        return x
    return _Operand(b.op("Expand", [x.name, sizes.onnx(groups)]), x.labels, full)


def _contract(b, x: _Operand, y: _Operand, needed: set, sizes: _Sizes) -> _Operand:
    """x and y contracted over their shared labels not needed later: [batch, left, right]."""
    shared = [label for label in x.labels if label in y.labels]
    batch = [label for label in shared if label in needed]
    summed = [label for label in shared if label not in needed]
    left = [label for label in x.labels if label not in shared]
    right = [label for label in y.labels if label not in shared]
    x, y = _expand(b, x, sizes), _expand(b, y, sizes)
    x, y = _transpose(b, x, batch + left + summed), _transpose(b, y, batch + summed + right)
    batch_groups = [[label] for label in batch]
    if summed:
        product = b.op("MatMul", [_reshape(b, x, batch_groups + [left, summed], sizes),
                                  _reshape(b, y, batch_groups + [summed, right], sizes)])
    else:  # an outer product: a broadcast multiply, not a GEMM with k = 1
        product = b.op("Mul", [_reshape(b, x, batch_groups + [left, []], sizes),
                               _reshape(b, y, batch_groups + [[], right], sizes)])
    labels = batch + left + right
    flat = _Operand(product, batch + [left, right], sizes.of(batch_groups + [left, right]))
    groups = [[label] for label in labels]
    return _Operand(_reshape(b, flat, groups, sizes), labels, sizes.of(groups))
