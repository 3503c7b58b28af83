"""Plan -> C++: fused loop nests over a scratch arena, GEMM and convolution through the runtime.

How a planned graph (plan.py) becomes code, one module per job:

1. Each stored node is one kernel (``MATERIALIZE``): a loop kernel (loops.py) whose body asks
   ``Values.value(node, idx)`` (expressions.py) for the C++ of the node at a multi-index, or a call
   into the runtime (calls.py: GEMM, convolution with its planned epilogue). Index arithmetic is
   symbolic (symbolic.py), rendered to C++ at the end.
2. Loop kernels fuse into row groups (one parallel loop) where their accesses stay in the row.
3. Buffers (buffers.py) are created as kernels need them; at the end, row-local scratch moves to
   each thread's stack, the rest gets arena offsets from its live ranges, and render.py writes the
   source (the prelude is cpp/engine_prelude.h).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .buffers import Buffer, Memory, Strided, plan_arena
from .ir import UnsupportedOnnxOp
from .calls import emit_attention, emit_conv, emit_conv_pair, emit_matmul, kernel_destination
from .expressions import Values
from .lines import Names
from .loops import Kernels, emit_concat, emit_elementwise, emit_pad, emit_reduce, emit_scan, emit_transposing
from .manifest import SizeSymbol, TensorSpec
from .plan import Plan, reshaped_source
from .render import keep_rows_on_stack, render_source


@dataclass
class Program:
    source: str
    inputs: list
    outputs: list
    constants: list          # TensorSpec of run-time constants, in `constants` pointer order
    scratch_bytes: int       # at the size symbols' maxima
    symbols: list = field(default_factory=list)   # SizeSymbol of each run-time dim, in `sizes` order


def _spec(name: str, node, names: dict) -> TensorSpec:
    """A graph input's or output's spec: its run-time dims by their symbol's name."""
    if any(d not in names for d in node.shape if not isinstance(d, int)):
        raise UnsupportedOnnxOp(f"{name!r} has the shape {list(node.shape)}: a run-time dim that is not "
                                f"one size symbol")
    return TensorSpec(name, node.dtype, [d if isinstance(d, int) else names[d] for d in node.shape])


MATERIALIZE = {
    "ew": emit_elementwise,
    "gather": emit_elementwise,
    "pad": emit_pad,
    "reduce": emit_reduce,
    "scan": emit_scan,
    "concat": emit_concat,
    "matmul": emit_matmul,
    "conv": emit_conv,
}


class Emitter:
    """What the kernel rules share while one plan is emitted: the plan, the buffers, fresh names,
    the value emission and the kernel blocks."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.names = Names()
        self.memory = Memory(plan.graph)
        self.values = Values(self.memory, self.names)
        self.kernels = Kernels(self.names)
        self.weight_gemms = []   # calls._weight_gemm's tuples, in call order

    def run(self) -> Program:
        plan, memory = self.plan, self.memory
        for node, k in plan.outputs.items():
            memory.output(node, k)
        fused = plan.fused
        paired = set(plan.conv_pairs.values())   # called with their depthwise convolution
        for node in plan.live:
            if node in fused or node in paired or node not in plan.materialized or node.op in ("input", "const"):
                continue
            emit = (emit_attention if node in plan.attentions else emit_conv_pair if node in plan.conv_pairs
                    else MATERIALIZE[node.op])
            emit(self, node, kernel_destination(self, node))
        for k, (_, node) in enumerate(plan.graph.outputs):
            # (an output reshaping a node written into it: make_plan)
            buf = memory.buffers.get(node) or memory.buffers.get(reshaped_source(node))
            if buf is None or (buf.kind, buf.index) != ("output", k):
                out = Strided.dense(Buffer("output", k, node.dtype, node.numel), node.shape)
                emit_transposing(self, f"output {k} = copy of {node!r}", out, node,
                                 lambda scope, idx, node=node: self.values.value(node, idx, scope))
        self.kernels.close_group()
        rows_on_stack = keep_rows_on_stack(self.kernels.blocks)
        scratch_bytes = plan_arena([b for b in memory.scratch if b not in rows_on_stack])
        graph = plan.graph
        # derived symbols (output dims no input binds) follow the bound ones in `sizes`
        symbols = graph.symbols + graph.derived
        names = {var: name for name, var in symbols}
        # an input-bound size equal to an expression of others (ir.SIZE_EQUAL_KEY): a dim the IR
        # computes as that expression is that size
        names.update({expr: names[var] for var, expr in graph.checks})
        return Program(render_source(self.kernels.blocks, memory.inline_consts, rows_on_stack,
                                     [var for _, var in graph.symbols], self.weight_gemms,
                                     [expr for _, expr in graph.derived], graph.checks),
                       [_spec(n.name, n, names) for n in graph.inputs],
                       [_spec(name, n, names) for name, n in graph.outputs],
                       [TensorSpec(name, n.dtype, list(n.shape)) for name, n in memory.runtime_consts],
                       scratch_bytes,
                       [SizeSymbol(name, *var.bounds()) for name, var in symbols])


def generate(plan: Plan) -> Program:
    return Emitter(plan).run()
