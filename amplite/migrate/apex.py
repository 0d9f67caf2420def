"""Codemod: NVIDIA apex ``amp`` (removed from apex) to native ``torch.amp``.

apex keeps its loss scaler in a process-wide singleton, so ``amp.scale_loss`` works anywhere once
``amp.initialize`` has run. The migration creates one ``GradScaler`` where ``amp.initialize`` was; when
other functions use it, that statement declares it ``global`` to keep the singleton's reach.

The rewrite is all-or-nothing per file: a half-migrated training step would silently train on scaled
gradients (or in FP32), so any apex use the codemod does not understand, or a forward pass it cannot wrap
in autocast, leaves the file untouched with a warning (``declined`` is then set, and the pipeline keeps
the whole file as it was).

``if args.fp16: model, optimizer = amp.initialize(...)`` becomes an unconditional
``GradScaler("cuda", enabled=args.fp16)`` and ``torch.autocast(..., enabled=args.fp16)``: the condition
is kept as the ``enabled`` flag, so the FP32 path runs as before.
"""

from __future__ import annotations

import libcst as cst
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider, QualifiedNameProvider, ScopeProvider

from amplite.migrate._apex_dead import dead_option_warnings
from amplite.migrate._apex_scan import (
    INIT_PARAMS,
    SCALE_LOSS_PARAMS,
    ApexScan,
    Use,
    check,
    level_plan,
    optimizers_by_function,
)
from amplite.migrate._blocks import Block, BlockEditMixin, Wrap, forward_region, receiver, rewrite_step_line
from amplite.migrate._cst import (
    ReplaceVariable,
    all_names,
    assign_line,
    bare,
    bind_args,
    call,
    code_of,
    comment_lines,
    count_variable,
    expr_line,
    fresh_name,
    string,
    tight_kwarg,
    torch_binding,
)
from amplite.migrate._imports import KEEP_NAMES, drop_dead_import_guards, remove_unused_imports

_APEX = ("apex.amp",)


class ApexAmpCommand(BlockEditMixin, VisitorBasedCodemodCommand):
    """Replace apex ``amp`` with ``torch.amp.GradScaler`` plus ``torch.autocast`` around the forward pass."""

    DESCRIPTION = (
        "Migrate NVIDIA apex amp (amp.initialize, amp.scale_loss, amp.state_dict/load_state_dict, "
        "amp.master_params) to torch.amp.GradScaler and torch.autocast, noting where O2/O3 differ."
    )
    METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider, ScopeProvider)

    def __init__(self, context: CodemodContext) -> None:
        super().__init__(context)
        self._reset()

    def _reset(self) -> None:
        """Per-module state (an instance may transform several modules)."""
        self.reset_edits()
        self.scaler = "scaler"
        self.torch = "torch"
        self.scale_withs: dict[cst.With, Use] = {}
        self.step_stmts: dict[cst.BaseStatement, set[str]] = {}
        self.replacements: dict[cst.Call, cst.BaseExpression] = {}
        self.redirects: dict[cst.Call, str] = {}
        self.regions: dict[cst.With, tuple[Block, int, int]] = {}
        self.migrated = False
        self.declined = False

    def _qualified(self, node: cst.CSTNode) -> set[str]:
        return {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        module = super().leave_Module(original_node, updated_node)
        if not self.migrated:
            return module
        keep = self.context.scratch.get(KEEP_NAMES, ())
        return drop_dead_import_guards(remove_unused_imports(module, _APEX, parents=True, keep=keep))

    def visit_Module(self, node: cst.Module) -> None:
        self._reset()
        scan = ApexScan(self._qualified)
        node.visit(scan)
        if not (scan.uses or scan.problems):
            return
        problems = check(scan) or self._place_autocast(scan)
        if problems:
            self.declined = True
            for where, why in problems:
                self.warn(f"line {self._line(where)}: {why}; the file is left unchanged")
            return
        self._plan(node, scan)

    def _place_autocast(self, scan: ApexScan) -> list[tuple[cst.CSTNode, str]]:
        """Find, for every ``amp.scale_loss``, the forward pass to wrap in autocast (into ``regions``).

        The forward pass is looked for in the block of the ``with`` and, when that is the branch of an
        ``if`` (``if args.fp16: with amp.scale_loss(...)``), in the block around the ``if``. Without
        autocast the migrated file would train in FP32 with loss scaling, so a miss is a problem.
        """
        bound = bind_args(scan.init.call, INIT_PARAMS) or {}
        if level_plan(bound, "torch", "scaler")[1] is None:  # O0: no autocast to place
            return []
        owners: dict[cst.CSTNode, cst.If] = {}
        for stmt in scan.parent_block:
            if isinstance(stmt, cst.If):
                owners[stmt.body] = stmt
                if isinstance(stmt.orelse, cst.Else):
                    owners[stmt.orelse.body] = stmt
        init_stmt = scan.init.condition or scan.init.stmt
        init_at = scan.line_of(init_stmt) if init_stmt is not None else None
        problems = []
        for with_node, use in scan.scale_withs.items():
            loss = (bind_args(use.call, SCALE_LOSS_PARAMS) or {})["loss"].value
            stmt: cst.BaseStatement | None = with_node
            while isinstance(loss, cst.Name) and stmt is not None and with_node not in self.regions:
                place = scan.line_of(stmt)
                if place is None:
                    break
                region = forward_region(place[0].body, place[1], loss.value)
                if region is not None and init_at is not None and init_at[0] is place[0]:
                    start = max(region[0], init_at[1] + 1)  # never wrap amp.initialize itself
                    region = (start, region[1]) if start < region[1] else None
                if region is not None:
                    self.regions[with_node] = (place[0], *region)
                stmt = owners.get(place[0])
            if with_node not in self.regions:
                problems.append((
                    with_node,
                    f"cannot place autocast: no forward pass computing `{code_of(loss)}` in the statements "
                    "before amp.scale_loss in its block (a forward inside another `with`, a loop or a helper "
                    "block is not followed); without autocast the migrated file would train in FP32",
                ))
        return problems

    def _plan(self, module: cst.Module, scan: ApexScan) -> None:
        self.migrated = True
        init = scan.init
        bound = bind_args(init.call, INIT_PARAMS) or {}
        self.scaler = fresh_name(all_names(module), "scaler", "grad_scaler", "amp_scaler")
        bound_torch = torch_binding(module)
        self.torch = bound_torch or "torch"
        if bound_torch is None:
            AddImportsVisitor.add_needed_import(self.context, "torch")

        condition = init.condition.test if init.condition is not None else None
        if condition is not None:  # `if args.fp16:` -> GradScaler(enabled=args.fp16), kept unconditional
            bound = {**bound, "enabled": cst.Arg(condition)}
        scaler_args, autocast_args, notes, dead = level_plan(bound, self.torch, self.scaler)
        for warning in dead_option_warnings(module, bound, dead, self._line, init.call):
            self.warn(warning)
        before, aliases, scaler_line = self._init_statements(init, bound, scaler_args, scan)
        if init.condition is None:
            record = self.edit(init.stmt)
            record.notes.extend(notes)
            record.replacement = [*before, *aliases, scaler_line]
        else:
            self.edit(init.stmt).replacement = aliases
            record = self.edit(init.condition)
            record.notes.extend(notes)
            record.before.extend([*before, scaler_line])
            body = init.condition.body.body if isinstance(init.condition.body, cst.IndentedBlock) else ()
            if len(body) == 1 and not aliases and init.condition.orelse is None:
                record.replacement = []  # the `if` held only amp.initialize

        self.scale_withs = dict(scan.scale_withs)
        if autocast_args is not None:
            same = [a for a in autocast_args if a.keyword is None or a.keyword.value != "enabled"]
            for with_node, use in self.scale_withs.items():
                args = autocast_args
                if condition is not None and use.function is init.function:
                    args = [*same, tight_kwarg("enabled", condition)]  # the condition itself, where visible
                item = call(f"{self.torch}.autocast", cst.Arg(string("cuda")), *args)
                block, start, stop = self.regions[with_node]
                if not any(w.start == start and w.stop == stop for w in self.wraps.get(block, [])):
                    self.add_wrap(block, Wrap(start, stop, item))
        optimizers = optimizers_by_function(scan)
        for step in scan.steps:
            if step.stmt is not None and receiver(step.call) in optimizers.get(step.function, set()):
                self.step_stmts.setdefault(step.stmt, set()).add(receiver(step.call))
        model = bound["models"].value if "models" in bound else None
        for use in scan.uses:
            if use.api in ("state_dict", "load_state_dict"):
                self.redirects[use.call] = use.api
                if use.api == "load_state_dict" and use.stmt is not None:
                    self.edit(use.stmt).notes.append("GradScaler state replaces apex amp state in checkpoints")
            elif use.api == "master_params":
                self._plan_master_params(use, model, optimizers)

    def _init_statements(
        self,
        init: Use,
        bound: dict[str, cst.Arg],
        scaler_args: list[cst.Arg],
        scan: ApexScan,
    ) -> tuple[list[cst.BaseStatement], list[cst.BaseStatement], cst.SimpleStatementLine]:
        """The statements replacing ``amp.initialize``: ([global], [aliases], scaler)."""
        assert isinstance(init.stmt, cst.SimpleStatementLine)
        before: list[cst.BaseStatement] = []
        stmts: list[cst.BaseStatement] = []
        if init.function is not None and any(u.function is not init.function for u in scan.uses):
            before.append(cst.SimpleStatementLine(body=[cst.Global(names=[cst.NameItem(cst.Name(self.scaler))])]))
        small = init.stmt.body[0]
        returned = [bound["models"].value, bound["optimizers"].value] if "models" in bound else []
        if isinstance(small, cst.Assign) and returned:
            target = small.targets[0].target
            elements = target.elements if isinstance(target, cst.Tuple | cst.List) else ()
            if [code_of(e.value) for e in elements] != [code_of(v) for v in returned]:
                value = cst.Tuple(
                    elements=[
                        cst.Element(returned[0], comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                        cst.Element(returned[1]),
                    ],
                    lpar=[],
                    rpar=[],
                )
                stmts.append(cst.SimpleStatementLine(body=[small.with_changes(value=value)]))
        scaler = call(f"{self.torch}.amp.GradScaler", *scaler_args)
        line = assign_line(self.scaler, scaler).with_changes(
            trailing_whitespace=init.stmt.trailing_whitespace,
            # comments among amp.initialize's arguments go above the scaler
            leading_lines=comment_lines(init.stmt.body[0]),
        )
        return before, stmts, line

    def _plan_master_params(
        self, use: Use, model: cst.BaseExpression | None, optimizers: dict[cst.FunctionDef | None, set[str]]
    ) -> None:
        opt = code_of(use.call.args[0].value)
        scope = self.get_metadata(ScopeProvider, use.call, None)
        if isinstance(model, cst.Name) and scope is not None and model.value in scope:
            expr = f"{model.value}.parameters()"
        else:
            expr = f'(p for group in {opt}.param_groups for p in group["params"])'
        self.replacements[use.call] = cst.parse_expression(expr)
        if use.stmt is None:
            return
        if use.function in optimizers:
            unscale = expr_line(call(f"{self.scaler}.unscale_", cst.Arg(cst.parse_expression(opt))))
            record = self.edit(use.stmt)
            if not record.before:
                record.before.append(unscale)
        else:
            self.warn(f"line {self._line(use.call)}: call {self.scaler}.unscale_({opt}) before clipping here")

    # -- transformation --------------------------------------------------------------------------

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if original_node in self.replacements:
            return self.replacements[original_node]
        api = self.redirects.get(original_node)
        if api is None:
            return updated_node
        return updated_node.with_changes(func=cst.Attribute(value=cst.Name(self.scaler), attr=cst.Name(api)))

    def leave_With(self, original_node: cst.With, updated_node: cst.With) -> cst.With:
        use = self.scale_withs.get(original_node)
        if use is None or not isinstance(updated_node.body, cst.IndentedBlock):
            return updated_node
        item = updated_node.items[0]
        loss = (bind_args(item.item, SCALE_LOSS_PARAMS) or {})["loss"]  # type: ignore[arg-type]
        scaled = call(f"{self.scaler}.scale", bare(loss))
        name = item.asname.name.value  # type: ignore[union-attr]
        block = updated_node.body
        if count_variable(block, name) == 1:
            stmts = [s.visit(ReplaceVariable(name, scaled)) for s in block.body]
        else:
            stmts = [assign_line(name, scaled), *block.body]
        if block.header.comment is not None:
            first = stmts[0]
            if isinstance(first, cst.SimpleStatementLine) and first.trailing_whitespace.comment is None:
                stmts[0] = first.with_changes(trailing_whitespace=block.header)
            else:
                comment = cst.EmptyLine(comment=block.header.comment)
                stmts[0] = first.with_changes(leading_lines=[comment, *first.leading_lines])
        record = self.edit(original_node)
        record.replacement = [s for s in stmts if isinstance(s, cst.BaseStatement)]
        record.trailing = list(block.footer)
        return updated_node

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        optimizers = self.step_stmts.get(original_node)
        if optimizers is None:
            return updated_node
        lines = rewrite_step_line(updated_node, optimizers, self.scaler)
        if len(lines) == 1:
            return lines[0]
        self.edit(original_node).replacement = list(lines)
        return updated_node
