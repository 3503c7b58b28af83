"""Helpers for the runtime tests (imported by conftest.py and the tests): compile the hand-written engines in engines/ with g++ the way the
engine compiler does (against cpp/blade_abi.h) and wrap them into torch.classes.blade.Engine."""
from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest
import torch

import blade._C  # noqa: F401  (registers torch.classes.blade.Engine)
from blade.engine.manifest import Manifest, SizeSymbol, TensorSpec

REPO = Path(__file__).resolve().parents[2]
ENGINE_SOURCES = Path(__file__).resolve().parent / "engines"
CXX_FLAGS = ["-O2", "-shared", "-fPIC", "-std=c++17", f"-I{REPO / 'cpp'}"]


def compile_engine(source: str, out_dir: Path, defines: dict[str, str] | None = None,
                   extra_flags: tuple[str, ...] = ()) -> Path:
    """engines/<source>.cpp -> <out_dir>/<source>[-defines][-flags].so"""
    defines = defines or {}
    suffix = "".join(f"-{k}={v}" for k, v in sorted(defines.items())) + "".join(extra_flags).replace("/", "_")
    so_path = out_dir / f"{source}{suffix}.so"
    if not so_path.exists():
        command = ["g++", *CXX_FLAGS, *(f"-D{k}={v}" for k, v in defines.items()), *extra_flags,
                   str(ENGINE_SOURCES / f"{source}.cpp"), "-o", str(so_path)]
        subprocess.run(command, check=True, capture_output=True, text=True)
    return so_path


def engine_args(name: str, so_bytes: bytes, inputs: list[TensorSpec], outputs: list[TensorSpec],
                constants: list[torch.Tensor] = (), scratch_bytes: int = 0, isa: str | None = None,
                abi_version: int | None = None, info_json: str = "{}", fallback_module: bytes = b"",
                fallback_mode: str = "off", rtol: float = 1e-4, atol: float = 1e-5, ops_source: str = "",
                symbols: list[SizeSymbol] = ()) -> list:
    """The Engine constructor's arguments, in order; tests change single entries to break them.
    A dim of a spec's shape may name one of `symbols`."""
    codes = Manifest(0, "", [], [], [], 0, symbols=list(symbols)).shape_codes
    return [
        name,
        torch.tensor(list(so_bytes), dtype=torch.uint8),
        blade._C.host_isa() if isa is None else isa,
        blade._C.abi_version() if abi_version is None else abi_version,
        [t.name for t in inputs], [t.dtype for t in inputs], [codes(t) for t in inputs],
        [t.name for t in outputs], [t.dtype for t in outputs], [codes(t) for t in outputs],
        list(constants),
        scratch_bytes,
        info_json,
        torch.tensor(list(fallback_module), dtype=torch.uint8),
        fallback_mode, rtol, atol, ops_source,
        [s.name for s in symbols], [[s.min, s.max] for s in symbols],
    ]


def make_engine(*args, **kwargs):
    return torch.classes.blade.Engine(*engine_args(*args, **kwargs))


ADD_INPUTS = [TensorSpec("x", "float32", [64, 128]), TensorSpec("y", "float32", [64, 128])]
ADD_OUTPUTS = [TensorSpec("sum", "float32", [64, 128]), TensorSpec("product", "float32", [64, 128])]
ADD_SCRATCH_BYTES = 64 * 128 * 4


def run_in_threads(worker, count: int = 4) -> None:
    """worker(seed) on `count` threads at once; returns when all are done."""
    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
