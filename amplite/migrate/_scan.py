"""A scan for deprecated AMP APIs, independent of the codemods: what ``amplite migrate --check`` fails on.

Whether or not a codemod can rewrite it, every import of, or reference to, ``torch.cuda.amp``,
``torch.cpu.amp`` or apex ``amp`` is a finding, with its line and the API's qualified name.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider

from amplite.migrate._cst import code_of, dotted_name, matches_prefix

#: The deprecated (torch.cuda.amp, torch.cpu.amp) and removed (apex amp) AMP APIs.
AMP_PREFIXES = ("torch.cuda.amp", "torch.cpu.amp", "apex.amp")


@dataclass(frozen=True)
class Finding:
    """One use of a deprecated AMP API.

    Attributes:
        line: 1-based line in the scanned source.
        code: The source of the import or reference.
        api: Qualified name (``torch.cuda.amp.autocast``; ``torch.cuda.amp.*`` for a star import).
        bound: For an import, the name it binds (None for references and star imports).
    """

    line: int
    code: str
    api: str
    bound: str | None = None

    def describe(self) -> str:
        """``line N: `code` uses torch.cuda.amp.autocast``."""
        return f"line {self.line}: `{self.code}` uses {self.api}"


class _Scan(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider)

    def __init__(self) -> None:
        super().__init__()
        self.found: list[Finding] = []

    def _add(self, node: cst.CSTNode, code: str, api: str, bound: str | None = None) -> None:
        self.found.append(Finding(self.get_metadata(PositionProvider, node).start.line, code, api, bound))

    def visit_Import(self, node: cst.Import) -> bool:
        for alias in node.names:
            name = dotted_name(alias.name) or ""
            if matches_prefix(name, AMP_PREFIXES):
                bound = alias.asname.name.value if isinstance(getattr(alias.asname, "name", None), cst.Name) else None
                self._add(node, f"import {code_of(alias).rstrip(', ')}", name, bound or name.split(".")[0])
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        if node.relative or node.module is None:
            return False
        module = dotted_name(node.module) or ""
        if isinstance(node.names, cst.ImportStar):
            if matches_prefix(module, AMP_PREFIXES):
                self._add(node, f"from {module} import *", f"{module}.*")
            return False
        for alias in node.names:
            name = dotted_name(alias.name) or ""
            full = f"{module}.{name}"
            if matches_prefix(full, AMP_PREFIXES):
                bound = alias.asname.name.value if isinstance(getattr(alias.asname, "name", None), cst.Name) else name
                self._add(node, f"from {module} import {code_of(alias).rstrip(', ')}", full, bound)
        return False

    def _reference(self, node: cst.Name | cst.Attribute) -> bool:
        names = sorted(q.name for q in self.get_metadata(QualifiedNameProvider, node, set()))
        hit = next((n for n in names if matches_prefix(n, AMP_PREFIXES)), None)
        if hit is None:
            return True
        self._add(node, code_of(node), hit)
        return False  # the outermost reference is enough

    def visit_Name(self, node: cst.Name) -> bool:
        return self._reference(node)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        return self._reference(node)


def find_deprecated(module: cst.Module) -> list[Finding]:
    """Every import of and reference to a deprecated AMP API in ``module``, in source order."""
    scan = _Scan()
    MetadataWrapper(module).visit(scan)
    return sorted(dict.fromkeys(scan.found), key=lambda f: (f.line, f.code))
