"""Run-time sizes read by ops inside clusters (issue 12): ``arange(seq)``, ``buffer[:, :seq]`` and
``expand(batch, seq)`` compute in engines with dynamic shapes: the frontend gives each such op an
``aten::size`` of a tensor (frontend._sizes_per_use), the cluster reads it from that tensor's
shape (ONNX Shape), and the engine's Range/Slice/Expand take it as an expression of its size
symbols. Checked against eager at several sizes, the range maxima and size 1 (dynamo's second
graph); a pattern the rules do not take stays in TorchScript with its reason."""
import pytest
import torch

from blade_testing import Capture, assert_close, compile_dynamic_and_check

SEQ_MAX, BATCH_MAX = 24, 6


class Positions(torch.nn.Module):
    """BERT's embeddings: positions arange(seq) (GPT-2) and a position buffer sliced to seq
    (BERT), token types from a buffer expanded to (batch, seq)."""

    def __init__(self, dim=16, vocab=50):
        super().__init__()
        self.words, self.positions = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(SEQ_MAX, dim)
        self.types = torch.nn.Embedding(2, dim)
        self.register_buffer("position_ids", torch.arange(SEQ_MAX).expand(1, -1), persistent=False)
        self.register_buffer("type_ids", torch.zeros(1, SEQ_MAX, dtype=torch.long), persistent=False)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, ids):
        batch, seq = ids.shape
        sliced = self.position_ids[:, :seq]
        arange = torch.arange(seq)
        types = self.type_ids[:, :seq].expand(batch, seq)
        x = self.words(ids) + self.positions(arange) + self.positions(sliced) + self.types(types)
        return self.norm(x), arange * 2 + 1


def ids_of(batch, seq):
    return torch.randint(0, 50, (batch, seq))


def compiled_positions(smallest=2):
    """Positions through torch.compile, batch and seq marked dynamic from `smallest` (1: traced
    with backed_size_oblivious, else dynamo would specialize size 1)."""
    import torch.fx.experimental._config as fx_config
    torch.manual_seed(0)
    model, capture = Positions().eval(), Capture()
    compiled = torch.compile(model, backend=capture)
    ids = ids_of(3, 7)
    torch._dynamo.mark_dynamic(ids, 0, min=smallest, max=BATCH_MAX)
    torch._dynamo.mark_dynamic(ids, 1, min=smallest, max=SEQ_MAX)
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=smallest < 2):  # while dynamo traces
        assert_close(compiled(ids), model(ids))
    return model, capture, compiled


def test_arange_slice_and_expand_of_sizes_compute_in_engines():
    model, capture, compiled = compiled_positions()
    report = capture.report
    kinds = {kind for c in report.clusters for kind in c.op_kinds}
    assert {"aten::arange", "aten::slice", "aten::expand"} <= kinds, kinds
    assert not any(kind in ("aten::arange", "aten::slice", "aten::expand") for kind, _ in report.left_out), \
        report.left_out
    assert all(c.status == "compiled" for c in report.clusters)
    assert report.coverage == 1.0, report.left_out
    with torch.no_grad():
        for batch, seq in [(2, 2), (5, 11), (BATCH_MAX, SEQ_MAX), (2, SEQ_MAX), (BATCH_MAX, 3), (3, 7)]:
            ids = ids_of(batch, seq)
            assert_close(compiled(ids), model(ids))
    assert len(capture.compiled) == 1  # one graph, one compile, every size in range


def test_size_one_is_exact_too():
    """dynamo specializes size 1 (a graph of its own, static in that dim)."""
    model = Positions().eval()
    compiled = torch.compile(model, backend="tt_infer", dynamic=True)
    with torch.no_grad():
        for batch, seq in [(3, 5), (1, 1), (1, 9), (4, 1), (2, 6)]:
            ids = ids_of(batch, seq)
            assert_close(compiled(ids), model(ids))


class PaddingMask(torch.nn.Module):
    """transformers' padding mask (masking_utils): mask[batch_idx, kv_idx] over the run-time
    batch and key length, then masked scores."""

    def forward(self, scores, mask):
        batch, kv = mask.shape
        batch_idx = torch.arange(batch)[:, None, None, None]
        kv_idx = torch.arange(kv)[None, None, None, :]
        allowed = mask.to(torch.bool)[batch_idx, kv_idx]                # [batch, 1, 1, kv]
        return scores.masked_fill(~allowed, -1e4).softmax(-1), mask[batch_idx, kv_idx - 1] * 2


def masked_inputs(batch, seq):
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, (seq + 1) // 2:] = 0
    return torch.randn(batch, 2, seq, seq), mask


def test_the_padding_mask_index_computes_in_an_engine():
    model, capture = PaddingMask().eval(), Capture()
    compiled = torch.compile(model, backend=capture)
    scores, mask = masked_inputs(3, 7)
    for x in (scores, mask):
        torch._dynamo.mark_dynamic(x, 0, min=2, max=BATCH_MAX)
    torch._dynamo.mark_dynamic(scores, 2, min=2, max=SEQ_MAX)
    torch._dynamo.mark_dynamic(scores, 3, min=2, max=SEQ_MAX)
    torch._dynamo.mark_dynamic(mask, 1, min=2, max=SEQ_MAX)
    with torch.no_grad():
        assert_close(compiled(scores, mask), model(scores, mask))
        for batch, seq in [(2, 2), (BATCH_MAX, SEQ_MAX), (4, 9), (2, SEQ_MAX)]:
            scores, mask = masked_inputs(batch, seq)
            assert_close(compiled(scores, mask), model(scores, mask))
    report = capture.report
    assert len(capture.compiled) == 1 and report.coverage == 1.0, report.left_out
    assert any("aten::index" in c.op_kinds for c in report.clusters)


class Aranges(torch.nn.Module):
    """aranges over run-time sizes from a constant or a size start and by steps != 1: position ids
    after an offset ``arange(2, seq + 2)``, ``arange(seq, 2 * seq)`` as floats, a fixed count of
    strided steps from a size ``arange(seq - 1, seq + 5, 2)``, a sum over ``arange(0, seq, 3)``, and
    an index_select along the run-time dim (its range check reads the length at run time)."""

    def forward(self, x):
        seq = x.shape[1]
        offset = torch.arange(2, seq + 2)
        doubled = torch.arange(seq, 2 * seq, dtype=torch.float32)
        window = torch.arange(seq - 1, seq + 5, 2)
        strided = torch.arange(0, seq, 3).sum()
        ends = x.index_select(1, torch.arange(seq - 2, seq).clamp(min=0))  # the last two (x[:, [0, 0]] at seq 1)
        return x * offset + doubled, window * 2 + strided, ends


class Rolls(torch.nn.Module):
    """Rolls along run-time dims by shifts below, at and past the sizes (a shift of 30 over
    lengths 1-24), negative ones, and two dims at once (Swin's shifted windows)."""

    def forward(self, x):
        ahead = torch.roll(x, 1, 1) * 2.0
        both = torch.roll(x, (-3, 5), (1, 0)) + 1.0
        far = torch.roll(x, 30, -1).relu()
        return torch.softmax(ahead, -1) + both * far


SIZES_FROM_1 = [(1, 1), (1, SEQ_MAX), (BATCH_MAX, 1), (2, 2), (3, 3), (2, 5), (4, 10), (BATCH_MAX, SEQ_MAX)]


@pytest.mark.parametrize("model, shape", [(Aranges(), lambda b, s: (b, s)), (Rolls(), lambda b, s: (b, s, s))],
                         ids=["arange", "roll"])
def test_arange_and_roll_over_run_time_sizes_compute_in_engines(model, shape):
    """One compile (blade.compile_model, min=1) with every op in engines, exact at size 1, every
    small size and the maxima."""
    import blade
    model = model.eval()
    batch, length = torch.export.Dim("batch", min=1, max=BATCH_MAX), torch.export.Dim("seq", min=1, max=SEQ_MAX)
    dims = {0: batch, 1: length} if len(shape(1, 1)) == 2 else {0: batch, 1: length, 2: length}
    compiled = blade.compile_model(model, (torch.randn(*shape(3, 7)),), dynamic_shapes={"x": dims})
    report = compiled.report
    kinds = {kind for c in report.clusters if c.status == "compiled" for kind in c.op_kinds}
    assert {"aten::arange", "aten::roll"} & kinds, report.left_out
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, report.left_out
    with torch.no_grad():
        for b, s in SIZES_FROM_1:
            x = torch.randn(*shape(b, s))
            assert_close(compiled.signature.outputs(compiled(x)), model(x))


def test_aranges_and_rolls_compute_in_engines_through_torch_compile():
    """The same through dynamo (mark_dynamic from 2, one graph)."""
    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.aranges, self.rolls = Aranges(), Rolls()

        def forward(self, x):
            return self.aranges(x.sum(-1)), self.rolls(x)

    model, capture = Both().eval(), Capture()
    compiled = torch.compile(model, backend=capture)
    x = torch.randn(3, 7, 7)
    for d, lo, hi in ((0, 2, BATCH_MAX), (1, 2, SEQ_MAX), (2, 2, SEQ_MAX)):
        torch._dynamo.mark_dynamic(x, d, min=lo, max=hi)
    with torch.no_grad():
        assert_close(compiled(x), model(x))
        for b, s in [(2, 2), (2, 3), (BATCH_MAX, SEQ_MAX), (4, 9)]:
            x = torch.randn(b, s, s)
            assert_close(compiled(x), model(x))
    report = capture.report
    assert len(capture.compiled) == 1 and report.size_symbols, report.size_symbols
    assert report.aten_in_engines == report.aten_total, report.left_out


class OverRunTimeDims(torch.nn.Module):
    """Ops whose ONNX once depended on the sizes along a run-time dim, each of which kept its cluster
    in TorchScript: means (mean pooling over the sequence; over batch and sequence) and var/std,
    whose counts are now read at run time; F.normalize's expand_as of a norm over the sequence,
    now an Expand to the other tensor's shape; flip along the sequence, a reversed view."""

    def forward(self, x):
        return ((x * 2.0).mean(dim=1) + 1.0, (x - 1.0).mean(dim=(0, 1), keepdim=True), x.double().mean(1),
                (x * 2.0).var(dim=1), (x + 1.0).std(dim=(0, 1), keepdim=True),
                torch.nn.functional.normalize(x * 2.0, dim=1) + 1.0, (x * 2.0).flip(1) + 1.0)


def test_reductions_and_flips_over_run_time_dims_compute_in_engines():
    """One compile (min=1) with every op in engines, within tolerance at size 1 (var's n - 1 = 0:
    NaN as eager), small sizes and the maxima."""
    import blade
    model = OverRunTimeDims().eval()
    dims = {0: torch.export.Dim("batch", min=1, max=BATCH_MAX), 1: torch.export.Dim("seq", min=1, max=SEQ_MAX)}
    compiled = blade.compile_model(model, (torch.randn(3, 7, 5),), dynamic_shapes={"x": dims})
    report = compiled.report
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, \
        (report.left_out, report.symbolic_refusals)
    with torch.no_grad():
        for b, s in SIZES_FROM_1:
            x = torch.randn(b, s, 5)
            assert_close(compiled.signature.outputs(compiled(x)), model(x))


class Stepped(torch.nn.Module):
    """An arange of a size by a step of 2 as an output (its length (seq + 1) // 2 is no size an
    input of the engine has: a derived size, test_derived_sizes.py) and an arange by a float step."""

    def forward(self, x):
        return (x * 2.0).relu(), torch.arange(0, x.shape[1], 2) * 3, torch.arange(0, x.shape[1], 0.5)


def test_a_size_pattern_not_taken_stays_in_torchscript_with_its_reason():
    capture = compile_dynamic_and_check(Stepped().eval(), [(2, 6), (3, 9), (5, 4)])
    reasons = [reason for kind, reason in capture.report.left_out if kind in ("aten::arange", "aten::mul")]
    assert len(reasons) == 1 and "non-integer or non-positive step" in reasons[0], capture.report.left_out
    assert not capture.report.symbolic_refusals


def test_size_one_runs_the_same_graph_under_backed_size_oblivious():
    """mark_dynamic(min=1) with torch's backed_size_oblivious while dynamo traces: no second graph
    for size 1 (dynamo would specialize sizes 0 and 1), and the one compile serves it."""
    model, capture, compiled = compiled_positions(smallest=1)
    with torch.no_grad():
        for b, s in [(1, 1), (1, SEQ_MAX), (BATCH_MAX, 1), (2, 5)]:
            ids = ids_of(b, s)
            assert_close(compiled(ids), model(ids))
    assert len(capture.compiled) == 1 and "in [1, " in capture.report.size_symbols, capture.report.size_symbols
    assert capture.report.coverage == 1.0, capture.report.left_out


def test_static_shapes_keep_their_graph():
    """Without size symbols no op reads a size: the frontend adds no aten::size."""
    model, capture = Positions().eval(), Capture()
    compiled = torch.compile(model, backend=capture, dynamic=False)
    with torch.no_grad():
        ids = ids_of(3, 7)
        assert_close(compiled(ids), model(ids))
    assert "aten::size" not in capture.graph_text


@pytest.mark.parametrize("seq", [2, 13, SEQ_MAX])
def test_export_serves_size_one_and_the_maxima(tmp_path, seq):
    """blade.export with dynamic_shapes: one compile checked at the minima (size 1, no second
    graph) and serving every size in range."""
    import blade
    torch.manual_seed(0)
    model = Positions().eval()
    batch, length = torch.export.Dim("batch", min=1, max=BATCH_MAX), torch.export.Dim("seq", min=1, max=SEQ_MAX)
    path = tmp_path / "positions.blade"
    blade.export(model, (ids_of(3, 7),), str(path), dynamic_shapes={"ids": {0: batch, 1: length}})
    loaded = blade.load(str(path))
    with torch.no_grad():
        for b in (1, BATCH_MAX):
            for s in (1, seq):
                ids = ids_of(b, s)
                assert_close(loaded(ids), model(ids))


class SizeArithmetic(torch.nn.Module):
    """What the untuned models compute from sizes: GPT-2's key length ``mask.size(0) *
    mask.size(1) // ids.size(0)``, Llama's ``view(batch, heads, -1, head_dim)``, BERT's token
    types gathered at the positions from a buffer expanded to the batch, T5's ``full_like``."""

    def __init__(self, dim=16, vocab=50):
        super().__init__()
        self.words, self.positions = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(SEQ_MAX, dim)
        self.register_buffer("type_ids", (torch.arange(SEQ_MAX) % 3).expand(1, -1), persistent=False)

    def forward(self, ids, mask):
        batch = ids.size(0)
        kv = mask.size(0) * mask.size(1) // ids.size(0)
        positions = torch.arange(kv)
        x = self.words(ids) + self.positions(positions)
        heads = x.view(batch, 4, -1, 4).softmax(-1)
        types = torch.gather(self.type_ids.expand(batch, -1), 1, positions.expand(batch, -1))
        return heads, types * 2 + 1, x * torch.full_like(x, 0.5) + torch.ones_like(x)


def size_inputs(batch, seq):
    return ids_of(batch, seq), torch.ones(batch, seq, dtype=torch.long)


def test_size_arithmetic_gather_and_fills_compute_in_engines_at_every_size(tmp_path):
    """Through blade.export (one compile, min=1): every op in engines, exact at size 1 and the maxima,
    and the archive serves the same in a fresh load."""
    import blade
    torch.manual_seed(0)
    model = SizeArithmetic().eval()
    batch, length = torch.export.Dim("batch", min=1, max=BATCH_MAX), torch.export.Dim("seq", min=1, max=SEQ_MAX)
    spec = {"ids": {0: batch, 1: length}, "mask": {0: batch, 1: length}}
    path = tmp_path / "sizes.blade"
    compiled = blade.export(model, size_inputs(3, 7), str(path), dynamic_shapes=spec)
    report = compiled.report
    kinds = {kind for c in report.clusters for kind in c.op_kinds}
    assert {"aten::floordiv", "aten::gather", "aten::full_like", "aten::view"} <= kinds, report.left_out
    assert report.aten_in_engines == report.aten_total, report.left_out
    loaded = blade.load(str(path))
    with torch.no_grad():
        for b, s in [(1, 1), (1, SEQ_MAX), (BATCH_MAX, 1), (2, 5), (BATCH_MAX, SEQ_MAX)]:
            inputs = size_inputs(b, s)
            assert_close(compiled(*inputs), model(*inputs))
            assert_close(loaded(*inputs), model(*inputs))


class DividedDifference(torch.nn.Module):
    """(seq - 3) // 2 is negative at seq < 3, where ONNX Div's truncation differs from floor."""

    def forward(self, x):
        return (x * 2.0).relu(), torch.arange((x.size(1) - 3) // 2 + 2) * 3


def test_a_floordiv_not_provably_non_negative_stays_in_torchscript_with_its_reason():
    capture = compile_dynamic_and_check(DividedDifference().eval(), [(2, 6), (3, 9), (5, 4), (2, 2)])
    # (dynamo may guard on the difference's sign and hand over a second graph: each keeps it out)
    left_out = [item for compiled in capture.compiled for item in compiled.report.left_out]
    reasons = [reason for kind, reason in left_out if kind == "aten::floordiv"]
    assert reasons and all("not provably non-negative" in r for r in reasons), left_out


class CausalMask(torch.nn.Module):
    """Causal masks built over the run-time sequence length (GPT-2 and Llama before transformers'
    masking_utils): ``full((s, s), -1e4).triu(1)``, ``ones(s, s).tril(-1)``, ``zeros(batch, s)``."""

    def forward(self, scores):
        batch, seq = scores.size(0), scores.size(-1)
        causal = torch.full((seq, seq), -1e4).triu(1)
        below = torch.ones(seq, seq, dtype=torch.bool).tril(-1)
        return (scores + causal).softmax(-1), scores.masked_fill(below, 0.0), torch.zeros(batch, seq) + scores[:, 0, 0]


@pytest.mark.parametrize("path", ["torch.compile", "export"])
def test_causal_masks_over_run_time_sizes_compute_in_engines(tmp_path, path):
    import blade
    model = CausalMask().eval()
    scores = torch.randn(3, 2, 7, 7)
    if path == "export":
        batch, length = torch.export.Dim("batch", min=1, max=BATCH_MAX), torch.export.Dim("seq", min=1, max=SEQ_MAX)
        compiled = blade.compile_model(model, (scores,), dynamic_shapes={"scores": {0: batch, 2: length, 3: length}})
        report, points = compiled.report, [(1, 1), (1, SEQ_MAX), (BATCH_MAX, 1), (2, 5), (BATCH_MAX, SEQ_MAX)]
    else:
        capture = Capture()
        compiled = torch.compile(model, backend=capture)
        for d, lo, hi in ((0, 2, BATCH_MAX), (2, 2, SEQ_MAX), (3, 2, SEQ_MAX)):
            torch._dynamo.mark_dynamic(scores, d, min=lo, max=hi)
        with torch.no_grad():
            compiled(scores)
        report, points = capture.report, [(2, 2), (2, SEQ_MAX), (BATCH_MAX, 3), (4, 9)]
    kinds = {kind for c in report.clusters for kind in c.op_kinds}
    assert {"aten::triu", "aten::tril", "aten::full", "aten::ones", "aten::zeros"} <= kinds, report.left_out
    assert report.aten_in_engines == report.aten_total, report.left_out
    with torch.no_grad():
        for b, s in points:
            x = torch.randn(b, 2, s, s)
            assert_close(compiled(x), model(x))


class Upsampled(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.interpolate((x * 2.0).transpose(1, 2), scale_factor=2.0) + 1.0


def test_a_scripted_raising_branch_does_not_stop_a_compile_with_run_time_sizes():
    """F.interpolate by a scale scripts to branches that raise, whose placeholder values
    (prim::Uninitialized) stay in the graph when sizes are run-time: measuring the graph's types
    once failed on them, and the whole model could not compile."""
    import blade
    model = Upsampled().eval()
    dims = {0: torch.export.Dim("batch", min=1, max=BATCH_MAX), 1: torch.export.Dim("seq", min=2, max=SEQ_MAX)}
    compiled = blade.compile_model(model, (torch.randn(3, 7, 5),), dynamic_shapes={"x": dims})
    assert compiled.report.aten_in_engines >= 1, compiled.report.left_out
    with torch.no_grad():
        for b, s in [(1, 2), (3, 7), (BATCH_MAX, SEQ_MAX)]:
            x = torch.randn(b, s, 5)
            assert_close(compiled.signature.outputs(compiled(x)), model(x))


class ConvStem(torch.nn.Module):
    """A ResNet's stem and block: its max pool pads with -inf (a stored pad, planned by comparing
    padded and unpadded dims, which once failed on a run-time batch)."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 7, 2, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                        torch.nn.MaxPool2d(3, 2, 1))
        self.conv, self.head = torch.nn.Conv2d(8, 8, 3, 1, 1), torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.stem(x)
        h = torch.relu(self.conv(h) + h)
        return self.head(h.mean(dim=(2, 3)))  # (F.adaptive_avg_pool2d's scripted size checks would stay as glue)


def test_a_convolution_stem_with_a_run_time_batch_computes_in_engines():
    import blade
    torch.manual_seed(0)
    model = ConvStem().eval()
    compiled = blade.compile_model(model, (torch.randn(2, 3, 32, 32),),
                                   dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1, max=BATCH_MAX)}})
    report = compiled.report
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, \
        (report.left_out, report.symbolic_refusals)
    with torch.no_grad():
        for b in (1, 3, BATCH_MAX):
            x = torch.randn(b, 3, 32, 32)
            assert_close(compiled.signature.outputs(compiled(x)), model(x))


class RowsOfTheMask(torch.nn.Module):
    """The mask's rows indexed by the other input's batch (transformers' masks: ``mask[batch_idx,
    kv_idx]`` with batch_idx = arange of the ids' batch). After a shape change dynamo gives the two
    batch dims two symbols and no guard relates them, so probe points at which the symbols differ
    index past the mask; the graph is probed again with the sizes equal at the example kept equal."""

    def forward(self, x, mask):
        keep = mask[torch.arange(x.shape[0]), :].to(torch.bool)
        return torch.where(keep[:, :, None], x, 0.0).softmax(-1)


def test_sizes_equal_at_the_example_stay_equal_when_the_graph_needs_it():
    model, capture = RowsOfTheMask(), Capture()
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        for batch, seq in [(3, 5), (4, 7), (2, 9), (BATCH_MAX, SEQ_MAX), (5, 2)]:
            x, mask = torch.randn(batch, seq, 8), (torch.rand(batch, seq) > 0.3).long()
            assert_close(compiled(x, mask), model(x, mask))
    static, symbolic = capture.compiled  # the first shape's graph, then one for every other shape
    assert symbolic.report.size_symbols and symbolic.report.coverage == 1.0, symbolic.report.left_out
