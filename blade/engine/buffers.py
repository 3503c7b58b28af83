"""Memory of an engine: the buffers of IR nodes (inputs, outputs, constants, scratch), strided
views of them, the dim orders buffers are stored in, and the scratch arena plan.

A node has memory when it is a graph input, a constant, or materialized by the plan (plan.py);
views of such a node are strided views of the same buffer (views.VIEW_LAYOUT). Scratch buffers get
arena offsets after every kernel exists (``plan_arena``), from their live ranges in kernel numbers.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from . import views
from .ir import Graph, Node
from .manifest import DTYPES
from .symbolic import Expr, as_expr, proves_at_least
from .views import Layout, contiguous_strides, linear_index

INLINE_CONST_MAX = 64          # constants with at most this many elements are compiled into the code
ALIGN = 64                     # arena offsets and stack rows are aligned to this (bytes)


@dataclass(eq=False)
class Buffer:
    kind: str          # "input" | "output" | "const" | "inline" | "scratch"
    index: int         # position in inputs / outputs / constants, or scratch number
    dtype: str
    numel: int
    values: object = None          # inline constants: the numpy array
    first: int = -1                # scratch live range, in kernel numbers
    last: int = -1
    offset: int = 0                # scratch arena offset (bytes), planned at the end
    referenced: bool = False       # some kernel reads or writes it through a pointer

    @property
    def ident(self) -> str:
        prefix = {"input": "in", "output": "out", "const": "c", "inline": "k", "scratch": "s"}[self.kind]
        return f"{prefix}{self.index}"

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype][1]

    @property
    def element_ctype(self) -> str:
        """The C++ type of its elements in memory. bool is stored as uint8_t (the same bytes):
        g++ finds no vector type for loads of bool, so a loop that reads a bool mask (a causal
        attention mask) would not vectorize at all."""
        return "uint8_t" if self.dtype == "bool" else DTYPES[self.dtype][0]


@dataclass
class Strided:
    buf: Buffer
    shape: tuple
    layout: Layout

    @classmethod
    def dense(cls, buf: Buffer, shape) -> "Strided":
        return cls(buf, tuple(shape), Layout(0, contiguous_strides(shape)))

    def address(self, idx) -> Expr:
        return linear_index(idx, self.layout.strides, self.layout.offset)


# ---------------------------------------------------------------------------------------------
# Dim orders: a buffer may hold its dims nested in another order than the logical one

def channels_last_order(rank: int) -> tuple:
    """The dims of [n, c, *spatial] in channels-last memory order (n, *spatial, c)."""
    return (0, *range(2, rank), 1)


CHANNELS_LAST = channels_last_order(4)   # NCHW dims in the memory order of NHWC


def strides_in_order(shape, order) -> tuple:
    """Strides of a tensor of `shape` stored densely with its dims nested as `order` (outermost first)."""
    dense = contiguous_strides([shape[d] for d in order])
    strides = [0] * len(shape)
    for position, d in enumerate(order):
        strides[d] = dense[position]
    return tuple(strides)


def same_strides(shape, a, b) -> bool:
    """Whether strides a and b address the same elements of `shape` (size-1 dims never move)."""
    return all(x == y for n, x, y in zip(shape, a, b) if n != 1)


def permuted(s: Strided, order) -> Strided:
    """s with its dims in `order`: the same elements, indexed in that order."""
    return Strided(s.buf, tuple(s.shape[d] for d in order),
                   Layout(s.layout.offset, tuple(s.layout.strides[d] for d in order)))


def blocked(s: Strided, dim: int, block: int) -> Strided:
    """s with dim cut into (its blocks, in place; a block's elements, appended as the last dim):
    the same elements, in the loop order of a kernel that runs block by block."""
    stride = s.layout.strides[dim]
    return Strided(s.buf, s.shape[:dim] + (s.shape[dim] // block,) + s.shape[dim + 1:] + (block,),
                   Layout(s.layout.offset, s.layout.strides[:dim] + (block * stride,) + s.layout.strides[dim + 1:]
                          + (stride,)))


def unblocked(idx, dim: int, block: int) -> list:
    """Indices of s from indices of blocked(s, dim, block) (its inverse)."""
    return list(idx[:dim]) + [idx[dim] * block + idx[-1]] + list(idx[dim + 1:-1])


def unpermuted(idx, order) -> list:
    """Indices in the logical dim order from indices in `order` (the inverse of permuted)."""
    logical = [None] * len(order)
    for position, d in enumerate(order):
        logical[d] = idx[position]
    return logical


def _at_least_unless_empty(a, b, shape) -> bool:
    """a >= b wherever a tensor of this shape has elements: a = b * q exactly, q a product of
    consecutive dims of the shape (a contiguous stride over a dim that may be 0, as [b, s - 1, 5]
    from x[:, :-1] with s from 1 has: 0 only where the tensor is empty, so no loop runs)."""
    a, b = as_expr(a), as_expr(b)
    if b.bounds()[0] < 1:
        return False
    try:
        q = a // b
    except ValueError:
        return False
    if q * b != a or q.bounds()[0] < 0:
        return False
    for i in range(len(shape)):
        run = as_expr(1)
        for n in shape[i:]:
            run = run * n
            if run == q:
                return True
    return False


def memory_order(s: Strided) -> tuple:
    """s's dims from the largest stride to the smallest (the order of a loop nest that walks its
    memory forward); size-1 dims keep their place."""
    moving = [d for d, n in enumerate(s.shape) if n != 1]
    strides = [s.layout.strides[d] for d in moving]
    if any(isinstance(x, Expr) for x in strides):
        # run-time strides: sorted by the order they provably have (at least as large: first)
        def larger_first(a, b):
            sa, sb = s.layout.strides[a], s.layout.strides[b]
            if as_expr(sa) == sb:
                return 0
            if proves_at_least(sa, sb) or _at_least_unless_empty(sa, sb, s.shape):
                return -1
            if proves_at_least(sb, sa) or _at_least_unless_empty(sb, sa, s.shape):
                return 1
            raise TypeError(f"the memory order of strides {strides} depends on run-time sizes")
        moving.sort(key=functools.cmp_to_key(larger_first))
    else:
        moving.sort(key=lambda d: -s.layout.strides[d])
    it = iter(moving)
    return tuple(d if n == 1 else next(it) for d, n in enumerate(s.shape))


# ---------------------------------------------------------------------------------------------
# The buffers of one engine

class Memory:
    """Which buffer holds each node that has memory, created as kernels are emitted (scratch
    numbers follow emission order), and the constants the engine needs."""

    def __init__(self, graph: Graph):
        self.buffers: dict[Node, Buffer] = {}
        self.scratch: list[Buffer] = []
        self.runtime_consts: list[tuple[str, Node]] = []   # passed at run time, in pointer order
        self.inline_consts: list[Buffer] = []              # compiled into the code
        self.strided_memo: dict = {}
        for i, node in enumerate(graph.inputs):
            self.buffers[node] = Buffer("input", i, node.dtype, node.numel)

    def output(self, node: Node, k: int) -> None:
        """node is stored straight into graph output k."""
        self.buffers[node] = Buffer("output", k, node.dtype, node.numel)

    def const_buffer(self, node: Node) -> Buffer:
        if node not in self.buffers:
            if node.numel <= INLINE_CONST_MAX or node.attrs.get("derived"):
                buf = Buffer("inline", len(self.inline_consts), node.dtype, node.numel, node.attrs["value"])
                self.inline_consts.append(buf)
            else:
                buf = Buffer("const", len(self.runtime_consts), node.dtype, node.numel)
                self.runtime_consts.append((node.name, node))
            self.buffers[node] = buf
        return self.buffers[node]

    def new_scratch(self, dtype: str, shape) -> Strided:
        buf = Buffer("scratch", len(self.scratch), dtype, math.prod(shape))
        self.scratch.append(buf)
        return Strided.dense(buf, shape)

    def strided_of(self, node: Node) -> Strided | None:
        """node as a strided view of memory, when it has (or views) memory."""
        if node in self.strided_memo:
            return self.strided_memo[node]
        result = None
        if node.op == "const":
            result = Strided.dense(self.const_buffer(node), node.shape)
        elif node in self.buffers:
            result = Strided.dense(self.buffers[node], node.shape)
        elif node.op == "view":
            src = self.strided_of(node.args[0])
            layout = src and views.view_layout(node, src.layout)
            result = layout and Strided(src.buf, node.shape, layout)
        self.strided_memo[node] = result
        return result

    def destination(self, node: Node, order=None) -> Strided:
        """Where a materialized node is written: its buffer (an output's, or new scratch), with its
        dims nested as `order` when given (channels-last, a permuted matmul output)."""
        if order is not None:
            buf = self.new_scratch(node.dtype, node.shape).buf
            self.buffers[node] = buf
            self.strided_memo[node] = Strided(buf, node.shape, Layout(0, strides_in_order(node.shape, order)))
            return self.strided_memo[node]
        if node not in self.buffers:
            self.buffers[node] = self.new_scratch(node.dtype, node.shape).buf
        return Strided.dense(self.buffers[node], node.shape)


def plan_arena(buffers) -> int:
    """Arena offsets for scratch buffers: buffers whose live ranges overlap never share bytes.
    Greedy, largest first, lowest fitting offset. Returns the arena size. A buffer with run-time
    dims is planned at its size symbols' maxima: one arena serves every size in range."""
    placed = []
    nbytes = {buf: as_expr(buf.nbytes).bounds()[1] for buf in buffers}
    for buf in sorted(buffers, key=lambda b: -nbytes[b]):
        if buf.first < 0:
            buf.first = buf.last = max(buf.last, 0)
        size = -(-max(nbytes[buf], 1) // ALIGN) * ALIGN
        conflicts = sorted((p.offset, p.offset + -(-max(nbytes[p], 1) // ALIGN) * ALIGN) for p in placed
                           if p.first <= buf.last and buf.first <= p.last)
        offset = 0
        for start, end in conflicts:
            if offset + size <= start:
                break
            offset = max(offset, end)
        buf.offset = offset
        placed.append(buf)
    return max((b.offset + nbytes[b] for b in placed), default=0)
