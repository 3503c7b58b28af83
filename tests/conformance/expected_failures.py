"""The one side table of expected sweep failures: (op name, dtype) or op name -> reason.

A key is an OpInfo name (with ".variant" for variants) and optionally a dtype of
opinfo_sweep.DTYPES. A listed group that passes all its cases is an XPASS: remove its line.
Reasons name the class of the failure (and who owns it, when another branch does).
"""
from __future__ import annotations

_RUNNING_STATS = ("mutation: a training-mode norm updates its running_mean/running_var inputs in place, and "
                  "the frontend's runs of the graph on the example inputs while compiling update them again "
                  "(state branch)")

EXPECTED_FAILURES: dict = {
    # mutation: in-place updates of graph inputs (frontend state/mutation branch)
    ("nn.functional.batch_norm", "f32"): _RUNNING_STATS,
    ("native_batch_norm", "f32"): _RUNNING_STATS,
    ("_native_batch_norm_legit", "f32"): _RUNNING_STATS,
    ("_batch_norm_with_update", "f32"): _RUNNING_STATS,
    ("nn.functional.instance_norm", "f32"): _RUNNING_STATS,
    ("nn.functional.instance_norm", "f64"): _RUNNING_STATS,
}


def expected_failure(op: str, dtype: str):
    """The reason a group is expected to fail, or None."""
    return EXPECTED_FAILURES.get((op, dtype), EXPECTED_FAILURES.get(op))
