"""Edge-value batches for every elementwise and reduction rule of the lowering table.

The op list comes from ``support.LOWERING``: a rule made by one of the generic rule factories
(``unary``, ``binary``, ``compare``, ``_activation``, ``reduce``) is called through
``torch.ops.aten.<name>`` without any entry here, so a new rule of those kinds is covered as soon as
it exists. Every other rule is either in ``CALLS`` (how to call it) or in ``NOT_EDGE_TESTED`` (with
why); ``uncovered_rules`` names any that is in neither.

Inputs: random values plus NaN, +-inf, +-0, subnormals, FLT_MIN/FLT_MAX, the overflow and underflow
edges of exp, huge and tiny magnitudes (and int min/max, zero and negative divisors for integers),
in a length (4099) that leaves a scalar tail after the 16-wide vector body, with specials in the
tail too. Binary ops see every pair of specials. The ops of one batch are stacked into one output,
so the whole batch is one cluster: one compile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from blade.cluster.support import LOWERING

LENGTH = 4099                 # 256 vectors of 16 floats + a 3-element scalar tail
ROWS = 10                     # rows of the reduction inputs

FLOAT_SPECIALS = [
    math.nan, math.inf, -math.inf, 0.0, -0.0, 1.4e-45, -1.4e-45, 1e-40, -1e-40, 1.1754944e-38, -1.1754944e-38,
    3.4028235e38, -3.4028235e38, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0, -3.0, 2.5, -2.5, 88.72, 88.73, -87.34,
    -103.9, -104.0, 1e10, -1e10, 1e-10, -1e-10, 1e30, -1e30, 20.0, -20.0, 1e5, 1.5707964, 3.1415927, 16777216.0,
    0.1, 9.1, -0.625,
]
INT_SPECIALS = {
    torch.int64: [0, 1, -1, 2, -2, 3, -3, 7, -7, 100, -100, 2**31 - 1, -2**31, 2**62, -2**62, 2**63 - 1, -2**63],
    torch.int32: [0, 1, -1, 2, -2, 3, -3, 7, -7, 100, -100, 2**30, 65536, 2**31 - 1, -2**31],
}


# ---- inputs ----

def _fill(specials: list, dtype, generator) -> torch.Tensor:
    """LENGTH values: the specials first, random values after, the specials again in the tail."""
    if dtype.is_floating_point:
        rest = torch.randn(LENGTH, generator=generator, dtype=torch.float64) * 3
    elif dtype == torch.bool:
        rest = torch.rand(LENGTH, generator=generator) < 0.5
    else:
        rest = torch.randint(-1000, 1000, (LENGTH,), generator=generator)
    values = rest.to(dtype)
    head = torch.tensor(specials, dtype=dtype)
    values[:len(head)] = head
    tail = head[: min(len(head), 3)]
    values[LENGTH - len(tail):] = tail
    return values


def specials_of(dtype) -> list:
    if dtype.is_floating_point:
        return FLOAT_SPECIALS
    return [False, True] if dtype == torch.bool else INT_SPECIALS[dtype]


def unary_inputs(dtype, seed=0) -> list:
    return [_fill(specials_of(dtype), dtype, torch.Generator().manual_seed(seed))]


def binary_inputs(dtype, seed=0) -> list:
    """x, y with every pair of specials (a cross product), then random values."""
    s = specials_of(dtype)
    pairs = [(a, b) for a in s for b in s][:LENGTH - 3]
    generator = torch.Generator().manual_seed(seed)
    x, y = _fill([a for a, _ in pairs], dtype, generator), _fill([b for _, b in pairs], dtype, generator)
    y[LENGTH - 3:] = torch.tensor((s * 3)[-3:], dtype=dtype)   # the tail sees other pairs than the head
    return [x, y]


def reduction_inputs(dtype, seed=0) -> list:
    """[ROWS, LENGTH]: random rows, and rows holding NaN (in the tail), +inf, +inf and -inf, only
    -inf, FLT_MAX, only zeros of both signs, only subnormals, only huge values (a sum overflows in
    any order). Values stay near 1 in magnitude so that products stay finite in any order."""
    generator = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        if dtype == torch.bool:
            x = torch.rand(ROWS, LENGTH, generator=generator) < 0.5
            x[1], x[2] = True, False
            return [x]
        x = torch.randint(-3, 4, (ROWS, LENGTH), generator=generator).to(dtype)
        info = torch.iinfo(dtype)
        x[1, -1], x[2, 5], x[3] = info.max, info.min, 0
        return [x]
    signs = torch.sign(torch.randn(ROWS, LENGTH, generator=generator))
    x = (1 + 0.001 * torch.randn(ROWS, LENGTH, generator=generator)) * signs
    x[1, -2] = math.nan
    x[2, 7] = math.inf
    x[3, 100], x[3, -1] = math.inf, -math.inf
    x[4] = -math.inf
    x[5, 3] = torch.finfo(torch.float32).max
    x[6] = 0.0
    x[6, ::3] = -0.0
    x[7] = 1e-40
    x[8] = 1e38
    return [x.to(dtype)]


# ---- how each rule is called ----

@dataclass(frozen=True)
class Call:
    family: str                     # "unary" | "binary" | "reduction" | "select"
    fn: Callable                    # (*inputs) -> tensor


def _aten(kind: str):
    return getattr(torch.ops.aten, kind.split("::")[1])


def _auto_call(kind: str) -> list:
    """Calls for rules made by the generic factories (torch.ops.aten.<name> with its defaults)."""
    factory = LOWERING[kind].lower.__qualname__.split(".")[0]
    op = _aten(kind)
    if factory in ("unary", "_activation", "rounding"):
        return [Call("unary", lambda x: op(x))]
    if factory in ("binary", "compare"):   # and with a Python scalar (a constant, type promotion)
        return [Call("binary", lambda x, y: op(x, y)), Call("unary", lambda x: op(x, 2.5))]
    if factory == "bitwise":   # integers and bools (eager raises for floats); a scalar keeps its int
        return ([Call("unary", lambda x: op(x))] if kind == "aten::bitwise_not" else
                [Call("binary", lambda x, y: op(x, y)), Call("unary", lambda x: op(x, 6))])
    if factory == "reduce":
        # along the rows (a vector loop), across them (the window form: 10 rows, 4099 long) and all
        return [Call("reduction", lambda x: op(x, 1)), Call("reduction", lambda x: op(x, 0)),
                Call("reduction", lambda x: op(x))]
    return []


BN_STATS = [torch.linspace(-1, 1, ROWS), torch.linspace(0.5, 2, ROWS), torch.linspace(2, 0.5, ROWS),
            torch.linspace(-0.5, 0.5, ROWS)]   # mean, var, weight, bias per channel (a row)

CALLS = {
    "aten::div": [Call("binary", lambda x, y: torch.div(x, y)),
                  Call("binary", lambda x, y: torch.div(x, y, rounding_mode="floor")),
                  Call("binary", lambda x, y: torch.div(x, y, rounding_mode="trunc"))],
    **{kind: [Call("binary", lambda x, y, op=op: op(x, y)), Call("unary", lambda x, op=op: op(x, 7))]
       for kind, op in (("aten::remainder", torch.remainder), ("aten::fmod", torch.fmod))},
    "aten::pow": [Call("binary", lambda x, y: torch.pow(x, y)),
                  Call("unary", lambda x: torch.pow(x, 2.5)),      # the general pow
                  Call("unary", lambda x: torch.pow(x, 3)),        # multiplies
                  Call("unary", lambda x: torch.pow(x, -2)),       # a reciprocal of multiplies
                  Call("unary", lambda x: torch.pow(x, 0.5)),      # sqrt
                  Call("unary", lambda x: torch.pow(2.0, x))],     # a scalar base
    "aten::gelu": [Call("unary", lambda x: F.gelu(x)), Call("unary", lambda x: F.gelu(x, approximate="tanh"))],
    "aten::clamp": [Call("unary", lambda x: torch.clamp(x, -2, 3)), Call("binary", lambda x, y: torch.clamp(x, y, y + 1))],
    "aten::sign": [Call("unary", lambda x: torch.sign(x))],
    "aten::sgn": [Call("unary", lambda x: torch.sgn(x))],
    "aten::diff": [Call("unary", lambda x: torch.diff(x)), Call("binary", lambda x, y: torch.diff(x, 2, 0, prepend=y))],
    "aten::clamp_min": [Call("unary", lambda x: torch.clamp_min(x, 0.5))],
    "aten::clamp_max": [Call("unary", lambda x: torch.clamp_max(x, 0.5))],
    "aten::where": [Call("binary", lambda x, y: torch.where(x > y, x, y)),
                    Call("unary", lambda x: torch.where(x > 0, x, 0))],
    "aten::masked_fill": [Call("binary", lambda x, y: x.masked_fill(y > 0, -math.inf))],
    "aten::max": [Call("reduction", lambda x: torch.max(x)), Call("binary", lambda x, y: torch.max(x, y)),
                  Call("reduction", lambda x: torch.max(x, 1).values), Call("reduction", lambda x: torch.max(x, 1).indices),
                  Call("reduction", lambda x: torch.max(x, 0, keepdim=True).indices)],
    "aten::min": [Call("reduction", lambda x: torch.min(x)), Call("binary", lambda x, y: torch.min(x, y)),
                  Call("reduction", lambda x: torch.min(x, 1).values), Call("reduction", lambda x: torch.min(x, 1).indices),
                  Call("reduction", lambda x: torch.min(x, 0, keepdim=True).indices)],
    "aten::argmax": [Call("reduction", lambda x: torch.argmax(x, 1)), Call("reduction", lambda x: torch.argmax(x))],
    "aten::argmin": [Call("reduction", lambda x: torch.argmin(x, 0, keepdim=True)), Call("reduction", lambda x: torch.argmin(x))],
    "aten::to": [Call("unary", lambda x, to=to: x.to(to))
                 for to in (torch.float32, torch.float64, torch.int64, torch.int32, torch.bool)],
    "aten::type_as": [Call("unary", lambda x: x.type_as(torch.zeros((), dtype=torch.int32)))],
    "aten::any": [Call("reduction", lambda x: torch.any(x, 1))],
    "aten::all": [Call("reduction", lambda x: torch.all(x, 1))],
    "aten::var": [Call("reduction", lambda x: torch.var(x, 1)), Call("reduction", lambda x: torch.var(x, 1, correction=0))],
    "aten::std": [Call("reduction", lambda x: torch.std(x, 1))],
    "aten::norm": [Call("reduction", lambda x: torch.norm(x, dim=1)), Call("reduction", lambda x: torch.norm(x, 1, dim=1))],
    "aten::linalg_vector_norm": [Call("reduction", lambda x: torch.linalg.vector_norm(x, math.inf, dim=1))],
    "aten::logsumexp": [Call("reduction", lambda x: torch.logsumexp(x, 1))],
    "aten::softmax": [Call("reduction", lambda x: torch.softmax(x, 1))],
    "aten::log_softmax": [Call("reduction", lambda x: torch.log_softmax(x, 1))],
    "aten::layer_norm": [Call("reduction", lambda x: F.layer_norm(x, (LENGTH,)))],
    "aten::group_norm": [Call("reduction", lambda x: F.group_norm(x.unsqueeze(0), 2).squeeze(0))],
    "aten::instance_norm": [Call("reduction", lambda x: F.instance_norm(x.unsqueeze(0)).squeeze(0))],
    "aten::batch_norm": [Call("reduction", lambda x: F.batch_norm(x.unsqueeze(0), *BN_STATS).squeeze(0))],
    "aten::cumsum": [Call("reduction", lambda x: torch.cumsum(x, 0)), Call("reduction", lambda x: torch.cumsum(x, 1))],
    # halves of the rows, and of each row (an odd length cut to even first)
    "aten::glu": [Call("unary", lambda x: F.glu(x, 0)),
                  Call("unary", lambda x: F.glu(x.narrow(-1, 0, x.shape[-1] // 2 * 2), -1))],
}

_SHAPES = "shapes, views and data movement: no arithmetic on values"
_CREATION = "tensor creation from constants: no input values"
NOT_EDGE_TESTED = {
    **{kind: "linear algebra: GEMM through MKL, tested by test_op_table/test_models" for kind in (
        "aten::linear", "aten::matmul", "aten::bmm", "aten::mm", "aten::addmm", "aten::baddbmm",
        "aten::scaled_dot_product_attention", "aten::einsum")},
    **{kind: "convolution and pooling windows: tested by test_op_table" for kind in (
        "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::convolution", "aten::_convolution",
        "aten::conv_transpose1d", "aten::conv_transpose2d", "aten::conv_transpose3d",
        "aten::max_pool1d", "aten::max_pool2d", "aten::avg_pool1d", "aten::avg_pool2d",
        "aten::adaptive_avg_pool1d", "aten::adaptive_avg_pool2d", "aten::upsample_nearest1d",
        "aten::upsample_nearest2d", "aten::upsample_linear1d", "aten::upsample_bilinear2d", "aten::im2col",
        "aten::col2im")},
    **{kind: _SHAPES for kind in (
        "aten::view", "aten::reshape", "aten::flatten", "aten::unflatten", "aten::view_as", "aten::reshape_as", "aten::permute",
        "aten::transpose", "aten::t", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::expand_as",
        "aten::contiguous", "aten::clone", "aten::detach",
        "aten::slice", "aten::narrow", "aten::unfold", "aten::select", "aten::cat", "aten::embedding",
        "aten::index", "aten::index_select", "aten::gather", "aten::tril", "aten::triu", "aten::repeat", "aten::repeat_interleave",
        "aten::roll", "aten::flip", "aten::stack", "aten::unbind", "aten::split", "aten::split_with_sizes", "aten::chunk",
        "aten::pad", "aten::constant_pad_nd", "aten::reflection_pad1d", "aten::reflection_pad2d",
        "aten::replication_pad1d", "aten::replication_pad2d",
        "prim::ListConstruct", "prim::ListUnpack", "aten::__getitem__", "aten::size")},
    **{kind: _CREATION for kind in (
        "aten::zeros_like", "aten::new_zeros", "aten::ones_like", "aten::new_ones", "aten::full_like",
        "aten::new_full", "aten::arange", "aten::zeros", "aten::ones", "aten::full")},
}


def calls_of(kind: str) -> list:
    return CALLS.get(kind) or _auto_call(kind)


def uncovered_rules() -> list:
    """Rules of the table neither called here nor listed with a reason."""
    return sorted(kind for kind in LOWERING if kind not in NOT_EDGE_TESTED and not calls_of(kind))


def edge_tested_kinds() -> list:
    return sorted(kind for kind in LOWERING if kind not in NOT_EDGE_TESTED and calls_of(kind))


# ---- comparing with eager ----

def mismatches(got: torch.Tensor, want: torch.Tensor, inputs: list, rtol=1e-4, atol=1e-5, shown=3,
               zero_sign=True) -> str:
    """'' when got matches want: floats within atol + rtol |want| per element, NaN in the same
    places, infinities and (unless not zero_sign) signs of zero equal where eager's are; other
    dtypes exactly."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{list(got.shape)} vs eager {want.dtype}{list(want.shape)}"
    if want.dtype.is_floating_point:
        g, w = got.double(), want.double()
        nan_w, nan_g = torch.isnan(w), torch.isnan(g)
        finite = ~nan_w & ~nan_g & torch.isfinite(w)
        close = (g - w).abs() <= atol + rtol * w.abs()
        bad = (nan_w != nan_g) | (torch.isinf(w) & (g != w)) | (finite & ~close)
        if zero_sign:
            bad |= (w == 0) & (g == 0) & (torch.signbit(w) != torch.signbit(g))
        bad &= ~(nan_w & nan_g)
    else:
        bad = got != want
    where = bad.reshape(-1).nonzero().reshape(-1)
    if len(where) == 0:
        return ""
    flat = [t.reshape(-1) if t.numel() == want.numel() else None for t in inputs]
    items = []
    for i in where[:shown].tolist():
        args = ", ".join(f"{t[i].item()!r}" for t in flat if t is not None)
        items.append(f"({args}) -> {got.reshape(-1)[i].item()!r}, eager {want.reshape(-1)[i].item()!r}")
    return f"{len(where)} of {want.numel()} differ: " + "; ".join(items)
