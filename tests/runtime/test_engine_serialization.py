"""Engine state: its versioned layout, and torch.jit.save/load of a module holding an Engine in a
fresh process that has only torch and blade._C."""
import io
import subprocess
import sys
import textwrap
from typing import List

import pytest
import torch

import blade._C

from blade.engine.manifest import TensorSpec
from runtime_testing import ADD_SCRATCH_BYTES, compile_engine, make_engine


class EngineHolder(torch.nn.Module):
    """What splice produces, reduced to one engine call."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> List[torch.Tensor]:
        return self.engine.execute([x, y])


def engine_state(engine):
    """The TorchScript __getstate__ (the Python-level one wraps it for the pickle module)."""
    return engine._get_method("__getstate__")()


def test_state_layout(add_engine, add_bias):
    state = engine_state(add_engine)
    (version, name, so_bytes, isa, abi_version, input_names, input_dtypes, input_shapes,
     output_names, output_dtypes, output_shapes, constants, scratch_bytes, info_json,
     fallback_module, fallback_mode, rtol, atol, ops_source, symbol_names, symbol_ranges, digests) = state
    assert version == 4
    assert (symbol_names, symbol_ranges) == ([], [])  # a static engine
    assert name == "cluster_add"
    assert so_bytes.dtype == torch.uint8 and so_bytes.dim() == 1 and bytes(so_bytes[:4].tolist()) == b"\x7fELF"
    assert (isa, abi_version) == (blade._C.host_isa(), blade._C.abi_version())
    assert (input_names, input_dtypes, input_shapes) == (["x", "y"], ["float32"] * 2, [[64, 128]] * 2)
    assert (output_names, output_dtypes, output_shapes) == (["sum", "product"], ["float32"] * 2, [[64, 128]] * 2)
    assert len(constants) == 1 and torch.equal(constants[0], add_bias)
    assert scratch_bytes == ADD_SCRATCH_BYTES
    assert info_json == '{"source": "engines/add.cpp"}'
    # compiled without fallback: no subgraph, mode off
    assert fallback_module.dtype == torch.uint8 and fallback_module.numel() == 0
    assert (fallback_mode, rtol, atol, ops_source) == ("off", 1e-4, 1e-5, "")
    assert [d.rsplit(" ", 1)[0] for d in digests] == ["so", "fallback_module", "fields", "constant 0"]
    assert all(len(d.rsplit(" ", 1)[1]) == 64 for d in digests)  # SHA-256 in hex


def test_format_3_state_asks_for_a_re_export(add_engine):
    old_state = (3,) + tuple(engine_state(add_engine)[1:19]) + (engine_state(add_engine)[-1],)
    with pytest.raises(RuntimeError, match="blade engine 'cluster_add'.*state format 3 .*ABI version 3.*re-export"):
        add_engine._get_method("__setstate__")(old_state)


@pytest.mark.parametrize("old_format, fields", [(1, 14), (2, 19)])
def test_states_without_content_hashes_are_rejected(add_engine, old_format, fields):
    """Formats 1 and 2 carry no hashes: loading them unchecked could dlopen a damaged .so."""
    old_state = (old_format,) + tuple(engine_state(add_engine)[1:fields])
    with pytest.raises(RuntimeError, match=f"blade engine 'cluster_add'.*state format {old_format}, which "
                                           f"carries no content hashes.*re-export"):
        add_engine._get_method("__setstate__")(old_state)


def test_state_of_another_format_is_rejected(add_engine):
    future_state = (5,) + tuple(engine_state(add_engine)[1:19]) + ("something new",)  # no empty lists: untyped here
    with pytest.raises(RuntimeError, match="blade engine 'cluster_add'.*state format 5, this blade reads format 4"):
        add_engine._get_method("__setstate__")(future_state)
    with pytest.raises(RuntimeError, match="blade engine 'cluster_add'.*state has 15 fields, format 4 has 22"):
        add_engine._get_method("__setstate__")(tuple(engine_state(add_engine)[:15]))
    with pytest.raises(RuntimeError, match="not a blade Engine state"):
        add_engine._get_method("__setstate__")("cluster_add")


def test_state_round_trips_in_process(add_engine, add_bias):
    copy = torch.classes.blade.Engine(*engine_state(add_engine)[1:-1])  # without the digests
    x, y = torch.randn(64, 128), torch.randn(64, 128)
    for got, want in zip(copy.execute([x, y]), add_engine.execute([x, y])):
        torch.testing.assert_close(got, want)


def test_engine_with_empty_lists_round_trips(engine_dir):
    """No inputs, no constants: the empty lists must come back with their element types."""
    so = compile_engine("fill", engine_dir, {"FILL_VALUE": "4.0f"})
    engine = make_engine("cluster_fill", so.read_bytes(), [], [TensorSpec("out", "float32", [4])])

    class Fill(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.engine = engine

        def forward(self) -> List[torch.Tensor]:
            return self.engine.execute([])

    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(Fill()), buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    torch.testing.assert_close(loaded()[0], torch.full((4,), 4.0))


def test_save_and_load_in_fresh_process(add_engine, add_bias, engine_dir, tmp_path):
    module_path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(EngineHolder(add_engine)), str(module_path))
    x, y = torch.randn(64, 128), torch.randn(64, 128)
    expected = [x + y + add_bias, x * y]
    torch.save({"x": x, "y": y, "expected": expected}, tmp_path / "io.pt")
    # The module must carry the .so itself: no compiled file may be needed at load time.
    for so in engine_dir.glob("add*.so"):
        so.unlink()

    script = textwrap.dedent(f"""
        import torch
        import blade._C
        module = torch.jit.load({str(module_path)!r})
        io = torch.load({str(tmp_path / "io.pt")!r})
        outputs = module(io["x"], io["y"])
        for got, want in zip(outputs, io["expected"]):
            torch.testing.assert_close(got, want)
        assert module.engine.name() == "cluster_add", module.engine.name()
        assert module.engine.info() == '{{"source": "engines/add.cpp"}}'
        print("round trip ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "round trip ok" in result.stdout
