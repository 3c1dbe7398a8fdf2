"""Values of answers read by `math_expr`, and the equivalence verdict the rule rewards use (`same_value`).

Exact `Fraction`s while rational, else complex floats; letters are evaluated at fixed points. Anything over the
bounds is undecided, never computed. An exact side with a decimal never equals an inexact one (`6.28` != `2\\pi`)."""

from __future__ import annotations

import cmath
import math
from fractions import Fraction

from slime.rollout.rm_hub.math_expr import FUNCTIONS, Expression, NotEvaluable

MAX_EXACT_BITS = 4096
MAX_FACTORIAL = 300
MAX_VARIABLES = 6
N_POINTS = 3
REL_TOL = 1e-11
MAX_MAGNITUDE = 1e250

# distinct "random-looking" rationals; variable j at point k takes _POINT_VALUES[(k + 4 j) % 13]
_POINT_VALUES = tuple(Fraction(n, d) for n, d in (
    (7, 5), (-9, 7), (13, 11), (5, 3), (-11, 13), (17, 9), (3, 7), (-19, 17), (23, 13), (2, 11), (-4, 3), (29, 19), (8, 9)))


def _int_root(v: int, n: int) -> int | None:
    if v < 2:
        return v
    if v.bit_length() > MAX_EXACT_BITS:
        return None
    if n == 2:
        r = math.isqrt(v)
        return r if r * r == v else None
    r = round(v ** (1.0 / n)) if v.bit_length() < 1000 else None
    if r is None:
        return None
    for c in (r - 1, r, r + 1):
        if c >= 0 and c**n == v:
            return c
    return None


def _exact_root(q: Fraction, n: int) -> Fraction | None:
    if q < 0:
        if n % 2 == 0:
            return None
        r = _exact_root(-q, n)
        return None if r is None else -r
    a, b = _int_root(q.numerator, n), _int_root(q.denominator, n)
    return None if a is None or b is None else Fraction(a, b)


def _inexact(z) -> complex:
    z = complex(z)
    if not (cmath.isfinite(z) and abs(z) < MAX_MAGNITUDE):
        raise NotEvaluable("not a finite value")
    return z


def _bits(q: Fraction) -> int:
    return max(q.numerator.bit_length(), q.denominator.bit_length())


def _power(base, exp):
    if isinstance(base, Fraction) and isinstance(exp, Fraction):
        if base == 0 and exp <= 0:
            raise NotEvaluable("0 to a non-positive power")
        p, q = exp.numerator, exp.denominator
        root = base if q == 1 else (_exact_root(base, q) if q <= 64 and base >= 0 else None)
        if root is not None:
            if _bits(root) * abs(p) > MAX_EXACT_BITS:
                raise NotEvaluable("power too large")
            return root**p
    b, e = _inexact(base), _inexact(exp)
    if abs(e) * max(1.0, math.log2(abs(b) + 1.0)) > 1000:
        raise NotEvaluable("power too large")
    return _inexact(b**e)


def _as_int(v) -> int:
    if not isinstance(v, Fraction) or v.denominator != 1:
        raise NotEvaluable("needs an integer")
    return v.numerator


def _eval(node: tuple, env: dict):
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "var":
        return env[node[1]]
    if kind in ("add", "sub", "mul", "div"):
        a, b = _eval(node[1], env), _eval(node[2], env)
        exact = isinstance(a, Fraction) and isinstance(b, Fraction)
        if not exact:
            a, b = _inexact(a), _inexact(b)
        if kind == "add":
            r = a + b
        elif kind == "sub":
            r = a - b
        elif kind == "mul":
            r = a * b
        else:
            if b == 0:
                raise NotEvaluable("division by zero")
            r = a / b
        if exact:
            if _bits(r) > MAX_EXACT_BITS:
                raise NotEvaluable("number too large")
            return r
        return _inexact(r)
    if kind == "neg":
        return -_eval(node[1], env)
    if kind == "pow":
        return _power(_eval(node[1], env), _eval(node[2], env))
    if kind == "pi":
        return complex(math.pi)
    if kind == "root":
        x = _eval(node[2], env)
        n = 2 if node[1] is None else _as_int(_eval(node[1], env))
        if n < 2 or n > 64:
            raise NotEvaluable("root index")
        if isinstance(x, Fraction):
            r = _exact_root(x, n)
            if r is not None:
                return r
            if x < 0 and n % 2 == 1:  # \sqrt[3]{-2} is the real root
                return -_inexact(float(-x) ** (1.0 / n))
        return _inexact(_inexact(x) ** (1.0 / n))
    if kind == "fn":
        x = _eval(node[2], env)
        if isinstance(x, Fraction) and x == 0 and node[1] in ("sin", "tan", "arcsin", "arctan", "sinh", "tanh"):
            return Fraction(0)
        try:
            return _inexact(FUNCTIONS[node[1]](_inexact(x)))
        except (ValueError, ZeroDivisionError, OverflowError) as e:
            raise NotEvaluable(str(e)) from e
    if kind == "fact":
        n = _as_int(_eval(node[1], env))
        if not 0 <= n <= MAX_FACTORIAL:
            raise NotEvaluable("factorial out of range")
        return Fraction(math.factorial(n))
    if kind == "binom":
        n, k = _as_int(_eval(node[1], env)), _as_int(_eval(node[2], env))
        if not 0 <= n <= 10 * MAX_FACTORIAL:
            raise NotEvaluable("binomial out of range")
        return Fraction(math.comb(n, k) if 0 <= k <= n else 0)
    if kind == "abs":
        x = _eval(node[1], env)
        return abs(x) if isinstance(x, Fraction) else _inexact(abs(x))
    if kind in ("floor", "ceil"):
        x = _eval(node[1], env)
        if not isinstance(x, Fraction):
            x = _inexact(x)
            if abs(x.imag) > REL_TOL:
                raise NotEvaluable("floor of a complex value")
            x = x.real
        return Fraction(math.floor(x) if kind == "floor" else math.ceil(x))
    raise NotEvaluable(f"unknown node {kind}")


def evaluate(expr: Expression, env: dict | None = None):
    """Value of `expr` (Fraction or complex) with variables bound by `env`; raises NotEvaluable."""
    try:
        return _eval(expr.tree, env or {})
    except (ZeroDivisionError, OverflowError, ValueError, KeyError, RecursionError) as e:
        raise NotEvaluable(str(e)) from e


def _close(a, b) -> bool:
    a, b = complex(a), complex(b)
    return abs(a - b) <= REL_TOL * max(1.0, abs(a), abs(b))


def _equal_values(a, b, a_decimal: bool, b_decimal: bool) -> bool:
    a_exact, b_exact = isinstance(a, Fraction), isinstance(b, Fraction)
    if a_exact and b_exact:
        return a == b
    if (a_exact and a_decimal) or (b_exact and b_decimal):
        return False  # a decimal approximation of an irrational value
    try:
        return _close(a, b)
    except OverflowError:
        return False


def points(names: list[str]) -> list[dict]:
    """The fixed evaluation points for these variable names (one empty point when there are none)."""
    if not names:
        return [{}]
    return [{n: _POINT_VALUES[(k + 4 * j) % len(_POINT_VALUES)] for j, n in enumerate(names)} for k in range(N_POINTS)]


def same_value(a: Expression, b: Expression) -> bool | None:
    """True/False when decided; None when either side cannot be evaluated (at enough points)."""
    names = sorted(a.variables | b.variables)
    if len(names) > MAX_VARIABLES:
        return None
    agreed = 0
    envs = points(names)
    for env in envs:
        try:
            va, vb = evaluate(a, env), evaluate(b, env)
        except NotEvaluable:
            continue
        if not _equal_values(va, vb, a.has_decimal, b.has_decimal):
            return False
        agreed += 1
    return True if agreed >= min(2, len(envs)) else None
