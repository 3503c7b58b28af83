"""Loop kernels: loop nests that compute a stored node element by element, fused into row groups.

Kernels are emitted into numbered *blocks* (the unit of scratch liveness). A call kernel (GEMM,
conv: calls.py) is one block. Loop kernels are fused into a RowGroup block while they share its
rows (leading dims) and touch the memory the group writes only within the current row: one
parallel loop runs every kernel of the group row by row, so what one kernel writes is still in L1
when the next one reads it, and the thread pool is entered once instead of per kernel. Whether a
kernel may join is decided from its recorded accesses (``row_local``); rendering the group
(render.py) keeps scratch that lives only inside one row on each thread's stack (``stack_rows``).

The rules at the end emit the loop kernels of elementwise, gather, pad, reduce and concat nodes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .buffers import Buffer, Strided, blocked, memory_order, permuted, unblocked, unpermuted
from .lines import Access, Names, Scope, cpp, declare, for_loop
from .manifest import DTYPES
from .optable import ARG_REDUCE, REDUCE, CType, literal
from .plan import WINDOW_REDUCE_MIN_ROW, stored_pad
from .versioning import versioned
from .symbolic import Const, Expr, Var, add, as_expr, constant, proves_less, proves_nonnegative
from .ir import Node
from .views import Layout, read_strides

# A large window reduced along the output row keeps a row of double partial sums on each thread's
# stack: at most this many (32 KB); longer rows take the row form.
LARGE_WINDOW_MAX_ROW = 4096
ROW_BLOCKS = 8               # ... cut into at most this many blocks, the threads' rows (_row_block)
# A reduction to at most SPLIT_MAX_OUTPUTS values over at least SPLIT_MIN_WINDOW elements runs as
# partial reductions along one axis, in parallel, then their combination (_emit_split_reduce).
SPLIT_MAX_OUTPUTS = 4
SPLIT_MIN_WINDOW = 1 << 16
SPLIT_ROWS = (8, 4096)       # the partial rows: enough for the threads, each a long enough run
TRANSPOSE_BLOCK = 16         # elements of the dim a transposing kernel reads along, per tile (a cache line)


@dataclass
class Kernel:
    number: int                                    # its block (kernels of a row group share one)
    comment: str
    uses: dict = field(default_factory=dict)       # Buffer -> written?
    accesses: list = field(default_factory=list)   # (Strided, idx, written) of loop kernels
    prologue: list = field(default_factory=list)   # loop kernels: lines before the row loop,
    body: list = field(default_factory=list)       # and lines inside it
    work: int = 0                                  # elements of work per row

    def use(self, buf: Buffer, write: bool = False) -> str:
        """Records that this kernel reads (or writes) buf through its pointer; returns the pointer's name."""
        buf.referenced = True
        self.uses[buf] = self.uses.get(buf, False) or write
        if buf.kind == "scratch":
            if write and buf.first < 0:
                buf.first = self.number
            buf.last = max(buf.last, self.number)
        return buf.ident


@dataclass
class RowGroup:
    """Loop kernels sharing one parallel loop over `rows` (leading dims of all their shapes)."""
    number: int
    rows: tuple
    kernels: list = field(default_factory=list)
    uses: dict = field(default_factory=dict)
    written: set = field(default_factory=set)
    work: int = 0

    def add(self, kernel: Kernel):
        self.kernels.append(kernel)
        for buf, written in kernel.uses.items():
            self.uses[buf] = self.uses.get(buf, False) or written
            if written:
                self.written.add(buf)
        self.work += kernel.work


def loop_vars(shape) -> list:
    """The index of a loop nest over shape: i<d> over each dim, 0 for size-1 dims."""
    return [Var.loop(f"i{d}", n) if n != 1 else Const(0) for d, n in enumerate(shape)]


class Kernels:
    """The blocks of one engine in order: (comment, lines) of call kernels, RowGroups of loop kernels."""

    def __init__(self, names: Names):
        self.names = names
        self.blocks: list = []
        self.group: RowGroup | None = None     # the open row group (its block is None until closed)

    def begin_call(self, comment: str) -> Kernel:
        """A call kernel: a block of its own (closes an open row group first)."""
        self.close_group()
        return Kernel(len(self.blocks), comment)

    def end_call(self, kernel: Kernel, body_lines):
        """body_lines: the kernel's lines, with DECLS where its buffer pointers get declared."""
        self.blocks.append((kernel.comment, declare(body_lines, kernel.uses)))

    def close_group(self):
        """Ends the open row group; it is rendered once scratch liveness is known."""
        if self.group is not None:
            self.blocks[self.group.number] = self.group
            self.group = None

    def emit_loop(self, comment, dest: Strided, value_fn, work_per_element=1, rows=None, make=None,
                  under_unit_rows=False):
        """dest[idx] = value_fn(scope, idx) for every idx of dest.shape, parallel over its rows
        (by default every dim but the innermost loop; `rows` overrides the number of leading dims),
        fused into the open row group when that is safe. `make` replaces loop_kernel as the
        builder of the kernel's loops (same arguments). under_unit_rows: dest may also join a group
        whose rows are its own leading dims under leading unit dims ([s, n] in a loop over (1, s))."""
        if math.prod(dest.shape) == 0:
            return
        order = memory_order(dest)
        if rows is None and make is None and order != tuple(range(len(order))):
            # the loops run along memory (over channels innermost for a channels-last buffer)
            dest, value_fn = permuted(dest, order), _in_order(value_fn, order)
        shape = dest.shape
        make = make or self.loop_kernel
        group = self.group
        joining = None
        if group is not None and shape[:len(group.rows)] == group.rows:
            joining = dest, value_fn
        elif group is not None and under_unit_rows:
            joining = _under_unit_rows(dest, value_fn, group.rows)
        if joining is not None:
            attempt = make(comment, *joining, work_per_element, group)
            if row_local(attempt, group):
                group.add(attempt)
                return
        self.close_group()
        loop_dims = [d for d, n in enumerate(shape) if n != 1]
        if rows is None:
            rows = loop_dims[-1] + (len(loop_dims) == 1) if loop_dims else len(shape)
        self.group = RowGroup(len(self.blocks), tuple(shape[:rows]))
        self.blocks.append(None)  # the group's slot, filled by close_group
        self.group.add(make(comment, dest, value_fn, work_per_element, self.group))
        if math.prod(self.group.rows) == 1:  # nothing to share a row loop with
            self.close_group()

    def loop_kernel(self, comment, dest: Strided, value_fn, work_per_element, group) -> Kernel:
        """One loop kernel inside group's row loop: the loops over dest's dims past the rows."""
        kernel = Kernel(group.number, comment)
        shape, k = dest.shape, len(group.rows)
        inner = [d for d in range(k, len(shape)) if shape[d] != 1]
        idx = loop_vars(shape)
        prologue = Scope(kernel, self.names)
        chain = [prologue.child([idx[d] for d in range(k) if shape[d] != 1])]
        for d in inner:
            chain.append(chain[-1].child([idx[d]]))
        kernel.use(dest.buf, write=True)
        kernel.accesses.append((dest, idx, True))
        target = Access(dest.buf, dest.address(idx))
        chain[-1].lines.append((target, f" = {value_fn(chain[-1], idx)};"))
        body = chain[-1].lines
        for level in range(len(inner), 0, -1):
            body = chain[level - 1].lines + for_loop(idx[inner[level - 1]], 0, shape[inner[level - 1]], body)
        # a row may be computed twice (versioning.py) when the kernel reads nothing it writes, and
        # is worth it when the row is a loop (a row of one element would branch per element)
        rereadable = not any(s.buf is dest.buf for s, _, written in kernel.accesses if not written)
        kernel.prologue, kernel.body = prologue.lines, versioned(body, bool(inner) and rereadable)
        kernel.work = math.prod(shape[k:]) * work_per_element
        return kernel


def _under_unit_rows(dest: Strided, value_fn, rows):
    """(dest, value_fn) seen with the leading unit dims of `rows` in front, when the rest of rows
    are dest's leading dims (a [s, n] GEMM output after a kernel over (1, s) rows): the same
    elements, so it can share that row loop. None otherwise."""
    units = next((d for d, n in enumerate(rows) if n != 1), len(rows))
    if units == 0 or tuple(dest.shape[:len(rows) - units]) != tuple(rows[units:]):
        return None
    lifted = Strided(dest.buf, (1,) * units + tuple(dest.shape),
                     Layout(dest.layout.offset, (0,) * units + tuple(dest.layout.strides)))
    return lifted, lambda scope, idx: value_fn(scope, idx[units:])


def _in_order(value_fn, order):
    """value_fn taking indices in `order` (those of a permuted destination)."""
    return lambda scope, idx: value_fn(scope, unpermuted(idx, order))


# ---------------------------------------------------------------------------------------------
# Row-group legality: an access is row-local when it provably stays inside the current row

def row_address(s: Strided, idx, rows) -> Expr | None:
    """The address of s[idx] relative to the current row, when it provably lies inside that
    row of s's buffer (row r spans elements [r * row_numel, (r + 1) * row_numel)); else None."""
    row_vars = [(var, n) for var, n in zip(loop_vars(rows), rows) if n != 1]
    row_numel, rem = _divmod(s.buf.numel, math.prod(rows))
    if not row_vars or rem != 0:
        return None  # no row loop: loads would be hoisted above the kernels that write them
    want, step = {}, row_numel
    for var, n in reversed(row_vars):
        want[var], step = step, step * n
    got, low, high, rest = dict.fromkeys(want, 0), s.layout.offset, s.layout.offset, []
    for i, stride, n in zip(idx, s.layout.strides, s.shape):
        if i in want:
            got[i] += stride
        elif i.free_vars() & want.keys():
            return None   # a row variable inside an expression: not provably in the row
        else:             # i ranges over [0, n)
            span = stride * (n - 1)
            if isinstance(span, Expr) and not proves_nonnegative(span):
                return None   # a run-time span of unknown sign: not provably in the row
            low, high = (low, high + span) if isinstance(span, Expr) else (low + min(0, span), high + max(0, span))
            rest.append(stride * i)
    if got != want or not _provably_within(low, high, row_numel):
        return None
    return add(s.layout.offset, *rest)


def _provably_within(low, high, numel) -> bool:
    """0 <= low and high < numel, for sizes that may be expressions (unproven: False)."""
    if not any(isinstance(x, Expr) for x in (low, high, numel)):
        return low >= 0 and high < numel
    return proves_nonnegative(low) and proves_less(high, numel)


def _divmod(a, b) -> tuple:
    """divmod of sizes that may be expressions over size symbols; a constant result as an int
    (a row of a buffer with run-time dims usually has a static size)."""
    if not isinstance(a, Expr) and not isinstance(b, Expr):
        return divmod(a, b)
    q, r = (a // b, a % b) if isinstance(a, Expr) else (as_expr(a) // b, as_expr(a) % b)
    return tuple(int(constant(e)) if constant(e) is not None else e for e in (q, r))


def row_local(kernel: Kernel, group: RowGroup) -> bool:
    """Whether kernel, run row by row inside group, touches what the group writes only within
    the current row and writes its own output row by row: then fusing it is safe."""
    return all(row_address(s, idx, group.rows) is not None
               for s, idx, written in kernel.accesses if written or s.buf in group.written)


def stack_row_numel(buf, rows) -> int:
    """Elements of buf's stack row in a group over rows: a row with run-time dims (a softmax over
    the sequence) gets its largest size, since a stack array has a static size (kept in the arena
    instead, each row went to memory and back: 2x the static engine's softmax at seq 512)."""
    row = _divmod(buf.numel, math.prod(rows))[0]
    return row.bounds()[1] if isinstance(row, Expr) else row


def stack_rows(group: RowGroup, budget: int) -> dict:
    """Scratch buffers that live only inside group's row loop become one row on each thread's
    stack (in L1) instead of a whole tensor in the arena: buffer -> {address: address in the row}
    (every access rebased), within budget bytes per row."""
    local = {}
    for buf in sorted(group.written, key=lambda b: b.index):
        if buf.kind != "scratch" or not buf.first == buf.last == group.number:
            continue
        accesses = [(s, idx) for k in group.kernels for s, idx, _ in k.accesses if s.buf is buf]
        rows = [row_address(s, idx, group.rows) for s, idx in accesses]
        row_bytes = stack_row_numel(buf, group.rows) * DTYPES[buf.dtype][1]
        if None in rows or row_bytes > budget:
            continue
        budget -= row_bytes
        local[buf] = {s.address(idx): row for (s, idx), row in zip(accesses, rows)}
    return local


# ---------------------------------------------------------------------------------------------
# The loop kernels of stored nodes (em: the codegen.Emitter: plan, memory, values, kernels)

def emit_elementwise(em, node, dest):
    emit_transposing(em, f"{node!r} = {node.op} {node.attrs.get('fn', '')}", dest, node,
                     lambda scope, idx: em.values.compute(node, idx, scope), computed=True)


def emit_transposing(em, comment, dest: Strided, value, value_fn, computed=False):
    """dest[idx] = value_fn(scope, idx), value's elements (its own memory or, `computed`, its
    arguments'), in tiles when value is read along another dim than dest is written (a channels-
    last activation into an NCHW graph output): blocks of TRANSPOSE_BLOCK elements of the read
    dim innermost, so each read is a run of memory and the block's rows of dest stay in L1 while
    the loops walk the other dims. In dest's order, every read was a cache line and page of its
    own: ResNet-50's last ReLU into its [1, 2048, 7, 7] output read 8 KB apart, 335 us for 100K floats."""
    order = memory_order(dest)
    moving = [d for d in order if dest.shape[d] != 1]
    read = _innermost_dim(em, value, computed)
    if read is None or len(moving) < 2 or read == moving[-1] or not isinstance(dest.shape[read], int):
        em.kernels.emit_loop(comment, dest, value_fn)
        return
    block = next((b for b in (TRANSPOSE_BLOCK, 8) if dest.shape[read] % b == 0), None)
    if block is None:
        em.kernels.emit_loop(comment, dest, value_fn)
        return
    # dest in memory order, the read dim cut into (its blocks, in place; a block's elements, innermost)
    q = order.index(read)
    tiles = blocked(permuted(dest, order), q, block)

    def tile_value(scope, idx):
        return value_fn(scope, unpermuted(unblocked(idx, q, block), order))
    # parallel over the blocks and the dim after them (a [1, 16, 56, 56] output is one block: its rows)
    em.kernels.emit_loop(comment + " (tiled transpose)", tiles, tile_value, rows=min(q + 2, len(order)))


def emit_pad(em, node, dest):
    if not stored_pad(node):
        emit_elementwise(em, node, dest)
        return
    (src,) = node.args
    fill = literal(node.attrs["value"], node.dtype)
    begins, strides = node.attrs["begins"], dest.layout.strides
    # Only the border is filled, the interior copy writes the rest (ResNet's max-pool pad, 64 x
    # 114 x 114, was filled whole and then overwritten but for its edges): per padded dim d, the
    # slabs before and after the interior, over the interior of the dims before d and all of the
    # dims after it, so no element is written twice.
    for d, (before, inside, size) in enumerate(zip(begins, src.shape, node.shape)):
        for start, extent in ((0, before), (before + inside, size - before - inside)):
            if isinstance(extent, int) and extent == 0:
                continue
            shape = (*src.shape[:d], extent, *node.shape[d + 1:])
            offset = dest.layout.offset + start * strides[d] + sum(b * st for b, st in zip(begins[:d], strides))
            slab = Strided(dest.buf, shape, Layout(offset, strides))
            em.kernels.emit_loop(f"{node!r} = pad fill (dim {d})", slab, lambda scope, idx: fill)
    offset = dest.layout.offset + sum(b * st for b, st in zip(begins, strides))
    interior = Strided(dest.buf, src.shape, Layout(offset, dest.layout.strides))
    em.kernels.emit_loop(f"{node!r} = pad interior", interior, lambda scope, idx: em.values.value(src, idx, scope))


def emit_reduce(em, node, dest):
    split = _split_axis(em, node)
    if split is not None:
        return _emit_split_reduce(em, node, dest, split)
    src = node.args[0]
    work = _divmod(src.numel, node.numel)[0] if isinstance(node.numel, Expr) else src.numel // max(node.numel, 1)
    # a run-time window (a softmax over the sequence): its largest size estimates the work
    work = max(1, work.bounds()[1] if isinstance(work, Expr) else work)
    loop_dims = [d for d, n in enumerate(node.shape) if n != 1]
    comment = f"{node!r} = reduce {node.attrs['kind']} over axes {node.attrs['axes']}"
    # The window form reads its window across the output row; a window that is a run of memory
    # (an NCHW global pool: 5x5 floats per channel, read 25 floats apart along the row; a layer
    # norm's 32 channels, SegFormer-b0's first stage) is summed along the run instead, vectorized,
    # the rows split across the threads. In window form that layer norm's sums over [16384, 32]
    # read a float per cache line 32 times over, on one thread: 3.8 ms a sum. Only into a row-major
    # output: one the plan laid out channels-last for the window form (ConvNeXt's layer norm over
    # channels-last channels) keeps that form, which loops in the output's memory order.
    along_run = em.values.window_is_one_run(node) and memory_order(dest) == tuple(range(len(dest.shape)))
    small = node in em.plan.window_form and not along_run
    if small or _large_window_along_row(em, node, dest):
        # A small window (pooling, a short axis) per output: accumulate into the output row with
        # the window loops outside, so the innermost loop runs along an output dim (in memory
        # order: channels for a channels-last output) and vectorizes; one reduction loop per
        # output element would run 4-9 scalar steps each. A large window whose input has that
        # output dim innermost too (a squeeze-and-excitation mean over a channels-last image)
        # likewise: per output element, its loop read the window one float per cache line.
        order = memory_order(dest)
        dest = permuted(dest, order)
        rows = [p for p, n in enumerate(dest.shape) if n != 1][-1]
        lanes = None if small else _row_block(dest.shape[rows])
        if lanes is not None:   # the row's blocks become rows: the threads share a global pool's channels
            dest = blocked(dest, rows, lanes)
            rows += 1
        joined = em.kernels.group
        if joined is not None and (len(joined.rows) > rows or (not small and len(joined.rows) != rows)):
            # its row loop runs over this output row too ([1, 49] rows of a layer norm before a
            # [1, 49, 64] -> [1, 49, 1] mean read 49 floats apart): one scalar window per element;
            # or, summing in double, it would leave two dims past the rows where the row of
            # partial sums takes one (a group norm's per-channel sums at batch 20, blocked
            # [20, 4, 1, 1, 16], after a kernel over rows (20,): the engine failed to compile)
            em.kernels.close_group()
        em.kernels.emit_loop(comment + " (window form)", dest, None, work, rows=rows,
                             make=lambda c, d, _, w, g: _window_reduce_kernel(em, node, c, d, w, g, order,
                                                                              in_double=not small, lanes=lanes))
        return
    em.kernels.emit_loop(comment, dest, lambda scope, idx: em.values.reduction_value(node, idx, scope), work,
                         rows=loop_dims[-1] + 1 if loop_dims else node.rank)


def _split_axis(em, node):
    """The reduced axis a reduction is split along (_emit_split_reduce): its outermost one in
    memory when it has at most SPLIT_MAX_OUTPUTS outputs and a static window of at least
    SPLIT_MIN_WINDOW elements (float sum, max or min) and that axis makes SPLIT_ROWS rows ([1, 65536,
    2] would be 65536 rows of two); None otherwise, or when its input's strides are unknown."""
    (src,) = node.args
    if node.attrs["kind"] not in ("sum", "max", "min") or not CType(node.dtype).is_float:
        return None
    axes = [a for a in node.attrs["axes"] if src.shape[a] != 1]
    if (not isinstance(node.numel, int) or node.numel > SPLIT_MAX_OUTPUTS or len(axes) < 2
            or not all(isinstance(src.shape[a], int) for a in axes) or math.prod(src.shape[a] for a in axes) < SPLIT_MIN_WINDOW):
        return None
    strides = read_strides(src, em.values.stored_strides)
    if strides is None or not all(isinstance(strides[a], int) for a in axes):
        return None
    outer = max(axes, key=lambda a: strides[a])
    return outer if SPLIT_ROWS[0] <= src.shape[outer] <= SPLIT_ROWS[1] else None


def _emit_split_reduce(em, node, dest, axis):
    """A reduction to a few outputs over a large window (a group norm's statistics over one group
    at batch 1: 200704 floats of a PoolFormer stage into one) has no rows to share among the
    threads, and ran on one: its window is cut along `axis` (_split_axis) into partial reductions,
    one row each, stored, then those combined into dest. A float sum adds in another order (its
    vectorized loop reassociates anyway); max and min are exact in any."""
    (src,) = node.args
    kind, axes = node.attrs["kind"], node.attrs["axes"]
    rows = tuple(src.shape[axis] if d == axis else n for d, n in enumerate(node.shape))
    partial = Node("reduce", rows, node.dtype, (src,), {"kind": kind, "axes": [a for a in axes if a != axis]},
                   name=f"{node.name}_rows")
    combined = Node("reduce", node.shape, node.dtype, (partial,), {"kind": kind, "axes": [axis]}, name=node.name)
    emit_reduce(em, partial, em.memory.destination(partial))
    emit_reduce(em, combined, dest)


def _large_window_along_row(em, node, dest: Strided) -> bool:
    """Whether a reduce node outside the plan's window form still reads its input along the
    output row: its window is static, its input has the output's innermost dim innermost in
    memory (stride 1, _innermost_dim), and that row is long enough to vectorize and short enough
    for a row of double partial sums on the stack (_window_reduce_kernel)."""
    src = node.args[0]
    if node in em.plan.window_form or node.attrs["kind"] in ARG_REDUCE:
        return False
    if not isinstance(math.prod(src.shape[a] for a in node.attrs["axes"]), int):
        return False
    order = memory_order(dest)
    moving = [d for d in order if dest.shape[d] != 1]
    if not moving:
        return False
    row = moving[-1]
    return (isinstance(dest.shape[row], int) and WINDOW_REDUCE_MIN_ROW <= dest.shape[row] <= LARGE_WINDOW_MAX_ROW
            and _innermost_dim(em, src) == row)


def _innermost_dim(em, value, computed=False):
    """The dim along which value is read from memory at stride 1: its own when it is stored (or a
    view of memory), else (computed inline elementwise, or `computed`: the node a kernel is about
    to store) the one its full-size arguments agree on (broadcast ones are read as a small table:
    RegNet's squeeze-and-excitation mean reads the ReLU of a stored convolution inline). None when
    there is no such dim or they disagree."""
    stored = None if computed else em.memory.strided_of(value)
    if stored is not None:
        dims = {d for d, (n, st) in enumerate(zip(stored.shape, stored.layout.strides)) if n != 1 and st == 1}
        return dims.pop() if len(dims) == 1 else None
    if value.op != "ew":
        return None
    full = [a for a in value.args if tuple(a.shape) == tuple(value.shape)]
    dims = {_innermost_dim(em, a) for a in full}
    return dims.pop() if len(dims) == 1 else None


def _row_block(n):
    """The block of a large window's output row that one thread reduces (a row of n outputs cut
    into at most ROW_BLOCKS blocks of whole cache lines, 16 floats, when n allows, else of whole
    8-float vectors: a thread reads each line once per pass): None when it is one block.
    One thread reduced EfficientNet's global pool over [1, 144, 56, 56] in 66-73 us, three blocks
    of 48 on two threads in 40-43 us (480 channels at 14x14: 13 -> 8 us in six blocks of 80)."""
    if not isinstance(n, int):
        return None
    step = 16 if n % 16 == 0 else 8
    block = next((b for b in range(step, n + 1, step) if n % b == 0 and n // b <= ROW_BLOCKS), n)
    return block if n // block >= 2 else None


def _window_reduce_kernel(em, node, comment, dest: Strided, work_per_element, group, order,
                          in_double=False, lanes=None) -> Kernel:
    """A reduce node's kernel inside group's row loop: dest's row is set to the initial value,
    then for each window position (outer loops) combined with the input along the row. dest
    is the output with its dims permuted into `order` (memory order), its row dim `blocked` into
    blocks of `lanes` (_row_block) unless None. in_double: a float sum accumulates in a row of
    doubles on the stack, stored rounded once at the end: a large window (12544 positions) summed
    in float, one position after another, could lose 1e-4. (Max and min are exact in any order;
    a product stays in float, so that it overflows where eager's does.)"""
    (src,), rule, ctype = node.args, REDUCE[node.attrs["kind"]], CType(node.dtype)
    names = em.kernels.names
    kernel = Kernel(group.number, comment)
    shape, k = dest.shape, len(group.rows)
    inner = [p for p in range(k, len(shape)) if shape[p] != 1]
    idx = loop_vars(shape)
    logical = unpermuted(idx if lanes is None else unblocked(idx, k - 1, lanes), order)
    axes = [a for a in node.attrs["axes"] if src.shape[a] != 1]
    window_vars = {a: Var.loop(names.fresh("r"), src.shape[a]) for a in axes}
    kernel.use(dest.buf, write=True)
    target = Access(dest.buf, dest.address(idx))
    kernel.accesses.append((dest, idx, True))
    declared, final = [], []
    if in_double and ctype.is_float and node.attrs["kind"] == "sum":
        # one output dim past the rows (_large_window_along_row): partials[its index]
        (p,) = inner
        partials = names.fresh("partial")
        declared = [f"double {partials}[{shape[p]}];"]
        final = for_loop(idx[p], 0, shape[p], [(target, f" = static_cast<{ctype}>({partials}[{cpp(idx[p])}]);")])
        target, ctype = f"{partials}[{cpp(idx[p])}]", CType("float64")
    init = [(target, f" = {rule.init(ctype)};")]
    for p in reversed(inner):
        init = for_loop(idx[p], 0, shape[p], init)
    prologue = Scope(kernel, names)
    loops = [(window_vars[a], src.shape[a]) for a in axes] + [(idx[p], shape[p]) for p in inner]
    chain = [prologue.child([idx[p] for p in range(k) if shape[p] != 1])]
    for var, _ in loops:
        chain.append(chain[-1].child([var]))
    src_idx = [window_vars.get(d, Const(0) if src.shape[d] == 1 else i) for d, i in enumerate(logical)]
    v, acc = em.values.value(src, src_idx, chain[-1]), names.fresh("acc")
    if declared:
        v = f"static_cast<double>({v})"
    # The old value in a local: read inside the combine's ?: it would be a conditional load,
    # which keeps g++ from vectorizing.
    chain[-1].lines += [(f"const {ctype} {acc} = ", target, ";"), (target, f" = {rule.combine(acc, v)};")]
    body = chain[-1].lines
    for level in range(len(loops), 0, -1):
        var, size = loops[level - 1]
        body = chain[level - 1].lines + for_loop(var, 0, size, body)
    kernel.prologue, kernel.body = prologue.lines, declared + init + body + final
    kernel.work = math.prod(shape[k:]) * work_per_element
    return kernel


def emit_concat(em, node, dest):
    axis, start = node.attrs["axis"], 0
    for arg in node.args:
        part = Strided(dest.buf, arg.shape, Layout(dest.layout.offset + start * dest.layout.strides[axis],
                                                   dest.layout.strides))
        em.kernels.emit_loop(f"{node!r} = concat part {arg!r}", part,
                             lambda scope, idx, arg=arg: em.values.value(arg, idx, scope))
        start += arg.shape[axis]


# Eight chains, not sixteen: pass 2 keeps one double accumulator per chunk, and with 16 of them
# the [64, 4096] float cumsum ran 239-321 us against 181-208 us with 8 (blade.load, one thread, CPU
# time, EPYC Zen 3 AVX2; eager 292-328), likely register spills (16 accumulators plus addresses on
# 16 vector registers; not checked in the assembly). Eight chains still cover the add's latency.
SCAN_CHUNKS = (8, 4)         # a contiguous scan axis is cut into this many chunks (the first that divides it) ...
SCAN_MIN_CHUNK = 16          # ... of at least this many elements each


def emit_scan(em, node, dest):
    """An inclusive running sum (cumsum) along node's axis, parallel over the dims before it.
    Along a contiguous axis one running sum is a chain of dependent adds (4 cycles each), so the
    row is cut into chunks: pass 1 sums each chunk (vectorized), pass 2 runs the chunks' sums
    side by side, each starting from the total of the chunks before it (independent chains).
    With dims after the axis, each step adds a whole vectorizable slice to the previous one.
    Float sums accumulate in double along a contiguous axis, as torch's CPU cumsum does."""
    axis, shape = node.attrs["axis"], node.shape
    comment = f"{node!r} = scan {node.attrs['kind']} over axis {axis}"
    make = _contiguous_scan_kernel if all(n == 1 for n in shape[axis + 1:]) else _slice_scan_kernel
    if em.kernels.group is not None and len(em.kernels.group.rows) > axis:
        em.kernels.close_group()   # its row loop would run over the scan axis
    em.kernels.emit_loop(comment, dest, None, 3, rows=axis,
                         make=lambda c, d, _, w, g: make(em, node, c, d, w, g))


def _scan_kernel_start(em, node, comment, dest, group):
    """The kernel, its index, its prologue scope, the scope of one scan line (inside the loops
    over the dims before the axis that the group's rows do not cover) and wrap(lines): those loops."""
    kernel = Kernel(group.number, comment)
    kernel.use(dest.buf, write=True)
    idx = loop_vars(dest.shape)
    prologue = Scope(kernel, em.kernels.names)
    chain = [prologue.child([idx[d] for d in range(len(group.rows)) if dest.shape[d] != 1])]
    outer = [d for d in range(len(group.rows), node.attrs["axis"]) if dest.shape[d] != 1]
    for d in outer:
        chain.append(chain[-1].child([idx[d]]))

    def wrap(lines):
        for level in range(len(outer), 0, -1):
            lines = chain[level - 1].lines + for_loop(idx[outer[level - 1]], 0, dest.shape[outer[level - 1]], lines)
        return lines
    return kernel, idx, prologue, chain[-1], wrap


def _store(kernel, dest, idx, value):
    kernel.accesses.append((dest, idx, True))
    return (Access(dest.buf, dest.address(idx)), f" = {value};")


def _contiguous_scan_kernel(em, node, comment, dest: Strided, work_per_element, group) -> Kernel:
    (src,), axis, n = node.args, node.attrs["axis"], node.shape[node.attrs["axis"]]
    names, ctype = em.kernels.names, CType(node.dtype)
    acc_type = "double" if ctype.is_float else ctype.name
    kernel, idx, prologue, row, wrap = _scan_kernel_start(em, node, comment, dest, group)
    chunks = next((v for v in SCAN_CHUNKS if isinstance(n, int) and n % v == 0 and n // v >= SCAN_MIN_CHUNK), 1)
    length = n // chunks if chunks > 1 else n
    v, i = Var.loop(names.fresh("c"), chunks), Var.loop(names.fresh("s"), length)
    at = lambda c, s: idx[:axis] + [c * length + s] + idx[axis + 1:]
    acc = names.fresh("acc")
    lines = [f"{acc_type} {acc}[{chunks}];"]
    c = v.name
    if chunks > 1:
        # pass 1: acc[c] = the sum of the chunks before c (exclusive prefix of the chunk sums)
        total, carry = names.fresh("sum"), names.fresh("carry")
        outer = row.child([v])
        inner = outer.child([i])
        x = em.values.value(src, at(v, i), inner)
        inner.lines.append(f"{total} += static_cast<{acc_type}>({x});")
        sums = outer.lines + [f"{acc_type} {total} = 0;"] + \
            for_loop(i, 0, length, inner.lines, f"#pragma omp simd reduction(+:{total})") + \
            [f"{acc}[{c}] = {carry};", f"{carry} += {total};"]
        lines += [f"{acc_type} {carry} = 0;"] + for_loop(v, 0, chunks, sums)
    else:
        lines.append(f"{acc}[0] = 0;")
    # pass 2: the chunks' running sums side by side
    outer = row.child([i])
    inner = outer.child([v])
    x = em.values.value(src, at(v, i), inner)
    inner.lines += [f"{acc}[{c}] += static_cast<{acc_type}>({x});",
                    _store(kernel, dest, at(v, i), f"static_cast<{ctype}>({acc}[{c}])")]
    lines += for_loop(i, 0, length, outer.lines + for_loop(v, 0, chunks, inner.lines, f"#pragma GCC unroll {chunks}"))
    kernel.prologue, kernel.body = prologue.lines, wrap(row.lines + lines)
    kernel.work = math.prod(dest.shape[len(group.rows):]) * work_per_element
    return kernel


def _slice_scan_kernel(em, node, comment, dest: Strided, work_per_element, group) -> Kernel:
    (src,), axis, n = node.args, node.attrs["axis"], node.shape[node.attrs["axis"]]
    names = em.kernels.names
    kernel, idx, prologue, row, wrap = _scan_kernel_start(em, node, comment, dest, group)
    trailing = [d for d in range(axis + 1, len(dest.shape)) if dest.shape[d] != 1]
    step = Var.loop(names.fresh("s"), n)

    def slice_loop(first: bool):
        # out[.., j, ..] = x[.., j, ..] (+ out[.., j - 1, ..] after the first step), over the trailing dims
        chain = [row.child([] if first else [step])]
        for d in trailing:
            chain.append(chain[-1].child([idx[d]]))
        j = Const(0) if first else step
        here = idx[:axis] + [j] + idx[axis + 1:]
        x = em.values.value(src, here, chain[-1])
        if not first:
            before = idx[:axis] + [step - 1] + idx[axis + 1:]
            kernel.accesses.append((dest, before, False))
            prev = names.fresh("prev")
            chain[-1].lines.append((f"const {CType(node.dtype)} {prev} = ", Access(dest.buf, dest.address(before)), ";"))
            x = f"{prev} + {x}"
        chain[-1].lines.append(_store(kernel, dest, here, x))
        body = chain[-1].lines
        for level in range(len(trailing), 0, -1):
            body = chain[level - 1].lines + for_loop(idx[trailing[level - 1]], 0, dest.shape[trailing[level - 1]], body)
        return body

    first = slice_loop(True)
    rest = slice_loop(False)
    kernel.prologue = prologue.lines
    kernel.body = wrap(row.lines + first + for_loop(step, 1, n, rest))
    kernel.work = math.prod(dest.shape[len(group.rows):]) * work_per_element
    return kernel
