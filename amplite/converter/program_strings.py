"""The strings of a .pt2's program JSON that FX writes into generated code, checked; node targets collected.

FX writes node and attribute names into generated Python, and torch resolves node targets by attribute lookup
from ``torch``. These rules admit what ``torch.export.save`` writes (identifiers, dotted names, plain strings)
and nothing that could run code; the targets are returned for :mod:`amplite.converter.pt2` to resolve against
its operator allowlist after ``--import``. The strings torch would *evaluate* never reach torch: size
expressions are parsed by :mod:`amplite.converter.sym_expr`, and ``guards_code`` is dropped (see ``pt2.py``).
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
            return  # never loaded: amplite drops the file's guards (pt2.py) and checks inputs by range constraints
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
