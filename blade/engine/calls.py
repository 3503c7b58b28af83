"""Call kernels: a matmul or a convolution is one call into the runtime (cpp/blade_abi.h).

GEMM goes through rt->sgemm (MKL, packed weights) with the operands' strides folded into its
transpose flags, leading dimensions and batch strides; an operand no stride pattern fits is copied
to dense scratch first. A convolution goes through rt->conv (oneDNN), reading and writing NCHW or
NHWC, with the plan's epilogue (a residual sum, a ReLU or clamp) applied by the runtime.
"""
from __future__ import annotations

from .attention import SCORE_STEP_KINDS
from .buffers import Strided, channels_last_order, memory_order, permuted, same_strides, strides_in_order, unpermuted
from .ir import Node
from .lines import DECLS, for_loop, indent
from .optable import literal
from .symbolic import Expr, Var, add, constant, maximum, mul, proves_at_least
from . import views
from .views import Layout, contiguous_strides, packed_matrix

CHANNELS_LAST_MIN_INPUT_CHANNELS = 8   # fewer (an RGB image): a channels-last conv still reads NCHW


def _may_exceed_one(n) -> bool:
    """Whether a GEMM dim can be larger than 1: a run-time dim (an Expr) counts as one that can,
    so its operand's leading dimension is its row stride, which is a valid one at size 1 too."""
    return isinstance(n, Expr) or n > 1


def _at_least_one(n):
    """max(n, 1) of a dim that may be run-time (a one-row operand's leading dimension: the
    decode step's single query row over a run-time key length)."""
    return max(n, 1) if isinstance(n, int) else maximum(n, 1)


def _gemm_operand(em, node: Node, packed_by_callee: bool = False):
    """(Strided, trans, ld) for a matmul operand. A computed operand whose matrix is not packed
    (views.packed_matrix: an attention head's slice of a projection) is copied to dense scratch
    first, as is one no stride pattern fits; a constant (a weight) is read where it is.
    packed_by_callee (the fused attention's Q, K^T and V): the runtime packs K^T and V per head
    itself and reads Q row by row, so a head's slice of a stored projection is read where it is;
    its dense copy was a kernel (and a parallel region) of its own that saved nothing (T5 b8 at 2
    threads: 0.16 ms a layer, scaling 1.2x from 1 thread)."""
    s = em.memory.strided_of(node)
    if s is not None and (packed_by_callee or _source(node).op == "const" or packed_matrix(s.shape, s.layout.strides)):
        fit = _fit(s)
        if fit is not None:
            return fit
    # A transposed operand (K^T) is copied untransposed, and a reshape's source in its own shape
    # (a patch GEMM's [N, O1, O2, C, K1, K2] patches): the copy's loops then run along the
    # source's rows without div/mod, and the view of the dense copy is a stride pattern again.
    reshaped = node.op == "view" and node.attrs["view"] == "reshape"
    viewed = _swaps_matrix_dims(node) or reshaped
    src = node.args[0] if viewed else node
    layout = views.view_layout(node, Strided.dense(None, src.shape).layout) if viewed else None
    if viewed and layout is None:   # the view of a dense copy is no stride pattern: copy the view
        src, viewed, reshaped = node, False, False
    copy = em.memory.new_scratch(src.dtype, src.shape)
    _emit_copy(em, f"contiguous copy of {src!r} for GEMM", copy, src, along_memory=reshaped)
    if viewed:
        copy = Strided(copy.buf, node.shape, layout)
    return _fit(copy)


def _emit_copy(em, comment, copy: Strided, src: Node, along_memory: bool):
    """copy = src. along_memory (a reshape's source, as a patch GEMM's patches): the loops run along
    src's memory when src is a reordering view of it (the image is read row by row, 138 -> 60 us for
    ViT's [196, 768] patches) as long as the innermost dim stays the same, so each row written is
    still one contiguous run. Otherwise in the copy's own order: one head's slice of a projection
    ([b, s, h, d] memory read as [b, h, s, d], for an unfused attention's GEMMs) then has the loop
    rows of the kernels around it, and fuses with them where along memory each copy was a kernel
    of its own; the rows read and written are head_dim floats either way."""
    source = em.memory.strided_of(src)
    order = tuple(range(src.rank))
    if along_memory and source is not None and all(isinstance(n, int) for n in (*source.shape, *source.layout.strides)):
        order = memory_order(source)
    if order == tuple(range(src.rank)) or order[-1] != src.rank - 1:
        em.kernels.emit_loop(comment, copy, lambda scope, idx: em.values.value(src, idx, scope))
        return
    dest = permuted(copy, order)
    loop_dims = [d for d, n in enumerate(dest.shape) if n != 1]
    em.kernels.emit_loop(comment, dest, lambda scope, idx: em.values.value(src, unpermuted(idx, order), scope),
                         rows=loop_dims[-1] + (len(loop_dims) == 1) if loop_dims else len(dest.shape))


def _fit(s: Strided):
    """(s, trans, ld) when s's matrix dims fit a GEMM operand's stride pattern, else None."""
    rows, cols = s.shape[-2:]
    rs, cs = s.layout.strides[-2:]
    # proves_at_least: an order run-time sizes leave open fits no pattern (the operand is copied to
    # dense scratch rather than passed with a leading dimension that may be too small)
    if (cols == 1 or cs == 1) and (rows == 1 or proves_at_least(rs, cols)):
        return s, 0, rs if _may_exceed_one(rows) else _at_least_one(cols)
    if (rows == 1 or rs == 1) and (cols == 1 or proves_at_least(cs, rows)):
        return s, 1, cs if _may_exceed_one(cols) else _at_least_one(rows)
    return None


def _source(node: Node) -> Node:
    """The node a chain of views looks at."""
    while node.op == "view":
        node = node.args[0]
    return node


def _swaps_matrix_dims(node: Node) -> bool:
    perm = node.attrs.get("perm") if node.op == "view" and node.attrs["view"] == "permute" else None
    return perm is not None and list(perm) == [*range(node.rank - 2), node.rank - 1, node.rank - 2]


def emit_matmul(em, node, dest):
    a_node, b_node = node.args
    m, n = node.shape[-2:]
    k = a_node.shape[-1]
    if node.numel == 0:
        return
    if k == 0:  # an empty sum (no bias epilogue then: plan._matmul_epilogue)
        em.kernels.emit_loop(f"{node!r} = matmul with k == 0", dest, lambda scope, idx: literal(0, node.dtype))
        return
    (a, ta, lda), (b, tb, ldb) = _gemm_operand(em, a_node), _gemm_operand(em, b_node)
    # C rows may be strided (a permuted output, plan._permuted_matmul_output); columns are dense.
    assert dest.layout.strides[-1] == 1 or n == 1, "matmul output columns must be dense"
    ldc = dest.layout.strides[-2] if _may_exceed_one(m) else n
    # The plan's bias epilogue (plan._matmul_epilogue): C starts as the bias row, the GEMM adds to
    # it. The fill is a loop kernel over C's rows: it joins the row loop of the kernel before (the
    # LayerNorm that wrote A), also across the unit dims of a [1, s, d] LayerNorm over [s, 3d] rows.
    epilogue = em.plan.epilogues.get(node)
    if epilogue is not None:
        em.kernels.emit_loop(f"{epilogue.target!r} = {epilogue.addend!r}, which the GEMM of {node!r} adds to", dest,
                             lambda scope, idx: em.values.value(epilogue.addend, idx, scope), under_unit_rows=True)
    beta = "1.0f" if epilogue is not None else "0.0f"
    described = f" + {epilogue.addend!r}" if epilogue is not None else ""
    kernel = em.kernels.begin_call(f"{node!r} = matmul {a_node!r} @ {b_node!r}{described}")
    names = [kernel.use(a.buf), kernel.use(b.buf), kernel.use(dest.buf, write=True)]
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
    loop_vars = [Var.loop(em.names.fresh("b"), size) for size, _ in merged]
    ptrs = [f"{name} + {add(o.layout.offset, *(st[i] * v for v, (_, st) in zip(loop_vars, merged)))}"
            for i, (name, o) in enumerate(zip(names, operands))]
    call = [f"rt->sgemm({sgemm_batch}, {m}, {n}, {k}, {literal(node.attrs['alpha'], 'float32')}, "
            f"{ptrs[0]}, {lda}, {sgemm_strides[0]}, {ta}, {ptrs[1]}, {ldb}, {sgemm_strides[1]}, {tb}, "
            f"{beta}, {ptrs[2]}, {ldc}, {sgemm_strides[2]});"]
    for var, (size, _) in reversed(list(zip(loop_vars, merged))):
        call = for_loop(var, 0, size, call)
    em.kernels.end_call(kernel, ["{", *indent([DECLS] + call), "}"])
    weight = _weight_gemm(b, n, k, ldb, tb, node.attrs["alpha"], m, ta, lda, ldc, sgemm_batch, sgemm_strides, merged)
    if weight is not None:
        em.weight_gemms.append(weight)


def _weight_gemm(b: Strided, n, k, ldb, tb, alpha, m, ta, lda, ldc, batch, strides, loops):
    """The GEMM's BladeWeightGemm fields (constant, offset, n, k, ldb, trans_b, alpha) when its B is a
    run-time constant the runtime's sgemm sees as one GEMM's constant B on every call (cpp/gemm_choice.cpp
    gemm: one batch, or a weight shared by row-stacked batches, which it folds into one), with sizes that
    never change; else None. Listed by blade_engine_weight_gemms, so the runtime can pack it at load."""
    if b.buf.kind != "const" or any(st[1] != 0 for _, st in loops):
        return None
    fields = [constant(v) for v in (b.layout.offset, n, k, ldb)]
    if None in fields:
        return None
    folds = strides[1] == 0 and ta == 0 and strides[0] == mul(m, lda) and strides[2] == mul(m, ldc)
    if batch != 1 and not folds:
        return None
    return (b.buf.index, *fields, tb, float(alpha))


def _dense_operand(em, node: Node) -> Strided:
    """node as dense row-major memory (copied to scratch if needed)."""
    s = em.memory.strided_of(node)
    if s is None or s.layout.strides != contiguous_strides(node.shape):
        s = em.memory.new_scratch(node.dtype, node.shape)
        em.kernels.emit_loop(f"contiguous copy of {node!r}", s, lambda scope, idx: em.values.value(node, idx, scope))
    return s


def _conv_input(em, node: Node, channels_last: bool) -> tuple:
    """(Strided, is it channels-last) for a convolution's input: its memory when dense NCHW or
    NHWC, else a copy (NHWC when the convolution writes NHWC and has enough channels for oneDNN
    to prefer it; a 3-channel image stays NCHW)."""
    s = em.memory.strided_of(node)
    if s is not None:
        if same_strides(node.shape, s.layout.strides, contiguous_strides(node.shape)):
            return s, False
        if node.rank in (3, 4) and same_strides(node.shape, s.layout.strides,
                                                 strides_in_order(node.shape, channels_last_order(node.rank))):
            return s, True
    nhwc = channels_last and node.shape[1] >= CHANNELS_LAST_MIN_INPUT_CHANNELS
    order = channels_last_order(node.rank) if nhwc else tuple(range(node.rank))
    copy = Strided(em.memory.new_scratch(node.dtype, node.shape).buf, node.shape,
                   Layout(0, strides_in_order(node.shape, order)))
    em.kernels.emit_loop(f"{'channels-last' if nhwc else 'contiguous'} copy of {node!r} for conv", copy,
                         lambda scope, idx: em.values.value(node, idx, scope))
    return copy, nhwc


def _conv_operands(em, node, dest) -> tuple:
    """(input, is it channels-last, weight and bias, is the output channels-last) of conv `node`
    writing dest; may emit copy kernels, so called before the conv's call kernel begins."""
    out_nhwc = node.rank in (3, 4) and not same_strides(node.shape, dest.layout.strides, contiguous_strides(node.shape))
    x, in_nhwc = _conv_input(em, node.args[0], out_nhwc)
    return x, in_nhwc, [_dense_operand(em, a) for a in node.args[1:]], out_nhwc


def _conv_call(em, kernel, node, dest, operands, suffix: str = "") -> tuple:
    """(declarations, argument list) of rt->conv for dest = conv(node's args) with the plan's
    epilogue; the declarations' names end in suffix (two calls in one block)."""
    x, in_nhwc, params, out_nhwc = operands
    epilogue = em.plan.epilogues.get(node)
    addend = epilogue and epilogue.addend
    activation = epilogue and epilogue.activation
    ptrs = [f"{kernel.use(o.buf)} + {o.layout.offset}" for o in (x, *params)]
    # the plan checked the addend (a stored node or a view of one) starts at its buffer's offset 0
    addend_ptr = f"{kernel.use(em.memory.strided_of(addend).buf)} + 0" if addend is not None else "nullptr"
    bias = ptrs[2] if len(ptrs) > 2 else "nullptr"
    arrays = {"xs": node.args[0].shape, "ws": node.args[1].shape, "st": node.attrs["strides"],
              "pd": node.attrs["pads"], "dl": node.attrs["dilations"]}
    decls = [f"const int64_t {name}{suffix}[] = {{{', '.join(map(str, values))}}};" for name, values in arrays.items()]
    if activation:
        decls.append(f"const BladeActivation act{suffix} = {{BLADE_ACTIVATION_{activation.kind.upper()}, "
                     f"{literal(activation.lo, 'float32')}, {literal(activation.hi, 'float32')}}};")
    layout = " | ".join(["BLADE_CONV_INPUT_CHANNELS_LAST"] * in_nhwc + ["BLADE_CONV_OUTPUT_CHANNELS_LAST"] * out_nhwc)
    args = (f"{node.rank - 2}, xs{suffix}, {ptrs[0]}, ws{suffix}, {ptrs[1]}, {bias}, st{suffix}, pd{suffix}, "
            f"dl{suffix}, {node.attrs['groups']}, {kernel.use(dest.buf, write=True)} + {dest.layout.offset}, "
            f"{layout or 0}, {addend_ptr}, {f'&act{suffix}' if activation else 'nullptr'}")
    return decls, args


def _describe_conv(em, node, out_nhwc: bool) -> str:
    epilogue = em.plan.epilogues.get(node)
    addend = epilogue and epilogue.addend
    activation = epilogue and epilogue.activation
    described = (f" + {addend!r}" if addend is not None else "") + (f" then {activation}" if activation else "")
    return (f"{node!r} = conv {' * '.join(map(repr, node.args))} stride {node.attrs['strides']} "
            f"pads {node.attrs['pads']} dilation {node.attrs['dilations']} groups {node.attrs['groups']}{described}"
            + (" (channels-last)" if out_nhwc else ""))


def emit_conv(em, node, dest):
    """dest = conv(node's args) [+ addend] [then an activation], with the plan's epilogue (the runtime's)."""
    if node.numel == 0:
        return
    operands = _conv_operands(em, node, dest)
    kernel = em.kernels.begin_call(_describe_conv(em, node, operands[-1]))
    decls, args = _conv_call(em, kernel, node, dest, operands)
    em.kernels.end_call(kernel, ["{", *indent([DECLS] + decls + [f"rt->conv({args});"]), "}"])


def emit_conv_pair(em, node, dest):
    """The plan's pair (plan._conv_pairs) in one rt->conv_pair call: the 1x1 convolution into its
    stored value, then node, the depthwise convolution reading it, into dest."""
    first = em.plan.conv_pairs[node]
    first_dest = kernel_destination(em, first)
    if node.numel == 0 or first.numel == 0:   # nothing to compute together (emit_conv skips the empty one)
        emit_conv(em, first, first_dest)
        emit_conv(em, node, dest)
        return
    first_operands, operands = _conv_operands(em, first, first_dest), _conv_operands(em, node, dest)
    assert operands[0].buf is first_dest.buf, "the depthwise convolution reads the stored value in place"
    kernel = em.kernels.begin_call(f"{_describe_conv(em, first, first_operands[-1])}, "
                                   f"then {_describe_conv(em, node, operands[-1])}")
    first_decls, first_args = _conv_call(em, kernel, first, first_dest, first_operands, "0")
    decls, args = _conv_call(em, kernel, node, dest, operands, "1")
    em.kernels.end_call(kernel, ["{", *indent([DECLS] + first_decls + decls + [
        f"const BladeConv first = {{{first_args}}};", f"const BladeConv second = {{{args}}};",
        "rt->conv_pair(&first, &second);"]), "}"])


def kernel_destination(em, node):
    """Where node's kernel writes: its epilogue's target (the node has no buffer of its own), else
    node's own memory."""
    epilogue = em.plan.epilogues.get(node)
    stored = epilogue.target if epilogue is not None else node
    return em.memory.destination(stored, em.plan.orders.get(stored))


def _batch_strides(strides, rank: int) -> list:
    """An attention operand's (outer, inner) batch strides: its dims before the last two, padded
    in front with 0 to two (a rank-3 matmul has one batch dim, a rank-2 one none)."""
    return [0] * (2 - (rank - 2)) + list(strides[:rank - 2])


def emit_attention(em, node, dest):
    """dest = the plan's fused attention ending in matmul `node` (attention.py): one
    rt->attention call in place of Q.K^T, the score steps, the softmax and P.V."""
    if node.numel == 0:
        return
    attention = em.plan.attentions[node]
    operands = [_gemm_operand(em, n, packed_by_callee=True) for n in (attention.q, attention.kt, attention.v)]
    masks = [_mask_operand(em, s.mask) if s.mask is not None else None for s in attention.steps]
    assert dest.layout.strides[-1] == 1 or node.shape[-1] == 1, "attention output columns must be dense"
    m, dv = node.shape[-2:]
    d, n = attention.kt.shape[-2:]
    batch = [1] * (2 - (node.rank - 2)) + list(node.shape[:-2])
    kernel = em.kernels.begin_call(f"{node!r} = {attention.describe()}")
    fields = [f"a.outer = {batch[0]};", f"a.inner = {batch[1]};", f"a.m = {m};", f"a.n = {n};", f"a.d = {d};",
              f"a.dv = {dv};"]
    for name, ld_name, (s, trans, ld) in zip(("q", "kt", "v"), ("ldq", "ldk", "ldv"), operands):
        strides = _batch_strides(s.layout.strides, len(s.shape))
        fields += [f"a.{name} = {kernel.use(s.buf)} + {s.layout.offset};", f"a.{ld_name} = {ld};",
                   f"a.{name[0]}_strides[0] = {strides[0]};", f"a.{name[0]}_strides[1] = {strides[1]};",
                   f"a.trans_{name[0]} = {trans};"]
    out_strides = _batch_strides(dest.layout.strides, len(dest.shape))
    ldo = dest.layout.strides[-2] if _may_exceed_one(m) else dv
    fields += [f"a.out = {kernel.use(dest.buf, write=True)} + {dest.layout.offset};", f"a.ldo = {ldo};",
               f"a.out_strides[0] = {out_strides[0]};", f"a.out_strides[1] = {out_strides[1]};",
               f"a.step_count = {len(attention.steps)};"]
    for k, (step, mask) in enumerate(zip(attention.steps, masks)):
        fields += [f"a.steps[{k}].kind = {SCORE_STEP_KINDS[step.kind]};",
                   f"a.steps[{k}].value = {literal(step.value, 'float32')};"]
        if mask is not None:
            strides = [0] * (4 - len(mask.shape)) + list(mask.layout.strides)
            fields.append(f"a.steps[{k}].mask = {kernel.use(mask.buf)} + {mask.layout.offset};")
            fields += [f"a.steps[{k}].strides[{j}] = {st};" for j, st in enumerate(strides)]
    if attention.zero_rows_max is not None:
        fields += ["a.zero_rows = 1;", f"a.zero_rows_max = {literal(attention.zero_rows_max, 'float32')};"]
    em.kernels.end_call(kernel, ["{", *indent([DECLS, "BladeAttention a = {};", *fields, "rt->attention(&a);"]), "}"])


def _mask_operand(em, node: Node) -> Strided:
    """A score step's mask where it lies in memory (a stored value or views of one, broadcast dims
    stride 0), or a dense copy when no stride pattern reaches it."""
    s = em.memory.strided_of(node)
    return s if s is not None else _dense_operand(em, node)
