"""The strings of a .pt2's program JSON that FX writes into generated code, checked; node targets collected.

FX writes node and attribute names into generated Python, and torch resolves node targets by attribute lookup
from ``torch``. These rules admit what ``torch.export.save`` writes (identifiers, dotted names, plain strings)
and nothing that could run code (module paths may hold any character but quotes, backslashes and control
characters, as ``nn.Module.add_module`` allows: ``block1-0``); the targets are returned for
:mod:`amplite.reading.pt2` to resolve against its operator allowlist after ``--import``. The strings torch
would *evaluate* never reach torch: size expressions are parsed by :mod:`amplite.reading.sym_expr`, and
``guards_code`` is dropped (see ``pt2.py``).
"""

from __future__ import annotations

import json
import keyword
import re
from pathlib import Path
from typing import Any

from amplite.errors import LoadError

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# A module path as torch writes it: ``add_module`` refuses only '.' and '' in a name, so torchvision's RegNet
# has ``block1-0``. FX writes a part that is not an identifier as ``getattr(self, "part")`` (fx.graph's
# _format_target), so a part may hold anything but the quotes, backslash and control characters that would
# end that string literal (Unicode line and paragraph separators included).
_PART = r"[^.'\"\\\x00-\x1f\x7f\u2028\u2029]+"
FQN = re.compile(rf"({_PART}(\.{_PART})*)?\Z")
DOTTED = re.compile(r"([A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*)?\Z")  # a Python type's qualified name
_FQN_KEYS = {
    "parameter_name", "buffer_name", "tensor_constant_name", "custom_obj_name", "user_input_name", "fqn",
}  # fmt: skip
_VALUE_MAPS = {"tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values", "custom_obj_values"}
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u2028\u2029]")
_QUOTES = re.compile(r"['\"\\]")


def is_parameter_name(value: object) -> bool:
    """Whether ``value`` can stand as a Python parameter or keyword-argument name (FX writes it into code)."""
    return isinstance(value, str) and IDENT.match(value) is not None and not keyword.iskeyword(value)


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
        raise _refuse(path, f"{bad} is not a module path (quotes, backslashes or control characters)")
    if key in ("as_string", "as_strings") and _QUOTES.search(value):
        raise _refuse(path, f"{bad} contains quotes or backslashes (torch writes it into generated guards)")
    if key == "forward_arg_names" and not is_parameter_name(value):
        raise _refuse(path, f"{bad} is not a parameter name (FX writes it into the generated forward)")
    if key in ("in_spec", "out_spec"):
        _check_treespec(path, record, key, value)


def _check_treespec(path: Path, record: str, key: str, value: str) -> None:
    """A pytree spec as torch writes it: ``[protocol, node]``, every context a JSON value of plain strings.

    FX writes the keys of the keyword-argument dict into the generated ``forward`` (``{'key': name}``), so
    they must be identifiers, as Python keyword arguments are; no string of any context may hold a quote or
    a backslash, so that no future code generation can be led out of a string literal either.
    """
    bad = f"{record}: {key}"
    try:
        spec = json.loads(value)
    except (ValueError, RecursionError):
        raise _refuse(path, f"{bad} is not a pytree spec (not JSON)") from None
    if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], dict)):
        raise _refuse(path, f"{bad} is not a pytree spec ([protocol, node])")
    contexts: dict[int, Any] = {}  # id(node) -> its parsed context
    stack: list[tuple[Any, int]] = [(spec[1], 0)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict) or depth > 64:
            raise _refuse(path, f"{bad} has a node that is not a spec, or is nested too deeply")
        kind, context, children = node.get("type"), node.get("context"), node.get("children_spec") or []
        if kind is not None and not (isinstance(kind, str) and DOTTED.match(kind)):
            raise _refuse(path, f"{bad} names the type {str(kind)[:60]!r}, which is not a dotted name")
        if context is not None and not isinstance(context, str):
            raise _refuse(path, f"{bad} has a context that is not a JSON string")
        try:
            parsed = json.loads(context) if context is not None else None
        except (ValueError, RecursionError):
            raise _refuse(path, f"{bad} has a context that is not JSON") from None
        contexts[id(node)] = parsed
        for text in _strings(parsed):
            if _QUOTES.search(text) or _CONTROL.search(text) or "\n" in text:
                raise _refuse(path, f"{bad}: the key {text[:60]!r} holds quotes, backslashes or control characters")
        if not isinstance(children, list):
            raise _refuse(path, f"{bad} has children that are not a list")
        stack.extend((child, depth + 1) for child in children)
    root = spec[1]
    kids = root.get("children_spec") or []
    args_kwargs = root.get("type") == "builtins.tuple" and len(kids) == 2 and kids[1].get("type") == "builtins.dict"
    if key == "in_spec" and args_kwargs:
        names = contexts[id(kids[1])] or []
        for name in names if isinstance(names, list) else [names]:
            if not is_parameter_name(name):
                raise _refuse(path, f"{bad}: keyword argument {str(name)[:60]!r} is not an identifier")


def _strings(value: Any) -> list[str]:
    """Every string in a parsed JSON value (keys and values), depth-first."""
    out: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
    return out
