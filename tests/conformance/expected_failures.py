"""The one side table of expected sweep failures: (op name, dtype) or op name -> reason.

A key is an OpInfo name (with ".variant" for variants) and optionally a dtype of
opinfo_sweep.DTYPES. A listed group that passes all its cases is an XPASS: remove its line.
Reasons name the class of the failure (and who owns it, when another branch does).
"""
from __future__ import annotations

# Only refusals (a kind left in TorchScript, an error): a wrong result is a FAIL even when listed.
# (Training-mode norms' running statistics, once listed, were fixed by the frontend's mutation
# handling: blade/cluster/aliasing.py.)
EXPECTED_FAILURES: dict = {}


def expected_failure(op: str, dtype: str):
    """The reason a group is expected to fail, or None."""
    return EXPECTED_FAILURES.get((op, dtype), EXPECTED_FAILURES.get(op))
