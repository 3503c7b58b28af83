"""Engines with size symbols (run-time dims): the host binds each symbol from the first input dim
that has it, checks its range and that every other dim with it agrees, allocates the outputs at
the bound sizes and passes the sizes to the engine; the symbols survive the saved state."""
import io

import pytest
import torch

from blade.engine.manifest import SizeSymbol, TensorSpec
from runtime_testing import compile_engine, engine_args, make_engine

ROWS = SizeSymbol("rows", 1, 16)
SPECS = dict(inputs=[TensorSpec("x", "float32", ["rows", 4]), TensorSpec("y", "float32", ["rows", 4])],
             outputs=[TensorSpec("sum", "float32", ["rows", 4])])


@pytest.fixture(scope="module")
def rows_engine(engine_dir):
    so = compile_engine("add_rows", engine_dir)
    return make_engine("cluster_rows", so.read_bytes(), SPECS["inputs"], SPECS["outputs"], symbols=[ROWS])


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_one_engine_serves_every_size_in_range(rows_engine, rows):
    x, y = torch.randn(rows, 4), torch.randn(rows, 4)
    (out,) = rows_engine.execute([x, y])
    assert out.shape == (rows, 4)
    torch.testing.assert_close(out, x + y)


@pytest.mark.parametrize("rows", [0, 17])
def test_size_outside_its_range_names_the_dim(rows_engine, rows):
    with pytest.raises(RuntimeError, match=rf"blade engine 'cluster_rows': input 0 \('x'\) dim 0 is size symbol "
                                           rf"'rows' with range \[1, 16\], got {rows}"):
        rows_engine.execute([torch.randn(rows, 4), torch.randn(rows, 4)])


def test_dims_of_one_symbol_must_agree(rows_engine):
    with pytest.raises(RuntimeError, match=r"input 1 \('y'\) dim 0 is size symbol 'rows', which input 0 \('x'\) "
                                           r"dim 0 set to 3, got 4"):
        rows_engine.execute([torch.randn(3, 4), torch.randn(4, 4)])


def test_static_dim_mismatch_describes_the_symbols(rows_engine):
    with pytest.raises(RuntimeError, match=r"input 0 \('x'\) expected float32\[rows in 1..16, 4\] on cpu, "
                                           r"got float32\[3, 5\]"):
        rows_engine.execute([torch.randn(3, 5), torch.randn(3, 5)])
    with pytest.raises(RuntimeError, match=r"input 1 \('y'\) expected float32\[rows in 1..16, 4\] on cpu, "
                                           r"got float64\[3, 4\]"):
        rows_engine.execute([torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64)])


def test_bad_symbol_declarations_are_rejected(engine_dir):
    so = compile_engine("add_rows", engine_dir).read_bytes()
    with pytest.raises(RuntimeError, match="size symbol 'rows' needs a range"):
        make_engine("bad", so, SPECS["inputs"], SPECS["outputs"], symbols=[SizeSymbol("rows", 5, 2)])
    args = engine_args("bad", so, SPECS["inputs"], SPECS["outputs"], symbols=[ROWS])
    args[6] = [[-2, 4], [-1, 4]]  # input 0 names symbol 1, which is not declared
    with pytest.raises(RuntimeError, match=r"input 0 \('x'\) has a negative dimension that names no size symbol"):
        torch.classes.blade.Engine(*args)
    unbound = [TensorSpec("x", "float32", [3, 4])]
    with pytest.raises(RuntimeError, match="size symbol 'rows' is no input's dim"):
        make_engine("bad", so, unbound, SPECS["outputs"], symbols=[ROWS])


def test_symbols_survive_save_and_load(rows_engine):
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.engine = rows_engine

        def forward(self, x: torch.Tensor, y: torch.Tensor):
            return self.engine.execute([x, y])

    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(Holder()), buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    x, y = torch.randn(7, 4), torch.randn(7, 4)
    torch.testing.assert_close(loaded(x, y)[0], x + y)
    with pytest.raises(RuntimeError, match=r"range \[1, 16\], got 20"):
        loaded(torch.randn(20, 4), torch.randn(20, 4))


# An output dim no input binds (a concatenation's 2 * rows): a derived symbol after the bound ones,
# which the .so computes (blade_engine_derived_sizes) before the host allocates the outputs.
TWICE = SizeSymbol("2*rows", 2, 32)
CAT = dict(inputs=[TensorSpec("x", "float32", ["rows", 4])], outputs=[TensorSpec("out", "float32", ["2*rows", 4])],
           symbols=[ROWS, TWICE])


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_derived_sizes_allocate_outputs_no_input_has(engine_dir, rows):
    engine = make_engine("cat", compile_engine("cat_rows", engine_dir).read_bytes(), **CAT)
    x = torch.randn(rows, 4)
    (out,) = engine.execute([x])
    torch.testing.assert_close(out, torch.cat([x, x]))


@pytest.mark.parametrize("defines, message", [
    ({"NO_DERIVED": "1"}, r"size symbol '2\*rows' is no input's dim, and the \.so does not export "
                          r"blade_engine_derived_sizes"),
    ({"DERIVED_COUNT": "2"}, r"the \.so derives 2 size symbols, the manifest has 1 that no input binds"),
])
def test_an_engine_that_does_not_derive_its_unbound_symbols_is_refused(engine_dir, defines, message):
    so = compile_engine("cat_rows", engine_dir, defines).read_bytes()
    with pytest.raises(RuntimeError, match=message):
        make_engine("cat", so, **CAT)


def test_a_derived_size_outside_its_range_is_refused_before_allocating(engine_dir):
    """The engine planned its scratch and indexing at the range: a value outside is never run."""
    engine = make_engine("cat", compile_engine("cat_rows", engine_dir, {"TWICE": "(3*sizes[0])"}).read_bytes(), **CAT)
    with pytest.raises(RuntimeError, match=r"derived size symbol '2\*rows' is 33, outside its range \[2, 32\]"):
        engine.execute([torch.randn(11, 4)])
    torch.testing.assert_close(engine.execute([torch.randn(2, 4)])[0].shape, torch.Size([6, 4]))


def test_only_trailing_symbols_may_be_derived(engine_dir):
    """Derived symbols follow the bound ones: an unbound symbol before a bound one is refused."""
    so = compile_engine("cat_rows", engine_dir).read_bytes()
    with pytest.raises(RuntimeError, match="size symbol '2\\*rows' is no input's dim, so no call could bind it"):
        make_engine("cat", so, CAT["inputs"], CAT["outputs"], symbols=[TWICE, ROWS])
