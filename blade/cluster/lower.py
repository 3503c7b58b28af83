"""Lower one cluster (TorchScript nodes) to its ONNX file: the backend contract, checked."""
from __future__ import annotations

import onnx
import onnx.shape_inference

from blade.cluster.onnx_builder import NP_TO_ONNX, OnnxBuilder
from blade.cluster.partition import Cluster
from blade.cluster.rules.base import LowerCtx, LoweringError, tensor_info
from blade.cluster.support import rule_for
from blade.engine.ir import without_weight_values

ONNX_TO_NP = {code: dtype for dtype, code in NP_TO_ONNX.items()}


def lower_cluster(cluster: Cluster, name: str, run_time: dict | None = None,
                  origins: list | None = None) -> onnx.ModelProto:
    """The cluster as an ONNX model whose inputs/outputs follow cluster.inputs/outputs in order.
    Raises LoweringError when a rule fails or ONNX disagrees with torch about a shape/dtype.
    ``run_time``: value -> its dims that are run-time sizes (LowerCtx). ``origins``, when given,
    receives per cluster node (node, ONNX nodes and initializers made so far, counted after it)."""
    builder = OnnxBuilder(name)
    names: dict = {}
    for i, value in enumerate(cluster.inputs):
        dtype, shape = tensor_info(value)
        names[value] = f"input_{i}"
        builder.add_input(names[value], dtype, shape)
    ctx = LowerCtx(builder, names, run_time)
    for node in cluster.nodes:
        try:
            results = rule_for(node).lower(ctx, node)
        except LoweringError:
            raise
        except Exception as err:  # a rule crashing is a lowering bug; keep the cluster in TorchScript
            raise LoweringError(f"lowering {node.kind()} failed: {err}") from err
        for value, result in zip(node.outputs(), results):
            names[value] = result
        if origins is not None:
            origins.append((node, len(builder.nodes), len(builder.initializers)))
    for j, value in enumerate(cluster.outputs):
        dtype, shape = tensor_info(value)
        out_name = f"output_{j}"
        builder.nodes.append(onnx.helper.make_node("Identity", [names[value]], [out_name]))
        builder.add_output(out_name, dtype, shape)
    model = builder.model()
    check_contract(model)
    return model


def check_contract(model: onnx.ModelProto) -> None:
    """onnx.checker plus strict shape inference; the declared outputs must be what ONNX infers.
    A LoweringError for an output's shape or dtype carries ``onnx_node``: the index of the node
    computing it, whose rule disagrees (blade/dynamic.py leaves that op out, not the cluster)."""
    checked = without_weight_values(model)  # the weights by type and shape only (blade/engine/ir.py)
    try:
        onnx.checker.check_model(checked)
        inferred = onnx.shape_inference.infer_shapes(checked, strict_mode=True, data_prop=True)
    except Exception as err:  # noqa: BLE001 - onnx raises several types
        error = LoweringError(f"ONNX contract check failed: {err}")
        error.onnx_node = _disagreeing_node(checked)
        raise error from err
    disagreement = _first_disagreement(model, inferred)
    if disagreement is not None:
        error = LoweringError(disagreement[0])
        error.onnx_node = disagreement[1]
        raise error


def _first_disagreement(model: onnx.ModelProto, inferred: onnx.ModelProto):
    """(message, index of the node computing it) of the first graph output whose declared type is
    not what ONNX infers, else None."""
    known = {v.name: v for v in inferred.graph.value_info}
    producers = {out: k for k, node in enumerate(model.graph.node) for out in node.output}
    for output in model.graph.output:
        source = model.graph.node[producers[output.name]].input[0]
        info = known.get(source)
        if info is None:
            continue  # it is a graph input or initializer: declared types already match
        want = _signature(output)
        got = _signature(info)
        # a dim ONNX leaves unknown (a Range or Expand to sizes read from shapes) is not compared
        if got[0] != want[0] or len(got[1]) != len(want[1]) or any(
                g is not None and g != w for g, w in zip(got[1], want[1])):
            return f"ONNX infers {got} for {output.name}, torch has {want}", producers.get(source)
    return None


def _disagreeing_node(checked: onnx.ModelProto):
    """After strict inference failed: the node computing an output whose declared shape is not
    what ONNX infers without the declared shapes (strict mode names only the output's Identity),
    None when that is not why."""
    loose = onnx.ModelProto()
    loose.CopyFrom(checked)
    for output in loose.graph.output:
        output.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(loose, strict_mode=True, data_prop=True)
    except Exception:  # noqa: BLE001 - it fails for another reason
        return None
    disagreement = _first_disagreement(checked, inferred)
    return None if disagreement is None else disagreement[1]


def _signature(value_info) -> tuple:
    ttype = value_info.type.tensor_type
    dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in ttype.shape.dim)
    return str(ONNX_TO_NP.get(ttype.elem_type, ttype.elem_type)), dims
