"""The runtime packs constant GEMM/conv weights once per engine (cpp/runtime.h PackedWeights): results
stay equal to torch on every call, from concurrent first calls, and operands computed at run time
(which change every call) are never served from the cache; with each GEMM kernel pinned (MKL's
pack, oneDNN's reordered weight)."""
import torch
import torch.nn.functional as F

from blade.engine.manifest import TensorSpec
from runtime_testing import compile_engine, make_engine, run_in_threads

INPUTS = [TensorSpec("x", "float32", [1, 3, 8, 8]), TensorSpec("y", "float32", [5, 16]),
          TensorSpec("v", "float32", [16, 8]), TensorSpec("u", "float32", [4, 3, 3, 3])]
OUTPUTS = [TensorSpec("conv", "float32", [1, 4, 6, 6]), TensorSpec("gemm", "float32", [5, 8]),
           TensorSpec("gemm_runtime_b", "float32", [5, 8]), TensorSpec("conv_runtime_w", "float32", [1, 4, 6, 6])]


def weights_engine(engine_dir, constants):
    so = compile_engine("weights", engine_dir)
    return make_engine("cluster_weights", so.read_bytes(), INPUTS, OUTPUTS, constants, scratch_bytes=236 * 4)


def check_call(engine, constants, generator):
    w, b, m = constants
    x, y = torch.randn(1, 3, 8, 8, generator=generator), torch.randn(5, 16, generator=generator)
    v, u = torch.randn(16, 8, generator=generator), torch.randn(4, 3, 3, 3, generator=generator)
    want = [F.conv2d(x, w, b), y @ m, y @ (2 * v), F.conv2d(x, 2 * u)]
    for got, expected in zip(engine.execute([x, y, v, u]), want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_packed_weights_match_torch_on_every_call(engine_dir, gemm_backend):
    constants = [torch.randn(4, 3, 3, 3), torch.randn(4), torch.randn(16, 8)]
    engine = weights_engine(engine_dir, constants)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):  # the first call packs, the later ones reuse; run-time operands differ each call
        check_call(engine, constants, generator)


def test_concurrent_first_calls_pack_safely(engine_dir, gemm_backend):
    constants = [torch.randn(4, 3, 3, 3), torch.randn(4), torch.randn(16, 8)]
    engine = weights_engine(engine_dir, constants)
    errors = []

    def worker(seed):
        try:
            generator = torch.Generator().manual_seed(seed)
            for _ in range(10):
                check_call(engine, constants, generator)
        except AssertionError as error:
            errors.append(error)

    run_in_threads(worker)
    assert errors == []
