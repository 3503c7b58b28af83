"""CLI of one engine compile: ``compile_main ONNX OUT_DIR --options JSON`` (torch-free).

The driver runs this in a fresh subprocess per cluster. Exit status 0 on success; otherwise the
error (naming the command and log that reproduce it) is printed on stderr.

Test-only fault injection: BLADE_TEST_COMPILE_FAULT=crash|timeout|garbage makes the process
abort, hang (with a child process, like a stuck g++), or "succeed" with unusable artifacts.
BLADE_TEST_PERTURB_CLUSTER=cluster_<k> compiles that cluster (its out dir's name) with 0.5 added to
its first output, so the engine is wrong but loads and runs: what fallback="check" must catch.
Both switches bypass nothing in the cache key: tests using them need their own cache_dir.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

FAULT_ENV = "BLADE_TEST_COMPILE_FAULT"
PERTURB_ENV = "BLADE_TEST_PERTURB_CLUSTER"


def _hang(out_dir: Path):
    child = subprocess.Popen(["sleep", "3600"])
    (out_dir / "fault_child.pid").write_text(str(child.pid))
    time.sleep(3600)


def _garbage(out_dir: Path):
    (out_dir / "engine.so").write_bytes(b"not a shared object")
    (out_dir / "manifest.json").write_text("{ truncated")
    sys.exit(0)


def _perturbed(onnx_path: str, out_dir: Path) -> str:
    """A copy of the model whose first output is the original plus 0.5 (float outputs only)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper
    model = onnx.load(onnx_path)
    first = model.graph.output[0].name
    producer = next(node for node in model.graph.node if first in node.output)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(model.graph.output[0].type.tensor_type.elem_type)
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.5, dtype=dtype), "blade_test_offset"))
    producer.output[list(producer.output).index(first)] = "blade_test_unperturbed"
    model.graph.node.append(onnx.helper.make_node("Add", ["blade_test_unperturbed", "blade_test_offset"], [first]))
    path = out_dir / "perturbed.onnx"
    onnx.save(model, path)
    return str(path)


FAULTS = {"crash": lambda out_dir: os.abort(), "timeout": _hang, "garbage": _garbage}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="compile_main", description=__doc__.splitlines()[0])
    parser.add_argument("onnx")
    parser.add_argument("out_dir")
    parser.add_argument("--options", default="{}", help="engine compile options as JSON")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fault = os.environ.get(FAULT_ENV)
    if fault:
        FAULTS[fault](out_dir)
    from .compiler import compile_onnx  # after the fault switch: faults need no onnx import
    if os.environ.get(PERTURB_ENV) == out_dir.name:
        args.onnx = _perturbed(args.onnx, out_dir)
    try:
        compile_onnx(args.onnx, out_dir, json.loads(args.options))
    except Exception as err:  # the traceback, then one line that ends the log the driver's error quotes
        traceback.print_exc()
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
