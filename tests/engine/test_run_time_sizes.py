"""Engines with run-time sizes: ONNX inputs whose dims are dim_params (ranges in the model's
metadata, ir.SIZE_RANGES_KEY) compile to ONE engine whose outer loop bounds, offsets and GEMM M
are expressions of the sizes passed at run time; checked at several sizes (1 and the maximum
included) against onnx's reference. What the slice does not handle is refused, never guessed."""
import json
import re

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import blade._C
from blade.engine.compiler import compile_onnx, load_constants
from blade.engine.ir import SIZE_DERIVED_KEY, SIZE_EQUAL_KEY, SIZE_RANGES_KEY, UnsupportedOnnxOp
from blade.engine.npruntime import NumpyEngine

F = TensorProto.FLOAT
RANGES = {"batch": [1, 16], "seq": [1, 32]}


def dynamic_model(nodes, inputs, outputs, inits=(), ranges=RANGES):
    """inputs/outputs: {name: shape with dim_param names}; float32 throughout."""
    graph = helper.make_graph(nodes, "cluster", [helper.make_tensor_value_info(n, F, s) for n, s in inputs.items()],
                              [helper.make_tensor_value_info(n, F, s) for n, s in outputs.items()],
                              initializer=[numpy_helper.from_array(v, n) for n, v in dict(inits).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.metadata_props.add(key=SIZE_RANGES_KEY, value=json.dumps(ranges))
    return model


rng = np.random.default_rng(0)
W = rng.standard_normal((16, 24)).astype(np.float32)
# The runtime's panels GEMM kernel runs on AVX2 with FMA (x86-64-v3) and up.
PANELS_RUN_HERE = blade._C.host_isa() in ("x86-64-v3", "x86-64-v4")
GAMMA, BETA = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)

CASES = {
    "broadcast-add-relu": dynamic_model(
        [helper.make_node("Add", ["x", "y"], ["a"]), helper.make_node("Relu", ["a"], ["out"])],
        {"x": ["batch", 16], "y": [16]}, {"out": ["batch", 16]}),
    "same-symbol-operands": dynamic_model(
        [helper.make_node("Mul", ["x", "y"], ["m"]), helper.make_node("Tanh", ["m"], ["out"])],
        {"x": ["batch", 3, 16], "y": ["batch", 1, 16]}, {"out": ["batch", 3, 16]}),
    "softmax": dynamic_model([helper.make_node("Softmax", ["x"], ["out"], axis=-1)],
                             {"x": ["batch", 3, 16]}, {"out": ["batch", 3, 16]}),
    "layer-norm": dynamic_model([helper.make_node("LayerNormalization", ["x", "g", "b"], ["out"], axis=-1)],
                                {"x": ["batch", "seq", 16]}, {"out": ["batch", "seq", 16]},
                                {"g": GAMMA, "b": BETA}),
    "reduce-mean-static-axis": dynamic_model(
        [helper.make_node("ReduceMean", ["x", "axes"], ["out"], keepdims=1)],
        {"x": ["batch", 16]}, {"out": ["batch", 1]}, {"axes": np.array([1], np.int64)}),
    "matmul-weight": dynamic_model(
        [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Relu", ["mm"], ["out"])],
        {"x": ["batch", 16]}, {"out": ["batch", 24]}, {"w": W}),
    "matmul-batched-rows": dynamic_model(
        [helper.make_node("MatMul", ["x", "w"], ["out"])],
        {"x": ["batch", "seq", 16]}, {"out": ["batch", "seq", 24]}, {"w": W}),
    # a softmax over a run-time axis: its row stays on the stack, sized for the largest row
    "softmax-run-time-axis": dynamic_model([helper.make_node("Softmax", ["x"], ["out"], axis=-1)],
                                           {"x": ["batch", "seq"]}, {"out": ["batch", "seq"]}),
    # attention heads sliced from one computed [batch, seq, 2 * heads * dim] projection: each head's
    # matrix is unpacked whatever seq is; the fused attention reads Q, K and V in place all the same
    "attention-heads": dynamic_model(
        [helper.make_node("Add", ["x", "bias"], ["qk"]),
         helper.make_node("Slice", ["qk", "zero", "eight", "two"], ["q"]),
         helper.make_node("Slice", ["qk", "eight", "sixteen", "two"], ["k"]),
         helper.make_node("Reshape", ["q", "heads"], ["q4"]), helper.make_node("Reshape", ["k", "heads"], ["k4"]),
         helper.make_node("Transpose", ["q4"], ["qt"], perm=[0, 2, 1, 3]),
         helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
         helper.make_node("MatMul", ["qt", "kt"], ["scores"]),
         helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
         helper.make_node("Transpose", ["k4"], ["v"], perm=[0, 2, 1, 3]),
         helper.make_node("MatMul", ["p", "v"], ["out"])],
        {"x": ["batch", "seq", 16]}, {"out": ["batch", 2, "seq", 4]},
        {"bias": GAMMA, "heads": np.array([0, 0, 2, 4], np.int64),
         **{name: np.array([v], np.int64) for name, v in {"zero": 0, "eight": 8, "sixteen": 16, "two": 2}.items()}}),
    # sizes read from a shape (blade/cluster/support.py's aten::size): positions Range(0, seq),
    # a table sliced to seq, an Expand to (batch, seq, 16), and seq read as data
    "sizes-from-shape": dynamic_model(
        [helper.make_node("Shape", ["x"], ["bs"], start=0, end=2),
         helper.make_node("Shape", ["x"], ["s1"], start=1, end=2),
         helper.make_node("Squeeze", ["s1", "zero_axis"], ["seq"]),
         helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
         helper.make_node("Gather", ["table", "positions"], ["by_position"], axis=0),
         helper.make_node("Slice", ["table", "start", "s1", "zero_axis"], ["sliced"]),
         helper.make_node("Concat", ["bs", "width"], ["target"], axis=0),
         helper.make_node("Expand", ["row", "target"], ["rows"]),
         helper.make_node("Cast", ["seq"], ["seq_f"], to=F),
         helper.make_node("Add", ["x", "by_position"], ["a"]),
         helper.make_node("Mul", ["a", "sliced"], ["b"]),
         helper.make_node("Add", ["b", "rows"], ["c"]),
         helper.make_node("Add", ["c", "seq_f"], ["out"])],
        {"x": ["batch", "seq", 16]}, {"out": ["batch", "seq", 16]},
        {"zero_axis": np.array([0], np.int64), "zero": np.array(0, np.int64), "one": np.array(1, np.int64),
         "start": np.array([0], np.int64), "width": np.array([16], np.int64),
         "table": rng.standard_normal((32, 16)).astype(np.float32), "row": GAMMA.reshape(1, 16)}),
    # int arithmetic on sizes (GPT-2's mask.size(0) * mask.size(1) // ids.size(0)): ONNX Div of
    # non-negative sizes by a size >= 1 is the floor quotient, here batch * seq / batch = seq
    "size-quotient": dynamic_model(
        [helper.make_node("Shape", ["x"], ["b1"], start=0, end=1),
         helper.make_node("Shape", ["x"], ["s1"], start=1, end=2),
         helper.make_node("Mul", ["b1", "s1"], ["cells"]),
         helper.make_node("Div", ["cells", "b1"], ["q1"]),
         helper.make_node("Squeeze", ["q1", "zero_axis"], ["q"]),
         helper.make_node("Range", ["zero", "q", "one"], ["positions"]),
         helper.make_node("Cast", ["positions"], ["pf"], to=F),
         helper.make_node("Unsqueeze", ["pf", "one_axis"], ["column"]),
         helper.make_node("Add", ["x", "column"], ["out"])],
        {"x": ["batch", "seq", 16]}, {"out": ["batch", "seq", 16]},
        {"zero_axis": np.array([0], np.int64), "one_axis": np.array([1], np.int64),
         "zero": np.array(0, np.int64), "one": np.array(1, np.int64)}),
    # Llama's view(batch, heads, -1, head_dim) beside a run-time batch: the -1 is numel / (4 batch 4)
    "reshape-inferred-beside-run-time-dims": dynamic_model(
        [helper.make_node("Shape", ["x"], ["b1"], start=0, end=1),
         helper.make_node("Concat", ["b1", "rest"], ["target"], axis=0),
         helper.make_node("Reshape", ["x", "target"], ["r"]),
         helper.make_node("Softmax", ["r"], ["out"], axis=2)],
        {"x": ["batch", "seq", 16]}, {"out": ["batch", 4, "seq", 4]},
        {"rest": np.array([4, -1, 4], np.int64)}),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("dynamic")
    return {name: (root / name / "engine.so", compile_onnx(model, root / name)) for name, model in CASES.items()}


def feeds_at(model, sizes):
    feeds = {}
    for value in model.graph.input:
        shape = [sizes[d.dim_param] if d.dim_param else d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("name", CASES)
def test_one_engine_serves_every_size(compiled, name):
    so_path, manifest = compiled[name]
    model = CASES[name]
    assert [s.name for s in manifest.symbols] == [n for n in RANGES if any(
        d.dim_param == n for v in model.graph.input for d in v.type.tensor_type.shape.dim)]
    engine = NumpyEngine(so_path, manifest, load_constants(model, manifest))
    for batch, seq in [(1, 1), (3, 7), (16, 32)]:
        feeds = feeds_at(model, {"batch": batch, "seq": seq})
        got = engine(*(feeds[spec.name] for spec in manifest.inputs))
        want = ReferenceEvaluator(model).run(None, feeds)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"{name} at batch={batch} seq={seq}")


def test_static_dims_stay_constants_and_sizes_come_from_the_call(compiled):
    so_path, manifest = compiled["broadcast-add-relu"]
    source = (so_path.parent / "engine.cpp").read_text()
    assert "const int64_t size0 = sizes[0];  // in [1, 16]" in source
    assert "blade::parallel_for(rt, 0, size0," in source
    assert "for (int64_t i1 = 0; i1 < 16; ++i1)" in source  # the inner loop keeps its static trip count
    assert manifest.inputs[0].shape == ["batch", 16] and manifest.outputs[0].shape == ["batch", 16]
    assert "rt->sgemm(1, size0, 24, 16," in (compiled["matmul-weight"][0].parent / "engine.cpp").read_text()


def test_a_run_time_row_stays_on_the_stack_at_its_largest_size(compiled):
    source = (compiled["softmax-run-time-axis"][0].parent / "engine.cpp").read_text()
    assert re.search(r"alignas\(64\) float s\d+\[32\];  // one row, per thread", source)
    assert "i1 < size1" in source  # the loops run over the row's run-time length


def test_unpacked_head_matrices_are_read_in_place_at_run_time_sizes(compiled):
    source = (compiled["attention-heads"][0].parent / "engine.cpp").read_text()
    # the sum is stored once and the fused attention reads each head where it lies (rows 16 floats
    # apart), taking the sequence length at run time (query rows and keys): no copy of a head
    assert "contiguous copy" not in source
    assert "rt->attention(&a);" in source
    assert "a.m = size1;" in source and "a.n = size1;" in source
    assert "a.ldq = 16;" in source and "a.ldk = 16;" in source and "a.ldv = 16;" in source


def test_scratch_is_planned_at_the_maxima(compiled):
    so_path, manifest = compiled["layer-norm"]
    engine = NumpyEngine(so_path, manifest, load_constants(CASES["layer-norm"], manifest))
    assert manifest.scratch_bytes >= 0
    feeds = feeds_at(CASES["layer-norm"], {"batch": 16, "seq": 32})
    assert engine(*(feeds[s.name] for s in manifest.inputs))[0].shape == (16, 32, 16)


@pytest.mark.parametrize("model, reason", [
    (dynamic_model([helper.make_node("Add", ["x", "y"], ["out"])], {"x": ["batch", 16], "y": [4, 16]},
                   {"out": [4, 16]}), "broadcasting run-time dims"),
    (dynamic_model([helper.make_node("Relu", ["x"], ["out"])], {"x": ["n", 16]}, {"out": ["n", 16]}),
     "dim 'n' has no declared range"),
    (dynamic_model([helper.make_node("Concat", ["x", "x"], ["out"], axis=0)], {"x": ["batch", 16]},
                   {"out": [None, 16]}), "run-time"),
    (dynamic_model([helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Cast", ["shape"], ["f"], to=F),
                    helper.make_node("Add", ["x", "f"], ["out"])], {"x": ["batch", 2]}, {"out": ["batch", 2]}),
     "read as a data tensor"),
    (dynamic_model([helper.make_node("Shape", ["x"], ["s"], start=0, end=1),
                    helper.make_node("Squeeze", ["s", "axis"], ["n"]),
                    helper.make_node("Range", ["n", "zero", "minus"], ["r"]),
                    helper.make_node("Cast", ["r"], ["out"], to=F)], {"x": ["batch", 2]}, {"out": ["batch"]},
                   {"axis": np.array([0], np.int64), "zero": np.array(0, np.int64), "minus": np.array(-1, np.int64)}),
     "Range over run-time sizes by a non-constant or non-positive step"),
])
def test_what_the_slice_does_not_handle_is_refused(tmp_path, model, reason):
    with pytest.raises(UnsupportedOnnxOp, match=reason):
        compile_onnx(model, tmp_path / "refused")


def _sizes_divided(dividend: list, divisor: str, inits: dict, op: str = "Div"):
    """Range(0, dividend op divisor) of x's sizes: dividend, nodes ending in 'n' (a 0-d size)."""
    return dynamic_model(
        [helper.make_node("Shape", ["x"], ["s1"], start=1, end=2), helper.make_node("Squeeze", ["s1", "axis"], ["seq"]),
         *dividend, helper.make_node(op, ["n", divisor], ["q"]),
         helper.make_node("Range", ["zero", "q", "one"], ["r"]), helper.make_node("Cast", ["r"], ["out"], to=F)],
        {"x": ["batch", "seq"]}, {"out": [None]},
        {"axis": np.array([0], np.int64), "zero": np.array(0, np.int64), "one": np.array(1, np.int64), **inits})


@pytest.mark.parametrize("model, reason", [
    # seq - 3 is negative at seq < 3: truncation and floor differ there (-1 / 2 is 0, -1 // 2 is -1)
    (_sizes_divided([helper.make_node("Sub", ["seq", "three"], ["n"])], "two",
                    {"three": np.array(3, np.int64), "two": np.array(2, np.int64)}), "Div of sizes"),
    # a divisor that may be 0
    (_sizes_divided([helper.make_node("Identity", ["seq"], ["n"])], "nought",
                    {"nought": np.array(0, np.int64)}), "Div of sizes"),
    # a remainder of seq - 3 (negative at seq < 3, where C++ % truncates) and one by seq - 1 (0 at seq 1)
    (_sizes_divided([helper.make_node("Sub", ["seq", "three"], ["n"])], "two",
                    {"three": np.array(3, np.int64), "two": np.array(2, np.int64)}, "Mod"), "Mod of sizes"),
    (_sizes_divided([helper.make_node("Identity", ["three"], ["n"]), helper.make_node("Sub", ["seq", "one"], ["d"])],
                    "d", {"three": np.array(3, np.int64)}, "Mod"), "Mod of sizes"),
    # [batch, seq] to [batch, 2, -1]: seq / 2 is not a whole number at every size
    (dynamic_model([helper.make_node("Shape", ["x"], ["b1"], start=0, end=1),
                    helper.make_node("Concat", ["b1", "rest"], ["target"], axis=0),
                    helper.make_node("Reshape", ["x", "target"], ["out"])],
                   {"x": ["batch", "seq"]}, {"out": ["batch", 2, None]}, {"rest": np.array([2, -1], np.int64)}),
     "the -1 is not provably"),
])
def test_size_arithmetic_that_is_not_exact_at_every_size_is_refused(tmp_path, model, reason):
    with pytest.raises(UnsupportedOnnxOp, match=reason):
        compile_onnx(model, tmp_path / "refused")


def test_the_engine_class_binds_and_checks_sizes(compiled):
    """The torch-side Engine (cpp/engine.cpp) runs the same .so: sizes bound from the inputs."""
    from blade.runtime import make_engine
    so_path, manifest = compiled["matmul-batched-rows"]
    engine = make_engine("cluster_dyn", so_path.read_bytes(), manifest, CASES["matmul-batched-rows"], {})
    for batch, seq in [(1, 1), (2, 5), (16, 32)]:
        x = torch.randn(batch, seq, 16)
        torch.testing.assert_close(engine.execute([x])[0], x @ torch.from_numpy(W), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"input 0 \('x'\) dim 1 is size symbol 'seq' with range \[1, 32\], got 33"):
        engine.execute([torch.randn(2, 33, 16)])


@pytest.mark.parametrize("start, end", [(5, 100), (0, 8), (-3, 100)])
def test_a_slice_clamped_at_some_sizes_only_refuses(tmp_path, start, end):
    """Slice clamps its bounds to the dim: along a run-time dim in [1, 16], x[5:] starts past
    the end at small sizes, x[:8] ends inside at some sizes only, x[-3:] starts before the start."""
    model = dynamic_model([helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["out"])],
                          {"x": ["batch", 16]}, {"out": [None, 16]},
                          {"starts": np.array([start], np.int64), "ends": np.array([end], np.int64),
                           "axes": np.array([0], np.int64)})
    with pytest.raises(UnsupportedOnnxOp, match="Slice"):
        compile_onnx(model, tmp_path / "refused")


def test_a_slice_the_same_at_every_size_is_an_expression_of_it(tmp_path):
    """x[1:] then x[:, 0:1] (BERT's pooler picks token 0) along run-time dims: one engine."""
    model = dynamic_model([helper.make_node("Slice", ["x", "s0", "e0", "a0"], ["rest"]),
                           helper.make_node("Slice", ["rest", "s1", "e1", "a1"], ["first"]),
                           helper.make_node("ReduceSum", ["first", "axes"], ["out"], keepdims=0)],
                          {"x": ["batch", "seq", 16]}, {"out": [16]},
                          {"s0": np.array([1], np.int64), "e0": np.array([2**62], np.int64), "a0": np.array([0], np.int64),
                           "s1": np.array([0], np.int64), "e1": np.array([1], np.int64), "a1": np.array([1], np.int64),
                           "axes": np.array([0, 1], np.int64)},
                          ranges={"batch": [2, 16], "seq": [1, 32]})
    manifest = compile_onnx(model, tmp_path / "slice")
    engine = NumpyEngine(tmp_path / "slice" / "engine.so", manifest, load_constants(model, manifest))
    for batch, seq in [(2, 1), (5, 7), (16, 32)]:
        x = rng.standard_normal((batch, seq, 16)).astype(np.float32)
        np.testing.assert_allclose(engine(x)[0], x[1:, 0].sum(0), rtol=1e-5, atol=1e-5)


def test_weight_gemms_are_listed_for_packing_at_load(compiled):
    """blade_engine_weight_gemms lists a GEMM on a constant weight (shared by the batch's rows, which
    the runtime folds into one GEMM), with its fixed n, k, ldb, trans_b and alpha; a B computed at
    run time (attention's keys) is no weight, so that engine exports no table."""
    source = (compiled["matmul-batched-rows"][0].parent / "engine.cpp").read_text()
    assert re.search(r"const BladeWeightGemm blade_weight_gemms\[\] = \{\n  \{0, 0, 24, 16, 24, 0, 1\.0f\},\n\};",
                     source)
    assert "return 1;" in source
    assert "blade_engine_weight_gemms" not in (compiled["attention-heads"][0].parent / "engine.cpp").read_text()


@pytest.mark.skipif(not PANELS_RUN_HERE, reason="the panels kernel needs AVX2 and FMA")
def test_an_engine_with_run_time_sizes_packs_its_weights_at_load_and_no_call_packs(compiled):
    from blade._C import _testing
    from blade.runtime import make_engine
    so_path, manifest = compiled["matmul-batched-rows"]
    _testing.set_gemm_backend("panels")
    try:
        before = _testing.packed_weight_count()
        engine = make_engine("cluster_dyn", so_path.read_bytes(), manifest, CASES["matmul-batched-rows"], {})
        assert _testing.packed_weight_count() == before + 1
        panels_before = _testing.gemm_kernel_calls("panels")
        for batch, seq in [(1, 1), (2, 5), (16, 32), (3, 7)]:
            x = torch.randn(batch, seq, 16)
            torch.testing.assert_close(engine.execute([x])[0], x @ torch.from_numpy(W), rtol=1e-5, atol=1e-5)
        assert _testing.gemm_kernel_calls("panels") == panels_before + 4
        assert _testing.packed_weight_count() == before + 1
    finally:
        _testing.set_gemm_backend("")


@pytest.mark.skipif(not PANELS_RUN_HERE, reason="the panels kernel needs AVX2 and FMA")
def test_tiny_gemms_of_an_engine_with_run_time_sizes_pack_nothing_more(compiled):
    """Under "auto" a GEMM under 2 MFLOP (here every row count: [rows, 16] x [16, 24]) runs untimed.
    On a constant weight that is the panels kernel, whose pack the engine made at load: one packed
    copy per weight whatever row counts arrive. (MKL ran them and packed the weight once more for its
    first row count, 5.5-6.8 MiB allocated per weight: a served GPT-2's first seq-1 call grew its
    heap by 85 MiB.)"""
    from blade._C import _testing
    from blade.runtime import make_engine
    so_path, manifest = compiled["matmul-batched-rows"]
    _testing.set_gemm_backend("auto")
    try:
        before = _testing.packed_weight_count()
        engine = make_engine("cluster_dyn", so_path.read_bytes(), manifest, CASES["matmul-batched-rows"], {})
        assert _testing.packed_weight_count() == before + 1
        panels_before, mkl_before = _testing.gemm_kernel_calls("panels"), _testing.gemm_kernel_calls("mkl")
        for batch, seq in [(1, 1), (2, 5), (16, 32), (3, 7), (1, 1)]:
            x = torch.randn(batch, seq, 16)
            torch.testing.assert_close(engine.execute([x])[0], x @ torch.from_numpy(W), rtol=1e-5, atol=1e-5)
        assert _testing.gemm_kernel_calls("panels") == panels_before + 5
        assert _testing.gemm_kernel_calls("mkl") == mkl_before
        assert _testing.packed_weight_count() == before + 1
    finally:
        _testing.set_gemm_backend("")


@pytest.mark.skipif(not PANELS_RUN_HERE, reason="the panels kernel needs AVX2 and FMA")
def test_engines_sharing_a_constant_share_its_pack_until_the_last_is_gone(compiled):
    """Engines made in one sharing_constants() scope (an export's captures) hold one weight tensor,
    and the runtime packs it once for all of them; an engine with an equal but separate weight packs
    its own; the pack dies with the last engine holding it (a later engine on the same weight, still
    alive in the scope, packs again)."""
    from blade._C import _testing
    from blade.runtime import make_engine
    from blade.shared_constants import sharing_constants
    so_path, manifest = compiled["matmul-batched-rows"]

    def engine():
        return make_engine("cluster_dyn", so_path.read_bytes(), manifest, CASES["matmul-batched-rows"], {})

    def weight_of(e):
        return e._get_method("__getstate__")()[11][0]

    _testing.set_gemm_backend("panels")
    try:
        before = _testing.packed_weight_count()
        apart = engine()  # outside the scope: its own tensor, its own pack
        with sharing_constants():
            first, second = engine(), engine()
            shared_ptr = weight_of(first).data_ptr()
            assert weight_of(second).data_ptr() == shared_ptr != weight_of(apart).data_ptr()
            assert _testing.packed_weight_count() == before + 2
            x = torch.randn(3, 5, 16)
            for e in (first, second, apart):
                torch.testing.assert_close(e.execute([x])[0], x @ torch.from_numpy(W), rtol=1e-5, atol=1e-5)
            del first, second
            third = engine()
            assert weight_of(third).data_ptr() == shared_ptr
            assert _testing.packed_weight_count() == before + 3
    finally:
        _testing.set_gemm_backend("")


def derived_model(derived: dict, batch="batch"):
    """Concat(x, x) along seq and a Pad of seq by 3: output dims no input has, each a derived size
    (ir.SIZE_DERIVED_KEY) the engine computes from the bound ones."""
    model = dynamic_model(
        [helper.make_node("Concat", ["x", "x"], ["twice"], axis=1),
         helper.make_node("Pad", ["x", "pads"], ["padded"])],
        {"x": [batch, "seq", 16]}, {"twice": [batch, "2*seq", 16], "padded": [batch, "seq+3", 16]},
        {"pads": np.array([0, 1, 0, 0, 2, 0], np.int64)},
        ranges={**RANGES, "2*seq": [2, 64], "seq+3": [4, 35]})
    model.metadata_props.add(key=SIZE_DERIVED_KEY, value=json.dumps(derived))
    return model


DERIVED = {"2*seq": ["mul", 2, "seq"], "seq+3": ["add", "seq", 3]}


def test_output_dims_no_input_has_are_derived_by_the_engine(tmp_path):
    """One engine; the derived sizes follow the bound ones in the manifest, and both the numpy
    harness and the torch-side Engine allocate the outputs from what the .so derives."""
    from blade.runtime import make_engine
    model = derived_model(DERIVED)
    manifest = compile_onnx(model, tmp_path)
    assert [(s.name, s.min, s.max) for s in manifest.symbols] == [
        ("batch", 1, 16), ("seq", 1, 32), ("2*seq", 2, 64), ("seq+3", 4, 35)]
    assert "sizes[2] = 2 * size1;" in (tmp_path / "engine.cpp").read_text()
    engine = NumpyEngine(tmp_path / "engine.so", manifest, load_constants(model, manifest))
    torch_engine = make_engine("cluster_derived", (tmp_path / "engine.so").read_bytes(), manifest, model, {})
    for batch, seq in [(1, 1), (3, 7), (16, 32)]:
        feeds = feeds_at(model, {"batch": batch, "seq": seq})
        want = ReferenceEvaluator(model).run(None, feeds)
        for got in (engine(feeds["x"]), [t.numpy() for t in torch_engine.execute([torch.from_numpy(feeds["x"])])]):
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("derived, reason", [
    ({**DERIVED, "2*seq": ["mul", 2, "cols"]}, "derived size symbol tree 'cols' is not over the bound size symbols"),
    ({**DERIVED, "2*seq": ["pow", "seq", 2]}, "derived size symbol tree"),
])
def test_a_derived_size_not_over_the_bound_ones_is_refused(tmp_path, derived, reason):
    with pytest.raises((UnsupportedOnnxOp, ValueError), match=re.escape(reason)):
        compile_onnx(derived_model(derived), tmp_path)


def test_a_derived_size_that_disagrees_with_the_graph_fails_the_compile(tmp_path):
    """The tree says 2 * batch where the Concat makes 2 * seq: never an engine allocating by the tree."""
    model = derived_model({**DERIVED, "2*seq": ["mul", 2, "batch"]})
    with pytest.raises(AssertionError, match=re.escape("Concat rule for 'twice' gives")):
        compile_onnx(model, tmp_path)


def equal_model():
    """A decode step: the cache [batch, past, 16] and the new row concatenated ([batch, past + 1,
    16]) plus a mask bias [batch, mask]; dynamo's guards made mask == past + 1 (ir.SIZE_EQUAL_KEY),
    so the Add broadcasts nothing."""
    model = dynamic_model(
        [helper.make_node("Concat", ["cache", "row"], ["keys"], axis=1),
         helper.make_node("Unsqueeze", ["bias", "last"], ["column"]),
         helper.make_node("Add", ["keys", "column"], ["out"])],
        {"cache": ["batch", "past", 16], "row": ["batch", 1, 16], "bias": ["batch", "mask"]},
        {"out": ["batch", "mask", 16]}, {"last": np.array([2], np.int64)},
        ranges={"batch": [1, 16], "past": [1, 32], "mask": [2, 33]})
    model.metadata_props.add(key=SIZE_EQUAL_KEY, value=json.dumps({"mask": ["add", "past", 1]}))
    return model


def test_an_input_size_equal_to_an_expression_of_others_is_checked_when_called(tmp_path):
    """The engine computes with mask = past + 1 (without the equality the Add of [.., past + 1, ..]
    and [.., mask, ..] is refused: equal only at some sizes), binds mask from its input like any
    size, and fails a call where the input's dim is not past + 1 before any kernel runs."""
    from blade.runtime import make_engine
    model = equal_model()
    manifest = compile_onnx(model, tmp_path)
    assert [(s.name, s.min, s.max) for s in manifest.symbols] == [("batch", 1, 16), ("past", 1, 32), ("mask", 2, 33)]
    assert "if (size2 != size1 + 1) return BLADE_ERR_SIZE_MISMATCH;" in (tmp_path / "engine.cpp").read_text()
    engine = make_engine("cluster_equal", (tmp_path / "engine.so").read_bytes(), manifest, model, {})
    for batch, past in [(1, 1), (3, 7), (16, 32)]:
        cache, row, bias = torch.randn(batch, past, 16), torch.randn(batch, 1, 16), torch.randn(batch, past + 1)
        torch.testing.assert_close(engine.execute([cache, row, bias])[0], torch.cat([cache, row], 1) + bias[..., None])
    with pytest.raises(RuntimeError, match="BLADE_ERR_SIZE_MISMATCH|an input dim differs from the size"):
        engine.execute([torch.randn(2, 5, 16), torch.randn(2, 1, 16), torch.randn(2, 5)])
    plain = dynamic_model(list(model.graph.node), {"cache": ["batch", "past", 16], "row": ["batch", 1, 16],
                                                   "bias": ["batch", "mask"]},
                          {"out": ["batch", "mask", 16]}, {"last": np.array([2], np.int64)},
                          ranges={"batch": [1, 16], "past": [1, 32], "mask": [2, 33]})
    with pytest.raises(UnsupportedOnnxOp, match="equal only at some sizes"):
        compile_onnx(plain, tmp_path / "plain")
