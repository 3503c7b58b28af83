"""The tt_infer backend as users call it: registration, entry points, grad modes, options,
serialization of the spliced module, concurrent calls."""
import logging
import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import blade
from blade_testing import PINNED_GEMM_ENV, Capture, assert_close, pinned_gemm


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).eval()


@pytest.fixture
def engines_built(caplog):
    """Engines the by-name backend built, read from blade's compile log line, so that a test
    through backend="tt_infer" cannot pass with every cluster left in TorchScript."""
    caplog.set_level(logging.INFO, logger="blade")

    def count() -> int:
        found = [re.search(r"in (\d+) engine\(s\)", r.getMessage()) for r in caplog.records]
        return sum(int(m.group(1)) for m in found if m)
    return count


def test_registered_by_name():
    from torch._dynamo import list_backends
    assert "tt_infer" in list_backends()


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_torch_compile_by_name(grad_mode, engines_built):
    model, x = _mlp(), torch.randn(4, 32)
    with grad_mode():
        expected = model(x)
        actual = torch.compile(model, backend="tt_infer")(x)
    assert_close(actual, expected)
    assert engines_built() >= 1


def test_dynamo_optimize_static(engines_built):
    model, x = _mlp(), torch.randn(4, 32)
    with torch.no_grad():
        expected = model(x)
        actual = torch._dynamo.optimize(backend="tt_infer", dynamic=False)(model)(x)
    assert_close(actual, expected)
    assert engines_built() >= 1


def test_options_reach_config_and_unknown_is_an_error():
    model, x = _mlp(), torch.randn(4, 32)
    with torch.no_grad():
        # a min cluster size above the model's op count leaves everything in TorchScript
        capture = Capture(min_cluster_size=1000)
        torch.compile(model, backend=capture)(x)
        assert capture.engine_calls() == 0
        with pytest.raises(Exception, match="unknown blade option"):
            torch.compile(model, backend="tt_infer", options={"no_such_option": 1})(x)


def test_excluded_ops_stay_in_torchscript():
    model, x = _mlp(), torch.randn(4, 32)
    capture = Capture(excluded_ops=("aten::gelu",), min_cluster_size=1)
    with torch.no_grad():
        expected = model(x)
        assert_close(torch.compile(model, backend=capture)(x), expected)
    assert "aten::gelu" in capture.graph_text
    assert ("aten::gelu", "excluded by config (excluded_ops)") in capture.report.left_out
    assert capture.engine_calls() == 2  # the linears on either side still compile


def test_save_and_load_in_fresh_process(tmp_path):
    model, x = _mlp(), torch.randn(4, 32)
    capture = Capture()
    with torch.no_grad(), pinned_gemm():
        out = torch.compile(model, backend=capture)(x)
    module = capture.compiled[0].module
    assert 'prim::CallMethod[name="execute"]' in str(module.graph)
    torch.jit.save(module, tmp_path / "m.pt")
    torch.save({"x": x, "out": out}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import torch, blade
        io = torch.load({str(tmp_path / 'io.pt')!r})
        m = torch.jit.load({str(tmp_path / 'm.pt')!r})
        assert 'prim::CallMethod[name="execute"]' in str(m.graph)
        got = m(io["x"])[0]
        assert torch.equal(got, io["out"]), (got - io["out"]).abs().max()
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={"PATH": "/nonexistent", **PINNED_GEMM_ENV})  # no compiler reachable: loading must not compile
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def assert_concurrent_calls_match(fn, inputs, expected, calls: int) -> None:
    """fn(inputs[i]) == expected[i], `calls` times on each of len(inputs) threads at once."""
    errors = []

    def worker(i):
        try:
            with torch.no_grad():
                for _ in range(calls):
                    assert_close(fn(inputs[i]), expected[i])
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_concurrent_calls_share_engines(engines_built):
    model = _mlp()
    inputs = [torch.randn(4, 32) for _ in range(4)]
    with torch.no_grad():
        compiled = torch.compile(model, backend="tt_infer")
        expected = [model(x) for x in inputs]
        compiled(inputs[0])  # compile once, before the threads start
    assert engines_built() >= 1
    assert_concurrent_calls_match(compiled, inputs, expected, calls=50)


def test_concurrent_calls_winograd_convolutions():
    """64-channel 3x3 convolutions between convolutions take the runtime's Winograd path (scratch
    per calling thread, the transformed weight packed once under the engine's lock): concurrent
    calls on one compiled model stay equal to eager."""
    torch.manual_seed(0)
    convs = [torch.nn.Conv2d(64, 64, 3, padding=1) for _ in range(3)]
    model = torch.nn.Sequential(convs[0], torch.nn.ReLU(), convs[1], torch.nn.ReLU(), convs[2]).eval()
    inputs = [torch.randn(1, 64, 12, 11) for _ in range(4)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
        compiled = blade.compile_model(model, (inputs[0],))
    assert compiled.report.clusters and all(c.status == "compiled" for c in compiled.report.clusters)
    assert_concurrent_calls_match(lambda x: compiled(x)[0], inputs, expected, calls=20)


class _ThreeInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, a, b, c):
        return self.fc(a) * 2 + torch.tanh(c) - b


def test_compiled_module_passes_each_runtime_input_in_place():
    """CompiledModule picks the ScriptModule's inputs out of dynamo's arguments (parameters
    interleaved) by position: three inputs of one shape must not trade places."""
    torch.manual_seed(0)
    model, args = _ThreeInputs().eval(), [torch.randn(4, 16) for _ in range(3)]
    with torch.no_grad():
        expected = model(*args)
        backend = Capture()
        compiled = torch.compile(model, backend=backend, dynamic=False)
        for _ in range(2):
            assert_close(compiled(*args), expected)
    assert backend.engine_calls() >= 1 and len(backend.compiled[0].runtime_inputs) == 3


@pytest.mark.parametrize("positions", [[], [3], [0, 2, 5]])
def test_picker_returns_a_tuple_of_the_positions(positions):
    from blade.pipeline import picker
    args = tuple(range(10, 16))
    assert picker(positions)(args) == tuple(args[p] for p in positions)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("gemm, split", [("mkl", True), ("mkl", False), ("onednn", False)])
def test_few_row_linears_match_eager_on_each_gemm_backend(threads, gemm, split):
    """An [8, 256] MLP block: with MKL its GEMMs (8 rows) run in column blocks across threads, each
    on its own packed slice of the weight (cpp/gemm_mkl.cpp), with oneDNN on a weight reordered
    once (cpp/gemm_onednn.cpp); the same numbers as eager every way."""
    from blade._C import _testing
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 256)).eval()
    x = torch.randn(8, 256)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    _testing.set_gemm_column_split_rows(-1 if split else 0)
    _testing.set_gemm_backend(gemm)
    try:
        with torch.no_grad():
            expected = model(x)
            backend = Capture()
            compiled = torch.compile(model, backend=backend, dynamic=False)
            for _ in range(3):  # the first call packs the weights, later ones reuse them
                assert_close(compiled(x), expected)
        assert backend.engine_calls() >= 1
    finally:
        torch.set_num_threads(before)
        _testing.set_gemm_column_split_rows(-1)
        _testing.set_gemm_backend("")
