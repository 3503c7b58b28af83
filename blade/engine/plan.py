"""The plan stage: which IR nodes get memory, how it is laid out, and what fuses into what.

Decided from the graph alone, before any code exists (compiler.STAGES dumps it as plan.txt):

- *materialized* nodes get a buffer: graph outputs, reductions, matmuls, concats, convolutions,
  operands the runtime reads from memory (GEMM/conv), values feeding a reshape that strides cannot
  express, and values several consumers would otherwise recompute at a real cost. Every other node
  is *inline*: computed inside the loops of each consumer (producer-consumer fusion);
- the dim order of each stored buffer: row-major, channels-last (convolutions and the values between
  them: oneDNN then reads and writes without reordering), or the order of the one permute that reads
  a batched matmul (attention heads back to [seq, heads * dim], written by sgemm's strides);
- convolution epilogues: act(conv), conv + addend and act(conv + addend), act a ReLU, a clamp
  (ReLU6, hardtanh) or SiLU, computed by the convolution itself (the runtime's kernels, oneDNN post-ops)
  when the sum's addend is stored before the convolution runs;
- convolution pairs: a 1x1 convolution whose result (after its epilogue) only a depthwise
  convolution reads is handed to the runtime with it in one call (MobileNet's expansion: the
  runtime may compute the two together and never store the expanded tensor);
- matmul epilogues: a stored matmul + bias row (a Linear's or GPT-2's Conv1D's bias; stored as a
  graph output, or as the projection whose heads a fused attention reads in place) is written by
  the GEMM: C is filled with the bias, then the GEMM accumulates into it;
- reductions in *window form* (small windows accumulated along the output row: pooling) and
  constant pads stored as a fill plus a copy of the interior (except a channels-last pooling's,
  read inline by its window reduction).

What it leaves to code generation: loop kernels fuse into row groups (one parallel loop) by their
actual memory accesses (loops.py), row-local scratch moves to the stack (render.py), and loops
follow the buffers' layouts: a large-window reduction whose input has its output row innermost
takes the window form too, and a loop reading along another dim than it writes runs in tiles
(loops.py, emit_reduce and emit_transposing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import views
from .attention import find_attentions
from .buffers import channels_last_order, same_strides, strides_in_order
from .ir import Graph, Node
from .optable import ARG_REDUCE, EXPENSIVE_OPS
from .symbolic import proves_at_least, proves_less
from .views import contiguous_strides

COMPUTED = ("ew", "gather", "pad")       # computed per element: inlined into consumers or stored
ALWAYS_MATERIALIZED = ("reduce", "scan", "matmul", "concat", "conv")
DENSE_OPERANDS = ("matmul", "conv")      # ops whose arguments the runtime reads from memory

RECOMPUTE_MAX_COST = 2                   # per-element cost above which a value read twice is stored
WINDOW_REDUCE_MAX = 32         # reductions over at most this many elements per output ...
WINDOW_REDUCE_MIN_ROW = 8      # ... with an innermost output dim this long use the window form


def reads_per_element(node: Node) -> int:
    """How often node's kernel reads each element of its argument: a scan (loops.emit_scan) and an
    arg reduction (expressions: the extreme, then its index) read it twice."""
    return 2 if node.op == "scan" or (node.op == "reduce" and node.attrs["kind"] in ARG_REDUCE) else 1


@dataclass(frozen=True)
class Activation:
    """An activation a convolution applies itself (blade_abi.h BladeActivation): "relu", "clamp"
    to [lo, hi], computed as the engine's Max(v, lo) then Min(v, hi) (a one-sided clamp has lo =
    -inf or hi = inf, which leave every value, NaN included, as it is), "silu", the engine's
    Mul(v, Sigmoid(v)), or "gelu", the engine's exact Gelu(v)."""
    kind: str
    lo: float = -math.inf
    hi: float = math.inf

    def __str__(self):
        return f"clamp[{self.lo}, {self.hi}]" if self.kind == "clamp" else self.kind


@dataclass(frozen=True)
class Epilogue:
    """A convolution computes `target` = act(conv), conv + addend or act(conv + addend) itself; a
    matmul computes `target` = matmul + addend (a bias row) itself (no activation)."""
    target: Node
    addend: Node | None
    activation: Activation | None


@dataclass
class Plan:
    graph: Graph
    live: list                         # nodes the outputs depend on, in topological order
    users: dict                        # node -> the live nodes reading it
    materialized: dict                 # node -> why it is stored (every other computed node is inline)
    outputs: dict                      # materialized node -> the graph output it is written into
    orders: dict                       # stored node -> its dims' nesting when not row-major
    epilogues: dict = field(default_factory=dict)   # conv node -> Epilogue
    window_form: set = field(default_factory=set)   # reductions emitted in window form
    attentions: dict = field(default_factory=dict)  # P.V matmul -> attention.Attention (one runtime call)
    conv_pairs: dict = field(default_factory=dict)  # depthwise conv -> the 1x1 conv it is called with

    @property
    def fused(self) -> set:
        """Nodes a convolution's epilogue computes (no kernel of their own)."""
        return {e.target for e in self.epilogues.values()}

    def attention_of(self, node: Node):
        """The P.V matmul whose fused attention call computes node, else None."""
        return next((pv for pv, a in self.attentions.items() if node in a.interior), None)

    def describe(self) -> str:
        """The plan as text, one line per live node: `name = op(args) shape dtype: decision`."""
        inline = sum(1 for n in self.live if n.op in COMPUTED and n not in self.materialized)
        lines = [f"# {len(self.live)} live nodes: {len(self.graph.inputs)} inputs, "
                 f"{sum(1 for n in self.live if n.op == 'const')} constants, {len(self.materialized)} stored, "
                 f"{inline} computed inline where they are read, "
                 f"{sum(1 for n in self.live if n.op == 'view')} views"]
        targets = {e.target: conv for conv, e in self.epilogues.items()}
        for node in self.live:
            what = {"ew": node.attrs.get("fn"), "view": f"{node.attrs.get('view')}",
                    "reduce": f"reduce {node.attrs.get('kind')} over {node.attrs.get('axes')}"}.get(node.op, node.op)
            if node.op == "view" and node.attrs["view"] == "permute":
                what += f" {node.attrs['perm']}"
            args = f"({', '.join(a.name for a in node.args)})" if node.args else ""
            lines.append(f"{node.name} = {what}{args} {list(node.shape)} {node.dtype}: {self._decision(node, targets)}")
        return "\n".join(lines) + "\n"

    def _decision(self, node: Node, targets: dict) -> str:
        if node.op in ("input", "const"):
            return "graph input" if node.op == "input" else "constant"
        fused_into = self.attention_of(node)
        if fused_into is not None:
            return f"computed by the fused attention call of {fused_into.name}"
        if node in self.attentions:
            return f"stored ({self.attentions[node].describe()})"
        if node not in self.materialized:
            return "inline (computed where it is read)" if node.op != "view" else "view (index arithmetic only)"
        parts = [f"stored ({self.materialized[node]})"]
        if node in targets:
            parts.append(f"computed by the epilogue of {targets[node].name}")
        paired_with = next((d for d, e in self.conv_pairs.items() if e is node), None)
        if paired_with is not None:
            parts.append(f"called with {paired_with.name} (conv_pair, at {paired_with.name}'s place)")
        if node in self.epilogues:   # the convolution writes the target's buffer, it has none of its own
            e = self.epilogues[node]
            value = f"{node.op}{f' + {e.addend.name}' if e.addend is not None else ''}"
            parts.append(f"its epilogue writes {e.target.name} = "
                         + (f"{e.activation}({value})" if e.activation is not None else value))
        elif node in self.outputs:
            parts.append(f"written into output {self.outputs[node]}")
        elif node in self.orders:
            order = self.orders[node]
            parts.append("channels-last" if node.rank >= 3 and order == channels_last_order(node.rank)
                         else f"dims nested as {order}")
        if node in self.window_form:
            parts.append("window form")
        if stored_pad(node):
            parts.append("a fill, then the interior")
        return "; ".join(parts)


def stored_pad(node: Node) -> bool:
    """Constant padding that only grows is stored (a fill, then a plain copy of the interior):
    read inline, every element pays a bounds check whose clamped index g++ cannot vectorize,
    and pooling windows read each element several times."""
    return (node.op == "pad" and node.attrs["mode"] == "constant" and min(node.attrs["begins"]) >= 0
            and all(proves_at_least(o, i + b) for o, i, b in zip(node.shape, node.args[0].shape, node.attrs["begins"])))


def window_form(node: Node) -> bool:
    """Whether a reduce node is emitted in window form (a small window per output, along a long
    enough output row: loops.emit_reduce). Run-time dims do not count as long: the window form's
    loops are planned on static rows only."""
    if node.attrs["kind"] in ARG_REDUCE:
        return False   # the window form keeps one accumulator per output, not a (value, index) pair
    src, dims = node.args[0], [n for n in node.shape if n != 1 and isinstance(n, int)]
    window = math.prod(src.shape[a] for a in node.attrs["axes"])
    if not isinstance(window, int):
        return False  # a run-time window: the row form's loop takes any trip count
    return bool(dims) and window <= WINDOW_REDUCE_MAX and max(dims) >= WINDOW_REDUCE_MIN_ROW


def make_plan(graph: Graph) -> Plan:
    live = _live_nodes(graph)
    users = {}
    for node in live:
        for arg in node.args:
            users.setdefault(arg, []).append(node)
    # Fused attention: the call computes the scores, their softmax and the probabilities itself,
    # so none of them is stored (and no kernel computes them); it reads Q, K^T and V in place.
    attentions = find_attentions(live, users, {node for _, node in graph.outputs})
    read_in_place = {operand for a in attentions.values() for operand in (a.q, a.kt, a.v)}
    materialized = _materialized(graph, live, read_in_place)
    _store_attention_masks(attentions, materialized)
    outputs = {}
    for k, (_, node) in enumerate(graph.outputs):
        if node in materialized and node not in outputs:
            outputs[node] = k
    # An output that reshapes a stored node: that node is written straight into the output (a
    # reshape of row-major memory is the same bytes) instead of into scratch and copied (group_norm
    # alone at [64, 4096]: a 1 MiB copy, 11% of its time).
    for k, (_, node) in enumerate(graph.outputs):
        source = reshaped_source(node)
        if source is not None and source in materialized and source not in outputs:
            outputs[source] = k
    result = Plan(graph, live, users, materialized, outputs, orders={},
                  window_form={n for n in live if n.op == "reduce" and window_form(n)})
    result.attentions = attentions
    for attention in result.attentions.values():
        for node in attention.interior:
            materialized.pop(node, None)
    channels_last = _channels_last(result)
    _inline_pooling_pads(result, channels_last)
    for node in live:
        if node in materialized and node not in outputs:
            order = _permuted_matmul_output(node, users.get(node, []))
            if order is None and node in channels_last:
                order = channels_last_order(node.rank)
            if order is None:
                order = result.orders.get(node)   # _channels_last's read order of a reshape's source
            if order is not None:
                result.orders[node] = order
    # the stored projections whose heads a fused attention reads in place (_matmul_epilogue)
    attention_sources = {views.view_chain(operand)[1] for operand in read_in_place}
    _plan_epilogues(result, channels_last, attention_sources)
    result.conv_pairs = _conv_pairs(result)
    return result


def _store_attention_masks(attentions: dict, materialized: dict) -> None:
    """Stores the computed source of each score step's mask that the fused attention can read
    through strides (a broadcast over heads: stride 0) and that is no larger than the mask.
    Inline, the call needed a dense copy of the mask at the scores' full shape, one per attention:
    BERT's padding mask And(row mask, column mask) [b, 1, s, s] was copied to [b, heads, s, s] in
    every layer; stored, it is computed once and read by every layer's call."""
    for attention in attentions.values():
        for step in attention.steps:
            if step.mask is None:
                continue
            chain, source = views.view_chain(step.mask)
            if source.op not in COMPUTED or source in materialized or not proves_at_least(step.mask.numel, source.numel):
                continue
            if views.layout_through(chain, views.Layout(0, contiguous_strides(source.shape))) is not None:
                materialized[source] = f"read through strides by the fused attention of {step.mask!r}"


def reshaped_source(node):
    """The node a chain of reshape views starts from (node itself is one), else None."""
    if node.op != "view" or node.attrs["view"] != "reshape":
        return None
    while node.op == "view" and node.attrs["view"] == "reshape":
        node = node.args[0]
    return node


def _live_nodes(graph: Graph) -> list:
    live, stack = set(), [node for _, node in graph.outputs]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.args)
    return [n for n in graph.nodes if n in live]


def _cost(node, stored, memo):
    """Per-element cost of computing node inline, down to stored values."""
    if node.op not in COMPUTED + ("view",) or node in stored:
        return 0
    if node not in memo:
        own = EXPENSIVE_OPS.get(node.attrs.get("fn"), 1) if node.op != "view" else 0
        memo[node] = own + sum(_cost(a, stored, memo) for a in node.args)
    return memo[node]


def _materialized(graph: Graph, live: list, read_in_place: set) -> dict:
    """node -> why it gets memory. read_in_place: the fused attentions' Q, K^T and V, which the
    runtime reads from their source's memory whatever their strides (calls._gemm_operand)."""
    outputs = {node for _, node in graph.outputs}
    # reads[n]: how many times each element of n is read by the rest of the graph, looking
    # through views (a view is read-through; an expand multiplies reads).
    reads = {n: 0 for n in live}
    for node in outputs:
        reads[node] += 1
    must_store = {}
    copied = set()   # views under a GEMM operand that is copied: computed by the copy's loop
    for node in reversed(live):
        for arg in node.args:
            if node.op == "view":
                grows = node.attrs["view"] == "expand" and proves_less(arg.numel, node.numel)
                reads[arg] += max(reads[node], 2) if grows and reads[node] else reads[node]
                if node in copied and arg.op == "view":
                    copied.add(arg)
                if node.attrs["view"] == "reshape" and not views.only_unit_dims_change(arg.shape, node.shape) \
                        and not (node in copied and views.splits_dims(arg.shape, node.shape)):
                    must_store.setdefault(arg, RESHAPE_SOURCE)
            else:
                reads[arg] += reads_per_element(node)
            if node.op in DENSE_OPERANDS:
                if arg not in read_in_place and _copied_gemm_operand(node, arg):
                    copied.add(arg)
                else:
                    must_store.setdefault(arg, f"read from memory by {node.op}")
    chosen, cost_memo = {}, {}
    for node in live:
        if node.op in ALWAYS_MATERIALIZED:
            chosen[node] = f"always: {node.op}"
        elif stored_pad(node):
            chosen[node] = "constant pad that grows"
        elif node.op in COMPUTED:
            if node in outputs:
                chosen[node] = "graph output"
            elif node in must_store:
                chosen[node] = must_store[node]
            elif reads[node] > 1 and _cost(node, chosen, cost_memo) > RECOMPUTE_MAX_COST:
                chosen[node] = f"read {reads[node]} times per element, cost {_cost(node, chosen, cost_memo)} each"
    # A stored view (reshape/matmul operand) means its compute source is stored instead.
    for node, why in must_store.items():
        viewed = node
        while node.op == "view":
            node = node.args[0]
        if node.op in COMPUTED and node not in chosen:
            chosen[node] = why if node is viewed else f"viewed by {viewed!r}, which is {why}"
    return chosen


# Why a node that a reshape (of non-unit dims) reads is stored: _read_order lays such a node out.
RESHAPE_SOURCE = "feeds a reshape strides cannot express"


def _copied_gemm_operand(node: Node, arg: Node) -> bool:
    """Whether matmul `node` reads its operand `arg` through a dense copy (calls._gemm_operand)
    instead of from its compute source's memory: arg views a computed value whose row-major
    buffer would leave arg's matrix unpacked (views.packed_matrix; Q, K and V as heads of one
    [seq, 3 * heads * dim] projection). That source then need not be stored for the matmul: the
    copy computes it (a bias add fuses into the copy of each head) where it would have been stored.
    Not asked of a fused attention's operands: the runtime reads those in place, so their source
    is stored (a biased projection by its GEMM: _matmul_epilogue) and no copy kernel runs."""
    if node.op != "matmul":
        return False
    chain, arg = views.view_chain(arg)
    if not chain or arg.op not in COMPUTED:
        return False
    layout = views.layout_through(chain, views.Layout(0, contiguous_strides(arg.shape)))
    return layout is not None and not views.packed_matrix(chain[0].shape, layout.strides)


def _permuted_matmul_output(node: Node, users: list):
    """A batched matmul read only through one permute (attention heads back to [seq, heads *
    dim]) is written straight in the permuted order (sgemm's ldc and batch stride), so the
    permute is dense and the reshape after it needs no copy: the permute's order, or None."""
    if node.op != "matmul" or len(users) != 1 or node.rank < 3:
        return None
    (user,) = users
    if user.op != "view" or user.attrs["view"] != "permute" or user.attrs["perm"][-1] != node.rank - 1:
        return None
    return tuple(user.attrs["perm"])


def _channels_last(p: Plan) -> set:
    """Nodes stored channels-last (channels innermost): 1-D and 2-D convolutions, and the values
    stored between them (activations, residual sums, padded inputs and window reductions of
    pooling). oneDNN then reads and writes without reordering (measured 7-30% faster per ResNet-18
    convolution than NCHW with a copy), the runtime's own kernels (channels-last only) take them,
    and the loops between convolutions run over channels innermost instead of transposing. Graph
    outputs stay dense NCHW. Of the 3-D values beside 1-D convolutions ([n, c, l]) only those
    computed from one or feeding one are: a 3-D value is as often a transformer's [batch, seq,
    hidden]. (HuBERT's feature extractor: conv, a layer norm over the channels between transposes,
    GELU, conv; with the GELU stored NCL, its loop read the channels-last conv output across, 12.8
    ms.) On the way it sets the order of each stored source of a reshape (_read_order), which the
    nodes after it read through."""
    chosen = set()
    for node in p.live:
        if node in p.outputs or node not in p.materialized or node.rank < 3:
            continue
        if node.rank in (3, 4) and node.op == "conv" and (_feeds_conv(node, p.users) or
                                                         _computed_from(p, node, chosen, ("ew", "view")) or
                                                         _reads_channels_innermost(p, node, node.args[:1], chosen)):
            chosen.add(node)
        elif node.rank in (3, 4) and node.op in ("ew", "pad", "concat") and (
                _computed_from(p, node, chosen, ("ew", "gather")) or
                _reads_channels_innermost(p, node, node.args, chosen) and (node.rank == 4 or _feeds_conv(node, p.users))):
            chosen.add(node)
        elif (node.op == "reduce" and 1 not in node.attrs["axes"] and node in p.window_form
              and _computed_from(p, node, chosen, ("ew", "view"))):
            chosen.add(node)
        elif p.materialized[node] == RESHAPE_SOURCE:
            order = _read_order(p, node, chosen)   # decided here: the nodes after read it so
            if order is not None:
                p.orders[node] = order
    return chosen


def _inline_pooling_pads(p: Plan, channels_last: set) -> None:
    """Reads inline the stored constant pads (stored_pad) that only pooling windows read, when
    every reader is a window-form reduce stored channels-last and the pad leaves dims 0 and 1
    alone: the reduce's innermost loop then runs along the channels, so a tap's bounds check is
    the same for the whole loop (hoisted out of it) and the load stays a vector one. Stored, the
    pad cost a pass over the activation: ResNet-18's max pool read a 3.2 MB stem output into a
    114x114 copy (105 us at 2 threads) before its window reduce (68 us). Only over a cheap inline
    source (ResNet's ReLU): overlapping windows read each element several times."""
    for node in p.live:
        if node not in p.materialized or not stored_pad(node) or node in p.outputs or node not in channels_last:
            continue
        if any(node.attrs["begins"][d] != 0 or node.shape[d] != node.args[0].shape[d] for d in (0, 1)):
            continue
        if _cost(node.args[0], p.materialized, {}) > RECOMPUTE_MAX_COST:
            continue
        readers = p.users.get(node, [])
        windows = [r for r in readers if r.op == "view" and r.attrs["view"] == "window"]
        reduces = [u for w in windows for u in p.users.get(w, [])]
        if (readers and len(windows) == len(readers) and reduces
                and all(u.op == "reduce" and u in p.window_form and u in channels_last for u in reduces)):
            del p.materialized[node]


def _reads_channels_innermost(p: Plan, node: Node, args, chosen: set) -> bool:
    """Whether node's full-size arguments reach memory with channels (dim 1) innermost, through
    views of channels-last or row-major NHWC values (ConvNeXt's blocks: x.permute(0, 3, 1, 2)
    after Linear layers on [n, h, w, c], then a depthwise convolution and a residual sum in NCHW
    terms), and none with another dim innermost. Stored channels-last, such a node's loop reads
    and writes densely and a depthwise convolution takes the runtime's kernel; stored NCHW, the
    loop transposes and the convolution took oneDNN (ConvNeXt's first stage, one core: its
    depthwise 7x7 0.149 -> 0.108 ms; its residual sum, 0.08 ms, and the LayerNorm reading it
    transposed, 0.04 ms, became one 0.022 ms kernel)."""
    votes = {_channels_innermost(p, arg, chosen) for arg in args if tuple(arg.shape) == tuple(node.shape)}
    return True in votes and False not in votes


def _channels_innermost(p: Plan, value: Node, chosen: set):
    """For a 3-D or 4-D value read through views and inline elementwise ops: True when its dim 1 is
    innermost in memory, False when another dim is, None when unknown (a stored node read
    directly, a broadcast). Through inline ops: PoolFormer's group norms reshape a channels-last
    convolution to [N, G, C / G, H, W], normalize it inline and reshape it back, and their
    affine output (stored NCHW, read by a pooling and a convolution) was a transposing loop."""
    chain, source = views.view_chain(value)
    if not chain and (source in p.materialized or source.op in ("input", "const")):
        return None  # the node's own stored source: _computed_from decides on those
    strides, shape = views.read_strides(value, lambda n: _planned_strides(p, n, chosen)), value.shape
    if strides is None:
        return None
    dims = [d for d in range(len(strides)) if not (isinstance(shape[d], int) and shape[d] == 1)]
    if len(strides) not in (3, 4) or 1 not in dims or any(not isinstance(strides[d], int) or strides[d] == 0 for d in dims):
        return None
    return min(dims, key=lambda d: strides[d]) == 1


def _planned_strides(p: Plan, node: Node, chosen: set = frozenset(), inline: Node = None):
    """The strides node is stored with as planned (channels-last when in chosen, else its order,
    else row-major); None when it is computed where it is read (or is `inline`)."""
    if node is inline or (node.op in COMPUTED and node not in p.materialized):
        return None
    order = channels_last_order(node.rank) if node in chosen else p.orders.get(node)
    return strides_in_order(node.shape, order) if order is not None else contiguous_strides(node.shape)


def _read_order(p: Plan, node: Node, chosen: set):
    """The dims of a stored elementwise node nested as its computation reads its arguments
    (largest stride outermost), when that is not row-major: its loop then reads and writes along
    memory. A group norm with several groups over a channels-last convolution stores its
    normalized [N, G, C / G, H, W] value for the reshape back to [N, C, H, W]; row-major, that
    store transposed, and so did every read of it after the reshape."""
    if node.op != "ew":
        return None
    strides = views.read_strides(node, lambda n: _planned_strides(p, n, chosen, inline=node))
    if strides is None or not all(isinstance(st, int) for st in strides):
        return None
    order = tuple(sorted(range(node.rank), key=lambda d: -strides[d]))
    if order == tuple(range(node.rank)):
        return None
    # Only where every view of it stays strided: a source read through a permute (attention's
    # heads) then merged by the reshape would need its readers to gather (or a GEMM a copy).
    return order if _views_strided(p, node, views.Layout(0, strides_in_order(node.shape, order))) else None


def _views_strided(p: Plan, node: Node, layout) -> bool:
    """Whether every view reading node (and views of those) has a strided layout when node's is
    `layout`."""
    for user in p.users.get(node, []):
        if user.op == "view":
            viewed = views.view_layout(user, layout)
            if viewed is None or not _views_strided(p, user, viewed):
                return False
    return True


def _feeds_conv(node: Node, users: dict) -> bool:
    """Whether node's value reaches another convolution through elementwise ops, padding, views
    and reductions. A convolution that neither reads NHWC nor feeds a convolution stays NCHW:
    the outputs are NCHW, and a loop that reads NHWC to write NCHW transposes (slowly)."""
    stack, seen = list(users.get(node, [])), set()
    while stack:
        user = stack.pop()
        if user.op == "conv":
            return True
        if user not in seen and user.op in ("ew", "pad", "view", "reduce", "gather", "concat"):
            seen.add(user)
            stack.extend(users.get(user, []))
    return False


def _computed_from(p: Plan, node: Node, chosen: set, through: tuple) -> bool:
    """Whether node's value is computed from a node in chosen, looking through lazy nodes of
    the ops in `through`."""
    stack, seen = list(node.args), set()
    while stack:
        arg = stack.pop()
        if arg in chosen:
            return True
        if arg not in seen and arg.op in through and arg not in p.materialized:
            seen.add(arg)
            stack.extend(arg.args)
    return False


def _plan_epilogues(p: Plan, channels_last: set, attention_sources: set) -> None:
    """Conv epilogues, in the order kernels run: an addend must be written before the convolution
    that reads it (an input, or a stored node whose kernel comes earlier); matmul epilogues for the
    biased projections in attention_sources."""
    written = set(p.graph.inputs)
    for node in p.live:
        if node in written or node not in p.materialized:
            continue
        if node.op == "matmul":
            epilogue = _matmul_epilogue(p, node, attention_sources)
            if epilogue is not None:
                p.epilogues[node] = epilogue
                written.add(epilogue.target)
                continue
        if node.op == "conv":
            epilogue = _conv_epilogue(p, node, written, channels_last)
            if epilogue is not None:
                p.epilogues[node] = epilogue
                written.add(epilogue.target)
                continue
        written.add(node)


def _conv_pairs(p: Plan) -> dict:
    """{depthwise conv: 1x1 conv} where the 1x1 convolution (stride 1, unpadded, ungrouped, no
    addend in its epilogue) writes a stored value that only the depthwise convolution reads, as its
    input: the runtime gets both in one call (BladeRuntime::conv_pair). The 1x1 one is then called
    at the depthwise one's place, later than its own: its input is still there (a buffer is
    written once, and the call's use keeps it live) and nothing read its result in between."""
    writers = {e.target: conv for conv, e in p.epilogues.items() if conv.op == "conv"}
    pairs = {}
    for node in p.live:
        if node.op != "conv" or node.rank != 4 or node.attrs["groups"] < 2:
            continue
        weight = node.args[1]
        if not (node.attrs["groups"] == node.shape[1] == node.args[0].shape[1] and weight.shape[1] == 1):
            continue
        value = node.args[0]
        expand = writers.get(value, value if value.op == "conv" and value not in p.epilogues else None)
        if expand is None or expand.op != "conv" or expand.rank != 4 or expand in pairs.values():
            continue
        epilogue = p.epilogues.get(expand)
        if (epilogue is not None and epilogue.addend is not None) or expand.attrs["groups"] != 1:
            continue
        if (tuple(expand.args[1].shape[2:]) != (1, 1) or any(s != 1 for s in expand.attrs["strides"])
                or any(expand.attrs["pads"]) or any(d != 1 for d in expand.attrs["dilations"])):
            continue
        if p.users.get(value) != [node] or value in p.outputs or value not in p.materialized:
            continue
        pairs[node] = expand
    return pairs


def _matmul_epilogue(p: Plan, matmul: Node, attention_sources: set) -> Epilogue | None:
    """matmul + bias when that sum is matmul's only reader and a fused attention reads its heads
    in place (attention_sources: GPT-2's c_attn, BERT's query/key/value after
    frontend._concat_shared_input_linears), the bias a float32 constant the same on every row (a
    Linear's bias, read through the views that broadcast it): the GEMM writes it, into C filled
    with the bias first (calls.emit_matmul, sgemm's beta 1), so no copy kernel computes each head
    with its bias. Only there: a stored sum elsewhere (ViT's patch embedding) keeps its bias add in
    the next row loop, where the fill would be a parallel region of its own (ViT b1/b8 read 7-9%
    slower at 2 threads in two noisy runs with the epilogue on every stored sum). The floats are
    the unfused ones where the GEMM adds C after its whole k-sum (the panels kernel, oneDNN's
    packed inner product: round(sum + bias)); MKL's sgemm with beta 1 need not round the same, no
    more than eager's addmm, which is that call (it differs from mm + bias by up to 1 ulp of the
    result, e.g. 9.5e-7 at [128, 768] @ [768, 2304]). None when the epilogue does not apply."""
    if matmul in p.attentions or any(matmul is node for _, node in p.graph.outputs):
        return None
    readers = p.users.get(matmul, [])
    if len(readers) != 1:
        return None
    (target,) = readers
    if target not in attention_sources:
        return None
    if not (target.op == "ew" and target.attrs.get("fn") == "Add" and target in p.materialized
            and target.dtype == "float32" and tuple(target.shape) == tuple(matmul.shape)
            and p.orders.get(target) is None):
        return None
    # k >= 1: with an empty sum the GEMM would leave C = bias, where eager's 0 + bias turns -0 to 0
    if not proves_at_least(matmul.args[0].shape[-1], 1):
        return None
    others = [a for a in target.args if a is not matmul]
    if len(others) != 1 or tuple(others[0].shape) != tuple(target.shape) or not _row_constant(others[0]):
        return None
    return Epilogue(target, others[0], None)


def _row_constant(value: Node) -> bool:
    """Whether value is a float32 constant read through views that repeat it along every dim but
    the last (a bias row broadcast over the rows): filling C with it reads a few cache lines."""
    chain, source = views.view_chain(value)
    if source.op != "const" or source.dtype != "float32":
        return False
    layout = views.layout_through(chain, views.Layout(0, contiguous_strides(source.shape)))
    return layout is not None and all(n == 1 or st == 0 for n, st in zip(value.shape[:-1], layout.strides[:-1]))


def _conv_epilogue(p: Plan, conv: Node, written: set, channels_last: set) -> Epilogue | None:
    """act(conv), act(conv + addend) or conv + addend when conv is used only by that stored value
    (the nodes in between inline, each the only user of the one before; the addend written already,
    in the target's layout): the convolution computes it in its own output pass (a ResNet block's
    ReLU and residual sum, MobileNet's ReLU6) instead of another pass over the activation. None
    otherwise."""
    graph_outputs = {node for _, node in p.graph.outputs}

    def readers(node):
        """The nodes reading node; None when a graph output is node too (read outside)."""
        return None if node in graph_outputs else p.users.get(node, [])

    def only_user(node):
        used = readers(node)
        return used[0] if used is not None and len(used) == 1 else None

    def is_ew(node, fn):
        return node is not None and node.op == "ew" and node.attrs.get("fn") == fn and node.shape == conv.shape

    user, addend = only_user(conv), None
    if is_ew(user, "Add"):
        others = [a for a in user.args if a is not conv]
        if len(others) != 1 or others[0].shape != conv.shape or others[0].dtype != conv.dtype:
            return None
        addend = others[0]
        activation, target = (None, user) if user in p.materialized else _activation(p, user, readers, only_user, is_ew)
    else:
        activation, target = _activation(p, conv, readers, only_user, is_ew)
        if activation is None:
            return None
    if target not in p.materialized or target in written:
        return None
    if addend is not None:
        planned = (strides_in_order(conv.shape, channels_last_order(conv.rank)) if target in channels_last
                   else contiguous_strides(conv.shape))
        if not _stored_as(p, addend, written, planned):
            return None
    return Epilogue(target, addend, activation)


def _stored_as(p: Plan, value: Node, written: set, strides) -> bool:
    """Whether value lies in memory written already, with `strides` from offset 0: a stored node,
    or views of one (ResNet's first residual is the max pool's [N, C, H, W, 1, 1] window
    reduction reshaped). Not yet written: computed later (e.g. a downsample)."""
    chain, source = views.view_chain(value)
    if source not in written:
        return False
    layout = views.layout_through(chain, views.Layout(0, tuple(_planned_strides(p, source))))
    return layout is not None and layout.offset == 0 and same_strides(value.shape, layout.strides, strides)


def _activation(p: Plan, value: Node, readers, only_user, is_ew) -> tuple:
    """(Activation, the node computing it) for the activation applied to `value` by its only user
    (Relu; Max with a scalar constant bound, then possibly Min with one: a clamp, as ONNX Clip and
    torch's clamp/relu6/hardtanh lower), or (None, value). Only the first operand of Max/Min may be
    the value: Max(v, lo) keeps v on a NaN or a tie, Max(lo, v) keeps lo on a tie. A stored Max
    ends the clamp there (its value is read elsewhere). Or SiLU (_silu), or the exact GELU."""
    silu = _silu(p, value, readers, is_ew)
    if silu is not None:
        return Activation("silu"), silu
    user = only_user(value)
    if is_ew(user, "Relu"):
        return Activation("relu"), user
    if is_ew(user, "Gelu") and value.dtype == "float32":
        return Activation("gelu"), user
    bounds, node = {}, value
    for fn, side in (("Max", "lo"), ("Min", "hi")):
        user = only_user(node) if node is value or node not in p.materialized else None
        bound = _scalar_bound(user, node) if is_ew(user, fn) else None
        if bound is not None:
            bounds[side], node = bound, user
    return (Activation("clamp", **bounds), node) if bounds else (None, value)


def _silu(p: Plan, value: Node, readers, is_ew) -> Node | None:
    """The Mul computing SiLU of value when value is read by exactly Sigmoid(value) and
    Mul(value, that sigmoid), in either order (aten::silu's lowering, cluster/rules/elementwise.py),
    and by nothing else (no graph output), the sigmoid inline and read only by the Mul; else None."""
    value_readers = readers(value)
    if value_readers is None or len(value_readers) != 2 or value.dtype != "float32":
        return None
    sigmoid = next((r for r in value_readers if is_ew(r, "Sigmoid") and r.args[0] is value), None)
    mul = next((r for r in value_readers if is_ew(r, "Mul")), None)
    if sigmoid is None or mul is None or sigmoid in p.materialized or readers(sigmoid) != [mul]:
        return None
    return mul if len(mul.args) == 2 and set(mul.args) == {value, sigmoid} else None


def _scalar_bound(node: Node, value: Node) -> float | None:
    """The float32 scalar constant that node (Max/Min) compares its first operand `value` with
    (looking through the views that broadcast it)."""
    if node.args[0] is not value or value.dtype != "float32":
        return None
    bound = node.args[1]
    while bound.op == "view":
        bound = bound.args[0]
    if bound.op != "const" or bound.dtype != "float32" or bound.numel != 1 or "value" not in bound.attrs:
        return None
    value = float(bound.attrs["value"].reshape(()))
    return None if math.isnan(value) else value   # the runtime's clamp takes no NaN bound
