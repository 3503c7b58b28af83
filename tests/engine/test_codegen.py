"""Properties of the generated code itself: fusion, CSE, GEMM operand folding, arena reuse, tables."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from onnx_cases import check_case, compile_cases, graph_case, op_case, run_case
from test_ops import CASES
from blade.engine import buffers, codegen, compiler, ir, optable, plan
from blade.engine.compiler import compile_onnx


def source_of(case):
    return codegen.generate(plan.make_plan(ir.lower_onnx(case.model)))


def kernels(program):
    return re.findall(r"^  // kernel \d+: (.*)$", program.source, re.MULTILINE)


def node(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def test_elementwise_chain_is_one_loop_nest_with_shared_subexpressions():
    case = graph_case("silu", [node("Sigmoid", ["x"], ["s"]), node("Mul", ["x", "s"], ["m"]),
                               node("Add", ["m", "b"], ["y"])], {"x": ((8, 16), "float32")}, ["y"],
                      {"b": np.ones((1, 16), np.float32)})
    program = source_of(case)
    assert len(kernels(program)) == 1
    body = program.source.split("blade_engine_run")[1]
    assert body.count("blade_sigmoidf(") == 1
    assert program.source.count("in0[") == 1, "x must be loaded once per element (CSE)"
    assert program.scratch_bytes == 0


def test_an_output_reshaping_a_stored_node_is_written_directly():
    (case,) = [c for c in CASES if c.name == "outputs-reshape-a-stored-node"]
    program = source_of(case)
    copies = re.findall(r"output (\d+) = copy of", "; ".join(kernels(program)))
    assert copies == ["1", "2"]
    assert program.scratch_bytes == 0, "the stored node is output 0's memory"


def test_softmax_and_layernorm_are_one_row_loop_with_rows_on_the_stack():
    softmax = source_of(op_case("Softmax", [(4, 33)], axis=-1))
    norm = source_of(op_case("LayerNormalization", [(2, 5, 16), (16,), (16,)], axis=-1))
    for program in (softmax, norm):
        assert len(kernels(program)) == 1 and program.source.count("parallel_for(") <= 1
        assert program.scratch_bytes == 0, "row-local intermediates live on the stack, not in the arena"
    assert "omp simd reduction(+:" in norm.source
    assert re.search(r"alignas\(64\) float s\d+\[33\];  // one row, per thread", softmax.source)


def test_cross_row_read_is_not_fused_into_the_row_loop():
    (case,) = [c for c in CASES if c.name == "cross-row-read"]
    program = source_of(case)
    assert len(kernels(program)) == 2 and program.scratch_bytes > 0


def test_exact_gelu_is_the_prelude_function():
    assert "blade_geluf(" in source_of(op_case("Gelu", [(3, 17)])).source.split("blade_engine_run")[1]


def test_small_constant_powers_are_multiplies():
    body = source_of(op_case("Pow", [(3, 17)], np.asarray(3.0, np.float32))).source.split("blade_engine_run")[1]
    assert "std::pow" not in body


def test_transposed_operand_folds_into_gemm_flags_and_weight_broadcast_has_stride_zero():
    case = graph_case("mm", [node("Transpose", ["b"], ["bt"], perm=[1, 0]), node("MatMul", ["a", "bt"], ["y"])],
                      {"a": ((2, 4, 5), "float32"), "b": ((3, 5), "float32")}, ["y"])
    program = source_of(case)
    assert "contiguous copy" not in program.source
    (call,) = re.findall(r"rt->sgemm\((.*)\);", program.source)
    args = [a.strip() for a in call.split(",")]
    assert args[0] == "2" and args[11] == "0" and args[12] == "1"   # batch, stride_b == 0, trans_b


def test_biased_attention_heads_are_read_in_place_from_a_projection_whose_gemm_adds_the_bias():
    (case,) = [c for c in CASES if c.name == "attention-heads-of-a-fused-projection"]
    planned = plan.make_plan(ir.lower_onnx(case.model))
    text = planned.describe()
    (bias_add,) = [line for line in text.splitlines() if " = Add(" in line]
    (projection,) = [line for line in text.splitlines() if " = matmul(x, w)" in line]
    assert bias_add.endswith(f"computed by the epilogue of {projection.split()[0]}"), bias_add
    assert text.count("reduce max") == 1, "softmax and the fully-masked-row check share one row max"
    program = source_of(case)
    listed = kernels(program)
    # C = the bias row, the projection's GEMM adding to it, then the fused attention reading q, k
    # and v where the GEMM wrote them: no copy kernel
    assert not any("contiguous copy" in k for k in listed), listed
    assert len(listed) == 3 and "which the GEMM of" in listed[0] and "fused attention" in listed[2], listed
    (call,) = re.findall(r"rt->sgemm\((.*)\);", program.source)
    assert call.split(", ")[13] == "1.0f", "beta 1: the GEMM adds its product to the bias"
    fields = dict(re.findall(r"a\.(\w+(?:\[\d\])?(?:\.\w+)?) = ([^;]+);", program.source))
    # q @ k^T with k^T read as the projection's rows (trans_k), 2 heads, rows 24 floats apart
    assert (fields["inner"], fields["ldq"], fields["ldk"], fields["trans_k"], fields["ldv"]) == ("2", "24", "24", "1", "24")


def test_a_bias_add_read_inline_stays_out_of_the_gemm():
    """Where matmul + bias is not stored (its reader computes it inline: bias + relu), the GEMM
    keeps beta 0 and no fill kernel runs: the add costs nothing there."""
    case = graph_case("linear-relu", [node("MatMul", ["x", "w"], ["p"]), node("Add", ["p", "b"], ["s"]),
                                      node("Relu", ["s"], ["y"])],
                      {"x": ((6, 8), "float32")}, ["y"],
                      {"w": np.ones((8, 5), np.float32), "b": np.arange(5, dtype=np.float32)})
    program = source_of(case)
    (call,) = re.findall(r"rt->sgemm\((.*)\);", program.source)
    assert call.split(", ")[13] == "0.0f" and len(kernels(program)) == 2


def test_unbiased_attention_heads_are_read_in_place_by_the_fused_attention():
    (case,) = [c for c in CASES if c.name == "attention-heads-of-an-unbiased-projection"]
    program = source_of(case)
    listed = kernels(program)
    # the projection, then the fused attention reading q, k and v where the projection wrote them
    # (the runtime packs K^T and V per head itself): no copy kernel in between
    assert not any("contiguous copy" in k for k in listed), listed
    assert "fused attention" in listed[-1] and len(listed) == 2, listed
    fields = dict(re.findall(r"a\.(\w+(?:\[\d\])?(?:\.\w+)?) = ([^;]+);", program.source))
    # each head's rows are the projection's rows: 24 floats (3 x 2 heads x 4) apart
    assert (fields["ldq"], fields["ldk"], fields["trans_k"], fields["ldv"]) == ("24", "24", "1", "24")


def test_an_attention_mask_broadcast_over_heads_is_stored_once_and_read_with_head_stride_zero():
    (case,) = [c for c in CASES if c.name == "attention-masks-broadcast-over-heads"]
    planned = plan.make_plan(ir.lower_onnx(case.model))
    (mask,) = [line for line in planned.describe().splitlines() if " = And(" in line]
    assert "read through strides by the fused attention" in mask, mask
    program = source_of(case)
    listed = kernels(program)
    assert not any("contiguous copy" in k for k in listed), listed
    assert sum("fused attention" in k for k in listed) == 2, listed
    # both calls read the one [1, 1, 6, 6] mask: batch and head strides 0, rows 6 apart
    steps = re.findall(r"a\.steps\[1\]\.strides\[(\d)\] = (\d+);", program.source)
    assert steps == [("0", "0"), ("1", "0"), ("2", "6"), ("3", "1")] * 2, steps


def test_a_patch_embedding_is_one_gemm_and_other_convolutions_stay_convolutions():
    programs = {c.name: source_of(c) for c in CASES if c.name.startswith("Conv-")}
    for name in ("Conv-patches-as-gemm", "Conv-1d-patches-as-gemm", "Conv-3d-patches-as-gemm"):
        assert "rt->conv(" not in programs[name].source and programs[name].source.count("rt->sgemm(") == 1
    # C * kernel under PATCH_GEMM_MIN_REDUCTION; overlapping windows
    for name in ("Conv-1d", "Conv-2x3x9x8-4x3x3x3-4-float32"):
        assert "rt->conv(" in programs[name].source


def test_arena_reuses_dead_buffers():
    chain = [node("Exp", ["x"], ["e1"]), node("ReduceSum", ["e1"], ["s1"]),
             node("Sub", ["x", "s1"], ["d1"]), node("Exp", ["d1"], ["e2"]), node("ReduceSum", ["e2"], ["s2"]),
             node("Sub", ["x", "s2"], ["d2"]), node("Exp", ["d2"], ["e3"]), node("ReduceSum", ["e3"], ["y"])]
    case = graph_case("chain", chain, {"x": ((64, 64), "float32")}, ["y"])
    program = source_of(case)
    assert 0 < program.scratch_bytes < 2 * 64 * 64 * 4


def test_plan_arena_keeps_overlapping_lifetimes_apart():
    bufs = [buffers.Buffer("scratch", i, "float32", n) for i, n in enumerate([100, 50, 100])]
    for buf, (first, last) in zip(bufs, [(0, 1), (1, 2), (2, 3)]):
        buf.first, buf.last = first, last
    size = buffers.plan_arena(bufs)
    def span(b):
        return range(b.offset, b.offset + b.nbytes)
    for a, b in [(bufs[0], bufs[1]), (bufs[1], bufs[2])]:
        assert not set(span(a)) & set(span(b))
    assert bufs[0].offset == bufs[2].offset and all(b.offset % 64 == 0 for b in bufs)
    assert size == 448 + 200


def test_generated_code_is_reentrant_and_self_contained():
    prelude = (compiler.include_dir() / "engine_prelude.h").read_text()
    for src in (source_of(CASES[0]).source, prelude):
        assert "static " not in src.replace("static_cast", "")
        assert set(re.findall(r'#include [<"](.*)[>"]', src)) <= {
            "atomic", "cmath", "cstdint", "limits", "blade_abi.h", "engine_prelude.h",
            "chrono"}  # chrono: only with -DBLADE_PROFILE


def test_the_package_ships_every_header_engines_include():
    """setup.py copies the headers into blade/include for installs (no cpp/ there)."""
    tree = ast.parse((Path(compiler.__file__).parents[2] / "setup.py").read_text())
    (shipped,) = [ast.literal_eval(n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "ENGINE_HEADERS"]
    assert [Path(h).name for h in shipped] == list(compiler.ENGINE_HEADERS)


@pytest.mark.parametrize("value", [0.1, -1e-30, 3.4e38, 1e-45, 2.0 / 3.0, -0.0])
def test_float_literals_are_exact(value):
    text = optable.literal(np.float32(value), "float32")
    assert np.float32(float(text.rstrip("f"))) == np.float32(value)
    assert np.isnan(float("nan")) and "quiet_NaN" in optable.literal(np.nan, "float32")


def test_unsupported_op_is_named():
    case = op_case("Relu", [(2,)], name="r")
    case.model.graph.node[0].op_type = "HardSwish"
    with pytest.raises(ir.UnsupportedOnnxOp, match="HardSwish"):
        ir.lower_onnx(case.model)


def test_every_onnx_rule_has_a_test_case():
    tested = {n.op_type for case in CASES for n in case.model.graph.node}
    assert set(ir.ONNX_RULES) - tested == set()


def test_isa_levels():
    assert compiler.resolve_isa("x86-64-v3") == "x86-64-v3"
    assert compiler.resolve_isa("native") in [level for level, _ in compiler.ISA_LEVELS]
    flags = open("/proc/cpuinfo").read()
    if all(f in flags for f in ("avx512f", "avx512bw", "avx512vl")):
        assert compiler.native_isa() == "x86-64-v4"


def test_big_constants_are_passed_at_run_time_small_ones_inlined():
    case = op_case("Add", [(100,)], np.arange(100, dtype=np.float32), name="big")
    assert [c.name for c in source_of(case).constants] == ["k0"]
    small = op_case("Add", [(8,)], np.arange(8, dtype=np.float32), name="small")
    program = source_of(small)
    assert program.constants == [] and "constexpr float k" in program.source


def test_the_plan_is_its_own_stage_and_reads_as_text():
    (case,) = [c for c in CASES if c.name == "conv-residual-block-channels-last"]
    planned = plan.make_plan(ir.lower_onnx(case.model))
    text = planned.describe()
    (conv2,) = [n for n in planned.epilogues if n.args[2:]]   # the conv with a bias, r2 = relu(c2 + x)
    assert f"{conv2.name} = conv(" in text and "its epilogue writes" in text and "channels-last" in text
    (sigmoid,) = [line for line in text.splitlines() if " = Sigmoid(" in line]
    assert sigmoid.endswith("stored (graph output); written into output 0")
    assert "inline (computed where it is read)" in text


def test_values_read_through_channels_innermost_views_are_stored_channels_last():
    """ConvNeXt's permutes: the depthwise convolution and the residual sum read NHWC values
    through NCHW views; stored channels-last, the sum's loop and the conv read densely."""
    (case,) = [c for c in CASES if c.name == "convnext-block-permutes"]
    planned = plan.make_plan(ir.lower_onnx(case.model))
    (conv,) = [n for n in planned.live if n.op == "conv"]
    (add,) = [n for n in planned.live if n.op == "ew" and tuple(n.shape) == (2, 16, 9, 7) and n in planned.materialized]
    assert planned.orders.get(conv) == buffers.CHANNELS_LAST and planned.orders.get(add) == buffers.CHANNELS_LAST
    assert "BLADE_CONV_INPUT_CHANNELS_LAST | BLADE_CONV_OUTPUT_CHANNELS_LAST" in source_of(case).source


def test_1d_convolutions_and_the_values_between_them_are_stored_channels_last():
    """HuBERT's feature extractor: the 1-D convolutions, and the GELU after the layer norm over
    the channels that feeds the next one, are stored [n, l, c] (with the GELU stored NCL its loop
    read the channels-last conv output across: 12.8 of 23 ms); the runtime gets channels-last 1-D
    convolutions (a 2-D one of unit height there)."""
    (case,) = [c for c in CASES if c.name == "conv1d-layernorm-gelu-conv1d"]
    planned = plan.make_plan(ir.lower_onnx(case.model))
    last = buffers.channels_last_order(3)
    convs = [n for n in planned.live if n.op == "conv"]
    (gelu,) = [n for n in planned.materialized if n.op == "ew" and n.attrs["fn"] == "Gelu"]
    assert [planned.orders.get(n) for n in convs[:2] + [gelu]] == [last] * 3
    source = source_of(case).source
    layouts = re.findall(r"rt->conv\(1, (?:[^,]*, ){10}([^,]*),", source)   # a 1-channel input stays NCL
    assert layouts == ["BLADE_CONV_OUTPUT_CHANNELS_LAST", "BLADE_CONV_INPUT_CHANNELS_LAST | BLADE_CONV_OUTPUT_CHANNELS_LAST",
                       "BLADE_CONV_INPUT_CHANNELS_LAST"], layouts


def test_an_upsampling_between_convolutions_stays_channels_last(tmp_path):
    """DPT's and UperNet's heads: a bilinear resize (gathers along H and W, weighted and summed)
    of a channels-last convolution, read by the next one. Stored NCHW, each pass's loop read the
    convolution across its layout and the next convolution read NCHW through oneDNN (DPT's
    224x224 32-channel 3x3: 6.2 -> 4.9 ms, the model 0.78 -> 0.89 of ONNX Runtime)."""
    width = np.repeat(np.arange(7), 2).astype(np.int64)   # nearest, 2x along W
    case = graph_case("conv-upsample-conv", [
        node("Conv", ["x", "w0"], ["c0"]), node("Conv", ["c0", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        node("Gather", ["c1", "i"], ["up"], axis=3),
        node("Mul", ["up", "s"], ["scaled"]), node("Conv", ["scaled", "w2"], ["y"], pads=[1, 1, 1, 1])],
        {"x": ((1, 8, 5, 7), "float32")}, ["y"],
        {"w0": np.random.default_rng(2).standard_normal((8, 8, 1, 1)).astype(np.float32),
         "w1": np.random.default_rng(3).standard_normal((16, 8, 3, 3)).astype(np.float32),
         "w2": np.random.default_rng(4).standard_normal((16, 16, 3, 3)).astype(np.float32),
         "i": width, "s": np.float32(0.5)}, rtol=1e-4, atol=1e-3)
    planned = plan.make_plan(ir.lower_onnx(case.model))
    (scaled,) = [n for n in planned.materialized if n.op == "ew" and n.rank == 4]
    assert planned.orders.get(scaled) == buffers.CHANNELS_LAST
    assert source_of(case).source.count("BLADE_CONV_INPUT_CHANNELS_LAST") == 2, "both read channels-last"
    check_case(case, compile_cases([case], tmp_path)[case.name])


def test_convolutions_reaching_a_convolution_through_resizes_and_a_concat_are_channels_last(tmp_path):
    """UperNet's FPN: convolutions over NCHW inputs (the backbone's levels, cluster inputs) whose
    outputs are resized and concatenated for the bottleneck convolution. None of them fed a
    convolution directly, so nothing was channels-last and the bottleneck (512 -> 128 3x3 at
    64x64, half the model's time) read its concat NCHW through oneDNN: 20.3 ms; channels-last,
    the runtime's kernels took it, 11.7 ms (UperNet 0.92 -> 1.32 of ONNX Runtime)."""
    rng = np.random.default_rng(5)
    case = graph_case("fpn-resize-concat-conv", [
        node("Conv", ["x", "w0"], ["c0"]), node("Conv", ["x", "w1"], ["c1"], strides=[2, 2]),
        node("Gather", ["c1", "iw"], ["wide"], axis=3), node("Gather", ["wide", "ih"], ["up"], axis=2),
        node("Concat", ["c0", "up"], ["cat"], axis=1), node("Conv", ["cat", "w2"], ["y"], pads=[1, 1, 1, 1])],
        {"x": ((1, 8, 6, 8), "float32")}, ["y"],
        {"w0": rng.standard_normal((16, 8, 1, 1)).astype(np.float32),
         "w1": rng.standard_normal((16, 8, 1, 1)).astype(np.float32),
         "w2": rng.standard_normal((16, 32, 3, 3)).astype(np.float32),
         "iw": np.repeat(np.arange(4), 2).astype(np.int64), "ih": np.repeat(np.arange(3), 2).astype(np.int64)},
        rtol=1e-4, atol=1e-3)
    planned = plan.make_plan(ir.lower_onnx(case.model))
    (concat,) = [n for n in planned.materialized if n.op == "concat"]
    assert planned.orders.get(concat) == buffers.CHANNELS_LAST
    source = source_of(case).source
    assert source.count("BLADE_CONV_OUTPUT_CHANNELS_LAST") == 2, "both levels' convolutions write channels-last"
    assert source.count("BLADE_CONV_INPUT_CHANNELS_LAST") == 1, "the last convolution reads the concat channels-last"
    check_case(case, compile_cases([case], tmp_path)[case.name])


def test_a_group_norm_between_convolutions_stays_channels_last():
    """PoolFormer's group norm over a channels-last convolution: its affine output, computed from
    the conv through the [N, G, C / G, H, W] reshapes and the inline normalization, is stored
    channels-last (it had been stored NCHW, a transposing loop, and the next conv read it
    through a gather), and each of its reductions loops over the channels innermost, stride 1
    (in logical order W was innermost, a float every C)."""
    for groups in (1, 2):
        (case,) = [c for c in CASES if c.name == f"conv-groupnorm-conv-{groups}"]
        planned = plan.make_plan(ir.lower_onnx(case.model))
        (affine,) = [n for n in planned.materialized if n.op == "ew" and n.rank == 4]
        assert planned.orders.get(affine) == buffers.CHANNELS_LAST
        source = source_of(case).source
        reductions = re.findall(r"#pragma omp simd reduction\(\+:\w+\)\n\s*for \(int64_t \w+ = 0; \w+ < (\d+);",
                                source)
        assert reductions == [str(8 // groups)] * 2, reductions
        assert source.count("BLADE_CONV_INPUT_CHANNELS_LAST") == 1, "the second conv reads channels-last"


def test_a_reduction_to_one_value_over_a_large_window_runs_in_parallel_rows(tmp_path):
    """A group norm's statistics with one group at batch 1 (here a sum and a max over [16, 64, 64],
    65536 floats, into one value): partial reductions along the outermost axis in memory, one row
    each (a parallel loop over the 16 channels), then their combination; a smaller window stays
    one loop."""
    x = np.random.default_rng(44).standard_normal((1, 16, 64, 64)).astype(np.float32)
    axes = np.array([1, 2, 3], np.int64)
    case = graph_case("sum-max-to-one", [node("ReduceSum", ["x", "axes"], ["s"]), node("ReduceMax", ["x", "axes"], ["m"])],
                      {"x": (x.shape, "float32")}, ["s", "m"], {"axes": axes}, values={"x": x}, rtol=1e-5, atol=1e-3)
    names = kernels(source_of(case))
    assert [k.split(" = ")[1] for k in names] == ["reduce sum over axes [2, 3]", "reduce sum over axes [1]",
                                                  "reduce max over axes [2, 3]", "reduce max over axes [1]"], names
    assert names[0].startswith("reduce:") and "_rows[1, 16, 1, 1]" in names[0]
    check_case(case, compile_cases([case], tmp_path)[case.name])
    small = op_case("ReduceSum", [(1, 16, 32, 32)], axes)
    assert len(kernels(source_of(small))) == 1
    many_rows = op_case("ReduceSum", [(1, 32768, 2)], np.array([1, 2], np.int64))
    assert len(kernels(source_of(many_rows))) == 1, "32768 rows of two floats: one loop"


def test_a_reshape_source_keeps_row_major_where_its_read_order_breaks_the_reshape():
    """A value computed from heads read through a permute, then merged by a reshape into a GEMM
    operand: stored in its read order, the merge would have no strides (a gather, a copy for
    the GEMM), so it stays row-major and its loop transposes instead."""
    case = graph_case("permuted-scaled-merged", [
        node("Transpose", ["x"], ["t"], perm=[0, 2, 1, 3]), node("Mul", ["t", "two"], ["m"]),
        node("Reshape", ["m", "merged"], ["r"]), node("MatMul", ["r", "w"], ["y"])],
        {"x": ((2, 4, 6, 8), "float32")}, ["y"],
        {"two": np.array(2.0, np.float32), "merged": np.array([2, 6, 32], np.int64),
         "w": np.random.default_rng(35).standard_normal((32, 16)).astype(np.float32)})
    planned = plan.make_plan(ir.lower_onnx(case.model))
    (scaled,) = [n for n in planned.materialized if n.op == "ew"]
    assert planned.materialized[scaled] == plan.RESHAPE_SOURCE and scaled not in planned.orders


def test_a_conv_epilogue_never_reads_an_addend_written_later():
    (case,) = [c for c in CASES if c.name == "conv-epilogue-addend-computed-later"]
    planned = plan.make_plan(ir.lower_onnx(case.model))
    assert planned.epilogues == {}
    assert "then relu" not in source_of(case).source


def test_a_conv_epilogue_adds_a_residual_read_through_a_view():
    """ResNet's first residual: the max pool's window reduction, reshaped (a view of memory written
    before the convolution, in its layout), is the epilogue's addend; no loop of its own."""
    (case,) = [c for c in CASES if c.name == "conv-maxpool-residual-epilogue"]
    planned = plan.make_plan(ir.lower_onnx(case.model))
    (epilogue,) = [e for e in planned.epilogues.values() if e.addend is not None]
    assert epilogue.addend.op == "view" and epilogue.activation == plan.Activation("relu")
    assert not any(k.startswith("ew") for k in kernels(source_of(case)))


def test_a_pooling_pad_between_channels_last_values_is_read_inline():
    """ResNet's stem: the max pool's -inf pad, read only by its channels-last window reduction, is
    no stored copy: the reduction's loop over the channels reads the conv's output (its ReLU
    inline) with each tap's bounds checked once per tap, outside that loop. An NCHW pool (a pad
    along the innermost loop's dim) keeps its stored pad, and so does one over a costly inline
    source (a Sigmoid, computed again for every window that reads it). Each tap's bounds are
    computed in its own loop, outside the loop over the channels (inside it, g++ vectorized that
    loop in only some of its copies: PoolFormer's average pools 0.6 -> 0.1 ms)."""
    for name in ("conv-maxpool-conv-channels-last", "conv-maxpool-residual-epilogue"):
        (case,) = [c for c in CASES if c.name == name]
        planned = plan.make_plan(ir.lower_onnx(case.model))
        (pad,) = [n for n in planned.live if n.op == "pad"]
        assert pad not in planned.materialized
        (pool,) = [n for n in planned.live if n.op == "reduce"]
        assert pool in planned.window_form and planned.orders.get(pool) is not None
        program = source_of(case)
        assert not any(k.startswith("pad") for k in kernels(program))
        window = program.source.split("(window form)\n  BLADE_PROFILE_BEGIN")[1].split("BLADE_PROFILE_END")[0]
        bounds = re.findall(r"^( *)const int64_t p\d+c? = ", window, re.MULTILINE)
        (load,) = re.findall(r"^( *)const float t\d+ = s\d+\[[^]]*p\d+c", window, re.MULTILINE)
        assert bounds and all(len(indent) < len(load) for indent in bounds), window
    for name in ("MaxPool-window-form", "conv-sigmoid-maxpool-conv"):
        (case,) = [c for c in CASES if c.name == name]
        planned = plan.make_plan(ir.lower_onnx(case.model))
        assert [n for n in planned.live if n.op == "pad" and n in planned.materialized]


def test_a_large_window_reduces_along_the_output_row_in_double(tmp_path):
    """A sum over a long axis of a row-major input (and a squeeze-and-excitation mean over a
    channels-last activation) reads the input along the output row, vectorized, instead of one
    output element's window at a time, a float per cache line. Its partial sums are doubles: one
    1.0 followed by 4095 values of 1e-8 sums to 1.000041, where float steps, one after another,
    stay at 1.0 (each 1e-8 is below half an ulp of 1.0)."""
    x = np.full((2, 4096, 8), 1e-8, np.float32)
    x[:, 0, :] = 1.0
    x[1] *= -3
    case = op_case("ReduceSum", [x.shape], np.array([1], np.int64), values={"x0": x})
    program = source_of(case)
    assert kernels(program) == ["reduce:v2[2, 1, 8]float32 = reduce sum over axes [1] (window form)"]
    assert "double partial" in program.source
    manifest = compile_onnx(case.model, tmp_path)
    (got,) = run_case(case, tmp_path / "engine.so", manifest)
    np.testing.assert_allclose(got, x.astype(np.float64).sum(axis=1, keepdims=True), rtol=1e-7)
    for se in [c for c in CASES if c.name.endswith("-squeeze-excitation-conv")]:   # stored, inline source
        assert any("reduce sum over axes [2, 3] (window form)" in k for k in kernels(source_of(se))), se.name


def test_a_window_along_the_row_after_a_kernel_over_those_rows_starts_its_own_loop(tmp_path):
    """PVTv2's and HuBERT's layer norm over a transposed NCHW value ([1, 64, 7, 7] -> [1, 49, 64]):
    both statistics read their window along the 49-float output row. The variance's followed the
    mean's division, a kernel over rows (1, 49); joining that row loop left it no row to read along,
    and the engine failed to compile (the whole cluster stayed in TorchScript)."""
    case = graph_case("layernorm-over-transposed", [
        node("Reshape", ["x", "s"], ["r"]), node("Transpose", ["r"], ["t"], perm=[0, 2, 1]),
        node("LayerNormalization", ["t", "g", "b"], ["y"], axis=-1)], {"x": ((1, 64, 7, 7), "float32")}, ["y"],
        {"s": np.array([1, 64, 49], np.int64), "g": np.linspace(0.5, 2, 64, dtype=np.float32),
         "b": np.linspace(-1, 1, 64, dtype=np.float32)})
    assert [k for k in kernels(source_of(case)) if k.endswith("(window form)")] == [
        "reduce:v6[1, 49, 1]float32 = reduce sum over axes [2] (window form)",
        "reduce:v14[1, 49, 1]float32 = reduce sum over axes [2] (window form)"]
    check_case(case, compile_cases([case], tmp_path)[case.name])


def test_a_short_window_that_is_a_run_of_memory_reduces_along_the_run(tmp_path):
    """SegFormer-b0's layer norms over 32 channels of [1, 16384, 32]: a window of one row's run of
    memory is summed along that run, vectorized, the rows split across the threads. The window form
    (for windows read across the output row, as pooling's) read it a float per cache line, 32 times
    over, on one thread: 3.8 ms a sum, the model at 0.9x ONNX Runtime."""
    case = graph_case("layernorm-over-32-channels", [
        node("Add", ["x", "y"], ["s"]), node("LayerNormalization", ["s", "g", "b"], ["out"], axis=-1)],
        {"x": ((1, 256, 32), "float32"), "y": ((1, 256, 32), "float32")}, ["out"],
        {"g": np.linspace(0.5, 2, 32, dtype=np.float32), "b": np.linspace(-1, 1, 32, dtype=np.float32)})
    program = source_of(case)
    assert not [k for k in kernels(program) if k.endswith("(window form)")], kernels(program)
    assert re.findall(r"#pragma omp simd reduction\(\+:acc\d+\)\n\s*for \(int64_t r\d+ = 0; r\d+ < 32;", program.source)
    check_case(case, compile_cases([case], tmp_path)[case.name])


def test_a_reduction_over_an_inline_value_contiguous_in_its_window_runs_as_one_loop(tmp_path):
    """A group norm's variance with nothing channels-last around it: sum((x - mean)^2) over
    [H, W] of an NCHW x, the mean broadcast over the window. Every load reads H x W as one run
    of memory, so one vectorized loop over the 128 elements (nested, the simd loop was W's 16).
    A value broadcast along H only (read at stride 0, then 1) is no run: its loops stay nested."""
    x = np.random.default_rng(45).standard_normal((1, 4, 8, 16)).astype(np.float32)
    axes = np.array([2, 3], np.int64)

    def variance(name, subtrahend):
        return graph_case(name, [node("ReduceMean", ["x", "axes"], ["m"]), node("Sub", ["x", subtrahend], ["d"]),
                                 node("Mul", ["d", "d"], ["q"]), node("ReduceSum", ["q", "axes"], ["v"])],
                          {"x": (x.shape, "float32")}, ["v"],
                          {"axes": axes, "b": np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 1, 1, 16)},
                          values={"x": x}, rtol=1e-5, atol=1e-4)

    whole, per_row = variance("variance-over-one-run", "m"), variance("variance-broadcast-along-h", "b")
    loops = {case.name: re.findall(r"for \(int64_t r\d+ = 0; r\d+ < (\d+);", source_of(case).source)
             for case in (whole, per_row)}
    assert loops == {whole.name: ["128", "128"], per_row.name: ["8", "16"]}, loops
    compiled = compile_cases([whole, per_row], tmp_path)
    for case in (whole, per_row):
        check_case(case, compiled[case.name])


def test_a_kernel_reading_along_another_dim_than_it_writes_runs_in_tiles():
    """A channels-last value into an NCHW output (48 channels: blocks of 16), and a transposed
    output copied from another, run as tiled transposes; 12 channels (no block divides them) keep
    the plain loop. (Their values: test_ops.)"""
    cases = {c.name: c for c in CASES}
    assert kernels(source_of(cases["conv-residual-relu-nchw-output-48"]))[-1].endswith(
        "[1, 48, 9, 7]float32 = ew Relu (tiled transpose)")
    assert not any("tiled" in k for k in kernels(source_of(cases["conv-residual-relu-nchw-output-12"])))
    assert any(k.startswith("output 1 = copy of") and k.endswith("(tiled transpose)")
               for k in kernels(source_of(cases["output-transposing-output"])))


def test_a_pooling_kernel_past_the_input_reads_only_the_input():
    """EfficientNet's head: avg_pool2d(320, ceil_mode=True) over a 2x2 map. The window's taps past
    the input are all fill, so the engine reduces the input itself: no pad up to the kernel's size
    (a [2, 320, 320, 320] buffer, 262 MB and 36 ms, before). Its values are checked against eager
    in tests/e2e/test_op_table.py (onnx's reference evaluator gives NaN for this window)."""
    case = op_case("AveragePool", [(2, 8, 2, 3)], kernel_shape=[320, 320], strides=[320, 320], ceil_mode=1)
    planned = plan.make_plan(ir.lower_onnx(case.model))
    assert not [n for n in planned.live if n.op == "pad"]
    assert max(int(np.prod(n.shape)) for n in planned.live) == 2 * 8 * 2 * 3
    assert source_of(case).scratch_bytes == 0


def test_a_stored_pad_fills_only_its_border():
    """One fill per padded side (none for an unpadded one), each over the slab outside the interior."""
    (case,) = [c for c in CASES if c.name == "Pad-2x3x4-float32"]   # [2, 3, 4] padded [0, 1, 2] before, [0, 2, 1] after
    fills = re.findall(r"pad fill[^;]*", ";".join(kernels(source_of(case))))   # a fused kernel lists its parts with ;
    assert fills == ["pad fill (dim 1)"] * 2 + ["pad fill (dim 2)"] * 2


def test_clamps_after_convolutions_are_their_epilogues():
    (block,) = [c for c in CASES if c.name == "conv-clip-mobilenet-block"]
    planned = plan.make_plan(ir.lower_onnx(block.model))
    relu6 = plan.Activation("clamp", 0.0, 6.0)
    assert sorted((e.activation == relu6, e.addend is not None) for e in planned.epilogues.values()) == [
        (False, True), (True, False), (True, False)]
    assert source_of(block).source.count("BLADE_ACTIVATION_CLAMP, 0.0f, 6.0f") == 2
    (forms,) = [c for c in CASES if c.name == "conv-clamp-forms"]
    planned = plan.make_plan(ir.lower_onnx(forms.model))
    activations = {planned.outputs[e.target]: e.activation for e in planned.epilogues.values()}   # by output
    lo, hi = float(np.float32(-0.5)), float(np.float32(0.8))
    assert activations == {0: plan.Activation("clamp", lo=lo), 1: plan.Activation("clamp", hi=hi),
                           3: plan.Activation("clamp", lo, hi)}   # y3 = Max(lo, conv) stays a loop


def test_gelu_after_a_convolution_is_its_epilogue(tmp_path):
    """PoolFormer's MLP: the exact GELU after a 1x1 convolution is the convolution's epilogue
    (BLADE_ACTIVATION_GELU), no loop of its own; not when the convolution's value is read
    elsewhere too. Computed, the result matches the reference's."""
    def conv_gelu(shared):
        return graph_case("conv-gelu" + ("-shared" if shared else ""), [
            node("Conv", ["x", "w1", "b1"], ["c"]), node("Gelu", ["c"], ["g"]), node("Conv", ["g", "w2"], ["y"])]
            + ([node("Sigmoid", ["c"], ["y2"])] if shared else []),
            {"x": ((1, 8, 5, 6), "float32")}, ["y"] + (["y2"] if shared else []),
            {"w1": np.random.default_rng(41).standard_normal((16, 8, 1, 1)).astype(np.float32),
             "b1": np.random.default_rng(42).standard_normal((16,)).astype(np.float32),
             "w2": np.random.default_rng(43).standard_normal((8, 16, 1, 1)).astype(np.float32)}, rtol=1e-4, atol=1e-4)
    case = conv_gelu(False)
    planned = plan.make_plan(ir.lower_onnx(case.model))
    assert [e.activation for e in planned.epilogues.values()] == [plan.Activation("gelu")]
    source = codegen.generate(planned).source
    assert "BLADE_ACTIVATION_GELU" in source and "blade_geluf(" not in source.split("blade_engine_run")[1]
    check_case(case, compile_cases([case], tmp_path)[case.name])
    shared = plan.make_plan(ir.lower_onnx(conv_gelu(True).model))
    assert all(e.activation is None for e in shared.epilogues.values())


def test_silu_after_convolutions_is_their_epilogue():
    """EfficientNet's block: SiLU (Sigmoid then Mul, in either order) after the expansion, the
    depthwise and the squeeze convolution is each one's epilogue (BLADE_ACTIVATION_SILU), the
    expansion still called with the depthwise one; its Sigmoid and Mul have no loop of their own.
    After a residual sum too; not when the convolution or the Sigmoid is read elsewhere, nor for the
    sigmoid of another value."""
    (block,) = [c for c in CASES if c.name == "conv-silu-efficientnet-block"]
    planned = plan.make_plan(ir.lower_onnx(block.model))
    silu = plan.Activation("silu")
    assert sorted((e.activation == silu, e.addend is not None) for e in planned.epilogues.values()) == [
        (False, True), (True, False), (True, False), (True, False)]
    assert len(planned.conv_pairs) == 1
    source = codegen.generate(planned).source
    assert source.count("BLADE_ACTIVATION_SILU") == 3 and source.count("rt->conv_pair(&first, &second);") == 1
    assert source.count("blade_sigmoidf(") == 1   # the gate's: the three SiLUs are the runtime's
    (forms,) = [c for c in CASES if c.name == "conv-silu-forms"]
    planned = plan.make_plan(ir.lower_onnx(forms.model))
    fused = {planned.outputs[e.target]: (e.activation, e.addend is not None) for e in planned.epilogues.values()
             if e.target in planned.outputs}
    assert fused == {0: (silu, True)}


def test_zero_pad_folds_into_the_convolution_pads():
    """Only when nothing else reads the padded tensor and the pad value is +0.0."""
    folded, read_twice, nonzero = (source_of(c) for c in CASES if c.name in (
        "Pad-folds-into-Conv", "Pad-read-twice-before-Conv", "Pad-nonzero-before-Conv"))
    assert not any("pad" in k.split("=")[0] for k in kernels(folded))
    assert "pads [0, 1, 1, 2]" in folded.source
    for program in (read_twice, nonzero):
        assert any(k.startswith("pad") for k in kernels(program))


def test_an_expansion_read_only_by_a_depthwise_convolution_is_called_with_it():
    """conv_pair: the 1x1 convolution (its ReLU6 epilogue included) is called with the depthwise
    one at the depthwise one's place; returned as an output too, its value is stored and it keeps
    its own call."""
    (case,) = [c for c in CASES if c.name == "conv-expand-depthwise-pair"]
    planned = plan.make_plan(ir.lower_onnx(case.model))
    ((depthwise, expand),) = planned.conv_pairs.items()
    assert depthwise.attrs["groups"] == 48 and tuple(expand.args[1].shape) == (48, 8, 1, 1)
    assert f"called with {depthwise.name} (conv_pair" in planned.describe()
    source = codegen.generate(planned).source
    assert source.count("rt->conv_pair(&first, &second);") == 1 and source.count("rt->conv(") == 2
    model = type(case.model)()
    model.CopyFrom(case.model)   # CASES is shared
    model.graph.output.append(helper.make_tensor_value_info("e", 1, [1, 48, 64, 64]))
    planned = plan.make_plan(ir.lower_onnx(model))
    assert planned.conv_pairs == {}
    assert "rt->conv_pair(" not in codegen.generate(planned).source
