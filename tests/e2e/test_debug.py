"""Debugging switches: fallback modes, check mode catching a broken engine, bisect, input
mismatches, excluded ops, min cluster size, dumps, and compile fault injection (vs eager)."""
from __future__ import annotations

import io
import re
import os
import warnings

import pytest
import torch

import blade
from blade.config import Config
from blade.debug import CapturingBackend
from blade.progress import Progress
from blade_testing import Capture, assert_close, compile_and_check


class TwoClusters(torch.nn.Module):
    """Excluding sigmoid splits it into two clusters of 3 ops: {mul, add, relu}, {mul, sub, tanh}."""

    def forward(self, x):
        a = torch.relu(x * 2 + 1)
        b = torch.sigmoid(a)
        return torch.tanh(b * 3 - 1)


SPLIT = {"excluded_ops": ("aten::sigmoid",)}
X = torch.randn(4, 16)


def compile_captured(model, inputs, **options):
    """torch.compile with a CapturingBackend; returns (compiled fn, backend)."""
    backend = CapturingBackend(Config.from_options(options))
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        compiled(*inputs)
    return compiled, backend


@pytest.mark.parametrize("mode", ["fallback", "check", "eager"])
def test_fallback_modes_match_eager(mode):
    capture = compile_and_check(TwoClusters(), [X], min_engines=2, fallback=mode, **SPLIT)
    engines = capture.compiled[0].engines()
    assert sorted(engines) == ["cluster_0", "cluster_1"]
    assert all(e.has_fallback() and e.fallback_mode() == mode and e.check_report() == "" for e in engines.values())


def test_excluded_op_is_really_excluded():
    capture = compile_and_check(TwoClusters(), [X], min_engines=2, **SPLIT)
    assert "aten::sigmoid" in capture.graph_text
    assert ("aten::sigmoid", "excluded by config (excluded_ops)") in capture.report.left_out
    assert all("aten::sigmoid" not in c.op_kinds for c in capture.report.clusters)


def test_min_cluster_size_is_honoured():
    capture = Capture(min_cluster_size=4, **SPLIT)
    with torch.no_grad():
        assert_close(torch.compile(TwoClusters(), backend=capture)(X), TwoClusters()(X))
    assert capture.engine_calls() == 0 and capture.report.clusters == []
    assert ("aten::relu", "in a cluster of 3 op(s), below min_cluster_size=4") in capture.report.left_out
    compile_and_check(TwoClusters(), [X], min_engines=2, min_cluster_size=3, **SPLIT)


def test_check_mode_names_the_broken_engine_and_bisect_finds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("BLADE_TEST_PERTURB_CLUSTER", "cluster_1")  # its engine adds 0.5 to output 0
    options = dict(SPLIT, cache_dir=str(tmp_path / "cache"), fallback="check")  # never the shared cache
    model = TwoClusters()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled, backend = compile_captured(model, [X], **options)
        with torch.no_grad():
            assert_close(compiled(X), model(X))  # check mode returns the subgraph's results
    engines = backend.compiled[0].engines()
    report = engines["cluster_1"].check_report()
    assert engines["cluster_0"].check_report() == ""
    assert "engine 'cluster_1' differs" in report and "output 0 ('output_0'): max abs error 0.5" in report
    assert "aten::tanh" in report and "test_debug.py" in report and "torch.tanh(b * 3 - 1)" in report
    checks = [str(w.message) for w in caught if "blade check" in str(w.message)]
    assert len(checks) == 1 and checks[0].startswith(report)  # torch appends "(Triggered internally at ...)"
    with torch.no_grad():
        blade.set_fallback_mode(backend.compiled[0], "off")  # the engine alone really is wrong
        assert (compiled(X) - model(X)).abs().max().item() == pytest.approx(0.5 * (1 - torch.tanh(torch.tensor(0.)) ** 2).item(), rel=0.5)
        blade.set_fallback_mode(backend.compiled[0], "eager")  # engines off: right again
        assert_close(compiled(X), model(X))
    torch._dynamo.reset()
    found = blade.bisect(model, X, **dict(options, fallback="off"))
    assert found is not None and found.cluster == "cluster_1" and found.engines == 2
    assert "aten::tanh" in str(found)


@pytest.fixture(scope="module")
def fallback_engine():
    """cluster_0 of TwoClusters (relu(x * 2 + 1) on float32[4, 16]) compiled with fallback."""
    _, backend = compile_captured(TwoClusters(), [X], fallback="fallback", **SPLIT)
    return backend.compiled[0].engines()["cluster_0"]


WRONG_INPUTS = {
    "shape": torch.randn(3, 16),
    "dtype": torch.randn(4, 16, dtype=torch.float64),
    "rank": torch.randn(64),
    "device": torch.empty(4, 16, device="meta"),
}


@pytest.mark.parametrize("what", sorted(WRONG_INPUTS))
def test_input_mismatch_is_a_clear_error_or_falls_back(fallback_engine, what):
    wrong = WRONG_INPUTS[what]
    fallback_engine.set_fallback_mode("off")
    with pytest.raises(RuntimeError, match=r"blade engine 'cluster_0': input 0 \('input_0'\) expected "
                                           r"float32\[4, 16\] on cpu, got "):
        fallback_engine.execute([wrong])
    fallback_engine.set_fallback_mode("fallback")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (out,) = fallback_engine.execute([wrong])
    expected = torch.relu(wrong * 2 + 1)
    assert out.shape == expected.shape and out.dtype == expected.dtype and out.device == expected.device
    if what != "device":
        torch.testing.assert_close(out, expected)
    assert len(caught) <= 1  # warned once per engine (the first mismatching case warns)
    (good,) = fallback_engine.execute([X])
    torch.testing.assert_close(good, torch.relu(X * 2 + 1))


def test_fallback_warns_once_and_names_the_reason():
    _, backend = compile_captured(TwoClusters(), [X], fallback="fallback", **SPLIT)
    engine = backend.compiled[0].engines()["cluster_0"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            engine.execute([torch.randn(2, 16)])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "engine 'cluster_0' runs its TorchScript subgraph" in messages[0]
    assert "expected float32[4, 16] on cpu, got float32[2, 16]" in messages[0]


def test_unloadable_engine_runs_its_subgraph_in_fallback_mode(fallback_engine, capfd):
    state = list(fallback_engine._get_method("__getstate__")())
    state[2] = torch.frombuffer(bytearray(b"\x7fELF garbage" * 8), dtype=torch.uint8)
    engine = torch.classes.blade.Engine(*state[1:-1])  # all but format, digests
    # a constructor is not called through Python's warning bridge: torch prints the warning
    assert re.search("blade engine 'cluster_0': cannot load the engine .so.*runs the cluster's TorchScript subgraph",
                     capfd.readouterr().err)
    torch.testing.assert_close(engine.execute([X])[0], torch.relu(X * 2 + 1))
    state[15] = "off"
    with pytest.raises(RuntimeError, match="blade engine 'cluster_0': cannot load the engine .so"):
        torch.classes.blade.Engine(*state[1:-1])  # all but format, digests


def test_modes_need_the_subgraph():
    capture = compile_and_check(TwoClusters(), [X], min_engines=2, **SPLIT)
    engine = capture.compiled[0].engines()["cluster_0"]
    assert not engine.has_fallback()
    with pytest.raises(RuntimeError, match="fallback mode 'check' needs the cluster's TorchScript subgraph"):
        engine.set_fallback_mode("check")
    with pytest.raises(RuntimeError, match="unknown fallback mode 'sometimes'"):
        engine.set_fallback_mode("sometimes")


# Fault injection: every cluster fails to build; the model still runs in TorchScript and the
# warning names the cluster and carries the tail of its log (the temp work dir is gone).
FAULTS = {
    "crash": ({"BLADE_TEST_COMPILE_FAULT": "crash"}, {}, "failed \\(exit"),
    "timeout": ({"BLADE_TEST_COMPILE_FAULT": "timeout"}, {"compile_timeout_s": 1.0}, "timed out after 1.0 s"),
    "garbage": ({"BLADE_TEST_COMPILE_FAULT": "garbage"}, {}, "unusable artifacts"),
    "no compiler": ({}, {"cxx": "/nonexistent/g++"}, "not found"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_compile_faults_leave_the_model_running(fault, monkeypatch):
    env, options, message = FAULTS[fault]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    capture = Capture(use_cache=False, **SPLIT, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            assert_close(torch.compile(TwoClusters(), backend=capture)(X), TwoClusters()(X))
    assert capture.engine_calls() == 0
    texts = [str(w.message) for w in caught if "failed to compile" in str(w.message)]
    for name in ("cluster_0", "cluster_1"):
        (text,) = [t for t in texts if t.startswith(f"blade: {name} ")]
        assert re.search(message, text), text
        assert "(log: " not in text, "the warning points at a log in a removed temp dir"
    reasons = [reason for kind, reason in capture.report.left_out if kind == "aten::relu"]
    assert reasons and reasons[0].startswith("compile failed (cluster_0; engine compile of 'cluster_0'")


def test_dump_dir_holds_every_artifact_even_on_cache_hits(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for run in ("first", "again"):  # the second compile is served from the cache
        torch._dynamo.reset()
        capture = compile_and_check(TwoClusters(), [X], min_engines=2, dump_dir=str(tmp_path / run), **SPLIT)
        for cluster in capture.report.clusters:
            files = set(os.listdir(tmp_path / run / cluster.name))
            assert {f"{cluster.name}.onnx", "subgraph.txt", "subgraph.pt", "plan.txt", "engine.cpp",
                    "compile_command.txt", "compile.log", "engine.so", "manifest.json", "reproduce.sh"} <= files, files
    assert capture.report.clusters[0].cache_hit
    assert "g++" in (tmp_path / "again" / "cluster_0" / "compile_command.txt").read_text()
    assert "aten::relu" in (tmp_path / "again" / "cluster_0" / "subgraph.txt").read_text()
    assert "stored (graph output)" in (tmp_path / "again" / "cluster_0" / "plan.txt").read_text()
    assert os.listdir(cwd) == []


def test_reproduce_line_recompiles_the_cluster(tmp_path):
    compile_and_check(TwoClusters(), [X], min_engines=2, dump_dir=str(tmp_path), use_cache=False, **SPLIT)
    line = (tmp_path / "cluster_0" / "reproduce.sh").read_text().splitlines()[-1]
    result = __import__("subprocess").run(["bash", "-c", line], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "cluster_0" / "reproduced" / "engine.so").read_bytes()[:4] == b"\x7fELF"


def test_progress_line_only_for_long_multi_cluster_compiles(monkeypatch):
    quiet, shown = io.StringIO(), io.StringIO()
    Progress(1, stream=quiet)()  # a single cluster: never
    progress = Progress(3, stream=shown)
    progress.started -= 5  # as if compiling for 5 s already
    for _ in range(3):
        progress()
    assert quiet.getvalue() == ""
    assert shown.getvalue().endswith("compiled 3/3 clusters (5.0 s)\n")


def test_config_rejects_unknown_options_and_reads_the_environment(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown blade option\(s\) \['fallbak'\]; valid options: .*'fallback'"):
        Config.from_options({"fallbak": "check"})
    monkeypatch.setenv("BLADE_FALLBACK", "check")
    monkeypatch.setenv("BLADE_EXCLUDED_OPS", "sigmoid,aten::relu")
    assert Config().fallback == "check" and Config().excluded_ops == ("aten::sigmoid", "aten::relu")
    with Config(fallback="eager"):
        assert blade.config.current().fallback == "eager"
    with pytest.raises(ValueError, match="fallback must be one of"):
        Config(fallback="sometimes")
