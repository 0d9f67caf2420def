"""Symbolic sizes of a .pt2, parsed by amplite's own grammar and built as sympy objects: nothing is evaluated.

torch's deserializer hands every ``expr_str`` to ``sympy.sympify``, which is ``eval`` with every builtin in
reach. amplite never lets it: each expression is parsed here and the field is replaced by the sympy object
built from it (``sympify`` returns a sympy object unchanged), so torch's code sees no string to evaluate.

The grammar is what torch's serializer writes (``sympy.srepr``) plus plain infix arithmetic::

    expr   := call | name | int | float | string | expr OP expr | -expr | (expr)
    call   := FUNC "(" [expr {"," expr}] {"," KEYWORD "=" bool} ")"
    FUNC   := one of CALLS below (sympy's classes and torch's size functions)
    OP     := + - * // % ** (and comparisons, & |)

Python's ``ast`` module reads the text into a tree (parsing runs no code); a node of any other kind (an
attribute, a subscript, a call of anything not in :data:`CALLS`, a parenthesised callee) is refused. Sizes stay
small: integer literals have at most 20 digits, powers and shifts take a literal exponent of at most
:data:`MAX_EXPONENT` and never nest, and the text and its tree are bounded, so building a value cannot hang.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from typing import Any

import sympy
import torch.utils._sympy.functions as tfn
from torch.utils._sympy.numbers import IntInfinity, NegativeIntInfinity, int_oo

MAX_LENGTH = 10_000
MAX_NODES = 2_000
MAX_DEPTH = 64
MAX_DIGITS = 20
MAX_EXPONENT = 64
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ASSUMPTIONS = frozenset(
    {"integer", "positive", "nonnegative", "negative", "nonpositive", "real", "finite", "zero", "nonzero",
     "rational", "even", "odd", "prime", "composite", "extended_real", "commutative", "infinite"}
)  # fmt: skip

#: The functions an expression may call, by the name torch's printer writes.
CALLS: dict[str, Callable[..., Any]] = {
    **{
        name: getattr(sympy, name)
        for name in (
            "Integer", "Rational", "Add", "Mul", "Pow", "Max", "Min", "Abs", "floor", "ceiling", "Eq", "Ne", "Lt",
            "Le", "Gt", "Ge", "Equality", "Unequality", "StrictLessThan", "StrictGreaterThan", "LessThan",
            "GreaterThan", "And", "Or", "Not", "Piecewise", "Tuple", "sqrt",
        )
    },
    **{
        name: getattr(tfn, name)
        for name in (
            "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt",
            "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv",
            "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal",
            "ToFloat", "Identity", "BitwiseFn_bitwise_and", "BitwiseFn_bitwise_or", "BitwiseFn_bitwise_xor",
        )
        if hasattr(tfn, name)
    },
    **{name: getattr(tfn, name) for name in dir(tfn) if name.startswith("OpaqueUnaryFn_")},
    "ExprCondPair": sympy.functions.elementary.piecewise.ExprCondPair,
    "IntInfinity": IntInfinity,
    "NegativeIntInfinity": NegativeIntInfinity,
}  # fmt: skip
_CONSTANTS: dict[str, Any] = {
    "oo": sympy.oo, "zoo": sympy.zoo, "nan": sympy.nan, "int_oo": int_oo, "true": sympy.true, "false": sympy.false,
    "pi": sympy.pi, "E": sympy.E,
}  # fmt: skip
# Functions whose second argument is an exponent or a shift: bounded, and never applied to a power again.
_POWERS = frozenset({"Pow", "PowByNatural", "FloatPow", "LShift", "RShift", "RoundDecimal"})
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: tfn.FloorDiv,
    ast.Mod: tfn.Mod, ast.Pow: sympy.Pow, ast.BitAnd: sympy.And, ast.BitOr: sympy.Or,
}  # fmt: skip
_COMPARE: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: sympy.Eq, ast.NotEq: sympy.Ne, ast.Lt: sympy.Lt, ast.LtE: sympy.Le, ast.Gt: sympy.Gt, ast.GtE: sympy.Ge,
}  # fmt: skip


class SymExprError(ValueError):
    """An expression outside the grammar, or one whose value would be unbounded."""


def parse_sym_expr(text: str, symbols: dict[str, sympy.Symbol] | None = None) -> Any:
    """The sympy object ``text`` denotes, built without evaluating any of it.

    Args:
        text: An ``expr_str`` of a .pt2 program (``sympy.srepr`` output or infix arithmetic).
        symbols: Symbols already built for this program, by name: a bare name reuses one (same assumptions).

    Raises:
        SymExprError: A construct outside the grammar, a bound exceeded, or a value sympy cannot build.
    """
    if not isinstance(text, str) or len(text) > MAX_LENGTH:
        raise SymExprError("is not a string of at most 10,000 characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise SymExprError(f"does not parse ({type(exc).__name__})") from None
    count = sum(1 for _ in ast.walk(tree))
    if count > MAX_NODES:
        raise SymExprError(f"has {count} parts (at most {MAX_NODES})")
    builder = _Builder(symbols if symbols is not None else {})
    try:
        return builder.build(tree.body, 0, in_power=False)
    except SymExprError:
        raise
    except (TypeError, ValueError, ArithmeticError, AttributeError, RecursionError) as exc:
        raise SymExprError(f"cannot be built ({type(exc).__name__}: {str(exc)[:80]})") from None


class _Builder:
    def __init__(self, symbols: dict[str, sympy.Symbol]) -> None:
        self.symbols = symbols

    def build(self, node: ast.AST, depth: int, *, in_power: bool) -> Any:
        if depth > MAX_DEPTH:
            raise SymExprError(f"nests deeper than {MAX_DEPTH}")
        if isinstance(node, ast.Constant):
            return self._literal(node.value)
        if isinstance(node, ast.Name):
            return self._name(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Not, ast.Invert)):
            value = self.build(node.operand, depth + 1, in_power=in_power)
            if isinstance(node.op, ast.USub):
                return -value
            return value if isinstance(node.op, ast.UAdd) else sympy.Not(value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            power = isinstance(node.op, ast.Pow)
            if power and in_power:
                raise SymExprError("nests a power inside a power")
            left = self.build(node.left, depth + 1, in_power=in_power or power)
            right = self.build(node.right, depth + 1, in_power=in_power or power)
            if power:
                _check_exponent(right)
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
            left = self.build(node.left, depth + 1, in_power=in_power)
            right = self.build(node.comparators[0], depth + 1, in_power=in_power)
            return _COMPARE[type(node.ops[0])](left, right)
        if isinstance(node, ast.Call):
            return self._call(node, depth, in_power=in_power)
        raise SymExprError(f"contains {type(node).__name__}, which is not part of a size expression")

    def _literal(self, value: Any) -> Any:
        if isinstance(value, bool):
            return sympy.true if value else sympy.false
        if isinstance(value, int):
            if len(str(abs(value))) > MAX_DIGITS:
                raise SymExprError(f"has an integer of more than {MAX_DIGITS} digits")
            return sympy.Integer(value)
        if isinstance(value, float):
            return sympy.Float(value)
        raise SymExprError(f"has a literal of type {type(value).__name__} outside a call")

    def _name(self, name: str) -> Any:
        if name in _CONSTANTS:
            return _CONSTANTS[name]
        if name in self.symbols:
            return self.symbols[name]
        if not _SYMBOL.match(name) or name.startswith("_") or name in CALLS:
            raise SymExprError(f"names {name[:40]!r}, which is not a symbol")
        symbol = sympy.Symbol(name, integer=True)
        self.symbols[name] = symbol
        return symbol

    def _call(self, node: ast.Call, depth: int, *, in_power: bool) -> Any:
        if not isinstance(node.func, ast.Name):
            raise SymExprError("calls something that is not a function name")
        name = node.func.id
        if name == "Symbol":
            return self._symbol(node)
        if name == "Float":
            return self._float(node)
        if name not in CALLS:
            raise SymExprError(f"calls {name[:40]!r}, which is not a size function")
        if node.keywords:
            raise SymExprError(f"passes keywords to {name}")
        power = name in _POWERS
        if power and in_power:
            raise SymExprError("nests a power inside a power")
        if name in ("Integer", "Rational"):
            args = [self._int_arg(arg) for arg in node.args]
        else:
            args = [self.build(arg, depth + 1, in_power=in_power or power) for arg in node.args]
        if power:
            if len(args) != 2:
                raise SymExprError(f"calls {name} with {len(args)} arguments (2 expected)")
            _check_exponent(args[1])
        return CALLS[name](*args)

    def _int_arg(self, arg: ast.AST) -> int:
        negative = isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub)
        value = arg.operand if negative else arg  # type: ignore[attr-defined]
        if not (isinstance(value, ast.Constant) and type(value.value) is int):
            raise SymExprError("calls Integer/Rational with something other than an integer")
        if len(str(value.value)) > MAX_DIGITS:
            raise SymExprError(f"has an integer of more than {MAX_DIGITS} digits")
        return -value.value if negative else value.value

    def _symbol(self, node: ast.Call) -> sympy.Symbol:
        if len(node.args) != 1 or not isinstance(node.args[0], ast.Constant) or not isinstance(node.args[0].value, str):
            raise SymExprError("calls Symbol without a single name")
        name = node.args[0].value
        if not _SYMBOL.match(name) or name.startswith("_"):
            raise SymExprError(f"names the symbol {name[:40]!r}, which is not an identifier")
        assumptions: dict[str, bool] = {}
        for kw in node.keywords:
            if kw.arg not in _ASSUMPTIONS or not isinstance(kw.value, ast.Constant) or type(kw.value.value) is not bool:
                raise SymExprError(f"gives Symbol the keyword {str(kw.arg)[:40]!r}, which is not an assumption")
            assumptions[kw.arg] = kw.value.value
        if name in self.symbols:
            return self.symbols[name]
        symbol = sympy.Symbol(name, **assumptions)
        self.symbols[name] = symbol
        return symbol

    def _float(self, node: ast.Call) -> sympy.Float:
        if len(node.args) != 1 or not isinstance(node.args[0], ast.Constant):
            raise SymExprError("calls Float without a single literal")
        value = node.args[0].value
        if isinstance(value, str) and not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)(e[-+]?\d{1,3})?|[-+]?inf|nan", value):
            raise SymExprError(f"calls Float with {value[:40]!r}, which is not a number")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise SymExprError("calls Float with something other than a number")
        for kw in node.keywords:
            if kw.arg != "precision" or not isinstance(kw.value, ast.Constant) or kw.value.value not in (24, 53, 64):
                raise SymExprError("gives Float a keyword other than precision=24/53/64")
        return sympy.Float(value)


def _check_exponent(value: Any) -> None:
    """An exponent or shift is a small literal: 9**99999999 (or 2**s0 with a huge hint) would take minutes."""
    if isinstance(value, (sympy.Integer, sympy.Rational)) and abs(value) <= MAX_EXPONENT:
        return
    if isinstance(value, sympy.Float) and abs(value) <= MAX_EXPONENT:
        return
    raise SymExprError(f"raises to or shifts by {str(value)[:40]}, beyond the bound of {MAX_EXPONENT}")
