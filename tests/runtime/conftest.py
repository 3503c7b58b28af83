"""Fixtures of the runtime tests: hand-written engines compiled once per session."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blade._C import _testing
from blade.engine.manifest import TensorSpec
from runtime_testing import ADD_INPUTS, ADD_OUTPUTS, ADD_SCRATCH_BYTES, compile_engine, make_engine


# BLADE_GEMM's modes: "onednn-packed" runs oneDNN's inner product on a reordered weight where B is
# an engine constant (a single GEMM) and oneDNN's matmul elsewhere; "panels" the runtime's own
# kernel where B is a constant (MKL elsewhere); "auto" times every
# applicable kernel per shape and keeps the fastest.
@pytest.fixture(params=["mkl", "onednn-matmul", "onednn-packed", "panels", "auto"])
def gemm_backend(request):
    """Pins the runtime's GEMM kernels for one test (process-wide), then back to BLADE_GEMM's."""
    _testing.set_gemm_backend(request.param)
    yield request.param
    _testing.set_gemm_backend("")


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


# The hand-written engines, as the torch side would build them from a manifest.
@pytest.fixture(scope="session")
def add_bias() -> torch.Tensor:
    return torch.linspace(-1, 1, 128)


@pytest.fixture(scope="session")
def add_engine(engine_dir, add_bias):
    so = compile_engine("add", engine_dir)
    return make_engine("cluster_add", so.read_bytes(), ADD_INPUTS, ADD_OUTPUTS, [add_bias], ADD_SCRATCH_BYTES,
                       info_json='{"source": "engines/add.cpp"}')


@pytest.fixture(scope="session")
def matmul_engine(engine_dir):
    so = compile_engine("matmul", engine_dir)
    weight = torch.randn(16, 4)
    engine = make_engine("cluster_matmul", so.read_bytes(), [TensorSpec("x", "float32", [2, 8, 16])],
                         [TensorSpec("out", "float32", [2, 8, 4])], [weight])
    return engine, weight


@pytest.fixture(scope="session")
def embedding_engine(engine_dir):
    so = compile_engine("embedding", engine_dir)
    table = torch.randn(10, 3)
    engine = make_engine("cluster_embedding", so.read_bytes(), [TensorSpec("ids", "int64", [4])],
                         [TensorSpec("out", "float32", [4, 3])], [table])
    return engine, table
