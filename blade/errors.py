"""Engine failures as the errors eager PyTorch raises for the same input.

An engine reports a bad index with a status code (cpp/blade_abi.h, BLADE_ERR_INDEX_OUT_OF_RANGE),
which the Engine turns into a RuntimeError; the TorchScript interpreter around it would turn any
other type into a RuntimeError as well. Eager raises IndexError for embedding, index_select and
tensor indexing and RuntimeError for gather, so the compiled module raises ``EngineIndexError``,
which is both: code catching either type catches it, like with eager, and its message names the
cluster's indexing ops and their source lines (the engine cannot say which index it was).
"""
from __future__ import annotations

import re

from blade.cluster.rules.indexing import RANGE_CHECKED

# describe_error_code in cpp/engine.cpp words BLADE_ERR_INDEX_OUT_OF_RANGE like this.
_INDEX_FAILURE = re.compile(r"blade engine '([^']+)': execution failed: index out of range")


class EngineIndexError(IndexError, RuntimeError):
    """An index outside its dimension reached an engine (eager raises IndexError or RuntimeError)."""


def translate_engine_error(err: RuntimeError, report) -> Exception | None:
    """The error to raise for an engine's run-time failure, or None to re-raise ``err`` as is."""
    match = _INDEX_FAILURE.search(str(err))
    if match is None:
        return None
    cluster = match.group(1)
    rep = next((c for c in report.clusters if c.name == cluster), None)
    ops = [line for line in (rep.sources if rep else []) if line.split()[0] in RANGE_CHECKED]
    where = "".join(f"\n  {line}" for line in ops) or f" (ops: {', '.join(rep.op_kinds) if rep else '?'})"
    return EngineIndexError(f"blade: {cluster}: an index is out of range for the dimension it "
                            f"indexes (eager raises here too); the cluster's indexing ops:{where}")
