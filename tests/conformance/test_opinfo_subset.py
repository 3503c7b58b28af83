"""A fixed, fast slice of the OpInfo sweep (opinfo_sweep.py) for `make test`: one or two OpInfo
samples per family of the lowering table, compiled with engines forced on and compared with eager
(outputs and inputs after the call). Every case must reach an engine (but the few that must stay in
TorchScript, each with its reason, in IN_TORCHSCRIPT), so a silent all-TorchScript run cannot pass;
a failing case of a group listed in expected_failures.py is an expected failure. Plus the first
sample of each kind's first composite case (composite_cases.py), which must put its kind in an engine."""
import pytest

from .composite_cases import COMPOSITE_CASES
from .expected_failures import expected_failure
from .opinfo_sweep import DTYPES, op_db, op_name, run_case, samples_of

# (OpInfo name, dtype, sample index)
FAST_CASES = [
    # arithmetic, integer semantics
    ("add", "f32", 0), ("add", "i64", 0), ("rsub", "i64", 0), ("mul", "i32", 0),
    ("mul", "bool", 0), ("div.no_rounding_mode", "f32", 0), ("div.floor_rounding", "i64", 0),
    ("div.trunc_rounding", "i32", 0), ("true_divide", "f64", 0), ("pow", "f32", 0), ("pow", "i64", 0),
    ("maximum", "f32", 0), ("minimum", "i64", 0),
    # unary math and activations
    ("neg", "f32", 0), ("abs", "i32", 0), ("nn.functional.relu", "f32", 0), ("sigmoid", "f32", 0),
    ("tanh", "f64", 0), ("exp", "f32", 0), ("log", "f32", 0), ("sqrt", "f64", 0), ("rsqrt", "f32", 0),
    ("reciprocal", "f32", 0), ("erf", "f32", 0), ("floor", "f32", 0), ("sin", "f32", 0),
    ("nn.functional.gelu", "f32", 0), ("nn.functional.silu", "f32", 0),
    ("nn.functional.hardswish", "f32", 0), ("nn.functional.elu", "f32", 0),
    ("nn.functional.softplus", "f32", 0), ("nn.functional.mish", "f32", 0),
    ("clamp", "f32", 0), ("clamp_min", "i64", 0),
    # selection, comparison, logic, casts
    ("where", "f32", 0), ("masked_fill", "f32", 0), ("eq", "i64", 0), ("lt", "f32", 0),
    ("gt", "i32", 0), ("logical_not", "bool", 0), ("logical_and", "bool", 0), ("bitwise_or", "bool", 0),
    ("bitwise_not", "bool", 0), ("to", "f32", 0), ("float", "i64", 0),
    # reductions and normalizations
    ("sum", "f32", 0), ("mean", "f64", 0), ("amax", "f32", 0), ("amin", "i64", 0), ("softmax", "f32", 0),
    ("log_softmax", "f32", 0), ("nn.functional.layer_norm", "f32", 0), ("prod", "f32", 0),
    ("max.reduction_no_dim", "f32", 0), ("any", "bool", 0), ("all", "f32", 0),
    ("var", "f32", 0), ("std", "f64", 0), ("linalg.vector_norm", "f32", 2), ("logsumexp", "f32", 1),
    ("cumsum", "f32", 0), ("nn.functional.batch_norm", "f32", 1), ("nn.functional.group_norm", "f32", 0),
    ("nn.functional.instance_norm", "f32", 0),   # training mode: the norm stays in TorchScript
    # convolution, pooling, padding
    ("nn.functional.conv2d", "f32", 0), ("nn.functional.conv1d", "f32", 0), ("nn.functional.max_pool2d", "f32", 1),
    ("nn.functional.pad.constant", "f32", 0), ("nn.functional.pad.reflect", "f32", 0),
    ("nn.functional.pad.replicate", "f32", 0),
    # linear algebra (OpInfo's sdpa wrapper breaks dynamo's graph: test_op_table covers sdpa)
    ("nn.functional.linear", "f32", 0), ("matmul", "f32", 0), ("bmm", "f32", 0), ("mm", "f64", 0),
    ("addmm", "f32", 0), ("baddbmm", "f32", 0),
    # shapes and data movement
    ("view", "f32", 0), ("reshape", "i64", 0), ("permute", "f32", 0),
    ("transpose", "f32", 0), ("squeeze", "f32", 0), ("expand", "f32", 0),
    ("narrow", "f32", 0), ("select", "f32", 0), ("cat", "f32", 0), ("stack", "f32", 0), ("unbind", "f32", 0),
    ("split", "f32", 0), ("nn.functional.embedding", "f32", 0), ("__getitem__", "f32", 0),
    ("index_select", "f32", 1), ("gather", "f32", 0), ("tril", "f32", 0), ("repeat", "f32", 0),
    ("roll", "f32", 0), ("flip", "f32", 0),
    # tensor creation and resampling
    ("zeros_like", "f32", 0),
    ("nn.functional.interpolate.nearest", "f32", 0), ("nn.functional.interpolate.bilinear", "f32", 0),
]

# Cases that must match eager but, by design, run no engine: the op alone returns a view of the
# graph's input (eager's result shares the input's memory; an engine's would not), or it writes
# its inputs (training-mode running statistics). Inside a model the same ops reach engines.
IN_TORCHSCRIPT = {
    **{(name, dtype, 0): "a view of the graph input, returned: its memory must stay shared"
       for name, dtype in (("view", "f32"), ("reshape", "i64"), ("permute", "f32"), ("transpose", "f32"),
                           ("squeeze", "f32"), ("expand", "f32"), ("narrow", "f32"), ("select", "f32"),
                           ("unbind", "f32"), ("split", "f32"))},
    ("nn.functional.instance_norm", "f32", 0): "training mode: writes running_mean/running_var in place",
}


@pytest.fixture(scope="module")
def ops_by_name():
    return {op_name(op): op for op in op_db()}


@pytest.mark.parametrize("name,dtype,index", FAST_CASES, ids=[f"{n}-{d}-{i}" for n, d, i in FAST_CASES])
def test_opinfo_case(ops_by_name, name, dtype, index):
    op = ops_by_name[name]
    samples = samples_of(op, DTYPES[dtype], index + 1)
    assert len(samples) > index, f"{name} has no sample {index} for {dtype}"
    result = run_case(op, dtype, index, samples[index])
    reason = expected_failure(name, dtype)
    if result.failed and reason is not None:
        # Whether the whole group still fails (else XPASS) is the full sweep's call: it runs them all.
        pytest.xfail(reason)
    assert result.status == "pass", f"{result.status}: {result.detail}"
    stays = IN_TORCHSCRIPT.get((name, dtype, index))
    assert result.engine == (stays is None), \
        f"engine ran: {result.engine}; expected {'none (' + stays + ')' if stays else 'an engine'}"


# The first composite case of each kind, on its first dtype and first sample (the full sweep runs
# every edge sample): the kinds OpInfo's one-op graphs leave without an engine.
FAST_COMPOSITE = [case for i, case in enumerate(COMPOSITE_CASES)
                  if all(other.kind != case.kind for other in COMPOSITE_CASES[:i])]


@pytest.mark.parametrize("case", FAST_COMPOSITE, ids=[case.kind.split("::")[1] for case in FAST_COMPOSITE])
def test_composite_case(case):
    dtype = case.dtypes[0]
    result = run_case(case, dtype, 0, samples_of(case, DTYPES[dtype], 1)[0])
    assert result.status == "pass", f"{result.status}: {result.detail}"
    assert case.kind in result.engine_ops
