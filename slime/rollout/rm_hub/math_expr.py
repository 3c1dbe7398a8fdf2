"""Read a final answer (LaTeX or plain) into a small expression tree: the slow half of the rule rewards'
equivalence check (upstream: `sympy.simplify`). Too long, too deep or outside the grammar: not read (undecided)."""

from __future__ import annotations

import cmath
import re
from dataclasses import dataclass
from fractions import Fraction

MAX_CHARS = 400
MAX_DEPTH = 60

_TOKEN = re.compile(r"(\d+(?:\.\d*)?|\.\d+)|(\\[a-zA-Z]+|\\[{}|])|([a-zA-Z]+)|(\*\*|[-+*/^_()\[\]{}!|,])|(\s+)")

# the functions we read, with the (principal-branch) complex function `math_value` evaluates them with
FUNCTIONS = {
    "sin": cmath.sin, "cos": cmath.cos, "tan": cmath.tan, "sec": lambda z: 1 / cmath.cos(z),
    "csc": lambda z: 1 / cmath.sin(z), "cot": lambda z: 1 / cmath.tan(z), "arcsin": cmath.asin,
    "arccos": cmath.acos, "arctan": cmath.atan, "sinh": cmath.sinh, "cosh": cmath.cosh, "tanh": cmath.tanh,
    "ln": cmath.log, "log": cmath.log, "exp": cmath.exp,
}
_GREEK = frozenset(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho sigma tau "
    "upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega".split())
# plain-text words read as commands (`2pi`, `sqrt(2)`); any other letter run is a product of variables
_WORDS = frozenset(FUNCTIONS) | {"pi", "sqrt"}
_MUL_COMMANDS = frozenset({"\\cdot", "\\times", "\\ast"})
_PRIMARY_COMMANDS = frozenset({"\\frac", "\\sqrt", "\\pi", "\\binom", "\\lfloor", "\\lceil", "\\infty"})


class NotEvaluable(Exception):
    """The answer is outside what this reader evaluates (undecided, not wrong)."""


@dataclass(frozen=True)
class Expression:
    tree: tuple
    variables: frozenset
    has_decimal: bool  # a literal such as 0.33 or 6.28 (not 2.0): the writer approximated
    # unambiguous plain arithmetic: every reader (sympy, math-verify) gives it the value we do
    plain: bool = False


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise NotEvaluable(f"cannot read {text[pos:pos + 10]!r}")
        pos = m.end()
        num, cmd, word, op, _ = m.groups()
        if num is not None:
            out.append(("num", num))
        elif cmd is not None:
            out.append(("cmd", cmd))
        elif word is not None:
            if word in _WORDS:
                out.append(("cmd", "\\" + word))
            else:
                out.extend(("var", ch) for ch in word)
        elif op is not None:
            out.append(("op", "^" if op == "**" else op))
    return out


class _Parser:
    """Recursive descent: sum > product (explicit or juxtaposed) > sign > power > factorial > primary."""

    def __init__(self, tokens: list[tuple[str, str]]):
        self.toks, self.i, self.depth = tokens, 0, 0
        self.variables: set[str] = set()
        self.has_decimal = False
        self.plain = True
        self.in_abs = False

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("end", "")

    def take(self, text: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok[0] == "end" or (text is not None and tok[1] != text):
            raise NotEvaluable(f"expected {text!r}, got {tok[1]!r}")
        self.i += 1
        return tok

    def enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise NotEvaluable("nested too deep")

    def parse(self) -> tuple:
        tree = self.sum()
        if self.i != len(self.toks):
            raise NotEvaluable(f"unexpected {self.peek()[1]!r}")
        return tree

    def sum(self) -> tuple:
        self.enter()
        node = self.product()
        while self.peek() in (("op", "+"), ("op", "-")):
            op = self.take()[1]
            node = ("add" if op == "+" else "sub", node, self.product())
        self.depth -= 1
        return node

    def starts_primary(self, tok: tuple[str, str]) -> bool:
        kind, text = tok
        if kind in ("num", "var"):
            return True
        if kind == "op":
            return text in "([{" or (text == "|" and not self.in_abs)
        return kind == "cmd" and (text in _PRIMARY_COMMANDS or text[1:] in FUNCTIONS or text[1:] in _GREEK)

    def product(self) -> tuple:
        node = self.signed()
        while True:
            tok = self.peek()
            if tok in (("op", "*"), ("op", "/")) or (tok[0] == "cmd" and (tok[1] in _MUL_COMMANDS or tok[1] == "\\div")):
                self.take()
                rhs = self.signed()
                node = ("div", node, rhs) if tok[1] in ("/", "\\div") else ("mul", node, rhs)
            elif self.starts_primary(tok):
                node = ("mul", node, self.power())
            else:
                return node

    def signed(self) -> tuple:
        tok = self.peek()
        if tok == ("op", "-"):
            self.take()
            self.enter()
            node = ("neg", self.signed())
            self.depth -= 1
            return node
        if tok == ("op", "+"):
            self.take()
            return self.signed()
        return self.power()

    def power(self) -> tuple:
        base = self.postfix()
        if self.peek() == ("op", "^"):
            self.take()
            return ("pow", base, self.exponent())
        return base

    def exponent(self) -> tuple:
        self.enter()
        tok = self.peek()
        if tok in (("op", "-"), ("op", "+")):
            self.take()
            node = self.exponent()
            node = ("neg", node) if tok[1] == "-" else node
        else:
            kind, text = self.peek()
            if kind == "num" and len(text) > 1:  # x^23: TeX reads x^2 3, plain text x^23
                self.plain = False
            node = self.postfix()
            if self.peek() == ("op", "^"):  # right associative: 2^3^2 = 2^(3^2)
                self.take()
                node = ("pow", node, self.exponent())
        self.depth -= 1
        return node

    def postfix(self) -> tuple:
        node = self.primary()
        while self.peek() == ("op", "!"):
            self.take()
            self.plain = False
            node = ("fact", node)
        return node

    def group(self, close: str) -> tuple:
        self.enter()
        saved, self.in_abs = self.in_abs, close == "|"
        node = self.sum()
        self.take(close)
        self.in_abs = saved
        self.depth -= 1
        return node

    def argument(self) -> tuple:
        """A command's argument: `{...}`, or one token (`\\frac12` after normalisation is `\\frac{1}{2}`)."""
        if self.peek() == ("op", "{"):
            self.take()
            return self.group("}")
        return self.postfix()

    def primary(self) -> tuple:
        kind, text = tok = self.take()
        if kind == "num":
            value = Fraction(text)
            if "." in text and value.denominator != 1:
                self.has_decimal = True
            return ("num", value)
        if kind == "var":
            return self.variable(text)
        if kind == "op":
            if text in "([{":
                return self.group({"(": ")", "[": "]", "{": "}"}[text])
            if text == "|" and not self.in_abs:
                self.plain = False
                return ("abs", self.group("|"))
            raise NotEvaluable(f"unexpected {text!r}")
        name = text[1:]
        if name in _GREEK:
            return self.variable(text)
        if name == "pi":
            return ("pi",)
        if name == "frac":
            return ("div", self.argument(), self.argument())
        if name == "binom":
            self.plain = False
            return ("binom", self.argument(), self.argument())
        if name == "sqrt":
            index = None
            if self.peek() == ("op", "["):
                self.take()
                index = self.group("]")
            return ("root", index, self.argument())
        if name in ("lfloor", "lceil"):
            self.plain = False
            inner = self.sum()
            self.take("\\rfloor" if name == "lfloor" else "\\rceil")
            return (name[1:], inner)
        if name in FUNCTIONS:
            self.plain = False
            return self.function(name)
        raise NotEvaluable(f"unknown command {tok[1]!r}")

    def variable(self, name: str) -> tuple:
        if self.peek() == ("op", "_"):  # a_1, x_{n}: one name
            self.take()
            if self.peek() == ("op", "{"):
                start = self.i
                self.take()
                self.group("}")
                name += "_" + "".join(t for _, t in self.toks[start:self.i])
            else:
                name += "_" + self.take()[1]
        self.variables.add(name)
        return ("var", name)

    def function(self, name: str) -> tuple:
        power = None
        if self.peek() == ("op", "^"):  # \sin^2 x = (\sin x)^2
            self.take()
            power = self.exponent()
        base = None
        if name == "log" and self.peek() == ("op", "_"):
            self.take()
            kind, text = self.peek()
            if kind == "num" and len(text) > 1 and text.isdigit():  # TeX subscripts take one character: \log_28
                self.toks[self.i] = ("num", text[1:])
                base = ("num", Fraction(int(text[0])))
            else:
                base = self.argument()
        if self.peek() in (("op", "("), ("op", "{")):
            arg = self.group(")" if self.take()[1] == "(" else "}")
        else:  # \sin 2x: the juxtaposed factors up to the next function or operator
            arg = self.power()
            while self.starts_primary(self.peek()) and not (self.peek()[0] == "cmd" and self.peek()[1][1:] in FUNCTIONS):
                arg = ("mul", arg, self.power())
        node = ("fn", name, arg) if base is None else ("div", ("fn", "ln", arg), ("fn", "ln", base))
        return node if power is None else ("pow", node, power)


def read(text: str) -> Expression | None:
    """The expression an answer denotes, or None when it is outside what we read (sets, equations, words...)."""
    if not text or len(text) > MAX_CHARS:
        return None
    try:
        parser = _Parser(_tokens(text))
        tree = parser.parse()
    except NotEvaluable:
        return None
    variables = frozenset(parser.variables)
    return Expression(tree, variables, parser.has_decimal, parser.plain and not variables & {"e", "i"})
