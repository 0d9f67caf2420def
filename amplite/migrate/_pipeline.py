"""The migration pipeline on one parsed module: run the codemods that apply, then report leftovers."""

from __future__ import annotations

import contextlib
import difflib
import io
import re
import tokenize
from collections.abc import Callable, Mapping
from typing import Literal

import libcst as cst
from libcst.codemod import Codemod, CodemodContext, SkipFile
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider

from amplite.migrate._cst import DEPRECATED_PREFIXES, code_of, dotted_name, matches_prefix
from amplite.migrate._imports import KEEP_NAMES, dunder_all
from amplite.migrate._scan import find_deprecated
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


def _run(
    make: Callable[[CodemodContext], Codemod],
    module: cst.Module,
    warnings: list[str],
    keep: Mapping[str, str],
    original: str,
) -> tuple[cst.Module, Codemod]:
    """Run one codemod on ``module``; its warnings are made to cite lines of the ``original`` source
    (an earlier codemod may have moved lines, e.g. by removing an import)."""
    context = CodemodContext(scratch={KEEP_NAMES: frozenset(keep)})
    command = make(context)
    given = module.code
    with contextlib.suppress(SkipFile):
        module = command.transform_module(module)
    found = list(context.warnings)
    to_original = _line_map(original, given) if found and given != original else {}
    for warning in found:
        line = _line_key(warning)
        if line in to_original:
            warning = f"line {to_original[line]}:" + warning[len(f"line {line}:") :]
        warnings.append(warning)
    return module, command


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


def mentions_deprecated(module: cst.Module) -> bool:
    """Whether the module's code may use a deprecated AMP API (a cheap token test before a scan)."""
    tokens = _code_tokens(module)
    return _mentions(_TORCH_AMP_TOKENS, tokens) or _mentions(_APEX_TOKENS, tokens)


def _line_key(warning: str) -> int:
    match = _LINE.match(warning)
    return int(match.group(1)) if match else 0


def migrate_module(
    module: cst.Module,
    *,
    add_autocast: bool = False,
    dtype: DType = "bf16",
    keep: Mapping[str, str] | None = None,
) -> tuple[cst.Module, list[str]]:
    """Run every codemod on a parsed module.

    A file is migrated all-or-nothing: when the apex codemod declines the file (a use it does not
    understand, a forward pass it cannot wrap in autocast), no codemod changes it and the warnings say why.

    Args:
        module: The parsed source.
        add_autocast: Also add autocast (and, for fp16, a GradScaler) to plain FP32 training loops.
        dtype: Autocast dtype for ``add_autocast``.
        keep: Names other files of the run import from this module (-> where, e.g. ``"train.py:3"``):
            their imports are never removed, like the names of ``__all__``.

    Returns:
        The migrated module and the warnings (``"line N: ..."``, lines of the original), sorted by line.
    """
    keep = dict(keep or {})
    warnings: list[str] = []
    original, declined = module, False
    tokens = _code_tokens(module)
    if _mentions(_TORCH_AMP_TOKENS, tokens):
        module, _ = _run(TorchAmpCommand, module, warnings, keep, original.code)
    if _mentions(_APEX_TOKENS, tokens):
        module, apex = _run(ApexAmpCommand, module, warnings, keep, original.code)
        declined = bool(getattr(apex, "declined", False))
        if declined:  # all-or-nothing: a half-migrated file trains differently without saying so
            module = original
    if add_autocast and not declined:
        tokens = _code_tokens(module)
        if _mentions(_BACKWARD_TOKENS, tokens) and not (tokens and _AMP_TOKENS.search(tokens)):
            make = lambda context: AddAutocastCommand(context, dtype=dtype)  # noqa: E731
            module, _ = _run(make, module, warnings, keep, original.code)
    tokens = _code_tokens(module)
    if _mentions(_TORCH_AMP_TOKENS, tokens) or _mentions(_APEX_TOKENS, tokens):
        leftovers = _Leftovers()
        MetadataWrapper(module).visit(leftovers)
        to_original = _line_map(original.code, module.code) if module is not original else {}
        warned = {_line_key(w) for w in warnings}
        for line, code, api in leftovers.found:
            line = to_original.get(line, line)
            if line not in warned:
                warnings.append(f"line {line}: `{code}` ({api}) is left unchanged; migrate it by hand")
        warnings.extend(_kept_reexports(module, keep, to_original))
    return module, sorted(dict.fromkeys(warnings), key=_line_key)


def _kept_reexports(module: cst.Module, keep: Mapping[str, str], to_original: dict[int, int]) -> list[str]:
    """Warnings for deprecated imports kept because the module re-exports their names."""
    exported = dunder_all(module)
    out = []
    for found in find_deprecated(module):
        if found.bound is None or (found.bound not in exported and found.bound not in keep):
            continue
        who = "listed in __all__" if found.bound in exported else f"imported by {keep[found.bound]}"
        new = found.api.replace("torch.cuda.amp", "torch.amp").replace("torch.cpu.amp", "torch.amp")
        hint = f"switch its importers to {new}" if new != found.api else "switch its importers to torch.amp"
        out.append(
            f"line {to_original.get(found.line, found.line)}: `{found.code}` is kept: `{found.bound}` is "
            f"re-exported ({who}); {hint} (with an explicit device), then remove it"
        )
    return out


def _line_map(before: str, after: str) -> dict[int, int]:
    """Map 1-based line numbers of ``after`` to those of ``before`` (warnings cite the original file)."""
    matcher = difflib.SequenceMatcher(None, before.splitlines(), after.splitlines(), autojunk=False)
    mapping: dict[int, int] = {}
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        for j in range(j1, j2):
            mapping[j + 1] = (i1 + (j - j1) if tag == "equal" else min(i1 + (j - j1), max(i2 - 1, i1))) + 1
    return mapping
