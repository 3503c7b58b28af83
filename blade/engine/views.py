"""View semantics: how each view kind maps indices (for lazy values) and strides (for buffers).

A view never computes. On a value held in memory it is pure stride arithmetic (``VIEW_LAYOUT``);
on a lazy value it rewrites the index expressions the consumer asks with (``VIEW_INDEX``). Index
expressions are symbolic (symbolic.Expr over loop variables with their bounds), simplified as they
are built: a reshape's div/mod of the linear index folds away where the bounds allow it
(``(64 * i0 + i1) / 16 % 4`` is ``i1 / 16``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .symbolic import Const, Expr, add, as_expr, proves_at_least, size_less


@dataclass(frozen=True)
class Layout:
    """Where element idx of a strided view lives: offset + sum(idx[d] * strides[d]) elements."""
    offset: int
    strides: tuple


def contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def packed_matrix(shape, strides) -> bool:
    """Whether the last two dims of a GEMM operand lie densely in memory, row-major or transposed.
    MKL reads such an operand at full speed; one head's slice of a [seq, heads * dim] projection
    (rows padded to heads * dim floats) ran its attention GEMMs 1.2-2x slower on one core (K^T
    the worst), while a copy to dense costs less than the difference. With run-time dims the test
    is the same, on expressions (Expr equality is structural): a row stride of 3 * heads * dim
    against dim columns is unpacked whatever the sequence length (passed strided, the dynamic
    engine's attention GEMMs at BERT 4x512 ran ~20% slower, oneDNN copying the operands itself
    with torch's copy); a run-time dim that may be 1 counts as larger than 1, and a stride equal
    to a run-time dim is packed when the expressions are the same (P of [seq, seq] rows)."""
    rows, cols = shape[-2:]
    rs, cs = strides[-2:]
    return ((cols == 1 or cs == 1) and (rows == 1 or rs == cols)) or ((rows == 1 or rs == 1) and (cols == 1 or cs == rows))


def linear_index(idx, strides, offset=0) -> Expr:
    """offset + sum(idx[d] * strides[d]): the element of a strided layout at a multi-index."""
    return add(offset, *(s * i for s, i in zip(strides, idx)))


# ---- per-kind rules: index(node, out_idx) -> src_idx; layout(node, src_shape, Layout) -> Layout|None ----

def _permute_index(node, idx):
    src = [None] * len(idx)
    for out_dim, src_dim in enumerate(node.attrs["perm"]):
        src[src_dim] = idx[out_dim]
    return src


def _permute_layout(node, src_shape, layout):
    return Layout(layout.offset, tuple(layout.strides[p] for p in node.attrs["perm"]))


def _expand_index(node, idx):
    src_shape = node.args[0].shape
    return [Const(0) if n == 1 else i for n, i in zip(src_shape, idx)]


def _expand_layout(node, src_shape, layout):
    return Layout(layout.offset, tuple(0 if n == 1 else s for n, s in zip(src_shape, layout.strides)))


def _slice_index(node, idx):
    return [step * i + start for i, start, step in zip(idx, node.attrs["starts"], node.attrs["steps"])]


def _slice_layout(node, src_shape, layout):
    starts, steps = node.attrs["starts"], node.attrs["steps"]
    offset = layout.offset + sum(a * s for a, s in zip(starts, layout.strides))
    return Layout(offset, tuple(s * step for s, step in zip(layout.strides, steps)))


def only_unit_dims_change(src_shape, shape) -> bool:
    """A reshape that only adds/removes size-1 dims: a pure renaming of index variables."""
    return [n for n in src_shape if n != 1] == [n for n in shape if n != 1]


def splits_dims(src_shape, shape) -> bool:
    """A reshape that only splits dims (each source dim is the product of consecutive new dims,
    [s, h * d] -> [s, h, d]): its index into the source is affine, no div/mod survives.
    Sizes may be expressions: a product is matched by (structural) equality, so a run-time dim
    split or kept whole ([b, s, 3 * h * d] -> [b, s, h, d] slices) is recognized."""
    src = [n for n in src_shape if n != 1]
    new = [n for n in shape if n != 1]
    j = 0
    for n in src:
        product = new[j] if j < len(new) else None
        j += 1
        while product is not None and product != n and j < len(new) and not _exceeds(product, n):
            product = product * new[j]
            j += 1
        if product is None or product != n:
            return False
    return j == len(new)


def _exceeds(product, n) -> bool:
    """Whether a partial product of new dims is already past the source dim (ints only: an
    expression goes on multiplying, and a product that never equals n fails the match)."""
    return isinstance(product, int) and isinstance(n, int) and product > n


def _reshape_index(node, idx):
    src_shape, shape = node.args[0].shape, node.shape
    if only_unit_dims_change(src_shape, shape):
        kept = iter(i for n, i in zip(shape, idx) if n != 1)
        return [Const(0) if n == 1 else next(kept) for n in src_shape]
    # General case: through the row-major linear index (div/mod by constants).
    linear = linear_index(idx, contiguous_strides(shape))
    src = []
    for d, (n, stride) in enumerate(zip(src_shape, contiguous_strides(src_shape))):
        term = linear // stride
        src.append(Const(0) if n == 1 else term if d == 0 else term % n)
    return src


def _takes_next_dim(view_numel, dim, tensor_numel) -> bool:
    """ATen's ``view_numel < tensor_numel || dim == 1``, for sizes that may be run-time
    expressions. When the order is not provable (equal only where some size is 1, e.g. ``s1`` vs
    ``s0 * s1`` with s0 >= 1), take the dim iff ``view_numel * dim <= tensor_numel`` provably: then
    at run time either view_numel < tensor_numel (ATen takes it) or they are equal and dim is 1
    (ATen takes it too). Otherwise stop: the caller finds the numels differ and copies instead."""
    if dim == 1:
        return True
    try:
        return size_less(view_numel, tensor_numel)
    except TypeError:
        return proves_at_least(tensor_numel, as_expr(view_numel) * dim)


def reshape_strides(old_shape, old_strides, new_shape):
    """Strides that view (old_shape, old_strides) as new_shape without copying, or None
    (the algorithm of ATen's computeStride)."""
    if math.prod(old_shape) == 0 or not old_shape:
        return contiguous_strides(new_shape)
    new_strides = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base = old_strides[-1]
    tensor_numel = view_numel = 1
    for tensor_d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[tensor_d]
        if tensor_d == 0 or (old_shape[tensor_d - 1] != 1
                             and old_strides[tensor_d - 1] != tensor_numel * chunk_base):
            while view_d >= 0 and _takes_next_dim(view_numel, new_shape[view_d], tensor_numel):
                new_strides[view_d] = view_numel * chunk_base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base = old_strides[tensor_d - 1]
                tensor_numel = view_numel = 1
    return tuple(new_strides) if view_d == -1 else None


def _reshape_layout(node, src_shape, layout):
    strides = reshape_strides(src_shape, layout.strides, node.shape)
    return None if strides is None else Layout(layout.offset, strides)


def _window_split(node):
    """(leading dims, (stride, dilation) per windowed dim) of a window view."""
    spatial = len(node.attrs["strides"])
    return node.args[0].rank - spatial, list(zip(node.attrs["strides"], node.attrs["dilations"]))


def _window_index(node, idx):
    """[..., *out, *kernel] -> [..., out * stride + kernel * dilation]."""
    lead, steps = _window_split(node)
    spatial = len(steps)
    outs, taps = idx[lead:lead + spatial], idx[lead + spatial:]
    return idx[:lead] + [s * o + d * k for (s, d), o, k in zip(steps, outs, taps)]


def _window_layout(node, src_shape, layout):
    lead, steps = _window_split(node)
    spatial = layout.strides[lead:]
    return Layout(layout.offset, layout.strides[:lead] + tuple(s * st for (s, _), st in zip(steps, spatial))
                  + tuple(d * st for (_, d), st in zip(steps, spatial)))


def _roll_index(node, idx):
    """out[i] = src[(i + offset) % n] along the axis (offset in [0, n]: the dividend is >= 0)."""
    axis = node.attrs["axis"]
    return idx[:axis] + [(idx[axis] + node.attrs["offset"]) % node.shape[axis]] + idx[axis + 1:]


VIEW_INDEX = {"permute": _permute_index, "expand": _expand_index, "slice": _slice_index,
              "reshape": _reshape_index, "window": _window_index, "roll": _roll_index}
VIEW_LAYOUT = {"permute": _permute_layout, "expand": _expand_layout, "slice": _slice_layout,
               "reshape": _reshape_layout, "window": _window_layout,
               "roll": lambda node, src_shape, layout: None}   # wraps around: no strided layout


def view_index(node, idx):
    return VIEW_INDEX[node.attrs["view"]](node, list(idx))


def view_layout(node, layout: Layout):
    return VIEW_LAYOUT[node.attrs["view"]](node, node.args[0].shape, layout)


def view_chain(value) -> tuple[list, object]:
    """The views value is read through (value first) and the node they look at."""
    chain = []
    while value.op == "view":
        chain.append(value)
        value = value.args[0]
    return chain, value


def layout_through(chain: list, layout: Layout) -> Layout | None:
    """The layout of chain[0] (view_chain's order) when the node the chain looks at is stored with
    `layout`; None when a view of it has no strided layout."""
    for view in reversed(chain):
        layout = view_layout(view, layout)
        if layout is None:
            return None
    return layout


def read_strides(value, stored) -> tuple | None:
    """The strides value's elements are read from memory with, through its views and the
    elementwise ops computed inline on the way: stored(node) gives the strides a node is stored
    with, None for one computed where it is read. An inline elementwise node reads with the
    strides its arguments read in full agree on (an argument broadcast along a dim, stride 0
    there, or of unknown strides has no say). None when unknown or they disagree."""
    chain, source = view_chain(value)
    strides = stored(source)
    if strides is None:
        if source.op != "ew":
            return None
        found = {s for s in (read_strides(arg, stored) for arg in source.args)
                 if s is not None and len(s) == len(source.shape)
                 and not any(isinstance(st, int) and st == 0 for st, n in zip(s, source.shape) if n != 1)}
        if len(found) != 1:
            return None
        strides = found.pop()
    layout = layout_through(chain, Layout(0, tuple(strides)))
    return tuple(layout.strides) if layout is not None else None
