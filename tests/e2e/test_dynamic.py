"""Graphs with symbolic sizes (dynamic=True, mark_dynamic, automatic dynamic after a shape change):
one compile whose engines take the sizes at run time serves every size in range (blade/dynamic.py);
ops whose lowering computes from a size stay in TorchScript; sizes past the ranges and
Config(dynamic_shapes="specialize") compile per shape. Engine compiles are counted at
blade.pipeline.compile_many (one job = one engine = one g++ run on a cache miss)."""
import pytest
import torch
import torch.nn.functional as F

import blade.pipeline
from blade.config import Config
from blade.pipeline import CompiledModule
from blade.specialize import ShapeSpecialized
from blade_testing import Capture, assert_close, compile_dynamic_and_check


class Attention(torch.nn.Module):
    """A BERT-style block: projections viewed into heads by computed sizes, a padding mask
    broadcast over heads, softmax over the (run-time) key length, layer norm, a GELU MLP."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.norm, self.mlp = torch.nn.LayerNorm(dim), torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.GELU(),
                                                                          torch.nn.Linear(64, dim))

    def forward(self, x, mask):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(d, dim=-1))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + (1.0 - mask[:, None, None, :]) * -1e4
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        y = self.norm(x + self.out(y))
        return y + self.mlp(y), y[:, 0]


@pytest.fixture
def engine_compiles(monkeypatch):
    """The number of engine compile jobs so far (a list: appended to as compiles run)."""
    jobs = []
    real = blade.pipeline.compile_many

    def counting(batch, **kwargs):
        jobs.extend(batch)
        return real(batch, **kwargs)

    monkeypatch.setattr(blade.pipeline, "compile_many", counting)
    return jobs


def inputs(batch, seq, dim=32):
    mask = torch.ones(batch, seq)
    mask[0, seq // 2:] = 0
    return torch.randn(batch, seq, dim), mask


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Attention().eval()


def test_one_compile_serves_every_batch_and_sequence_length(model, engine_compiles):
    capture = Capture()
    compiled = torch.compile(model, backend=capture, dynamic=True)
    with torch.no_grad():
        x, mask = inputs(4, 16)
        assert_close(compiled(x, mask), model(x, mask))
        first = len(engine_compiles)
        for batch, seq in [(2, 5), (16, 64), (3, 128), (4, 16)]:
            x, mask = inputs(batch, seq)
            assert_close(compiled(x, mask), model(x, mask))
    assert len(capture.compiled) == 1 and len(engine_compiles) == first  # no engine compiled again
    report = capture.report
    assert report.size_symbols and report.coverage == 1.0, report.left_out
    assert all(c.status == "compiled" for c in report.clusters)
    assert any(isinstance(d, str) for c in report.clusters for shape in c.input_shapes for d in shape)


def test_size_one_is_a_graph_of_its_own(model, engine_compiles):
    """dynamo specializes sizes 0 and 1 (its symbols start at 2): batch 1 traces a second graph,
    dynamic in the sequence only, also compiled once."""
    capture = Capture()
    compiled = torch.compile(model, backend=capture, dynamic=True)
    with torch.no_grad():
        for batch, seq in [(3, 8), (1, 8), (1, 33), (5, 2), (1, 2)]:
            x, mask = inputs(batch, seq)
            assert_close(compiled(x, mask), model(x, mask))
    assert len(capture.compiled) == 2
    assert [c.report.size_symbols.count(" in [") for c in capture.compiled] == [2, 1]
    assert len(engine_compiles) == sum(len(c.report.clusters) for c in capture.compiled)


def test_automatic_dynamic_after_a_shape_change_compiles_once_more():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
    capture = Capture()
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        for batch in (2, 3, 5, 9, 3):  # the second shape makes dynamo recompile with a symbolic size
            x = torch.randn(batch, 16)
            assert_close(compiled(x), model(x))
    assert len(capture.compiled) == 2 and not capture.compiled[0].report.size_symbols
    assert capture.compiled[1].report.size_symbols.startswith("s")
    assert capture.compiled[1].report.coverage == 1.0


def test_mark_dynamic_declares_the_range(model):
    capture = Capture()
    compiled = torch.compile(model, backend=capture)
    x, mask = inputs(4, 16)
    torch._dynamo.mark_dynamic(x, 1, min=2, max=40)
    torch._dynamo.mark_dynamic(mask, 1, min=2, max=40)
    with torch.no_grad():
        compiled(x, mask)
        assert "in [2, 40]" in capture.report.size_symbols
        for seq in (2, 40):
            x, mask = inputs(4, seq)
            assert_close(compiled(x, mask), model(x, mask))


def test_sizes_past_the_cap_compile_per_shape(model, engine_compiles):
    """Where dynamo leaves a maximum open, the engines' cap is Config.dynamic_max_size (lowered
    to fit the memory budget); a size past it gets a static compile of its own, not an error."""
    capture = Capture(dynamic_max_size=24)
    compiled = torch.compile(model, backend=capture, dynamic=True)
    with torch.no_grad():
        x, mask = inputs(4, 16)
        compiled(x, mask)
        assert "in [2, 24]" in capture.report.size_symbols
        first = len(engine_compiles)
        x, mask = inputs(4, 30)
        assert_close(compiled(x, mask), model(x, mask))
        assert len(engine_compiles) > first
        assert isinstance(capture.compiled[0]._outside, ShapeSpecialized)


class Resized(torch.nn.Module):
    """A nearest resize by 1.5 along a run-time length: its rule writes the source positions as a
    constant of the output's length. (A roll, flattened or along a dim, and a causal mask over the
    length compute in engines: test_dynamic_ops.py, test_dynamic_sizes.py.)"""

    def forward(self, x):
        return torch.softmax(F.interpolate(x * 2.0, scale_factor=1.5), -1).relu()


def test_an_op_that_computes_from_a_size_stays_in_torchscript():
    """The op the engine refuses at run-time sizes stays in TorchScript, named with the reason; the
    rest still compiles once."""
    capture = compile_dynamic_and_check(Resized().eval(), [(2, 6, 6), (3, 9, 9), (5, 4, 4)])
    report = capture.report
    assert report.size_symbols and 0 < report.aten_in_engines < report.aten_total
    assert report.left_out


class BuildsAModule(torch.nn.Module):
    """transformers 5's decoders (Mistral, Qwen2, Phi...) build a module inside forward, which puts
    nn.Module's usage log call (torch._C._log_api_usage_once) into dynamo's graph."""

    def forward(self, x):
        return torch.nn.SiLU()(x * 2.0) + 1.0


def test_a_module_built_inside_forward_still_compiles_once(engine_compiles):
    """The usage log computes nothing and TorchScript cannot script it: it is left out, so the graph
    scripts and one compile with run-time sizes serves every shape (before: one per shape)."""
    capture = compile_dynamic_and_check(BuildsAModule().eval(), [(4, 8), (5, 8), (7, 3)])
    assert len(capture.compiled) == 1 and not isinstance(capture.compiled[0], ShapeSpecialized)
    report = capture.report
    assert report.size_symbols and report.coverage == 1.0, report.left_out
    assert len(engine_compiles) == 1


def test_adaptive_pooling_at_run_time_sizes_is_all_in_the_engine():
    """F.adaptive_avg_pool2d scripts a check of its input's rank (len(x.size()), an If): the rank
    is known, so nothing stays in TorchScript, and the pooled tensor is no engine output
    (RegNet, EfficientNet, MobileNetV1 pool this way)."""
    capture = compile_dynamic_and_check(lambda x: F.adaptive_avg_pool2d(torch.relu(x), 1) * 2.0,
                                        [(2, 8, 5, 5), (3, 8, 7, 7), (5, 8, 4, 4)])
    report = capture.report
    assert report.size_symbols and report.coverage == 1.0, report.left_out
    (cluster,) = report.clusters
    assert len(cluster.output_shapes) == 1


class PadThenConv(torch.nn.Module):
    """TF "same" padding written as F.pad before a strided conv (MobileNetV1, EfficientNet)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, stride=2)

    def forward(self, x):
        return torch.relu(self.conv(F.pad(x, (0, 1, 0, 1))))


def test_a_zero_pad_before_a_conv_at_run_time_sizes_joins_the_engine():
    """The conv takes the pad over (its batch dim's pad end is s0 - s0, an expression of 0): the
    engine compiler compared that with 0 and raised, which kept the conv in TorchScript."""
    torch.manual_seed(0)
    model, capture = PadThenConv().eval(), Capture()
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        for batch in (2, 3, 5):
            x = torch.randn(batch, 4, 9, 9)
            torch._dynamo.mark_dynamic(x, 0)   # the batch only (dynamo guards H == W at square images)
            assert_close(compiled(x), model(x))
    assert len(capture.compiled) == 1
    report = capture.report
    assert report.size_symbols and report.coverage == 1.0, report.left_out


class MergedHeads(torch.nn.Module):
    """Bloom's attention: [batch, heads, seq, dim] reshaped to [batch * heads, seq, dim]."""

    def __init__(self, heads=4, dim=8):
        super().__init__()
        self.heads, self.dim, self.proj = heads, dim, torch.nn.Linear(heads * dim, heads * dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.proj(x).view(b, s, self.heads, self.dim).transpose(1, 2).reshape(b * self.heads, s, self.dim)
        return torch.softmax(q @ q.transpose(1, 2), dim=-1).sum(-1) * 2.0


def test_merged_run_time_heads_compute_in_engines():
    """[batch, heads, seq, dim] -> [batch * heads, seq, dim]: two run-time dims no single -1 infers;
    the reshape's shape is computed from the source's dims (it stayed in TorchScript before; an op
    an engine refuses leaving only itself out: test_dynamic_ops.py)."""
    torch.manual_seed(0)
    capture = compile_dynamic_and_check(MergedHeads().eval(), [(3, 12, 32), (2, 7, 32), (4, 20, 32)])
    report = capture.report
    assert report.size_symbols and report.aten_in_engines == report.aten_total, report.left_out


class InferredHeads(MergedHeads):
    """DeBERTa-v2's attention: heads merged into the batch by view(-1, seq, dim) and split back by
    view(-1, heads, seq, seq), each -1 a product of run-time sizes the engine proves is the element
    count over the other dims at every size."""

    def heads_first(self, x):
        x = x.view(x.size()[:-1] + (self.heads, -1))
        return x.permute(0, 2, 1, 3).contiguous().view(-1, x.size(1), x.size(-1))

    def forward(self, x):
        q, k = self.heads_first(self.proj(x)), self.heads_first(x)
        scores = q @ k.transpose(1, 2)
        scores = scores.view(-1, self.heads, scores.size(-2), scores.size(-1))   # split back
        return torch.sign(scores) * torch.softmax(scores, dim=-1)


def test_a_view_whose_minus_one_is_a_product_of_run_time_sizes_computes_in_engines():
    torch.manual_seed(0)
    capture = compile_dynamic_and_check(InferredHeads().eval(), [(3, 12, 32), (2, 7, 32), (4, 20, 32)])
    report = capture.report
    assert report.size_symbols and report.aten_in_engines == report.aten_total, report.left_out


def test_probe_points_keep_what_guards_relate_and_what_the_example_equates():
    """The second set of probe points (blade/dynamic.py _moved_together): a KV-cache decode step's
    guards say the mask is one longer than the cache (cache < mask <= cache + 1, not an equation
    dynamo substitutes), and the mask's batch symbol equals the ids' at the example (no guard says
    so, the mask indexing relies on it). The first set puts every symbol at its own value; the
    second must hold the guards and the equality at every point, each point a new size."""
    import sympy
    from blade.dynamic import PROBES, _point_sets
    cache, mask, batch, mask_batch = sympy.symbols("s70 s53 s72 s43", integer=True, positive=True)
    ranges = {mask_batch: (2, 64), mask: (3, 65), cache: (2, 64), batch: (2, 64)}
    example = {mask_batch: 3, mask: 17, cache: 16, batch: 3}
    guards = [sympy.Le(cache, mask), sympy.Ne(mask, cache), sympy.Le(mask, cache + 1)]
    distinct, moved = _point_sets(ranges, example, guards)
    assert any(not all(bool(g.subs(p)) for g in guards) for p in distinct)
    assert len(moved) == PROBES - 1
    for point in moved:
        assert all(bool(g.subs(point)) for g in guards) and point[batch] == point[mask_batch], point
    assert len({p[cache] for p in [example, *moved]}) == PROBES and len({p[batch] for p in [example, *moved]}) == PROBES


def test_a_size_the_guards_make_equal_to_another_plus_one_is_that_size():
    """A decode step's guards (transformers' mask creation): the mask is at least the cache + 1 long
    and at most that, never an equation dynamo substitutes. The symbol is then the other plus one
    to the engines (blade/dynamic.py _guarded_equalities), checked when they are called; a guard
    set bounding it only one way relates nothing."""
    import sympy
    from blade.dynamic import _guarded_equalities
    past, mask, batch = sympy.symbols("s70 s53 s72", integer=True, positive=True)
    both_ways = [sympy.Le(past, mask), sympy.Ne(mask, past), sympy.Le(-mask + past + 1, 0), sympy.Le(mask, past + 1)]
    candidates = [past, mask, batch, past + 1, 2 * batch]
    assert _guarded_equalities([past, mask, batch], candidates, both_ways) == {mask: past + 1}
    assert _guarded_equalities([past, mask, batch], candidates, both_ways[:3]) == {}   # Gemma2's window: one way
    assert _guarded_equalities([past, mask, batch], candidates, [sympy.Lt(past, mask), sympy.Ge(past + 1, mask)]) \
        == {mask: past + 1}


class PrefillDecode(torch.nn.Module):
    """A tiny Qwen2 prefill and one decode step on its DynamicCache, in one forward."""

    def __init__(self):
        super().__init__()
        import transformers
        cfg = transformers.Qwen2Config(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
        self.inner = transformers.Qwen2Model(cfg).eval()

    def forward(self, input_ids, next_ids, attention_mask):
        first = self.inner(input_ids=input_ids, attention_mask=attention_mask[:, :input_ids.shape[1]], use_cache=True)
        step = self.inner(input_ids=next_ids, attention_mask=attention_mask, past_key_values=first.past_key_values,
                          use_cache=True)
        cache = first.past_key_values   # the grown cache is returned too, as generate() keeps it
        return first.last_hidden_state, step.last_hidden_state, [t for layer in cache.layers for t in (layer.keys, layer.values)]


def test_a_decode_step_after_a_shape_change_computes_its_attention_in_engines():
    """Before, the step's key length (cache + 1, from the cat) and its mask length (a symbol of its
    own) were unrelated to the engines: the cat of the cache, the mask and the attention stayed in
    TorchScript (Qwen2 decode after a shape change: 355 of 369 aten ops in engines)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = PrefillDecode().eval()
    capture = Capture()
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        for batch, seq in [(2, 8), (3, 12), (2, 5)]:
            mask = torch.ones(batch, seq + 1, dtype=torch.long)
            mask[-1, seq - 2:seq] = 0
            inputs = (torch.randint(5, 100, (batch, seq)), torch.randint(5, 100, (batch, 1)), mask)
            assert_close(compiled(*inputs), model(*inputs))
    dynamic = capture.compiled[-1].report
    assert dynamic.size_symbols and len(capture.compiled) == 2, [c.report.size_symbols for c in capture.compiled]
    kinds = {kind for kind, _ in dynamic.left_out}
    assert not kinds & {"aten::scaled_dot_product_attention", "aten::cat"}, dynamic.left_out
    assert dynamic.aten_in_engines >= dynamic.aten_total - 2, dynamic.left_out


RESPELLED = {   # what dynamo's graph spells in a way torch.jit.script rejects (blade/frontend.py _respell)
    "mask_bool_method": lambda x: x.masked_fill(~(x > 0).int().bool(), -1.0) * 2.0,          # DeBERTa-v2
    "cat_axis_keyword": lambda x: torch.cat([x, x * 2.0], axis=1) + 1.0,                      # Funnel
    "pad_int_value": lambda x: F.pad(x * 2.0, (1, 2), "constant", 0) + 1.0,                   # BiT
    "sum_of_sizes": lambda x: F.pad(x, (0, sum([x.shape[1], x.shape[1], 1]) - x.shape[1])) * 2.0,  # Wav2Vec2
    "empty_list_tensor": lambda x: torch.cat([torch.tensor([]), x * 2.0], dim=-1) + 1.0,     # DynamicCache
    "ellipsis_then_list": lambda x: x.view(x.shape[0], -1, 4)[..., [-2, 0]] * 2.0 + x[..., [1]].sum(),  # Falcon
}


@pytest.mark.parametrize("name", sorted(RESPELLED))
def test_constructs_torchscript_rejects_are_respelled_and_compile_once(name):
    """Scripting is the only converter with run-time sizes: these used to fail it, and the graph
    compiled once per shape (eager after 8)."""
    capture = compile_dynamic_and_check(RESPELLED[name], [(2, 8), (3, 12), (5, 16)])
    assert len(capture.compiled) == 1 and not isinstance(capture.compiled[0], ShapeSpecialized)
    assert capture.report.size_symbols


@pytest.mark.parametrize("first, once", [((2, 8), False), ((2, 14), True)])
def test_max_of_sizes_is_right_at_every_size(first, once):
    """max(s, 10) is 10 at probe points below 10, so a run-time-size compile would take it for a
    constant (and refuse s = 12 at the engine's door): probe points at which a size of the graph
    is the same everywhere are refused, and such a graph compiles per shape. From s = 14 the probe
    points near it tell max(s, 10) apart, and one compile serves sizes on both sides of the bend."""
    def padded(x):
        return F.pad(x, (0, max(x.shape[1], 10) - x.shape[1])) * 2.0
    from blade.dynamo import tt_infer
    compiled_graphs = []
    def backend(gm, example_inputs):
        compiled_graphs.append(tt_infer(gm, example_inputs))
        return compiled_graphs[-1]
    compiled = torch.compile(padded, backend=backend, dynamic=True)
    with torch.no_grad():
        for shape in [first, (3, 12), (5, 16), (4, 9), (2, 3)]:
            x = torch.randn(*shape)
            assert_close(compiled(x), padded(x))
    assert len(compiled_graphs) == 1
    assert isinstance(compiled_graphs[0], ShapeSpecialized) != once, getattr(compiled_graphs[0], "reason", "")


def test_gather_along_a_run_time_dim_joins_the_engine():
    """BERT's token types: a buffer cut to the run-time length, gathered at the position ids
    (``buffer[:, :seq].gather(1, positions)``). The gather reads the length from the shape, so it
    compiles with its neighbours into one engine instead of splitting the graph."""
    class TokenTypes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("types", torch.arange(64).remainder(3).unsqueeze(0))
            self.embed = torch.nn.Embedding(3, 8)

        def forward(self, x):
            seq = x.shape[1]
            positions = torch.arange(seq).flip(0).unsqueeze(0)
            types = self.types[:, :seq].gather(1, positions).expand(x.shape[0], seq)
            return (x + self.embed(types)).relu()

    torch.manual_seed(0)
    capture = compile_dynamic_and_check(TokenTypes().eval(), [(2, 6, 8), (3, 9, 8), (5, 40, 8)])
    report = capture.report
    assert report.size_symbols and not any("gather" in n.kind for n in report.left_out_nodes), report.left_out_nodes
    assert any("aten::gather" in c.op_kinds for c in report.clusters if c.status == "compiled")


def test_gather_whose_offsets_need_a_run_time_size_joins_the_engine():
    """gather over rows of a run-time count: each row's offset is a multiple of the run-time row
    length, computed at run time from a Range over the rows (not a constant); exact at every size."""
    class RowGather(torch.nn.Module):
        def forward(self, x):
            index = (x > 0).long()  # 0 or 1: in range at every probe size
            return (x.gather(1, index) * 2.0).relu()

    capture = compile_dynamic_and_check(RowGather().eval(), [(3, 6), (4, 9), (6, 5)])
    assert len(capture.compiled) == 1 and capture.report.size_symbols
    assert not any(n.kind == "aten::gather" for n in capture.report.left_out_nodes), capture.report.left_out_nodes
    assert any("aten::gather" in c.op_kinds for c in capture.report.clusters if c.status == "compiled")


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.scale = torch.nn.LayerNorm(8), 0.5

    def forward(self, x):
        return self.norm(x) * self.scale + 1.0


def test_a_changed_python_scalar_runs_eagerly():
    """dynamo passes float attributes of modules it does not specialize (in a ModuleList, as in
    transformers models) as 0-d tensors it makes per call; blade freezes them into the engines
    and compares their values on every call (dynamo also guards on them: a changed attribute
    recompiles; the check covers calls that pass another value to the same graph)."""
    model = torch.nn.ModuleList([Scaled(), Scaled()]).eval()
    graphs = []

    def backend(gm, example_inputs):
        from blade.dynamo import tt_infer
        graphs.append((gm, list(example_inputs), tt_infer(gm, example_inputs)))
        return graphs[-1][2]

    compiled = torch.compile(lambda x: model[1](model[0](x)), backend=backend, dynamic=True)
    with torch.no_grad():
        x = torch.randn(3, 8)
        assert_close(compiled(x), model[1](model[0](x)))
        gm, example, module = graphs[0]
        scalars = module.source.scalars
        assert scalars.positions  # the attributes arrived wrapped, and are frozen
        args = [3 if isinstance(a, torch.SymInt) else a for a in example]
        args[scalars.positions[-1]] = torch.tensor(scalars.values[-1] + 1.0, dtype=torch.float64)
        with pytest.warns(UserWarning, match="another value"):
            assert_close(module(*args), gm(*args))


def test_specialize_mode_compiles_per_shape():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
    produced = []

    def backend(gm, example_inputs):
        from blade.dynamo import tt_infer
        produced.append(tt_infer(gm, example_inputs, options={"dynamic_shapes": "specialize"}))
        return produced[-1]

    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for batch in (2, 3, 5, 3):
            x = torch.randn(batch, 16)
            assert_close(compiled(x), model(x))
    dynamic = [p for p in produced if isinstance(p, ShapeSpecialized)]
    assert len(dynamic) == 1 and len(dynamic[0].variants) == 2  # batch 3 and 5, each compiled once
    for variant in dynamic[0].variants.values():
        assert 'prim::CallMethod[name="execute"]' in str(variant.module.graph)
    assert all(isinstance(p, CompiledModule) for p in produced if p not in dynamic)


def test_explain_names_the_size_symbols_and_what_stays_in_torchscript():
    import blade

    text = str(blade.explain(Resized().eval(), torch.randn(2, 6, 6), dynamic=True))
    assert "size symbols: s" in text and "computes from a run-time size" in text, text
