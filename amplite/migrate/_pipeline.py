"""The migration pipeline on one parsed module: run the codemods that apply, then report leftovers."""

from __future__ import annotations

import contextlib
import difflib
import io
import re
import tokenize
from collections.abc import Callable
from typing import Literal

import libcst as cst
from libcst.codemod import Codemod, CodemodContext, SkipFile
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider

from amplite.migrate._cst import DEPRECATED_PREFIXES, code_of, dotted_name, matches_prefix
from amplite.migrate.add_autocast import AddAutocastCommand
from amplite.migrate.apex import ApexAmpCommand
from amplite.migrate.torch_amp import TorchAmpCommand

DType = Literal["bf16", "fp16"]

_LINE = re.compile(r"line (\d+):")

# Cheap gates on a file's code tokens (names and operators, so comments and strings do not count): every
# use of a deprecated API spells one of these, so other files skip the costly scope analysis of a codemod.
_TORCH_AMP_TOKENS = re.compile(r"\b(?:cuda|cpu) (?:\. amp|import)\b")
_APEX_TOKENS = re.compile(r"\bapex\b")
_BACKWARD_TOKENS = re.compile(r"\. backward \(")
#: Files naming these are treated as mixed precision already by --add-autocast.
_AMP_TOKENS = re.compile(r"\b(?:autocast|GradScaler)\b")


def _code_tokens(module: cst.Module) -> str | None:
    """The module's NAME and OP tokens joined by spaces (None if tokenize disagrees with libcst)."""
    try:
        tokens = tokenize.generate_tokens(io.StringIO(module.code).readline)
        return " ".join(t.string for t in tokens if t.type in (tokenize.NAME, tokenize.OP))
    except (tokenize.TokenError, SyntaxError):
        return None


def _mentions(pattern: re.Pattern[str], tokens: str | None) -> bool:
    return tokens is None or pattern.search(tokens) is not None


def _run(make: Callable[[CodemodContext], Codemod], module: cst.Module, warnings: list[str]) -> cst.Module:
    context = CodemodContext()
    with contextlib.suppress(SkipFile):
        module = make(context).transform_module(module)
    warnings.extend(context.warnings)
    return module


class _Leftovers(cst.CSTVisitor):
    """Finds references to deprecated AMP APIs that survived the codemods."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider)

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[int, str, str]] = []  # (line, code, qualified name)

    def visit_Import(self, node: cst.Import) -> bool:
        return False  # an import is only reported through the code that uses it

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        # A star import hides which names it brings in, so it is the one import reported itself.
        module = dotted_name(node.module) if node.module is not None and not node.relative else None
        if isinstance(node.names, cst.ImportStar) and module and matches_prefix(module, DEPRECATED_PREFIXES):
            self.found.append((self.get_metadata(PositionProvider, node).start.line, code_of(node), module))
        return False

    def _check(self, node: cst.Name | cst.Attribute) -> bool:
        names = sorted(q.name for q in self.get_metadata(QualifiedNameProvider, node, set()))
        hit = next((n for n in names if matches_prefix(n, DEPRECATED_PREFIXES)), None)
        if hit is None:
            return True
        self.found.append((self.get_metadata(PositionProvider, node).start.line, code_of(node), hit))
        return False

    def visit_Name(self, node: cst.Name) -> bool:
        return self._check(node)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        return self._check(node)


def _line_key(warning: str) -> int:
    match = _LINE.match(warning)
    return int(match.group(1)) if match else 0


def migrate_module(
    module: cst.Module, *, add_autocast: bool = False, dtype: DType = "bf16"
) -> tuple[cst.Module, list[str]]:
    """Run every codemod on a parsed module.

    Args:
        module: The parsed source.
        add_autocast: Also add autocast (and, for fp16, a GradScaler) to plain FP32 training loops.
        dtype: Autocast dtype for ``add_autocast``.

    Returns:
        The migrated module and the warnings (``"line N: ..."``), sorted by line.
    """
    warnings: list[str] = []
    original = module
    tokens = _code_tokens(module)
    if _mentions(_TORCH_AMP_TOKENS, tokens):
        module = _run(TorchAmpCommand, module, warnings)
    if _mentions(_APEX_TOKENS, tokens):
        module = _run(ApexAmpCommand, module, warnings)
    if add_autocast:
        tokens = _code_tokens(module)
        if _mentions(_BACKWARD_TOKENS, tokens) and not (tokens and _AMP_TOKENS.search(tokens)):
            module = _run(lambda context: AddAutocastCommand(context, dtype=dtype), module, warnings)
    tokens = _code_tokens(module)
    if _mentions(_TORCH_AMP_TOKENS, tokens) or _mentions(_APEX_TOKENS, tokens):
        leftovers = _Leftovers()
        MetadataWrapper(module).visit(leftovers)
        to_original = _line_map(original.code, module.code) if leftovers.found else {}
        warned = {_line_key(w) for w in warnings}
        for line, code, api in leftovers.found:
            line = to_original.get(line, line)
            if line not in warned:
                warnings.append(f"line {line}: `{code}` ({api}) is left unchanged; migrate it by hand")
    return module, sorted(dict.fromkeys(warnings), key=_line_key)


def _line_map(before: str, after: str) -> dict[int, int]:
    """Map 1-based line numbers of ``after`` to those of ``before`` (warnings cite the original file)."""
    matcher = difflib.SequenceMatcher(None, before.splitlines(), after.splitlines(), autojunk=False)
    mapping: dict[int, int] = {}
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        for j in range(j1, j2):
            mapping[j + 1] = (i1 + (j - j1) if tag == "equal" else min(i1 + (j - j1), max(i2 - 1, i1))) + 1
    return mapping
