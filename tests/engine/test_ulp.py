"""The numerics contract of the prelude's float32 transcendentals, on a fixed dense sample.

bench/ulp_table.py measures them over (nearly) every float32 input; this test checks the same
bounds on 2^18 evenly spaced bit patterns (every float32 binade, both signs) plus dense ranges
where the functions bend, through a compiled engine (the code engines really run), against
float64 numpy. A regression in a prelude function fails here.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import helper

from onnx_cases import graph_case, run_case
from blade.engine.compiler import compile_onnx

# op -> (max ulp allowed, the float64 reference). Measured maxima (bench/ulp_table.py --stride 7,
# README "Numerics"; log over all 2^32 inputs): exp 1.02, log 0.85, tanh 1.32, sigmoid 2.47 (2.48 over all
# 2^32 inputs with the divide), erf 2.31,
# sin 0.50, cos 0.50, pow 0.50.
CONTRACT = {
    "Exp": (1.5, np.exp),
    "Log": (1.0, np.log),
    "Tanh": (1.5, np.tanh),
    "Sigmoid": (2.5, lambda x: 1.0 / (1.0 + np.exp(-x))),
    "Erf": (2.5, np.frompyfunc(math.erf, 1, 1)),
    "Sin": (0.6, np.sin),
    "Cos": (0.6, np.cos),
}
POW_ULP = 0.6


def dense_sample() -> np.ndarray:
    every_binade = (np.arange(1 << 18, dtype=np.uint64) * ((1 << 32) // (1 << 18)) + 12345).astype(np.uint32)
    floats = every_binade.view(np.float32)
    ranges = [np.linspace(-20, 20, 40001), np.linspace(0.5, 2, 20001), np.linspace(-1e4, 1e4, 20001),
              np.linspace(-1e6, 1e6, 20001)]
    # consecutive floats where sin/cos switch from Cody-Waite to Payne-Hanek (2^24) and below FLT_MAX
    consecutive = [np.arange(start - 4096, start + 4096, dtype=np.int64).astype(np.uint32).view(np.float32)
                   for start in (0x4B800000, 0x7F7FF000)]
    x = np.concatenate([floats[np.isfinite(floats)], *[r.astype(np.float32) for r in ranges], *consecutive])
    return x.astype(np.float32)


def ulps(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|got - ref| in float32 ulps of ref, where ref is a finite normal float32 value (else 0)."""
    with np.errstate(all="ignore"):   # refs beyond float32 (overflowing to inf) and NaNs are left out
        return _ulps(got, ref)


def _ulps(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    ref32 = ref.astype(np.float32)
    normal = np.isfinite(ref32) & (np.abs(ref) >= np.finfo(np.float32).tiny)
    exponent = np.frexp(np.where(normal, ref32, 1.0).astype(np.float64))[1] - 1
    err = np.abs(got.astype(np.float64) - ref) / np.ldexp(1.0, exponent - 23)
    return np.where(normal, err, 0.0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    x = dense_sample()
    rng = np.random.default_rng(0)
    base = np.abs(x[: len(x) // 2]) + np.float32(1e-30)
    # exponents that keep base^y inside the float range: y = t / log2(base), t in [-140, 120]
    exponent = (rng.uniform(-140, 120, base.shape) / np.where(np.log2(base) == 0, 1, np.log2(base))).astype(np.float32)
    nodes = [helper.make_node(op, ["x"], [op]) for op in CONTRACT] + [helper.make_node("Pow", ["b", "e"], ["Pow"])]
    case = graph_case("ulp", nodes, {"x": (x.shape, "float32"), "b": (base.shape, "float32"),
                                     "e": (exponent.shape, "float32")},
                      [*CONTRACT, "Pow"], values={"x": x, "b": base, "e": exponent})
    out = tmp_path_factory.mktemp("ulp")
    manifest = compile_onnx(case.model, out)
    return case, dict(zip([*CONTRACT, "Pow"], run_case(case, out / "engine.so", manifest)))


@pytest.mark.parametrize("op", list(CONTRACT))
def test_unary_within_contract(op, results):
    case, outputs = results
    bound, reference = CONTRACT[op]
    x = case.feeds["x"].astype(np.float64)
    with np.errstate(all="ignore"):
        ref = np.asarray(reference(x), dtype=np.float64)
    err = ulps(outputs[op], ref)
    worst = int(np.argmax(err))
    assert err[worst] <= bound, f"{op}({x[worst]!r}) = {outputs[op][worst]!r}, float64 {ref[worst]!r}: {err[worst]:.2f} ulp"


def test_pow_within_contract(results):
    case, outputs = results
    b, e = case.feeds["b"].astype(np.float64), case.feeds["e"].astype(np.float64)
    with np.errstate(all="ignore"):
        ref = np.power(b, e)
    err = ulps(outputs["Pow"], ref)
    worst = int(np.argmax(err))
    assert err[worst] <= POW_ULP, f"pow({b[worst]!r}, {e[worst]!r}) = {outputs['Pow'][worst]!r}: {err[worst]:.2f} ulp"


def test_sin_cos_rows_take_the_cheap_form_or_the_full_one_within_contract(tmp_path):
    """In rows (2-D) sin and cos run Cody-Waite only and redo a row holding any |x| >= 2^24, inf or
    NaN with the full reduction (engine/versioning.py): the dense sample as rows of 1024, with rows
    of either kind, one row whose only wide element is its last, and inf/NaN among small values."""
    x = dense_sample()
    x = np.concatenate([x, np.zeros(-len(x) % 1024, np.float32)]).reshape(-1, 1024)
    one_wide, special = np.linspace(-7, 7, 1024, dtype=np.float32), np.linspace(-3, 3, 1024, dtype=np.float32)
    one_wide[-1] = np.float32(3e7)
    special[[5, 600]] = np.inf, np.nan
    x = np.concatenate([x, one_wide[None], special[None]])
    wide = (np.abs(x) >= 2.0 ** 24) | ~np.isfinite(x)
    assert wide.any(axis=1).sum() > 10 and (~wide.any(axis=1)).sum() > 10
    case = graph_case("ulp-rows", [helper.make_node(op, ["x"], [op]) for op in ("Sin", "Cos")],
                      {"x": (x.shape, "float32")}, ["Sin", "Cos"], values={"x": x})
    manifest = compile_onnx(case.model, tmp_path)
    assert "blade_sinf_fast(" in (tmp_path / "engine.cpp").read_text()
    for op, got in zip(("Sin", "Cos"), run_case(case, tmp_path / "engine.so", manifest)):
        bound, reference = CONTRACT[op]
        with np.errstate(all="ignore"):
            ref = np.asarray(reference(x.astype(np.float64)), dtype=np.float64)
        assert np.isnan(got[~np.isfinite(x)]).all()
        err = ulps(got, ref)
        worst = np.unravel_index(int(np.argmax(err)), err.shape)
        assert err[worst] <= bound, f"{op}({x[worst]!r}) = {got[worst]!r}, float64 {ref[worst]!r}: {err[worst]:.2f} ulp"


def test_pow_rows_take_the_cheap_form_or_the_full_one(tmp_path):
    """In rows pow runs without C's special cases (blade_powf_fast) and redoes a row holding any
    x <= 0, inf or NaN or any y inf or NaN with blade_powf (engine/versioning.py): usual rows within
    the contract, and every special value (alone in a row, or its row's last element) as float64
    pow gives it: signs of odd integer powers of negatives, NaN for their non-integer powers, 0^y,
    inf^y, 1^NaN and NaN^0, and x^+-inf."""
    rng = np.random.default_rng(1)
    usual_x = (np.abs(rng.standard_normal((6, 1024))) + 1e-3).astype(np.float32)
    usual_y = rng.uniform(-8, 8, (6, 1024)).astype(np.float32)
    specials = [(-2.0, 3.0), (-2.0, -3.0), (-2.0, 2.0), (-2.0, 0.5), (-0.0, 3.0), (-0.0, -3.0), (0.0, -2.0),
                (0.0, 0.5), (np.inf, -1.0), (-np.inf, 3.0), (-np.inf, 2.0), (np.nan, 0.0), (1.0, np.nan),
                (np.nan, 2.0), (2.0, np.nan), (0.5, np.inf), (0.5, -np.inf), (-1.0, np.inf), (3.0, -np.inf),
                (-3.0, 1e30), (-1e-3, 33.0), (1e-45, 0.5), (3.4028235e38, 1.0)]
    special_x, special_y = usual_x[:2].copy(), usual_y[:2].copy()
    for i, (b, e) in enumerate(specials):
        special_x[0, 40 * i], special_y[0, 40 * i] = b, e
    special_x[1, -1], special_y[1, -1] = -2.0, 3.0
    x, y = np.concatenate([usual_x, special_x]), np.concatenate([usual_y, special_y])
    case = graph_case("pow-rows", [helper.make_node("Pow", ["x", "y"], ["z"])],
                      {"x": (x.shape, "float32"), "y": (y.shape, "float32")}, ["z"], values={"x": x, "y": y})
    manifest = compile_onnx(case.model, tmp_path)
    assert "blade_powf_fast(" in (tmp_path / "engine.cpp").read_text()
    (got,) = run_case(case, tmp_path / "engine.so", manifest)
    with np.errstate(all="ignore"):
        ref = np.power(x.astype(np.float64), y.astype(np.float64))
    exact = ~np.isfinite(ref.astype(np.float32)) | (ref == 0) | ~np.isfinite(x) | ~np.isfinite(y) | (x <= 0)
    np.testing.assert_array_equal(got[exact], ref[exact].astype(np.float32))
    err = ulps(got, ref)
    worst = np.unravel_index(int(np.argmax(err)), err.shape)
    assert err[worst] <= POW_ULP, f"pow({x[worst]!r}, {y[worst]!r}) = {got[worst]!r}: {err[worst]:.2f} ulp"


GELU_ABS = 2e-7   # |error| / |x| of the exact GELU (measured 1.72e-7; eager's float32 A&S erf: 3.3e-7)


def test_exact_gelu_within_contract(tmp_path):
    """blade_geluf (one op: x Phi(x) with Phi(-|x|) = t R(t) e^(-x^2/2)): error <= GELU_ABS |x| on
    the dense sample and densely over [-14, 14] (every region of the formula: x near 0, the clamp of
    -x^2/2 at -80 beyond |x| = 12.6), and the special values as eager's scalar GELU gives them."""
    specials = np.float32([np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4028235e38, -3.4028235e38, -20.0, 1e-40, -1e-40])
    x = np.concatenate([dense_sample(), np.linspace(-14, 14, 280001).astype(np.float32), specials])
    case = graph_case("gelu", [helper.make_node("Gelu", ["x"], ["y"])], {"x": (x.shape, "float32")}, ["y"],
                      values={"x": x})
    manifest = compile_onnx(case.model, tmp_path)
    assert "blade_geluf(" in (tmp_path / "engine.cpp").read_text()
    (got,) = run_case(case, tmp_path / "engine.so", manifest)
    xd = x.astype(np.float64)
    finite = np.isfinite(xd)
    ref = xd[finite] * 0.5 * np.frompyfunc(lambda v: math.erfc(-v / math.sqrt(2.0)), 1, 1)(xd[finite]).astype(np.float64)
    # (plus the spacing of subnormal results, which the rounding of a subnormal x / 2 can cost)
    err = (np.abs(got[finite].astype(np.float64) - ref) - 2.0 ** -149) / np.maximum(np.abs(xd[finite]), 1e-45)
    worst = int(np.argmax(err))
    assert err[worst] <= GELU_ABS, f"gelu({xd[finite][worst]!r}) = {got[finite][worst]!r}, float64 {ref[worst]!r}"
    tail = got[-len(specials):]
    assert np.isnan(tail[0]) and tail[1] == np.inf and np.isnan(tail[2])   # eager: gelu(-inf) = -inf * 0 = NaN
    assert tail[3] == 0 and not np.signbit(tail[3]) and tail[4] == 0 and np.signbit(tail[4])
    assert tail[5] == np.float32(3.4028235e38) and tail[6] == 0 and np.signbit(tail[6])
    assert -1e-30 < tail[7] <= 0 and np.signbit(tail[7])
    assert tail[8] == np.float32(5e-41) and tail[9] == np.float32(-5e-41)
