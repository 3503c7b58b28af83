"""Building an Engine: every bad artifact or argument is a clean RuntimeError naming the engine,
never a crash; and the host ISA queries the load check relies on."""
import gc
import re

import pytest
import torch

import blade._C
from blade.engine.manifest import TensorSpec

from runtime_testing import compile_engine, engine_args, make_engine

FILL_OUTPUT = [TensorSpec("out", "float32", [4])]


def fill_engine(engine_dir, value, name="cluster_fill", **defines):
    so = compile_engine("fill", engine_dir, {"FILL_VALUE": f"{value}f", **defines})
    return make_engine(name, so.read_bytes(), [], FILL_OUTPUT)


def test_engine_without_inputs_runs(engine_dir):
    (out,) = fill_engine(engine_dir, 3.5).execute([])
    torch.testing.assert_close(out, torch.full((4,), 3.5))


def test_garbage_bytes(engine_dir):
    with pytest.raises(RuntimeError, match=r"blade engine 'junk': cannot load the engine \.so"):
        make_engine("junk", b"\x7fELF definitely not a shared object" * 10, [], FILL_OUTPUT)


def test_empty_bytes():
    with pytest.raises(RuntimeError, match="blade engine 'empty': cannot load"):
        make_engine("empty", b"", [], FILL_OUTPUT)


def test_missing_entry_symbol(engine_dir):
    so = compile_engine("no_entry", engine_dir)
    with pytest.raises(RuntimeError, match="blade engine 'no_run'.*does not export .*blade_engine_run"):
        make_engine("no_run", so.read_bytes(), [], FILL_OUTPUT)


def test_so_built_for_another_abi(engine_dir):
    so = compile_engine("fill", engine_dir, {"FILL_VALUE": "1.0f", "ABI_VERSION": "99"})
    with pytest.raises(RuntimeError, match=f"blade engine 'old_abi'.*ABI version 99, this runtime speaks version {blade._C.abi_version()}"):
        make_engine("old_abi", so.read_bytes(), [], FILL_OUTPUT)


def test_manifest_abi_differs_from_runtime(engine_dir):
    so = compile_engine("fill", engine_dir, {"FILL_VALUE": "1.0f"})
    future = blade._C.abi_version() + 1
    with pytest.raises(RuntimeError, match=f"blade engine 'future'.*compiled for runtime ABI version {future}"):
        make_engine("future", so.read_bytes(), [], FILL_OUTPUT, abi_version=future)


def test_unknown_isa(engine_dir):
    so = compile_engine("fill", engine_dir, {"FILL_VALUE": "1.0f"})
    with pytest.raises(RuntimeError, match="blade engine 'arm'.*ISA 'armv9-a'.*known ISAs: x86-64, x86-64-v2"):
        make_engine("arm", so.read_bytes(), [], FILL_OUTPUT, isa="armv9-a")


@pytest.mark.parametrize(
    "index, value, message",
    [
        (1, torch.zeros(3, 4, dtype=torch.uint8), "the .so bytes must be a 1-D uint8 CPU tensor, got uint8[3, 4]"),
        (1, torch.zeros(8, dtype=torch.int32), "the .so bytes must be a 1-D uint8 CPU tensor, got int32[8]"),
        (8, ["float16"], "output 0 ('out'): unsupported dtype 'float16'"),
        (9, [[4], [4]], "output names, dtypes and shapes differ in length (1, 1, 2)"),
        (9, [[-1]], "output 0 ('out') has a negative dimension"),
        (10, [torch.zeros(2, device="meta")], "constant 0 must be a CPU tensor, got float32[2] on meta"),
        (11, -8, "negative scratch_bytes"),
    ],
    ids=["so-2d", "so-int32", "dtype", "lengths", "negative-dim", "meta-constant", "negative-scratch"],
)
def test_bad_constructor_arguments(engine_dir, index, value, message):
    so = compile_engine("fill", engine_dir, {"FILL_VALUE": "1.0f"})
    args = engine_args("bad_args", so.read_bytes(), [], FILL_OUTPUT)
    args[index] = value
    with pytest.raises(RuntimeError, match=re.escape("blade engine 'bad_args': " + message)):
        torch.classes.blade.Engine(*args)


def test_unloadable_library_does_not_shadow_the_next_engine(engine_dir):
    """Some libraries are never unloaded (marked NODELETE, or holding STB_GNU_UNIQUE symbols), so
    their dlopen name "/proc/self/fd/N" outlives the engine, and dlopen matches names before files:
    a new engine whose memory file reuses fd N must still get its own code, not the dead one's."""
    for value in (1.0, 2.0, 3.0):
        so = compile_engine("fill", engine_dir, {"FILL_VALUE": f"{value}f"}, ("-Wl,-z,nodelete",))
        engine = make_engine("cluster_nodelete", so.read_bytes(), [], FILL_OUTPUT)
        torch.testing.assert_close(engine.execute([])[0], torch.full((4,), value))
        del engine
        gc.collect()


def test_many_engines_alive_at_once(engine_dir):
    engines = [fill_engine(engine_dir, float(v), name=f"cluster_{v}") for v in range(6)]
    for v, engine in enumerate(engines):
        torch.testing.assert_close(engine.execute([])[0], torch.full((4,), float(v)))


def test_host_isa_queries():
    known = blade._C.known_isas()
    assert known == ["x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4"]
    host = blade._C.host_isa()
    assert host in known
    for level in known:
        assert blade._C.isa_supported(level) == (known.index(level) <= known.index(host))
    assert not blade._C.isa_supported("x86-64-v5")
    from blade.engine.compiler import abi_version  # the header the engines compile against
    assert blade._C.abi_version() == abi_version()
