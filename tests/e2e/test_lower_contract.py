"""check_contract checks weights by type and shape only; shape data and small operands keep their values."""
import gc

import numpy as np
import onnx
import pytest

from blade.cluster.lower import check_contract
from blade.cluster.onnx_builder import OnnxBuilder
from blade.cluster.rules.base import LoweringError
from blade.engine.ir import without_weight_values
from blade.heap import frozen_heap


def _matmul_then_reshape(out_shape, weight_rows=64, target=(4, 32)):
    """x[2, rows] @ W[rows, 64] reshaped to ``target``, declared as ``out_shape``."""
    b = OnnxBuilder("c")
    b.add_input("x", np.float32, [2, weight_rows])
    w = b.constant(np.ones((weight_rows, 64), np.float32), "w")
    y = b.op("MatMul", ["x", w])
    z = b.op("Reshape", [y, b.ints(target)])
    b.nodes.append(onnx.helper.make_node("Identity", [z], ["out"]))
    b.add_output("out", np.float32, out_shape)
    return b.model()


def test_weights_become_typed_inputs_and_shape_data_stays():
    model = _matmul_then_reshape([4, 32])
    checked = without_weight_values(model)
    assert [t.name for t in checked.graph.initializer] == ["ints_3"]  # the reshape target, by value
    assert [i.name for i in checked.graph.input] == ["x", "w_1"]
    assert len(model.graph.initializer) == 2  # the model itself is untouched
    check_contract(model)


def test_a_wrong_declared_shape_still_fails_with_weights_stripped():
    # the reshape target's value (shape data, kept) decides [4, 32]
    with pytest.raises(LoweringError, match=r"\(4\) vs \(8\)"):
        check_contract(_matmul_then_reshape([8, 16]))



def test_a_weight_of_the_wrong_shape_still_fails():
    with pytest.raises(LoweringError, match="contract check failed"):
        check_contract(_bad_matmul())


def _bad_matmul():
    """x[2, 3] @ W[5, 64]: the weight's shape (kept as its input's type) does not fit."""
    b = OnnxBuilder("c")
    b.add_input("x", np.float32, [2, 3])
    w = b.constant(np.ones((5, 64), np.float32), "w")
    y = b.op("MatMul", ["x", w])
    b.nodes.append(onnx.helper.make_node("Identity", [y], ["out"]))
    b.add_output("out", np.float32, [2, 64])
    return b.model()


def test_a_model_without_weights_is_checked_as_it_is():
    b = OnnxBuilder("c")
    b.add_input("x", np.float32, [2, 3])
    y = b.op("Mul", ["x", b.constant(np.float32(2.0))])
    b.nodes.append(onnx.helper.make_node("Identity", [y], ["out"]))
    b.add_output("out", np.float32, [2, 3])
    model = b.model()
    assert without_weight_values(model) is model


def test_frozen_heap_unfreezes_and_leaves_a_process_freeze_alone():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0   # the inner one leaves the outer's freeze
    assert gc.get_freeze_count() == 0
    gc.freeze()   # a process that froze its own objects (a pre-fork server)
    try:
        before = gc.get_freeze_count()
        with frozen_heap():
            pass
        # Not unfrozen (that empties the permanent generation) and nothing added. A frozen object
        # that dies meanwhile leaves it (under xdist the count once fell by 2: 615149 -> 615147).
        assert before - 1000 < gc.get_freeze_count() <= before
    finally:
        gc.unfreeze()


def test_the_engine_compilers_contract_check_reads_weights_by_type_and_shape(monkeypatch):
    """ir.lower_onnx (run by every engine compile, and by blade/dynamic.py on a cluster with run-time
    sizes) hands onnx.checker and shape inference the weightless view: serializing GPT-2's 64 MB of
    weights for each of them was ~0.5 s of CPU a check. The IR still reads the weights' values."""
    from blade.engine import ir
    checked = []
    real_check = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda model, *a, **k: (checked.append(model), real_check(model, *a, **k)))
    model = _matmul_then_reshape([4, 32])
    graph = ir.lower_onnx(model)
    assert [[t.name for t in m.graph.initializer] for m in checked] == [["ints_3"]]
    weight = next(n for n in graph.nodes if n.op == "const" and n.name == "w_1")
    assert np.array_equal(weight.attrs["value"], np.ones((64, 64), np.float32))
    with pytest.raises(Exception, match="Incompatible dimensions|MatMul"):
        ir.lower_onnx(_bad_matmul())   # a weight of the wrong shape still fails the check


@pytest.mark.parametrize("array", [np.float32(2.0), np.arange(6, dtype=np.int64).reshape(2, 3),
                                   np.ones((3, 4), np.float64), np.array([True, False]),
                                   np.arange(5, dtype=np.int32), np.ones((2, 3), np.float32).T,
                                   np.ones(3, np.float16)], ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_constants_written_in_place_are_what_onnx_makes_of_them(array):
    """OnnxBuilder writes an initializer into its model as it is made (adding a finished one copies
    it: GPT-2's 64 MB once more per lowering); the tensor is numpy_helper.from_array's."""
    b = OnnxBuilder("c")
    name = b.constant(array)
    expected = onnx.numpy_helper.from_array(np.require(array, requirements="C"), name)
    assert b.model().graph.initializer[0].SerializeToString() == expected.SerializeToString()


def test_a_constant_onnx_cannot_hold_leaves_no_initializer_behind():
    b = OnnxBuilder("c")
    with pytest.raises(ValueError):
        b.constant(np.ones(3, ">f4"))
    assert len(b.model().graph.initializer) == 0
