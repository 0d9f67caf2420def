"""Command-line options that only fed ``amp.initialize`` (``--opt-level``, ``--keep-batchnorm-fp32``...):
after the apex migration they no longer do anything, which users should hear about (file:line)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import libcst as cst

from amplite.migrate._cst import code_of


def _option_dest(node: cst.Call) -> tuple[str, str] | None:
    """(first option string, argparse ``dest``) of an ``add_argument("--opt-level", ...)`` call."""
    options = [
        a.value.evaluated_value
        for a in node.args
        if a.keyword is None and isinstance(a.value, cst.SimpleString) and isinstance(a.value.evaluated_value, str)
    ]
    flags = [o for o in options if o.startswith("-")]
    if not flags:
        return None
    dest = next(
        (
            a.value.evaluated_value
            for a in node.args
            if a.keyword is not None and a.keyword.value == "dest" and isinstance(a.value, cst.SimpleString)
        ),
        None,
    )
    longs = [f for f in flags if f.startswith("--")] or flags
    return flags[0], str(dest or longs[0].lstrip("-").replace("-", "_"))


class _AddArguments(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.options: list[tuple[cst.Call, str, str]] = []  # (call, flag, dest)

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Attribute) and node.func.attr.value == "add_argument":
            found = _option_dest(node)
            if found is not None:
                self.options.append((node, *found))


def dead_option_warnings(
    module: cst.Module,
    bound: Mapping[str, cst.Arg],
    dead: list[str],
    line_of: Callable[[cst.CSTNode], int],
    init: cst.Call,
) -> list[str]:
    """Warnings for the options whose only effect was an ``amp.initialize`` argument that is now gone.

    Args:
        module: The module (as the codemod received it; ``line_of`` gives its lines).
        bound: ``amp.initialize`` arguments by parameter name.
        dead: The parameters whose values no longer do anything.
        line_of: Line of a node of ``module``.
        init: The ``amp.initialize`` call.

    Returns:
        ``"line N: ..."`` warnings: at the ``add_argument`` defining the option when it is in this file,
        else at ``amp.initialize``.
    """
    finder = _AddArguments()
    module.visit(finder)
    warnings = []
    for param in dead:
        value = bound[param].value
        name = value.attr.value if isinstance(value, cst.Attribute) else getattr(value, "value", None)
        name = name if isinstance(value, cst.Attribute | cst.Name) and name not in ("True", "False", "None") else None
        if name is None:
            continue  # a literal: the note on the scaler line says it was dropped
        option = next(((c, flag) for c, flag, dest in finder.options if dest == name), None)
        if option is not None:
            warnings.append(
                f"line {line_of(option[0])}: option `{option[1]}` no longer does anything: it fed "
                f"amp.initialize({param}={code_of(value)}), which the migration removed; remove or re-wire it"
            )
        else:
            warnings.append(
                f"line {line_of(init)}: `{code_of(value)}` (amp.initialize {param}=) no longer does anything "
                "after the migration; remove the option that sets it or re-wire it"
            )
    return warnings
