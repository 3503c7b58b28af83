"""Frontend rewrites of the frozen TorchScript graph, checked on the graph and against eager."""
import pytest
import torch
import torch.fx

import blade
from blade.frontend import to_torchscript
from blade_testing import assert_close


class SharedInputLinears(torch.nn.Module):
    """Attention-style projections: three linears on one input (one without bias), one elsewhere."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8), torch.nn.Linear(16, 4, bias=False)
        self.out = torch.nn.Linear(8, 16)

    def forward(self, x):
        scores = (self.q(x) * self.k(x)).sum(-1, keepdim=True)
        return self.out(self.q(x) + scores) + self.v(x).mean(-1, keepdim=True)


def kinds(graph):
    return [node.kind() for node in graph.nodes()]


def test_linears_sharing_an_input_become_one_sliced_linear():
    torch.manual_seed(0)
    model, x = SharedInputLinears().eval(), torch.randn(2, 5, 16)
    frontend = to_torchscript(torch.fx.symbolic_trace(model), [x])
    # q, k and v (q used twice) merge into one [20, 16] linear; `out` reads another input
    assert kinds(frontend.graph).count("aten::linear") == 2
    assert kinds(frontend.graph).count("aten::slice") == 3
    with torch.no_grad():
        assert_close(frontend.module(x), model(x))
        assert_close(torch.compile(model, backend="tt_infer")(x), model(x))
        assert_close(blade.compile_model(model, (x,))(x)[0], model(x))


class RepBlock(torch.nn.Module):
    """A re-parameterizable block (FAST's TextNet, ACNet): 3x3, 3x1 and 1x3 convolutions of one
    input, each batch-normed, plus a batch norm of the input itself where the shape allows."""

    def __init__(self, channels, stride=1, groups=1, dilation=1, spatial=2):
        super().__init__()
        conv, norm = (torch.nn.Conv2d, torch.nn.BatchNorm2d) if spatial == 2 else (torch.nn.Conv1d, torch.nn.BatchNorm1d)
        kernels = [(3, 3), (3, 1), (1, 3)] if spatial == 2 else [(3,), (1,)]
        self.branches = torch.nn.ModuleList(
            torch.nn.Sequential(conv(channels, channels, k, stride, [dilation * (n // 2) for n in k], dilation=dilation,
                                     groups=groups, bias=False), norm(channels)) for k in kernels)
        self.identity = norm(channels) if stride == 1 else None
        for module in self.modules():
            if isinstance(module, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)):
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 2)
                module.weight.data.normal_()
                module.bias.data.normal_()

    def forward(self, x):
        y = sum(branch(x) for branch in self.branches)
        return torch.relu(y + self.identity(x) if self.identity is not None else y)


@pytest.mark.parametrize("block", [dict(), dict(stride=2), dict(groups=4), dict(dilation=2), dict(spatial=1)],
                         ids=["plain", "stride2", "groups4", "dilated", "conv1d"])
def test_convolutions_summed_over_one_input_become_one_convolution(block):
    torch.manual_seed(0)
    spatial = block.get("spatial", 2)
    model = torch.nn.Sequential(RepBlock(16, **block), torch.nn.Conv2d(16, 8, 1) if spatial == 2 else
                                torch.nn.Conv1d(16, 8, 1)).eval()
    x = torch.randn(2, 16, *([12, 10] if spatial == 2 else [30]))
    frontend = to_torchscript(torch.fx.symbolic_trace(model), [x])
    # the block's branches and identity: one convolution, then the 1x1 (not summed with anything)
    assert kinds(frontend.graph).count(f"aten::conv{spatial}d") == 2, frontend.graph
    assert {"aten::add", "aten::batch_norm"}.isdisjoint(kinds(frontend.graph))
    with torch.no_grad():
        assert_close(frontend.module(x), model(x))
        assert_close(torch.compile(model, backend="tt_infer")(x), model(x))


class UnmergeableSums(torch.nn.Module):
    """Sums the rewrite must leave apart: a branch also read elsewhere, dilations a kernel cannot
    be embedded across (the same output extent), and convolutions of different inputs."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 1)
        self.wide, self.narrow = torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2), torch.nn.Conv2d(8, 8, 3, padding=1)
        self.c, self.d = torch.nn.Conv2d(8, 8, 1), torch.nn.Conv2d(8, 8, 1)

    def forward(self, x, z):
        shared = self.a(x)
        return shared + self.b(x) + shared.mean(), self.wide(x) + self.narrow(x), self.c(x) + self.d(z)


def test_sums_that_are_not_one_convolution_are_left_apart():
    torch.manual_seed(0)
    model, x, z = UnmergeableSums().eval(), torch.randn(1, 8, 9, 9), torch.randn(1, 8, 9, 9)
    frontend = to_torchscript(torch.fx.symbolic_trace(model), [x, z])
    assert kinds(frontend.graph).count("aten::conv2d") == 6, frontend.graph
    with torch.no_grad():
        for got, want in zip(frontend.module(x, z), model(x, z)):
            assert_close(got, want)


# Kinds the lowering table has no rule for, because the frontend never produces them:
# (function, inputs, the kind it would be, the kind TorchScript computes it as or None)
F = torch.nn.functional
NEVER_PRODUCED = {
    "true_divide": (lambda x: torch.true_divide(x, x + 1), "aten::true_divide", "aten::div"),
    "concat": (lambda x: torch.concat([x, x]) * 2, "aten::concat", "aten::cat"),
    "dropout": (lambda x: F.dropout(x, 0.5, training=False) * 2, "aten::dropout", None),
    "feature_dropout": (lambda x: F.dropout2d(x, 0.5, training=False) * 2, "aten::feature_dropout", None),
    "zeros": (lambda x: x + torch.zeros(4), "aten::zeros", None),
    "ones": (lambda x: x + torch.ones(4), "aten::ones", None),
    "full": (lambda x: x + torch.full((4,), 2.5), "aten::full", None),
    "arange": (lambda x: x + torch.arange(4), "aten::arange", None),
}


@pytest.mark.parametrize("name", sorted(NEVER_PRODUCED))
def test_kinds_without_a_rule_never_reach_the_partitioner(name):
    """If torch starts producing one of these, it needs its rule back (blade/cluster/support.py)."""
    fn, kind, instead = NEVER_PRODUCED[name]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(to_torchscript(gm, list(example_inputs)).graph)
        return gm.forward
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend)(torch.randn(2, 3, 4, 4))
    assert len(graphs) == 1 and kind not in kinds(graphs[0])
    assert instead is None or instead in kinds(graphs[0])


# TorchScript computes these in another dtype than eager (it has no bool Scalar: `& True` is
# `& 1`, int64; freezing drops `* 1` and `+ 0` even where they turn bool into int64); the
# frontend casts each such value back to eager's dtype. In engines and in TorchScript alone.
DTYPE_DIVERGENCES = {
    "bool_times_one": lambda x: (x > 0) * 1,
    "one_times_bool": lambda x: 1 * (x > 0),
    "bool_plus_zero": lambda x: 0 + (x > 0),
    "int_over_one": lambda x: (x > 0).int() / 1,
    "invert_after_times_one": lambda x: ~((x > 0) * 1),
    "bool_and_true": lambda x: (x > 0) & True,
    "invert_after_or_false": lambda x: ~((x > 0) | False),
    "where_bool_scalar": lambda x: torch.where(x > 0, x > 1, True),
    "bool_plus_true": lambda x: (x > 0) + True,
}


@pytest.mark.parametrize("min_cluster_size", [1, 100], ids=["engines", "torchscript"])
@pytest.mark.parametrize("name", sorted(DTYPE_DIVERGENCES))
def test_values_torchscript_types_differently_keep_eager_dtypes(name, min_cluster_size):
    fn = DTYPE_DIVERGENCES[name]
    x = torch.randn(6)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(fn, backend="tt_infer", options={"min_cluster_size": min_cluster_size})(x)
    assert_close(got, fn(x))


@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
def test_transformer_encoder_fast_path_is_spelled_out_for_engines(norm_first, activation):
    """nn.TransformerEncoderLayer in eval without grad is one native call (torch's fast path),
    which no engine takes: blade/native_layers.py spells it out, and every op reaches an engine."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation=activation, norm_first=norm_first,
                                             batch_first=True)
    model, x = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval(), torch.randn(2, 7, 32)
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = blade.explain(model, x)
        assert explanation.coverage == 1.0 and "_transformer_encoder_layer_fwd" not in str(explanation), explanation
        assert_close(torch.compile(model, backend="tt_infer")(x), model(x))
        assert_close(blade.compile_model(model, (x,))(x)[0], model(x))


class MaskedEncoder(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder, self.causal = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), causal

    def forward(self, x, padding):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1]).isinf() if self.causal else None
        # both bool (a mix warns) and the causal hint given (else the encoder compares the mask's
        # values): dynamo breaks the graph at either
        return self.encoder(x, mask=mask, src_key_padding_mask=padding, is_causal=self.causal or None)


@pytest.mark.parametrize("causal", [False, True], ids=["padding", "causal_and_padding"])
def test_transformer_encoder_fast_path_with_masks_is_spelled_out(causal):
    """The native layer reads its (float -inf/0) masks as booleans: a key padding mask (mask type
    1) or a causal mask merged with it (type 2); a query whose keys are all masked is NaN there,
    and so here (the second sequence is all padding)."""
    torch.manual_seed(0)
    model = MaskedEncoder(causal).eval()
    x, padding = torch.randn(3, 7, 32), torch.tensor([[False] * 5 + [True] * 2, [True] * 7, [False] * 7])
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = blade.explain(model, x, padding)
        assert explanation.coverage == 1.0 and "_transformer_encoder_layer_fwd" not in str(explanation), explanation
        want = model(x, padding)
        assert want[1].isnan().all() and not want[0].isnan().any()
        assert_close(torch.compile(model, backend="tt_infer")(x, padding), want)


class PaddedMemoryDecoder(torch.nn.Module):
    """A decoder reading a padded memory: nn.MultiheadAttention's key padding mask path."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.decoder = torch.nn.TransformerDecoder(layer, 2)

    def forward(self, x, memory, padding):
        return self.decoder(x, memory, memory_key_padding_mask=padding)


def test_multi_head_attention_branches_fold_into_one_engine():
    """nn.MultiheadAttention reaches TorchScript as F.multi_head_attention_forward, scripted whole:
    its rank and dtype checks (one inside another), its ``query is key`` choice of projection and
    its in_proj_weight (which freezing keeps as a read) are all decided at compile time, so the
    projections sit in the engine with constant weights: one engine, every op in it."""
    torch.manual_seed(0)
    model, x, memory = PaddedMemoryDecoder().eval(), torch.randn(2, 6, 32), torch.randn(2, 9, 32)
    padding = torch.tensor([[False] * 7 + [True] * 2, [False] * 9])
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = blade.explain(model, x, memory, padding)
        assert explanation.engines == 1 and explanation.coverage == 1.0, explanation
        assert_close(torch.compile(model, backend="tt_infer")(x, memory, padding), model(x, memory, padding))
        assert_close(blade.compile_model(model, (x, memory, padding))(x, memory, padding)[0],
                     model(x, memory, padding))


def _identity_tests(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    fresh = a + 1
    view = fresh.view(-1)
    out = a * 2
    if fresh is a:        # a fresh value is never a caller's tensor: False
        out = out + 1
    if view is fresh:     # a view shares storage: not decided
        out = out + 2
    if a is b:            # two inputs the caller may pass as one: not decided
        out = out + 4
    if fresh is fresh:    # one value: True
        out = out + 8
    return out


def test_identity_tests_fold_where_the_graph_decides_them():
    from blade.cluster.aliasing import fold_identity_tests
    graph = torch.jit.script(_identity_tests).graph
    assert fold_identity_tests(graph) == 2
    remaining = [node for node in graph.nodes() if node.kind() == "aten::__is__"]
    assert len(remaining) == 2, graph


def _identity_through_undeclared_aliases(a: torch.Tensor) -> torch.Tensor:
    fresh = a + 1
    same = torch.nn.functional.dropout(fresh, 0.5, False)   # returns fresh itself (its schema does not say)
    out = fresh * 2
    if same is fresh:
        out = out + 1
    return out


def test_identity_tests_see_ops_that_return_their_input_unannounced():
    from blade.cluster.aliasing import fold_identity_tests
    graph = torch.jit.script(_identity_through_undeclared_aliases).graph
    assert fold_identity_tests(graph) == 0
