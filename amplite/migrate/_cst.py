"""Small libcst helpers shared by the ``amplite migrate`` codemods.

They build nodes that blend into the surrounding code (tight ``key=value`` keywords, argument separators
copied from the call being edited) so that a rewrite only touches the expression it changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import libcst as cst
from libcst.helpers import get_full_name_for_node

#: Prefix of every comment the codemods write, so users can grep for what needs a human look.
NOTE_PREFIX = "# amplite: "

#: Module prefixes whose use is deprecated (``torch.cuda.amp``/``torch.cpu.amp``) or gone (apex amp).
DEPRECATED_PREFIXES: tuple[str, ...] = ("torch.cuda.amp", "torch.cpu.amp", "apex")

QualifiedNames = Callable[[cst.CSTNode], set[str]]


def matches_prefix(name: str, prefixes: Iterable[str]) -> bool:
    """Whether dotted ``name`` is one of ``prefixes`` or lies inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def dotted_name(node: cst.CSTNode) -> str | None:
    """The dotted source text of a ``Name``/``Attribute`` chain, or None for anything else."""
    return get_full_name_for_node(node)


def code_of(node: cst.CSTNode) -> str:
    """Source text of ``node`` as libcst would print it."""
    return cst.Module(body=[]).code_for_node(node)


def tight_kwarg(name: str, value: cst.BaseExpression) -> cst.Arg:
    """A keyword argument printed PEP 8 style, ``name=value``."""
    empty = cst.SimpleWhitespace("")
    return cst.Arg(
        value=value,
        keyword=cst.Name(name),
        equal=cst.AssignEqual(whitespace_before=empty, whitespace_after=empty),
    )


def string(value: str) -> cst.SimpleString:
    """A double-quoted string literal."""
    return cst.SimpleString(f'"{value}"')


def attr_chain(dotted: str) -> cst.BaseExpression:
    """Build ``a.b.c`` as an ``Attribute`` chain."""
    head, *rest = dotted.split(".")
    node: cst.BaseExpression = cst.Name(head)
    for part in rest:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def call(func: str | cst.BaseExpression, *args: cst.Arg) -> cst.Call:
    """A call ``func(args...)`` with ``, `` separators."""
    target = attr_chain(func) if isinstance(func, str) else func
    return cst.Call(func=target, args=_with_commas(list(args)))


def _with_commas(args: list[cst.Arg]) -> list[cst.Arg]:
    comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    return [a.with_changes(comma=comma) for a in args[:-1]] + args[-1:]


def expr_line(expr: cst.BaseExpression) -> cst.SimpleStatementLine:
    """A statement line holding the single expression ``expr``."""
    return cst.SimpleStatementLine(body=[cst.Expr(expr)])


def assign_line(name: str, value: cst.BaseExpression) -> cst.SimpleStatementLine:
    """A statement line ``name = value``."""
    return cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(name))], value=value)])


def note(text: str) -> cst.EmptyLine:
    """A ``# amplite: ...`` comment line at the indentation of the statement it precedes."""
    return cst.EmptyLine(comment=cst.Comment(NOTE_PREFIX + text))


def bare(arg: cst.Arg) -> cst.Arg:
    """A plain positional copy of ``arg``'s value, ready to be moved into a new call."""
    return cst.Arg(value=arg.value)


def find_arg(node: cst.Call, index: int, keyword: str) -> cst.Arg | None:
    """The argument bound to parameter ``keyword`` at position ``index`` (None if absent or ambiguous)."""
    positional = 0
    for arg in node.args:
        if arg.star:
            return None
        if arg.keyword is None:
            if positional == index:
                return arg
            positional += 1
        elif arg.keyword.value == keyword:
            return arg
    return None


def _clean_ws(ws: cst.BaseParenthesizableWhitespace) -> cst.BaseParenthesizableWhitespace:
    """Copy a separator without any comment or blank lines it carries."""
    if isinstance(ws, cst.ParenthesizedWhitespace):
        return ws.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[])
    return ws


def _separator(node: cst.Call) -> cst.BaseParenthesizableWhitespace:
    """The whitespace the call already uses between arguments (one per line or all on one line)."""
    for arg in node.args[:-1]:
        if isinstance(arg.comma, cst.Comma):
            return _clean_ws(arg.comma.whitespace_after)
    if isinstance(node.whitespace_before_args, cst.ParenthesizedWhitespace):
        return _clean_ws(node.whitespace_before_args)
    return cst.SimpleWhitespace(" ")


def insert_arg(node: cst.Call, index: int, arg: cst.Arg) -> cst.Call:
    """Insert ``arg`` at ``index``, following the call's layout (including multi-line calls).

    Args:
        node: The call to edit.
        index: Position of the new argument; ``len(node.args)`` appends.
        arg: The argument, without a comma.

    Returns:
        The call with the new argument.
    """
    args = list(node.args)
    sep = _separator(node)
    if index < len(args):
        if index == 0:
            # Keep "f(first, ...)" on its line unless the call opens with a line break.
            before = node.whitespace_before_args
            sep = _clean_ws(before) if isinstance(before, cst.ParenthesizedWhitespace) else cst.SimpleWhitespace(" ")
        elif isinstance(args[index - 1].comma, cst.Comma):
            sep = _clean_ws(args[index - 1].comma.whitespace_after)
        args.insert(index, arg.with_changes(comma=cst.Comma(whitespace_after=sep)))
    elif not args:
        args.append(arg)
    else:
        last = args[-1]
        if isinstance(last.comma, cst.Comma):
            # Trailing comma: the new last argument inherits it (and the whitespace before ")").
            args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=sep))
            args.append(arg.with_changes(comma=last.comma))
        else:
            args[-1] = last.with_changes(
                comma=cst.Comma(whitespace_after=sep), whitespace_after_arg=cst.SimpleWhitespace("")
            )
            args.append(arg.with_changes(whitespace_after_arg=last.whitespace_after_arg))
    return node.with_changes(args=args)


def positional_to_keywords(node: cst.Call, names: tuple[str, ...]) -> cst.Call | None:
    """Turn the positional arguments of ``node`` into keywords named after ``names``.

    Returns:
        The rewritten call, or None if it has ``*args`` or more positionals than ``names``.
    """
    args: list[cst.Arg] = []
    for position, arg in enumerate(node.args):
        if arg.star == "*":
            return None
        if arg.keyword is None and not arg.star:
            if position >= len(names):
                return None
            empty = cst.SimpleWhitespace("")
            arg = arg.with_changes(
                keyword=cst.Name(names[position]),
                equal=cst.AssignEqual(whitespace_before=empty, whitespace_after=empty),
            )
        args.append(arg)
    return node.with_changes(args=args)


def torch_binding(module: cst.Module) -> str | None:
    """The name a module-level ``import torch`` / ``import torch as th`` binds, if any.

    Dotted imports (``import torch.nn``) are ignored on purpose: they may be removed as unused later.
    """
    alias: str | None = None
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if not isinstance(small, cst.Import):
                continue
            for name in small.names:
                if dotted_name(name.name) != "torch":
                    continue
                if name.asname is None:
                    return "torch"
                if isinstance(name.asname.name, cst.Name):
                    alias = alias or name.asname.name.value
    return alias


class _CommentCollector(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.comments: list[cst.Comment] = []

    def visit_Comment(self, node: cst.Comment) -> None:
        self.comments.append(node)


def comment_lines(node: cst.CSTNode) -> list[cst.EmptyLine]:
    """Every comment inside ``node`` (e.g. in the arguments of a multi-line call being replaced), each as
    a line of its own, so that a rewrite never loses one."""
    collector = _CommentCollector()
    node.visit(collector)
    return [cst.EmptyLine(comment=c) for c in collector.comments]


class _NameCollector(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)


def all_names(node: cst.CSTNode) -> set[str]:
    """Every identifier spelled anywhere in ``node`` (a superset of the names it binds)."""
    collector = _NameCollector()
    node.visit(collector)
    return collector.names


def fresh_name(taken: set[str], base: str, *alternatives: str) -> str:
    """The first of ``base``, ``alternatives`` or ``base_N`` not in ``taken``."""
    for candidate in (base, *alternatives):
        if candidate not in taken:
            return candidate
    n = 2
    while f"{base}_{n}" in taken:
        n += 1
    return f"{base}_{n}"


class ReadCollector(cst.CSTVisitor):
    """Names read by a statement: attribute names and keyword names are not variables."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)
        return False


def names_read(node: cst.CSTNode) -> set[str]:
    """Variable names used in ``node`` (over-approximated: targets are included)."""
    collector = ReadCollector()
    node.visit(collector)
    return collector.names


def count_variable(node: cst.CSTNode, name: str) -> int:
    """How many times variable ``name`` occurs in ``node`` (ignoring attribute and keyword names)."""
    counter = _VariableCounter(name)
    node.visit(counter)
    return counter.count


class _VariableCounter(ReadCollector):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.count = 0

    def visit_Name(self, node: cst.Name) -> None:
        self.count += node.value == self.name


class ReplaceVariable(cst.CSTTransformer):
    """Replace every use of variable ``name`` by ``replacement`` (attribute/keyword names are kept)."""

    def __init__(self, name: str, replacement: cst.BaseExpression) -> None:
        super().__init__()
        self.name = name
        self.replacement = replacement

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
        return self.replacement if original_node.value == self.name else updated_node

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.Attribute:
        return updated_node.with_changes(attr=original_node.attr)

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        return updated_node.with_changes(keyword=original_node.keyword)


def bind_args(node: cst.Call, params: tuple[str, ...]) -> dict[str, cst.Arg] | None:
    """Map the arguments of ``node`` to the parameter names ``params`` (positional order).

    Returns:
        Parameter name -> argument, or None if the call uses ``*``/``**`` unpacking, unknown keywords or
        too many positionals.
    """
    bound: dict[str, cst.Arg] = {}
    for position, arg in enumerate(node.args):
        if arg.star:
            return None
        if arg.keyword is None:
            if position >= len(params):
                return None
            bound[params[position]] = arg
        elif arg.keyword.value in params:
            bound[arg.keyword.value] = arg
        else:
            return None
    return bound
