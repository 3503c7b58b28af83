"""CLI of one engine compile: ``compile_main ONNX OUT_DIR --options JSON`` (torch-free).

The driver runs this in a fresh subprocess per cluster. Exit status 0 on success; otherwise the
error (naming the command and log that reproduce it) is printed on stderr.

Test-only fault injection: BLADE_TEST_COMPILE_FAULT=crash|timeout|garbage makes the process
abort, hang (with a child process, like a stuck g++), or "succeed" with unusable artifacts.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FAULT_ENV = "BLADE_TEST_COMPILE_FAULT"


def _hang(out_dir: Path):
    child = subprocess.Popen(["sleep", "3600"])
    (out_dir / "fault_child.pid").write_text(str(child.pid))
    time.sleep(3600)


def _garbage(out_dir: Path):
    (out_dir / "engine.so").write_bytes(b"not a shared object")
    (out_dir / "manifest.json").write_text("{ truncated")
    sys.exit(0)


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
    try:
        compile_onnx(args.onnx, out_dir, json.loads(args.options))
    except Exception as err:  # one line for the driver's error message, full detail after it
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
