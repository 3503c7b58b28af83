"""Edge values (NaN, +-inf, +-0, subnormals, FLT_MAX, exp's limits, int min/max, zero divisors)
through tt_infer vs eager, for every elementwise and reduction rule of the lowering table.

One batch per (family, dtype, variant) is one compiled cluster: its ops' results are stacked into
outputs, compared row by row. "fused" feeds the ops x * one (a run-time input), so each op runs in
the same loop as a producer. Differences from eager must be in XFAIL (checked both ways); ops the
engine refuses must be in REFUSED with the reason the report gives.
"""
from __future__ import annotations

import pytest
import torch

from blade_testing import Capture
from edge_values import (binary_inputs, calls_of, edge_tested_kinds, mismatches, reduction_inputs, uncovered_rules,
                         unary_inputs)

INPUTS = {"unary": unary_inputs, "binary": binary_inputs, "reduction": reduction_inputs}
DTYPES = {"float32": torch.float32, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
# (reductions of int32 take the int64 code paths: torch sums them as int64, max/min are the same loops)
BATCHES = [(family, dtype, "plain") for family in INPUTS for dtype in DTYPES
           if (family, dtype) != ("reduction", "int32")] + [(family, "float32", "fused") for family in INPUTS]

EAGER_GELU = ("eager's vectorized exact GELU gives NaN at +inf and inf at FLT_MAX; its scalar path (1-element "
              "tensors) gives inf and FLT_MAX like the engine")
# (call label, input dtype) -> why the engine differs from eager there
XFAIL = {
    ("aten::gelu#0", "float32"): EAGER_GELU,
}
# Ties of -0 and +0: eager's maximum/minimum (and clamp with tensor bounds) return one operand in
# their vector body and the other in their scalar tail, so which zero comes out depends on the
# element's position; the sign of a zero result is not compared for these calls.
ZERO_SIGN_BY_POSITION = {"aten::maximum#0", "aten::minimum#0", "aten::max#1", "aten::min#1", "aten::clamp#1"}
# Also not compared: which zero a max/min reduction of a row holding -0 and +0 returns (its
# reduction order decides), and the zeros normalizations compute as x - mean of a constant row.
ZERO_SIGN_BY_ORDER = {"aten::amax#0", "aten::amin#0", "aten::amax#2", "aten::amin#2", "aten::max#0", "aten::min#0",
                      "aten::layer_norm#0", "aten::group_norm#0", "aten::instance_norm#0"}
# label -> (reduction input rows not compared, why). Rows 5 and 8 hold FLT_MAX and 1e38: eager's
# norms compute moments in float32 with Welford updates (row 8 all 1e38: 0; row 5: a variance of
# inf, so 0 instead of the true -0.0156), the engine as a sum (mean inf: NaN). Neither is the true
# value for row 5; the norms keep float32 moments for speed (var/std, rarely hot, use float64).
HUGE_NORM_ROWS = "moments overflowing float32 (|x| >= 1e38): eager float32 Welford vs engine sums"
ROWS_NOT_COMPARED = {"aten::layer_norm#0": ([5, 8], HUGE_NORM_ROWS), "aten::instance_norm#0": ([5, 8], HUGE_NORM_ROWS),
                     "aten::group_norm#0": ([5, 6, 7, 8, 9], HUGE_NORM_ROWS + " (rows 5-9 are one group)")}
# (aten kind, input dtype) -> a substring of the reason the report gives for leaving it out
REFUSED = {
    **{(kind, "bool"): "of a bool tensor" for kind in ("aten::max", "aten::min", "aten::argmax", "aten::argmin")},
    **{(kind, dtype): "only integers" for kind in ("aten::remainder", "aten::fmod") for dtype in ("float32", "float64")},
}


def test_every_rule_is_edge_tested_or_listed_with_a_reason():
    assert uncovered_rules() == [], "add these rules to edge_values.CALLS or NOT_EDGE_TESTED"


def _calls(family: str) -> list:
    """(label, kind, Call) of every call of this family; labels are kind#k for a kind's k-th call."""
    out = []
    for kind in edge_tested_kinds():
        for k, call in enumerate(calls_of(kind)):
            if call.family == family:
                out.append((f"{kind}#{k}", kind, call))
    return out


def _eager_results(calls, inputs):
    """The calls torch runs on these inputs (others: a dtype torch does not support) and their
    results. On bool inputs only calls with a bool result, and casts: a float op of a bool is the
    float op of 0 and 1 after a cast (the casts themselves are tested here)."""
    kept = []
    for label, kind, call in calls:
        try:
            with torch.no_grad():
                result = call.fn(*inputs)
        except (RuntimeError, TypeError, NotImplementedError):
            continue
        if inputs[0].dtype != torch.bool or result.dtype == torch.bool or kind == "aten::to":
            kept.append((label, kind, call, result))
    return kept


def _stacked_model(calls, fused: bool):
    """fn(*inputs[, one]) -> one stacked tensor per (dtype, shape) of the results; and the groups."""
    groups = {}
    for index, (_, _, _, result) in enumerate(calls):
        groups.setdefault((result.dtype, tuple(result.shape)), []).append(index)
    order = list(groups.values())

    def fn(*args):
        inputs = [x * args[-1] for x in args[:-1]] if fused else args
        results = [call.fn(*inputs) for _, _, call, _ in calls]
        return tuple(torch.stack([results[i] for i in group]) for group in order)
    return fn, order


@pytest.mark.parametrize("family,dtype,variant", BATCHES, ids=["-".join(b) for b in BATCHES])
def test_edge_values(family, dtype, variant):
    torch.manual_seed(0)
    inputs = INPUTS[family](DTYPES[dtype])
    calls = _eager_results(_calls(family), inputs)
    if not calls:
        pytest.skip(f"no {family} op takes {dtype}")
    fused = variant == "fused"
    fn, groups = _stacked_model(calls, fused)
    args = inputs + ([torch.ones((), dtype=DTYPES[dtype])] if fused else [])
    capture = Capture(min_cluster_size=1)
    with torch.no_grad():
        outputs = torch.compile(fn, backend=capture)(*args)
    assert capture.engine_calls() >= 1, "no engine ran"
    refused = {kind: reason for kind, reason in capture.report.left_out}
    unexpected_refusals = {kind: reason for kind, reason in refused.items()
                           if kind in {k for _, k, _, _ in calls} and REFUSED.get((kind, dtype), "\0") not in reason}
    assert not unexpected_refusals, f"ops left out of the engine: {unexpected_refusals}"

    failures = {}
    for group, stacked in zip(groups, outputs):
        for row, index in enumerate(group):
            label, kind, _, want = calls[index]
            if kind in refused:
                continue
            got, want = stacked[row], want.clone()
            skipped, _ = ROWS_NOT_COMPARED.get(label, ([], ""))
            if skipped:   # equal NaNs there: not compared
                got = got.clone()
                got[skipped], want[skipped] = float("nan"), float("nan")
            zero_sign = label not in ZERO_SIGN_BY_POSITION | ZERO_SIGN_BY_ORDER
            problem = mismatches(got, want, inputs, zero_sign=zero_sign)
            if problem:
                failures[label] = problem
    expected = {label for label, _, _, _ in calls if (label, dtype) in XFAIL}
    unexpected = {label: text for label, text in failures.items() if label not in expected}
    assert not unexpected, "differences from eager:\n" + "\n".join(f"{k}: {v}" for k, v in sorted(unexpected.items()))
    fixed = sorted(expected - set(failures))
    assert not fixed, f"these now match eager, remove them from XFAIL: {fixed}"


def test_float64_floor_division_follows_torch_through_fmod():
    """torch rounds float floor division through fmod (1.0 // 0.1 is 9, not floor(10.0)); the
    engine computes the same algorithm in the same dtype, so float64 is exact too."""
    x = torch.tensor([1.0, 0.5, 2.0, -1.0, 7.0, -0.0], dtype=torch.float64)
    y = torch.tensor([0.1, 0.1, 0.1, 0.1, -0.7, 3.0], dtype=torch.float64)
    fn = lambda a, b: torch.div(a, b, rounding_mode="floor") * 2  # noqa: E731
    capture = Capture(min_cluster_size=1)
    with torch.no_grad():
        out = torch.compile(fn, backend=capture)(x, y)
    assert capture.engine_calls() >= 1
    want = fn(x, y)
    assert torch.equal(out, want) and torch.equal(out.signbit(), want.signbit()), (out, want)
