"""Every elementwise op's loop vectorizes (g++'s -fopt-info report, not a timing): a scalar op in a
fused loop makes the whole loop scalar (a chain with std::log ran 2.8x slower than eager).

The ops come from the engine's own table (ir.ELEMENTWISE): an op without an entry in SIGNATURES
fails by name, so a new op cannot slip in unchecked. All ops and dtypes are nodes of one model (one
compile); each node is an output, so each gets its own loop, named by its kernel comment.
"""
from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

import blade
from blade.engine import expressions, ir
from blade.engine.compiler import compile_onnx
from onnx_cases import graph_case, run_case
from vectorization import compile_with_report, functions_and_loops, short_loops

FLOATS = ("float32", "float64")
NUMERIC = ("float32", "float64", "int64", "int32")
ALL = NUMERIC + ("bool",)
# op -> (number of operands, dtypes of the operands it is compiled for)
SIGNATURES = {
    **{op: (2, NUMERIC) for op in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min",
                                   "Less", "LessOrEqual", "Greater", "GreaterOrEqual")},
    "Equal": (2, ALL),
    **{op: (1, NUMERIC) for op in ("Neg", "Abs", "Relu", "Sign")},
    **{op: (1, FLOATS) for op in ("Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Reciprocal", "Erf", "Gelu", "Floor", "Ceil",
                                  "Sin", "Cos")},
    "Mod": (2, FLOATS),    # fmod=1 (ir._fmod); floats only
    "Not": (1, ("bool",)),
    **{op: (2, ("bool",)) for op in ("And", "Or", "Xor")},
    "BitwiseNot": (1, ("int64", "int32")),
    **{op: (2, ("int64", "int32")) for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor")},
    "Where": (3, ALL),     # a bool condition, both branches of the dtype
    "Cast": (1, ALL),      # from the dtype to every dtype
}
ATTRIBUTES = {"Mod": {"fmod": 1}}   # what the lowering emits (ONNX's integer Mod is not an engine op)
LIBM = "float64 calls libm (the prelude's branch-free versions are float32)"
# (op, dtype) -> why its loop stays scalar. Checked both ways: an entry whose loop vectorizes fails too.
SCALAR = {
    ("Div", "int64"): "x86 has no vector integer divide (and a zero divisor must fail the call)",
    ("Div", "int32"): "x86 has no vector integer divide (and a zero divisor must fail the call)",
    ("Pow", "int64"): "integer pow: a square-and-multiply loop per element (blade_ipow)",
    ("Pow", "int32"): "integer pow: a square-and-multiply loop per element (blade_ipow)",
    **{("Mod", dtype): "fmod (exact remainder, only in float floor division): std::fmod" for dtype in FLOATS},
    **{(op, "float64"): LIBM for op in ("Pow", "Sigmoid", "Tanh", "Exp", "Log", "Erf", "Gelu", "Sin", "Cos")},
}
SHAPE = (2, 1027)     # two rows (the parallel loop), each a vector body and a scalar tail
# Nothing here runs the engines, so the ISA is fixed (not the host's): the same loops vectorize on
# every machine the tests run on. (AVX2 lacks int64 <-> float conversions and 64-bit multiplies.)
ISA = "x86-64-v4"


def _nodes():
    """(label, ONNX node) per op, dtype (and Cast target); the inputs are a_<dtype>, b_<dtype>, c."""
    for op, (arity, dtypes) in SIGNATURES.items():
        for dtype in dtypes:
            if op == "Cast":
                for to in (t for t in ALL if t != dtype):   # (a cast to its own dtype is no op)
                    yield f"Cast-{dtype}-{to}", helper.make_node(
                        "Cast", [f"a_{dtype}"], [f"Cast-{dtype}-{to}"], to=helper.np_dtype_to_tensor_dtype(np.dtype(to)))
                continue
            names = ["c", f"a_{dtype}", f"b_{dtype}"] if op == "Where" else [f"a_{dtype}", f"b_{dtype}"][:arity]
            yield f"{op}-{dtype}", helper.make_node(op, names, [f"{op}-{dtype}"], **ATTRIBUTES.get(op, {}))


@pytest.fixture(scope="module")
def loops_by_op(tmp_path_factory):
    labelled = list(_nodes())
    inputs = {f"{p}_{dtype}": (SHAPE, dtype) for dtype in ALL for p in "ab"} | {"c": (SHAPE, "bool")}
    case = graph_case("every-elementwise-op", [n for _, n in labelled], inputs, [label for label, _ in labelled])
    loops = compile_with_report(case.model, tmp_path_factory.mktemp("vectorized") / "ops", ISA)
    graph = ir.lower_onnx(case.model)
    label_of_node = {node.name: label for label, node in graph.outputs}
    by_op = {}
    for loop in loops:
        node_name = loop.kernel.split(":", 1)[1].split("[", 1)[0]
        by_op.setdefault(label_of_node.get(node_name, loop.kernel), []).append(loop)
    return by_op


def test_every_elementwise_op_has_a_signature():
    assert set(ir.ELEMENTWISE) - set(SIGNATURES) == set(), "add the new ops to SIGNATURES"


def test_every_elementwise_loop_vectorizes(loops_by_op):
    labels = [label for label, _ in _nodes()]
    missing = [label for label in labels if label not in loops_by_op]
    assert not missing, f"no loop found for {missing}"
    scalar = sorted(label for label in labels if not all(loop.vectorized for loop in loops_by_op[label]))
    expected = sorted(f"{op}-{dtype}" for op, dtype in SCALAR)
    unexpected = [s for s in scalar if s not in expected]
    assert not unexpected, f"these ops' loops did not vectorize: {unexpected}"
    vectorized = [e for e in expected if e not in scalar]
    assert not vectorized, f"these now vectorize, remove them from SCALAR: {vectorized}"


def node(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def test_fused_user_chain_with_log_vectorizes(tmp_path):
    """silu, tanh, exp, log, affine, softmax, gelu, layer norm, clamp and abs over [64, 4096] (the
    chain users measured 2.8x slower than eager when std::log made its fused loop scalar)."""
    rng = np.random.default_rng(0)
    width = 4096
    chain = [node("Sigmoid", ["x"], ["s"]), node("Mul", ["x", "s"], ["silu"]), node("Tanh", ["silu"], ["t"]),
             node("Exp", ["t"], ["e"]), node("Log", ["e"], ["l"]), node("Mul", ["l", "w"], ["lw"]),
             node("Add", ["lw", "b"], ["affine"]), node("Softmax", ["affine"], ["p"], axis=-1),
             node("Gelu", ["p"], ["g"]), node("LayerNormalization", ["g", "w", "b"], ["n"], axis=-1),
             node("Clip", ["n", "lo", "hi"], ["c"]), node("Abs", ["c"], ["y"])]
    inits = {"w": rng.standard_normal(width).astype(np.float32), "b": rng.standard_normal(width).astype(np.float32),
             "lo": np.array(-1.0, np.float32), "hi": np.array(1.0, np.float32)}
    case = graph_case("user-chain", chain, {"x": ((64, width), "float32")}, ["y"], inits)
    loops = compile_with_report(case.model, tmp_path / "chain", ISA)
    body = (tmp_path / "chain" / "engine.cpp").read_text().split("blade_engine_run")[1]
    assert loops and body.count("parallel_for(") == 1, "the chain should fuse into one row loop"
    assert "blade_logf(" in body and "std::log" not in body
    scalar = [f"line {loop.lines[0]} of {loop.kernel}" for loop in loops if not loop.vectorized]
    assert scalar == [], f"scalar loops in the fused chain: {scalar}"
    imported = subprocess.run(["nm", "-D", "--undefined-only", str(tmp_path / "chain" / "engine.so")],
                              capture_output=True, text=True, check=True).stdout
    libm = {"expf", "logf", "tanhf", "erff", "sinf", "cosf", "powf"}
    assert libm.isdisjoint(word.split("@")[0] for word in imported.split()), f"libm calls in the engine:\n{imported}"


def test_prelude_functions_vectorize_with_avx2_too(tmp_path):
    """The float32 transcendentals avoid AVX-512-only conversions (int64 <-> double), so engines
    built for x86-64-v3 (target_isa) vectorize them as well."""
    ops = ("Exp", "Log", "Tanh", "Sigmoid", "Erf", "Sin", "Cos")
    nodes = [node(op, ["x"], [op]) for op in ops] + [node("Pow", ["x", "y"], ["Pow"])]
    case = graph_case("prelude-v3", nodes, {"x": (SHAPE, "float32"), "y": (SHAPE, "float32")}, [*ops, "Pow"])
    loops = compile_with_report(case.model, tmp_path / "v3", isa="x86-64-v3")
    # one loop per op; sin, cos and pow have two (the cheap form and the full one: engine/versioning.py)
    assert len({loop.kernel for loop in loops}) == len(ops) + 1
    assert len(loops) == len(ops) + 1 + 3
    assert [loop.kernel for loop in loops if not loop.vectorized] == []


def test_report_parsing_sees_a_scalar_loop(tmp_path):
    """The check can fail: a float64 exp (a libm call) is reported scalar."""
    case = graph_case("exp-f64", [node("Exp", ["x"], ["y"])], {"x": (SHAPE, "float64")}, ["y"])
    loops = compile_with_report(case.model, tmp_path / "exp64", ISA)
    assert loops and not any(loop.vectorized for loop in loops)


def test_scan_and_arg_reduction_loops_vectorize(tmp_path):
    """cumsum's chunk sums and slice-by-slice steps, and both passes of argmax/argmin (the extreme,
    then its first index), vectorize; the one scalar loop is cumsum's chunks running side by side
    (independent add chains, loops.emit_scan)."""
    nodes = [node("ArgMax", ["x"], ["amax"], axis=1), node("ArgMin", ["i"], ["amin"], axis=1),
             node("CumSum", ["r", "last"], ["rows"]), node("CumSum", ["x3", "middle"], ["slices"])]
    inits = {"last": np.array(1, np.int64), "middle": np.array(1, np.int64)}
    case = graph_case("scan-arg", nodes, {"x": (SHAPE, "float32"), "i": (SHAPE, "int64"), "r": ((2, 1024), "float32"),
                                          "x3": ((2, 64, 1027), "float32")},
                      ["amax", "amin", "rows", "slices"], inits)
    loops = compile_with_report(case.model, tmp_path / "scan", ISA)
    kinds = ("argmax", "argmin", "scan sum over axis 1")
    # innermost loops: two passes per arg reduction; a chunked scan's two, a sliced scan's first step and the rest
    assert {kind: sum(kind in loop.kernel for loop in loops) for kind in kinds} == dict(zip(kinds, (2, 2, 4)))
    scalar = [loop for loop in loops if not loop.vectorized]
    assert len(scalar) == 1 and "scan" in scalar[0].kernel, [(l.kernel, l.lines) for l in scalar]


@pytest.mark.parametrize("chunks", [2, 3, 4, 8])
def test_long_row_sums_and_maxima_run_as_vectorized_partial_ones(tmp_path, monkeypatch, chunks):
    """A float sum or max over 6144 elements accumulates its parts (expressions.CHUNKS of them, four
    in the engines; 2, 3 and 8 check the tree that combines them) side by side in one loop
    (expressions.Values._in_chunks: with one accumulator, its chain of dependent adds bound a
    [64, 4096] sum at 29 us against eager's 23); a 256-long row keeps one accumulator. The loops
    vectorize, the sums equal numpy's float64 ones to float32 rounding, and the max is exact with
    a NaN (in the last part of one row) propagated as torch does."""
    monkeypatch.setattr(expressions, "CHUNKS", chunks)
    width = 6144   # (a multiple of 16 CHUNKS and at least CHUNK_MIN CHUNKS for every CHUNKS here)
    axes = {"axes": np.array([1], np.int64)}
    nodes = [node("ReduceSum", ["long", "axes"], ["long_sum"]), node("ReduceSum", ["short", "axes"], ["short_sum"]),
             node("ReduceMax", ["peaks", "axes"], ["long_max"])]
    peaks = np.random.default_rng(1).standard_normal((2, width)).astype(np.float32)
    peaks[1, width - 600] = np.nan
    peaks[0, 5] = 9.0   # the maximum of row 0 in its first part
    case = graph_case("sums", nodes, {"long": ((2, width), "float32"), "short": ((2, 256), "float32"),
                                      "peaks": ((2, width), "float32")},
                      ["long_sum", "short_sum", "long_max"], axes, values={"peaks": peaks})
    loops = compile_with_report(case.model, tmp_path / "sums", ISA)
    source = (tmp_path / "sums" / "engine.cpp").read_text()
    accumulators = sorted(len(names.split(",")) for names in re.findall(r"reduction\((?:\+|max):([^)]*)\)", source))
    assert accumulators == [1, chunks, chunks], source
    assert len(loops) == 3 and all(loop.vectorized for loop in loops)
    manifest = compile_onnx(case.model, tmp_path / "run")
    got = dict(zip(("long", "short", "peaks"), run_case(case, tmp_path / "run" / "engine.so", manifest)))
    for name in ("long", "short"):
        want = case.feeds[name].astype(np.float64).sum(axis=1, keepdims=True)
        # float32 rounding over 6144 terms (~|sum| 100: 2e-4 is ~25 ulp); a part left out or counted
        # twice is off by a partial sum, ~10 or more
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=2e-4)
    np.testing.assert_array_equal(got["peaks"], np.max(peaks, axis=1, keepdims=True))


@pytest.mark.parametrize("op, dtype", [("Relu", "float32"), ("BitwiseNot", "int32"), ("Neg", "float32"),
                                       ("Add", "float32")])
def test_short_vector_loops_start_a_64_byte_block(tmp_path, op, dtype):
    """A one-pass op's vector loop is a few instructions per 32 bytes in and out, so at 2 threads
    from L2/L3 its fetch is part of its bound: with g++'s default 16-byte loop alignment relu's and
    int32 bitwise_not's loops at [64, 4096] crossed a 64-byte boundary and at times ran ~30% slower
    than eager while neg's (inside one block) did not (compiler.BASE_FLAGS, -falign-loops=64)."""
    names = ["a", "b"][:SIGNATURES[op][0]]
    case = graph_case(f"{op}-{dtype}", [node(op, names, ["y"])], {n: ((64, 4096), dtype) for n in names}, ["y"])
    compile_onnx(case.model, tmp_path / "engine", {"isa": "x86-64-v3"})
    loops = short_loops(tmp_path / "engine" / "engine.so")
    assert loops, "no loop found in the engine's object code"
    assert [(hex(head), end - head) for head, end in loops if head % 64] == []


STACK_VECTOR_MOVE = re.compile(r"\(%r[bs]p\).*%[yz]mm|%[yz]mm.*\(%r[bs]p\)")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86-64 object code")
def test_the_patch_kernels_tiles_keep_their_accumulators_in_registers():
    """The convolution patch kernel's tiles (cpp/conv_patch_kernels.h): no innermost loop of at
    least 4 vector FMAs moves a vector to or from the stack. Inlined into the block functions, g++
    kept one accumulator of the 6 x 1 tile there (a store and a reload per step on its chain), and
    MobileNetV2's 1x1 32 -> 16 ran 1.7x slower with AVX-512 (now tile_out_of_line); a tile would do
    that again unnoticed by any result check. (Other kernels may spill by design: AVX2's depthwise
    rows hold 16 values in 16 registers.)"""
    checked, spilling = 0, []
    for name, instructions, loops in functions_and_loops(Path(blade.runtime_library())):
        if "conv_patch_blocks" not in name and "tile_out_of_line" not in name:
            continue
        for head, jump in loops:
            if any(head <= h and j <= jump and (h, j) != (head, jump) for h, j in loops):
                continue  # not innermost
            body = instructions[head:jump + 1]
            if sum(m.startswith("vfmadd") and "mm" in ops for _, m, ops in body) < 4:
                continue
            checked += 1
            if any(m.startswith("vmov") and STACK_VECTOR_MOVE.search(ops) for _, m, ops in body):
                spilling.append(f"{name[:80]} at {hex(body[0][0])}")
    assert checked >= 20, f"only {checked} FMA loops found in the patch kernel's functions"
    assert spilling == []


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86-64 object code")
@pytest.mark.parametrize("function", ["silu_range", "gelu_range"])
def test_the_runtime_unary_epilogues_divide_whole_vectors_in_each_clone(function):
    """The runtime's SiLU and GELU epilogues (cpp/activation.cpp silu_range, gelu_range) vectorize
    in their AVX2 and AVX-512 clones as the engine's own loops do: a divide of 8 (ymm) or 16 (zmm)
    floats. With trapping math the AVX2 clone kept blade_sigmoidf's selects as branches, one float
    a step (1.4 ns a float, 7x slower), and every result check passed."""
    divides = {}
    for name, instructions, _ in functions_and_loops(Path(blade.runtime_library())):
        if function in name and "[clone .arch_x86_64_v" in name:
            level = name.split("[clone .arch_x86_64_")[1].rstrip("]")
            divides[level] = {ops.split(",")[-1].strip()[:4] for _, mnemonic, ops in instructions
                              if mnemonic.startswith("vdivps")}
    assert "%ymm" in divides.get("v3", set()), divides
    assert "%zmm" in divides.get("v4", set()), divides


def test_a_max_pool_over_an_inline_relu_vectorizes(tmp_path):
    """BiT's stem: a pool reads the ReLU of a normalization inline, channels innermost. With its
    NaN-propagating combine one short-circuit select (`v != v || v > acc`) after the ReLU's, g++
    kept a branch and the loop over the channels stayed scalar (9.4 ms of a 25 ms call); the
    prelude's two-statement blade_max_nan vectorizes."""
    rng = np.random.default_rng(3)
    nodes = [node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]), node("Sub", ["c", "m"], ["s"]),
             node("Div", ["s", "d"], ["n"]), node("Relu", ["n"], ["r"]),
             node("MaxPool", ["r"], ["p"], kernel_shape=[3, 3], strides=[2, 2]), node("Conv", ["p", "w2"], ["y"])]
    inits = {"w1": rng.standard_normal((32, 16, 3, 3)).astype(np.float32),
             "w2": rng.standard_normal((32, 32, 1, 1)).astype(np.float32),
             "m": rng.standard_normal((1, 32, 1, 1)).astype(np.float32),
             "d": rng.uniform(0.5, 2, (1, 32, 1, 1)).astype(np.float32)}
    case = graph_case("pool-over-inline-relu", nodes, {"x": ((1, 16, 13, 13), "float32")}, ["y"], inits)
    loops = [loop for loop in compile_with_report(case.model, tmp_path / "pool", ISA) if "(window form)" in loop.kernel]
    assert loops and all(loop.vectorized for loop in loops), [(loop.kernel, loop.lines) for loop in loops]
