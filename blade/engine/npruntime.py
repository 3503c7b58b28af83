"""A torch-free runner for engine .so files: numpy GEMM/convolution and a serial parallel_for, through ctypes.

For tests and debugging only (the real runtime is the ATen-backed Engine in cpp/engine.cpp).
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path

import numpy as np

from .manifest import Manifest

RANGE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
SGEMM_FN = ctypes.CFUNCTYPE(
    None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32,
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32,
    ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
PARALLEL_FOR_FN = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_void_p)
CONV_FN = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p)
CONV_INPUT_CHANNELS_LAST, CONV_OUTPUT_CHANNELS_LAST = 1, 2   # blade_abi.h BLADE_CONV_* layout bits
ACTIVATION_RELU, ACTIVATION_CLAMP, ACTIVATION_SILU, ACTIVATION_GELU = 1, 2, 3, 4  # blade_abi.h BLADE_ACTIVATION_*


class BladeActivation(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("lo", ctypes.c_float), ("hi", ctypes.c_float)]


class BladeScoreStep(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("value", ctypes.c_float), ("mask", ctypes.c_void_p),
                ("strides", ctypes.c_int64 * 4)]


class BladeAttention(ctypes.Structure):
    _fields_ = ([(d, ctypes.c_int64) for d in ("outer", "inner", "m", "n", "d", "dv")]
                + [("q", ctypes.c_void_p), ("ldq", ctypes.c_int64), ("q_strides", ctypes.c_int64 * 2),
                   ("trans_q", ctypes.c_int32),
                   ("kt", ctypes.c_void_p), ("ldk", ctypes.c_int64), ("k_strides", ctypes.c_int64 * 2),
                   ("trans_k", ctypes.c_int32),
                   ("v", ctypes.c_void_p), ("ldv", ctypes.c_int64), ("v_strides", ctypes.c_int64 * 2),
                   ("trans_v", ctypes.c_int32),
                   ("out", ctypes.c_void_p), ("ldo", ctypes.c_int64), ("out_strides", ctypes.c_int64 * 2),
                   ("step_count", ctypes.c_int32), ("steps", BladeScoreStep * 4),
                   ("zero_rows", ctypes.c_int32), ("zero_rows_max", ctypes.c_float)])


ATTENTION_FN = ctypes.CFUNCTYPE(None, ctypes.POINTER(BladeAttention))
SCORE_MUL, SCORE_DIV, SCORE_KEEP, SCORE_ADD = 1, 2, 3, 4     # blade_abi.h BLADE_SCORE_*


class BladeConv(ctypes.Structure):
    """One conv call's arguments, in CONV_FN's order."""
    _fields_ = [("spatial", ctypes.c_int32), ("input_shape", ctypes.c_void_p), ("input", ctypes.c_void_p),
                ("weight_shape", ctypes.c_void_p), ("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("pads", ctypes.c_void_p), ("dilations", ctypes.c_void_p),
                ("groups", ctypes.c_int64), ("output", ctypes.c_void_p), ("layout", ctypes.c_int32),
                ("sum", ctypes.c_void_p), ("activation", ctypes.c_void_p)]


CONV_PAIR_FN = ctypes.CFUNCTYPE(None, ctypes.POINTER(BladeConv), ctypes.POINTER(BladeConv))


class BladeRuntime(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_int32), ("sgemm", SGEMM_FN), ("parallel_for", PARALLEL_FOR_FN),
                ("conv", CONV_FN), ("attention", ATTENTION_FN), ("conv_pair", CONV_PAIR_FN)]


ERROR_NAMES = {1: "BLADE_ERR_INDEX_OUT_OF_RANGE", 2: "BLADE_ERR_DIVISION_BY_ZERO",
               3: "BLADE_ERR_SIZE_MISMATCH"}   # blade_abi.h


class EngineRunError(RuntimeError):
    def __init__(self, code: int):
        name = ERROR_NAMES.get(code)
        super().__init__(f"engine returned error code {code}" + (f" ({name})" if name else ""))
        self.code = code


F32 = np.dtype(np.float32).itemsize


def _matrices(ptr, batch, rows, cols, ld, stride, trans):
    """The batch of [rows, cols] float32 matrices op(X_b) described by a BLAS-style operand."""
    if rows == 0 or cols == 0 or batch == 0:
        return np.zeros((batch, rows, cols), np.float32)
    # element (b, i, j) of op(X) lives at b*stride + (j*ld + i if trans else i*ld + j)
    strides = (stride, 1, ld) if trans else (stride, ld, 1)
    extent = (batch - 1) * stride + (rows - 1) * strides[1] + (cols - 1) * strides[2] + 1
    flat = np.ctypeslib.as_array((ctypes.c_float * extent).from_address(ptr))
    return np.lib.stride_tricks.as_strided(flat, (batch, rows, cols), tuple(s * F32 for s in strides))


def _sgemm(batch, m, n, k, alpha, a, lda, sa, ta, b, ldb, sb, tb, beta, c, ldc, sc):
    lhs = _matrices(a, batch, m, k, lda, sa, ta).astype(np.float64)
    rhs = _matrices(b, batch, k, n, ldb, sb, tb).astype(np.float64)
    out = _matrices(c, batch, m, n, ldc, sc, 0)
    result = alpha * (lhs @ rhs)
    if beta != 0.0:
        result += beta * out
    out[...] = result.astype(np.float32)


def _heads(ptr, ld, strides, trans, outer, inner, rows, cols, ctype=ctypes.c_float):
    """[outer, inner, rows, cols] view of an attention operand (sgemm's ld/trans per (o, i))."""
    item = ctypes.sizeof(ctype)
    steps = (strides[0], strides[1], *((1, ld) if trans else (ld, 1)))
    sizes = (outer, inner, rows, cols)
    extent = 1 + sum((n - 1) * st for n, st in zip(sizes, steps))
    flat = np.ctypeslib.as_array((ctype * extent).from_address(ptr))
    return np.lib.stride_tricks.as_strided(flat, sizes, tuple(st * item for st in steps))


def _attention(pointer):
    """BladeRuntime::attention in float32 numpy, step by step as blade_abi.h states it."""
    a = pointer.contents
    shape = (a.outer, a.inner)
    q = _heads(a.q, a.ldq, a.q_strides, a.trans_q, *shape, a.m, a.d).astype(np.float64)
    kt = _heads(a.kt, a.ldk, a.k_strides, a.trans_k, *shape, a.d, a.n).astype(np.float64)
    v = _heads(a.v, a.ldv, a.v_strides, a.trans_v, *shape, a.n, a.dv).astype(np.float64)
    x = (q @ kt).astype(np.float32)
    with np.errstate(all="ignore"):
        for step in a.steps[:a.step_count]:
            value = np.float32(step.value)
            if step.kind in (SCORE_KEEP, SCORE_ADD):
                ctype = ctypes.c_uint8 if step.kind == SCORE_KEEP else ctypes.c_float
                item = ctypes.sizeof(ctype)
                extent = 1 + sum((n - 1) * st for n, st in zip(x.shape, step.strides))
                flat = np.ctypeslib.as_array((ctype * extent).from_address(step.mask))
                mask = np.lib.stride_tricks.as_strided(flat, x.shape, tuple(st * item for st in step.strides))
                x = np.where(mask != 0, x, value) if step.kind == SCORE_KEEP else x + mask
            else:
                x = x * value if step.kind == SCORE_MUL else x / value
        top = x.max(axis=-1, keepdims=True)
        e = np.exp(x - top)
        p = e * (np.float32(1) / e.sum(axis=-1, keepdims=True))
        if a.zero_rows:
            p = np.where(top == np.float32(a.zero_rows_max), np.float32(0), p)
        out = p.astype(np.float64) @ v
    dest = _heads(a.out, a.ldo, a.out_strides, 0, *shape, a.m, a.dv)
    dest[...] = out.astype(np.float32)


def _array(ptr, shape, ctype=ctypes.c_float):
    count = int(np.prod(shape))
    if count == 0:
        return np.zeros(shape)
    return np.ctypeslib.as_array((ctype * count).from_address(ptr)).reshape(shape)


def _activation(ptr, shape, channels_last: bool):
    """An engine activation [n, c, *spatial] (stored as [n, *spatial, c] when channels_last)."""
    if not channels_last:
        return _array(ptr, shape)
    return np.moveaxis(_array(ptr, [shape[0], *shape[2:], shape[1]]), -1, 1)


def _conv(spatial, in_shape, x, w_shape, w, bias, strides, pads, dilations, groups, out, layout, addend, activation):
    """The blade_abi.h conv contract in numpy (float64 accumulation): pad, then one einsum per group
    over sliding windows."""
    ints = lambda ptr, n: [int(v) for v in _array(ptr, (n,), ctypes.c_int64)]
    in_shape, w_shape = ints(in_shape, 2 + spatial), ints(w_shape, 2 + spatial)
    strides, pads, dilations = ints(strides, spatial), ints(pads, 2 * spatial), ints(dilations, spatial)
    x = np.pad(_activation(x, in_shape, bool(layout & CONV_INPUT_CHANNELS_LAST)).astype(np.float64),
               [(0, 0), (0, 0)] + [(pads[d], pads[spatial + d]) for d in range(spatial)])
    w = _array(w, w_shape).astype(np.float64)
    # windows[n, c, *out, *k]: the input under each kernel tap, dilated and strided
    extents = [dilations[d] * (w_shape[2 + d] - 1) + 1 for d in range(spatial)]
    windows = np.lib.stride_tricks.sliding_window_view(x, extents, axis=tuple(range(2, 2 + spatial)))
    windows = windows[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)
                      + tuple(slice(None, None, d) for d in dilations)]
    c_in, c_out = w_shape[1], w_shape[0] // groups
    letters = "ijkl"[:spatial]
    parts = [np.einsum(f"nc{letters.upper()}{letters},oc{letters}->no{letters.upper()}",
                       windows[:, g * c_in:(g + 1) * c_in], w[g * c_out:(g + 1) * c_out]) for g in range(groups)]
    result = np.concatenate(parts, axis=1)
    if bias:
        result += _array(bias, (w_shape[0],)).reshape((1, -1) + (1,) * spatial)
    out_channels_last = bool(layout & CONV_OUTPUT_CHANNELS_LAST)
    if addend:
        result += _activation(addend, result.shape, out_channels_last)
    if activation:
        act = BladeActivation.from_address(activation)
        if act.kind == ACTIVATION_RELU:
            result = np.where(result < 0, 0.0, result)   # NaN stays NaN
        elif act.kind == ACTIVATION_CLAMP:   # Max then Min: NaN stays NaN
            result = np.where(np.isnan(result) | (result >= act.lo), result, act.lo)
            result = np.where(np.isnan(result) | (result <= act.hi), result, act.hi)
        elif act.kind == ACTIVATION_SILU:
            # exp(-v) = inf below -88: v / inf is -0 (-inf / inf: NaN), as the engine's v * 0
            with np.errstate(over="ignore", invalid="ignore"):
                result = result / (1.0 + np.exp(-result))
        elif act.kind == ACTIVATION_GELU:   # v * Phi(v), in float64 (-inf * 0 is NaN, as eager's)
            with np.errstate(invalid="ignore"):
                result = result * 0.5 * (1.0 + np.vectorize(math.erf)(result / math.sqrt(2.0)))
        else:
            raise ValueError(f"unknown activation kind {act.kind}")
    if result.size:
        _activation(out, result.shape, out_channels_last)[...] = result.astype(np.float32)


def _conv_pair(first, second):
    """BladeRuntime::conv_pair as its two conv calls, in order."""
    for call in (first.contents, second.contents):
        _conv(*(getattr(call, name) for name, _ in BladeConv._fields_))


def _parallel_for(begin, end, grain, fn, ctx):
    chunk = RANGE_FN(fn)
    step = max(grain, 1)
    for lo in range(begin, end, step):
        chunk(ctx, lo, min(lo + step, end))


class NumpyEngine:
    """Loads engine.so + manifest; __call__(*inputs) -> list of outputs."""

    def __init__(self, so_path, manifest: Manifest | None = None, constants=()):
        so_path = Path(so_path)
        if manifest is None:
            manifest = Manifest.from_json((so_path.parent / "manifest.json").read_text())
        self.manifest = manifest
        self.lib = ctypes.CDLL(str(so_path))
        if self.lib.blade_engine_abi_version() != manifest.abi_version:
            raise RuntimeError(f"{so_path}: ABI {self.lib.blade_engine_abi_version()} != manifest {manifest.abi_version}")
        self.run = self.lib.blade_engine_run
        self.run.restype = ctypes.c_int32
        self.run.argtypes = [ctypes.POINTER(BladeRuntime)] + [ctypes.c_void_p] * 5
        self.constants = [np.require(np.asarray(c, dtype=s.dtype), requirements="C") for c, s in zip(constants, manifest.constants)]
        if len(self.constants) != len(manifest.constants):
            raise ValueError(f"engine needs {len(manifest.constants)} constants, got {len(self.constants)}")
        self.runtime = BladeRuntime(manifest.abi_version, SGEMM_FN(_sgemm), PARALLEL_FOR_FN(_parallel_for),
                                    CONV_FN(_conv), ATTENTION_FN(_attention), CONV_PAIR_FN(_conv_pair))

    @staticmethod
    def _pointers(arrays):
        return (ctypes.c_void_p * max(len(arrays), 1))(*[a.ctypes.data for a in arrays])

    def __call__(self, *inputs):
        specs = self.manifest.inputs
        if len(inputs) != len(specs):
            raise ValueError(f"expected {len(specs)} inputs, got {len(inputs)}")
        args, sizes = [], {}
        ranges = {s.name: (s.min, s.max) for s in self.manifest.symbols}
        for spec, value in zip(specs, inputs):
            value = np.require(np.asarray(value, dtype=spec.dtype), requirements="C")
            # a size symbol takes the first value it meets (in its range); later dims must agree
            bound = [sizes.setdefault(d, n) if isinstance(d, str) else d for d, n in zip(spec.shape, value.shape)]
            if value.ndim != len(spec.shape) or list(value.shape) != bound or not all(
                    ranges[d][0] <= sizes[d] <= ranges[d][1] for d in spec.shape if isinstance(d, str)):
                raise ValueError(f"input {spec.name!r}: shape {list(value.shape)}, expected {spec.shape} "
                                 f"(size symbols {ranges}, bound {sizes})")
            args.append(value)
        size_values = (ctypes.c_int64 * max(len(ranges), 1))(*[sizes.get(name, -1) for name in ranges])
        if len(sizes) < len(ranges):  # derived symbols (output dims no input binds): the .so computes them
            self.lib.blade_engine_derived_sizes(size_values)
            sizes = dict(zip(ranges, size_values))
        outputs = [np.empty([sizes[d] if isinstance(d, str) else d for d in s.shape], s.dtype)
                   for s in self.manifest.outputs]
        # 64-byte aligned scratch, poisoned so that reads of never-written scratch show up as NaNs.
        raw = np.full(self.manifest.scratch_bytes + 64, 0xFF, np.uint8)
        start = (-raw.ctypes.data) % 64
        scratch = raw[start:start + self.manifest.scratch_bytes]
        code = self.run(ctypes.byref(self.runtime), self._pointers(args), self._pointers(outputs),
                        self._pointers(self.constants), ctypes.addressof(size_values),
                        scratch.ctypes.data if scratch.size else None)
        if code != 0:
            raise EngineRunError(code)
        return outputs
