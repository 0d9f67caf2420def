"""Codemod: deprecated ``torch.cuda.amp`` / ``torch.cpu.amp`` APIs to ``torch.amp``.

Every import and alias form is resolved through libcst's qualified names, so ``torch.cuda.amp.autocast()``,
``amp.autocast()`` after ``from torch.cuda import amp`` and ``ac()`` after
``from torch.cuda.amp import autocast as ac`` are all rewritten to ``torch.amp.autocast("cuda")``.
Positional arguments become keywords because ``torch.amp`` puts the device first.
"""

from __future__ import annotations

import libcst as cst
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider, QualifiedNameProvider

from amplite.migrate._cst import (
    attr_chain,
    code_of,
    insert_arg,
    matches_prefix,
    positional_to_keywords,
    string,
    tight_kwarg,
    torch_binding,
)
from amplite.migrate._imports import KEEP_NAMES, imports_from, remove_unused_imports, replace_dotted_imports

_OLD_MODULES = ("torch.cuda.amp", "torch.cpu.amp")
_AUTOCAST_PARAMS = ("enabled", "dtype", "cache_enabled")
_SCALER_PARAMS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")


def _api_table() -> dict[str, tuple[str, str]]:
    """Qualified name of each deprecated API -> (new ``torch.amp`` name, device type)."""
    table: dict[str, tuple[str, str]] = {}
    for device in ("cuda", "cpu"):
        base = f"torch.{device}.amp"
        table[f"{base}.autocast"] = table[f"{base}.autocast_mode.autocast"] = ("autocast", device)
        table[f"{base}.GradScaler"] = table[f"{base}.grad_scaler.GradScaler"] = ("GradScaler", device)
        for fn in ("custom_fwd", "custom_bwd"):
            table[f"{base}.{fn}"] = table[f"{base}.autocast_mode.{fn}"] = (fn, device)
    return table


_APIS = _api_table()


class TorchAmpCommand(VisitorBasedCodemodCommand):
    """Rewrite ``torch.{cuda,cpu}.amp`` autocast, GradScaler and custom_fwd/bwd to ``torch.amp``."""

    DESCRIPTION = (
        "Rewrite deprecated torch.cuda.amp / torch.cpu.amp autocast, GradScaler and custom_fwd/custom_bwd "
        'to torch.amp with an explicit device ("cuda"/"cpu"), in every import and alias form.'
    )
    METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider)

    def __init__(self, context: CodemodContext) -> None:
        super().__init__(context)
        self._reset()

    def _reset(self) -> None:
        """Per-module state (an instance may transform several modules)."""
        self.torch = "torch"
        self.needs_torch_import = False
        self.references: list[cst.CSTNode] = []
        self.handled: set[cst.CSTNode] = set()
        self.declined: set[cst.CSTNode] = set()
        self.annotation_depth = 0
        self.old_imports = False

    # -- helpers ---------------------------------------------------------------------------------

    def _qualified(self, node: cst.CSTNode) -> set[str]:
        return {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}

    def _api(self, node: cst.CSTNode) -> tuple[str, str] | None:
        for name in self._qualified(node):
            if name in _APIS:
                return _APIS[name]
        return None

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def _new(self, name: str) -> cst.BaseExpression:
        return attr_chain(f"{self.torch}.amp.{name}")

    # -- module ----------------------------------------------------------------------------------

    def visit_Module(self, node: cst.Module) -> None:
        self._reset()
        bound = torch_binding(node)
        self.torch = bound or "torch"
        self.needs_torch_import = bound is None

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        unhandled = [ref for ref in self.references if ref not in self.handled]
        for ref in unhandled:
            why = "unpacked or extra positional arguments" if ref in self.declined else "not a call or decorator"
            self.warn(f"line {self._line(ref)}: `{code_of(ref)}` left unchanged ({why}); migrate it by hand")
        if self.handled and self.needs_torch_import:
            AddImportsVisitor.add_needed_import(self.context, "torch")
        if self.old_imports:
            keep = self.context.scratch.get(KEEP_NAMES, ())
            updated_node = remove_unused_imports(updated_node, _OLD_MODULES, keep=keep)
            if not unhandled:
                updated_node = replace_dotted_imports(updated_node, _OLD_MODULES)
        return updated_node

    # -- references ------------------------------------------------------------------------------

    def visit_Import(self, node: cst.Import) -> bool:
        self.old_imports = self.old_imports or imports_from(node, _OLD_MODULES)
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        self.old_imports = self.old_imports or imports_from(node, _OLD_MODULES)
        return False

    def visit_Annotation(self, node: cst.Annotation) -> None:
        self.annotation_depth += 1

    def leave_Annotation(self, original_node: cst.Annotation, updated_node: cst.Annotation) -> cst.Annotation:
        self.annotation_depth -= 1
        return updated_node

    def _note_reference(self, node: cst.Name | cst.Attribute) -> bool:
        if any(matches_prefix(q, _OLD_MODULES) for q in self._qualified(node)):
            self.references.append(node)
            return False  # the outermost deprecated reference is enough
        return True

    def visit_Name(self, node: cst.Name) -> bool:
        return self._note_reference(node)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        return self._note_reference(node)

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
        return self._rewrite_annotation(original_node, updated_node)

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.BaseExpression:
        return self._rewrite_annotation(original_node, updated_node)

    def _rewrite_annotation(self, original: cst.CSTNode, updated: cst.BaseExpression) -> cst.BaseExpression:
        # torch.cuda.amp.GradScaler/autocast subclass the torch.amp classes, so annotations can name the base.
        api = self._api(original) if self.annotation_depth else None
        if api is None or api[0] not in ("autocast", "GradScaler"):
            return updated
        self.handled.add(original)
        return self._new(api[0])

    # -- calls and decorators --------------------------------------------------------------------

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        api = self._api(original_node.func)
        if api is None:
            return updated_node
        name, device = api
        if name in ("autocast", "GradScaler"):
            params = _AUTOCAST_PARAMS if name == "autocast" else _SCALER_PARAMS
            keyworded = positional_to_keywords(updated_node, params)
            if keyworded is None:
                self.declined.add(original_node.func)
                return updated_node
            new = insert_arg(keyworded.with_changes(func=self._new(name)), 0, cst.Arg(string(device)))
        else:
            if any(arg.star == "*" for arg in updated_node.args):
                self.declined.add(original_node.func)
                return updated_node
            positionals = sum(1 for arg in updated_node.args if arg.keyword is None and not arg.star)
            device_arg = tight_kwarg("device_type", string(device))
            new = insert_arg(updated_node.with_changes(func=self._new(name)), positionals, device_arg)
        self.handled.add(original_node.func)
        return new

    def leave_Decorator(self, original_node: cst.Decorator, updated_node: cst.Decorator) -> cst.Decorator:
        target = original_node.decorator
        api = None if isinstance(target, cst.Call) else self._api(target)
        if api is None or api[0] not in ("custom_fwd", "custom_bwd"):
            return updated_node
        self.handled.add(target)
        decorator = cst.Call(func=self._new(api[0]), args=[tight_kwarg("device_type", string(api[1]))])
        return updated_node.with_changes(decorator=decorator)
