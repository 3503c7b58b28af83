"""The composite table: small hand-written graphs, keyed by the lowering-table kind each must put
in an engine. The sweep's second case source, after OpInfo (opinfo_sweep.py runs both).

OpInfo's one-op graphs leave some kinds without an engine case: a view op alone returns a view
of its graph input, which rightly stays in TorchScript (cluster/aliasing.py); OpInfo's wrappers
reach the frontend as other aten spellings (F.pad is aten::pad, never aten::reflection_pad2d) or
with arguments the rule refuses (max_pool with return_indices, adaptive pools to sizes that do
not divide, training-mode norms); OpInfo's bitwise samples lack Python-scalar operands. Here each kind gets a graph in which an engine must compute it (a view feeds
a consumer inside the graph), over the dtypes it applies to, with edge shapes: empty tensors,
size-1 dims, non-contiguous inputs, negative dims. A case that matches eager while its kind stays
in TorchScript is recorded as "refused", with blade's reason: a failure, not a pass.

The cases look like OpInfos to the sweep (name, variant_test_name, op, supported_dtypes,
sample_inputs), so opinfo_sweep.run_case compiles and compares them unchanged. A sample is an
argument tuple: its tensors become graph inputs, everything else is a constant of the graph.
Adding a kind: one Composite(...) entry in COMPOSITE_CASES.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.testing._internal.opinfo.core import SampleInput

from .opinfo_sweep import DTYPES

ALL = ("f32", "f64", "i32", "i64", "bool")
NUMBERS = ("f32", "f64", "i32", "i64")
FLOATS = ("f32", "f64")
aten = torch.ops.aten


@dataclass(frozen=True)
class Composite:
    kind: str                  # the lowering-table kind an engine must compute, e.g. "aten::permute"
    fn: Callable               # fn(*sample): the graph
    samples: Callable          # dtype -> list of argument tuples
    dtypes: tuple = ALL
    variant: str = ""          # tells apart several cases of one kind

    @property
    def engine_kind(self) -> str:
        return self.kind

    @property
    def name(self) -> str:
        return "composite:" + self.kind.split("::")[1]

    @property
    def variant_test_name(self) -> str:
        return self.variant

    @property
    def op(self) -> Callable:
        return self.fn

    def supported_dtypes(self, device: str) -> set:
        return {DTYPES[d] for d in self.dtypes}

    def sample_inputs(self, device: str, dtype: torch.dtype, requires_grad: bool = False) -> list:
        return [SampleInput(args[0], args=tuple(args[1:])) for args in self.samples(dtype)]

    reference_inputs = sample_inputs  # no edge values beyond the samples: --inputs reference adds none


# ---- inputs ----

def make(shape, dtype: torch.dtype, *, positive: bool = False, noncontig: bool = False) -> torch.Tensor:
    """A tensor of `shape`; noncontig: the same values seen through reversed strides (a dense
    transposed layout, which the sweep's input copies keep)."""
    if noncontig:
        return make(tuple(reversed(shape)), dtype, positive=positive).permute(*reversed(range(len(shape))))
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.rand(shape, dtype=dtype) + 0.5 if positive else torch.randn(shape, dtype=dtype) * 3
    return torch.randint(1 if positive else -9, 10, shape, dtype=dtype)


def channels_last(shape, dtype: torch.dtype) -> torch.Tensor:
    return make(shape, dtype).contiguous(memory_format=torch.channels_last)


def consume(value):
    """A consumer inside the graph, so a view is computed by the engine rather than returned."""
    if isinstance(value, (list, tuple)):
        return tuple(consume(v) for v in value)
    return value.logical_not() if value.dtype == torch.bool else value * 2


def _transposed_conv(spatial: int, c_in: int, c_out: int, kernel, stride, padding, output_padding, groups, dilation):
    torch.manual_seed(spatial * 100 + c_in * 10 + c_out)
    conv = (None, torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)[spatial](
        c_in, c_out, kernel, stride, padding, output_padding, groups, True, dilation).eval()
    return lambda x: conv(x) * 1.0   # a consumer, so the engine computes the convolution


# name -> a transposed convolution module with fixed weights: (spatial, c_in, c_out, kernel, stride,
# padding, output_padding, groups, dilation); upsampling hops, phases with no tap, output padding,
# groups, dilation, uneven strides
_TRANSPOSED = {name: _transposed_conv(*spec) for name, spec in {
    "hop-8": (1, 4, 6, 16, 8, 4, 0, 1, 1), "odd-kernel-groups": (1, 4, 6, 3, 2, 1, 1, 2, 1),
    "dilated": (1, 3, 5, 4, 1, 0, 0, 1, 2), "2x2-stride-2": (2, 8, 4, 2, 2, 0, 0, 1, 1),
    "4x4-stride-2": (2, 8, 4, 4, 2, 1, 0, 1, 1), "groups-output-padding": (2, 6, 9, 3, 2, 1, 1, 3, 1),
    "uneven": (2, 4, 4, (3, 5), (2, 3), (1, 2), (1, 0), 1, (2, 1)), "gaps": (2, 4, 4, 3, 3, 0, 2, 1, 1),
    "3d": (3, 4, 2, 2, 2, 0, 0, 1, 1)}.items()}
_TRANSPOSED_SAMPLES = {
    "aten::conv_transpose1d": [("hop-8", (2, 4, 7)), ("odd-kernel-groups", (2, 4, 9)), ("odd-kernel-groups", (4, 9)),
                               ("dilated", (1, 3, 6))],
    "aten::conv_transpose2d": [("2x2-stride-2", (2, 8, 5, 5)), ("4x4-stride-2", (1, 8, 6, 6)),
                               ("groups-output-padding", (2, 6, 5, 5)), ("uneven", (4, 5, 4)), ("gaps", (1, 4, 4, 4)),
                               ("4x4-stride-2", (1, 8, 1, 1))],
    "aten::conv_transpose3d": [("3d", (2, 4, 3, 3, 3))],
}

def viewed(view: Callable) -> Callable:
    return lambda *args: consume(view(*args))


def _other_dtype(dtype: torch.dtype) -> torch.dtype:
    """A dtype to cast to: type_as to the same dtype returns its input (an alias, no engine)."""
    return torch.int64 if dtype == torch.float32 else torch.float32


def _attention_mask(dtype: torch.dtype, as_bool: bool) -> torch.Tensor:
    keep = torch.rand(4, 6) > 0.4
    keep[:, 0] = True
    keep[2] = False          # a query that attends to nothing
    return keep if as_bool else torch.zeros(4, 6, dtype=dtype).masked_fill(~keep, -math.inf)


# ---- the table ----

def _conv_samples(dt):
    return [
        (make((2, 4, 9, 9), dt), make((6, 4, 3, 3), dt), make((6,), dt), [1, 1], [0, 0], [1, 1], 1),
        (make((1, 4, 9, 9), dt), make((6, 2, 3, 3), dt), None, [2, 2], [1, 1], [2, 2], 2),
        (make((2, 4, 10), dt), make((3, 4, 3), dt), make((3,), dt), [1], [2], [1], 1),
        (channels_last((2, 4, 6, 7), dt), make((5, 4, 1, 3), dt), make((5,), dt), [1, 2], [0, 1], [1, 1], 1),
        (make((0, 4, 5, 5), dt), make((2, 4, 3, 3), dt), None, [1, 1], [0, 0], [1, 1], 1),
    ]


def _conv_activation_samples(dt):
    """(x, weight, bias, stride, padding, groups) for an activation that is its convolution's
    epilogue (plan.Activation): NCHW and channels-last inputs, a 1x1, a strided depthwise one, and
    NaN and infinities in the input."""
    edges = make((1, 8, 7, 7), dt)
    edges[0, 1, 2, 3], edges[0, 5, 0, 0], edges[0, 6, 6, 6] = math.nan, math.inf, -math.inf
    return [
        (make((2, 4, 9, 9), dt), make((6, 4, 3, 3), dt), make((6,), dt), 1, 1, 1),
        (channels_last((1, 16, 10, 10), dt), make((40, 16, 1, 1), dt), make((40,), dt), 1, 0, 1),
        (channels_last((1, 16, 11, 10), dt), make((16, 1, 3, 3), dt), make((16,), dt), 2, 1, 16),
        (edges, make((8, 8, 1, 1), dt), None, 1, 0, 1),
    ]


def _conv_epilogue(activation):
    return lambda x, w, b, stride, padding, groups: activation(F.conv2d(x, w, b, stride, padding, 1, groups))


def _pad_samples(spatial: int, reflect: bool):
    def samples(dt):
        lead = (2, 3) + (5,) * (spatial - 1)
        out = [(make(lead + (6,), dt), [1, 2] * spatial),
               (make(lead[1:] + (6,), dt), [2, 0] * spatial),                 # unbatched
               (make(lead + (6,), dt, noncontig=True), [0, 1] * spatial)]
        if not reflect:
            out.append((make(lead + (1,), dt), [2, 3] * spatial))             # a size-1 dim, replicated
        return out
    return samples


def _mha_detached_mask(x, scores):
    """x.detach() survives freezing only where the graph compares tensors with ``is`` (torch's
    EliminateNoOps then skips the graph): F.multi_head_attention_forward does, so the mask's
    detach reaches the partitioner here. The diagonal is never masked (no fully masked row)."""
    length, embed = x.shape[0], x.shape[-1]
    weight = torch.linspace(-0.5, 0.5, 3 * embed * embed, dtype=x.dtype).reshape(3 * embed, embed)
    mask = (scores > 0).detach() & ~torch.eye(length, dtype=torch.bool)
    return F.multi_head_attention_forward(x, x, x, embed, 2, weight, None, None, None, False, 0.0,
                                          weight[:embed], None, training=False, need_weights=False,
                                          attn_mask=mask)[0]


def _split_samples(dt):
    return [(make((4, 8), dt), 3, 1), (make((4, 8), dt), [3, 5], -1), (make((4, 8), dt), 8, 1),
            (make((0, 4), dt), 2, 0), (make((4, 6), dt, noncontig=True), 4, -2)]


def _arg_reduction_samples(dt):
    """argmax/argmin: ties (the first index wins), NaN (the first NaN wins), dim None, keepdim."""
    ties = torch.tensor([[1, 3, 3, 0], [2, 2, 2, 2], [0, -1, 5, 5]]).to(dt)
    samples = [(make((3, 5), dt), 1, False), (make((3, 5), dt), None, False), (make((2, 3, 4), dt), -2, True),
               (make((2, 3, 4), dt), None, True), (ties, 1, False), (ties, 0, True),
               (make((1, 6), dt), 0, False), (make((4, 3), dt, noncontig=True), 1, False)]
    if dt.is_floating_point:
        nans = torch.tensor([[1.0, math.nan, 3.0, math.nan], [-math.inf, 2.0, math.inf, 0.0]]).to(dt)
        samples += [(nans, 1, False), (nans, None, False), (nans, 0, True)]
    return samples


COMPOSITE_CASES = [
    # views and data movement, each feeding a consumer
    Composite("aten::permute", viewed(lambda x, dims: x.permute(dims)), lambda dt: [
        (make((2, 3, 4), dt), (2, 0, 1)), (make((2, 3, 4), dt), (-1, -3, -2)), (make((1, 3, 1), dt), (2, 1, 0)),
        (make((0, 3, 2), dt), (1, 0, 2)), (make((2, 3, 4), dt, noncontig=True), (1, 2, 0)), (make((), dt), ())]),
    Composite("aten::transpose", viewed(lambda x, a, b: x.transpose(a, b)), lambda dt: [
        (make((2, 3, 4), dt), 0, 2), (make((2, 3, 4), dt), -1, -2), (make((5,), dt), 0, 0),
        (make((1, 3, 1), dt), 0, 2), (make((0, 2, 3), dt), 0, 1), (make((3, 4), dt, noncontig=True), 0, 1)]),
    Composite("aten::t", viewed(lambda x: x.t()), lambda dt: [
        (make((3, 4), dt),), (make((5,), dt),), (make((), dt),), (make((0, 3), dt),),
        (make((4, 3), dt, noncontig=True),)]),
    Composite("aten::expand", viewed(lambda x, sizes: x.expand(*sizes)), lambda dt: [
        (make((3, 1), dt), (3, 4)), (make((1,), dt), (2, 3, 4)), (make((3, 1), dt), (-1, 5)),
        (make((0, 1), dt), (0, 4)), (make((2, 1, 3), dt), (2, 0, 3)), (make((4, 1, 3), dt, noncontig=True), (4, 2, 3))]),
    Composite("aten::flatten", viewed(lambda x, start, end: torch.flatten(x, start, end)), lambda dt: [
        (make((2, 3, 4), dt), 1, -1), (make((2, 3, 4), dt), 0, 1), (make((0, 3, 4), dt), 0, -1),
        (make((3, 4, 2), dt, noncontig=True), 0, -1), (make((), dt), 0, -1), (make((5,), dt), 0, 0)]),
    Composite("aten::unflatten", viewed(lambda x, dim, sizes: x.unflatten(dim, sizes)), lambda dt: [
        (make((2, 12), dt), 1, (3, 4)), (make((2, 12), dt), -1, (-1, 2)), (make((6, 2), dt), 0, (1, 6)),
        (make((0, 4), dt), 1, (2, 2)), (make((4, 6), dt, noncontig=True), 1, (2, 3))]),
    Composite("aten::view_as", viewed(lambda x, y: x.view_as(y)), lambda dt: [
        (make((2, 3, 4), dt), make((6, 4), dt)), (make((1, 5), dt), make((5,), dt)),
        (make((0, 3), dt), make((3, 0), dt)), (make((4,), dt), make((1, 4, 1), dt))]),
    Composite("aten::reshape_as", viewed(lambda x, y: x.reshape_as(y)), lambda dt: [
        (make((2, 3, 4), dt), make((6, 4), dt)), (make((3, 4), dt, noncontig=True), make((2, 6), dt)),
        (make((0, 3), dt), make((3, 0), dt)), (make((4,), dt), make((1, 4, 1), dt))]),
    Composite("aten::contiguous", viewed(lambda x: x.contiguous()), lambda dt: [
        (make((3, 4), dt, noncontig=True),), (make((3, 4), dt),), (make((2, 3, 4), dt, noncontig=True),),
        (make((0, 3), dt, noncontig=True),)]),
    Composite("aten::detach", _mha_detached_mask, lambda dt: [
        (make((5, 2, 4), dt), make((5, 5), dt)), (make((3, 1, 8), dt), make((3, 3), dt))], FLOATS),
    Composite("aten::narrow", viewed(lambda x, dim, start, length: x.narrow(dim, start, length)), lambda dt: [
        (make((4, 6), dt), 1, 2, 3), (make((4, 6), dt), -1, -4, 2), (make((4, 6), dt), 0, 1, 0),
        (make((1, 6), dt), 0, 0, 1), (make((4, 6), dt, noncontig=True), 0, 1, 2)]),
    Composite("aten::unfold", viewed(lambda x, dim, size, step: x.unfold(dim, size, step)), lambda dt: [
        (make((2, 11), dt), 1, 3, 1), (make((2, 5, 11), dt), 1, 2, 2), (make((3, 17), dt), -1, 4, 6),
        (make((1, 38), dt), 1, 10, 8), (make((7,), dt), 0, 7, 1), (make((4, 3), dt), 0, 4, 1),
        (make((4, 9, 6), dt, noncontig=True), 0, 2, 1)]),
    Composite("aten::select", viewed(lambda x, dim, index: x.select(dim, index)), lambda dt: [
        (make((3, 4), dt), 0, 1), (make((3, 4), dt), -1, -1), (make((1, 5), dt), 0, 0),
        (make((2, 3, 4), dt), 1, -3), (make((0, 3), dt), 1, 2), (make((3, 4), dt, noncontig=True), 1, 2)]),
    Composite("aten::slice", viewed(lambda x, index: x[index]), lambda dt: [
        (make((4, 6), dt), (slice(None), slice(1, None, 2))), (make((4, 6), dt), (Ellipsis, slice(-3, -1))),
        (make((4, 6), dt), (slice(2, 2),)), (make((4, 6), dt), (slice(1, 100),)),
        (make((4, 6), dt, noncontig=True), (slice(None), slice(None, None, 4)))]),
    Composite("aten::split", viewed(lambda x, size, dim: x.split(size, dim)), _split_samples),
    Composite("aten::split_with_sizes", viewed(lambda x, sizes, dim: x.split_with_sizes(sizes, dim)), lambda dt: [
        (make((4, 8), dt), [3, 5], 1), (make((4, 8), dt), [0, 8], -1), (make((6, 2), dt), [1, 2, 3], 0),
        (make((4, 6), dt, noncontig=True), [2, 2], 0)]),
    Composite("aten::chunk", viewed(lambda x, n, dim: x.chunk(n, dim)), lambda dt: [
        (make((4, 8), dt), 3, 1), (make((4, 8), dt), 5, -1), (make((4, 8), dt), 1, 0), (make((0, 4), dt), 2, 0),
        (make((4, 3), dt), 4, 1), (make((6, 4), dt, noncontig=True), 2, 0)]),
    # F.fold of windows that do not overlap (stride = kernel): blocks back into an image; padding
    # crops it, rows and columns no window reaches are 0; unbatched too (OpInfo has no fold)
    Composite("aten::col2im", viewed(lambda x, size, kernel, padding: F.fold(x, size, kernel, padding=padding,
                                                                           stride=kernel)), lambda dt: [
        (make((2, 12, 6), dt), (4, 6), (2, 2), 0), (make((1, 8, 6), dt), (5, 7), (2, 2), 0),
        (make((1, 6, 16), dt), (6, 6), (1, 3), (1, 0)), (make((12, 6), dt), (4, 6), (2, 2), 0),
        (make((2, 12, 6), dt, noncontig=True), (4, 6), (2, 2), 0)], ("f32", "f64", "bool")),
    Composite("aten::unbind", viewed(lambda x, dim: x.unbind(dim)), lambda dt: [
        (make((3, 4), dt), 0), (make((3, 4), dt), -1), (make((1, 5), dt), 0), (make((2, 0), dt), 0),
        (make((3, 4), dt, noncontig=True), 1)]),
    Composite("aten::index_select", lambda x, dim, index: torch.index_select(x, dim, index), lambda dt: [
        (make((4, 5), dt), 0, torch.tensor([3, 0, 3])), (make((4, 5), dt), -1, torch.tensor([4, 1], dtype=torch.int32)),
        (make((4, 5), dt), 1, torch.tensor([], dtype=torch.int64)), (make((5,), dt), 0, torch.tensor([2])),
        (make((), dt), 0, torch.tensor([0])), (make((4, 5), dt, noncontig=True), 1, torch.tensor([0, 4]))]),
    # casts and arithmetic in spellings OpInfo's samples do not produce
    Composite("aten::type_as", lambda x, y: x.type_as(y), lambda dt: [
        (make((3, 4), dt), make((), _other_dtype(dt))), (make((0,), dt), make((2,), _other_dtype(dt))),
        (make((), dt), make((1,), _other_dtype(dt))), (make((3, 4), dt, noncontig=True), make((), _other_dtype(dt)))]),
    # (torch.rsub of two tensors is aten::sub after TorchScript's normalization; a scalar keeps rsub)
    Composite("aten::rsub", lambda x, other, alpha: torch.rsub(x, other, alpha=alpha), lambda dt: [
        (make((3, 4), dt), 2, 1), (make((3, 4), dt), 2.5, 1), (make((3, 4), dt), 5, 3), (make((0,), dt), 1, 1),
        (make((), dt), -3, 2), (make((3, 4), dt, noncontig=True), 7, -1)], NUMBERS),
    # bitwise ops on bools and integers, with tensors and with scalars. With a Python bool, TorchScript
    # computes `x & 1` (it has no bool Scalar) in int64, and the frontend casts the result back to
    # eager's bool.
    *[Composite(kind, fn, samples, dtypes, variant)
      for kind, fn in (("aten::__and__", lambda x, y: x & y), ("aten::__or__", lambda x, y: x | y),
                       ("aten::__xor__", lambda x, y: x ^ y), ("aten::bitwise_and", torch.bitwise_and),
                       ("aten::bitwise_or", torch.bitwise_or), ("aten::bitwise_xor", torch.bitwise_xor))
      for variant, samples, dtypes in (
          ("", lambda dt: [
              (make((3, 4), dt), make((3, 4), dt)), (make((3, 1), dt), make((4,), dt)), (make((0, 4), dt), make((4,), dt)),
              (make((3, 4), dt, noncontig=True), make((3, 4), dt))], ("i32", "i64", "bool")),
          ("scalar", lambda dt: [(make((3, 4), dt), True), (make((3, 4), dt), False)], ("bool",)),
          ("int_scalar", lambda dt: [(make((3, 4), dt), 6), (make((3, 4), dt), -1)], ("i32", "i64")))],
    # integer remainders (floats stay in TorchScript): divisors of both signs, never zero (eager raises)
    *[Composite(kind, fn, lambda dt: [
        (make((3, 4), dt), make((3, 4), dt, positive=True)), (make((3, 4), dt), -make((3, 4), dt, positive=True)),
        (make((3, 1), dt), make((4,), dt, positive=True)), (make((0, 4), dt), make((4,), dt, positive=True)),
        (make((3, 4), dt, noncontig=True), make((3, 4), dt, positive=True)), (make((3, 4), dt), 7),
        (make((3, 4), dt), -3)], ("i32", "i64")) for kind, fn in (("aten::remainder", torch.remainder),
                                                                   ("aten::fmod", torch.fmod))],
    Composite("aten::bitwise_not", lambda x: ~x, lambda dt: [
        (make((3, 4), dt),), (make((0,), dt),), (make((), dt),), (make((3, 4), dt, noncontig=True),)],
        ("i32", "i64", "bool")),
    # reductions and normalizations
    *[Composite(kind, fn, _arg_reduction_samples, NUMBERS) for kind, fn in (
        ("aten::argmax", lambda x, dim, keep: torch.argmax(x, dim, keep)),
        ("aten::argmin", lambda x, dim, keep: torch.argmin(x, dim, keep)))],
    Composite("aten::linalg_vector_norm", lambda x, order, dim, keep: torch.linalg.vector_norm(x, order, dim, keep),
              lambda dt: [(make((3, 4), dt), 2, None, False), (make((3, 4), dt), 1, -1, True),
                          (make((2, 3, 4), dt), math.inf, (0, -1), False), (make((0, 4), dt), 2, None, False),
                          (make((5,), dt), 2, 0, False), (make((3, 4), dt, noncontig=True), 2, 0, True)], FLOATS),
    Composite("aten::batch_norm", lambda x, mean, var, w, b, eps: F.batch_norm(x, mean, var, w, b, False, 0.1, eps),
              lambda dt: [(make(shape, dt), make((3,), dt), make((3,), dt, positive=True), w, b, eps)
                          for shape, w, b, eps in (((4, 3), make((3,), dt), make((3,), dt), 1e-5),
                                                   ((2, 3, 5), None, None, 1e-3),
                                                   ((1, 3, 4, 4), make((3,), dt), None, 1e-5),
                                                   ((0, 3, 4), None, make((3,), dt), 1e-5))], FLOATS),
    Composite("aten::instance_norm", lambda x, w, b, eps: F.instance_norm(x, weight=w, bias=b, eps=eps), lambda dt: [
        (make((2, 3, 5), dt), make((3,), dt), make((3,), dt), 1e-5), (make((2, 3, 4, 4), dt), None, None, 1e-3),
        (make((1, 2, 1, 5), dt), make((2,), dt), None, 1e-5),
        (channels_last((2, 3, 4, 5), dt), None, make((3,), dt), 1e-5)], FLOATS),
    # convolution: the generic spellings, as torch.convolution / torch._convolution calls produce them
    Composite("aten::convolution", lambda x, w, b, stride, pad, dil, groups: torch.convolution(
        x, w, b, stride, pad, dil, False, [0] * len(stride), groups), _conv_samples, ("f32",)),
    Composite("aten::_convolution", lambda x, w, b, stride, pad, dil, groups: torch._convolution(
        x, w, b, stride, pad, dil, False, [0] * len(stride), groups, False, False, True, True), _conv_samples, ("f32",)),
    # transposed convolutions: their weight a constant of the graph (the rule regroups its taps at
    # compile time), not an argument
    *(Composite(kind, lambda x, spec: _TRANSPOSED[spec](x), lambda dt, specs=specs: [(make(shape, dt), spec) for spec, shape in specs],
                ("f32",)) for kind, specs in _TRANSPOSED_SAMPLES.items()),
    # activations a convolution computes in its own output pass (SiLU also after a residual sum)
    Composite("aten::silu", _conv_epilogue(F.silu), _conv_activation_samples, ("f32",), "conv-epilogue"),
    Composite("aten::silu", lambda x, w, b: F.silu(F.conv2d(x, w, b, padding=1) + x), lambda dt: [
        (channels_last((1, 8, 6, 7), dt), make((8, 8, 3, 3), dt), make((8,), dt)),
        (make((2, 8, 5, 5), dt), make((8, 8, 3, 3), dt), None)], ("f32",), "conv-residual-epilogue"),
    Composite("aten::relu", _conv_epilogue(F.relu), _conv_activation_samples, ("f32",), "conv-epilogue"),
    Composite("aten::hardtanh", _conv_epilogue(lambda t: F.hardtanh(t, 0.0, 6.0)), _conv_activation_samples, ("f32",),
              "conv-epilogue"),
    # pooling, padding, resampling: the kinds OpInfo's wrappers do not spell
    Composite("aten::max_pool1d", lambda x, k, s, p, d, ceil: F.max_pool1d(x, k, s, p, d, ceil_mode=ceil), lambda dt: [
        (make((2, 3, 9), dt), 2, None, 0, 1, False), (make((2, 3, 9), dt), 3, 2, 1, 1, True),
        (make((2, 3, 10), dt), 2, 1, 0, 2, False), (make((3, 9), dt), 2, None, 0, 1, False),
        (make((2, 3, 9), dt, noncontig=True), 3, 3, 1, 1, False)], FLOATS),
    Composite("aten::max_pool2d", lambda x, k, s, p, d, ceil: F.max_pool2d(x, k, s, p, d, ceil_mode=ceil), lambda dt: [
        (make((2, 3, 8, 6), dt), 2, None, 0, 1, False), (make((1, 3, 7, 7), dt), 3, 2, 1, 1, True),
        (make((1, 2, 9, 9), dt), (3, 2), (2, 1), (1, 0), 2, False), (make((3, 8, 6), dt), 2, None, 0, 1, False),
        (channels_last((2, 3, 6, 6), dt), 2, 2, 1, 1, False)], NUMBERS),
    Composite("aten::adaptive_avg_pool1d", F.adaptive_avg_pool1d, lambda dt: [
        (make((2, 3, 8), dt), 4), (make((2, 3, 8), dt), 1), (make((2, 3, 8), dt), 8), (make((3, 8), dt), 2),
        (make((2, 3, 8), dt, noncontig=True), 2)], FLOATS),
    Composite("aten::adaptive_avg_pool2d", F.adaptive_avg_pool2d, lambda dt: [
        (make((2, 3, 8, 6), dt), (4, 3)), (make((2, 3, 8, 6), dt), 1), (make((1, 3, 8, 6), dt), (None, 2)),
        (make((3, 8, 6), dt), (2, 3)), (channels_last((2, 3, 4, 4), dt), 2)], FLOATS),
    Composite("aten::reflection_pad1d", aten.reflection_pad1d, _pad_samples(1, reflect=True), NUMBERS),
    Composite("aten::reflection_pad2d", aten.reflection_pad2d, _pad_samples(2, reflect=True), NUMBERS),
    Composite("aten::replication_pad1d", aten.replication_pad1d, _pad_samples(1, reflect=False), NUMBERS),
    Composite("aten::replication_pad2d", aten.replication_pad2d, _pad_samples(2, reflect=False), NUMBERS),
    Composite("aten::upsample_nearest2d", lambda x, size, scale: F.interpolate(x, size, scale, mode="nearest"),
              lambda dt: [(make((2, 3, 4, 5), dt), None, 2.0), (make((2, 3, 4, 5), dt), (7, 3), None),
                          (make((1, 2, 6, 6), dt), None, (1.5, 0.5)), (make((1, 1, 1, 1), dt), (3, 3), None),
                          (channels_last((2, 3, 4, 4), dt), (8, 8), None)], FLOATS),
    # attention, called directly (OpInfo's wrapper breaks dynamo's graph)
    Composite("aten::scaled_dot_product_attention",
              lambda q, k, v, mask, causal, scale: F.scaled_dot_product_attention(
                  q, k, v, attn_mask=mask, is_causal=causal, scale=scale),
              lambda dt: [(make((2, 4, 8), dt), make((2, 4, 8), dt), make((2, 4, 8), dt), None, False, None),
                          (make((1, 2, 4, 8), dt), make((1, 2, 6, 8), dt), make((1, 2, 6, 8), dt),
                           _attention_mask(dt, True), False, None),
                          (make((2, 4, 8), dt), make((2, 6, 8), dt), make((2, 6, 5), dt),
                           _attention_mask(dt, False), False, 0.3),
                          (make((1, 2, 5, 8), dt), make((1, 2, 5, 8), dt), make((1, 2, 5, 8), dt), None, True, None),
                          (make((2, 8, 4), dt, noncontig=True).transpose(1, 2), make((2, 4, 8), dt),
                           make((2, 4, 8), dt), None, False, None)], FLOATS),
]
