"""The engine cache seen from whole processes: a new process is served from it, two processes
compiling the same model into it at once both succeed identically, a corrupt entry is recovered
from, and nothing lands in the current directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from aot_testing import E2E_DIR
from blade_testing import PINNED_GEMM_ENV

# Compiles the Block model with tt_infer, saves its outputs, prints one JSON line of per-cluster
# status and cache hits.
COMPILE = textwrap.dedent("""
    import json, sys, torch, blade
    from aot_testing import make_model_and_inputs
    from blade_testing import Capture
    model, inputs = make_model_and_inputs()
    capture = Capture()
    with torch.no_grad():
        out = torch.compile(model, backend=capture)(*inputs)
    torch.save(out, sys.argv[1])
    print(json.dumps([[c.name, c.status, c.cache_hit] for c in capture.report.clusters]))
""")


def start(out_path, cache_dir, cwd):
    env = dict(os.environ, BLADE_CACHE_DIR=str(cache_dir), PYTHONPATH=E2E_DIR, **PINNED_GEMM_ENV)  # outputs compared bitwise
    return subprocess.Popen([sys.executable, "-c", COMPILE, str(out_path)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.fixture
def empty_cwd(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    yield cwd
    assert not list(cwd.iterdir()), "something was written to the current directory"


def test_concurrent_first_compiles_then_cached_then_corrupt_entry(tmp_path, empty_cwd):
    cache_dir = tmp_path / "cache"
    # two processes compile the same model into one empty cache at the same time
    procs = [start(tmp_path / f"out{i}.pt", cache_dir, empty_cwd) for i in range(2)]
    reports = [finish(p)[0] for p in procs]
    compiled = [name for name, status, _ in reports[0] if status == "compiled"]
    assert compiled, reports[0]
    assert [r[:2] for r in reports[0]] == [r[:2] for r in reports[1]]  # hits may differ, statuses not
    first, second = (torch.load(tmp_path / f"out{i}.pt") for i in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    entries = [p for p in cache_dir.glob("*/*") if not p.name.startswith(".tmp-") and p.parent.name != "locks"]
    assert len(entries) == len(compiled), "one entry per engine, whoever won the race"
    assert not list(cache_dir.glob("*/.tmp-*")), "a writer left its temp dir behind"

    # a new process is served entirely from the cache
    report, _ = finish(start(tmp_path / "out2.pt", cache_dir, empty_cwd))
    assert all(hit for _, status, hit in report if status == "compiled") and report
    assert all(torch.equal(a, b) for a, b in zip(torch.load(tmp_path / "out2.pt"), first))

    # a corrupt entry: detected, removed with a warning, recompiled; the results do not change
    victim = entries[0] / "engine.so"
    good = victim.read_bytes()
    victim.write_bytes(good[:-64])
    report, err = finish(start(tmp_path / "out3.pt", cache_dir, empty_cwd))
    assert "corrupt" in err and str(entries[0]) in err
    assert sum(not hit for _, status, hit in report if status == "compiled") == 1
    assert all(torch.equal(a, b) for a, b in zip(torch.load(tmp_path / "out3.pt"), first))
    assert victim.read_bytes() == good, "the entry was not republished"
