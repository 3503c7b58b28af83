"""The C++ value of an IR node at a multi-index, inside a kernel's loop nest.

``Values.value(node, idx, scope)`` returns an atom (a temp name or a literal), emitting the
statements that compute it into ``scope``: a stored node (or a view of one) is a load through its
strides (broadcast = stride 0); a lazy node is computed from its definition (``LAZY``), inlining
its lazy producers (producer-consumer fusion): views only rewrite the index, elementwise ops go
through the op table (optable.CODE_FOR_OP), gathers and pads compute a checked or clamped index.
Every value becomes a ``const`` temp memoized per (node, index) -- that is CSE -- placed in the
outermost scope that binds the variables its index uses (a per-row value is computed once per row).
A reduction is an accumulator loop inside the consumer's body, so its input is fused in too.
"""
from __future__ import annotations

import math

from . import views
from .buffers import Memory, Strided
from .ir import Node
from .lines import Access, Names, Scope, for_loop
from .optable import ARG_REDUCE, CODE_FOR_OP, REDUCE, CType, literal
from .symbolic import Const, Var, as_expr, render

# A long float sum, max or min runs as this many partial ones (Values._in_chunks), each at least
# CHUNK_MIN elements long.
CHUNKS = 4
CHUNK_MIN = 256
CHUNKED_RULES = (REDUCE["sum"], REDUCE["max"], REDUCE["min"])


class Values:
    def __init__(self, memory: Memory, names: Names):
        self.memory, self.names = memory, names

    def load(self, s: Strided, idx, scope: Scope):
        """The Access of s[idx] (recorded in the scope's kernel), or the literal of a one-element
        inline constant."""
        if s.buf.kind == "inline" and s.buf.numel == 1:
            return literal(s.buf.values.reshape(-1)[0], s.buf.dtype)
        scope.kernel.accesses.append((s, idx, False))
        scope.kernel.use(s.buf)
        return Access(s.buf, s.address(idx))

    def value(self, node: Node, idx, scope: Scope) -> str:
        """The C++ expression (an atom) of node at multi-index idx (Exprs), emitting statements as needed."""
        idx = tuple(as_expr(i) for i in idx)
        key = (id(node), idx)
        hit = scope.lookup(key)
        if hit is not None:
            return hit
        home = scope.home_for(idx)
        strided = self.memory.strided_of(node)
        if strided is None:
            return self.compute(node, idx, home, key)
        text = self.load(strided, idx, scope)
        if strided.buf.kind == "inline" and strided.buf.numel == 1:
            return text
        # Different views of one buffer can load the same element: memoize by the access too.
        hit = scope.lookup(text)
        if hit is None:
            hit = home.define(CType(node.dtype), text, text)
        home.memo[key] = hit
        return hit

    def compute(self, node: Node, idx, scope: Scope, key=None) -> str:
        """The value of node from its definition (inlining lazy producers), ignoring its buffer."""
        if node.op not in LAZY:
            raise AssertionError(f"{node} should have been materialized")
        return LAZY[node.op](self, node, tuple(idx), scope.home_for(idx), key)

    def _view_value(self, node, idx, scope, key):
        return self.value(node.args[0], views.view_index(node, idx), scope)

    def _elementwise_value(self, node, idx, scope, key):
        ctype = CType(node.dtype)
        args = [self.value(a, idx, scope) for a in node.args]
        clamped = _clamped(node)
        if clamped is not None:   # x > high ? high : Max(x, low)
            x, high = self.value(clamped, idx, scope), args[1]
            return scope.define(ctype, f"{x} > {high} ? {high} : {args[0]}", key)
        return scope.define(ctype, CODE_FOR_OP[node.attrs["fn"]](ctype, *args), key)

    def _gather_value(self, node, idx, scope, key):
        data, indices = node.args
        axis, n = node.attrs["axis"], data.shape[node.attrs["axis"]]
        raw = self.value(indices, idx[axis:axis + indices.rank], scope)
        if not isinstance(n, int) and n.bounds()[0] < 1:
            raise ValueError(f"a gather along a run-time axis of size {n}, empty at some sizes")
        extent = n if not isinstance(n, int) else max(n, 1)
        pos = Var.loop(self.names.fresh("g"), extent)   # in range once the lines below ran
        scope.lines += [
            f"int64_t {pos} = static_cast<int64_t>({raw});",
            f"if ({pos} < 0) {pos} += {n};",
            # Out of range: flag the error and read a valid element instead of faulting.
            f"if ({pos} < 0 || {pos} >= {extent}) {{ status.store(BLADE_ERR_INDEX_OUT_OF_RANGE, "
            f"std::memory_order_relaxed); {pos} = 0; }}",
        ]
        scope.binds.add(pos)
        scope.mark_side_effects()
        result = literal(0, node.dtype) if n == 0 else \
            self.value(data, idx[:axis] + (pos,) + idx[axis + indices.rank:], scope)
        if key is not None:
            scope.memo[key] = result
        return result

    def _pad_value(self, node, idx, scope, key):
        """x at idx - begin: out-of-range positions read the fill (constant) or a remapped element."""
        (src,), mode = node.args, node.attrs["mode"]
        src_idx, inside = [], []
        for i, lo, n in zip(idx, node.attrs["begins"], src.shape):
            if lo == 0 and n == node.shape[len(src_idx)]:
                src_idx.append(i)
                continue
            shifted = i - lo
            pos = Var(self.names.fresh("p"), *shifted.bounds())
            clamped = Var.loop(f"{pos}c", max(n, 1))
            remap = {"constant": f"({pos} >= 0 && {pos} < {n} ? {pos} : 0)",
                     "edge": f"({pos} < 0 ? 0 : ({pos} >= {n} ? {n - 1} : {pos}))",
                     "reflect": f"({pos} < 0 ? -{pos} : ({pos} >= {n} ? {2 * n - 2} - {pos} : {pos}))"}[mode]
            # in the loop its own index varies in: a pooling window's tap, read by a loop over the
            # channels, checks its bounds once per tap, outside that loop (inside it, g++
            # vectorized that loop in only some of its copies: PoolFormer's average pools)
            home = scope.home_for([shifted])
            home.lines += [f"const int64_t {pos} = {shifted};", f"const int64_t {clamped} = {remap};"]
            inside.append(f"{pos} >= 0 && {pos} < {n}")
            home.binds.update({pos, clamped})
            src_idx.append(clamped)
        value = self.value(src, src_idx, scope)
        if mode != "constant" or not inside:
            if key is not None:
                scope.memo[key] = value
            return value
        fill = literal(node.attrs["value"], node.dtype)
        return scope.define(CType(node.dtype), f"({' && '.join(inside)}) ? {value} : {fill}", key)

    def reduction_value(self, node: Node, idx, scope: Scope) -> str:
        """The accumulator loop of a reduce node for one output element (its input fused in)."""
        (src,), kind = node.args, node.attrs["kind"]
        if kind in ARG_REDUCE:
            return self._arg_reduction_value(node, idx, scope)
        rule, ctype = REDUCE[kind], CType(node.dtype)
        acc = self.names.fresh("acc")
        scope.lines.append(f"{ctype} {acc} = {rule.init(ctype)};")
        axes = [a for a in node.attrs["axes"] if src.shape[a] != 1]
        if self._in_chunks(node, axes, rule, ctype):
            return self._chunked_reduction(node, idx, scope, acc, axes[0], rule, ctype)
        run = self.window_run(node)
        if run is not None:
            # One loop over the window's run (an NCHW global pool's H x W), which the simd pragma
            # vectorizes whole (nested, only its innermost W would be).
            axes, extents = run[-1:], {run[-1]: math.prod(src.shape[a] for a in run)}
            loop_vars = {run[-1]: Var.loop(self.names.fresh("r"), extents[run[-1]])}
            src_idx = [loop_vars.get(d, Const(0) if d in run or src.shape[d] == 1 else i) for d, i in enumerate(idx)]
        else:
            axes = self._in_memory_order(src, axes)
            extents = {a: src.shape[a] for a in axes}
            loop_vars = {a: Var.loop(self.names.fresh("r"), extents[a]) for a in axes}
            src_idx = [loop_vars.get(d, Const(0) if src.shape[d] == 1 else i) for d, i in enumerate(idx)]
        chain = [scope]                        # chain[j + 1] is the body of the loop over axes[j]
        for a in axes:
            chain.append(chain[-1].child([loop_vars[a]]))
        v = self.value(src, src_idx, chain[-1])
        # Vectorize the innermost accumulation when reassociating it is harmless (float sums,
        # float max/min with their NaN flag).
        simd = rule.simd and ctype.is_float and not chain[-1].has_side_effects
        clauses, after = f"reduction({rule.simd}:{acc})", []
        if simd and rule.float_combine:
            nan = self.names.fresh("nan")
            scope.lines.append(f"int32_t {nan} = 0;")
            chain[-1].lines += [f"{acc} = {rule.float_combine(acc, v)};", f"{nan} |= {v} != {v};"]
            clauses += f" reduction(|:{nan})"
            after = [f"if ({nan}) {acc} = std::numeric_limits<{ctype}>::quiet_NaN();"]
        else:
            chain[-1].lines.append(f"{acc} = {rule.combine(acc, v)};")
        body = chain[-1].lines
        for level in range(len(axes), 0, -1):
            pragma = f"#pragma omp simd {clauses}" if simd and level == len(axes) else ""
            body = chain[level - 1].lines + for_loop(loop_vars[axes[level - 1]], 0, extents[axes[level - 1]],
                                                     body, pragma)
        scope.lines[:] = body + after
        return acc

    def _in_memory_order(self, src: Node, axes: list) -> list:
        """The reduced axes as src's memory nests them (largest stride outermost), so the innermost
        loop reads along memory: in logical order a group norm over a channels-last convolution's
        [C / G, H, W] read W innermost, one float every C (PoolFormer-S12). Unchanged when src's
        strides are unknown or not all static."""
        strides = views.read_strides(src, self.stored_strides)
        if strides is None or len(axes) < 2 or not all(isinstance(strides[a], int) for a in axes):
            return axes
        return sorted(axes, key=lambda a: -strides[a])

    def stored_strides(self, node: Node):
        """The strides node is stored with; None when it is computed where it is read."""
        stored = self.memory.strided_of(node)
        return stored.layout.strides if stored is not None else None

    def _in_chunks(self, node: Node, axes, rule, ctype) -> bool:
        """Whether a float sum, max or min over one long static axis runs as CHUNKS interleaved
        accumulations: one vector accumulator is one chain of dependent adds or max/min, so a long
        row's reduction is bound by that latency, not by its loads ([64, 4096], one thread, EPYC
        Zen 3, CPU time: a sum 29 us with one chain, 19 us with four; eager 23 us)."""
        extent = node.args[0].shape[axes[0]] if len(axes) == 1 else None
        return (rule in CHUNKED_RULES and ctype.is_float and self.window_run(node) is None
                and isinstance(extent, int) and extent >= CHUNKS * CHUNK_MIN and extent % (CHUNKS * 16) == 0)

    def _chunked_reduction(self, node: Node, idx, scope: Scope, acc: str, axis: int, rule, ctype) -> str:
        """The reduction of one output element as CHUNKS partial ones over consecutive CHUNKS-th parts
        of the axis, accumulated side by side in one vectorized loop, then combined as a tree (max/min:
        the NaN-ignoring combine and one NaN flag for all parts, as the one-chain loop)."""
        (src,) = node.args
        part_length = src.shape[axis] // CHUNKS
        r = Var.loop(self.names.fresh("r"), part_length)
        body = scope.child([r])
        parts = [self.names.fresh("acc") for _ in range(CHUNKS)]
        scope.lines.append(f"{ctype} {', '.join(f'{part} = {rule.init(ctype)}' for part in parts)};")
        combine = rule.float_combine or rule.combine
        clauses, after = f"reduction({rule.simd}:{', '.join(parts)})", []
        if rule.float_combine:
            nan = self.names.fresh("nan")
            scope.lines.append(f"int32_t {nan} = 0;")
            clauses += f" reduction(|:{nan})"
            after = [f"if ({nan}) {acc} = std::numeric_limits<{ctype}>::quiet_NaN();"]
        for k, part in enumerate(parts):
            src_idx = [r + k * part_length if d == axis else Const(0) if src.shape[d] == 1 else i
                       for d, i in enumerate(idx)]
            v = self.value(src, src_idx, body)
            body.lines.append(f"{part} = {combine(part, v)};")
            if rule.float_combine:
                body.lines.append(f"{nan} |= {v} != {v};")
        scope.lines += for_loop(r, 0, part_length, body.lines, "" if body.has_side_effects else f"#pragma omp simd {clauses}")
        # a tree over the partials (neighbours first, an odd one out carried up a level): ceil(log2 CHUNKS)
        # dependent combines, for any CHUNKS
        level = parts
        while len(level) > 1:
            paired = [scope.define(ctype, combine(a, b)) for a, b in zip(level[::2], level[1::2])]
            level = paired + level[len(paired) * 2:]
        scope.lines += [f"{acc} = {level[0]};", *after]
        return acc

    def window_run(self, node: Node) -> list | None:
        """The reduced dims of a sum/mean/max/min reduce node when its window is one run of memory:
        consecutive static dims (H, W of an NCHW tensor) that every load of its input (stored, or
        computed inline from stored values) reads down to stride 1 (or 0: broadcast), each dim's
        stride the next one's times its size, so index (0, ..., 0, r) reads element r of the run;
        else None."""
        axes = [a for a in node.attrs["axes"] if node.args[0].shape[a] != 1]
        return axes if node.attrs["kind"] not in ARG_REDUCE and len(axes) >= 2 and self.window_is_one_run(node) else None

    def window_is_one_run(self, node: Node) -> bool:
        """Whether a reduce node's window, one dim or several, is one run of memory as window_run
        reads it: its reduced dims (but those of size 1) consecutive, static, and every load of its
        input reads them nested down to stride 1 (or 0)."""
        src = node.args[0]
        axes = [a for a in node.attrs["axes"] if src.shape[a] != 1]
        return (bool(axes) and axes == list(range(axes[0], axes[-1] + 1))
                and all(isinstance(src.shape[a], int) for a in axes) and self._reads_as_one_run(src, axes))

    def _reads_as_one_run(self, value: Node, axes: list) -> bool:
        """Whether value, read at an index whose `axes` are (0, ..., 0, r), is value at the index
        r spells over those dims (row-major): each stored value it loads has strides over the axes
        nesting one into the next down to 1 (contiguous) or 0 for all (broadcast); an inline elementwise
        node when its arguments do; a broadcast over all the axes whatever it looks at. Any other
        inline view or op maps indices in ways this does not follow: False."""
        stored = self.memory.strided_of(value)
        if stored is not None:
            strides = stored.layout.strides
            return all(isinstance(strides[a], int) for a in axes) and strides[axes[-1]] in (0, 1) and all(
                strides[a] == strides[a + 1] * value.shape[a + 1] for a in axes[:-1])
        if value.op == "ew":
            return all(self._reads_as_one_run(arg, axes) for arg in value.args)
        return (value.op == "view" and value.attrs["view"] == "expand"
                and all(value.args[0].shape[a] == 1 for a in axes))

    def _arg_reduction_value(self, node: Node, idx, scope: Scope) -> str:
        """The index of an argmax/argmin node (one axis) for one output element, in two vectorized
        passes: the extreme (NaN-ignoring, with a NaN flag), then the first index holding it (the
        first NaN when there is one), a min-reduction over candidate indices."""
        (src,), (axis,) = node.args, node.attrs["axes"]
        better, init = ARG_REDUCE[node.attrs["kind"]]
        vtype, n = CType(src.dtype), src.shape[axis]
        best, nan, pos = self.names.fresh("best"), self.names.fresh("nan"), self.names.fresh("pos")
        scope.lines += [f"{vtype} {best} = {init(vtype)};", f"int32_t {nan} = 0;", f"int64_t {pos} = {n};"]
        simd_op = "max" if node.attrs["kind"] == "argmax" else "min"

        def pass_over_axis(body_lines, pragma):
            r = Var.loop(self.names.fresh("r"), n)
            body = scope.child([r])
            v = self.value(src, [r if d == axis else i for d, i in enumerate(idx)], body)
            body.lines += body_lines(v, r)
            scope.lines += for_loop(r, 0, n, body.lines, pragma)

        pass_over_axis(lambda v, r: [f"{best} = {better(best, v)} ? {v} : {best};", f"{nan} |= {v} != {v};"],
                       f"#pragma omp simd reduction({simd_op}:{best}) reduction(|:{nan})")
        candidate = self.names.fresh("hit")
        # bitwise & and | of the conditions, not ?: or &&: g++ vectorizes masks, not branches
        def hit(v):
            return f"(({v} != {v}) & ({nan} != 0)) | (({v} == {best}) & ({nan} == 0))" if vtype.is_float else f"{v} == {best}"
        pass_over_axis(lambda v, r: [f"const int64_t {candidate} = ({hit(v)}) ? {r} : {n};",
                                     f"{pos} = {candidate} < {pos} ? {candidate} : {pos};"],
                       f"#pragma omp simd reduction(min:{pos})")
        return pos


def _size_value(self, node, idx, scope, key):
    """A run-time size read as data (ir.Builder._size_data): its expression over the size symbols."""
    return scope.define(CType(node.dtype), f"static_cast<{CType(node.dtype)}>({render(node.attrs['expr'])})", key)


LAZY = {
    "sizeval": _size_value,
    "view": Values._view_value,
    "ew": Values._elementwise_value,
    "gather": Values._gather_value,
    "pad": Values._pad_value,
}


def _clamped(node: Node) -> Node | None:
    """x when node is Min(Max(x, low), high) for constant scalars low <= high (clamp, hardtanh,
    relu6, hardswish), else None. Such a Min is computed as ``x > high ? high : Max(x, low)``: the
    same values (a NaN x fails both compares and stays; a tie keeps Min's first operand), but both
    compares read x. Chained, the second compare reads the first's select, and g++ if-converts the
    pair into four compares and mask arithmetic (hardswish [64,4096] alone: 26 -> 17 us a call,
    the speed of a copy)."""
    if node.attrs.get("fn") != "Min":
        return None
    maxed, high = node.args
    if maxed.op != "ew" or maxed.attrs.get("fn") != "Max":
        return None
    x, low = maxed.args
    low, high = _scalar_value(low), _scalar_value(high)
    return x if low is not None and high is not None and low <= high else None   # NaN compares False


def _scalar_value(node: Node):
    """The value of a one-element compile-time constant seen through its views, else None."""
    while node.op == "view":
        node = node.args[0]
    value = node.attrs.get("value") if node.op == "const" else None
    return value.reshape(()).item() if value is not None and value.size == 1 else None
