"""Building small ONNX test models and checking compiled engines against onnx's numpy reference."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from blade.engine.compiler import compile_onnx, load_constants
from blade.engine.npruntime import NumpyEngine

OPSET = 20


def random_array(shape, dtype, rng):
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in ("int64", "int32"):
        return rng.integers(-5, 6, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@dataclass
class Case:
    """One model: graph inputs get random values (or `values`), constants become initializers."""
    name: str
    model: onnx.ModelProto
    feeds: dict
    rtol: float = 1e-5
    atol: float = 1e-5
    expect_error: str | None = None     # substring of the engine's run error
    extra: dict = field(default_factory=dict)


def graph_case(name, nodes, inputs, outputs, inits=None, values=None, seed=0, **tolerances) -> Case:
    """inputs: {name: (shape, dtype)}; inits: {name: ndarray}; outputs: names. Output types are
    taken from the reference's results (the backend contract wants typed outputs)."""
    rng = np.random.default_rng(seed)
    feeds = {n: (values or {}).get(n, random_array(shape, dtype, rng)) for n, (shape, dtype) in inputs.items()}
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(dt)), shape)
                    for n, (shape, dt) in inputs.items()]
    initializers = [numpy_helper.from_array(np.asarray(v), n) for n, v in (inits or {}).items()]
    untyped = [helper.make_value_info(n, onnx.TypeProto()) for n in outputs]
    inferred = onnx.shape_inference.infer_shapes(_model(nodes, graph_inputs, untyped, initializers))
    types = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)
             + graph_inputs + [helper.make_tensor_value_info(i.name, i.data_type, i.dims) for i in initializers]}
    if not all(types.get(n) and types[n].type.HasField("tensor_type") for n in outputs):
        # inference can stop early (duplicate outputs, shape inputs): take the reference's results
        results = ReferenceEvaluator(_model(nodes, graph_inputs, untyped, initializers)).run(None, feeds)
        types = {n: helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(r.dtype), r.shape)
                 for n, r in zip(outputs, results)}
    typed = [types[n] for n in outputs]
    return Case(name, _model(nodes, graph_inputs, typed, initializers), feeds, **tolerances)


def _model(nodes, inputs, outputs, initializers):
    graph = helper.make_graph(nodes, "cluster", inputs, outputs, initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def op_case(op, shapes, *consts, dtype="float32", dtypes=None, outputs=1, name=None, values=None,
            rtol=1e-5, atol=1e-5, **attrs) -> Case:
    """A single-node model: graph inputs of `shapes` (dtype, or per input `dtypes`), followed by
    constant inputs `consts` (numpy arrays as initializers; None = omitted optional input)."""
    dtypes = dtypes or [dtype] * len(shapes)
    inputs = {f"x{i}": (shape, dt) for i, (shape, dt) in enumerate(zip(shapes, dtypes))}
    inits = {f"k{i}": c for i, c in enumerate(consts) if c is not None}
    names = list(inputs) + [f"k{i}" if c is not None else "" for i, c in enumerate(consts)]
    out_names = [f"y{i}" for i in range(outputs)]
    node = helper.make_node(op, names, out_names, **attrs)
    label = name or f"{op}-{'-'.join('x'.join(map(str, s)) or 'scalar' for s in shapes)}-{dtypes[0] if shapes else ''}"
    return graph_case(label, [node], inputs, out_names, inits, values, rtol=rtol, atol=atol)


def compile_cases(cases, root, parallelism=2) -> dict:
    """name -> (so_path, manifest) or the exception, compiling in threads (g++ runs in parallel)."""
    def one(case):
        out = root / case.name
        try:
            return case.name, (out / "engine.so", compile_onnx(case.model, out))
        except Exception as err:  # reported by the test of that case
            return case.name, err
    with ThreadPoolExecutor(parallelism) as pool:
        return dict(pool.map(one, cases))


def run_case(case: Case, so_path, manifest):
    engine = NumpyEngine(so_path, manifest, load_constants(case.model, manifest))
    return engine(*(case.feeds[spec.name] for spec in manifest.inputs))


def check_case(case: Case, compiled):
    if isinstance(compiled, Exception):
        raise compiled
    got = run_case(case, *compiled)
    with np.errstate(all="ignore"):  # the reference overflows on purpose in the whole-range cases
        want = ReferenceEvaluator(case.model).run(None, case.feeds)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        w = np.asarray(w)
        assert g.dtype == w.dtype, f"output {i}: dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"output {i}: shape {g.shape} != {w.shape}"
        np.testing.assert_allclose(g, w, rtol=case.rtol, atol=case.atol, err_msg=f"{case.name} output {i}")
