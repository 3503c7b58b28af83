"""Ops under run-time sizes that once cost more than themselves (issue 12): an op the engine
compiler refuses at run-time sizes (a slice whose bound clamps at some sizes only) used to fail
its whole cluster's compile, so every op of it stayed in TorchScript; now that op alone stays out
(its reason in blade.explain) and the rest computes in engines. layer_norm over x.shape[-k:] of
run-time dims and a roll of the flattened tensor compute in engines. Each checked against eager
at size 1, small sizes and the maxima, with one compile (blade.compile_model, dims from 1)."""
import pytest
import torch
import torch.nn.functional as F

from blade_testing import Capture, assert_close, compile_dynamic_and_check

SEQ_MAX, BATCH_MAX, WIDTH_MAX = 24, 6, 16


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def compiled(fn, dims: dict, example=(3, 7, 5), least=1):
    import blade
    model = Fn(fn).eval()
    declared = {d: torch.export.Dim(name, min=least, max=hi) for d, (name, hi) in dims.items()}
    return model, blade.compile_model(model, (torch.randn(*example),), blade.Config(min_cluster_size=1),
                                      dynamic_shapes={"x": declared})


def check_sizes(model, compiled_model, shapes):
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(*shape)
            assert_close(compiled_model.signature.outputs(compiled_model(x)), model(x))


def engine_kinds(report) -> set:
    return {kind for c in report.clusters if c.status == "compiled" for kind in c.op_kinds}


BATCH_SEQ = {0: ("batch", BATCH_MAX), 1: ("seq", SEQ_MAX)}
SIZES = [(1, 1, 5), (BATCH_MAX, 1, 5), (1, SEQ_MAX, 5), (2, 3, 5), (3, 10, 5), (4, 11, 5), (BATCH_MAX, SEQ_MAX, 5)]


def test_an_op_the_engine_refuses_stays_out_and_the_rest_of_its_cluster_computes_in_engines():
    """x[:, :10] with seq in [1, 24]: the engine's Slice refuses a bound clamped at some sizes only.
    It stays in TorchScript with the engine's reason; the multiply before it and the add after it
    are engines (before: the one cluster failed to compile, 0 of 4 aten ops in engines)."""
    model, result = compiled(lambda x: (x * 2)[:, :10] + 1, BATCH_SEQ)
    report = result.report
    assert not [c.name for c in report.clusters if c.status != "compiled"], report.left_out
    left = [(kind, reason) for kind, reason in report.left_out if kind.startswith("aten::")]
    assert len(left) == 1 and left[0][0] == "aten::slice" and "Slice bound 10" in left[0][1], left
    assert {"aten::mul", "aten::add"} <= engine_kinds(report)
    assert report.aten_in_engines == report.aten_total - 1, report.left_out
    check_sizes(model, result, SIZES)


@pytest.mark.parametrize("name, fn", [
    ("last", lambda x: F.layer_norm(x * 2, x.shape[-1:]) + 1),
    ("last_two", lambda x: F.layer_norm(x * 2, x.shape[-2:]) - 1),
    ("weighted", lambda x: F.layer_norm(x * 2, x.shape[-1:], torch.ones(x.shape[-1]) * 3, torch.ones(x.shape[-1])))])
def test_layer_norm_over_run_time_trailing_dims_computes_in_an_engine(name, fn):
    """normalized_shape = x.shape[-k:] with every dim run-time (width 1 too: a normalization over
    one element)."""
    dims = {**BATCH_SEQ, 2: ("width", WIDTH_MAX)}
    model, result = compiled(fn, dims)
    report = result.report
    assert "aten::layer_norm" in engine_kinds(report), report.left_out
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, report.left_out
    check_sizes(model, result, [(1, 1, 1), (BATCH_MAX, 1, 3), (1, SEQ_MAX, WIDTH_MAX), (2, 3, 4), (3, 7, 5),
                                (2, 5, 1), (BATCH_MAX, SEQ_MAX, WIDTH_MAX)])


@pytest.mark.parametrize("affine", [False, True])
def test_group_norm_over_a_run_time_batch_and_length_computes_in_an_engine(affine):
    """F.group_norm's Python size check (_verify_batch_size: a loop over the sizes) is dynamo's to
    make, so the graph calls the op alone; its groups reshape copies the run-time batch and infers
    the length (before: the check's 12 size ops and the norm stayed in TorchScript)."""
    weight, bias = (torch.randn(6), torch.randn(6)) if affine else (None, None)
    model, result = compiled(lambda x: F.group_norm(x * 2, 3, weight, bias) + 1,
                             {0: ("batch", BATCH_MAX), 2: ("length", WIDTH_MAX)}, example=(3, 6, 5))
    report = result.report
    assert "aten::group_norm" in engine_kinds(report), report.left_out
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, report.left_out
    check_sizes(model, result, [(1, 6, 1), (BATCH_MAX, 6, 1), (1, 6, WIDTH_MAX), (2, 6, 3), (4, 6, 9),
                                (BATCH_MAX, 6, WIDTH_MAX)])


@pytest.mark.parametrize("groups", [1, 2])
def test_group_norm_over_a_run_time_batch_alone_computes_in_an_engine(groups):
    """A run-time batch and static planes: one group, [0 (the batch, copied), 1, C, H, W] reduced
    over its last three dims; two, sums per channel then per group ([0, G, C / G, 1, 1])."""
    model, result = compiled(lambda x: F.group_norm(x * 2, groups) + 1, {0: ("batch", BATCH_MAX)}, example=(3, 4, 5, 6))
    report = result.report
    assert "aten::group_norm" in engine_kinds(report), report.left_out
    check_sizes(model, result, [(1, 4, 5, 6), (BATCH_MAX, 4, 5, 6), (2, 4, 5, 6)])


def test_a_one_row_operand_over_a_run_time_length_multiplies_in_an_engine():
    """A decode step's attention with a soft cap on the scores (Gemma2; no fused attention): the
    probabilities [batch, 1, seq] are a one-row GEMM operand whose width is the run-time length
    (its leading dimension was max(seq, 1) of a symbol: the cpp stage refused the cluster)."""
    def decode_step(x):
        query = x[:, -1:, :] * 0.5
        scores = torch.tanh(query @ x.transpose(1, 2) / 4.0) * 4.0
        return scores.softmax(-1) @ x
    report = compile_dynamic_and_check(Fn(decode_step), [(3, 7, 16), (2, 5, 16), (4, 12, 16), (2, 2, 16)]).report
    assert "aten::matmul" in engine_kinds(report), report.left_out
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, report.left_out


@pytest.mark.parametrize("name, fn", [
    ("view", lambda x: (x.reshape(-1, x.shape[-1]) * 2.0 + 1.0).view(x.shape) - x),   # OPT's MLP
    ("reshape", lambda x: (x.flatten() * 2.0).reshape(x.shape) + x),
    ("expand", lambda x: (x[:, :1] * 2.0).expand(x.shape) + x),
    ("repeat", lambda x: torch.arange(x.shape[1]).unsqueeze(0).repeat(x.shape[0], 1)[..., None] * x),  # Whisper
    ("repeat_new_dim", lambda x: (x[0, :, 0] * 2.0).repeat(x.shape[0], 1)[..., None] + x),
    ("repeat_run_time_dims", lambda x: (x[:1] * 2.0).repeat(x.shape[0], 1, 1) + x.repeat(1, 2, 1)[:, ::2]),
    # DeBERTa's heads: [b, s, h, d] -> [b, h, s, d] -> [b * h, s, d] (two run-time dims no -1 infers) and back
    ("flatten_heads", lambda x: (x.view(x.shape[0], x.shape[1], 4, 4).transpose(1, 2).flatten(0, 1) * 2.0)
     .unflatten(0, (-1, 4)).transpose(1, 2).flatten(2) + x)])
def test_a_view_to_another_tensors_whole_shape_computes_in_an_engine(name, fn):
    """x.view(t.shape) over a run-time batch and sequence: view_as(x, t), the shape read at run time
    (the int list of t.shape stayed in TorchScript, and the view with it)."""
    model, capture = Fn(fn), Capture()
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        for k, shape in enumerate([(3, 7, 16), (2, 5, 16), (4, 12, 16), (2, 24, 16)]):
            x = torch.randn(*shape)
            if k == 0:
                torch._dynamo.mark_dynamic(x, 0, min=2, max=BATCH_MAX)
                torch._dynamo.mark_dynamic(x, 1, min=2, max=SEQ_MAX)
            assert_close(compiled(x), model(x))
    report = capture.report
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, report.left_out


def test_causal_attention_over_a_run_time_length_computes_in_an_engine():
    """sdpa(is_causal=True) (a decoder's prefill without a mask: BART's): the causal mask is built
    from the run-time query and key lengths (it was a constant of the example's: the cluster
    refused run-time sizes)."""
    def causal(x):
        heads = x.view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(heads * 0.5, heads, heads + 1.0, is_causal=True).sum(1)
    report = compile_dynamic_and_check(Fn(causal), [(3, 7, 16), (2, 5, 16), (4, 12, 16), (2, 2, 16)]).report
    assert "aten::scaled_dot_product_attention" in engine_kinds(report), report.left_out
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, report.left_out


@pytest.mark.parametrize("shift", [3, -7, 40])
def test_a_roll_of_the_flattened_tensor_computes_in_an_engine(shift):
    """torch.roll without dims over run-time dims: the element count read at run time, shifts below
    and past it (40 > 1 * 1 * 5)."""
    model, result = compiled(lambda x: torch.roll(x * 2, shift) + 1, BATCH_SEQ)
    report = result.report
    assert "aten::roll" in engine_kinds(report), report.left_out
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, report.left_out
    check_sizes(model, result, SIZES)


@pytest.mark.parametrize("dim, n", [(1, 1), (0, 2), (1, 3)])
def test_diff_over_run_time_dims_computes_in_an_engine(dim, n):
    """torch.diff with a prepend (transformers' packed-sequence check) along a run-time dim, n past
    the dim's size at size 1 (an empty result)."""
    model, result = compiled(lambda x: torch.diff(x * 2, n, dim, prepend=x.narrow(dim, 0, 1) - 1) + 1, BATCH_SEQ)
    report = result.report
    assert "aten::diff" in engine_kinds(report), report.left_out
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, report.left_out
    check_sizes(model, result, SIZES)


EINSUMS = {   # x: [batch, seq, 5]
    "attention_scores": lambda x: torch.einsum("bid,bjd->bij", x, x * 2),
    "projection": lambda x: torch.einsum("bsd,de->bse", x, torch.ones(5, 3)),
    "seq_summed": lambda x: torch.einsum("bsd,bsd->bd", x, x + 1),
    "outer_with_a_broadcast_label": lambda x: torch.einsum("bsd,bte->bstde", x, x[:, :1] * 2),
    "funnel_relative": lambda x: torch.einsum("bnd,jd->bnj", x, torch.arange(15.0).view(3, 5)),
}


@pytest.mark.parametrize("name", sorted(EINSUMS))
def test_einsum_over_run_time_dims_computes_in_an_engine(name):
    """Its reshapes and expands take the run-time labels' sizes read at run time (before: the
    example's sizes baked in, so the ONNX differed at every size and einsum stayed out)."""
    # (dims from 2: dynamo's einsum specializes a size-1 dim, so export refuses a range from 1)
    model, result = compiled(lambda x: EINSUMS[name](x) + 1, BATCH_SEQ, least=2)
    report = result.report
    assert "aten::einsum" in engine_kinds(report), report.left_out
    assert not report.symbolic_refusals, report.left_out
    check_sizes(model, result, [shape for shape in SIZES if min(shape) >= 2])


def test_an_engine_rule_disagreeing_with_onnx_inference_costs_only_its_op(monkeypatch):
    """A deliberately inconsistent engine rule (Relu's IR of another shape than ONNX infers, the
    check blade/engine/ir.py _check_against_inference makes): relu alone stays in TorchScript,
    named with the engine's reason, and the ops around it compute in engines."""
    import numpy as np
    from blade.engine import ir
    monkeypatch.setitem(ir.ONNX_RULES, "Relu", lambda b, attrs, x: [b.const(np.zeros(3, x.dtype))])
    model, result = compiled(lambda x: (x * 2).relu() + 1, BATCH_SEQ)
    report = result.report
    left = [(kind, reason) for kind, reason in report.left_out if kind.startswith("aten::")]
    assert len(left) == 1 and left[0][0] == "aten::relu" and "ONNX infers" in left[0][1], left
    assert {"aten::mul", "aten::add"} <= engine_kinds(report), report.left_out
    check_sizes(model, result, SIZES)


def test_the_onnx_contract_check_names_the_node_it_refuses():
    """check_contract's output mismatch carries the index of the ONNX node whose rule disagrees,
    which blade/dynamic.py maps back to the cluster op it blames."""
    from onnx import TensorProto, helper
    from blade.cluster.lower import check_contract
    from blade.cluster.rules.base import LoweringError
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Transpose", ["a"], ["b"], perm=[1, 0]),
             helper.make_node("Identity", ["b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    with pytest.raises(LoweringError, match="Inferred shape and existing shape differ") as caught:
        check_contract(model)
    assert caught.value.onnx_node == 1
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 3
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 2
    check_contract(model)  # (consistent now)


@pytest.mark.parametrize("name, fn", [
    ("shift_left", lambda x: (x * 2)[:, :-1] + 1),
    ("shift_right", lambda x: (x * 2)[:, 1:] + 1),
    ("inner", lambda x: (x * 2)[:, 1:-1] + 1),
    ("inner_sum", lambda x: (x * 2)[:, 1:-1].sum(1) + 1)])
def test_slices_empty_at_the_smallest_lengths_compute_in_engines(name, fn):
    """A language model's shifted logits x[:, :-1] / x[:, 1:] and x[:, 1:-1] with seq from 1: their
    length s - 1 or max(s - 2, 0) is 0 at the smallest sizes. The engine's row loops take such a
    dim (a divisor max(n, 1) where rows run, and memory order decided where the tensor has
    elements), the Slice's length is max(.., 0), and an output dim may be a max of sizes. Before:
    the memory-order and divisor refusals failed each whole cluster (0 of 4 aten ops in engines),
    x[:, 1:-1] was refused."""
    model, result = compiled(fn, BATCH_SEQ)
    report = result.report
    assert "aten::slice" in engine_kinds(report), report.left_out
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, \
        (report.left_out, report.symbolic_refusals)
    check_sizes(model, result, SIZES + [(3, 2, 5)])


@pytest.mark.parametrize("name, fn", [
    ("every_second", lambda x: (x * 2)[:, ::2] + 1),
    ("every_third_from_1", lambda x: (x * 2)[:, 1::3] + 1),
    ("every_second_sum", lambda x: (x * 2)[:, ::2].sum(1) + 1)])
def test_stepped_slices_along_a_run_time_dim_compute_in_engines(name, fn):
    """x[:, ::2] and x[:, 1::3] with seq from 1: ceil(max(s - start, 0) / step) elements, a stepped
    view (before: 'Slice with step 2 along a run-time dim', the slice in TorchScript)."""
    model, result = compiled(fn, BATCH_SEQ)
    report = result.report
    assert "aten::slice" in engine_kinds(report), report.left_out
    assert report.aten_in_engines == report.aten_total and not report.symbolic_refusals, \
        (report.left_out, report.symbolic_refusals)
    check_sizes(model, result, SIZES + [(3, 2, 5), (2, 4, 5)])
