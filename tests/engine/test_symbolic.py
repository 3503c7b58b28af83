"""The index expression type (blade/engine/symbolic.py): simplification, bounds, equality, C++."""
from __future__ import annotations

import itertools
import random
import subprocess

import pytest

from blade.engine import compiler
from blade.engine.symbolic import Const, Expr, Var, maximum, minimum, proves_nonnegative

i0, i1 = Var.loop("i0", 4), Var.loop("i1", 64)
seq = Var("seq", 1, 512)                      # a size symbol known only at run time
j0, j1 = Var.loop("j0", 8), Var.loop("j1", seq)

SIMPLIFIED = [
    (i0 + 0, "i0"),
    (1 * i0, "i0"),
    (i0 * 0 + 3, "3"),
    (i0 - i0, "0"),
    (2 * i0 + 3 * i0 + 1 - 1, "5 * i0"),
    ((i0 + 2) * 3, "3 * i0 + 6"),
    (Const(7) // 2 + Const(-7) // 2 + Const(-7) % 2, "0"),   # floor semantics: 3 + -4 + 1
    # the row-major linear index of [4, 64] split again, as a reshape to [4, 4, 16] asks
    ((64 * i0 + i1) // 1024, "0"),
    ((64 * i0 + i1) // 64, "i0"),
    ((64 * i0 + i1) % 64, "i1"),
    ((64 * i0 + i1) // 16, "4 * i0 + i1 / 16"),
    ((64 * i0 + i1) // 16 % 4, "i1 / 16"),
    ((64 * i0 + i1) % 16, "i1 % 16"),
    ((4 * i0 + 2) // 8, "i0 / 2"),             # a factor of the divisor comes out: 2 < 4
    ((4 * i0 + 2) % 8, "4 * (i0 % 2) + 2"),
    ((6 * i0 + 4) // 8, "(3 * i0 + 2) / 4"),
    # a reshape [2, 128, 64] -> [256, 64] of a permuted attention output: the row's remainder
    # (64 * i3 + i2 < 8192) never carries into 8192 * i1 / 16384
    ((8192 * Var.loop("h", 4) + 64 * i1 + Var.loop("d", 64)) // 16384, "h / 2"),
    (i1 // 4 // 4, "i1 / 16"),                 # nested divisions by constants merge
    (i1 % 16 % 4, "i1 % 4"),
    ((i1 + 64) % 64, "i1"),
    ((i1 + 128) // 64, "2"),
    ((i1 + 130) // 64, "(i1 + 2) / 64 + 2"),
    (minimum(i0, 5), "i0"),
    (minimum(i0, 2), "std::min<int64_t>(2, i0)"),
    (maximum(i0 - 3, 0), "0"),
    # a symbolic divisor: the loop over seq is bounded by seq - 1
    ((seq * j0 + j1) // seq, "j0"),
    ((seq * j0 + j1) % seq, "j1"),
    ((2 * seq * j0 + 2 * j1) // (2 * seq), "j0"),
    ((seq * j0 + j1) * 4, "4 * j0 * seq + 4 * j1"),
]


@pytest.mark.parametrize("expr, text", SIMPLIFIED, ids=[t for _, t in SIMPLIFIED])
def test_simplifies_to(expr, text):
    assert expr.render() == text


def test_equal_expressions_are_equal_whatever_the_build_order():
    a, b = 64 * i0 + i1 + 3, 3 + i1 + i0 * 64
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.render() == "64 * i0 + i1 + 3" and b.render() == "i1 + 64 * i0 + 3"   # first-built order
    assert Const(3) == 3 and hash(Const(3)) == hash(3) and i0 != Var.loop("i0", 5)


def test_rendering_keeps_integer_semantics():
    assert (16 * (i1 // 4)).render() == "16 * (i1 / 4)"     # not 16 * i1 / 4
    assert (-(i1 // 16) + i0).render() == "-(i1 / 16) + i0"
    assert (i0 - 2 * i1 - 1).render() == "i0 - 2 * i1 - 1"
    assert ((i0 - 2) // 3).render() == "(i0 + 1) / 3 - 1"      # floor, with a dividend >= 0
    # a roll's index (j1 + seq - shift % seq) % seq: split to a dividend >= -seq, rendered shifted by seq
    assert ((j1 + seq - 3 % seq) % seq).render() == "((j1 - 3 % seq + seq) % seq)"
    assert ((j1 + seq - 3 % seq) // seq).render() == "(((j1 - 3 % seq + seq) / seq) - 1) + 1"
    with pytest.raises(ValueError, match="may be negative"):   # C++ / truncates
        ((i0 - i1) // 3).render()
    with pytest.raises(ValueError, match="may be < 1"):
        i0 // (i0 - 1)


def test_bounds():
    assert (64 * i0 + i1).bounds() == (0, 255)
    assert (i0 - i1).bounds() == (-63, 3)
    assert (i1 // 16).bounds() == (0, 3) and ((i1 + 5) % 8).bounds() == (0, 7)
    assert j1.bounds() == (0, 511) and (seq * j0).bounds() == (0, 3584)
    assert minimum(i0, i1 - 60).bounds() == (-60, 3)
    assert proves_nonnegative(seq - 1 - j1) and not proves_nonnegative(seq - 2 - j1)
    # a remainder by seq is at most seq - 1 (a roll's start n - shift % n), its numeric bounds cannot say so
    assert (seq - 700 % seq).bounds()[0] < 0 and proves_nonnegative(seq - 700 % seq)
    assert proves_nonnegative(seq - 1 - 700 % seq) and not proves_nonnegative(seq - 2 - 700 % seq)
    assert proves_nonnegative(700 % seq) and not proves_nonnegative(-(700 % seq) + seq // 2)



def test_bounds_take_a_shared_factor_out_of_the_terms():
    """batch * (length / 20) - batch is batch * (length / 20 - 1) (a conv's output length times the
    batch: HuBERT's feature encoder over raw audio of at least 60 samples): at least 2 * 2, where
    term by term its lowest is 2 * 3 - 15; also when other terms sit beside the shared ones."""
    batch, length = Var("batch", 2, 15), Var("length", 60, 4096)
    rows = batch * (length // 20) - batch
    assert rows.bounds() == (4, 15 * 203)
    assert (64 * rows + 64 * i1 + i0).bounds() == (256, 64 * 15 * 203 + 64 * 63 + 3)
    exact = [(b * (n // 20) - b) for b in range(2, 16) for n in range(60, 4097)]
    assert rows.bounds() == (min(exact), max(exact))


def test_a_truth_value_needs_a_constant():
    assert not Const(0) and Const(2)
    with pytest.raises(TypeError):
        bool(i0 + 1)


# ---- random expressions against Python's integer arithmetic, and their C++ against both ----

LEAVES = [Var.loop("a", 6), Var.loop("b", 4), Var("c", -2, 2), Var("s", 1, 4)]
A, B, C, S = LEAVES
J = Var.loop("j", S)     # bounded by the symbol s


def _random_expr(rng: random.Random, depth: int):
    """(Expr, reference: assignment -> int)."""
    if depth == 0 or rng.random() < 0.25:
        if rng.random() < 0.3:
            k = rng.randint(-3, 9)
            return Const(k), lambda env, k=k: k
        v = rng.choice(LEAVES + [J])
        return v, lambda env, v=v: env[v.name]
    (x, fx), (y, fy) = _random_expr(rng, depth - 1), _random_expr(rng, depth - 1)
    op = rng.choice(["+", "-", "*", "//k", "%k", "//s", "%s", "min", "max"])
    k = rng.randint(1, 8)
    return {
        "+": (x + y, lambda env: fx(env) + fy(env)),
        "-": (x - y, lambda env: fx(env) - fy(env)),
        "*": (x * y, lambda env: fx(env) * fy(env)),
        "//k": (x // k, lambda env: fx(env) // k),
        "%k": (x % k, lambda env: fx(env) % k),
        "//s": (x // S, lambda env: fx(env) // env["s"]),
        "%s": (x % (S + 1), lambda env: fx(env) % (env["s"] + 1)),
        "min": (minimum(x, y), lambda env: min(fx(env), fy(env))),
        "max": (maximum(x, y), lambda env: max(fx(env), fy(env))),
    }[op]


def _assignments():
    for a, b, c, s in itertools.product(range(6), range(4), range(-2, 3), range(1, 5)):
        for j in range(s):
            yield {"a": a, "b": b, "c": c, "s": s, "j": j}


RANDOM = [_random_expr(random.Random(seed), 4) for seed in range(300)]


def test_simplification_and_bounds_agree_with_integer_arithmetic():
    envs = list(_assignments())
    for expr, reference in RANDOM:
        lo, hi = expr.bounds()
        for env in envs:
            value = reference(env)
            assert expr.evaluate(env) == value, (expr, env)
            assert lo <= value <= hi, (expr, env, (lo, hi))


def test_rendered_cpp_computes_the_same_values(tmp_path):
    """Every expression that renders is compiled by g++ and evaluated at every assignment."""
    rendered = []
    for expr, reference in RANDOM:
        try:
            rendered.append((expr.render(), reference))
        except ValueError:
            continue   # a possibly negative dividend: refused, checked above
    assert len(rendered) > 200
    envs = list(_assignments())
    body = "\n".join(f"  std::printf(\"%lld\\n\", (long long)({text}));" for text, _ in rendered)
    source = tmp_path / "exprs.cpp"
    source.write_text("#include <algorithm>\n#include <cstdint>\n#include <cstdio>\n#include <cstdlib>\n"
                      "int main(int argc, char** argv) {\n"
                      + "".join(f"  const int64_t {n} = std::atoll(argv[{k + 1}]);\n" for k, n in enumerate("abcsj"))
                      + body + "\n}\n")
    binary = tmp_path / "exprs"
    subprocess.run([compiler.resolve_options(None)["cxx"], "-O1", "-std=c++17", str(source), "-o", str(binary)],
                   check=True)
    for env in envs[::7]:
        out = subprocess.run([str(binary), *(str(env[n]) for n in "abcsj")], check=True, capture_output=True,
                             text=True).stdout.split()
        assert [int(v) for v in out] == [reference(env) for _, reference in rendered], env


def test_substitution_resolves_symbols():
    expr = (seq * j0 + j1) // 16
    assert isinstance(expr, Expr) and expr.subs({seq: 64}).render() == "4 * j0 + j1 / 16"
    assert expr.evaluate({"seq": 64, "j0": 2, "j1": 20}) == 9


def test_reshape_strides_with_sizes_that_may_be_one():
    """Splitting [b*s, n] into [b, s, n] (and merging back) when b and s may be 1: the order of s
    and b*s is not provable, but taking each dim keeps the view exact at every size; the strides
    equal ATen's at every size in range (a size-1 dim's stride never matters)."""
    import torch
    from blade.engine.views import reshape_strides
    b, s = Var("b", 1, 3), Var("s", 1, 3)
    # the last: a decode step's keys [b, heads, past + 1, d] given a unit dim (the multiple of a
    # sum of terms: 32 b (s + 1) over 16 (s + 1) is 2 b, symbolic.proves_multiple)
    cases = [((b * s, 8), (8, 1), (b, s, 8)), ((b, s, 8), (s * 8, 8, 1), (b * s, 8)),
             ((b, s, 8), (s * 8, 8, 1), (b, s, 2, 4)),
             ((b, 2, s + 1, 16), (32 * s + 32, 16 * s + 16, 16, 1), (b, 2, 1, s + 1, 16))]
    for old_shape, old_strides, new_shape in cases:
        strides = reshape_strides(old_shape, old_strides, new_shape)
        assert strides is not None, (old_shape, new_shape)
        for bv, sv in itertools.product(range(1, 4), repeat=2):
            def at(e):
                return e if isinstance(e, int) else int(e.evaluate({"b": bv, "s": sv}))
            shape = [at(d) for d in new_shape]
            base = torch.empty([at(d) for d in old_shape]).as_strided([at(d) for d in old_shape],
                                                                      [at(d) for d in old_strides])
            want = base.view(shape).stride()
            assert all(n == 1 or at(got) == w for n, got, w in zip(shape, strides, want)), (bv, sv)


def test_chained_floor_divisions_of_a_size_are_one_expression():
    """(x // m + c) // k is (x + c m) // (m k): three stride-2 convs' output width as ONNX infers it
    (ceil(ceil(ceil(s/2)/2)/2)) and as the rules compute it ((s + 7) // 8) compare equal, or the
    engine compile's shape check fails the whole cluster (a dynamic-size ResNet compiled nothing)."""
    s = Var("s", 1, 512)
    nested = (((s + 1) // 2 + 1) // 2 + 1) // 2
    assert nested == (s + 7) // 8
    for value in range(1, 600):
        assert (((value + 1) // 2 + 1) // 2 + 1) // 2 == (value + 7) // 8
    assert ((s // 3 - 2) // 5) == (s - 6) // 15
