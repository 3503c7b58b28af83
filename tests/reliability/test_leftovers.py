"""A compile leaves nothing in the temp dir, on every path; exported archives get the umask's mode."""
from __future__ import annotations

import os
import re
import stat
import tempfile
import warnings

import pytest
import torch

import blade
import blade.pipeline
from blade.cluster.rules.base import LoweringError
from fault_models import MODEL, X




@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """The process's temp dir for the test: whatever a compile leaves there is seen."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def compile_caught(**config):
    """(CompiledModule, blade warning texts) of MODEL compiled with these Config fields."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = blade.compile_model(MODEL, (X,), blade.Config(**config))
    return compiled, [str(w.message) for w in caught if str(w.message).startswith("blade:")]


# fault -> (environment, Config fields, what the warning says: from the driver or the log's tail)
FAULTS = {
    "compiler crash": ({"BLADE_TEST_COMPILE_FAULT": "crash"}, {}, "failed \\(exit"),
    "timeout": ({"BLADE_TEST_COMPILE_FAULT": "timeout"}, {"compile_timeout_s": 1.0}, "timed out after 1.0 s"),
    "unusable artifacts": ({"BLADE_TEST_COMPILE_FAULT": "garbage"}, {}, "unusable artifacts"),
    "no compiler": ({}, {"cxx": "/nonexistent/g++"}, "not found"),   # text of the compile log
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_failed_compile_leaves_no_temp_dir_and_warns_with_its_log(fault, temp_root, monkeypatch):
    env, options, message = FAULTS[fault]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    compiled, texts = compile_caught(use_cache=False, **options)
    assert [c.status for c in compiled.report.clusters] == ["compile failed"]
    torch.testing.assert_close(compiled(X)[0], MODEL(X))  # the model still runs, in TorchScript
    assert list(temp_root.iterdir()) == []
    (text,) = [t for t in texts if "failed to compile" in t]
    assert re.search(message, text), text
    assert "(log: " not in text, "the warning points at a log in a removed temp dir"


def test_a_lowering_failure_leaves_no_temp_dir(temp_root, monkeypatch):
    def fail(cluster, name):
        raise LoweringError(f"{name}: no rule (test)")
    monkeypatch.setattr(blade.pipeline, "lower_cluster", fail)
    compiled, texts = compile_caught(use_cache=False)
    assert [c.status for c in compiled.report.clusters] == ["lowering failed"]
    assert any("could not be lowered" in t for t in texts)
    assert list(temp_root.iterdir()) == []


def test_an_exception_mid_compile_leaves_no_temp_dir(temp_root, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("disk on fire (test)")
    monkeypatch.setattr(blade.pipeline, "compile_many", fail)
    with pytest.raises(RuntimeError, match="disk on fire"):
        compile_caught()
    assert list(temp_root.iterdir()) == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_an_exported_archive_gets_the_umask_mode(tmp_path, umask, mode):
    path = tmp_path / "model.blade.pt"
    old = os.umask(umask)
    try:
        blade.export(MODEL, (X,), str(path))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode
