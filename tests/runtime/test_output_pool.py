"""The output pool of engines with run-time sizes (cpp/output_pool.h): an engine reserves two resident
blocks per output at its largest size when it loads, calls take the smallest free block that holds an
output and get it back when the tensor dies, so after the largest shape no call allocates (memory
flat, no page faults) and the pool keeps no more free than the live engines reserved."""
import gc
import random
import resource

import torch

from blade._C import _testing
from blade.engine.manifest import SizeSymbol, TensorSpec
from runtime_testing import compile_engine, make_engine

ROWS_MAX = 1 << 18  # sum: float32[rows, 4]: 4 MiB at the largest, 1024 pages
ROWS = SizeSymbol("rows", 1, ROWS_MAX)
INPUTS = [TensorSpec("x", "float32", ["rows", 4]), TensorSpec("y", "float32", ["rows", 4])]
OUTPUTS = [TensorSpec("sum", "float32", ["rows", 4])]
LARGEST_BYTES = ROWS_MAX * 4 * 4
RESERVED = 2 * LARGEST_BYTES  # two blocks: the previous call's output may still be alive


def rows_engine(engine_dir):
    so = compile_engine("add_rows", engine_dir).read_bytes()
    return make_engine("cluster_pooled_rows", so, INPUTS, OUTPUTS, symbols=[ROWS])


def free_bytes() -> int:
    gc.collect()  # engines and outputs of earlier tests
    return _testing.output_pool()[1]


def made_blocks() -> int:
    return _testing.output_pool()[2]


def test_outputs_come_from_a_resident_block_and_no_call_allocates(engine_dir):
    before = free_bytes()
    engine = rows_engine(engine_dir)
    assert free_bytes() - before == RESERVED, "the engine's output blocks are not ready after load"
    made = made_blocks()
    x, y = torch.randn(ROWS_MAX, 4), torch.randn(ROWS_MAX, 4)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    (out,) = engine.execute([x, y])
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    assert faults < LARGEST_BYTES // 4096 // 8, f"{faults} page faults in the first call at the largest shape"
    torch.testing.assert_close(out, x + y)
    del out
    rng = random.Random(0)
    for _ in range(30):  # shapes of every size after the largest: each output reuses a free block
        rows = rng.randint(1, ROWS_MAX)
        (out,) = engine.execute([x[:rows], y[:rows]])
        torch.testing.assert_close(out, x[:rows] + y[:rows])
    del out
    assert made_blocks() == made
    assert free_bytes() - before == RESERVED


def test_held_outputs_get_blocks_of_their_own_and_the_pool_keeps_only_the_reserved_bytes(engine_dir):
    before = free_bytes()
    engine = rows_engine(engine_dir)
    x, y = torch.randn(ROWS_MAX, 4), torch.randn(ROWS_MAX, 4)
    sizes = (ROWS_MAX, 1000, ROWS_MAX // 2, 77)
    held = [engine.execute([x[:rows], y[:rows]])[0] for rows in sizes]
    assert len({t.data_ptr() for t in held}) == len(sizes)
    for out, rows in zip(held, sizes):
        torch.testing.assert_close(out, x[:rows] + y[:rows])
    held.clear()
    # the two largest blocks are kept (they serve any output), the smaller ones are freed
    assert free_bytes() - before == RESERVED


def test_an_outputs_storage_is_ordinary_and_resizable(engine_dir):
    engine = rows_engine(engine_dir)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    (out,) = engine.execute([x, y])
    out.resize_(1000, 4)  # a caller may reuse an output (e.g. as out=): its storage grows from the pool
    out[:8] = x + y
    out.fill_(1.0)
    assert out.sum().item() == 4000.0


def test_a_destroyed_engines_blocks_go_with_it(engine_dir):
    before = free_bytes()
    engine = rows_engine(engine_dir)
    assert free_bytes() - before == RESERVED
    del engine
    gc.collect()
    assert free_bytes() == before


def test_outputs_too_large_to_hold_from_load_reserve_nothing(engine_dir):
    """An output over kOutputReserveLimit (64 MiB) at its largest (a size capped only by the memory
    budget) gets no resident blocks at load; its calls' blocks are freed when the tensors die."""
    huge_rows = SizeSymbol("rows", 1, 1 << 23)  # 128 MiB at the largest
    so = compile_engine("add_rows", engine_dir).read_bytes()
    before = free_bytes()
    engine = make_engine("cluster_huge_rows", so, INPUTS, OUTPUTS, symbols=[huge_rows])
    assert free_bytes() == before
    x, y = torch.randn(1000, 4), torch.randn(1000, 4)
    (out,) = engine.execute([x, y])
    torch.testing.assert_close(out, x + y)
    del out
    assert free_bytes() == before
