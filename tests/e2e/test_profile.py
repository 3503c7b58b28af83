"""blade.profile: per-kernel timings from engines compiled with Config(profile=True).

No timing is asserted (speed is measured in bench/): only that every kernel of every engine is
reported, with non-negative times that fit inside the engine's own, and that the model still
matches eager.
"""
import torch
import torch.nn.functional as F

import blade
from blade._C import _testing
from blade.debug import CapturingBackend


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.fc = torch.nn.Linear(64, 128)

    def forward(self, x):
        return torch.softmax(F.gelu(self.fc(self.norm(x))), dim=-1).sum(-1)


def test_profile_reports_every_kernel():
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(256, 64)  # a GEMM big enough for the runtime to time kernels
    # the choice table is per bucket of shapes and process-wide: an earlier test's GEMM in the same
    # bucket would have made (and named) the choice; start from an empty table
    _testing.set_gemm_backend("")
    # on one thread: the thread count is part of a bucket's key, and a serial window opened by load
    # (GEMMs then run on one thread) split 2-thread calls between two buckets, neither of which got
    # a sample, so a loaded CI run listed no choice
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        profile = blade.profile(model, x, runs=5, warmup=2)
    finally:
        torch.set_num_threads(threads)
    text = str(profile)
    print("\n" + text)
    assert profile.kernels, "a profiled engine reports its kernels"
    assert {k.category for k in profile.kernels} >= {"GEMM", "loops"}
    assert all(k.ms_per_run >= 0 for k in profile.kernels)
    assert profile.kernel_ms <= profile.engine_ms * 1.05 + 1e-3  # kernels run inside run_engine
    assert profile.engine_ms <= profile.model_ms * 1.05 + 1e-3  # engines run inside the model call
    assert "= matmul" in text and "ms in kernels" in text
    if _testing.gemm_onednn_usable():  # else MKL is the only candidate: nothing is timed or listed
        assert any(c["shape"].startswith("[256, 64] @ [64, 128]^T") for c in profile.gemm_choices), text
        assert "GEMM kernels chosen per bucket of call shapes" in text


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v


def test_the_fused_attention_is_its_own_category():
    """Its kernel is not counted as loops (BERT b8's 'loops 23%' was mostly attention)."""
    q, k, v = (torch.randn(2, 3, 16, 16) for _ in range(3))
    profile = blade.profile(Attention(), q, k, v, runs=2, warmup=1, min_cluster_size=1)
    assert [k.category for k in profile.kernels if "fused attention" in k.name] == ["attention"], str(profile)
    assert "attention" in profile.by_category()


def test_profiled_engines_match_eager_and_plain_engines_report_nothing():
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(16, 64)
    with torch.no_grad():
        expected = model(x)
        for profile, reports in ((True, True), (False, False)):
            backend = CapturingBackend(blade.Config(profile=profile))
            got = torch.compile(model, backend=backend, dynamic=False)(x)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
            engines = backend.engines()
            assert engines
            assert all(bool(engine.profile()) == reports for _, engine in engines)
