"""A forward that is more than one engine call runs without the graph executor's optimization
(blade/executor.py): no profiling run on its first call, the caller's thread flag restored."""
from __future__ import annotations

import pytest
import torch

import blade
from blade.config import Config
from blade.executor import unoptimized

# cumprod kept out of the engines: two engines with TorchScript between them, so the forward is
# not the one engine call blade/direct.py runs without TorchScript
SPLIT = Config(min_cluster_size=1, excluded_ops=("aten::cumprod",))


class Split(torch.nn.Module):
    def forward(self, x):
        return torch.cumprod(x * 2, 0) + 1


def _profiled_last_call() -> bool:
    """Whether the graph the executor ran last holds profiling nodes (its optimizing first run)."""
    return "prim::profile" in str(torch.jit.last_executed_optimized_graph())


def test_unoptimized_turns_the_flag_off_for_the_call_and_restores_the_callers():
    inside = unoptimized(lambda: torch._C._get_graph_executor_optimize())
    assert torch._C._get_graph_executor_optimize()
    assert inside() is False
    assert torch._C._get_graph_executor_optimize()
    with torch.jit.optimized_execution(False):
        assert inside() is False
        assert torch._C._get_graph_executor_optimize() is False  # a caller's False stays False


def test_unoptimized_restores_the_flag_when_the_call_raises():
    def fails():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        unoptimized(fails)()
    assert torch._C._get_graph_executor_optimize()


def test_loaded_archive_and_compiled_module_forwards_run_unoptimized(tmp_path):
    x = torch.randn(4, 5)
    expected = Split()(x)
    path = str(tmp_path / "split.blade.pt")
    compiled = blade.export(Split(), (x,), path, SPLIT)
    loaded = blade.load(path)
    assert loaded._fast is None, "the forward must not be a single engine call for this test"
    with torch.no_grad():
        for module in (compiled, loaded):
            for _ in range(3):  # the executor profiles on the first call, optimizes on the second
                out = module(x)  # the CompiledModule returns the flat outputs, the archive the model's
                torch.testing.assert_close(out[0] if isinstance(out, list) else out, expected)
                assert not _profiled_last_call()
                assert torch._C._get_graph_executor_optimize()
        loaded.script.forward(x)  # the ScriptModule called directly keeps torch's default
        assert _profiled_last_call()
