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
        # Initializers are written into the model as they are made: adding a finished TensorProto
        # to a model copies it, and a cluster's weights (GPT-2's: 64 MB) were copied once more per
        # lowering for 0.15 s of CPU (a cluster with run-time sizes is lowered at three probes).
        self._model = onnx.ModelProto(ir_version=10, producer_name="blade",
                                      opset_import=[helper.make_opsetid("", OPSET)])
        self.initializers = self._model.graph.initializer
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
        array = np.require(np.asarray(array), requirements="C")
        if array.dtype not in NP_TO_ONNX:
            tensor = numpy_helper.from_array(array, name)  # (before add(): it may raise)
            self.initializers.add().CopyFrom(tensor)
            return name
        tensor = self.initializers.add()  # what numpy_helper.from_array makes of it, in place
        tensor.dims.extend(array.shape)
        tensor.name, tensor.data_type = name, NP_TO_ONNX[array.dtype]
        tensor.raw_data = numpy_helper.tobytes_little_endian(array)
        return name

    def ints(self, values) -> str:
        return self.constant(np.asarray(list(values), dtype=np.int64), "ints")

    def add_input(self, name: str, dtype: np.dtype, shape) -> None:
        self.inputs.append(helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(dtype)], list(shape)))

    def add_output(self, name: str, dtype: np.dtype, shape) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(dtype)], list(shape)))

    def model(self) -> onnx.ModelProto:
        """The model, holding the initializers made so far (the same object on every call)."""
        # filled in place: helper.make_model copies a whole graph (weights included) once more;
        # cleared first so that a second call does not list the nodes and inputs twice
        graph = self._model.graph
        graph.name = self.name
        for repeated in ("node", "input", "output"):
            graph.ClearField(repeated)
        graph.node.extend(self.nodes)
        graph.input.extend(self.inputs)
        graph.output.extend(self.outputs)
        return self._model
