"""IR -> C++: fused loop nests over a scratch arena, GEMM through the runtime (torch-free).

How a graph becomes code:

1. ``Schedule`` decides which IR nodes get memory (are *materialized*): graph outputs, reductions,
   matmuls, concats, and values that several consumers would otherwise recompute at a real cost
   (or that feed a reshape strides can't express). Everything else stays *lazy*.
2. Each materialized node is one kernel: a loop nest over its shape whose body asks
   ``Emitter.value(node, idx)`` for the C++ expression of the node at a multi-index. Lazy
   producers are inlined there (producer-consumer fusion); views only rewrite the index; loads of
   buffers use their strides (broadcast = stride 0). Every computed value becomes a ``const`` temp
   memoized per (node, index) — that is CSE — and is placed in the outermost loop scope that binds
   the variables its index uses (loop-invariant code motion: a per-row value is computed once per row).
3. Reductions put their accumulator loop inside that body, so their input is fused in too.
4. Scratch buffers get arena offsets after all kernels exist, from their live ranges.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from . import views
from .ir import ELEMENTWISE, Graph, Node
from .manifest import DTYPES, TensorSpec
from .symbolic import Const, Expr, Var, add, as_expr, render
from .views import Layout, contiguous_strides, linear_index

INLINE_CONST_MAX = 64          # constants with at most this many elements are compiled into the code
PARALLEL_WORK = 16384          # elements of work below which a loop is not worth a thread
STACK_ROW_BYTES = 64 * 1024    # per row group: rows of group-local scratch kept on each thread's stack
ALIGN = 64
WINDOW_REDUCE_MAX = 32         # reductions over at most this many elements per output ...
WINDOW_REDUCE_MIN_ROW = 8      # ... with an innermost output dim this long use the window form
CHANNELS_LAST_MIN_INPUT_CHANNELS = 8   # fewer (an RGB image): a channels-last conv still reads NCHW
DECLS = "@DECLS@"              # where a kernel's buffer pointers get declared


# ---------------------------------------------------------------------------------------------
# C++ types and literals

@dataclass(frozen=True)
class CType:
    dtype: str

    @property
    def name(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def is_float(self) -> bool:
        return self.dtype in ("float32", "float64")

    def __str__(self) -> str:
        return self.name


def literal(value, dtype: str) -> str:
    """A C++ literal that reproduces value exactly in dtype."""
    if dtype == "bool":
        return "true" if value else "false"
    if dtype in ("float32", "float64"):
        limits = f"std::numeric_limits<{DTYPES[dtype][0]}>"
        value = float(value)
        if math.isnan(value):
            return f"{limits}::quiet_NaN()"
        if math.isinf(value):
            return f"{'-' if value < 0 else ''}{limits}::infinity()"
        # repr round-trips the double, which is exactly the float32 value: parsing it back as a
        # float literal gives the same float.
        return repr(value) + ("f" if dtype == "float32" else "")
    value = int(value)
    if dtype == "int64":
        return "INT64_MIN" if value == -2**63 else f"int64_t({value}LL)"
    return "INT32_MIN" if value == -2**31 else f"int32_t({value})"


def _neg_inf_or_lowest(t: CType) -> str:
    return f"-std::numeric_limits<{t}>::infinity()" if t.is_float else f"std::numeric_limits<{t}>::lowest()"


def _inf_or_max(t: CType) -> str:
    return f"std::numeric_limits<{t}>::infinity()" if t.is_float else f"std::numeric_limits<{t}>::max()"


# ---------------------------------------------------------------------------------------------
# Op tables. Arguments are always atoms (temps, literals, loads), so repeating one is free.
# t: the C++ type of the result.

def _exp(t: CType) -> str:
    return "blade_expf" if t.dtype == "float32" else "std::exp"


def _call(fn):
    return lambda t, a: f"{fn}({a})"


def _float32_or_std(name):
    """blade_<name>f of the prelude for float32 (a loop calling it vectorizes), std::<name> otherwise."""
    return lambda t, a: f"blade_{name}f({a})" if t.dtype == "float32" else f"std::{name}({a})"


def _integer_div(t: CType, a: str, b: str) -> str:
    """ONNX integer division truncates, as C++ does. Neither x / 0 nor INT_MIN / -1 may trap the
    process: a zero divisor fails the call (eager raises ZeroDivisionError), and x / -1 is a
    wrapping negation (torch's result for INT_MIN)."""
    unsigned = f"u{t}"
    return (f"({b} == 0 ? (status.store(BLADE_ERR_DIVISION_BY_ZERO, std::memory_order_relaxed), {t}(0)) : "
            f"{b} == {t}(-1) ? {t}({unsigned}(0) - {unsigned}({a})) : {t}({a} / {b}))")


CODE_FOR_OP = {
    "Add": lambda t, a, b: f"{a} + {b}",
    "Sub": lambda t, a, b: f"{a} - {b}",
    "Mul": lambda t, a, b: f"{a} * {b}",
    "Div": lambda t, a, b: f"{a} / {b}" if t.is_float else _integer_div(t, a, b),
    "Pow": lambda t, a, b: (f"blade_powf({a}, {b})" if t.dtype == "float32" else f"std::pow({a}, {b})" if t.is_float
                            else f"blade_ipow({a}, {b})"),
    "Mod": lambda t, a, b: f"std::fmod({a}, {b})",   # floats only (ir._fmod)
    "Neg": lambda t, a: f"-{a}",
    "Abs": _call("std::abs"),
    "Relu": lambda t, a: f"({a} < {t}(0) ? {t}(0) : {a})",   # NaN passes through, like torch
    # float32 exp/tanh/sigmoid/erf/log/sin/cos/pow use the branch-free versions of the prelude so that loops vectorize.
    "Sigmoid": lambda t, a: (f"blade_sigmoidf({a})" if t.dtype == "float32"
                             else f"{t}(1) / ({t}(1) + {_exp(t)}(-{a}))"),
    "Tanh": lambda t, a: f"{'blade_tanhf' if t.dtype == 'float32' else 'std::tanh'}({a})",
    "Exp": lambda t, a: f"{_exp(t)}({a})",
    "Log": _float32_or_std("log"),
    "Sqrt": _call("std::sqrt"),
    "Reciprocal": lambda t, a: f"{t}(1) / {a}",
    "Erf": lambda t, a: f"{'blade_erff' if t.dtype == 'float32' else 'std::erf'}({a})",
    "Floor": _call("std::floor"),
    "Ceil": _call("std::ceil"),
    "Sin": _float32_or_std("sin"),
    "Cos": _float32_or_std("cos"),
    # NaN wins and a tie (-0 vs +0) gives the first operand, like torch's maximum/minimum/clamp
    "Max": lambda t, a, b: f"({a} != {a} || {a} >= {b}) ? {a} : {b}",
    "Min": lambda t, a, b: f"({a} != {a} || {a} <= {b}) ? {a} : {b}",
    # bool branches as bit operations: g++ does not vectorize a ?: select of bools
    "Where": lambda t, c, a, b: f"({c} & {a}) | (!{c} & {b})" if t.dtype == "bool" else f"{c} ? {a} : {b}",
    "Equal": lambda t, a, b: f"{a} == {b}",
    "Less": lambda t, a, b: f"{a} < {b}",
    "LessOrEqual": lambda t, a, b: f"{a} <= {b}",
    "Greater": lambda t, a, b: f"{a} > {b}",
    "GreaterOrEqual": lambda t, a, b: f"{a} >= {b}",
    "Not": lambda t, a: f"!{a}",
    "And": lambda t, a, b: f"{a} && {b}",
    "Or": lambda t, a, b: f"{a} || {b}",
    # +a: a bool operand is promoted to int first (g++ does not vectorize bool -> float conversions;
    # every other operand type is unchanged by the unary +)
    "Cast": lambda t, a: f"{a} != 0" if t.dtype == "bool" else f"static_cast<{t}>(+{a})",
}
assert CODE_FOR_OP.keys() == ELEMENTWISE.keys(), "ir.ELEMENTWISE and CODE_FOR_OP must list the same ops"

# Rough cost of one element of an op, to decide between recomputing a shared value and storing it.
EXPENSIVE_OPS = {"Div": 4, "Sqrt": 4, "Reciprocal": 4, "Pow": 20, "Sigmoid": 20, "Tanh": 20,
                 "Exp": 20, "Log": 20, "Erf": 20, "Sin": 20, "Cos": 20}
RECOMPUTE_MAX_COST = 2


@dataclass(frozen=True)
class Reduction:
    init: object       # CType -> C++ initial accumulator
    combine: object    # (acc, value) -> C++ expression
    simd: str = ""     # OpenMP simd reduction operator when the combine is associative enough
    # Float max/min: the NaN-propagating combine is a loop-carried select g++ will not vectorize, so
    # float loops use this NaN-ignoring combine (an OpenMP simd max/min) and OR a NaN flag alongside.
    float_combine: object = None


REDUCE = {
    "sum": Reduction(lambda t: f"{t}(0)", lambda acc, v: f"{acc} + {v}", "+"),
    "prod": Reduction(lambda t: f"{t}(1)", lambda acc, v: f"{acc} * {v}", "*"),
    "max": Reduction(_neg_inf_or_lowest, lambda acc, v: f"({v} != {v} || {v} > {acc}) ? {v} : {acc}", "max",
                     lambda acc, v: f"{v} > {acc} ? {v} : {acc}"),
    "min": Reduction(_inf_or_max, lambda acc, v: f"({v} != {v} || {v} < {acc}) ? {v} : {acc}", "min",
                     lambda acc, v: f"{v} < {acc} ? {v} : {acc}"),
}


# ---------------------------------------------------------------------------------------------
# Memory

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
# Lines of code: a line is a str, or a tuple of parts whose text is only known once the whole
# program is planned: a buffer access (its address may become relative to a row kept on the
# stack) and a scratch buffer's arena offset.

@dataclass(frozen=True)
class Access:
    """buf[address] (a load or a store)."""
    buf: Buffer
    address: Expr

    def text(self, stack_rows: dict) -> str:
        rows = stack_rows.get(self.buf)
        # a buffer kept on the stack is addressed within its row: every access was rebased
        address = self.address if rows is None else rows[self.address]
        return f"{self.buf.ident}[{address.render()}]"


@dataclass(frozen=True)
class ArenaOffset:
    """A scratch buffer's byte offset in the arena (planned after every kernel exists)."""
    buf: Buffer

    def text(self, stack_rows: dict) -> str:
        return str(self.buf.offset)


def line_text(line, stack_rows: dict) -> str:
    if isinstance(line, str):
        return line
    return "".join(part if isinstance(part, str) else part.text(stack_rows) for part in line)


def _loop_vars(shape) -> list:
    """The index of a loop nest over shape: i<d> over each dim, 0 for size-1 dims."""
    return [Var.loop(f"i{d}", n) if n != 1 else Const(0) for d, n in enumerate(shape)]


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


def _permuted(s: Strided, order) -> Strided:
    """s with its dims in `order`: the same elements, indexed in that order."""
    return Strided(s.buf, tuple(s.shape[d] for d in order),
                   Layout(s.layout.offset, tuple(s.layout.strides[d] for d in order)))


def _unpermuted(idx, order) -> list:
    """Indices in the logical dim order from indices in `order` (the inverse of _permuted)."""
    logical = [None] * len(order)
    for position, d in enumerate(order):
        logical[d] = idx[position]
    return logical


def memory_order(s: Strided) -> tuple:
    """s's dims from the largest stride to the smallest (the order of a loop nest that walks its
    memory forward); size-1 dims keep their place."""
    moving = sorted((d for d, n in enumerate(s.shape) if n != 1), key=lambda d: -s.layout.strides[d])
    it = iter(moving)
    return tuple(d if n == 1 else next(it) for d, n in enumerate(s.shape))


# ---------------------------------------------------------------------------------------------
# Scopes: statement lists of nested loop bodies, with memo and loop-invariant placement

class Scope:
    def __init__(self, emitter, parent=None, binds=()):
        self.emitter, self.parent = emitter, parent
        self.binds = set(binds)       # Vars: loop variables (and index temps) defined here
        self.lines: list[str] = []
        self.memo: dict = {}
        self.has_side_effects = False

    def child(self, binds) -> "Scope":
        return Scope(self.emitter, self, binds)

    def lookup(self, key):
        scope = self
        while scope is not None:
            if key in scope.memo:
                return scope.memo[key]
            scope = scope.parent
        return None

    def home_for(self, idx) -> "Scope":
        """The outermost enclosing scope in which every variable used by idx is defined."""
        used = set().union(*(i.free_vars() for i in idx))
        scope = self
        while scope.parent is not None and not (scope.binds & used):
            scope = scope.parent
        return scope

    def define(self, ctype: CType, text, key=None, prefix="t") -> str:
        """A const temp holding text (C++, or an Access) in this scope; returns its name."""
        name = self.emitter.fresh(prefix)
        self.lines.append(f"const {ctype} {name} = {text};" if isinstance(text, str)
                          else (f"const {ctype} {name} = ", text, ";"))
        if key is not None:
            self.memo[key] = name
        return name

    def mark_side_effects(self):
        scope = self
        while scope is not None:
            scope.has_side_effects = True
            scope = scope.parent


def _indent(lines, depth=1):
    pad = "  " * depth
    return [(pad + line if line else line) if isinstance(line, str) else (pad, *line) for line in lines]


def _cpp(value) -> str:
    """C++ of an index value: an int or Expr, or a C++ name already."""
    return value if isinstance(value, str) else render(value)


def _for(var, begin, end, body_lines, pragma: str = ""):
    """A loop of var over [begin, end): each a Var/Expr/int, or C++ text."""
    head = [pragma] if pragma else []
    var = _cpp(var)
    return head + [f"for (int64_t {var} = {_cpp(begin)}; {var} < {_cpp(end)}; ++{var}) {{",
                   *_indent(body_lines), "}"]


# ---------------------------------------------------------------------------------------------
# Scheduling: which nodes get memory

COMPUTED = ("ew", "gather", "pad")     # computed per element: inlined into consumers or stored

class Schedule:
    ALWAYS_MATERIALIZED = ("reduce", "matmul", "concat", "conv")
    DENSE_OPERANDS = ("matmul", "conv")     # ops whose arguments the runtime reads from memory

    def __init__(self, graph: Graph):
        self.graph = graph
        self.live = self._live_nodes()
        self.materialized = self._choose()

    def _live_nodes(self):
        live, stack = set(), [node for _, node in self.graph.outputs]
        while stack:
            node = stack.pop()
            if node not in live:
                live.add(node)
                stack.extend(node.args)
        return [n for n in self.graph.nodes if n in live]

    def _cost(self, node, stored, memo):
        """Per-element cost of computing node inline, down to stored values."""
        if node.op not in COMPUTED + ("view",) or node in stored:
            return 0
        if node not in memo:
            own = EXPENSIVE_OPS.get(node.attrs.get("fn"), 1) if node.op != "view" else 0
            memo[node] = own + sum(self._cost(a, stored, memo) for a in node.args)
        return memo[node]

    @staticmethod
    def _stored_pad(node) -> bool:
        """Constant padding that only grows is stored (a fill, then a plain copy of the interior):
        read inline, every element pays a bounds check whose clamped index g++ cannot vectorize,
        and pooling windows read each element several times."""
        return (node.op == "pad" and node.attrs["mode"] == "constant" and min(node.attrs["begins"]) >= 0
                and all(o >= i + b for o, i, b in zip(node.shape, node.args[0].shape, node.attrs["begins"])))

    def _choose(self) -> set:
        outputs = {node for _, node in self.graph.outputs}
        # reads[n]: how many times each element of n is read by the rest of the graph, looking
        # through views (a view is read-through; an expand multiplies reads).
        reads = {n: 0 for n in self.live}
        for node in outputs:
            reads[node] += 1
        must_store = set()
        for node in reversed(self.live):
            for arg in node.args:
                if node.op == "view":
                    grows = node.attrs["view"] == "expand" and node.numel > arg.numel
                    reads[arg] += max(reads[node], 2) if grows and reads[node] else reads[node]
                    if node.attrs["view"] == "reshape" and not views.only_unit_dims_change(arg.shape, node.shape):
                        must_store.add(arg)
                else:
                    reads[arg] += 1
                if node.op in self.DENSE_OPERANDS:
                    must_store.add(arg)
        chosen, cost_memo = set(), {}
        for node in self.live:
            if node.op in self.ALWAYS_MATERIALIZED or self._stored_pad(node):
                chosen.add(node)
            elif node.op in COMPUTED:
                if node in outputs or node in must_store or (reads[node] > 1 and
                                          self._cost(node, chosen, cost_memo) > RECOMPUTE_MAX_COST):
                    chosen.add(node)
        # A stored view (reshape/matmul operand) means its compute source is stored instead.
        for node in list(must_store):
            while node.op == "view":
                node = node.args[0]
            if node.op in COMPUTED:
                chosen.add(node)
        return chosen


# ---------------------------------------------------------------------------------------------
# The emitter

@dataclass
class Kernel:
    number: int                                    # its block (kernels of a row group share one)
    comment: str
    uses: dict = field(default_factory=dict)       # Buffer -> written?
    accesses: list = field(default_factory=list)   # (Strided, idx, written) of loop kernels
    prologue: list = field(default_factory=list)   # loop kernels: lines before the row loop,
    body: list = field(default_factory=list)       # and lines inside it
    work: int = 0                                  # elements of work per row


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


@dataclass
class Program:
    source: str
    inputs: list
    outputs: list
    constants: list          # TensorSpec of run-time constants, in `constants` pointer order
    scratch_bytes: int


class Emitter:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.schedule = Schedule(graph)
        self.counter = 0
        self.buffers: dict[Node, Buffer] = {}
        self.scratch: list[Buffer] = []
        self.runtime_consts: list[tuple[str, Node]] = []
        self.inline_consts: list[Buffer] = []
        self.kernels_code: list[str] = []
        self.kernel: Kernel | None = None
        self.group: RowGroup | None = None
        self.strided_memo: dict = {}
        self.channels_last: set = set()     # nodes stored NHWC (_choose_channels_last)
        self.stack_rows: dict = {}          # scratch kept a row per thread: {address: row address}
        for i, node in enumerate(graph.inputs):
            self.buffers[node] = Buffer("input", i, node.dtype, node.numel)

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    # ---- memory of nodes ----

    def _const_buffer(self, node: Node) -> Buffer:
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
            result = Strided.dense(self._const_buffer(node), node.shape)
        elif node in self.buffers:
            result = Strided.dense(self.buffers[node], node.shape)
        elif node.op == "view":
            src = self.strided_of(node.args[0])
            layout = src and views.view_layout(node, src.layout)
            result = layout and Strided(src.buf, node.shape, layout)
        self.strided_memo[node] = result
        return result

    def use(self, buf: Buffer, write: bool = False) -> str:
        buf.referenced = True
        self.kernel.uses[buf] = self.kernel.uses.get(buf, False) or write
        if buf.kind == "scratch":
            if write and buf.first < 0:
                buf.first = self.kernel.number
            buf.last = max(buf.last, self.kernel.number)
        return buf.ident

    # ---- values ----

    def load(self, s: Strided, idx):
        """The Access of s[idx], or the literal of a one-element inline constant."""
        if s.buf.kind == "inline" and s.buf.numel == 1:
            return literal(s.buf.values.reshape(-1)[0], s.buf.dtype)
        self.kernel.accesses.append((s, idx, False))
        self.use(s.buf)
        return Access(s.buf, s.address(idx))

    def value(self, node: Node, idx, scope: Scope) -> str:
        """The C++ expression (an atom) of node at multi-index idx (Exprs), emitting statements as needed."""
        idx = tuple(as_expr(i) for i in idx)
        key = (id(node), idx)
        hit = scope.lookup(key)
        if hit is not None:
            return hit
        home = scope.home_for(idx)
        strided = self.strided_of(node)
        if strided is None:
            return self.compute(node, idx, home, key)
        text = self.load(strided, idx)
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
        return scope.define(ctype, CODE_FOR_OP[node.attrs["fn"]](ctype, *args), key)

    def _gather_value(self, node, idx, scope, key):
        data, indices = node.args
        axis, n = node.attrs["axis"], data.shape[node.attrs["axis"]]
        raw = self.value(indices, idx[axis:axis + indices.rank], scope)
        pos = Var.loop(self.fresh("g"), max(n, 1))   # in range once the lines below ran
        scope.lines += [
            f"int64_t {pos} = static_cast<int64_t>({raw});",
            f"if ({pos} < 0) {pos} += {n};",
            # Out of range: flag the error and read a valid element instead of faulting.
            f"if ({pos} < 0 || {pos} >= {max(n, 1)}) {{ status.store(BLADE_ERR_INDEX_OUT_OF_RANGE, "
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
            pos = Var(self.fresh("p"), *shifted.bounds())
            clamped = Var.loop(f"{pos}c", max(n, 1))
            remap = {"constant": f"({pos} >= 0 && {pos} < {n} ? {pos} : 0)",
                     "edge": f"({pos} < 0 ? 0 : ({pos} >= {n} ? {n - 1} : {pos}))",
                     "reflect": f"({pos} < 0 ? -{pos} : ({pos} >= {n} ? {2 * n - 2} - {pos} : {pos}))"}[mode]
            scope.lines += [f"const int64_t {pos} = {shifted};", f"const int64_t {clamped} = {remap};"]
            inside.append(f"{pos} >= 0 && {pos} < {n}")
            scope.binds.update({pos, clamped})
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
        rule, ctype = REDUCE[kind], CType(node.dtype)
        acc = self.fresh("acc")
        scope.lines.append(f"{ctype} {acc} = {rule.init(ctype)};")
        axes = [a for a in node.attrs["axes"] if src.shape[a] != 1]
        loop_vars = {a: Var.loop(self.fresh("r"), src.shape[a]) for a in axes}
        chain = [scope]                        # chain[j + 1] is the body of the loop over axes[j]
        for a in axes:
            chain.append(chain[-1].child([loop_vars[a]]))
        src_idx = [loop_vars.get(d, Const(0) if src.shape[d] == 1 else i) for d, i in enumerate(idx)]
        v = self.value(src, src_idx, chain[-1])
        # Vectorize the innermost accumulation when reassociating it is harmless (float sums,
        # float max/min with their NaN flag).
        simd = rule.simd and ctype.is_float and not chain[-1].has_side_effects
        clauses, after = f"reduction({rule.simd}:{acc})", []
        if simd and rule.float_combine:
            nan = self.fresh("nan")
            scope.lines.append(f"int32_t {nan} = 0;")
            chain[-1].lines += [f"{acc} = {rule.float_combine(acc, v)};", f"{nan} |= {v} != {v};"]
            clauses += f" reduction(|:{nan})"
            after = [f"if ({nan}) {acc} = std::numeric_limits<{ctype}>::quiet_NaN();"]
        else:
            chain[-1].lines.append(f"{acc} = {rule.combine(acc, v)};")
        body = chain[-1].lines
        for level in range(len(axes), 0, -1):
            pragma = f"#pragma omp simd {clauses}" if simd and level == len(axes) else ""
            body = chain[level - 1].lines + _for(loop_vars[axes[level - 1]], 0, src.shape[axes[level - 1]],
                                                 body, pragma)
        scope.lines[:] = body + after
        return acc

    # ---- kernels ----
    #
    # Kernels are emitted into numbered *blocks* (the unit of scratch liveness). A call kernel
    # (GEMM, conv) is one block. Loop kernels are fused into a RowGroup block while they share its
    # rows (leading dims) and touch the memory the group writes only within the current row: one
    # parallel loop runs every kernel of the group row by row, so what one kernel writes is still
    # in L1 when the next one reads it, and the thread pool is entered once instead of per kernel.

    def begin_kernel(self, comment: str):
        """Starts a block of its own (call kernels); closes an open row group first."""
        self.close_group()
        self.kernel = Kernel(len(self.kernels_code), comment)

    def end_kernel(self, body_lines):
        """Closes the kernel; its buffer pointers are declared where body_lines has DECLS (inside
        the parallel lambda, so that __restrict__ reaches the loops)."""
        self.kernels_code.append((self.kernel.comment, self._declare(body_lines, self.kernel.uses)))
        self.kernel = None

    def _declare(self, body_lines, uses):
        decls = [self._pointer_decl(buf, written) for buf, written in uses.items() if buf.kind != "inline"]
        lines = []
        for line in body_lines:
            if isinstance(line, str) and line.strip() == DECLS:
                lines += _indent(decls, (len(line) - len(line.lstrip())) // 2)
            else:
                lines.append(line)
        return lines

    @staticmethod
    def _pointer_decl(buf: Buffer, written: bool) -> str:
        ctype = buf.element_ctype
        qual = "" if written else "const "
        source = {"input": f"inputs[{buf.index}]", "output": f"outputs[{buf.index}]",
                  "const": f"constants[{buf.index}]"}.get(buf.kind)
        if source is None:
            return (f"{qual}{ctype}* __restrict__ {buf.ident} = reinterpret_cast<{qual}{ctype}*>(arena + ",
                    ArenaOffset(buf), ");")
        return f"{qual}{ctype}* __restrict__ {buf.ident} = static_cast<{qual}{ctype}*>({source});"

    def emit_loop_kernel(self, comment, dest: Strided, value_fn, work_per_element=1, rows=None, make=None):
        """dest[idx] = value_fn(scope, idx) for every idx of dest.shape, parallel over its rows
        (by default every dim but the innermost loop; `rows` overrides the number of leading dims),
        fused into the open row group when that is safe. `make` replaces _loop_kernel as the
        builder of the kernel's loops (same arguments)."""
        if math.prod(dest.shape) == 0:
            return
        order = memory_order(dest)
        if rows is None and make is None and order != tuple(range(len(order))):
            dest, value_fn = self._in_memory_order(dest, value_fn, order)
        shape = dest.shape
        make = make or self._loop_kernel
        group = self.group
        if group is not None and shape[:len(group.rows)] == group.rows:
            attempt = make(comment, dest, value_fn, work_per_element, group)
            if self._row_local(attempt, group):
                group.add(attempt)
                return
        self.close_group()
        loop_dims = [d for d, n in enumerate(shape) if n != 1]
        if rows is None:
            rows = loop_dims[-1] + (len(loop_dims) == 1) if loop_dims else len(shape)
        self.group = RowGroup(len(self.kernels_code), tuple(shape[:rows]))
        self.kernels_code.append(None)  # the group's slot, filled by close_group
        self.group.add(make(comment, dest, value_fn, work_per_element, self.group))
        if math.prod(self.group.rows) == 1:  # nothing to share a row loop with
            self.close_group()

    @staticmethod
    def _in_memory_order(dest: Strided, value_fn, order):
        """dest with its dims permuted into memory order (so the loops run along memory, e.g. over
        channels innermost for a channels-last buffer), and value_fn taking indices in that order."""
        return _permuted(dest, order), lambda scope, idx: value_fn(scope, _unpermuted(idx, order))

    def _loop_kernel(self, comment, dest: Strided, value_fn, work_per_element, group) -> Kernel:
        """One loop kernel inside group's row loop: the loops over dest's dims past the rows."""
        self.kernel = kernel = Kernel(group.number, comment)
        shape, k = dest.shape, len(group.rows)
        inner = [d for d in range(k, len(shape)) if shape[d] != 1]
        idx = _loop_vars(shape)
        prologue = Scope(self)
        chain = [prologue.child([idx[d] for d in range(k) if shape[d] != 1])]
        for d in inner:
            chain.append(chain[-1].child([idx[d]]))
        self.use(dest.buf, write=True)
        kernel.accesses.append((dest, idx, True))
        target = Access(dest.buf, dest.address(idx))
        chain[-1].lines.append((target, f" = {value_fn(chain[-1], idx)};"))
        body = chain[-1].lines
        for level in range(len(inner), 0, -1):
            body = chain[level - 1].lines + _for(idx[inner[level - 1]], 0, shape[inner[level - 1]], body)
        kernel.prologue, kernel.body = prologue.lines, body
        kernel.work = math.prod(shape[k:]) * work_per_element
        self.kernel = None
        return kernel

    @staticmethod
    def _row_address(s: Strided, idx, rows) -> Expr | None:
        """The address of s[idx] relative to the current row, when it provably lies inside that
        row of s's buffer (row r spans elements [r * row_numel, (r + 1) * row_numel)); else None."""
        row_vars = [(var, n) for var, n in zip(_loop_vars(rows), rows) if n != 1]
        row_numel, rem = divmod(s.buf.numel, math.prod(rows))
        if not row_vars or rem:
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
                low, high = low + min(0, stride * (n - 1)), high + max(0, stride * (n - 1))
                rest.append(stride * i)
        if got != want or low < 0 or high >= row_numel:
            return None
        return add(s.layout.offset, *rest)

    def _row_local(self, kernel: Kernel, group: "RowGroup") -> bool:
        """Whether kernel, run row by row inside group, touches what the group writes only within
        the current row and writes its own output row by row: then fusing it is safe."""
        return all(self._row_address(s, idx, group.rows) is not None
                   for s, idx, written in kernel.accesses if written or s.buf in group.written)

    def _stack_rows(self, group: "RowGroup", budget: int):
        """Scratch buffers that live only inside group's row loop become one row on each thread's
        stack (in L1) instead of a whole tensor in the arena: their accesses are rebased to the row
        (recorded in self.stack_rows: buffer -> {address: address within the row})."""
        local = set()
        for buf in sorted(group.written, key=lambda b: b.index):
            if buf.kind != "scratch" or not buf.first == buf.last == group.number:
                continue
            accesses = [(s, idx) for k in group.kernels for s, idx, _ in k.accesses if s.buf is buf]
            rows = [self._row_address(s, idx, group.rows) for s, idx in accesses]
            row_bytes = buf.nbytes // math.prod(group.rows)
            if None in rows or row_bytes > budget:
                continue
            budget -= row_bytes
            local.add(buf)
            self.stack_rows[buf] = {s.address(idx): row for (s, idx), row in zip(accesses, rows)}
        return local

    def close_group(self):
        """Ends the open row group; it is rendered once scratch liveness is known (render_group)."""
        if self.group is not None:
            self.kernels_code[self.group.number] = self.group
            self.group = None

    def render_group(self, group: "RowGroup") -> tuple:
        """(comment, lines) of a row group: one parallel loop over its rows running every kernel."""
        local = self._stack_rows(group, STACK_ROW_BYTES)
        total = math.prod(group.rows)
        grain = max(1, -(-PARALLEL_WORK // max(group.work, 1)))
        unflatten, step, row = [], 1, Var.loop("o", total)
        row_dims = [d for d, n in enumerate(group.rows) if n != 1]
        for d in reversed(row_dims):
            q = row // step
            unflatten.insert(0, f"const int64_t i{d} = {q if d == row_dims[0] else q % group.rows[d]};")
            step *= group.rows[d]
        rows_body = unflatten
        for kernel in group.kernels:
            rows_body += [f"// {kernel.comment}"] * (len(group.kernels) > 1) + kernel.body
        prologue = [f"alignas({ALIGN}) {b.element_ctype} {b.ident}[{b.numel // total}];  // one row, per thread"
                    for b in sorted(local, key=lambda b: b.index)]
        prologue += [line for kernel in group.kernels for line in kernel.prologue]
        uses = {buf: written for buf, written in group.uses.items() if buf not in local}
        comment = "; ".join(kernel.comment for kernel in group.kernels)
        if total == 1:
            body = ["{", *_indent([DECLS] + prologue + rows_body), "}"]
        else:
            body = [f"blade::parallel_for(rt, 0, {total}, {grain}, [&](int64_t lo, int64_t hi) {{",
                    *_indent([DECLS] + prologue + _for("o", "lo", "hi", rows_body)), "});"]
        return comment, self._declare(body, uses), local

    def _emit_elementwise(self, node, dest):
        self.emit_loop_kernel(f"{node!r} = {node.op} {node.attrs.get('fn', '')}", dest,
                              lambda scope, idx: self.compute(node, idx, scope))

    def _emit_pad(self, node, dest):
        if not Schedule._stored_pad(node):
            self._emit_elementwise(node, dest)
            return
        (src,) = node.args
        fill = literal(node.attrs["value"], node.dtype)
        self.emit_loop_kernel(f"{node!r} = pad fill", dest, lambda scope, idx: fill)
        offset = dest.layout.offset + sum(b * st for b, st in zip(node.attrs["begins"], dest.layout.strides))
        interior = Strided(dest.buf, src.shape, Layout(offset, dest.layout.strides))
        self.emit_loop_kernel(f"{node!r} = pad interior", interior, lambda scope, idx: self.value(src, idx, scope))

    def _emit_reduce(self, node, dest):
        src = node.args[0]
        work = max(1, src.numel // max(node.numel, 1))
        loop_dims = [d for d, n in enumerate(node.shape) if n != 1]
        comment = f"{node!r} = reduce {node.attrs['kind']} over axes {node.attrs['axes']}"
        if self._window_form(node):
            # A small window (pooling, a short axis) per output: accumulate into the output row with
            # the window loops outside, so the innermost loop runs along an output dim (in memory
            # order: channels for a channels-last output) and vectorizes; one reduction loop per
            # output element would run 4-9 scalar steps each.
            order = memory_order(dest)
            dest = _permuted(dest, order)
            rows = [p for p, n in enumerate(dest.shape) if n != 1][-1]
            self.emit_loop_kernel(comment + " (window form)", dest, None, work, rows=rows,
                                  make=lambda c, d, _, w, g: self._window_reduce_kernel(node, c, d, w, g, order))
            return
        self.emit_loop_kernel(comment, dest, lambda scope, idx: self.reduction_value(node, idx, scope), work,
                              rows=loop_dims[-1] + 1 if loop_dims else node.rank)

    @staticmethod
    def _window_form(node) -> bool:
        """Whether a reduce node is emitted in window form (see _emit_reduce)."""
        src, dims = node.args[0], [n for n in node.shape if n != 1]
        window = math.prod(src.shape[a] for a in node.attrs["axes"])
        return bool(dims) and window <= WINDOW_REDUCE_MAX and max(dims) >= WINDOW_REDUCE_MIN_ROW

    def _window_reduce_kernel(self, node, comment, dest: Strided, work_per_element, group, order) -> Kernel:
        """A reduce node's kernel inside group's row loop: dest's row is set to the initial value,
        then for each window position (outer loops) combined with the input along the row. dest
        is the output with its dims permuted into `order` (memory order)."""
        (src,), rule, ctype = node.args, REDUCE[node.attrs["kind"]], CType(node.dtype)
        self.kernel = kernel = Kernel(group.number, comment)
        shape, k = dest.shape, len(group.rows)
        inner = [p for p in range(k, len(shape)) if shape[p] != 1]
        idx = _loop_vars(shape)
        logical = _unpermuted(idx, order)
        axes = [a for a in node.attrs["axes"] if src.shape[a] != 1]
        window_vars = {a: Var.loop(self.fresh("r"), src.shape[a]) for a in axes}
        self.use(dest.buf, write=True)
        target = Access(dest.buf, dest.address(idx))
        kernel.accesses.append((dest, idx, True))
        init = [(target, f" = {rule.init(ctype)};")]
        for p in reversed(inner):
            init = _for(idx[p], 0, shape[p], init)
        prologue = Scope(self)
        loops = [(window_vars[a], src.shape[a]) for a in axes] + [(idx[p], shape[p]) for p in inner]
        chain = [prologue.child([idx[p] for p in range(k) if shape[p] != 1] + ["o"])]
        for var, _ in loops:
            chain.append(chain[-1].child([var]))
        src_idx = [window_vars.get(d, Const(0) if src.shape[d] == 1 else i) for d, i in enumerate(logical)]
        v, acc = self.value(src, src_idx, chain[-1]), self.fresh("acc")
        # The old value in a local: read inside the combine's ?: it would be a conditional load,
        # which keeps g++ from vectorizing.
        chain[-1].lines += [(f"const {ctype} {acc} = ", target, ";"), (target, f" = {rule.combine(acc, v)};")]
        body = chain[-1].lines
        for level in range(len(loops), 0, -1):
            var, size = loops[level - 1]
            body = chain[level - 1].lines + _for(var, 0, size, body)
        kernel.prologue, kernel.body = prologue.lines, init + body
        kernel.work = math.prod(shape[k:]) * work_per_element
        self.kernel = None
        return kernel

    def _emit_concat(self, node, dest):
        axis, start = node.attrs["axis"], 0
        for arg in node.args:
            part = Strided(dest.buf, arg.shape, Layout(dest.layout.offset + start * dest.layout.strides[axis],
                                                       dest.layout.strides))
            self.emit_loop_kernel(f"{node!r} = concat part {arg!r}", part,
                                  lambda scope, idx, arg=arg: self.value(arg, idx, scope))
            start += arg.shape[axis]

    def _gemm_operand(self, node: Node):
        """(Strided, trans, ld) for a matmul operand, copying it to scratch if its layout can't be used."""
        s = self.strided_of(node)
        if s is not None:
            rows, cols = s.shape[-2:]
            rs, cs = s.layout.strides[-2:]
            if (cols == 1 or cs == 1) and (rows == 1 or rs >= cols):
                return s, 0, rs if rows > 1 else max(cols, 1)
            if (rows == 1 or rs == 1) and (cols == 1 or cs >= rows):
                return s, 1, cs if cols > 1 else max(rows, 1)
        copy = self.new_scratch(node.dtype, node.shape)
        self.emit_loop_kernel(f"contiguous copy of {node!r} for GEMM", copy,
                              lambda scope, idx: self.value(node, idx, scope))
        return copy, 0, max(node.shape[-1], 1)

    def _emit_matmul(self, node, dest):
        a_node, b_node = node.args
        m, n = node.shape[-2:]
        k = a_node.shape[-1]
        if node.numel == 0:
            return
        if k == 0:  # an empty sum
            self.emit_loop_kernel(f"{node!r} = matmul with k == 0", dest, lambda scope, idx: literal(0, node.dtype))
            return
        (a, ta, lda), (b, tb, ldb) = self._gemm_operand(a_node), self._gemm_operand(b_node)
        # C rows may be strided (a permuted output, _permuted_matmul_output); columns are dense.
        assert dest.layout.strides[-1] == 1 or n == 1, "matmul output columns must be dense"
        ldc = dest.layout.strides[-2] if m > 1 else n
        self.begin_kernel(f"{node!r} = matmul {a_node!r} @ {b_node!r}")
        names = [self.use(a.buf), self.use(b.buf), self.use(dest.buf, write=True)]
        operands = (a, b, dest)
        # Batch dims (size > 1): the innermost goes to sgemm's batch, the others become loops.
        batch = [(size, [o.layout.strides[d] for o in operands])
                 for d, size in enumerate(node.shape[:-2]) if size != 1]
        merged = []
        for size, strides in batch:
            if merged and all(so == s * size for so, s in zip(merged[-1][1], strides)):
                merged[-1] = (merged[-1][0] * size, strides)
            else:
                merged.append((size, strides))
        sgemm_batch, sgemm_strides = merged.pop() if merged else (1, [0, 0, 0])
        loop_vars = [Var.loop(self.fresh("b"), size) for size, _ in merged]
        ptrs = [f"{name} + {add(o.layout.offset, *(st[i] * v for v, (_, st) in zip(loop_vars, merged)))}"
                for i, (name, o) in enumerate(zip(names, operands))]
        call = [f"rt->sgemm({sgemm_batch}, {m}, {n}, {k}, {literal(node.attrs['alpha'], 'float32')}, "
                f"{ptrs[0]}, {lda}, {sgemm_strides[0]}, {ta}, {ptrs[1]}, {ldb}, {sgemm_strides[1]}, {tb}, "
                f"0.0f, {ptrs[2]}, {ldc}, {sgemm_strides[2]});"]
        for var, (size, _) in reversed(list(zip(loop_vars, merged))):
            call = _for(var, 0, size, call)
        self.end_kernel(["{", *_indent([DECLS] + call), "}"])

    def _dense_operand(self, node: Node) -> str:
        """A pointer expression to node as dense row-major memory (copied to scratch if needed)."""
        s = self.strided_of(node)
        if s is None or s.layout.strides != contiguous_strides(node.shape):
            s = self.new_scratch(node.dtype, node.shape)
            self.emit_loop_kernel(f"contiguous copy of {node!r}", s, lambda scope, idx: self.value(node, idx, scope))
        return s

    def _conv_input(self, node: Node, channels_last: bool) -> tuple:
        """(Strided, is it channels-last) for a convolution's input: its memory when dense NCHW or
        NHWC, else a copy (NHWC when the convolution writes NHWC and has enough channels for oneDNN
        to prefer it; a 3-channel image stays NCHW)."""
        s = self.strided_of(node)
        if s is not None:
            if same_strides(node.shape, s.layout.strides, contiguous_strides(node.shape)):
                return s, False
            if node.rank == 4 and same_strides(node.shape, s.layout.strides, strides_in_order(node.shape, CHANNELS_LAST)):
                return s, True
        nhwc = channels_last and node.shape[1] >= CHANNELS_LAST_MIN_INPUT_CHANNELS
        order = CHANNELS_LAST if nhwc else tuple(range(node.rank))
        copy = Strided(self.new_scratch(node.dtype, node.shape).buf, node.shape,
                       Layout(0, strides_in_order(node.shape, order)))
        self.emit_loop_kernel(f"{'channels-last' if nhwc else 'contiguous'} copy of {node!r} for conv", copy,
                              lambda scope, idx: self.value(node, idx, scope))
        return copy, nhwc

    def _emit_conv(self, node, dest, addend=None, relu=False):
        """dest = conv(node's args) [+ addend] [then relu]: the epilogue is the runtime's."""
        if node.numel == 0:
            return
        out_nhwc = node.rank == 4 and not same_strides(node.shape, dest.layout.strides, contiguous_strides(node.shape))
        (x, in_nhwc), *params = self._conv_input(node.args[0], out_nhwc), *map(self._dense_operand, node.args[1:])
        epilogue = (f" + {addend!r}" if addend is not None else "") + (" then relu" if relu else "")
        self.begin_kernel(f"{node!r} = conv {' * '.join(map(repr, node.args))} "
                          f"stride {node.attrs['strides']} pads {node.attrs['pads']} "
                          f"dilation {node.attrs['dilations']} groups {node.attrs['groups']}{epilogue}"
                          + (" (channels-last)" if out_nhwc else ""))
        ptrs = [f"{self.use(o.buf)} + {o.layout.offset}" for o in (x, *params)]
        addend_ptr = f"{self.use(self.strided_of(addend).buf)} + 0" if addend is not None else "nullptr"
        bias = ptrs[2] if len(ptrs) > 2 else "nullptr"
        arrays = {"xs": node.args[0].shape, "ws": node.args[1].shape, "st": node.attrs["strides"],
                  "pd": node.attrs["pads"], "dl": node.attrs["dilations"]}
        decls = [f"const int64_t {name}[] = {{{', '.join(map(str, values))}}};" for name, values in arrays.items()]
        layout = " | ".join(["BLADE_CONV_INPUT_CHANNELS_LAST"] * in_nhwc + ["BLADE_CONV_OUTPUT_CHANNELS_LAST"] * out_nhwc)
        call = (f"rt->conv({node.rank - 2}, xs, {ptrs[0]}, ws, {ptrs[1]}, {bias}, st, pd, dl, "
                f"{node.attrs['groups']}, {self.use(dest.buf, write=True)} + {dest.layout.offset}, {layout or 0}, "
                f"{addend_ptr}, {'BLADE_ACTIVATION_RELU' if relu else 'BLADE_ACTIVATION_NONE'});")
        self.end_kernel(["{", *_indent([DECLS] + decls + [call]), "}"])

    # ---- whole program ----

    def run(self) -> Program:
        sched = self.schedule
        output_nodes = [node for _, node in self.graph.outputs]
        for k, node in enumerate(output_nodes):
            if node in sched.materialized and node not in self.buffers:
                self.buffers[node] = Buffer("output", k, node.dtype, node.numel)
        users = {}
        for node in sched.live:
            for arg in node.args:
                users.setdefault(arg, []).append(node)
        self.channels_last = self._choose_channels_last(users)
        fused = set()   # nodes a convolution's epilogue computes
        for node in sched.live:
            if node in fused or node not in sched.materialized or node.op in ("input", "const"):
                continue
            epilogue = self._conv_epilogue(node, users, output_nodes) if node.op == "conv" else None
            if epilogue:
                target, addend, relu = epilogue
                fused.add(target)
                self._emit_conv(node, self._dest(target, users), addend, relu)
            else:
                MATERIALIZE[node.op](self, node, self._dest(node, users))
        for k, node in enumerate(output_nodes):
            buf = self.buffers.get(node)
            if buf is None or (buf.kind, buf.index) != ("output", k):
                out = Strided.dense(Buffer("output", k, node.dtype, node.numel), node.shape)
                self.emit_loop_kernel(f"output {k} = copy of {node!r}", out,
                                      lambda scope, idx, node=node: self.value(node, idx, scope))
        self.close_group()
        on_stack = set()
        for number, block in enumerate(self.kernels_code):
            if isinstance(block, RowGroup):
                comment, lines, local = self.render_group(block)
                self.kernels_code[number] = (comment, lines)
                on_stack |= local
        scratch_bytes = plan_arena([b for b in self.scratch if b not in on_stack])
        return Program(self._render(), self._specs(self.graph.inputs),
                       [TensorSpec(name, n.dtype, list(n.shape)) for name, n in self.graph.outputs],
                       [TensorSpec(name, n.dtype, list(n.shape)) for name, n in self.runtime_consts],
                       scratch_bytes)

    def _dest(self, node: Node, users: dict) -> Strided:
        """Where a materialized node is stored: its output buffer, a permuted matmul output, a
        channels-last buffer, or dense scratch."""
        dest = self._permuted_matmul_output(node, users.get(node, []))
        if dest is None and node in self.channels_last:
            dest = self._store_in_order(node, channels_last_order(node.rank))
        if dest is None:
            if node not in self.buffers:
                self.buffers[node] = self.new_scratch(node.dtype, node.shape).buf
            dest = Strided.dense(self.buffers[node], node.shape)
        return dest

    def _conv_epilogue(self, conv: Node, users: dict, outputs: list):
        """(target, addend or None, relu) when conv is used only by a stored relu(conv),
        relu(conv + addend) or conv + addend (addend already stored, in the target's layout): the
        convolution computes the target itself, with oneDNN post-ops (a ResNet block's ReLU and
        residual sum) instead of another pass over the activation. None otherwise."""
        def only_user(node):
            used = users.get(node, [])
            return used[0] if len(used) == 1 and node not in outputs else None

        def is_ew(node, fn):
            return node is not None and node.op == "ew" and node.attrs.get("fn") == fn and node.shape == conv.shape

        materialized, user, addend = self.schedule.materialized, only_user(conv), None
        if is_ew(user, "Add"):
            others = [a for a in user.args if a is not conv]
            if len(others) != 1 or others[0].shape != conv.shape or others[0].dtype != conv.dtype:
                return None
            addend = others[0]
            if user not in materialized and is_ew(only_user(user), "Relu"):
                user = only_user(user)
        elif not is_ew(user, "Relu"):
            return None
        if user not in materialized or user in self.buffers and self.buffers[user].kind != "output":
            return None
        if addend is not None:
            if addend not in self.buffers:   # not stored yet (computed later, e.g. a downsample)
                return None
            planned = (strides_in_order(conv.shape, CHANNELS_LAST) if user in self.channels_last
                       else contiguous_strides(conv.shape))
            stored = self.strided_of(addend)
            if stored.layout.offset != 0 or not same_strides(conv.shape, stored.layout.strides, planned):
                return None
        return user, addend, user.attrs.get("fn") == "Relu"

    def _permuted_matmul_output(self, node: Node, users: list) -> Strided | None:
        """A batched matmul read only through one permute (attention heads back to [seq, heads *
        dim]) is written straight in the permuted order (sgemm's ldc and batch stride), so the
        permute is dense and the reshape after it needs no copy. None: the usual dense buffer."""
        if node.op != "matmul" or node in self.buffers or len(users) != 1 or node.rank < 3:
            return None
        (user,) = users
        if user.op != "view" or user.attrs["view"] != "permute" or user.attrs["perm"][-1] != node.rank - 1:
            return None
        return self._store_in_order(node, user.attrs["perm"])

    def _store_in_order(self, node: Node, order) -> Strided:
        """A scratch buffer for node holding its dims nested as `order` (outermost first)."""
        buf = self.new_scratch(node.dtype, node.shape).buf
        self.buffers[node] = buf
        self.strided_memo[node] = Strided(buf, node.shape, Layout(0, strides_in_order(node.shape, order)))
        return self.strided_memo[node]

    def _choose_channels_last(self, users: dict) -> set:
        """Nodes stored channels-last (channels innermost): 2-D convolutions, and the values stored
        between them (activations, residual sums, padded inputs and window reductions of pooling).
        oneDNN then reads and writes without reordering (measured 7-30% faster per ResNet-18
        convolution than NCHW with a copy), and the loops between convolutions run over channels
        innermost instead of transposing. Graph outputs stay dense NCHW."""
        chosen = set()
        for node in self.schedule.live:
            if node in self.buffers or node not in self.schedule.materialized or node.rank < 4:
                continue
            if node.rank == 4 and node.op == "conv" and (self._feeds_conv(node, users) or
                                                        self._computed_from(node, chosen, ("ew", "view"))):
                chosen.add(node)
            elif node.rank == 4 and node.op in ("ew", "pad") and self._computed_from(node, chosen, ("ew",)):
                chosen.add(node)
            elif (node.op == "reduce" and 1 not in node.attrs["axes"] and self._window_form(node)
                  and self._computed_from(node, chosen, ("ew", "view"))):
                chosen.add(node)
        return chosen

    @staticmethod
    def _feeds_conv(node: Node, users: dict) -> bool:
        """Whether node's value reaches another convolution through elementwise ops, padding, views
        and reductions. A convolution that neither reads NHWC nor feeds a convolution stays NCHW:
        the outputs are NCHW, and a loop that reads NHWC to write NCHW transposes (slowly)."""
        stack, seen = list(users.get(node, [])), set()
        while stack:
            user = stack.pop()
            if user.op == "conv":
                return True
            if user not in seen and user.op in ("ew", "pad", "view", "reduce"):
                seen.add(user)
                stack.extend(users.get(user, []))
        return False

    def _computed_from(self, node: Node, chosen: set, through: tuple) -> bool:
        """Whether node's value is computed from a node in chosen, looking through lazy nodes of
        the ops in `through`."""
        stack, seen = list(node.args), set()
        while stack:
            arg = stack.pop()
            if arg in chosen:
                return True
            if arg not in seen and arg.op in through and arg not in self.schedule.materialized:
                seen.add(arg)
                stack.extend(arg.args)
        return False

    @staticmethod
    def _specs(nodes):
        return [TensorSpec(n.name, n.dtype, list(n.shape)) for n in nodes]

    def _render(self) -> str:
        lines = [HEADER, *_profile_table([comment for comment, _ in self.kernels_code]),
                 "namespace {"]
        for buf in self.inline_consts:
            if not buf.referenced:
                continue
            values = ", ".join(literal(v, buf.dtype) for v in np.asarray(buf.values).reshape(-1))
            lines.append(f"constexpr {buf.element_ctype} {buf.ident}[{max(buf.numel, 1)}] = {{{values}}};")
        lines += ["}  // namespace", "", ENTRY_BEGIN]
        for number, (comment, body) in enumerate(self.kernels_code):
            block = [line_text(line, self.stack_rows) for line in body]
            lines += ["", f"  // kernel {number}: {comment}", f"  BLADE_PROFILE_BEGIN({number});", *_indent(block),
                      f"  BLADE_PROFILE_END({number});"]
        lines += ["  BLADE_PROFILE_RUN();", "  return status.load(std::memory_order_relaxed);", "}", ""]
        return "\n".join(lines)


LAZY = {
    "view": Emitter._view_value,
    "ew": Emitter._elementwise_value,
    "gather": Emitter._gather_value,
    "pad": Emitter._pad_value,
}

MATERIALIZE = {
    "ew": Emitter._emit_elementwise,
    "gather": Emitter._emit_elementwise,
    "pad": Emitter._emit_pad,
    "reduce": Emitter._emit_reduce,
    "concat": Emitter._emit_concat,
    "matmul": Emitter._emit_matmul,
    "conv": Emitter._emit_conv,
}

# The start of every engine: the prelude (cpp/engine_prelude.h: float32 transcendentals that
# vectorize, integer pow, profiling macros) is a header beside blade_abi.h, in the cache key.
HEADER = """// Generated by blade.engine from one ONNX cluster. Do not edit.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include "blade_abi.h"
#include "engine_prelude.h"
"""


def _profile_table(comments) -> list:
    """The profile counters, kernel names and blade_engine_profile() (only with BLADE_PROFILE)."""
    names = ", ".join(json.dumps(c if len(c) <= 200 else c[:197] + "...") for c in comments) or '""'
    return ["#ifdef BLADE_PROFILE", "namespace {",
            f"std::atomic<int64_t> blade_profile_ns[{max(len(comments), 1)}];",
            f"const char* const blade_profile_names[] = {{{names}}};", "}  // namespace",
            "// Kernel k's name and total nanoseconds (over every run so far) for k < the count returned;",
            "// *runs: completed runs. Reading never stops concurrent runs.",
            "extern \"C\" int32_t blade_engine_profile(const char* const** names, int64_t* ns, int32_t capacity,",
            "                                        int64_t* runs) {",
            f"  const int32_t count = {len(comments)};",
            "  for (int32_t k = 0; k < count && k < capacity; ++k) ns[k] = blade_profile_ns[k].load();",
            "  *names = blade_profile_names;",
            "  *runs = blade_profile_runs.load();",
            "  return count;",
            "}", "#endif", ""]


ENTRY_BEGIN = """extern "C" int32_t blade_engine_abi_version(void) { return BLADE_ABI_VERSION; }

extern "C" int32_t blade_engine_run(const BladeRuntime* rt, const void* const* inputs,
                                    void* const* outputs, const void* const* constants, void* scratch) {
  (void)rt; (void)inputs; (void)outputs; (void)constants;
  std::atomic<int32_t> status{BLADE_OK};
  char* const arena = static_cast<char*>(scratch);
  (void)arena;"""


def plan_arena(buffers) -> int:
    """Arena offsets for scratch buffers: buffers whose live ranges overlap never share bytes.
    Greedy, largest first, lowest fitting offset. Returns the arena size."""
    placed = []
    for buf in sorted(buffers, key=lambda b: -b.nbytes):
        if buf.first < 0:
            buf.first = buf.last = max(buf.last, 0)
        size = -(-max(buf.nbytes, 1) // ALIGN) * ALIGN
        conflicts = sorted((p.offset, p.offset + -(-max(p.nbytes, 1) // ALIGN) * ALIGN) for p in placed
                           if p.first <= buf.last and buf.first <= p.last)
        offset = 0
        for start, end in conflicts:
            if offset + size <= start:
                break
            offset = max(offset, end)
        buf.offset = offset
        placed.append(buf)
    return max((b.offset + b.nbytes for b in placed), default=0)


def generate(graph: Graph) -> Program:
    return Emitter(graph).run()
