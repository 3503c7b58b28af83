"""Helpers for the runtime tests (imported by conftest.py and the tests): compile the hand-written engines in engines/ with g++ the way the
engine compiler does (against cpp/blade_abi.h) and wrap them into torch.classes.blade.Engine."""
from __future__ import annotations

import contextlib
import itertools
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import blade._C  # noqa: F401  (registers torch.classes.blade.Engine)
from blade._C import _testing
from blade.engine.manifest import Manifest, SizeSymbol, TensorSpec

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's intra-op thread count set to `threads` for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return {flag for line in cpuinfo if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


_FLAGS = _cpu_flags()
# The runtime's own GEMM (cpp/gemm_panels.cpp) runs on AVX-512 CPUs and on AVX2 ones with FMA (a
# constant B and a computed one alike): there "auto" has one more candidate.
PANELS_USABLE = "avx512f" in _FLAGS or {"avx2", "fma"} <= _FLAGS
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


def operand(rng, batch, batch_stride, rows, cols, ld, transposed):
    """A flat buffer holding `batch` [rows, cols] matrices laid out as the sgemm contract says, plus
    the dense [batch, rows, cols] array it represents. Padding holds NaN so stray reads show."""
    size = (batch - 1) * batch_stride + (cols - 1) * ld + rows if transposed else \
        (batch - 1) * batch_stride + (rows - 1) * ld + cols
    flat = np.full(max(size, 0), np.nan, dtype=np.float32)
    dense = rng.standard_normal((batch, rows, cols)).astype(np.float32)
    if batch_stride == 0:
        dense[:] = dense[0]
    if dense.size:
        steps = (batch_stride, 1, ld) if transposed else (batch_stride, ld, 1)
        view = np.lib.stride_tricks.as_strided(flat, dense.shape, [s * flat.itemsize for s in steps])
        view[...] = dense  # a shared operand (batch stride 0) writes the same matrix each time
    return flat, dense


def run_sgemm(batch, m, n, k, alpha, beta, trans_a, trans_b, shared_a=False, shared_b=False, pad=3, seed=0,
              pack=False):
    """C = alpha op(A) op(B) + beta C through the runtime's sgemm, checked against float64; returns C."""
    rng = np.random.default_rng(seed)
    lda = max(1, (m if trans_a else k) + pad)  # BLAS wants ld >= 1 even for an empty dimension
    ldb = max(1, (k if trans_b else n) + pad)
    ldc = n + pad
    stride_a = 0 if shared_a else (k if trans_a else m) * lda
    stride_b = 0 if shared_b else (n if trans_b else k) * ldb
    stride_c = m * ldc
    a_flat, a = operand(rng, batch, stride_a, m, k, lda, trans_a)
    b_flat, b = operand(rng, batch, stride_b, k, n, ldb, trans_b)
    c_flat, c = operand(rng, batch, stride_c, m, n, ldc, False)
    if beta == 0:  # C's old contents must be ignored entirely, even NaN
        c_flat[:] = np.nan
    want = alpha * (a.astype(np.float64) @ b.astype(np.float64)) + (beta * c if beta != 0 else 0)

    c_tensor = torch.from_numpy(c_flat)
    _testing.sgemm(batch, m, n, k, alpha, torch.from_numpy(a_flat), lda, stride_a, trans_a,
                   torch.from_numpy(b_flat), ldb, stride_b, trans_b, beta, c_tensor, ldc, stride_c, pack=pack)
    got = np.stack([[c_flat[bi * stride_c + i * ldc: bi * stride_c + i * ldc + n] for i in range(m)]
                    for bi in range(batch)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # Padding between C's rows is not C's: it must be untouched.
    if beta != 0:
        for bi, i in itertools.product(range(batch), range(m)):
            row_end = bi * stride_c + i * ldc + n
            assert np.isnan(c_flat[row_end: row_end + pad]).all()
    return got
