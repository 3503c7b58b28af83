"""The C++ of IR operations on scalars: types, literals, the elementwise op table (CODE_FOR_OP),
reductions (REDUCE), and what each op costs (EXPENSIVE_OPS, for the plan's recompute-or-store choice).

The prelude functions these call (blade_expf, blade_ipow, ...) are in cpp/engine_prelude.h.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .ir import ELEMENTWISE
from .manifest import DTYPES


# ---------------------------------------------------------------------------------------------
# C++ types and literals

@dataclass(frozen=True)
class CType:
    dtype: str

    @property
    def name(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def is_float(self) -> bool:
        return self.dtype in ("float32", "float64")

    def __str__(self) -> str:
        return self.name


def literal(value, dtype: str) -> str:
    """A C++ literal that reproduces value exactly in dtype."""
    if dtype == "bool":
        return "true" if value else "false"
    if dtype in ("float32", "float64"):
        limits = f"std::numeric_limits<{DTYPES[dtype][0]}>"
        value = float(value)
        if math.isnan(value):
            return f"{limits}::quiet_NaN()"
        if math.isinf(value):
            return f"{'-' if value < 0 else ''}{limits}::infinity()"
        # repr round-trips the double, which is exactly the float32 value: parsing it back as a
        # float literal gives the same float.
        return repr(value) + ("f" if dtype == "float32" else "")
    value = int(value)
    if dtype == "int64":
        return "INT64_MIN" if value == -2**63 else f"int64_t({value}LL)"
    return "INT32_MIN" if value == -2**31 else f"int32_t({value})"


def _neg_inf_or_lowest(t: CType) -> str:
    return f"-std::numeric_limits<{t}>::infinity()" if t.is_float else f"std::numeric_limits<{t}>::lowest()"


def _inf_or_max(t: CType) -> str:
    return f"std::numeric_limits<{t}>::infinity()" if t.is_float else f"std::numeric_limits<{t}>::max()"


# ---------------------------------------------------------------------------------------------
# Op tables. Arguments are always atoms (temps, literals, loads), so repeating one is free.
# t: the C++ type of the result.

def _exp(t: CType) -> str:
    return "blade_expf" if t.dtype == "float32" else "std::exp"


def _call(fn):
    return lambda t, a: f"{fn}({a})"


def _float32_or_std(name):
    """blade_<name>f of the prelude for float32 (a loop calling it vectorizes), std::<name> otherwise."""
    return lambda t, a: f"blade_{name}f({a})" if t.dtype == "float32" else f"std::{name}({a})"


def _integer_div(t: CType, a: str, b: str) -> str:
    """ONNX integer division truncates, as C++ does. Neither x / 0 nor INT_MIN / -1 may trap the
    process: a zero divisor fails the call (eager raises ZeroDivisionError), and x / -1 is a
    wrapping negation (torch's result for INT_MIN)."""
    unsigned = f"u{t}"
    return (f"({b} == 0 ? (status.store(BLADE_ERR_DIVISION_BY_ZERO, std::memory_order_relaxed), {t}(0)) : "
            f"{b} == {t}(-1) ? {t}({unsigned}(0) - {unsigned}({a})) : {t}({a} / {b}))")


CODE_FOR_OP = {
    "Add": lambda t, a, b: f"{a} + {b}",
    "Sub": lambda t, a, b: f"{a} - {b}",
    "Mul": lambda t, a, b: f"{a} * {b}",
    "Div": lambda t, a, b: f"{a} / {b}" if t.is_float else _integer_div(t, a, b),
    "Pow": lambda t, a, b: (f"blade_powf({a}, {b})" if t.dtype == "float32" else f"std::pow({a}, {b})" if t.is_float
                            else f"blade_ipow({a}, {b})"),
    "Mod": lambda t, a, b: f"std::fmod({a}, {b})",   # floats only (ir._fmod)
    "Neg": lambda t, a: f"-{a}",
    "Abs": _call("std::abs"),
    "Relu": lambda t, a: f"({a} < {t}(0) ? {t}(0) : {a})",   # NaN passes through, like torch
    # float32 exp/tanh/sigmoid/erf/log/sin/cos/pow use the branch-free versions of the prelude so that loops vectorize.
    "Sigmoid": lambda t, a: (f"blade_sigmoidf({a})" if t.dtype == "float32"
                             else f"{t}(1) / ({t}(1) + {_exp(t)}(-{a}))"),
    "Tanh": lambda t, a: f"{'blade_tanhf' if t.dtype == 'float32' else 'std::tanh'}({a})",
    "Exp": lambda t, a: f"{_exp(t)}({a})",
    "Log": _float32_or_std("log"),
    "Sqrt": _call("std::sqrt"),
    "Reciprocal": lambda t, a: f"{t}(1) / {a}",
    "Erf": lambda t, a: f"{'blade_erff' if t.dtype == 'float32' else 'std::erf'}({a})",
    # exact GELU (ir._gelu); float64 as torch writes it
    "Gelu": lambda t, a: (f"blade_geluf({a})" if t.dtype == "float32"
                          else f"{a} * 0.5 * (1.0 + std::erf({a} * 0.70710678118654752440))"),
    "Floor": _call("std::floor"),
    "Ceil": _call("std::ceil"),
    # two compares, as torch's sign: NaN and -0 give +0 (a ?: of 1/0 vectorizes where a call would not)
    "Sign": lambda t, a: f"({a} > {t}(0) ? {t}(1) : {t}(0)) - ({a} < {t}(0) ? {t}(1) : {t}(0))",
    "Sin": _float32_or_std("sin"),
    "Cos": _float32_or_std("cos"),
    # NaN wins and a tie (-0 vs +0) gives the first operand, like torch's maximum/minimum/clamp: b
    # when it is beyond a or NaN, else a (a NaN a stays). g++ folds `b != b` away for a constant b
    # (clamp, relu6, hardswish): one compare and a blend, where `a != a || a >= b` cost three
    # compares and mask moves through general registers (hardswish [64,4096]: 37 -> 26 us).
    "Max": lambda t, a, b: f"({a} < {b} || {b} != {b}) ? {b} : {a}",
    "Min": lambda t, a, b: f"({a} > {b} || {b} != {b}) ? {b} : {a}",
    # bool branches as bit operations: g++ does not vectorize a ?: select of bools
    "Where": lambda t, c, a, b: f"({c} & {a}) | (!{c} & {b})" if t.dtype == "bool" else f"{c} ? {a} : {b}",
    "Equal": lambda t, a, b: f"{a} == {b}",
    "Less": lambda t, a, b: f"{a} < {b}",
    "LessOrEqual": lambda t, a, b: f"{a} <= {b}",
    "Greater": lambda t, a, b: f"{a} > {b}",
    "GreaterOrEqual": lambda t, a, b: f"{a} >= {b}",
    "Not": lambda t, a: f"!{a}",
    # bit operations too (operands are computed bools, nothing to short-circuit): with && a mask
    # row broadcast into a run-time-length loop (the dynamic engine's attention mask) vectorized
    # into a 64-step bit-assembly per vector, 1.9x slower than & (g++ 12, AVX-512)
    "And": lambda t, a, b: f"{a} & {b}",
    "Or": lambda t, a, b: f"{a} | {b}",
    "Xor": lambda t, a, b: f"{a} != {b}",
    # integers only (bools take Not/And/Or/Xor); the cast undoes C++'s promotion of narrow types
    # to int, so ~uint8 stays a uint8 in the expressions it feeds
    "BitwiseNot": lambda t, a: f"{t}(~{a})",
    "BitwiseAnd": lambda t, a, b: f"{t}({a} & {b})",
    "BitwiseOr": lambda t, a, b: f"{t}({a} | {b})",
    "BitwiseXor": lambda t, a, b: f"{t}({a} ^ {b})",
    # +a: a bool operand is promoted to int first (g++ does not vectorize bool -> float conversions;
    # every other operand type is unchanged by the unary +)
    "Cast": lambda t, a: f"{a} != 0" if t.dtype == "bool" else f"static_cast<{t}>(+{a})",
}
assert CODE_FOR_OP.keys() == ELEMENTWISE.keys(), "ir.ELEMENTWISE and CODE_FOR_OP must list the same ops"

# Rough cost of one element of an op, to decide between recomputing a shared value and storing it.
EXPENSIVE_OPS = {"Div": 4, "Sqrt": 4, "Reciprocal": 4, "Pow": 20, "Sigmoid": 20, "Tanh": 20,
                 "Exp": 20, "Log": 20, "Erf": 20, "Gelu": 20, "Sin": 20, "Cos": 20}


@dataclass(frozen=True)
class Reduction:
    init: object       # CType -> C++ initial accumulator
    combine: object    # (acc, value) -> C++ expression
    simd: str = ""     # OpenMP simd reduction operator when the combine is associative enough
    # Float max/min: the NaN-propagating combine is a loop-carried select g++ will not vectorize, so
    # float loops use this NaN-ignoring combine (an OpenMP simd max/min) and OR a NaN flag alongside.
    float_combine: object = None


# The NaN-propagating max/min combine is the prelude's blade_max_nan/blade_min_nan (why: there).
REDUCE = {
    "sum": Reduction(lambda t: f"{t}(0)", lambda acc, v: f"{acc} + {v}", "+"),
    "prod": Reduction(lambda t: f"{t}(1)", lambda acc, v: f"{acc} * {v}", "*"),
    "max": Reduction(_neg_inf_or_lowest, lambda acc, v: f"blade_max_nan({acc}, {v})", "max",
                     lambda acc, v: f"{v} > {acc} ? {v} : {acc}"),
    "min": Reduction(_inf_or_max, lambda acc, v: f"blade_min_nan({acc}, {v})", "min",
                     lambda acc, v: f"{v} < {acc} ? {v} : {acc}"),
}

# Arg reductions: (the comparison that makes v the new extreme, the initial extreme). A strict
# comparison keeps the first of equal extremes, and a NaN is taken once (v != v) and then kept
# (best != best), which are torch's rules for max/min(dim) and argmax/argmin.
ARG_REDUCE = {
    "argmax": (lambda best, v: f"{v} > {best}", _neg_inf_or_lowest),
    "argmin": (lambda best, v: f"{v} < {best}", _inf_or_max),
}
