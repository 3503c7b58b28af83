"""The engines' scratch pool (cpp/scratch_pool.h): a loaded engine's scratch is resident before
its first call, calls fault in none of it, and what an engine kept resident goes when it does."""
import gc
import resource

import torch

from blade._C import _testing
from runtime_testing import ADD_INPUTS, ADD_OUTPUTS, compile_engine, make_engine

SCRATCH = 24 << 20  # far more than add.cpp touches (32 KiB): the part a call at a small shape leaves


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_scratch_is_resident_from_load_and_released_with_the_engine(engine_dir, add_bias):
    so = compile_engine("add", engine_dir).read_bytes()
    before = _testing.scratch_pool()
    engine = make_engine("cluster_big_scratch", so, ADD_INPUTS, ADD_OUTPUTS, [add_bias], SCRATCH)
    blocks, free_bytes = _testing.scratch_pool()
    assert free_bytes >= SCRATCH, "the engine's scratch block is not ready after load"
    x, y = torch.randn(64, 128), torch.randn(64, 128)
    faults = minor_faults()
    engine.execute([x, y])
    # (the two outputs are 32 KiB each; a scratch that faulted in would be ~6000 pages)
    assert minor_faults() - faults < 200
    assert _testing.scratch_pool() == (blocks, free_bytes), "the call did not give its block back"
    del engine
    gc.collect()
    # its block is freed: no live engine needs one that large (unless one already had it before)
    after = _testing.scratch_pool()
    assert after == before or after[1] < SCRATCH, (before, after)
