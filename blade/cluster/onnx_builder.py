"""A small builder for one cluster's ONNX graph (the backend contract, DESIGN.md #1)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 20

NP_TO_ONNX = {
    np.dtype("float32"): TensorProto.FLOAT,
    np.dtype("float64"): TensorProto.DOUBLE,
    np.dtype("int64"): TensorProto.INT64,
    np.dtype("int32"): TensorProto.INT32,
    np.dtype("bool"): TensorProto.BOOL,
}


class OnnxBuilder:
    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._counter = 0

    def fresh(self, hint: str = "v") -> str:
        self._counter += 1
        return f"{hint}_{self._counter}"

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs):
        """Append a node; returns its output name (or the list of names when n_out > 1)."""
        outputs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outputs, **attrs))
        return outputs[0] if n_out == 1 else outputs

    def constant(self, array, hint: str = "c") -> str:
        """An initializer holding `array` (numpy array or anything np.asarray takes)."""
        name = self.fresh(hint)
        # (not np.ascontiguousarray: it turns a 0-d scalar into shape [1])
        self.initializers.append(numpy_helper.from_array(np.require(np.asarray(array), requirements="C"), name))
        return name

    def ints(self, values) -> str:
        return self.constant(np.asarray(list(values), dtype=np.int64), "ints")

    def add_input(self, name: str, dtype: np.dtype, shape) -> None:
        self.inputs.append(helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(dtype)], list(shape)))

    def add_output(self, name: str, dtype: np.dtype, shape) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(dtype)], list(shape)))

    def model(self) -> onnx.ModelProto:
        # filled in place: helper.make_model copies a whole graph (weights included) once more
        model = onnx.ModelProto(ir_version=10, producer_name="blade",
                                opset_import=[helper.make_opsetid("", OPSET)])
        graph = model.graph
        graph.name = self.name
        graph.node.extend(self.nodes)
        graph.input.extend(self.inputs)
        graph.output.extend(self.outputs)
        graph.initializer.extend(self.initializers)
        return model
