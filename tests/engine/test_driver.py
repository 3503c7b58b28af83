"""The compile driver (subprocesses, parallelism, timeouts, failures) and the engine cache."""
from __future__ import annotations

import os
import time

import numpy as np
import onnx
import pytest
from onnx import helper

from onnx_cases import check_case, op_case
from blade.engine import cache, compiler
from blade.engine.compile_main import FAULT_ENV
from blade.engine.driver import BLOCK_TORCH_ENV, compile_many


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    """Two tiny clusters saved as ONNX files: name -> (case, path)."""
    root = tmp_path_factory.mktemp("driver_models")
    cases = [op_case("Relu", [(4, 8)], name="relu"), op_case("Softmax", [(3, 5)], axis=-1, name="softmax")]
    out = {}
    for case in cases:
        path = root / f"{case.name}.onnx"
        onnx.save(case.model, path)
        out[case.name] = (case, path)
    return out


def jobs_for(models, work_root):
    return [(name, str(path), str(work_root / name)) for name, (_, path) in models.items()]


def test_compiler_process_cannot_import_torch_and_jobs_overlap(small_models, tmp_path, monkeypatch):
    monkeypatch.setenv(BLOCK_TORCH_ENV, "1")   # the subprocess stub makes `import torch` fail
    results = compile_many(jobs_for(small_models, tmp_path), parallelism=2, timeout_s=120)
    assert [r.name for r in results] == list(small_models)
    assert all(r.ok for r in results), [r.error for r in results]
    first, second = results
    assert first.started < second.finished and second.started < first.finished, "jobs did not overlap"
    for r in results:
        check_case(small_models[r.name][0], (r.so_path, r.manifest))


def test_torch_block_is_real(tmp_path, monkeypatch):
    """The switch used above really breaks a compiler that imports torch."""
    from blade.engine import driver
    monkeypatch.setenv(BLOCK_TORCH_ENV, "1")
    stub = driver.STUB.replace("from blade.engine.compile_main import main", "import torch")
    monkeypatch.setattr(driver, "STUB", stub)
    model = op_case("Relu", [(2,)], name="r").model
    onnx.save(model, tmp_path / "r.onnx")
    (result,) = compile_many([("r", str(tmp_path / "r.onnx"), str(tmp_path / "w"))], timeout_s=60)
    assert not result.ok and "ModuleNotFoundError" in open(result.log_path).read()


@pytest.mark.parametrize("fault, message", [("crash", "failed (exit"), ("timeout", "timed out"),
                                            ("garbage", "unusable artifacts")])
def test_failing_job_is_contained(fault, message, small_models, tmp_path, monkeypatch):
    from blade.engine import driver
    # Inject the fault into the second job only (the stub reads the env var; pick it by path).
    real_run = driver._run_subprocess

    def faulty(onnx_path, work_dir, options, timeout_s):
        if "softmax" in str(onnx_path):
            monkeypatch.setenv(FAULT_ENV, fault)
        try:
            return real_run(onnx_path, work_dir, options, timeout_s)
        finally:
            monkeypatch.delenv(FAULT_ENV, raising=False)

    monkeypatch.setattr(driver, "_run_subprocess", faulty)
    start = time.monotonic()
    good, bad = compile_many(jobs_for(small_models, tmp_path), parallelism=1, timeout_s=6)
    assert good.ok and not bad.ok
    assert message in bad.error and "'softmax'" in bad.error and bad.log_path in bad.error
    if fault == "timeout":
        assert time.monotonic() - start < 30
        child = int((tmp_path / "softmax" / "fault_child.pid").read_text())
        time.sleep(0.2)
        assert not _alive(child), "the timed-out job's child process survived"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_compile_error_names_command(tmp_path):
    model = op_case("Relu", [(2,)], name="r").model
    with pytest.raises(compiler.EngineCompileError, match="reproduce with: .*g\\+\\+"):
        compiler.compile_onnx(model, tmp_path, {"extra_flags": ["-DBLADE_BROKEN", "-include", "/nonexistent.h"]})
    assert (tmp_path / "compile.log").read_text()


def test_missing_compiler(tmp_path):
    model = op_case("Relu", [(2,)], name="r").model
    with pytest.raises(compiler.CompilerNotFound, match="no-such-cxx"):
        compiler.compile_onnx(model, tmp_path, {"cxx": "no-such-cxx"})


def test_cache_hit_and_broken_entries(small_models, tmp_path):
    cache_dir = tmp_path / "cache"
    jobs = jobs_for(small_models, tmp_path / "a")
    first = compile_many(jobs, parallelism=2, cache_dir=cache_dir)
    assert all(r.ok and not r.cache_hit for r in first)
    second = compile_many(jobs_for(small_models, tmp_path / "b"), parallelism=2, cache_dir=cache_dir)
    assert all(r.ok and r.cache_hit for r in second)
    # a hit is a verified private copy: eviction by another process cannot pull it from under us
    assert all(r.so_path.startswith(str(tmp_path / "b")) for r in second)
    assert not list((tmp_path / "b").rglob("engine.cpp")), "a hit must not compile"
    check_case(small_models["relu"][0], (second[0].so_path, second[0].manifest))
    # Leftover temp dirs of a crashed writer are ignored; a half-written entry is repaired.
    options = compiler.resolve_options(None)
    key = cache.cache_key(small_models["relu"][1].read_bytes(), options)
    entry = cache.entry_dir(cache_dir, key)
    (entry.parent / f".tmp-{key[:16]}-crashed").mkdir()
    (entry / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="corrupt"):
        assert cache.lookup(cache_dir, key) is None
    third = compile_many(jobs_for(small_models, tmp_path / "c"), cache_dir=cache_dir)
    assert third[0].ok and not third[0].cache_hit and cache.lookup(cache_dir, key) is not None
    assert compile_many(jobs_for(small_models, tmp_path / "d"), cache_dir=cache_dir)[0].cache_hit


def test_corrupt_entry_is_detected_removed_and_recompiled(small_models, tmp_path):
    cache_dir = tmp_path / "cache"
    (first,) = compile_many(jobs_for(small_models, tmp_path / "a")[:1], cache_dir=cache_dir)
    key = cache.cache_key(small_models["relu"][1].read_bytes(), compiler.resolve_options(None))
    so = cache.entry_dir(cache_dir, key) / "engine.so"
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit-pattern in the middle: still an ELF, wrong code
    so.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"corrupt \(engine.so does not match its checksum\)"):
        (again,) = compile_many(jobs_for(small_models, tmp_path / "b")[:1], cache_dir=cache_dir)
    assert again.ok and not again.cache_hit
    assert open(again.so_path, "rb").read() == open(first.so_path, "rb").read()
    check_case(small_models["relu"][0], (again.so_path, again.manifest))
    (third,) = compile_many(jobs_for(small_models, tmp_path / "c")[:1], cache_dir=cache_dir)
    assert third.cache_hit


def test_cache_evicts_least_recently_used(small_models, tmp_path):
    cache_dir = tmp_path / "cache"
    options = compiler.resolve_options(None)
    keys = {name: cache.cache_key(path.read_bytes(), options) for name, (_, path) in small_models.items()}
    compile_many(jobs_for(small_models, tmp_path / "a"), cache_dir=cache_dir)
    sizes = {name: sum(f.stat().st_size for f in cache.entry_dir(cache_dir, k).iterdir()) for name, k in keys.items()}
    old = time.time() - 100
    os.utime(cache.entry_dir(cache_dir, keys["relu"]) / cache.CHECKSUMS, (old, old))
    os.utime(cache.entry_dir(cache_dir, keys["softmax"]) / cache.CHECKSUMS, (old + 50, old + 50))
    # a hit on relu makes softmax the least recently used
    assert compile_many(jobs_for(small_models, tmp_path / "b")[:1], cache_dir=cache_dir)[0].cache_hit
    assert cache.evict(cache_dir, max(sizes.values()) + 1) == [cache.entry_dir(cache_dir, keys["softmax"])]
    assert cache.lookup(cache_dir, keys["relu"]) is not None
    # a store over the bound evicts everything older, never the entry it just wrote
    (fresh,) = compile_many(jobs_for(small_models, tmp_path / "c")[1:], cache_dir=cache_dir, cache_max_bytes=1)
    assert fresh.ok and not fresh.cache_hit
    assert cache.lookup(cache_dir, keys["relu"]) is None and cache.lookup(cache_dir, keys["softmax"]) is not None


def test_cache_key_covers_inputs(small_models):
    options = compiler.resolve_options(None)
    data = small_models["relu"][1].read_bytes()
    keys = {cache.cache_key(data, options),
            cache.cache_key(data + b" ", options),
            cache.cache_key(data, {**options, "isa": "x86-64"}),
            cache.cache_key(data, {**options, "opt_level": "-O2"})}
    assert len(keys) == 4


@pytest.mark.parametrize("header", compiler.ENGINE_HEADERS)
def test_cache_key_covers_the_headers_engines_include(header, tmp_path, monkeypatch):
    for name in compiler.ENGINE_HEADERS:
        (tmp_path / name).write_bytes((compiler.include_dir() / name).read_bytes())
    monkeypatch.setattr(compiler, "include_dir", lambda: tmp_path)
    before = cache.source_digest.__wrapped__()
    (tmp_path / header).write_text((tmp_path / header).read_text() + "\n// changed\n")
    assert cache.source_digest.__wrapped__() != before


def test_lost_race_is_success(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "engine.so").write_bytes(b"\x7fELF")
    (work / "manifest.json").write_text(compiler.Manifest(1, "x86-64", [], [], [], 0).to_json())
    key = "ab" * 32
    (tmp_path / "cache" / key[:2] / f".tmp-{key[:16]}-crashed-long-ago").mkdir(parents=True)
    os.utime(tmp_path / "cache" / key[:2] / f".tmp-{key[:16]}-crashed-long-ago", (0, 0))
    first = cache.store(tmp_path / "cache", key, work)
    assert cache.store(tmp_path / "cache", key, work, max_bytes=1) == first  # entry exists: race lost
    assert sorted(os.listdir(first.parent)) == [key]  # no temp dirs left behind; stale ones swept


def test_driver_result_for_missing_onnx(tmp_path):
    (result,) = compile_many([("ghost", str(tmp_path / "none.onnx"), str(tmp_path / "w"))], timeout_s=60)
    assert not result.ok and "'ghost'" in result.error
    assert np.isfinite(result.seconds)
