"""Integer expressions for index arithmetic: built and simplified as data, rendered to C++ at the end.

Every value is an ``Expr``: a constant, a variable with known bounds (a loop variable ``i0`` in
[0, 63], or a size symbol ``seq`` in [1, 512] whose value comes at run time), or sums, products,
floor divisions, remainders, minima and maxima of those. Python operators build them
(``4 * i0 + i1``, ``x // 16``, ``x % 4``), and every constructor simplifies on the way:

- sums collect like terms and fold constants (``x + 0``, ``1 * x``, ``2x - 2x``);
- products of sums distribute, so a sum is a polynomial: integer coefficients times monomials
  (a variable, a product of variables, or an opaque division/remainder/min/max);
- ``(k a + b) // k`` = ``a + b // k`` and ``(k a + b) % k`` = ``b % k`` (exact for integers); then
  ``b // k`` = 0 and ``b % k`` = b when 0 <= b < k is provable from the bounds. A divisor may be a
  symbol (``(seq i0 + i1) // seq`` = ``i0`` when i1's upper bound is ``seq - 1``);
- a factor of the divisor comes out when what it leaves is smaller than it (``(8192 a + 64 b + c)
  // 16384`` = ``a // 2`` for 0 <= 64 b + c < 8192), nested divisions by constants merge, and
  min/max with a provable order pick their side.

Bounds are intervals of Python ints (``bounds()``); a variable's own bounds may be expressions over
size symbols (``Var.loop("i1", seq)``: 0 <= i1 <= seq - 1), which ``proves_nonnegative`` uses to
prove facts numeric intervals cannot. Equal expressions compare and hash equal whatever order they
were built in (a sum keeps its first-built term order only for rendering).

C++ rendering (``render``) uses int64_t arithmetic: ``/`` and ``%`` truncate in C++, which is
floor division only for a non-negative dividend, so a division or remainder whose dividend is not
provably non-negative refuses to render (ValueError) instead of rendering something wrong.
"""
from __future__ import annotations

import math
import operator
from functools import reduce


class Expr:
    """An integer expression; immutable and hashable. Build with the operators or the functions below."""
    __slots__ = ("_key", "_hash")

    # -- structure (subclasses define) --
    def _make_key(self):
        raise NotImplementedError

    @property
    def key(self):
        key = getattr(self, "_key", None)
        if key is None:
            key = self._key = self._make_key()
        return key

    def __eq__(self, other):
        if isinstance(other, int) and not isinstance(other, bool):
            other = Const(other)
        return isinstance(other, Expr) and self.key == other.key

    def __hash__(self):
        h = getattr(self, "_hash", None)
        if h is None:
            h = self._hash = hash(self.key)
        return h

    def __repr__(self):
        try:
            return f"Expr({self.render()})"
        except ValueError:
            return f"Expr({self.key})"

    # -- arithmetic --
    def __add__(self, other):
        return add(self, other)

    __radd__ = __add__

    def __sub__(self, other):
        return add(self, mul(other, -1))

    def __rsub__(self, other):
        return add(other, mul(self, -1))

    def __neg__(self):
        return mul(self, -1)

    def __mul__(self, other):
        return mul(self, other)

    __rmul__ = __mul__

    def __floordiv__(self, other):
        return floordiv(self, other)

    def __rfloordiv__(self, other):
        return floordiv(other, self)

    def __mod__(self, other):
        return mod(self, other)

    def __rmod__(self, other):
        return mod(other, self)

    # -- queries (subclasses define) --
    def bounds(self) -> tuple[int, int]:
        """(lowest, highest) value over every assignment of the variables within their bounds."""
        raise NotImplementedError

    def free_vars(self) -> frozenset:
        raise NotImplementedError

    def subs(self, values: dict) -> "Expr":
        """The expression with variables replaced (values: Var -> Expr or int), simplified again."""
        raise NotImplementedError

    def evaluate(self, values: dict) -> int:
        """The value with every variable given (values: Var or its name -> int)."""
        raise NotImplementedError

    def render(self) -> str:
        """C++ (int64_t arithmetic) computing the expression."""
        raise NotImplementedError

    @property
    def is_atom(self) -> bool:
        """Renders without operators (needs no parentheses as an operand)."""
        return False

    def __str__(self):
        return self.render()

    def __bool__(self):
        raise TypeError(f"the truth value of {self!r} depends on its variables")


class Const(Expr):
    __slots__ = ("value",)

    def __init__(self, value: int):
        self.value = int(value)

    def _make_key(self):
        return ("const", self.value)

    def __hash__(self):   # equal to the int: Const(3) == 3
        return hash(self.value)

    def __int__(self):
        return self.value

    def __bool__(self):
        return self.value != 0

    __index__ = __int__

    def bounds(self):
        return self.value, self.value

    def free_vars(self):
        return frozenset()

    def subs(self, values):
        return self

    def evaluate(self, values):
        return self.value

    def render(self):
        return str(self.value)

    @property
    def is_atom(self):
        return self.value >= 0


class Var(Expr):
    """A loop variable or a size symbol: an integer in [lo, hi], where lo and hi are ints or
    expressions over size symbols (a loop over a symbolic size: ``Var.loop("i0", seq)``)."""
    __slots__ = ("name", "lo", "hi")

    def __init__(self, name: str, lo, hi):
        self.name, self.lo, self.hi = name, as_expr(lo), as_expr(hi)
        if self.bounds()[0] > self.bounds()[1]:
            raise ValueError(f"{name} has an empty range [{lo}, {hi}]")

    @classmethod
    def loop(cls, name: str, extent) -> "Var":
        """The variable of `for (name = 0; name < extent; ++name)`. A loop that never runs gets
        [0, 0]: no value of the variable is ever used, so any bounds are true of it."""
        extent = as_expr(extent)
        return cls(name, 0, max(extent.value - 1, 0) if isinstance(extent, Const) else extent - 1)

    def _make_key(self):
        return ("var", self.name, self.lo.key, self.hi.key)

    def bounds(self):
        return self.lo.bounds()[0], self.hi.bounds()[1]

    def free_vars(self):
        return frozenset((self,))

    def subs(self, values):
        return as_expr(values.get(self, self))

    def evaluate(self, values):
        value = values[self] if self in values else values[self.name]
        return int(value)

    def render(self):
        return self.name

    @property
    def is_atom(self):
        return True


def as_expr(value) -> Expr:
    if isinstance(value, Expr):
        return value
    if hasattr(value, "__index__") and not isinstance(value, bool):   # int, numpy integers
        return Const(value.__index__())
    raise TypeError(f"not an integer expression: {value!r}")


def constant(e) -> int | None:
    """e's value if it is a constant, else None."""
    e = as_expr(e)
    return e.value if isinstance(e, Const) else None


# ---------------------------------------------------------------------------------------------
# Polynomials: Sum of coefficient * monomial (a monomial is any non-constant, non-Sum Expr;
# Prod is a product of two or more non-Prod monomials).

def _sort_key(e: Expr):
    return repr(e.key)


class Prod(Expr):
    __slots__ = ("factors",)

    def __init__(self, factors):
        self.factors = tuple(sorted(factors, key=_sort_key))

    def _make_key(self):
        return ("prod", tuple(f.key for f in self.factors))

    def bounds(self):
        return reduce(_interval_mul, (f.bounds() for f in self.factors))

    def free_vars(self):
        return frozenset().union(*(f.free_vars() for f in self.factors))

    def subs(self, values):
        return reduce(mul, (f.subs(values) for f in self.factors))

    def evaluate(self, values):
        return math.prod(f.evaluate(values) for f in self.factors)

    def render(self):
        return " * ".join(_operand(f) for f in self.factors)


class Sum(Expr):
    """const + sum(coef * monomial); terms keep the order they were first built in (for
    rendering only: equality and hashing ignore it)."""
    __slots__ = ("terms", "const")

    def __init__(self, terms, const: int):
        self.terms, self.const = tuple(terms), const

    def _make_key(self):
        return ("sum", frozenset((m.key, c) for m, c in self.terms), self.const)

    def bounds(self):
        """Term by term, except that a nonnegative factor several terms share is taken out of them
        first: ``batch * (len / 10) - batch`` is batch * (len / 10 - 1), at least 2 * 5 for batch
        >= 2 and len >= 60, where term by term its lowest is 2 * 6 - 15 < 0 (a conv's output
        length times the batch: HuBERT's feature encoder)."""
        lo = hi = self.const
        terms = list(self.terms)
        while len(terms) > 1:
            counts = {}
            for m, _ in terms:
                for f in set(_factors(m)):
                    counts[f] = counts.get(f, 0) + 1
            shared = sorted((f for f, n in counts.items() if n > 1 and f.bounds()[0] >= 0),
                            key=lambda f: (-counts[f], _sort_key(f)))
            if not shared:
                break
            common = shared[0]
            group = [(m, c) for m, c in terms if common in _factors(m)]
            terms = [(m, c) for m, c in terms if common not in _factors(m)]
            quotient = add(*(mul(_without(m, common), c) for m, c in group))
            a, b = _interval_mul(common.bounds(), quotient.bounds())
            lo, hi = lo + a, hi + b
        for m, c in terms:
            a, b = _interval_mul(m.bounds(), (c, c))
            lo, hi = lo + a, hi + b
        return lo, hi

    def free_vars(self):
        return frozenset().union(*(m.free_vars() for m, _ in self.terms))

    def subs(self, values):
        return add(self.const, *(mul(m.subs(values), c) for m, c in self.terms))

    def evaluate(self, values):
        return self.const + sum(c * m.evaluate(values) for m, c in self.terms)

    def render(self):
        parts = []
        for m, c in self.terms:
            # a monomial is a product at most: no parentheses in a sum, but c * (a / b) needs them
            text = m.render() if abs(c) == 1 else f"{abs(c)} * {m.render() if isinstance(m, Prod) else _operand(m)}"
            parts.append((c < 0, text))
        if self.const:
            parts.append((self.const < 0, str(abs(self.const))))
        negative, first = parts[0]
        first_monomial = self.terms[0][0] if self.terms else None
        if negative and abs(self.terms[0][1]) == 1 and not first_monomial.is_atom:
            first = f"({first})"
        out = ("-" if negative else "") + first
        for negative, text in parts[1:]:
            out += (" - " if negative else " + ") + text
        return out


def _operand(e: Expr) -> str:
    """e rendered as an operand of * / %: parenthesized unless atomic. (a * (b / c) differs from
    a * b / c in integer arithmetic, so divisions are parenthesized inside products too.)"""
    return e.render() if e.is_atom else f"({e.render()})"


def _interval_mul(a, b):
    corners = [x * y for x in a for y in b]
    return min(corners), max(corners)


def _linear(e: Expr) -> tuple[dict, int]:
    """e as ({monomial: coefficient}, constant), monomials in first-built order."""
    if isinstance(e, Const):
        return {}, e.value
    if isinstance(e, Sum):
        return dict(e.terms), e.const
    return {e: 1}, 0


def _from_linear(terms: dict, const: int) -> Expr:
    terms = {m: c for m, c in terms.items() if c != 0}
    if not terms:
        return Const(const)
    if const == 0 and len(terms) == 1:
        ((m, c),) = terms.items()
        if c == 1:
            return m
    return Sum(terms.items(), const)


def add(*operands) -> Expr:
    terms, const = {}, 0
    for operand in operands:
        t, c = _linear(as_expr(operand))
        const += c
        for m, coef in t.items():
            terms[m] = terms.get(m, 0) + coef
    return _from_linear(terms, const)


def _factors(m: Expr) -> tuple:
    return m.factors if isinstance(m, Prod) else (m,)


def _without(m: Expr, factor: Expr) -> Expr:
    """The monomial m with one occurrence of factor taken out (1 when m is that factor)."""
    rest = list(_factors(m))
    rest.remove(factor)
    return reduce(mul, rest, Const(1))


def _monomial_product(a: Expr, b: Expr) -> Expr:
    factors = _factors(a) + _factors(b)
    return Prod(factors)


def mul(a, b) -> Expr:
    a, b = as_expr(a), as_expr(b)
    ta, ca = _linear(a)
    tb, cb = _linear(b)
    terms = {m: c * cb for m, c in ta.items()}
    for m, c in tb.items():
        terms[m] = terms.get(m, 0) + c * ca
    for ma, xa in ta.items():
        for mb, xb in tb.items():
            m = _monomial_product(ma, mb)
            terms[m] = terms.get(m, 0) + xa * xb
    return _from_linear(terms, ca * cb)


# ---------------------------------------------------------------------------------------------
# Proofs from bounds

def proves_nonnegative(e) -> bool:
    """Whether e >= 0 for every value of its variables: from the numeric bounds, else by replacing
    each variable that has symbolic bounds and occurs only as a linear term by its extreme (lo
    where its coefficient is positive, hi where negative) and trying again on the result."""
    e = as_expr(e)
    if e.bounds()[0] >= 0:
        return True
    terms, const = _linear(e)
    # a remainder term a % d lies in [0, d - 1] at every point: its extreme by its coefficient's
    # sign (``n - shift % n`` >= 1, which the remainder's numeric bounds cannot show)
    remainders = {m: Const(0) if c > 0 else m.den - 1 for m, c in terms.items() if isinstance(m, Mod)}
    if remainders and proves_nonnegative(add(const, *(mul(remainders.get(m, m), c) for m, c in terms.items()))):
        return True
    # only variables that occur as terms of their own: e is then monotone in each of them
    nested = frozenset().union(*(m.free_vars() for m in terms if not isinstance(m, Var)))
    extremes = {}
    for m, c in terms.items():
        if isinstance(m, Var) and m not in nested and (m.lo.free_vars() or m.hi.free_vars()):
            extremes[m] = m.lo if c > 0 else m.hi
    if not extremes:
        return False
    return proves_nonnegative(e.subs(extremes))


def proves_less(a, b) -> bool:
    """Whether a < b always."""
    return proves_nonnegative(as_expr(b) - a - 1)


def proves_multiple(big, small, least: int = 1) -> bool:
    """Whether big = small * q exactly with q >= least, and small >= 1, at every size: products
    of size symbols (``seq < seq * batch``), which interval bounds alone cannot order."""
    small, big = as_expr(small), as_expr(big)
    if small.bounds()[0] < 1:
        return False
    try:
        q = big // small
    except ValueError:
        return False
    if q * small != big:
        q = _term_quotient(big, small)
    return q is not None and q * small == big and q.bounds()[0] >= least


def _term_quotient(big: Expr, small: Expr):
    """q with q * small == big where q is a term of big over a term of small (a divisor of several
    terms: 32 * b * s + 32 * b over 16 * s + 16 is 2 * b), else None."""
    small_terms, small_const = _linear(small)
    if not small_terms:
        return None
    lead, lead_coef = next(iter(small_terms.items()))
    big_terms, _ = _linear(big)
    for m, c in big_terms.items():
        q = _divides(mul(lead, lead_coef), c, m)
        if q is not None and q * small == big:
            return q
    return None


def proves_at_least(a, b) -> bool:
    """Whether a >= b at every size (by bounds, or as an exact multiple)."""
    return proves_nonnegative(as_expr(a) - b) or proves_multiple(a, b, 1)


def size_less(a, b) -> bool:
    """a < b for sizes (ints or expressions), decided when provable either way, else TypeError:
    a compile stage then refuses the run-time sizes rather than guessing."""
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    if proves_less(a, b) or proves_multiple(b, a, 2):
        return True
    if proves_nonnegative(as_expr(a) - b) or proves_multiple(a, b, 1):
        return False
    raise TypeError(f"cannot order sizes {a} and {b} at every run-time size")


def _positive(divisor: Expr, what: str) -> Expr:
    if divisor.bounds()[0] < 1:
        raise ValueError(f"{what} by {divisor.render()}, which may be < 1")
    return divisor


def _divides(divisor: Expr, coef: int, monomial: Expr):
    """(coef * monomial) / divisor as an Expr if it divides exactly, else None."""
    k = constant(divisor)
    if k is not None:
        return None if coef % k else mul(coef // k, monomial)
    # a symbolic divisor c * m': divides when m' is a sub-product of the monomial's factors
    dterms, dconst = _linear(divisor)
    if dconst or len(dterms) != 1:
        return None
    ((dm, dc),) = dterms.items()
    if coef % dc:
        return None
    rest = list(_factors(monomial))
    for f in _factors(dm):
        if f not in rest:
            return None
        rest.remove(f)
    return mul(coef // dc, reduce(mul, rest, Const(1)))


def _split(e: Expr, divisor: Expr):
    """(quotient, remainder) with e = divisor * quotient + remainder, taking the terms of e that
    divisor divides exactly (and for a constant divisor, the constant's multiple of it) into the
    quotient."""
    terms, const = _linear(e)
    quotient, remainder = [], {}
    for m, c in terms.items():
        q = _divides(divisor, c, m)
        if q is None:
            remainder[m] = c
        else:
            quotient.append(q)
    k = constant(divisor)
    if k is not None:   # the constant too: c = k (c // k) + c % k, the remainder in [0, k)
        quotient.append(Const(const // k))
        const %= k
    return add(*quotient), _from_linear(remainder, const)


def _factor_out(e: Expr, k: int):
    """(g, a, r) with e = g a + r, g > 1 a divisor of k and 0 <= r < g provable, the largest such
    g; else None. Then e // k = a // (k / g) and e % k = g (a % (k / g)) + r: the remainder r is
    below one step of g a, so it never carries into the quotient."""
    terms, const = _linear(e)
    for g in sorted({math.gcd(k, c) for c in terms.values()} - {1}, reverse=True):
        a = _from_linear({m: c // g for m, c in terms.items() if c % g == 0}, const // g)
        r = _from_linear({m: c for m, c in terms.items() if c % g}, const % g)
        if proves_nonnegative(r) and proves_less(r, g):
            return g, a, r
    return None


class _Division(Expr):
    """num // den or num % den (den >= 1), floor semantics; `cpp` is the C++ operator, which
    truncates: it renders only for a dividend provably >= 0."""
    __slots__ = ("num", "den")
    cpp = ""

    def __init__(self, num: Expr, den: Expr):
        self.num, self.den = num, den

    def _make_key(self):
        return (self.cpp, self.num.key, self.den.key)

    def free_vars(self):
        return self.num.free_vars() | self.den.free_vars()

    def subs(self, values):
        return self.build(self.num.subs(values), self.den.subs(values))

    def evaluate(self, values):
        return self.apply(self.num.evaluate(values), self.den.evaluate(values))

    def render(self):
        if proves_nonnegative(self.num):
            return f"{_operand(self.num)} {self.cpp} {_operand(self.den)}"
        # a dividend >= -den (a roll's (i - shift % n) % n): shifted by one divisor it is >= 0, with
        # the same remainder and a quotient one more
        if proves_nonnegative(self.num + self.den):
            shifted = f"({_operand(self.num + self.den)} {self.cpp} {_operand(self.den)})"
            return shifted if self.cpp == "%" else f"({shifted} - 1)"
        raise ValueError(f"C++ {self.cpp} truncates: {self.num!r} may be negative, where it differs "
                         "from floor division")


class FloorDiv(_Division):
    __slots__ = ()
    cpp = "/"
    apply = staticmethod(operator.floordiv)
    build = staticmethod(lambda a, b: floordiv(a, b))

    def bounds(self):
        (a, b), (c, d) = self.num.bounds(), self.den.bounds()   # c >= 1
        corners = [x // y for x in (a, b) for y in (c, d)]
        return min(corners), max(corners)


class Mod(_Division):
    __slots__ = ()
    cpp = "%"
    apply = staticmethod(operator.mod)
    build = staticmethod(lambda a, b: mod(a, b))

    def bounds(self):
        lo, hi = self.num.bounds()
        top = self.den.bounds()[1] - 1
        return (0, min(hi, top)) if lo >= 0 else (0, top)


def floordiv(a, b) -> Expr:
    """floor(a / b) for b >= 1."""
    a, b = as_expr(a), _positive(as_expr(b), "floor division")
    if constant(b) == 1:
        return a
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(a.value // b.value)
    k = constant(b)
    if k is not None:
        factored = _factor_out(a, k)
        if factored is not None:
            g, a, _ = factored
            return floordiv(a, k // g)
        if isinstance(a, FloorDiv) and constant(a.den) is not None:   # (x // m) // k = x // (m k)
            return floordiv(a.num, constant(a.den) * k)
        terms, c = _linear(a)
        (inner, coefficient), = terms.items() if len(terms) == 1 else ((None, 0),)
        if coefficient == 1 and isinstance(inner, FloorDiv) and constant(inner.den) is not None:
            # (x // m + c) // k = (x + c m) // (m k): strided convs and pools chained (ceil(ceil(s/2)/2)
            # as ONNX infers it, (s + 3) // 4 as the rules compute it) render as one expression
            m = constant(inner.den)
            return floordiv(add(inner.num, Const(c * m)), m * k)
    quotient, remainder = _split(a, b)
    if proves_nonnegative(remainder) and proves_less(remainder, b):
        return quotient
    if constant(quotient) == 0:
        return FloorDiv(remainder, b)
    return add(quotient, floordiv(remainder, b))


def mod(a, b) -> Expr:
    """a - b * floor(a / b) for b >= 1 (Python's %: in [0, b))."""
    a, b = as_expr(a), _positive(as_expr(b), "remainder")
    if constant(b) == 1:
        return Const(0)
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(a.value % b.value)
    k = constant(b)
    _, remainder = _split(a, b)
    if k is not None:
        factored = _factor_out(remainder, k)
        if factored is not None:
            g, a, r = factored
            return add(mul(g, mod(a, k // g)), r)
        if isinstance(remainder, Mod) and constant(remainder.den) is not None and constant(remainder.den) % k == 0:
            remainder = remainder.num   # (x % (m k)) % k = x % k
            _, remainder = _split(remainder, b)
    if proves_nonnegative(remainder) and proves_less(remainder, b):
        return remainder
    return Mod(remainder, b)


# ---------------------------------------------------------------------------------------------
# min / max

class _MinMax(Expr):
    """The smaller (Min) or larger (Max) of two expressions; `pick` is Python's min or max."""
    __slots__ = ("args",)
    pick = None

    def __init__(self, args):
        self.args = tuple(sorted(args, key=_sort_key))

    def _make_key(self):
        return (self.pick.__name__, tuple(a.key for a in self.args))

    def bounds(self):
        (a, b), (c, d) = (x.bounds() for x in self.args)
        return self.pick(a, c), self.pick(b, d)

    def free_vars(self):
        return frozenset().union(*(a.free_vars() for a in self.args))

    def subs(self, values):
        return _ordered(self.pick, *(a.subs(values) for a in self.args))

    def evaluate(self, values):
        return self.pick(a.evaluate(values) for a in self.args)

    def render(self):
        return f"std::{self.pick.__name__}<int64_t>({', '.join(a.render() for a in self.args)})"

    @property
    def is_atom(self):
        return True


class Min(_MinMax):
    __slots__ = ()
    pick = staticmethod(min)


class Max(_MinMax):
    __slots__ = ()
    pick = staticmethod(max)


def _ordered(pick, a, b) -> Expr:
    """pick(a, b) (Python's min or max): one side when the bounds order them, else Min/Max."""
    a, b = as_expr(a), as_expr(b)
    if proves_nonnegative(b - a):      # a <= b
        return a if pick is min else b
    if proves_nonnegative(a - b):
        return b if pick is min else a
    return (Min if pick is min else Max)((a, b))


def minimum(a, b) -> Expr:
    return _ordered(min, a, b)


def maximum(a, b) -> Expr:
    return _ordered(max, a, b)


def render(value) -> str:
    """C++ of an int or an Expr."""
    return as_expr(value).render()
