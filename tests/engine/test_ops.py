"""Per-op and fused-chain engine tests against onnx's numpy reference: one line per case.

All cases compile once per session (in parallel threads); each test runs its engine via npruntime.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from onnx_cases import check_case, compile_cases, graph_case, op_case, run_case
from blade.engine.npruntime import EngineRunError

f32, i64 = np.float32, np.int64
arr = np.array
positive = {"x0": np.abs(np.random.default_rng(1).standard_normal((3, 17))).astype(f32) + 0.1}
ints_nonzero = {"x1": arr([[3, -2, 5, -7]], i64)}
# exp/tanh/sigmoid have own vectorizable float32 versions: check them over the whole float range.
wide = np.concatenate([np.linspace(-110, 95, 1001), np.geomspace(1e-8, 10, 200), -np.geomspace(1e-8, 10, 200),
                       [0, -0.0, np.inf, -np.inf, np.nan, 88.72, 88.73, -87.4, -103.9, -104]]).astype(f32)


def node(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


CASES = [
    # elementwise, unary
    *[op_case(op, [(3, 17)]) for op in
      ("Neg", "Abs", "Relu", "Sigmoid", "Tanh", "Exp", "Erf", "Floor", "Ceil", "Sign", "Sin", "Cos", "Identity")],
    *[op_case(op, [(3, 17)], values=positive) for op in ("Sqrt", "Log", "Reciprocal")],
    *[op_case(op, [wide.shape], values={"x0": wide}, rtol=1e-6, atol=1.2e-38, name=f"{op}-whole-range")
      for op in ("Exp", "Tanh", "Sigmoid", "Erf")],
    # erf's own float32 version, densely over the range where it is not +-1: <= 2.3 ulp measured
    op_case("Erf", [(24001,)], values={"x0": np.linspace(-6, 6, 24001).astype(f32)}, rtol=4e-7, atol=1e-7,
            name="Erf-dense"),
    op_case("Neg", [(5,)], dtype="int64"),
    op_case("Abs", [(5,)], dtype="int32"),
    op_case("Sign", [(5,)], dtype="int64"),
    op_case("Not", [(2, 3)], dtype="bool"),
    # elementwise, binary with broadcasting
    op_case("Add", [(4, 1, 5), (3, 1)]),
    op_case("Sub", [(2, 3), (3,)]),
    op_case("Mul", [(5,), (4, 5)]),
    op_case("Div", [(2, 3, 4), (2, 1, 4)]),
    op_case("Div", [(2, 4), (1, 4)], dtype="int64", values=ints_nonzero),
    op_case("Div", [(6,), (6,)], dtype="int64", name="Div-int64-truncates-wraps",
            values={"x0": arr([-7, 7, -2**63, 2**62 + 1, 5, -5], i64), "x1": arr([2, -2, -1, 3, -1, 7], i64)}),
    op_case("Div", [(3,), (3,)], dtype="int64", name="Div-int64-by-zero",
            values={"x0": arr([5, -5, 7], i64), "x1": arr([2, 0, -2], i64)}),
    op_case("Mod", [(3, 17), (17,)], fmod=1, name="Mod-fmod-float"),
    op_case("Pow", [(8,), (8,)], dtype="int64", name="Pow-int64-wraps",
            values={"x0": arr([3, -3, 7, 2, 5, 1, -1, 4], i64), "x1": arr([41, 39, 2, 63, 30, 5, 3, 0], i64)}),
    op_case("Add", [(), (3,)], name="Add-scalar-broadcast"),
    op_case("Mul", [(), ()], name="Mul-0d"),
    op_case("Add", [(0, 3), (3,)], name="Add-empty"),
    op_case("Pow", [(3, 17)], arr(2.0, f32), values=positive, name="Pow-square"),
    op_case("Pow", [(3, 17), (17,)], values=positive, name="Pow-tensor"),
    op_case("Pow", [(3, 17)], arr(3, i64), values=positive, name="Pow-int-exponent"),
    op_case("Pow", [(3, 17)], arr(3.0, f32), name="Pow-cube-signed"),
    op_case("Pow", [(3, 17)], arr(-2.0, f32), values=positive, name="Pow-inverse-square"),
    op_case("Pow", [(3, 17)], arr(0.5, f32), values=positive, name="Pow-sqrt"),
    op_case("Max", [(3, 4), (4,), (3, 1)]),
    op_case("Min", [(3, 4), (4,)]),
    op_case("Max", [(4,), (4,)], values={"x0": arr([1, np.nan, 3, -np.inf], f32)}, name="Max-nan"),
    op_case("Where", [(2, 3), (3,), (2, 1)], dtypes=["bool", "float32", "float32"]),
    *[op_case(op, [(3, 4), (4,)], dtype="int64") for op in
      ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")],
    op_case("Less", [(3, 4), (3, 4)]),
    op_case("And", [(3, 4), (4,)], dtype="bool"),
    op_case("Or", [(3, 4), (4,)], dtype="bool"),
    op_case("Xor", [(3, 4), (4,)], dtype="bool"),
    *[op_case(op, [(3, 4), (4,)], dtype=dtype) for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor")
      for dtype in ("int32", "int64")],
    *[op_case("BitwiseNot", [(3, 5)], dtype=dtype) for dtype in ("int32", "int64")],
    op_case("Cast", [(3, 5)], to=7, name="Cast-f32-i64", values={"x0": arr([[1.7, -1.7, 2.5, -0.2, 0]] * 3, f32)}),
    op_case("Cast", [(3, 5)], to=9, name="Cast-f32-bool", values={"x0": arr([[1.7, -1.7, 0, -0.0, 3]] * 3, f32)}),
    op_case("Cast", [(2, 3)], to=1, dtype="bool", name="Cast-bool-f32"),
    op_case("Cast", [(2, 3)], to=1, dtype="int64", name="Cast-i64-f32"),
    op_case("Cast", [(2, 3)], to=11, name="Cast-f32-f64"),
    op_case("Cast", [(2, 3)], to=6, dtype="int64", name="Cast-i64-i32"),
    op_case("Clip", [(3, 17)], arr(-0.5, f32), arr(0.5, f32)),
    op_case("Clip", [(3, 17)], None, arr(0.5, f32), name="Clip-max-only"),
    op_case("Clip", [(3, 17)], name="Clip-no-bounds"),
    op_case("Gelu", [(3, 17)]),
    op_case("Gelu", [(3, 17)], approximate="tanh", name="Gelu-tanh"),
    # reductions
    op_case("ReduceSum", [(3, 4, 5)], arr([1], i64)),
    op_case("ReduceSum", [(3, 4, 5)], arr([-1, 0], i64), keepdims=0, name="ReduceSum-neg-axes-nokeep"),
    op_case("ReduceSum", [(3, 4, 5)], name="ReduceSum-all"),
    op_case("ReduceSum", [(3, 4)], arr([], i64), noop_with_empty_axes=1, name="ReduceSum-noop"),
    op_case("ReduceSum", [(3, 4)], arr([1], i64), dtype="int64"),
    op_case("ReduceSum", [(3, 0)], arr([1], i64), name="ReduceSum-empty-axis"),
    op_case("ReduceMean", [(2, 3, 64)], arr([-1], i64)),
    op_case("ReduceMax", [(4, 6)], arr([0], i64), keepdims=0),
    op_case("CumSum", [(3, 64)], arr(1, i64), name="CumSum-chunked-rows"),
    op_case("CumSum", [(3, 7)], arr(-1, i64), dtype="int64", name="CumSum-short-rows-int"),
    op_case("CumSum", [(5, 4, 3)], arr(0, i64), name="CumSum-first-axis"),
    op_case("ArgMax", [(3, 5)], axis=1, values={"x0": arr([[1, 4, 4, 0, 4], [-2, -2, -3, -9, -2], [0, 0, 0, 0, 0]], f32)},
            name="ArgMax-ties-first-index"),
    op_case("ArgMin", [(4, 6)], axis=0, keepdims=0, dtype="int64"),
    op_case("ReduceMax", [(2, 3)], arr([1], i64), values={"x0": arr([[1, np.nan, 2], [1, 2, 3]], f32)},
            name="ReduceMax-nan"),
    op_case("ReduceMin", [(3, 4, 5)], arr([0, 2], i64)),
    op_case("ReduceProd", [(3, 4, 5)], arr([1], i64), keepdims=0, rtol=1e-5),
    op_case("ReduceProd", [(3, 4)], arr([0], i64), dtype="int64"),
    op_case("Softmax", [(4, 33)], axis=-1),
    op_case("Softmax", [(2, 5, 3)], axis=1),
    op_case("LogSoftmax", [(4, 33)], axis=0),
    op_case("LayerNormalization", [(2, 5, 16), (16,), (16,)], axis=-1, epsilon=1e-5, rtol=1e-4, atol=1e-5),
    op_case("LayerNormalization", [(2, 3, 8), (3, 8)], axis=1, name="LayerNorm-axis1-nobias",
            rtol=1e-4, atol=1e-5),
    # linear algebra
    op_case("MatMul", [(4, 5), (5, 3)]),
    op_case("MatMul", [(5,), (5, 3)], name="MatMul-1d-2d"),
    op_case("MatMul", [(4, 5), (5,)], name="MatMul-2d-1d"),
    op_case("MatMul", [(5,), (5,)], name="MatMul-1d-1d"),
    op_case("MatMul", [(2, 3, 4, 5), (5, 6)], name="MatMul-broadcast-weight", rtol=1e-4),
    op_case("MatMul", [(2, 1, 4, 5), (3, 5, 6)], name="MatMul-batch-broadcast", rtol=1e-4),
    op_case("MatMul", [(0, 4), (4, 3)], name="MatMul-empty-m"),
    op_case("MatMul", [(2, 0), (0, 3)], name="MatMul-empty-k"),
    op_case("MatMul", [(3, 4), (4, 2)], dtype="int64", name="MatMul-int64"),
    op_case("MatMul", [(2, 3, 4), (4, 2)], dtype="float64", name="MatMul-f64"),
    op_case("Gemm", [(4, 5), (5, 3), (3,)], rtol=1e-4),
    op_case("Gemm", [(5, 4), (3, 5), (4, 1)], transA=1, transB=1, alpha=0.5, beta=2.0, name="Gemm-trans",
            rtol=1e-4),
    op_case("Gemm", [(4, 5), (3, 5)], transB=1, name="Gemm-noC"),
    # data movement
    op_case("Reshape", [(2, 3, 4)], arr([0, -1], i64)),
    op_case("Flatten", [(2, 3, 4, 5)], axis=2),
    op_case("Transpose", [(2, 3, 4)], perm=[2, 0, 1]),
    op_case("Transpose", [(2, 3)], name="Transpose-default"),
    op_case("Unsqueeze", [(3, 4)], arr([0, -1], i64)),
    op_case("Squeeze", [(1, 3, 1, 4)], arr([2], i64)),
    op_case("Squeeze", [(1, 3, 1, 4)], name="Squeeze-all"),
    op_case("Expand", [(3, 1)], arr([2, 3, 4], i64)),
    op_case("Slice", [(6, 7)], arr([1, -2], i64), arr([5, 100], i64)),
    op_case("Slice", [(6, 7)], arr([-1, 5], i64), arr([-100, 0], i64), arr([0, 1], i64), arr([-2, -1], i64),
            name="Slice-negative-steps"),
    op_case("Slice", [(4, 5, 6)], arr([2], i64), arr([9], i64), arr([-1], i64), arr([3], i64),
            name="Slice-one-axis-step"),
    op_case("Concat", [(2, 3), (2, 1), (2, 0)], axis=1),
    op_case("Concat", [(2, 3)], arr(np.ones((4, 3), f32)), axis=0, name="Concat-with-const"),
    op_case("Gather", [(10, 4)], arr([[1, 9], [-1, 0]], i64), name="Gather-embedding"),
    op_case("Gather", [(3, 5, 2)], arr(-2, i64), axis=1, name="Gather-scalar-index"),
    op_case("Gather", [(3, 5), (2, 2)], dtypes=["float32", "int64"], axis=1, name="Gather-runtime-indices",
            values={"x1": arr([[4, -5], [0, 2]], i64)}),
    op_case("Gather", [(4, 3)], arr([0, 99], i64), name="Gather-out-of-range"),
    # convolution (through the runtime's conv) and pooling (pad + window view + reduce)
    op_case("Conv", [(2, 3, 9, 8), (4, 3, 3, 3), (4,)], pads=[1, 1, 1, 1], rtol=1e-4, atol=1e-5),
    op_case("Conv", [(1, 4, 10, 9), (6, 2, 3, 2)], strides=[2, 1], dilations=[2, 1], group=2,
            pads=[0, 1, 1, 0], name="Conv-grouped-dilated-asymmetric", rtol=1e-4, atol=1e-5),
    op_case("Conv", [(1, 4, 7, 7), (4, 1, 3, 3)], group=4, pads=[1, 1, 1, 1], name="Conv-depthwise",
            rtol=1e-4, atol=1e-5),
    op_case("Conv", [(2, 3, 11), (5, 3, 4)], strides=[3], name="Conv-1d", rtol=1e-4, atol=1e-5),
    # windows that tile the input (a ViT patch embedding) are one GEMM of the patches; a ragged
    # edge the windows never reach is dropped; 1-D and 3-D too, and a bias-free one
    op_case("Conv", [(2, 16, 10, 9), (8, 16, 4, 4), (8,)], strides=[4, 4], name="Conv-patches-as-gemm",
            rtol=1e-4, atol=1e-5),
    op_case("Conv", [(1, 32, 17), (5, 32, 8)], strides=[8], name="Conv-1d-patches-as-gemm", rtol=1e-4, atol=1e-5),
    op_case("Conv", [(1, 8, 4, 6, 8), (3, 8, 4, 2, 4), (3,)], strides=[4, 2, 4], name="Conv-3d-patches-as-gemm",
            rtol=1e-4, atol=1e-5),
    # TF-style "same" padding: a zero Pad of the spatial dims folds into the Conv's own (asymmetric)
    # pads; with a second reader, or a non-zero pad value, the Pad stays a kernel of its own.
    graph_case("Pad-folds-into-Conv", [node("Pad", ["x", "p"], ["t"]), node("Conv", ["t", "w"], ["y"], group=6,
                                                                             strides=[2, 2])],
               {"x": ((2, 6, 9, 8), "float32")}, ["y"],
               {"p": arr([0, 0, 0, 1, 0, 0, 1, 2], i64),
                "w": np.random.default_rng(9).standard_normal((6, 1, 3, 3)).astype(f32)}, rtol=1e-4, atol=1e-5),
    graph_case("Pad-read-twice-before-Conv", [node("Pad", ["x", "p"], ["t"]), node("Conv", ["t", "w"], ["c"]),
                                              node("ReduceSum", ["t"], ["s"], keepdims=0)],
               {"x": ((1, 3, 5, 5), "float32")}, ["c", "s"],
               {"p": arr([0, 0, 1, 1, 0, 0, 1, 1], i64),
                "w": np.random.default_rng(10).standard_normal((2, 3, 3, 3)).astype(f32)}, rtol=1e-4, atol=1e-5),
    graph_case("Pad-nonzero-before-Conv", [node("Pad", ["x", "p", "v"], ["t"]), node("Conv", ["t", "w"], ["y"])],
               {"x": ((1, 3, 5, 5), "float32")}, ["y"],
               {"p": arr([0, 0, 1, 0, 0, 0, 0, 1], i64), "v": arr(0.5, f32),
                "w": np.random.default_rng(11).standard_normal((2, 3, 3, 3)).astype(f32)}, rtol=1e-4, atol=1e-5),
    graph_case("Conv-transposed-input-relu", [node("Transpose", ["x"], ["t"], perm=[0, 3, 1, 2]),
                                              node("Conv", ["t", "w"], ["c"]), node("Relu", ["c"], ["y"])],
               {"x": ((1, 5, 6, 3), "float32")}, ["y"],
               {"w": np.random.default_rng(4).standard_normal((2, 3, 1, 1)).astype(f32)}, rtol=1e-4, atol=1e-5),
    # ConvNeXt's block in NHWC terms: permuted to NCHW for a depthwise 7x7 convolution, back to NHWC
    # for two MatMuls, to NCHW again for the residual sum. The convolution and the sum read
    # channels-innermost views, so both are stored channels-last (the scaled sum, read by two
    # outputs, is stored; test_codegen checks the plan).
    graph_case("convnext-block-permutes", [
        node("Transpose", ["x"], ["xt"], perm=[0, 3, 1, 2]),
        node("Conv", ["xt", "wd", "bd"], ["d"], group=16, pads=[3, 3, 3, 3]),
        node("Transpose", ["d"], ["dh"], perm=[0, 2, 3, 1]), node("MatMul", ["dh", "w1"], ["m1"]),
        node("Relu", ["m1"], ["r"]), node("MatMul", ["r", "w2"], ["m2"]),
        node("Transpose", ["m2"], ["mt"], perm=[0, 3, 1, 2]), node("Mul", ["mt", "g"], ["ms"]),
        node("Add", ["ms", "gb"], ["mb"]), node("Add", ["xt", "mb"], ["s"]),
        node("Transpose", ["s"], ["sh"], perm=[0, 2, 3, 1]), node("Sigmoid", ["sh"], ["y"]),
        node("Tanh", ["sh"], ["y2"])],
        {"x": ((2, 9, 7, 16), "float32")}, ["y", "y2"],
        {"wd": (np.random.default_rng(21).standard_normal((16, 1, 7, 7)) / 7).astype(f32),
         "bd": np.random.default_rng(22).standard_normal((16,)).astype(f32),
         "w1": (np.random.default_rng(23).standard_normal((16, 32)) / 4).astype(f32),
         "w2": (np.random.default_rng(24).standard_normal((32, 16)) / 6).astype(f32),
         "g": np.random.default_rng(25).standard_normal((16, 1, 1)).astype(f32),
         "gb": np.random.default_rng(26).standard_normal((16, 1, 1)).astype(f32)}, rtol=1e-4, atol=1e-5),
    # PoolFormer's group norm (one group here, two groups of 4 channels in the case after it)
    # between convolutions, as reductions.py lowers it: the conv output's channel dim split
    # [N, G, C / G, H, W], normalized over the last three, reshaped back, the affine, a conv. The
    # affine output is stored channels-last and the reductions read along the channels
    # (test_codegen checks the plan and the loops).
    *[graph_case(f"conv-groupnorm-conv-{groups}", [
        node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        node("Reshape", ["c1", "grouped"], ["g"]), node("ReduceMean", ["g", "axes"], ["mean"]),
        node("Sub", ["g", "mean"], ["centered"]), node("Mul", ["centered", "centered"], ["square"]),
        node("ReduceMean", ["square", "axes"], ["var"]), node("Add", ["var", "eps"], ["vare"]),
        node("Sqrt", ["vare"], ["std"]), node("Div", ["centered", "std"], ["n"]),
        node("Reshape", ["n", "ungrouped"], ["nb"]), node("Mul", ["nb", "gamma"], ["scaled"]),
        node("Add", ["scaled", "beta"], ["affine"]), node("Conv", ["affine", "w2"], ["y"])],
        {"x": ((2, 8, 6, 7), "float32")}, ["y"],
        {"w1": np.random.default_rng(31).standard_normal((8, 8, 3, 3)).astype(f32),
         "grouped": np.array([2, groups, 8 // groups, 6, 7], np.int64),
         "axes": np.array([2, 3, 4], np.int64), "eps": np.array(1e-5, f32),
         "ungrouped": np.array([2, 8, 6, 7], np.int64),
         "gamma": np.random.default_rng(32).standard_normal((8, 1, 1)).astype(f32),
         "beta": np.random.default_rng(33).standard_normal((8, 1, 1)).astype(f32),
         "w2": np.random.default_rng(34).standard_normal((8, 8, 1, 1)).astype(f32)}, rtol=1e-4, atol=1e-4)
      for groups in (1, 2)],
    # An audio feature extractor (HuBERT's: strided 1-D convolutions, a layer norm over the
    # channels between transposes, GELU) then SqueezeBERT's grouped 1x1 Conv1d: the convolutions
    # and the GELU are stored channels-last [n, l, c] (test_codegen checks the plan).
    graph_case("conv1d-layernorm-gelu-conv1d", [
        node("Conv", ["x", "w1"], ["c1"], kernel_shape=[10], strides=[5]),
        node("Transpose", ["c1"], ["t1"], perm=[0, 2, 1]), node("LayerNormalization", ["t1", "g", "b"], ["n1"], axis=-1),
        node("Transpose", ["n1"], ["u1"], perm=[0, 2, 1]), node("Gelu", ["u1"], ["a1"]),
        node("Conv", ["a1", "w2"], ["c2"], kernel_shape=[3], strides=[2]),
        node("Transpose", ["c2"], ["t2"], perm=[0, 2, 1]), node("LayerNormalization", ["t2", "g", "b"], ["n2"], axis=-1),
        node("Transpose", ["n2"], ["u2"], perm=[0, 2, 1]), node("Conv", ["u2", "w3", "b3"], ["y"], group=2)],
        {"x": ((1, 1, 403), "float32")}, ["y"],
        {"w1": np.random.default_rng(41).standard_normal((32, 1, 10)).astype(f32),
         "w2": (np.random.default_rng(42).standard_normal((32, 32, 3)) / 8).astype(f32),
         "w3": (np.random.default_rng(43).standard_normal((32, 16, 1)) / 4).astype(f32),
         "b3": np.random.default_rng(44).standard_normal((32,)).astype(f32),
         "g": np.random.default_rng(45).standard_normal((32,)).astype(f32),
         "b": np.random.default_rng(46).standard_normal((32,)).astype(f32)}, rtol=1e-4, atol=1e-4),
    # A residual block: convolutions and the activations between them are stored channels-last
    # (an NCHW input with >= 8 channels is copied NHWC first; the outputs come back dense NCHW).
    graph_case("conv-residual-block-channels-last", [
        node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), node("Relu", ["c1"], ["r1"]),
        node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]), node("Add", ["c2", "x"], ["s"]),
        node("Relu", ["s"], ["r2"]), node("Conv", ["r2", "w3"], ["c3"], strides=[2, 2]),
        node("Sigmoid", ["c3"], ["y"])],
        {"x": ((2, 8, 7, 9), "float32")}, ["y", "r2"],
        {"w1": np.random.default_rng(5).standard_normal((8, 8, 3, 3)).astype(f32),
         "w2": np.random.default_rng(6).standard_normal((8, 8, 3, 3)).astype(f32),
         "b2": np.random.default_rng(7).standard_normal((8,)).astype(f32),
         "w3": np.random.default_rng(8).standard_normal((16, 8, 1, 1)).astype(f32)}, rtol=1e-4, atol=1e-4),
    # The same with >= 64 channels: the runtime computes the 3x3 convolutions with Winograd F(2x2, 3x3)
    # (odd sizes: the edge tiles are partial; the first conv's sum epilogue, the second's bias + ReLU).
    graph_case("conv-residual-block-winograd", [
        node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]), node("Relu", ["c1"], ["r1"]),
        node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]), node("Add", ["c2", "x"], ["s"]),
        node("Relu", ["s"], ["r2"]), node("Conv", ["r2", "w3"], ["y"])],
        {"x": ((2, 64, 9, 7), "float32")}, ["y", "r2"],
        {"w1": (np.random.default_rng(11).standard_normal((64, 64, 3, 3)) / 24).astype(f32),
         "b1": np.random.default_rng(12).standard_normal((64,)).astype(f32),
         "w2": (np.random.default_rng(13).standard_normal((64, 64, 3, 3)) / 24).astype(f32),
         "w3": np.random.default_rng(14).standard_normal((8, 64, 1, 1)).astype(f32)}, rtol=1e-4, atol=1e-4),
    # MobileNetV2's expansion: a 1x1 convolution + ReLU6 (reading a channels-last input) read only
    # by a depthwise one (TF padding, stride 2): one rt->conv_pair call, computed together by the
    # runtime (an expanded tensor of 768 KB); then the projection.
    graph_case("conv-expand-depthwise-pair", [
        node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1]),
        node("Conv", ["c0", "w1", "b1"], ["c1"]), node("Clip", ["c1", "lo", "hi"], ["e"]),
        node("Conv", ["e", "w2", "b2"], ["c2"], group=48, strides=[2, 2], pads=[0, 0, 1, 1]),
        node("Clip", ["c2", "lo", "hi"], ["d"]), node("Conv", ["d", "w3"], ["y"])],
        {"x": ((1, 8, 64, 64), "float32")}, ["y"],
        {"w0": (np.random.default_rng(20).standard_normal((8, 8, 3, 3)) / 8).astype(f32),
         "w1": (np.random.default_rng(21).standard_normal((48, 8, 1, 1)) / 3).astype(f32),
         "b1": np.random.default_rng(22).standard_normal((48,)).astype(f32),
         "w2": (np.random.default_rng(23).standard_normal((48, 1, 3, 3)) / 3).astype(f32),
         "b2": np.random.default_rng(24).standard_normal((48,)).astype(f32),
         "w3": (np.random.default_rng(25).standard_normal((8, 48, 1, 1)) / 7).astype(f32),
         "lo": np.array(0.0, f32), "hi": np.array(6.0, f32)}, rtol=1e-4, atol=1e-4),
    # A ResNet stem: the padded input and the window reduction of the pooling are channels-last too.
    graph_case("conv-maxpool-conv-channels-last", [
        node("Conv", ["x", "w1"], ["c1"], pads=[3, 3, 3, 3], strides=[2, 2]), node("Relu", ["c1"], ["r1"]),
        node("MaxPool", ["r1"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        node("Conv", ["p", "w2"], ["c2"], pads=[1, 1, 1, 1]), node("Add", ["c2", "p"], ["y"])],
        {"x": ((1, 3, 21, 19), "float32")}, ["y"],
        {"w1": np.random.default_rng(9).standard_normal((16, 3, 7, 7)).astype(f32),
         "w2": np.random.default_rng(10).standard_normal((16, 16, 3, 3)).astype(f32)}, rtol=1e-4, atol=1e-4),
    # The same with a Sigmoid before the pool: overlapping windows would compute it ~2.25 times per
    # element read inline, so the padded copy stays stored.
    graph_case("conv-sigmoid-maxpool-conv", [
        node("Conv", ["x", "w1"], ["c1"], pads=[3, 3, 3, 3], strides=[2, 2]), node("Sigmoid", ["c1"], ["r1"]),
        node("MaxPool", ["r1"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        node("Conv", ["p", "w2"], ["y"], pads=[1, 1, 1, 1])],
        {"x": ((1, 3, 21, 19), "float32")}, ["y"],
        {"w1": np.random.default_rng(9).standard_normal((16, 3, 7, 7)).astype(f32),
         "w2": np.random.default_rng(10).standard_normal((16, 16, 3, 3)).astype(f32)}, rtol=1e-4, atol=1e-4),
    # A squeeze-and-excitation block (EfficientNet, RegNet): a global mean over the channels-last
    # swish output between convolutions, read along the channels in the window form (two blocks
    # of 16 channels, one per thread; the sum above: three blocks of 16).
    graph_case("conv-swish-squeeze-excitation-conv", [
        node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), node("Sigmoid", ["c1"], ["s1"]),
        node("Mul", ["c1", "s1"], ["a"]), node("ReduceMean", ["a", "hw"], ["m"], keepdims=1),
        node("Sigmoid", ["m"], ["g"]), node("Mul", ["a", "g"], ["e"]), node("Conv", ["e", "w2"], ["y"])],
        {"x": ((1, 3, 40, 36), "float32")}, ["y"],
        {"w1": np.random.default_rng(11).standard_normal((32, 3, 3, 3)).astype(f32),
         "w2": np.random.default_rng(12).standard_normal((8, 32, 1, 1)).astype(f32),
         "hw": arr([2, 3], i64)}, rtol=1e-4, atol=1e-4),
    # A ResNet's last block: the residual sum's ReLU, read from two channels-last convolutions,
    # is a graph output (NCHW): a tiled transpose (loops.emit_transposing); with 12 channels (no
    # block of 8 divides them) the plain loop. An output transposing another one, copied in tiles.
    *[graph_case(f"conv-residual-relu-nchw-output-{c}", [
        node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), node("Conv", ["c1", "w2"], ["c2"]),
        node("Conv", ["c1", "w3"], ["c3"]), node("Add", ["c2", "c3"], ["s"]), node("Relu", ["s"], ["y"])],
        {"x": ((1, 3, 9, 7), "float32")}, ["y"],
        {"w1": np.random.default_rng(15).standard_normal((8, 3, 3, 3)).astype(f32),
         "w2": np.random.default_rng(16).standard_normal((c, 8, 1, 1)).astype(f32),
         "w3": np.random.default_rng(17).standard_normal((c, 8, 1, 1)).astype(f32)}, rtol=1e-4, atol=1e-4)
      for c in (48, 12)],
    graph_case("output-transposing-output", [node("Exp", ["x"], ["y1"]), node("Transpose", ["y1"], ["y2"], perm=[0, 2, 1])],
               {"x": ((2, 5, 40), "float32")}, ["y1", "y2"]),
    # RegNet-Y's: the mean reads the ReLU of the convolution inline.
    graph_case("conv-relu-squeeze-excitation-conv", [
        node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), node("Relu", ["c1"], ["a"]),
        node("ReduceMean", ["a", "hw"], ["m"], keepdims=1), node("Sigmoid", ["m"], ["g"]),
        node("Mul", ["a", "g"], ["e"]), node("Conv", ["e", "w2"], ["y"])],
        {"x": ((1, 3, 40, 36), "float32")}, ["y"],
        {"w1": np.random.default_rng(13).standard_normal((48, 3, 3, 3)).astype(f32),
         "w2": np.random.default_rng(14).standard_normal((8, 48, 1, 1)).astype(f32),
         "hw": arr([2, 3], i64)}, rtol=1e-4, atol=1e-4),
    # ResNet's first block: the residual is the max pool's output, a reshaped view of its window
    # reduction, which the second convolution's epilogue adds (asymmetric pool pads: the pad's
    # border fill is one slab per side).
    graph_case("conv-maxpool-residual-epilogue", [
        node("Conv", ["x", "w1"], ["c1"], pads=[3, 3, 3, 3], strides=[2, 2]), node("Relu", ["c1"], ["r1"]),
        node("MaxPool", ["r1"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[0, 1, 2, 1]),
        node("Conv", ["p", "w2"], ["c2"], pads=[1, 1, 1, 1]), node("Relu", ["c2"], ["r2"]),
        node("Conv", ["r2", "w3"], ["c3"], pads=[1, 1, 1, 1]), node("Add", ["c3", "p"], ["s"]),
        node("Relu", ["s"], ["r3"]), node("Conv", ["r3", "w4"], ["y"], strides=[2, 2])],
        {"x": ((2, 3, 21, 19), "float32")}, ["y"],
        {"w1": np.random.default_rng(31).standard_normal((16, 3, 7, 7)).astype(f32),
         "w2": np.random.default_rng(32).standard_normal((16, 16, 3, 3)).astype(f32),
         "w3": np.random.default_rng(33).standard_normal((16, 16, 3, 3)).astype(f32),
         "w4": np.random.default_rng(34).standard_normal((8, 16, 1, 1)).astype(f32)}, rtol=1e-4, atol=1e-4),
    # EfficientNet's MBConv block: each SiLU (Sigmoid then Mul, either order) is the epilogue of the
    # convolution before it: the 1x1 expansion's and the depthwise one's, called together
    # (conv_pair, a 614 KB expansion), and the squeeze's (a 1x1 on a 1x1 image); the gate's Sigmoid
    # stays a loop. NaN and infinities (silu(-inf) = -inf * 0 is NaN) go through every kernel.
    graph_case("conv-silu-efficientnet-block", [
        node("Conv", ["x", "w1", "b1"], ["c1"]), node("Sigmoid", ["c1"], ["s1"]), node("Mul", ["c1", "s1"], ["a1"]),
        node("Conv", ["a1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], group=96), node("Sigmoid", ["c2"], ["s2"]),
        node("Mul", ["s2", "c2"], ["a2"]), node("ReduceMean", ["a2", "hw"], ["m"], keepdims=1),
        node("Conv", ["m", "w3", "b3"], ["c3"]), node("Sigmoid", ["c3"], ["s3"]), node("Mul", ["c3", "s3"], ["a3"]),
        node("Conv", ["a3", "w4", "b4"], ["c4"]), node("Sigmoid", ["c4"], ["g"]), node("Mul", ["a2", "g"], ["e"]),
        node("Conv", ["e", "w5"], ["c5"]), node("Add", ["c5", "x"], ["y"])],
        {"x": ((1, 16, 40, 40), "float32")}, ["y"],
        {"w1": (np.random.default_rng(40).standard_normal((96, 16, 1, 1)) / 4).astype(f32),
         "b1": np.random.default_rng(41).standard_normal((96,)).astype(f32),
         "w2": (np.random.default_rng(42).standard_normal((96, 1, 3, 3)) / 3).astype(f32),
         "b2": np.random.default_rng(43).standard_normal((96,)).astype(f32),
         "w3": (np.random.default_rng(44).standard_normal((4, 96, 1, 1)) / 10).astype(f32),
         "b3": np.random.default_rng(45).standard_normal((4,)).astype(f32),
         "w4": (np.random.default_rng(46).standard_normal((96, 4, 1, 1)) / 2).astype(f32),
         "b4": np.random.default_rng(47).standard_normal((96,)).astype(f32),
         "w5": (np.random.default_rng(48).standard_normal((16, 96, 1, 1)) / 10).astype(f32),
         "hw": arr([2, 3], i64)},
        values={"x": np.where(np.arange(16 * 40 * 40).reshape(1, 16, 40, 40) % 997 == 5, np.nan,
                              np.where(np.arange(16 * 40 * 40).reshape(1, 16, 40, 40) % 991 == 3, -np.inf,
                                       np.random.default_rng(49).standard_normal((1, 16, 40, 40)) * 3)).astype(f32)},
        rtol=1e-4, atol=1e-4),
    # SiLU after a residual sum (YOLO's bottlenecks) is that convolution's epilogue, with the sum; a
    # convolution that is also a graph output keeps its SiLU a loop, as does a Sigmoid read twice
    # (y3's Mul and the output y4) and a Mul of the sigmoid of another value.
    graph_case("conv-silu-forms", [
        node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), node("Add", ["c1", "x"], ["r"]),
        node("Sigmoid", ["r"], ["s1"]), node("Mul", ["r", "s1"], ["y1"]),
        node("Conv", ["x", "w2"], ["y2"]), node("Sigmoid", ["y2"], ["s2"]), node("Mul", ["y2", "s2"], ["y5"]),
        node("Conv", ["x", "w3"], ["c3"]), node("Sigmoid", ["c3"], ["y4"]), node("Mul", ["c3", "y4"], ["y3"]),
        node("Conv", ["x", "w4"], ["c4"]), node("Sigmoid", ["x"], ["s4"]), node("Mul", ["c4", "s4"], ["y6"])],
        {"x": ((2, 8, 7, 9), "float32")}, ["y1", "y2", "y3", "y4", "y5", "y6"],
        {"w1": np.random.default_rng(50).standard_normal((8, 8, 3, 3)).astype(f32),
         "w2": np.random.default_rng(51).standard_normal((8, 8, 1, 1)).astype(f32),
         "w3": np.random.default_rng(52).standard_normal((8, 8, 1, 1)).astype(f32),
         "w4": np.random.default_rng(53).standard_normal((8, 8, 1, 1)).astype(f32)}, rtol=1e-4, atol=1e-4),
    # A sum epilogue's addend that is a graph output computed after the convolution (ONNX node
    # order): the convolution must not read it before its kernel ran, so the sum stays a loop.
    graph_case("conv-epilogue-addend-computed-later", [
        node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), node("Mul", ["x2", "two"], ["z"]),
        node("Add", ["c", "z"], ["s"]), node("Relu", ["s"], ["y"])],
        {"x": ((1, 8, 6, 6), "float32"), "x2": ((1, 8, 6, 6), "float32")}, ["y", "z"],
        {"w": np.random.default_rng(15).standard_normal((8, 8, 3, 3)).astype(f32), "two": np.asarray(2.0, f32)},
        rtol=1e-4, atol=1e-4),
    # MobileNetV2's inverted residual block: each Clip (ReLU6, lowered to Max then Min) is the
    # epilogue of the convolution before it (1x1 as a GEMM, depthwise, both channels-last); NaN and
    # infinities in the input go through every kernel's clamp.
    graph_case("conv-clip-mobilenet-block", [
        node("Conv", ["x", "w1", "b1"], ["c1"]), node("Clip", ["c1", "zero", "six"], ["r1"]),
        node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], group=48),
        node("Clip", ["c2", "zero", "six"], ["r2"]), node("Conv", ["r2", "w3", "b3"], ["c3"]),
        node("Add", ["c3", "x"], ["y"])],
        {"x": ((2, 16, 9, 7), "float32")}, ["y"],
        {"w1": (np.random.default_rng(16).standard_normal((48, 16, 1, 1)) / 2).astype(f32),
         "b1": np.random.default_rng(17).standard_normal((48,)).astype(f32),
         "w2": np.random.default_rng(18).standard_normal((48, 1, 3, 3)).astype(f32),
         "b2": np.random.default_rng(19).standard_normal((48,)).astype(f32),
         "w3": (np.random.default_rng(20).standard_normal((16, 48, 1, 1)) / 4).astype(f32),
         "b3": np.random.default_rng(21).standard_normal((16,)).astype(f32),
         "zero": np.asarray(0.0, f32), "six": np.asarray(6.0, f32)},
        values={"x": np.where(np.arange(2 * 16 * 9 * 7).reshape(2, 16, 9, 7) % 97 == 5, np.nan,
                              np.where(np.arange(2 * 16 * 9 * 7).reshape(2, 16, 9, 7) % 89 == 3, -np.inf,
                                       np.random.default_rng(22).standard_normal((2, 16, 9, 7)) * 3)).astype(f32)},
        rtol=1e-4, atol=1e-4),
    # Clamps in the forms the plan absorbs (clamp_min, clamp_max, after a residual sum, NCHW graph
    # outputs) and one it must not: Max(lo, conv) keeps lo on a tie, not the conv's value.
    graph_case("conv-clamp-forms", [
        node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), node("Max", ["c1", "lo"], ["y1"]),
        node("Conv", ["x", "w2"], ["c2"], pads=[1, 1, 1, 1]), node("Min", ["c2", "hi"], ["y2"]),
        node("Conv", ["x", "w3"], ["c3"], pads=[1, 1, 1, 1]), node("Max", ["lo", "c3"], ["y3"]),
        node("Conv", ["x", "w4"], ["c4"], pads=[1, 1, 1, 1]), node("Add", ["c4", "x"], ["s4"]),
        node("Clip", ["s4", "lo", "hi"], ["y4"])],
        {"x": ((1, 8, 6, 5), "float32")}, ["y1", "y2", "y3", "y4"],
        {**{f"w{k}": np.random.default_rng(22 + k).standard_normal((8, 8, 3, 3)).astype(f32) for k in range(1, 5)},
         "lo": np.asarray(-0.5, f32), "hi": np.asarray(0.8, f32)},
        values={"x": np.where(np.arange(240).reshape(1, 8, 6, 5) % 41 == 7, np.nan,
                              np.random.default_rng(27).standard_normal((1, 8, 6, 5))).astype(f32)},
        rtol=1e-4, atol=1e-4),
    op_case("MaxPool", [(2, 3, 9, 8)], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
    op_case("MaxPool", [(1, 2, 7, 7)], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, name="MaxPool-ceil"),
    op_case("MaxPool", [(1, 2, 8)], kernel_shape=[3], dilations=[2], name="MaxPool-1d-dilated"),
    # Outputs with an innermost dim >= 8 and small windows take the window form of reductions.
    op_case("MaxPool", [(1, 2, 20, 22)], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
            name="MaxPool-window-form"),
    op_case("MaxPool", [(1, 1, 3, 10)], kernel_shape=[2, 2], pads=[1, 1, 1, 1],
            values={"x0": arr([[[[1, -5] + [0] * 8, [2] * 10, [-np.inf] * 9 + [3]]]], f32)},
            name="MaxPool-window-form-inf"),
    op_case("ReduceSum", [(2, 5, 16)], arr([1], i64), name="ReduceSum-window-form"),
    op_case("ReduceMin", [(4, 9)], arr([0], i64), values={"x0": np.where(np.arange(36).reshape(4, 9) == 13, np.nan,
                                                                        np.arange(36).reshape(4, 9) % 7).astype(f32)},
            name="ReduceMin-window-form-nan"),
    op_case("AveragePool", [(1, 2, 18, 18)], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="AveragePool-window-form"),
    # Large windows over a stored input whose innermost dim is an output dim also take the window
    # form (loops.py: _large_window_along_row; test_codegen checks its float sum's precision):
    # a sum, NaN and inf through max, an integer sum.
    op_case("ReduceSum", [(2, 64, 48)], arr([1], i64), name="ReduceSum-large-window-along-row"),
    op_case("ReduceMax", [(2, 40, 12)], arr([1], i64),
            values={"x0": np.where(np.arange(960).reshape(2, 40, 12) % 97 == 5, np.nan,
                                   np.where(np.arange(960).reshape(2, 40, 12) % 89 == 3, np.inf,
                                            np.random.default_rng(42).standard_normal((2, 40, 12)))).astype(f32)},
            name="ReduceMax-large-window-nan"),
    op_case("ReduceSum", [(3, 50, 9)], arr([1], i64), dtypes=["int64"], name="ReduceSum-large-window-int64"),
    op_case("AveragePool", [(2, 3, 8, 8)], kernel_shape=[2, 2], strides=[2, 2]),
    op_case("AveragePool", [(1, 2, 7, 6)], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="AveragePool-pad-exclude"),
    op_case("AveragePool", [(1, 2, 7, 6)], kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1,
            name="AveragePool-pad-include"),
    op_case("GlobalAveragePool", [(2, 3, 5, 4)]),
    # Windows that are a run of memory (trailing dims of a stored input) sum along the run in one
    # loop: an NCHW global pool with channels enough for the window form, a max with NaN, a mean
    # without kept dims, and dims that merge but do not end at stride 1 (not a run).
    op_case("GlobalAveragePool", [(2, 40, 5, 5)], name="GlobalAveragePool-run"),
    op_case("ReduceMax", [(2, 12, 3, 4)], arr([2, 3], i64),
            values={"x0": np.where(np.arange(288).reshape(2, 12, 3, 4) % 53 == 7, np.nan,
                                   np.random.default_rng(31).standard_normal((2, 12, 3, 4))).astype(f32)},
            name="ReduceMax-run-nan"),
    op_case("ReduceMean", [(2, 9, 3, 7)], arr([2, 3], i64), keepdims=0, name="ReduceMean-run-no-keepdims"),
    op_case("ReduceSum", [(3, 4, 5, 2)], arr([1, 2], i64), name="ReduceSum-merged-not-run"),
    op_case("Pad", [(2, 3, 4)], arr([0, 1, 2, 0, 2, 1], i64), arr(1.5, f32)),
    op_case("Pad", [(2, 3, 4)], arr([0, 1, 2, 0, 2, 1], i64), mode="reflect", name="Pad-reflect"),
    op_case("Pad", [(2, 3, 4)], arr([1, 0, 0, 2], i64), None, arr([0, 2], i64), mode="edge", name="Pad-edge-axes"),
    # fused chains
    graph_case("silu-bias", [node("Sigmoid", ["x"], ["s"]), node("Mul", ["x", "s"], ["m"]),
                             node("Add", ["m", "b"], ["y"])],
               {"x": ((8, 16), "float32")}, ["y"], {"b": np.linspace(-1, 1, 16).astype(f32)}),
    graph_case("attention", [
        node("MatMul", ["x", "wq"], ["q0"]), node("Add", ["q0", "bq"], ["q1"]),
        node("Reshape", ["q1", "heads"], ["q2"]), node("Transpose", ["q2"], ["q"], perm=[0, 2, 1, 3]),
        node("Transpose", ["q2"], ["kt"], perm=[0, 2, 3, 1]),
        node("MatMul", ["q", "kt"], ["s0"]), node("Mul", ["s0", "scale"], ["s1"]),
        node("Softmax", ["s1"], ["p"], axis=-1), node("MatMul", ["p", "q"], ["o0"]),
        node("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3]), node("Reshape", ["o1", "flat"], ["y"])],
        {"x": ((2, 7, 16), "float32")}, ["y"],
        {"wq": np.random.default_rng(2).standard_normal((16, 16)).astype(f32) * 0.3,
         "bq": np.random.default_rng(3).standard_normal(16).astype(f32),
         "heads": arr([2, 7, 4, 4], i64), "flat": arr([2, 7, 16], i64), "scale": arr(0.5, f32)},
        rtol=1e-4, atol=1e-5),
    graph_case("layernorm-gelu-residual", [
        node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1), node("Gelu", ["n"], ["a"]),
        node("Add", ["a", "x"], ["y"]), node("ReduceMean", ["y", "ax"], ["z"], keepdims=0)],
        {"x": ((3, 40), "float32")}, ["y", "z"],
        {"g": np.linspace(0.5, 1.5, 40).astype(f32), "b": np.linspace(-0.1, 0.1, 40).astype(f32),
         "ax": arr([0], i64)}, rtol=1e-4, atol=1e-5),
    graph_case("transposed-matmul-operands", [
        node("Transpose", ["a"], ["at"], perm=[0, 2, 1]), node("Transpose", ["b"], ["bt"], perm=[1, 0]),
        node("MatMul", ["at", "bt"], ["y"])],
        {"a": ((2, 5, 4), "float32"), "b": ((3, 5), "float32")}, ["y"], rtol=1e-4),
    # Attention's output: the batched matmul is written in the permuted order, the reshape is free.
    graph_case("matmul-permuted-output", [node("MatMul", ["a", "b"], ["m"]),
                                          node("Transpose", ["m"], ["t"], perm=[0, 2, 1, 3]),
                                          node("Reshape", ["t", "shape"], ["r"]), node("Relu", ["r"], ["y"])],
               {"a": ((2, 3, 4, 5), "float32"), "b": ((2, 3, 5, 6), "float32")}, ["y"],
               {"shape": arr([2, 4, 18], i64)}, rtol=1e-4),
    # GPT-2's heads: one biased projection [seq, 3 * heads * dim] split into q, k and v by views. The
    # projection's GEMM adds the bias itself (C filled with it, beta 1), the fused attention reads
    # each head in place, and the masked softmax's max is the one its fully-masked-row check reads.
    graph_case("attention-heads-of-a-fused-projection", [
        node("MatMul", ["x", "w"], ["p"]), node("Add", ["p", "b"], ["qkv"]),
        node("Reshape", ["qkv", "split"], ["r"]), node("Transpose", ["r"], ["h"], perm=[1, 2, 0, 3]),
        *[node("Slice", ["h", f"s{i}", f"s{i + 1}", "ax0"], [z]) for i, z in enumerate("qkv")],
        node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], ["s"]),
        node("Where", ["keep", "s", "ninf"], ["ms"]), node("Softmax", ["ms"], ["a"], axis=-1),
        node("ReduceMax", ["ms", "ax3"], ["peak"], keepdims=1), node("Equal", ["peak", "ninf"], ["none"]),
        node("Where", ["none", "zero", "a"], ["pa"]), node("MatMul", ["pa", "v"], ["y"])],
        {"x": ((6, 8), "float32"), "keep": ((6, 6), "bool")}, ["y"],
        {"w": np.random.default_rng(1).standard_normal((8, 24)).astype(f32),
         "b": np.linspace(-1, 1, 24).astype(f32), "split": arr([6, 3, 2, 4], i64),
         "s0": arr([0], i64), "s1": arr([1], i64), "s2": arr([2], i64), "s3": arr([3], i64),
         "ax0": arr([0], i64), "ax3": arr([3], i64), "ninf": arr(-np.inf, f32), "zero": arr(0, f32)},
        values={"keep": np.tril(np.ones((6, 6), bool)) & np.array([1, 1, 1, 1, 1, 0], bool)[:, None]},
        rtol=1e-4),
    # T5's heads: an unbiased projection split the same way, a constant position bias added to the
    # scores. Each head's operand is a plain view of the projection, read in place.
    graph_case("attention-heads-of-an-unbiased-projection", [
        node("MatMul", ["x", "w"], ["qkv"]),
        node("Reshape", ["qkv", "split"], ["r"]), node("Transpose", ["r"], ["h"], perm=[1, 2, 0, 3]),
        *[node("Slice", ["h", f"s{i}", f"s{i + 1}", "ax0"], [z]) for i, z in enumerate("qkv")],
        node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], ["s"]),
        node("Add", ["s", "bias"], ["sb"]), node("Softmax", ["sb"], ["a"], axis=-1),
        node("MatMul", ["a", "v"], ["y"])],
        {"x": ((6, 8), "float32")}, ["y"],
        {"w": np.random.default_rng(2).standard_normal((8, 24)).astype(f32), "split": arr([6, 3, 2, 4], i64),
         "s0": arr([0], i64), "s1": arr([1], i64), "s2": arr([2], i64), "s3": arr([3], i64),
         "ax0": arr([0], i64), "bias": np.random.default_rng(3).standard_normal((1, 2, 6, 6)).astype(f32)},
        rtol=1e-4),
    # BERT's padding mask: And(row mask, column mask) [1, 1, s, s] broadcast over the heads of two
    # attentions. The plan stores it once and each fused call reads it with head stride 0 (no dense
    # copy per attention); the masked fill is finite, so the fully masked row is uniform, not NaN.
    graph_case("attention-masks-broadcast-over-heads", [
        node("And", ["rows", "pad"], ["keep"]),
        *[n for layer in ("a", "b") for n in (
            node("MatMul", ["x", f"w{layer}"], [f"p{layer}"]), node("Reshape", [f"p{layer}", "heads"], [f"r{layer}"]),
            node("Transpose", [f"r{layer}"], [f"q{layer}"], perm=[0, 2, 1, 3]),
            node("Transpose", [f"r{layer}"], [f"kt{layer}"], perm=[0, 2, 3, 1]),
            node("MatMul", [f"q{layer}", f"kt{layer}"], [f"s{layer}"]), node("Mul", [f"s{layer}", "scale"], [f"m{layer}"]),
            node("Where", ["keep", f"m{layer}", "fill"], [f"k{layer}"]),
            node("Softmax", [f"k{layer}"], [f"a{layer}"], axis=-1),
            node("MatMul", [f"a{layer}", f"q{layer}"], [f"y{layer}"]))]],
        {"x": ((1, 6, 8), "float32"), "pad": ((1, 1, 1, 6), "bool")}, ["ya", "yb"],
        {"wa": np.random.default_rng(4).standard_normal((8, 8)).astype(f32) * 0.3,
         "wb": np.random.default_rng(5).standard_normal((8, 8)).astype(f32) * 0.3,
         "heads": arr([1, 6, 2, 4], i64), "scale": arr(0.5, f32), "fill": arr(-1e4, f32),
         "rows": arr([1, 1, 1, 1, 1, 0], bool).reshape(1, 1, 6, 1)},
        values={"pad": arr([1, 1, 1, 1, 0, 1], bool).reshape(1, 1, 1, 6)}, rtol=1e-4, atol=1e-5),
    graph_case("shared-exp-two-outputs", [node("Exp", ["x"], ["e"]), node("Add", ["e", "e"], ["y"]),
                                          node("Neg", ["e"], ["z"])],
               {"x": ((5, 6), "float32")}, ["y", "z", "e"]),
    graph_case("outputs-alias", [node("Identity", ["x"], ["y"])], {"x": ((3,), "float32")},
               ["y", "x", "c", "y"], {"c": np.arange(100, dtype=f32)}),
    graph_case("sliced-concat-of-expanded", [
        node("Expand", ["x", "shape"], ["e"]), node("Slice", ["e", "st", "en", "ax", "sp"], ["s"]),
        node("Concat", ["s", "e"], ["y"], axis=1), node("ReduceMax", ["y"], ["z"], keepdims=1)],
        {"x": ((1, 5), "float32")}, ["y", "z"],
        {"shape": arr([3, 5], i64), "st": arr([4], i64), "en": arr([-100], i64), "ax": arr([1], i64),
         "sp": arr([-2], i64)}),
    # a row max read across rows (y[i, j] = x[i, j] + max(x[j, :])): must not join the max's row loop
    graph_case("cross-row-read", [node("ReduceMax", ["x", "ax"], ["m"], keepdims=1),
                                  node("Transpose", ["m"], ["mt"], perm=[1, 0]), node("Add", ["x", "mt"], ["y"])],
               {"x": ((9, 9), "float32")}, ["y"], {"ax": arr([1], i64)}),
    # outputs reshaping a stored node (group_norm's last step): the first is written into output 0
    # directly (plan.reshaped_source); the second reshape of it and a third of an input are copies
    graph_case("outputs-reshape-a-stored-node",
               [node("Reshape", ["x", "groups"], ["g"]), node("ReduceMean", ["g", "ax"], ["m"], keepdims=1),
                node("Sub", ["g", "m"], ["d"]), node("Reshape", ["d", "flat"], ["y"]),
                node("Reshape", ["d", "flat"], ["y2"]), node("Reshape", ["x", "flat"], ["y3"])],
               {"x": ((4, 12), "float32")}, ["y", "y2", "y3"],
               {"groups": arr([4, 3, 4], i64), "ax": arr([2], i64), "flat": arr([4, 12, 1], i64)}),
    # Shape and Range on static shapes (run-time sizes: test_run_time_sizes.py): constants
    graph_case("shape-range", [node("Shape", ["x"], ["sh"], start=1, end=2), node("Squeeze", ["sh", "ax"], ["n"]),
                               node("Range", ["zero", "n", "one"], ["r"]), node("Cast", ["r"], ["rf"], to=1),
                               node("Add", ["x", "rf"], ["y"]), node("Range", ["zero", "seven", "two"], ["z"])],
               {"x": ((3, 8), "float32")}, ["y", "z"],
               {"ax": arr([0], i64), "zero": np.array(0, i64), "one": np.array(1, i64), "two": np.array(2, i64), "seven": np.array(7, i64)}),
]
ERRORS = {"Gather-out-of-range": "BLADE_ERR_INDEX_OUT_OF_RANGE",   # expected run-time errors
          "Div-int64-by-zero": "BLADE_ERR_DIVISION_BY_ZERO"}
assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    return compile_cases(CASES, tmp_path_factory.mktemp("engine_ops"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_op(case, compiled):
    if case.name in ERRORS:
        with pytest.raises(EngineRunError, match=ERRORS[case.name]):
            run_case(case, *compiled[case.name])
    else:
        check_case(case, compiled[case.name])


UNARY_EPILOGUES = {  # BLADE_ACTIVATION_* kind: the engine's own loop computing it
    "silu": (3, [node("Sigmoid", ["x"], ["s"]), node("Mul", ["x", "s"], ["y"])]),
    "gelu": (4, [node("Gelu", ["x"], ["y"])])}


@pytest.mark.parametrize("activation", sorted(UNARY_EPILOGUES))
@pytest.mark.parametrize("kernel", ["patch", "depthwise", "nchw"])
def test_the_runtime_unary_epilogues_are_the_engines_bitwise(kernel, activation, tmp_path):
    """A convolution's SiLU and GELU epilogues (the runtime's, BLADE_ACTIVATION_SILU and _GELU)
    give the floats of the engine's own Mul(v, Sigmoid(v)) and Gelu(v) loops over the whole float
    range (`wide`: flushes, overflows, infinities, NaN): a 1x1 convolution of weight 1 passes v
    through to the epilogue on the patch kernel (one channel), the depthwise kernel (groups =
    channels) and an NCHW output's path."""
    import torch
    from blade._C import _testing
    shape = (1, 17, 1, wide.size // 17)   # 1411 values
    kind, nodes = UNARY_EPILOGUES[activation]
    (case,) = [graph_case(activation, nodes, {"x": (shape, "float32")}, ["y"], values={"x": wide.reshape(shape)})]
    (engine_values,) = run_case(case, *compile_cases([case], tmp_path)[activation])
    x = torch.from_numpy(wide.reshape(shape))
    channels_last = torch.channels_last
    if kernel == "patch":
        x, weight, groups, layout = x.reshape(1, 1, 1, -1).contiguous(memory_format=channels_last), torch.ones(1, 1, 1, 1), 1, 3
    elif kernel == "depthwise":
        x, weight, groups, layout = x.contiguous(memory_format=channels_last), torch.ones(17, 1, 1, 1), 17, 3
    else:
        x, weight, groups, layout = x.reshape(1, 1, 1, -1), torch.ones(1, 1, 1, 1), 1, 0
    out = torch.full(x.shape, 7.0).contiguous(memory_format=channels_last if layout else torch.contiguous_format)
    before = _testing.conv_kernel_calls(kernel) if kernel != "nchw" else 0
    _testing.conv(x, weight, None, [1, 1], [0, 0, 0, 0], [1, 1], groups, out, layout, True, None, kind)
    if kernel != "nchw":
        assert _testing.conv_kernel_calls(kernel) == before + 1
    np.testing.assert_array_equal(out.contiguous().reshape(shape).numpy(), engine_values)
