"""Codemod: add mixed precision to a plain FP32 training loop (``amplite migrate --add-autocast``).

A loop qualifies when its body holds exactly one ``loss.backward()`` statement and a plain
``optimizer.step()``. The statements computing ``loss`` (forward pass and loss function) are wrapped in
``torch.autocast``; for fp16 a ``GradScaler`` is created before the outermost loop and drives backward,
step and (if present) gradient clipping. Files that already use any AMP API are left alone, which also
makes the codemod idempotent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import libcst as cst
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider, QualifiedNameProvider

from amplite.migrate._blocks import BlockEditMixin, ScopeScanner, Wrap, forward_region, receiver, rewrite_step_line
from amplite.migrate._cst import (
    QualifiedNames,
    all_names,
    assign_line,
    attr_chain,
    call,
    expr_line,
    fresh_name,
    matches_prefix,
    names_read,
    string,
    tight_kwarg,
    torch_binding,
)

_AMP_APIS = ("torch.amp", "torch.autocast", "torch.cuda.amp", "torch.cpu.amp", "apex")
_CLIPS = ("clip_grad_norm_", "clip_grad_value_")
_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
#: Names that read as an optimizer: opt, optim, optimizer, opt_g, d_optimizer, ...
_OPTIMIZER_NAME = re.compile(r"(\w+_)?(opt|optim|optimi[sz]er)(_\w+)?")


@dataclass
class _Event:
    """A ``.backward()``, ``.step()`` or gradient-clipping call and where it sits."""

    call: cst.Call
    stmt: cst.BaseStatement | None
    loop: cst.For | cst.While | None
    outer: cst.For | cst.While | None


class _LoopScan(ScopeScanner):
    def __init__(self, qualified: QualifiedNames) -> None:
        super().__init__()
        self.qualified = qualified
        self.uses_amp = False
        self.optimizers: set[str] = set()
        self.devices: set[str] = set()
        self.backwards: list[_Event] = []
        self.steps: list[_Event] = []
        self.clips: list[_Event] = []

    def _event(self, node: cst.Call) -> _Event:
        loops = self.loops
        return _Event(node, self.statement, loops[-1] if loops else None, loops[0] if loops else None)

    def visit_Assign(self, node: cst.Assign) -> None:
        names = self.qualified(node.value.func) if isinstance(node.value, cst.Call) else set()
        targets = {t.target.value for t in node.targets if isinstance(t.target, cst.Name)}
        if any(n.startswith("torch.optim.") and ".lr_scheduler" not in n for n in names):
            self.optimizers |= targets
        if "torch.device" in names:
            self.devices |= targets

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.uses_amp = self.uses_amp or any(matches_prefix(n, _AMP_APIS) for n in self.qualified(node))

    def visit_Name(self, node: cst.Name) -> None:
        self.uses_amp = self.uses_amp or any(matches_prefix(n, _AMP_APIS) for n in self.qualified(node))

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Attribute) and node.func.attr.value == "backward":
            self.backwards.append(self._event(node))
        elif isinstance(node.func, cst.Attribute) and node.func.attr.value == "step":
            self.steps.append(self._event(node))
        elif any(n.startswith("torch.nn.utils") and n.endswith(_CLIPS) for n in self.qualified(node.func)):
            self.clips.append(self._event(node))

    def is_optimizer(self, node: cst.Call) -> bool:
        """Whether ``X`` in ``X.step()`` looks like an optimizer (not an LR scheduler)."""
        name = receiver(node).rsplit(".", 1)[-1]
        return name in self.optimizers or bool(_OPTIMIZER_NAME.fullmatch(name.lower()))


def _in_line(event: _Event) -> bool:
    """The call is a whole statement of a statement line (possibly among ``;``-separated ones)."""
    stmt = event.stmt
    return isinstance(stmt, cst.SimpleStatementLine) and any(
        isinstance(small, cst.Expr) and small.value is event.call for small in stmt.body
    )


def _alone(event: _Event) -> bool:
    """The call is the whole statement line (so it can be rewritten or wrapped around)."""
    stmt = event.stmt
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and stmt.body[0].value is event.call
    )


class AddAutocastCommand(BlockEditMixin, VisitorBasedCodemodCommand):
    """Wrap the forward pass of plain training loops in ``torch.autocast`` (plus a GradScaler for fp16)."""

    DESCRIPTION = (
        "Add mixed precision to plain FP32 training loops: torch.autocast around the forward pass and loss, "
        "and a torch.amp.GradScaler for fp16."
    )
    METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider)

    def __init__(self, context: CodemodContext, dtype: Literal["bf16", "fp16"] = "bf16") -> None:
        super().__init__(context)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'bf16' or 'fp16', not {dtype!r}")
        self.dtype = dtype
        self._reset()

    def _reset(self) -> None:
        """Per-module state (an instance may transform several modules)."""
        self.reset_edits()
        self.scaler = "scaler"
        self.backward_stmts: dict[cst.BaseStatement, str] = {}
        self.step_stmts: dict[cst.BaseStatement, set[str]] = {}

    def _qualified(self, node: cst.CSTNode) -> set[str]:
        return {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def visit_Module(self, node: cst.Module) -> None:
        self._reset()
        scan = _LoopScan(self._qualified)
        node.visit(scan)
        if scan.uses_amp or not scan.backwards:
            return
        bound_torch = torch_binding(node)
        torch = bound_torch or "torch"
        self.scaler = fresh_name(all_names(node), "scaler", "grad_scaler", "amp_scaler")
        planned = False
        scalers: set[cst.CSTNode] = set()
        for event in scan.backwards:
            why = self._plan_loop(scan, event, torch, scalers)
            if why is None:
                planned = True
            else:
                self.warn(f"line {self._line(event.call)}: {why}; --add-autocast left it unchanged")
        if planned and bound_torch is None:
            AddImportsVisitor.add_needed_import(self.context, "torch")

    def _plan_loop(self, scan: _LoopScan, event: _Event, torch: str, scalers: set[cst.CSTNode]) -> str | None:
        """Plan the rewrite of the loop around ``event`` (a backward call); return why not, if it can't."""
        loss = event.call.func.value if isinstance(event.call.func, cst.Attribute) else None
        if event.loop is None:
            return "`.backward()` is not inside a loop"
        if sum(1 for other in scan.backwards if other.loop is event.loop) > 1:
            return "several `.backward()` calls in one loop"
        if not isinstance(loss, cst.Name) or not _alone(event):
            return "`.backward()` is not a plain `loss.backward()` statement"
        steps = [s for s in scan.steps if s.loop is event.loop and scan.is_optimizer(s.call)]
        optimizers = {receiver(s.call) for s in steps}
        if not steps or any(s.call.args or not _in_line(s) for s in steps):
            return "no plain `optimizer.step()` in the same loop"
        if self.dtype == "fp16" and len(optimizers) > 1:
            return "several optimizers step in this loop"
        assert event.stmt is not None
        place = scan.line_of(event.stmt)
        region = forward_region(place[0].body, place[1], loss.value) if place else None
        if place is None or region is None:
            return f"could not find the forward pass computing `{loss.value}`"

        devices = sorted(names_read(event.loop) & scan.devices)

        def device() -> cst.Arg:  # `device.type` follows a script that picks CPU or CUDA at run time
            return cst.Arg(attr_chain(f"{devices[0]}.type") if devices else string("cuda"))

        dtype = tight_kwarg("dtype", attr_chain(f"{torch}.{_DTYPES[self.dtype]}"))
        self.add_wrap(place[0], Wrap(region[0], region[1], call(f"{torch}.autocast", device(), dtype)))
        if self.dtype == "bf16":
            return None  # bf16 has FP32's range: no loss scaling needed
        self.backward_stmts[event.stmt] = loss.value
        for step in steps:
            assert step.stmt is not None
            self.step_stmts[step.stmt] = optimizers
        clips = [c for c in scan.clips if c.loop is event.loop and c.stmt is not None]
        if clips:
            unscale = call(f"{self.scaler}.unscale_", cst.Arg(cst.parse_expression(next(iter(optimizers)))))
            self.edit(clips[0].stmt).before.append(expr_line(unscale))  # type: ignore[arg-type]
        outer = event.outer
        if outer is not None and outer not in scalers:
            scalers.add(outer)
            scaler = assign_line(self.scaler, call(f"{torch}.amp.GradScaler", device()))
            self.edit(outer).before.append(scaler)
        return None

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        loss = self.backward_stmts.get(original_node)
        if loss is not None:
            expr = updated_node.body[0]
            assert isinstance(expr, cst.Expr) and isinstance(expr.value, cst.Call)
            func = expr.value.func
            assert isinstance(func, cst.Attribute)
            scaled = func.with_changes(value=call(f"{self.scaler}.scale", cst.Arg(cst.Name(loss))))
            return updated_node.with_changes(body=[expr.with_changes(value=expr.value.with_changes(func=scaled))])
        optimizers = self.step_stmts.get(original_node)
        if optimizers is None:
            return updated_node
        lines = rewrite_step_line(updated_node, optimizers, self.scaler)
        if len(lines) > 1:
            self.edit(original_node).replacement = list(lines)
            return updated_node
        return lines[0]
