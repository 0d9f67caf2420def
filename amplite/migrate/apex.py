"""Codemod: NVIDIA apex ``amp`` (removed from apex) to native ``torch.amp``.

apex keeps its loss scaler in a process-wide singleton, so ``amp.scale_loss`` works anywhere once
``amp.initialize`` has run. The migration creates one ``GradScaler`` where ``amp.initialize`` was; when
other functions use it, that statement declares it ``global`` to keep the singleton's reach.

The rewrite is all-or-nothing per file: a half-migrated training step would silently train on scaled
gradients, so any apex use the codemod does not understand leaves the file untouched with a warning.
"""

from __future__ import annotations

import libcst as cst
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider, QualifiedNameProvider, ScopeProvider

from amplite.migrate._apex_scan import (
    INIT_PARAMS,
    SCALE_LOSS_PARAMS,
    ApexScan,
    Use,
    check,
    level_plan,
    optimizers_by_function,
)
from amplite.migrate._blocks import BlockEditMixin, Wrap, forward_region, receiver, rewrite_step_line
from amplite.migrate._cst import (
    ReplaceVariable,
    all_names,
    assign_line,
    bare,
    bind_args,
    call,
    code_of,
    count_variable,
    expr_line,
    fresh_name,
    string,
    torch_binding,
)
from amplite.migrate._imports import drop_dead_import_guards, remove_unused_imports

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
        self.migrated = False

    def _qualified(self, node: cst.CSTNode) -> set[str]:
        return {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        module = super().leave_Module(original_node, updated_node)
        if not self.migrated:
            return module
        return drop_dead_import_guards(remove_unused_imports(module, _APEX, parents=True))

    def visit_Module(self, node: cst.Module) -> None:
        self._reset()
        scan = ApexScan(self._qualified)
        node.visit(scan)
        if not (scan.uses or scan.problems):
            return
        problems = check(scan)
        if problems:
            for where, why in problems:
                self.warn(f"line {self._line(where)}: {why}; apex amp in this file left unchanged")
            return
        self._plan(node, scan)

    def _plan(self, module: cst.Module, scan: ApexScan) -> None:
        self.migrated = True
        init = scan.init
        bound = bind_args(init.call, INIT_PARAMS) or {}
        self.scaler = fresh_name(all_names(module), "scaler", "grad_scaler", "amp_scaler")
        bound_torch = torch_binding(module)
        self.torch = bound_torch or "torch"
        if bound_torch is None:
            AddImportsVisitor.add_needed_import(self.context, "torch")

        scaler_args, autocast_args, notes = level_plan(bound, self.torch, self.scaler)
        record = self.edit(init.stmt)
        record.notes.extend(notes)
        record.replacement = self._init_statements(init, bound, scaler_args, scan)

        self.scale_withs = dict(scan.scale_withs)
        if autocast_args is not None:
            item = call(f"{self.torch}.autocast", cst.Arg(string("cuda")), *autocast_args)
            for with_node, use in self.scale_withs.items():
                self._wrap_forward(scan, with_node, use, item)
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
    ) -> list[cst.BaseStatement]:
        """The statements replacing ``amp.initialize``: [global], [aliases], scaler."""
        assert isinstance(init.stmt, cst.SimpleStatementLine)
        stmts: list[cst.BaseStatement] = []
        if init.function is not None and any(u.function is not init.function for u in scan.uses):
            stmts.append(cst.SimpleStatementLine(body=[cst.Global(names=[cst.NameItem(cst.Name(self.scaler))])]))
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
        line = assign_line(self.scaler, scaler).with_changes(trailing_whitespace=init.stmt.trailing_whitespace)
        return [*stmts, line]

    def _wrap_forward(self, scan: ApexScan, with_node: cst.With, use: Use, item: cst.Call) -> None:
        args = bind_args(use.call, SCALE_LOSS_PARAMS) or {}
        loss = args["loss"].value
        place = scan.line_of(with_node)
        region = forward_region(place[0].body, place[1], loss.value) if place and isinstance(loss, cst.Name) else None
        if place is None or region is None:
            self.warn(
                f"line {self._line(with_node)}: could not find the forward pass computing "
                f"`{code_of(loss)}`; wrap it in torch.autocast by hand"
            )
            return
        self.add_wrap(place[0], Wrap(region[0], region[1], item))

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
