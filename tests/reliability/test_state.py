"""Mutation and aliasing: a compiled call writes model state and inputs exactly as eager does.

Every case runs a model eagerly and through tt_infer (each on its own copy of the model and of the
inputs) and compares the outputs and, after every call, the inputs and the model's buffers. Where a
model also has ops that merely sit next to a mutation, engines must still have run for them.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import blade
from blade.dynamo import tt_infer
from blade.pipeline import CompiledModule
from blade.specialize import ShapeSpecialized
from blade_testing import assert_close

MODES = ["off", "fallback", "check", "eager"]
ENGINE_CALL = 'prim::CallMethod[name="execute"]'


class Recorder:
    """tt_infer, remembering what it returned for each graph (no silent fallback to eager)."""

    def __init__(self, **options):
        self.options = options
        self.results: list = []

    def __call__(self, gm, example_inputs):
        result = tt_infer(gm, example_inputs, options=self.options)
        assert isinstance(result, (CompiledModule, ShapeSpecialized)), "a graph fell back to eager"
        self.results.append(result)
        return result

    def modules(self) -> list:
        found = []
        for result in self.results:
            variants = result.variants.values() if isinstance(result, ShapeSpecialized) else [result]
            found += [v for v in variants if isinstance(v, CompiledModule)]
        return found

    def engine_calls(self) -> int:
        return sum(str(m.module.graph).count(ENGINE_CALL) for m in self.modules())

    def left_out(self) -> list:
        return [item for m in self.modules() for item in m.report.left_out]


def _same_tensors(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, f"{what} {name}: dtype"
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-6, equal_nan=True), \
            f"{what} {name} after the call: {got[name]} vs eager {want[name]}"


def run_against_eager(model, make_inputs, calls=(0,), *, mode="off", min_cluster_size=1):
    """Call eager and the compiled copy once per entry of calls (make_inputs(entry) builds the
    inputs, so each side gets its own); compare outputs, inputs and buffers after every call."""
    torch._dynamo.reset()
    eager = model
    compiled_model = copy.deepcopy(model)
    recorder = Recorder(fallback=mode, min_cluster_size=min_cluster_size)
    compiled = torch.compile(compiled_model, backend=recorder)
    with torch.no_grad():
        for call in calls:
            eager_inputs, compiled_inputs = make_inputs(call), make_inputs(call)
            expected = eager(*eager_inputs)
            actual = compiled(*compiled_inputs)
            assert_close(actual, expected, rtol=1e-5, atol=1e-6)
            _same_tensors(dict(enumerate(compiled_inputs)), dict(enumerate(eager_inputs)), "input")
            _same_tensors(dict(compiled_model.named_buffers()), dict(eager.named_buffers()), "buffer")
    torch._dynamo.reset()
    return recorder


def seeded(fn):
    """make_inputs from a function of (generator, call): the same tensors every time it is asked."""
    def make(call):
        return fn(torch.Generator().manual_seed(call), call)
    return make


# ---------------------------------------------------------------------------------------------
# 1. Model state: a buffer counter, written once per call
# ---------------------------------------------------------------------------------------------

class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return (x * 2 + 1).relu() + self.count


def counter_inputs(g, call):
    return (torch.randn(3 if call < 2 else 5, 4, generator=g),)


@pytest.mark.parametrize("mode", MODES)
def test_buffer_counter_after_one_two_calls_and_a_new_shape(mode):
    recorder = run_against_eager(Counter(), seeded(counter_inputs), calls=(0, 1, 2), mode=mode)
    assert recorder.engine_calls() >= 1  # the mul/add/relu next to the counter still compiled
    reasons = dict(recorder.left_out())
    assert "mutates memory" in reasons["aten::add_"]


def test_buffer_counter_with_default_cluster_size():
    recorder = run_against_eager(Counter(), seeded(counter_inputs), calls=(0, 1), min_cluster_size=2)
    assert recorder.engine_calls() >= 1


# ---------------------------------------------------------------------------------------------
# 2. In-place ops on graph inputs
# ---------------------------------------------------------------------------------------------

class InputAddOne(torch.nn.Module):
    def forward(self, x):
        x.add_(1)
        return (x * 2).sigmoid()


class InputAddBuffer(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.register_buffer("step", torch.arange(4).to(dtype))

    def forward(self, x):
        y = x.exp() * 3
        x.add_(self.step)
        return y + x, x


@pytest.mark.parametrize("mode", MODES)
def test_input_add_(mode):
    recorder = run_against_eager(InputAddOne(), seeded(lambda g, c: (torch.randn(2, 4, generator=g),)),
                                 calls=(0, 1), mode=mode)
    assert recorder.engine_calls() >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32])
def test_input_add_of_buffer_with_mixed_dtypes(dtype):
    recorder = run_against_eager(InputAddBuffer(dtype), seeded(lambda g, c: (torch.randn(3, 4, generator=g),)),
                                 calls=(0, 1))
    assert recorder.engine_calls() >= 1


# ---------------------------------------------------------------------------------------------
# 3. Batch norm and instance norm in training mode update their running statistics
# ---------------------------------------------------------------------------------------------

class NormBlock(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.norm = norm

    def forward(self, x):
        return self.norm(self.conv(x)).relu() * 2


class FunctionalNorms(torch.nn.Module):
    """The OpInfo samples: F.batch_norm / F.instance_norm with running stats and batch statistics."""

    def __init__(self):
        super().__init__()
        for name in ("bn_mean", "in_mean"):
            self.register_buffer(name, torch.zeros(4))
        for name in ("bn_var", "in_var"):
            self.register_buffer(name, torch.ones(4))

    def forward(self, x):
        a = F.batch_norm(x, self.bn_mean, self.bn_var, training=True, momentum=0.2)
        b = F.instance_norm(x, self.in_mean, self.in_var, use_input_stats=True, momentum=0.3)
        return (a + b).tanh()


def image_inputs(g, call):
    return (torch.randn(2, 3, 6, 6, generator=g),)


NORMS = {
    "batch_norm": lambda: torch.nn.BatchNorm2d(4),
    "instance_norm": lambda: torch.nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_training_norm_updates_running_stats(norm, mode):
    model = NormBlock(NORMS[norm]()).train()
    recorder = run_against_eager(model, seeded(image_inputs), calls=(0, 1), mode=mode)
    assert model.norm.running_mean.abs().sum() > 0  # eager did update: the comparison means something
    assert recorder.engine_calls() >= 1  # the conv and the relu/mul around the norm


def test_functional_norms_with_running_stats():
    recorder = run_against_eager(FunctionalNorms(), seeded(lambda g, c: (torch.randn(2, 4, 5, generator=g),)),
                                 calls=(0, 1))
    assert recorder.engine_calls() >= 1
    reasons = dict(recorder.left_out())
    assert "writes" in reasons["aten::batch_norm"] and "writes" in reasons["aten::instance_norm"]


class NormsOfInputs(torch.nn.Module):
    """The OpInfo form: the running statistics are the call's own arguments."""

    def forward(self, x, bn_mean, bn_var, in_mean, in_var):
        a = F.batch_norm(x * 2, bn_mean, bn_var, training=True)
        b = F.instance_norm(x + 1, in_mean, in_var, use_input_stats=True)
        return a - b


class StatsThroughViews(torch.nn.Module):
    """Running statistics kept as rows of one buffer: batch norm writes through select views."""

    def __init__(self):
        super().__init__()
        self.register_buffer("stats", torch.stack([torch.zeros(4), torch.ones(4)]))

    def forward(self, x):
        return F.batch_norm(x * 2, self.stats[0], self.stats[1], training=True).exp() + 1


def test_training_batch_norm_writes_through_views_of_a_buffer():
    recorder = run_against_eager(StatsThroughViews(), seeded(lambda g, c: (torch.randn(3, 4, generator=g),)),
                                 calls=(0, 1))
    assert recorder.engine_calls() >= 1
    assert "written in place" in dict(recorder.left_out())["aten::select"]


def test_norms_update_running_stats_passed_as_inputs():
    def make(g, call):
        return (torch.randn(2, 4, 5, generator=g), torch.zeros(4), torch.ones(4), torch.zeros(4), torch.ones(4))
    recorder = run_against_eager(NormsOfInputs(), seeded(make), calls=(0, 1))
    assert recorder.engine_calls() >= 1


# ---------------------------------------------------------------------------------------------
# 4. as_strided reads the storage under a view, not the view's logical layout
# ---------------------------------------------------------------------------------------------

VIEWS = {
    "transpose": lambda y: y.transpose(0, 1),
    "permute": lambda y: y.permute(1, 0, 2),
    "slice_with_offset": lambda y: y[1:],
    "select": lambda y: y.select(0, 1),
    "narrow": lambda y: y.narrow(2, 1, 3),
    "expand": lambda y: y[:1].expand(3, 4, 5),
}


class StridedOverView(torch.nn.Module):
    def __init__(self, view):
        super().__init__()
        self.view = view

    def forward(self, x):
        y = x * 2 + 1                       # computed: an engine may produce it
        v = self.view(y)
        s = torch.as_strided(v, (2, 3), (1, 4), 22)  # past y's first row: an expand's copy differs
        return s.exp() + 1, v.sum()


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_as_strided_over_a_view_of_a_computed_value(view):
    recorder = run_against_eager(StridedOverView(VIEWS[view]),
                                 seeded(lambda g, c: (torch.randn(3, 4, 5, generator=g),)))
    assert recorder.engine_calls() >= 1  # exp/add after as_strided, or the sum of the view


class StridedOverInput(torch.nn.Module):
    def forward(self, x):
        under_view = torch.as_strided(x.transpose(2, 3), (2, 3), (1, 4), 1)
        under_result = torch.as_strided(x * 2, (2, 3), (1, 4), 5)  # eager keeps x's memory format
        return under_view.exp() + under_result


def _strided_input(kind):
    def make(g, call):
        base = torch.randn(2, 3, 4, 4, generator=g)
        return ({"channels_last": base.contiguous(memory_format=torch.channels_last),
                 "transposed": base.transpose(2, 3),
                 "offset_slice": base[1:]}[kind],)
    return seeded(make)


@pytest.mark.parametrize("kind", ["channels_last", "transposed", "offset_slice"])
def test_as_strided_over_a_non_contiguous_input(kind):
    recorder = run_against_eager(StridedOverInput(), _strided_input(kind))
    assert recorder.engine_calls() >= 1


class WriteThroughView(torch.nn.Module):
    def forward(self, x):
        y = x * 3
        # dynamo breaks the graph here and returns both y and its view y.t(): the view must
        # still alias y when the out= write lands in it
        torch.mul(x.t(), 2, out=y.t())
        return y.relu() - 1


def test_in_place_write_through_a_view_of_a_computed_value():
    recorder = run_against_eager(WriteThroughView(), seeded(lambda g, c: (torch.randn(4, 3, generator=g),)))
    assert recorder.engine_calls() >= 1


class ReturnsViewOfInput(torch.nn.Module):
    def forward(self, x):
        return x.t(), (x * 2).relu()


def test_output_that_is_a_view_of_an_input_aliases_it():
    torch._dynamo.reset()
    recorder = Recorder(min_cluster_size=1)
    x = torch.randn(3, 4)
    with torch.no_grad():
        view, _ = torch.compile(ReturnsViewOfInput(), backend=recorder)(x)
    torch._dynamo.reset()
    assert view.data_ptr() == x.data_ptr() and view.stride() == x.t().stride()
    assert recorder.engine_calls() >= 1


# ---------------------------------------------------------------------------------------------
# 5. Export: the archive starts from the model's state as it was
# ---------------------------------------------------------------------------------------------

def test_export_of_a_stateful_model_starts_from_the_original_state(tmp_path):
    model = Counter()
    x = torch.randn(3, 4)
    path = str(tmp_path / "counter.blade.pt")
    with torch.no_grad():
        blade.export(model, (x,), path, blade.Config(min_cluster_size=1))
    assert model.count.item() == 0.0, "exporting ran the model on its live state"
    loaded = blade.load(path)
    with torch.no_grad():
        first = loaded(x)
        second = loaded(x)
        eager_first = model(x)
        eager_second = model(x)
    assert_close(first, eager_first)     # the archive's counter went 0 -> 1 -> 2, as eager's did
    assert_close(second, eager_second)
    assert ENGINE_CALL in str(loaded.graph)


def test_explain_names_the_writer_and_runs_the_model_once():
    model = Counter()
    torch._dynamo.reset()
    with torch.no_grad():
        text = str(blade.explain(model, torch.randn(3, 4), min_cluster_size=1))
    torch._dynamo.reset()
    assert "aten::add_" in text and "mutates memory" in text
    assert model.count.item() == 0.0  # explain reports; it leaves the model as it was


class NestedStats(torch.nn.Module):
    """Running statistics two modules down: freezing can only keep top-level attributes."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.BatchNorm1d(4))

    def forward(self, x):
        bn = self.inner[0]
        return F.batch_norm(x, bn.running_mean, bn.running_var, training=True).relu() * 2


def test_written_state_that_freezing_would_fold_runs_eagerly_once():
    eager, traced = NestedStats(), torch.fx.symbolic_trace(NestedStats())
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="constants"):
        run = tt_infer(traced, [x], options={"min_cluster_size": 1})
    with torch.no_grad():
        assert_close(run(x), eager(x))
    kept = dict(traced.named_buffers())  # symbolic_trace drops the unused num_batches_tracked
    _same_tensors(kept, {k: v for k, v in eager.named_buffers() if k in kept}, "buffer")


def test_exported_training_batch_norm_updates_its_stats_like_eager(tmp_path):
    model = NormBlock(NORMS["batch_norm"]()).train()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 6)
    path = str(tmp_path / "bn.blade.pt")
    with torch.no_grad():
        blade.export(model, (x,), path, blade.Config(min_cluster_size=1))
        _same_tensors(dict(model.named_buffers()), dict(eager.named_buffers()), "buffer")  # untouched
        loaded = blade.load(path)
        for _ in range(2):
            assert_close(loaded(x), eager(x))
    saved = {name.replace("L__self___norm_", "norm."): t for name, t in loaded.named_buffers()}
    _same_tensors(saved, dict(eager.named_buffers()), "archive buffer")
    assert ENGINE_CALL in str(loaded.graph)


# ---------------------------------------------------------------------------------------------
# 6. The rules themselves, on small graphs: who writes, which values alias
# ---------------------------------------------------------------------------------------------

WRITERS = {   # one node's IR -> the names of the inputs it writes
    "%y : Tensor = aten::add_(%a, %b, %one)": ["a"],
    "%y : Tensor = aten::add(%a, %b, %one, %c)": ["c"],                  # out=
    "%y : Tensor = aten::batch_norm(%a, %none, %none, %b, %c, %true, %f, %f, %true)": ["b", "c"],
    "%y : Tensor = aten::batch_norm(%a, %none, %none, %b, %c, %false, %f, %f, %true)": [],
    "%y : Tensor = aten::instance_norm(%a, %none, %none, %none, %none, %true, %f, %f, %true)": [],
    "%y : Tensor = aten::mul(%a, %b)": [],
}


@pytest.mark.parametrize("line", sorted(WRITERS))
def test_written_inputs_from_schemas(line):
    from blade.cluster.aliasing import written_inputs
    graph = torch._C.parse_ir(f"""graph(%a : Tensor, %b : Tensor, %c : Tensor):
      %one : int = prim::Constant[value=1]()
      %true : bool = prim::Constant[value=1]()
      %false : bool = prim::Constant[value=0]()
      %f : float = prim::Constant[value=0.1]()
      %none : NoneType = prim::Constant()
      {line}
      return (%y)""")
    node = graph.return_node().inputsAt(0).node()
    assert [v.debugName() for v in written_inputs(node)] == WRITERS[line]
