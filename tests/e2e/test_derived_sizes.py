"""Engine outputs whose dims are expressions of size symbols no input has (issue 12): a
concatenation along the sequence (2 seq), a pad (seq + 3), flattening (5 seq) and [batch * seq, 5]
views, pooling (seq // 2) and a stepped arange ((seq + 1) // 2). Each is a derived size symbol the
engine computes from its inputs' sizes before the call (blade_engine_derived_sizes), so these
clusters compute in engines with one compile; checked against eager at size 1, small sizes and
the maxima, through blade.compile_model, torch.compile and an archive served in a fresh process."""
import pytest
import torch
import torch.nn.functional as F

from aot_testing import serve_in_fresh_process
from blade_testing import Capture, assert_close

SEQ_MAX, BATCH_MAX, WIDTH = 24, 6, 5

# name -> (forward, the smallest sequence: eager's for pooling). The [batch * seq, 5] patterns from
# seq 1: at a probe where seq is 1, batch * seq equals batch, and the reshape's lowering compares
# run-time dims by their sizes at every probe (support.LowerCtx.same_run_time_dim), not at that one
PATTERNS = {
    "cat": (lambda x: torch.cat([x * 2, x + 1], 1) * 3, 1),
    "pad": (lambda x: F.pad(x * 2, (0, 0, 1, 2)) + 1, 1),
    "flatten": (lambda x: (x * 2).reshape(x.shape[0], -1) + 1, 1),
    "rows": (lambda x: (x * 2).reshape(-1, WIDTH) + 1, 1),
    "view_rows": (lambda x: (x * 2).view(-1, WIDTH) + 1, 1),
    "flatten_rows": (lambda x: (x * 2).flatten(0, 1) + 1, 1),
    "avg_pool1d": (lambda x: F.avg_pool1d((x * 2).transpose(1, 2), 2) + 1, 2),
    "arange_step": (lambda x: ((x * 2).relu(), torch.arange(0, x.shape[1], 2) * 3), 1),
}


class Pattern(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.forward_fn = PATTERNS[name][0]

    def forward(self, x):
        return self.forward_fn(x)


class All(torch.nn.Module):
    """Every pattern in one graph: one engine with several derived sizes."""

    def forward(self, x):
        outputs = []
        for f, _ in PATTERNS.values():
            out = f(x)
            outputs += out if isinstance(out, tuple) else [out]
        return tuple(outputs)


def sizes_from(smallest: int) -> list:
    return [(1, smallest), (BATCH_MAX, smallest), (2, 3), (3, 7), (1, SEQ_MAX), (BATCH_MAX, SEQ_MAX)]


def assert_all_in_engines(report):
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, \
        (report.left_out, report.symbolic_refusals)


@pytest.mark.parametrize("name", PATTERNS)
def test_each_pattern_computes_in_engines_with_one_compile(name):
    import blade
    model, smallest = Pattern(name).eval(), PATTERNS[name][1]
    dims = {0: torch.export.Dim("batch", min=1, max=BATCH_MAX), 1: torch.export.Dim("seq", min=smallest, max=SEQ_MAX)}
    compiled = blade.compile_model(model, (torch.randn(3, 7, WIDTH),), dynamic_shapes={"x": dims})
    assert_all_in_engines(compiled.report)
    with torch.no_grad():
        for b, s in sizes_from(smallest):
            x = torch.randn(b, s, WIDTH)
            assert_close(compiled.signature.outputs(compiled(x)), model(x))


def test_the_patterns_compute_in_engines_through_torch_compile():
    """mark_dynamic, one graph, every op in engines; seq from 4: avg_pool1d's meta guards
    seq // 2 != 1, which dynamo refuses for a range from 2."""
    model, capture = All().eval(), Capture()
    compiled = torch.compile(model, backend=capture)
    x = torch.randn(3, 7, WIDTH)
    torch._dynamo.mark_dynamic(x, 0, min=2, max=BATCH_MAX)
    torch._dynamo.mark_dynamic(x, 1, min=4, max=SEQ_MAX)
    with torch.no_grad():
        assert_close(compiled(x), model(x))
        for b, s in [(2, 4), (2, 5), (4, 9), (BATCH_MAX, SEQ_MAX)]:
            x = torch.randn(b, s, WIDTH)
            assert_close(compiled(x), model(x))
    assert len(capture.compiled) == 1 and capture.report.size_symbols, capture.report.size_symbols
    assert_all_in_engines(capture.report)


def test_an_archive_with_derived_sizes_serves_in_a_fresh_process(tmp_path):
    import blade
    torch.manual_seed(0)
    model = All().eval()
    dims = {0: torch.export.Dim("batch", min=1, max=BATCH_MAX), 1: torch.export.Dim("seq", min=2, max=SEQ_MAX)}
    path = str(tmp_path / "derived.blade.pt")
    compiled = blade.export(model, (torch.randn(3, 7, WIDTH),), path, dynamic_shapes={"x": dims})
    assert_all_in_engines(compiled.report)
    points = []
    with torch.no_grad():
        for b, s in sizes_from(2):
            x = torch.randn(b, s, WIDTH)
            points.append({"x": x, "expected": model(x)})
    out = serve_in_fresh_process(tmp_path, path, points, """
        for p in points:
            got = m(p["x"])
            assert len(got) == len(p["expected"])
            for g, want in zip(got, p["expected"]):
                assert g.shape == want.shape and g.dtype == want.dtype, (g.shape, want.shape)
                assert (g.double() - want.double()).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())
            print("served", tuple(p["x"].shape))
    """)
    assert out.count("served") == len(points), out
