"""The strings of a .pt2's program JSON that torch evaluates or writes into generated code, checked.

torch's deserializer passes every ``expr_str`` to ``sympy.sympify`` (an ``eval``), pastes ``guards_code`` into a
function it ``exec``-s, resolves node targets by attribute lookup from ``torch``, and FX writes node and attribute
names into generated Python. These rules admit what ``torch.export.save`` writes and nothing that could run
code; the targets are returned for :mod:`amplite.converter.pt2` to resolve after ``--import``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from amplite.errors import LoadError

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
FQN = re.compile(r"([A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*)?\Z")
_FQN_KEYS = {
    "parameter_name", "buffer_name", "tensor_constant_name", "custom_obj_name", "user_input_name", "fqn",
}  # fmt: skip
_VALUE_MAPS = {"tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values", "custom_obj_values"}
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u2028\u2029]")
# A symbolic expression torch passes to sympy.sympify (an eval): names, numbers, plain quoted words (symbol
# names), arithmetic, comparisons, keyword arguments and calls of the sympy classes below. Attribute access,
# subscripts, lambdas and other strings are not part of torch's printer output (sympy.srepr).
_EXPR_TOKEN = re.compile(
    r"\s+|'[A-Za-z0-9_.+-]*'|[A-Za-z_][A-Za-z0-9_]*|\d+(\.\d*)?(e[+-]?\d+)?|\*\*|//|[-+*/%(),<>=!&|~]=?"
)
# Guards torch turns into Python and exec-s: "L['x'].size()[0] == 4", "L['x'].size()[0] >= 2", ...
_GUARD_TOKEN = re.compile(
    r"\s+|L(\['[A-Za-z0-9_]+'\]|\[\d+\])+|\.(size|stride|storage_offset|dim|numel)\(\)|\[\d+\]"
    r"|[A-Za-z_][A-Za-z0-9_]*|\d+(\.\d*)?(e[+-]?\d+)?|\*\*|//|[-+*/%(),<>=!&|~]=?"
)
# The functions a symbolic expression may call: torch's sympy functions (the deserializer's namespace) and the
# sympy classes torch's printer writes.
_SYMPY_CALLS = frozenset(
    {
        "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt",
        "CeilDiv", "IntTrueDiv", "FloatTrueDiv", "LShift", "RShift", "IsNonOverlappingAndDenseIndicator",
        "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "FloatPow", "PowByNatural",
        "Identity", "Max", "Min", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "Abs", "floor",
        "ceiling", "Piecewise", "sqrt",
        # sympy.srepr, which torch's serializer writes: Mul(Integer(2), Symbol('s0', positive=True, integer=True))
        "Integer", "Symbol", "Mul", "Add", "Pow", "Rational", "Float", "Equality", "Unequality", "StrictLessThan",
        "StrictGreaterThan", "LessThan", "GreaterThan", "ExprCondPair", "Tuple", "BooleanTrue", "BooleanFalse",
        "Half", "One", "Zero", "NegativeOne", "Infinity", "NegativeInfinity", "IntInfinity", "NegativeIntInfinity",
    }
)  # fmt: skip


def _refuse(path: Path, problem: str) -> LoadError:
    return LoadError(f"{str(path)!r}: {problem}", "re-save the model with torch.export.save (and copy the file again)")


def check_program_strings(path: Path, record: str, program: dict[str, Any]) -> set[str]:
    """Check ``program`` (the parsed ``models/model.json``); return every node target string.

    Raises:
        LoadError: A string torch would evaluate, or write into generated code, that torch does not write.
    """
    targets: set[str] = set()
    try:
        _walk(path, record, program, "", targets)
    except RecursionError:
        raise _refuse(path, f"{record} is nested too deeply") from None
    return targets


def _walk(path: Path, record: str, value: Any, key: str, targets: set[str]) -> None:
    """Check every string of the program JSON that torch evaluates or writes into generated code."""
    if isinstance(value, dict):
        if isinstance(value.get("target"), str) and "inputs" in value:
            targets.add(value["target"])
        for k, v in value.items():
            if not isinstance(k, str) or _CONTROL.search(k):
                raise _refuse(path, f"{record} has a key with control characters")
            if key in _VALUE_MAPS and not IDENT.match(k):
                raise _refuse(path, f"{record}: value name {k[:60]!r} is not an identifier")
            _walk(path, record, v, k, targets)
    elif isinstance(value, list):
        if key == "guards_code":
            for guard in value:
                _check_guard(path, guard)
            return
        for v in value:
            _walk(path, record, v, key, targets)
    elif isinstance(value, str):
        _check_string(path, record, key, value)


def _check_string(path: Path, record: str, key: str, value: str) -> None:
    bad = f"{record}: {key} {value[:60]!r}"
    if _CONTROL.search(value) or ("\n" in value and key != "stack_trace"):
        raise _refuse(path, f"{bad} contains control characters")
    if key == "name" and value and not IDENT.match(value):
        raise _refuse(path, f"{bad} is not an identifier (it would be written into generated code)")
    if key in _FQN_KEYS and not FQN.match(value):
        raise _refuse(path, f"{bad} is not a dotted attribute name")
    if key in ("as_string", "as_strings") and re.search(r"['\"\\]", value):
        raise _refuse(path, f"{bad} contains quotes or backslashes (torch writes it into generated guards)")
    if key == "expr_str":
        _check_tokens(path, value, _EXPR_TOKEN, "symbolic expression", _SYMPY_CALLS)


def _check_tokens(path: Path, text: str, token: re.Pattern[str], what: str, calls: frozenset[str]) -> None:
    words = []
    pos = 0
    while pos < len(text):
        m = token.match(text, pos)
        if m is None or m.end() == pos:
            raise _refuse(path, f"{what} {text[:80]!r} is not one torch writes; torch would evaluate it as code")
        if not m.group(0).isspace():
            words.append(m.group(0))
        pos = m.end()
    for i, word in enumerate(words):
        nxt = words[i + 1] if i + 1 < len(words) else ""
        bad = word.startswith("_") or (word[0].isalpha() and nxt == "(" and word not in calls)
        if word == "**":  # a small literal or a symbol as exponent, never chained (2**99**99 hangs)
            after = words[i + 2] if i + 2 < len(words) else ""
            bad = after == "**" or not (IDENT.match(nxt) or (nxt.isdigit() and len(nxt) <= 2))
        if bad:
            raise _refuse(path, f"{what} {text[:80]!r} is not one torch writes ({word!r}); torch would evaluate it")


def _check_guard(path: Path, guard: Any) -> None:
    if not isinstance(guard, str) or _CONTROL.search(guard) or "\n" in guard or '"' in guard or "\\" in guard:
        raise _refuse(path, f"guard {str(guard)[:80]!r} is not one torch writes; torch would exec it")
    _check_tokens(path, guard, _GUARD_TOKEN, "guard", frozenset())
