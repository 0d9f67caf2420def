"""Statement-level editing shared by the codemods: scanning, forward-pass detection, block rebuilding.

The codemods decide everything in a pre-scan of the original tree and record *edits* keyed by original
statement nodes. Statement ``leave_*`` methods never change how many statements a block holds; the block
(``IndentedBlock`` or ``Module``) applies the edits when it is left, so original and updated bodies can be
walked in lockstep. That keeps insertions, replacements and ``with`` wrapping from fighting each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import libcst as cst

from amplite.migrate._cst import call, code_of, names_read, note

#: Calls that only load or move data; a forward region does not start with them.
_DATA_METHODS = frozenset(
    {"to", "cuda", "cpu", "pin_memory", "float", "half", "double", "long", "int", "bool", "contiguous"}
)
_DATA_FUNCTIONS = frozenset({"next", "len", "iter"})

Block = cst.IndentedBlock | cst.Module


class ScopeScanner(cst.CSTVisitor):
    """Visitor that knows the innermost function, loops, statement and block around each node."""

    def __init__(self) -> None:
        super().__init__()
        self.functions: list[cst.FunctionDef | None] = [None]
        self.loop_frames: list[list[cst.For | cst.While]] = [[]]
        self.statements: list[cst.BaseStatement] = []
        self.blocks: list[Block] = []
        self.parent_block: dict[cst.BaseStatement, Block] = {}

    @property
    def function(self) -> cst.FunctionDef | None:
        """Innermost enclosing function (None at module level)."""
        return self.functions[-1]

    @property
    def loops(self) -> list[cst.For | cst.While]:
        """Enclosing loops of the innermost function, outermost first."""
        return self.loop_frames[-1]

    @property
    def statement(self) -> cst.BaseStatement | None:
        """Innermost enclosing statement."""
        return self.statements[-1] if self.statements else None

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.BaseStatement):
            if self.blocks:
                self.parent_block[node] = self.blocks[-1]
            self.statements.append(node)
        if isinstance(node, cst.IndentedBlock | cst.Module):
            self.blocks.append(node)
        if isinstance(node, cst.FunctionDef | cst.ClassDef):
            self.functions.append(node if isinstance(node, cst.FunctionDef) else self.function)
            self.loop_frames.append([])
        if isinstance(node, cst.For | cst.While):
            self.loops.append(node)
        return super().on_visit(node)

    def on_leave(self, original_node: cst.CSTNode) -> None:
        super().on_leave(original_node)
        if isinstance(original_node, cst.For | cst.While):
            self.loops.pop()
        if isinstance(original_node, cst.FunctionDef | cst.ClassDef):
            self.functions.pop()
            self.loop_frames.pop()
        if isinstance(original_node, cst.IndentedBlock | cst.Module):
            self.blocks.pop()
        if isinstance(original_node, cst.BaseStatement):
            self.statements.pop()

    def line_of(self, stmt: cst.BaseStatement) -> tuple[Block, int] | None:
        """The block holding ``stmt`` and its index there."""
        block = self.parent_block.get(stmt)
        if block is None:
            return None
        for index, candidate in enumerate(block.body):
            if candidate is stmt:
                return block, index
        return None


def _single_small(stmt: cst.BaseStatement) -> cst.BaseSmallStatement | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        return stmt.body[0]
    return None


def _target_names(target: cst.BaseExpression) -> set[str]:
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, cst.Tuple | cst.List):
        names: set[str] = set()
        for element in target.elements:
            names |= _target_names(element.value)
        return names
    if isinstance(target, cst.StarredElement):
        return _target_names(target.value)
    return set()


def assigned_names(stmt: cst.BaseStatement) -> set[str]:
    """Variables bound by a one-assignment statement line (empty for anything else)."""
    small = _single_small(stmt)
    if isinstance(small, cst.Assign):
        names: set[str] = set()
        for target in small.targets:
            names |= _target_names(target.target)
        return names
    if (isinstance(small, cst.AnnAssign) and small.value is not None) or isinstance(small, cst.AugAssign):
        return _target_names(small.target)
    return set()


class _CallKinds(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.compute = False

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        data = (isinstance(func, cst.Attribute) and func.attr.value in _DATA_METHODS) or (
            isinstance(func, cst.Name) and func.value in _DATA_FUNCTIONS
        )
        self.compute = self.compute or not data


def computes(stmt: cst.BaseStatement) -> bool:
    """Whether ``stmt`` calls something other than a data-loading/device-transfer helper."""
    kinds = _CallKinds()
    stmt.visit(kinds)
    return kinds.compute


def forward_region(body: Sequence[cst.BaseStatement], index: int, loss: str) -> tuple[int, int] | None:
    """Find the statements computing ``loss`` before ``body[index]`` (the backward statement).

    The region ends with the last assignment to ``loss`` before ``index`` and extends upwards over the
    contiguous assignments the loss depends on; leading statements that only load or move data
    (``x = x.cuda()``, ``x, y = batch``) are left outside.

    Args:
        body: Statements of the block holding the backward statement.
        index: Index of the backward statement in ``body``.
        loss: Name of the loss variable.

    Returns:
        ``(start, stop)`` indices of the region, or None if it cannot be found.
    """
    end = next((j for j in range(index - 1, -1, -1) if loss in assigned_names(body[j])), None)
    if end is None:
        return None
    needed = names_read(body[end])
    start = end
    for j in range(end - 1, -1, -1):
        bound = assigned_names(body[j])
        if not bound & needed:
            break
        needed |= names_read(body[j])
        start = j
    while start <= end and not computes(body[start]):
        start += 1
    return (start, end + 1) if start <= end else None


def receiver(node: cst.Call) -> str:
    """Source of ``X`` in a method call ``X.m(...)`` ("" for plain function calls)."""
    return code_of(node.func.value) if isinstance(node.func, cst.Attribute) else ""


def rewrite_step_line(
    line: cst.SimpleStatementLine, optimizers: set[str], scaler: str
) -> list[cst.SimpleStatementLine]:
    """Rewrite ``opt.step()`` in ``line`` to ``scaler.step(opt)`` followed by ``scaler.update()``.

    Returns:
        Two lines when the step was the only statement on its line (the first keeps its trailing comment,
        the caller moves the leading lines), otherwise the single line with ``;``-separated statements.
    """
    body: list[cst.BaseSmallStatement] = []
    for small in line.body:
        step = small.value if isinstance(small, cst.Expr) else None
        if not (
            isinstance(step, cst.Call)
            and isinstance(step.func, cst.Attribute)
            and step.func.attr.value == "step"
            and not step.args
            and receiver(step) in optimizers
        ):
            body.append(small)
            continue
        semicolon = cst.Semicolon(whitespace_after=cst.SimpleWhitespace(" "))
        body.append(cst.Expr(call(f"{scaler}.step", cst.Arg(step.func.value)), semicolon=semicolon))
        body.append(cst.Expr(call(f"{scaler}.update"), semicolon=small.semicolon))
    if len(line.body) == 1 and len(body) == 2:
        plain = [s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT) for s in body]
        first = line.with_changes(body=[plain[0]], leading_lines=[])
        return [first, cst.SimpleStatementLine(body=[plain[1]])]
    return [line.with_changes(body=body)]


def _merge_lines(carried: list[cst.EmptyLine], lines: Sequence[cst.EmptyLine]) -> list[cst.EmptyLine]:
    """Lines left by a removed statement followed by the next statement's own leading lines.

    Blank lines alone are dropped when the next statement already starts with one, so removing a
    statement does not double the spacing; comments are always kept.
    """
    if carried and all(line.comment is None for line in carried) and lines and lines[0].comment is None:
        return list(lines)
    return [*carried, *lines]


@dataclass
class Edit:
    """What to do with one original statement when its block is rebuilt.

    Attributes:
        before: Statements inserted before it.
        replacement: Statements that replace it (None keeps the transformed statement).
        notes: ``# amplite:`` comment texts placed above the group.
        trailing: Comment lines that must follow the group (e.g. an unwrapped block's footer).
    """

    before: list[cst.BaseStatement] = field(default_factory=list)
    replacement: list[cst.BaseStatement] | None = None
    notes: list[str] = field(default_factory=list)
    trailing: list[cst.EmptyLine] = field(default_factory=list)


@dataclass
class Wrap:
    """Wrap ``body[start:stop]`` of a block in ``with <item>:``."""

    start: int
    stop: int
    item: cst.Call


class BlockEditMixin:
    """Transformer mixin applying :class:`Edit` and :class:`Wrap` records when a block is left."""

    edits: dict[cst.CSTNode, Edit]
    wraps: dict[cst.CSTNode, list[Wrap]]

    def reset_edits(self) -> None:
        """Forget all recorded edits (call at the start of each module)."""
        self.edits = {}
        self.wraps = {}

    def edit(self, stmt: cst.CSTNode) -> Edit:
        """The (new or existing) edit record of original statement ``stmt``."""
        return self.edits.setdefault(stmt, Edit())

    def add_wrap(self, block: cst.CSTNode, wrap: Wrap) -> None:
        """Record a ``with`` wrap inside original ``block``."""
        self.wraps.setdefault(block, []).append(wrap)

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        body, footer = self._rebuild(original_node, updated_node.body, updated_node.footer)
        return updated_node.with_changes(body=body, footer=footer)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        body, footer = self._rebuild(original_node, updated_node.body, updated_node.footer)
        return updated_node.with_changes(body=body, footer=footer)

    def _rebuild(
        self,
        original: Block,
        updated_body: tuple[cst.BaseStatement, ...],
        footer: tuple[cst.EmptyLine, ...],
    ) -> tuple[list[cst.BaseStatement], list[cst.EmptyLine]]:
        if len(original.body) != len(updated_body):  # pragma: no cover - guarded by design
            raise AssertionError("statement count changed outside BlockEditMixin")
        groups: list[list[cst.BaseStatement]] = []
        carry: list[cst.EmptyLine] = []
        for orig, upd in zip(original.body, updated_body, strict=True):
            record = self.edits.pop(orig, None)
            if record is None:
                group: list[cst.BaseStatement] = [upd]
                head = _merge_lines(carry, upd.leading_lines)
                trailing: list[cst.EmptyLine] = []
            else:
                kept = [upd] if record.replacement is None else list(record.replacement)
                group = [*record.before, *kept]
                head = [*_merge_lines(carry, upd.leading_lines), *(note(text) for text in record.notes)]
                trailing = list(record.trailing)
            if not group:
                carry = head + trailing
                groups.append([])
                continue
            own = [] if group[0] is upd else list(group[0].leading_lines)
            group = [s.with_changes(leading_lines=[]) if s is upd else s for s in group]
            group[0] = group[0].with_changes(leading_lines=[*head, *own])
            groups.append(group)
            carry = trailing
        for wrap in sorted(self.wraps.pop(original, []), key=lambda w: -w.start):
            inner = [s for g in groups[wrap.start : wrap.stop] for s in g]
            if not inner:
                continue
            lead = inner[0].leading_lines
            inner[0] = inner[0].with_changes(leading_lines=[])
            node = cst.With(
                items=[cst.WithItem(item=wrap.item)], body=cst.IndentedBlock(body=inner), leading_lines=lead
            )
            groups[wrap.start : wrap.stop] = [[node]] + [[] for _ in range(wrap.stop - wrap.start - 1)]
        body = [s for g in groups for s in g]
        if not body and isinstance(original, cst.IndentedBlock):  # a block cannot be empty
            body = [cst.SimpleStatementLine(body=[cst.Pass()], leading_lines=carry)]
            carry = []
        return body, [*carry, *footer]
