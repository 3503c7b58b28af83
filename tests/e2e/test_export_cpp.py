"""examples/cpp: blade's runtime as a plain shared library, and a libtorch program that loads an
exported archive with torch::jit::load and runs it — the way libtorch-based servers would."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

import blade
from aot_testing import make_model_and_inputs
from blade_testing import PINNED_GEMM_ENV, pinned_gemm

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "cpp"
CMAKE = shutil.which("cmake")

def _run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="session")
def blade_run(tmp_path_factory) -> Path:
    """examples/cpp built once per session against the runtime library this blade runs on
    (blade.runtime_library(), the one blade._C links): only blade_run.cpp compiles, the runtime is
    the package's own -O2 build, and the outputs are compared bit for bit."""
    if CMAKE is None:
        pytest.skip("cmake is not installed: the C++ loading example cannot be built")
    build = tmp_path_factory.mktemp("cpp_build")
    configure = _run([CMAKE, "-S", EXAMPLE, "-B", build, f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                      f"-DBLADE_ROOT={REPO}", f"-DBLADE_RUNTIME_LIBRARY={blade.runtime_library()}"], timeout=300)
    assert f"blade: linking the runtime library {blade.runtime_library()}" in configure, configure
    _run([CMAKE, "--build", build, "-j", str(min(2, os.cpu_count() or 1))], timeout=600)
    return build / "blade_run"


def test_cpp_example_loads_archive_and_matches_python(blade_run, tmp_path):
    model, inputs = make_model_and_inputs()
    compiled = blade.export(model, inputs, str(tmp_path / "block.blade.pt"))
    assert 'prim::CallMethod[name="execute"]' in str(compiled.module.graph)
    with torch.no_grad(), pinned_gemm():  # compared bitwise with the C++ process's outputs
        expected = blade.load(str(tmp_path / "block.blade.pt"))(*inputs)
    torch.save(list(inputs), tmp_path / "inputs.pt")

    # no Python in the C++ process: the runtime library alone registers the Engine class
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": str(torch.get_num_threads()), **PINNED_GEMM_ENV}
    stdout = _run([blade_run, tmp_path / "block.blade.pt", tmp_path / "inputs.pt", tmp_path / "outputs.pt"],
                  env=env, timeout=300)
    got = torch.load(tmp_path / "outputs.pt")
    assert len(got) == len(expected)
    for i, (g, want) in enumerate(zip(got, expected)):
        assert torch.equal(g, want), f"output {i}: max diff {(g - want).abs().max()}"
        assert f"output {i}: float [{', '.join(map(str, want.shape))}]" in stdout, stdout


def test_cpp_example_refuses_a_damaged_archive(blade_run, tmp_path):
    """libtorch checks no CRC-32: a flipped byte in the archive's TorchScript code must stop
    blade_run (blade::verify_archive) instead of running a different program."""
    model, inputs = make_model_and_inputs()
    path = tmp_path / "block.blade.pt"
    blade.export(model, inputs, str(path))
    torch.save(list(inputs), tmp_path / "inputs.pt")
    with zipfile.ZipFile(path) as zf:
        (code,) = [i for i in zf.infolist() if i.filename.endswith(".py") and "graph_module" in i.filename]
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[code.header_offset + 26:code.header_offset + 30])
    raw[code.header_offset + 30 + name_len + extra_len + code.file_size // 2] ^= 0x01
    path.write_bytes(raw)
    result = subprocess.run([blade_run, path, tmp_path / "inputs.pt"], capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin"}, timeout=300)
    assert result.returncode == 1, result
    # a stored record fails its SHA-256; a compressed one may already fail to inflate
    assert f"blade archive {path} is damaged: " in result.stderr, result.stderr
    assert "nothing of it was loaded" in result.stderr, result.stderr


def test_cpp_example_dispatches_seq_1_to_its_own_capture(blade_run, tmp_path):
    """An archive whose seq 1 has a capture of its own (transformers' attention guards seq >= 2,
    blade/size_variants.py) dispatches in TorchScript, so libtorch alone serves seq 1 and refuses a
    seq outside the declared range by name."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    seq, batch = torch.export.Dim("seq", min=1, max=64), torch.export.Dim("batch", min=1, max=4)
    path = tmp_path / "bert.blade.pt"
    blade.export(model, (torch.randint(0, 100, (2, 12)),), str(path),
                 kwargs={"attention_mask": torch.ones(2, 12, dtype=torch.long)},
                 dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}})
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": str(torch.get_num_threads()), **PINNED_GEMM_ENV}
    for b, s in ((3, 1), (2, 5)):
        ids, mask = torch.randint(0, 100, (b, s)), torch.ones(b, s, dtype=torch.long)
        torch.save([ids, mask], tmp_path / "inputs.pt")
        _run([blade_run, path, tmp_path / "inputs.pt", tmp_path / "outputs.pt"], env=env, timeout=300)
        with torch.no_grad():
            want = model(ids, attention_mask=mask)
        got = torch.load(tmp_path / "outputs.pt")
        for g, w in zip(got, (want.last_hidden_state, want.pooler_output)):
            assert (g - w).abs().max() <= 1e-4 * max(1.0, w.abs().max().item()), (b, s)
    torch.save([torch.zeros(1, 65, dtype=torch.long), torch.ones(1, 65, dtype=torch.long)], tmp_path / "inputs.pt")
    result = subprocess.run([blade_run, path, tmp_path / "inputs.pt"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 1, result
    assert "Dim 'seq') is 65, outside its declared range [1, 64]" in result.stderr, result.stderr
