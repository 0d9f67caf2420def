"""Import clean-up shared by the codemods.

libcst's RemoveImportsVisitor needs its own scope analysis (the slowest part of a run) and drops the
comments above a removed import; after a migration the codemods know which imports may have become unused,
so a name-based check is enough here.
"""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from amplite.migrate._blocks import BlockEditMixin
from amplite.migrate._cst import ReadCollector, code_of, comment_lines, dotted_name, matches_prefix, torch_binding


def imports_from(node: cst.Import | cst.ImportFrom, modules: tuple[str, ...], *, parents: bool = False) -> bool:
    """Whether an import statement brings in one of ``modules`` (or something inside them).

    ``from torch.cuda import amp`` counts as importing ``torch.cuda.amp``. With ``parents``, importing a
    parent package (``import apex`` for ``apex.amp``) counts too.
    """
    if isinstance(node, cst.Import):
        for alias in node.names:
            name = dotted_name(alias.name) or ""
            if matches_prefix(name, modules) or (parents and any(m.startswith(name + ".") for m in modules)):
                return True
        return False
    if node.relative or node.module is None:
        return False
    module = dotted_name(node.module) or ""
    if matches_prefix(module, modules):
        return True
    names = node.names
    return not isinstance(names, cst.ImportStar) and any(
        matches_prefix(f"{module}.{dotted_name(a.name)}", modules) for a in names
    )


#: ``CodemodContext.scratch`` key: names other files of the run import from this one (never removed).
KEEP_NAMES = "amplite.keep_names"


def dunder_all(module: cst.Module) -> set[str]:
    """The string literals of a module-level ``__all__ = [...]``, ``__all__ += [...]`` or
    ``__all__.extend([...])`` / ``.append(...)``: names the module re-exports."""
    names: set[str] = set()

    def strings(node: cst.BaseExpression) -> None:
        if isinstance(node, cst.List | cst.Tuple | cst.Set):
            for element in node.elements:
                strings(element.value)
        elif isinstance(node, cst.SimpleString) and isinstance(node.evaluated_value, str):
            names.add(node.evaluated_value)
        elif isinstance(node, cst.BinaryOperation):
            strings(node.left)
            strings(node.right)

    for stmt in module.body:
        for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
            if isinstance(small, cst.Assign) and any(
                isinstance(t.target, cst.Name) and t.target.value == "__all__" for t in small.targets
            ):
                strings(small.value)
            elif isinstance(small, cst.AnnAssign | cst.AugAssign) and dotted_name(small.target) == "__all__":
                if small.value is not None:
                    strings(small.value)
            elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
                func = dotted_name(small.value.func) or ""
                if func in ("__all__.extend", "__all__.append"):
                    for arg in small.value.args:
                        strings(arg.value)
    return names


def _trailing_comment(stmt: cst.SimpleStatementLine) -> list[cst.EmptyLine]:
    """The comment at the end of a statement line that is being removed, as a line of its own."""
    comment = stmt.trailing_whitespace.comment
    return [cst.EmptyLine(comment=comment)] if comment is not None else []


class _UsedNames(ReadCollector):
    """Variable names read outside import statements (attribute and keyword names do not count)."""

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> bool:
        return not isinstance(node.target, cst.Name)  # rebinding (`amp = None`) is not a use


def _bound_name(alias: cst.ImportAlias, from_import: bool) -> str:
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    name = dotted_name(alias.name) or ""
    return name if from_import else name.split(".")[0]


def _last_alias(alias: cst.ImportAlias, old_last: cst.ImportAlias) -> cst.ImportAlias:
    """``alias`` as the new last name: without a comma, unless the parenthesized list had a trailing one
    (then its own comma and comment stay, and the line break before ``)`` comes from the old last name)."""
    comma, old = alias.comma, old_last.comma
    if not isinstance(comma, cst.Comma) or not isinstance(old, cst.Comma):
        return alias.with_changes(comma=cst.MaybeSentinel.DEFAULT)
    ws, old_ws = comma.whitespace_after, old.whitespace_after
    if isinstance(ws, cst.ParenthesizedWhitespace) and isinstance(old_ws, cst.ParenthesizedWhitespace):
        return alias.with_changes(
            comma=comma.with_changes(whitespace_after=ws.with_changes(indent=old_ws.indent, last_line=old_ws.last_line))
        )
    if not isinstance(ws, cst.ParenthesizedWhitespace) and not isinstance(old_ws, cst.ParenthesizedWhitespace):
        return alias.with_changes(comma=cst.MaybeSentinel.DEFAULT)  # one line: `import (a, b)` -> `(a)`
    return alias.with_changes(comma=old)


class _DropUnusedImports(BlockEditMixin, cst.CSTTransformer):
    def __init__(self, used: set[str], modules: tuple[str, ...], parents: bool) -> None:
        super().__init__()
        self.reset_edits()
        self.used = used
        self.modules = modules
        self.parents = parents

    def _keep(self, node: cst.Import | cst.ImportFrom) -> list[cst.ImportAlias] | None:
        """Aliases to keep, or None if the statement is not one of ours."""
        if isinstance(node.names, cst.ImportStar) or not imports_from(node, self.modules, parents=self.parents):
            return None
        from_import = isinstance(node, cst.ImportFrom)
        keep = []
        for alias in node.names:
            single = node.with_changes(names=[alias])
            ours = imports_from(single, self.modules, parents=self.parents)
            if not ours or _bound_name(alias, from_import) in self.used:
                keep.append(alias)
        return keep

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        body: list[cst.BaseSmallStatement] = []
        lost: list[cst.EmptyLine] = []  # comments of removed names (`autocast,  # for eval` in parentheses)
        for small in updated_node.body:
            keep = self._keep(small) if isinstance(small, cst.Import | cst.ImportFrom) else None
            if keep is None or len(keep) == len(small.names):  # type: ignore[union-attr]
                body.append(small)
            elif keep:
                lost.extend(c for a in small.names if a not in keep for c in comment_lines(a))  # type: ignore[union-attr]
                keep[-1] = _last_alias(keep[-1], small.names[-1])  # type: ignore[union-attr]
                body.append(small.with_changes(names=keep))
            else:
                lost.extend(comment_lines(small))
        if body == list(updated_node.body):
            return updated_node
        if not body:
            record = self.edit(original_node)
            record.replacement = []  # the block moves its comments to the next line
            # ... and every comment of the line survives (a noqa, "NVIDIA apex", those in parentheses)
            record.trailing = [*lost, *_trailing_comment(original_node)]
            return updated_node
        body[-1] = body[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
        return updated_node.with_changes(body=body, leading_lines=[*updated_node.leading_lines, *lost])


def remove_unused_imports(
    module: cst.Module, modules: tuple[str, ...], *, parents: bool = False, keep: Iterable[str] = ()
) -> cst.Module:
    """Drop imports of ``modules`` whose bound name the code no longer uses.

    A name the module re-exports (listed in its ``__all__``, or in ``keep``: imported by other files of
    the run) is a use: removing it would break ``from this_module import name`` elsewhere.

    Args:
        module: The migrated module.
        modules: Dotted module names whose imports are candidates (``torch.cuda.amp``, ``apex.amp``).
        parents: Also consider imports of their parent packages (``import apex``).
        keep: Names never removed.

    Returns:
        The module without those imports; comments above or after a removed import line are kept.
    """
    used = _UsedNames()
    module.visit(used)
    return module.visit(_DropUnusedImports(used.names | dunder_all(module) | set(keep), modules, parents))


def _is_dotted(alias: cst.ImportAlias, modules: tuple[str, ...]) -> bool:
    return alias.asname is None and matches_prefix(dotted_name(alias.name) or "", modules)


def replace_dotted_imports(module: cst.Module, modules: tuple[str, ...]) -> cst.Module:
    """Turn a top-level ``import torch.cuda.amp`` into ``import torch`` (or drop it if torch is imported).

    libcst treats ``import torch.cuda.amp`` as binding ``torch``, so it is never "unused" once the code
    says ``torch.amp`` and RemoveImportsVisitor keeps it.
    """
    have_torch = torch_binding(module) == "torch"
    body: list[cst.BaseStatement] = []
    carry: list[cst.EmptyLine] = []
    for stmt in module.body:
        if carry:
            stmt = stmt.with_changes(leading_lines=[*carry, *stmt.leading_lines])
            carry = []
        if not isinstance(stmt, cst.SimpleStatementLine) or not any(
            isinstance(small, cst.Import) and any(_is_dotted(a, modules) for a in small.names) for small in stmt.body
        ):
            body.append(stmt)
            continue
        smalls: list[cst.BaseSmallStatement] = []
        for small in stmt.body:
            if isinstance(small, cst.Import):
                names = []
                for alias in small.names:
                    if not _is_dotted(alias, modules):
                        names.append(alias)
                    elif not have_torch:
                        names.append(alias.with_changes(name=cst.Name("torch")))
                        have_torch = True
                if not names:
                    continue
                names[-1] = names[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                small = small.with_changes(names=names)
            smalls.append(small)
        if smalls:
            smalls[-1] = smalls[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
            body.append(stmt.with_changes(body=smalls))
        else:
            carry = [*stmt.leading_lines, *_trailing_comment(stmt)]
    return module.with_changes(body=body, footer=[*carry, *module.footer])


def _is_dead_import_guard(stmt: cst.BaseStatement) -> bool:
    """``try: pass`` + ``except ImportError:`` without comments, as removing a guarded import leaves it.

    Nothing in ``pass`` can raise, so the handlers are dead code.
    """
    if not isinstance(stmt, cst.Try) or stmt.orelse is not None or stmt.finalbody is not None:
        return False
    body = stmt.body.body if isinstance(stmt.body, cst.IndentedBlock) else ()
    only_pass = not body or (  # RemoveImportsVisitor can leave an empty block, printed as `pass`
        len(body) == 1
        and isinstance(body[0], cst.SimpleStatementLine)
        and [type(s) for s in body[0].body] == [cst.Pass]
    )
    guards = all(
        h.type is not None and dotted_name(h.type) in ("ImportError", "ModuleNotFoundError") for h in stmt.handlers
    )
    return only_pass and guards and "#" not in code_of(stmt.with_changes(leading_lines=[]))


def drop_dead_import_guards(module: cst.Module) -> cst.Module:
    """Remove module-level dead import guards, keeping any comments above them."""
    if not any(_is_dead_import_guard(s) for s in module.body):
        return module
    body: list[cst.BaseStatement] = []
    carry: list[cst.EmptyLine] = []
    for stmt in module.body:
        if _is_dead_import_guard(stmt):
            # Blank lines alone would double the spacing; comments must survive.
            if any(line.comment is not None for line in stmt.leading_lines):
                carry.extend(stmt.leading_lines)
            continue
        body.append(stmt.with_changes(leading_lines=[*carry, *stmt.leading_lines]) if carry else stmt)
        carry = []
    return module.with_changes(body=body, footer=[*carry, *module.footer])
