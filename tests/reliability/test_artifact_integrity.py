"""Damaged artifacts give a clear error or a correct result: never a crash, never a wrong result.

Damaged copies are loaded in worker subprocesses (bench/fuzz_artifact.py), so a crash fails the
test instead of killing the test run."""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

import blade
from blade.aot import CorruptArtifact, PrecompiledModule

FUZZ_PATH = Path(__file__).resolve().parents[2] / "bench" / "fuzz_artifact.py"
_spec = importlib.util.spec_from_file_location("fuzz_artifact", FUZZ_PATH)
fuzz = sys.modules["fuzz_artifact"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(fuzz)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(archive, reference, regions) of the fuzz script's small model."""
    archive, reference = fuzz.export_small_model(tmp_path_factory.mktemp("exported"))
    return archive, reference, fuzz.regions(archive)


def run(exported, cases, loader="blade.load", seed=0):
    archive, reference, _ = exported
    return fuzz.run_cases(archive, reference, cases, loader=loader, timeout_s=120, seed=seed)


def middle_of(exported, region: str) -> fuzz.Case:
    span = exported[2][region][0]
    return fuzz.Case(region, [span.start + len(span) // 2])


def test_damaged_so_is_refused_before_dlopen_by_torch_jit_load(exported):
    """torch.jit.load checks no CRC: the Engine's own SHA-256 must stop a damaged .so (also what
    protects C++ loaders)."""
    elf_header, text = fuzz.Case("so", [exported[2]["so"][0].start + 18]), middle_of(exported, "so")
    for case in run(exported, [elf_header, text], loader="torch.jit.load"):
        assert case.verdict == "error", (case.verdict, case.detail)
        assert "blade engine 'cluster_0'" in case.detail and "SHA-256) of its .so differs" in case.detail


def test_damaged_engine_constant_is_refused_by_torch_jit_load(exported):
    (case,) = run(exported, [middle_of(exported, "tensor")], loader="torch.jit.load")
    assert case.verdict == "error", (case.verdict, case.detail)
    assert "blade engine 'cluster_0'" in case.detail and "of constant " in case.detail


def test_blade_load_refuses_a_damaged_record_of_any_kind(exported):
    regions = ["so", "tensor", "ts_constant", "pickle", "code", "metadata"]
    for case in run(exported, [middle_of(exported, region) for region in regions]):
        assert case.verdict == "error" and case.detail.startswith("CorruptArtifact: blade archive"), case


def test_cpp_loaders_get_a_check_of_the_records_torch_does_not(exported, tmp_path):
    """blade._C.verify_archive is what blade_run (examples/cpp) runs before torch::jit::load."""
    raw = exported[0].read_bytes()
    for region in ("ts_constant", "code", "pickle"):
        span = exported[2][region][0]
        path = fuzz.damaged_copy(raw, [span.start + len(span) // 2], random.Random(0), tmp_path / f"{region}.pt")
        # a damaged compressed record may already fail to inflate: damaged either way, nothing loaded
        with pytest.raises(RuntimeError, match=f"blade archive {path} is damaged: (the SHA-256 of record|"
                                               f"PytorchStreamReader failed).*nothing of it was loaded"):
            blade._C.verify_archive(str(path))
    blade._C.verify_archive(str(exported[0]))


# cpp/engine_state.h's EngineState, for a scripted __setstate__ call: from Python, the tracer cannot
# type the empty lists of a state (a static engine's size symbols).
EngineState = Tuple[int, str, torch.Tensor, str, int, List[str], List[str], List[List[int]], List[str], List[str],
                    List[List[int]], List[torch.Tensor], int, str, torch.Tensor, str, float, float, str, List[str],
                    List[List[int]], List[str]]


class StateSetter(torch.nn.Module):
    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def forward(self, state: EngineState):
        self.engine.__setstate__(state)


def test_engine_fields_are_hashed(exported):
    """Specs live in data.pkl, outside any tensor record: a larger output shape or a smaller scratch
    would make the engine write out of bounds."""
    engine = blade.load(str(exported[0])).cluster_0
    state = list(engine._get_method("__getstate__")())
    for index, value in ((10, [[4, 9]]), (12, 0)):  # output_shapes, scratch_bytes
        changed = list(state)
        changed[index] = value
        with pytest.raises(RuntimeError, match=r"blade engine 'cluster_0'.*SHA-256\) of its specs and settings"):
            torch.jit.script(StateSetter(engine))(tuple(changed))


def test_damaged_precompiled_payload_is_refused(exported):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    compiled = blade.compile_model(model, (torch.randn(2, 8),))
    data = bytearray(PrecompiledModule.serialize_compile_artifacts(PrecompiledModule.wrap(compiled, "off")))
    data[len(data) // 2] ^= 0x10
    with pytest.raises(CorruptArtifact, match="blade precompiled function is damaged: the SHA-256"):
        PrecompiledModule.deserialize_compile_artifacts(bytes(data))


def _assert_no_bad_cases(cases):
    bad = [c for c in cases if c.verdict in fuzz.BAD_CLASSES]
    assert not bad, fuzz.summary(cases)


def test_short_fuzz_over_the_sensitive_regions(exported):
    cases = fuzz.make_cases(exported[2], fuzz.SENSITIVE_REGIONS, 30, random.Random(14))
    _assert_no_bad_cases(run(exported, cases, seed=14))


@pytest.mark.slow
def test_fuzz_hundreds_of_flips(exported):
    archive = exported[0]
    cases = fuzz.make_cases(exported[2], list(exported[2]), 300, random.Random(1))
    cases += [fuzz.Case(region, [p]) for region, p in fuzz.chosen_positions(archive, exported[2])]
    _assert_no_bad_cases(run(exported, cases, seed=1))


def test_a_damaged_precompiled_file_is_refused_and_torch_still_reads_an_intact_one(tmp_path):
    """blade.precompile appends a SHA-256 trailer to torch's file; torch's own loader must keep
    ignoring it (its unpickler stops at the pickle's end)."""
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval(), torch.randn(2, 8)
    path = tmp_path / "m.aot"
    blade.precompile(model, (x,), str(path))
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(blade.load_precompiled(str(path), model)(x)[0], expected)
        with open(path, "rb") as f:
            plain = torch.compiler.load_compiled_function(f, external_data={"model": blade.aot._Forward(model)})
        torch.testing.assert_close(plain(blade.aot._Forward(model), x)[0], expected)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x04
    path.write_bytes(data)
    with pytest.raises(CorruptArtifact, match=f"{path} is damaged: the SHA-256"):
        blade.load_precompiled(str(path), model)
