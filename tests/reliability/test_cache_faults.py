"""A cache that cannot be written is a read-only cache; compiles of one key wait for one compile."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
import warnings

import onnx
import pytest
from onnx import TensorProto, helper

import blade
from blade.engine import cache, compiler, driver
from fault_models import MODEL, X




def compile_caught(**config):
    """(CompiledModule, warning texts) of TwoLayers compiled with these Config fields."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = blade.compile_model(MODEL, (X,), blade.Config(**config))
    return compiled, [str(w.message) for w in caught if "blade" in str(w.message)]


def test_a_file_in_place_of_the_cache_dir_still_gives_engines(tmp_path):
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("")
    compiled, texts = compile_caught(cache_dir=str(not_a_dir))
    assert [c.status for c in compiled.report.clusters] == ["compiled"], compiled.report.clusters
    assert compiled.report.coverage > 0
    (text,) = texts
    assert f"the engine cache {not_a_dir} cannot be written" in text and "read-only" in text


def test_a_read_only_cache_serves_its_hits(tmp_path, monkeypatch):
    """As root a chmod'ed dir stays writable, so the read-only volume is simulated: every write
    into the cache fails with EROFS, as it would on a read-only mount."""
    cache_dir = tmp_path / "cache"
    compile_caught(cache_dir=str(cache_dir))  # fills the cache

    def read_only(real, writes=lambda *args: True):
        def call(path, *args, **kwargs):
            if str(path).startswith(str(cache_dir)) and writes(*args):
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            return real(path, *args, **kwargs)
        return call
    for name in ("utime", "mkdir", "replace", "unlink", "rmdir"):
        monkeypatch.setattr(os, name, read_only(getattr(os, name)))
    monkeypatch.setattr(os, "open", read_only(os.open, lambda flags, *_: flags & (os.O_WRONLY | os.O_RDWR)))
    compiled, texts = compile_caught(cache_dir=str(cache_dir))
    assert [(c.status, c.cache_hit) for c in compiled.report.clusters] == [("compiled", True)]
    assert texts == []


@pytest.fixture
def relu_onnx(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "relu.onnx"
    onnx.save(model, path)
    return path


def counting_compiles(monkeypatch) -> list:
    """Records every compile subprocess the driver starts."""
    started, real = [], driver._run_subprocess

    def counted(*args, **kwargs):
        started.append(args[1])
        return real(*args, **kwargs)
    monkeypatch.setattr(driver, "_run_subprocess", counted)
    return started


def test_threads_compiling_one_key_wait_for_one_compile(relu_onnx, tmp_path, monkeypatch):
    started = counting_compiles(monkeypatch)
    jobs = [(f"job_{k}", str(relu_onnx), str(tmp_path / f"work_{k}")) for k in range(3)]
    results = driver.compile_many(jobs, parallelism=3, timeout_s=120, cache_dir=str(tmp_path / "cache"))
    assert all(r.ok for r in results), [r.error for r in results]
    assert len(started) == 1, started
    assert sorted(r.cache_hit for r in results) == [False, True, True]


def test_a_stuck_lock_holder_delays_a_compile_only_until_the_timeout(relu_onnx, tmp_path, monkeypatch):
    """Another process holds the key's lock and never compiles: after timeout_s the job compiles
    on its own (and the holder's lock is a real cross-process flock)."""
    cache_dir = tmp_path / "cache"
    key = cache.cache_key(relu_onnx.read_bytes(), compiler.resolve_options(None))
    lock = cache_dir / cache.LOCK_DIR / f"{key}.lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               f"f = open({str(lock)!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                               "print('held', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = counting_compiles(monkeypatch)
        timeout_s = 4.0
        begin = time.monotonic()
        (result,) = driver.compile_many([("job", str(relu_onnx), str(tmp_path / "work"))], timeout_s=timeout_s,
                                        cache_dir=str(cache_dir))
        assert result.ok and not result.cache_hit, result.error
        assert time.monotonic() - begin >= timeout_s, "the job did not wait for the lock holder"
        assert len(started) == 1
    finally:
        holder.kill()
        holder.wait()


def test_eviction_takes_the_lock_file_with_the_entry(relu_onnx, tmp_path):
    """Lock files must not pile up over a cache's life: one per entry at most."""
    cache_dir = tmp_path / "cache"
    (first,) = driver.compile_many([("relu", str(relu_onnx), str(tmp_path / "a"))], timeout_s=120,
                                   cache_dir=str(cache_dir))
    key = cache.cache_key(relu_onnx.read_bytes(), compiler.resolve_options(None))
    assert first.ok and (cache_dir / cache.LOCK_DIR / f"{key}.lock").exists()
    assert cache.evict(cache_dir, 1) == [cache.entry_dir(cache_dir, key)]
    assert list((cache_dir / cache.LOCK_DIR).iterdir()) == []
