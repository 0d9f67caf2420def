"""Analysis half of the apex codemod: find apex amp uses, check they can be migrated, map opt levels."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from amplite.migrate._blocks import ScopeScanner, receiver
from amplite.migrate._cst import QualifiedNames, bind_args, code_of, matches_prefix, string, tight_kwarg

INIT_PARAMS = (
    "models", "optimizers", "enabled", "opt_level", "cast_model_type", "patch_torch_functions",
    "keep_batchnorm_fp32", "master_weights", "loss_scale", "cast_model_outputs", "num_losses", "verbosity",
    "min_loss_scale", "max_loss_scale",
)  # fmt: skip
SCALE_LOSS_PARAMS = ("loss", "optimizers", "loss_id", "model", "delay_unscale", "delay_overflow_check")
_SUPPORTED = ("initialize", "scale_loss", "state_dict", "load_state_dict", "master_params")
_SIMPLE = (cst.Name, cst.Attribute)
_LEVEL_NOTES = {
    "O2": "apex O2 (FP16 weights, FP32 master copy) is now autocast: weights stay FP32",
    "O3": "apex O3 (pure FP16, no loss scaling) is now autocast: weights stay FP32",
}

Problem = tuple[cst.CSTNode, str]


@dataclass
class Use:
    """One call of an apex amp function (or of ``X.step()``)."""

    api: str
    call: cst.Call
    function: cst.FunctionDef | None
    stmt: cst.BaseStatement | None
    top_level: bool = False
    #: ``if args.fp16:`` directly around a top-level ``amp.initialize`` statement (its only condition).
    condition: cst.If | None = None


class ApexScan(ScopeScanner):
    """Collects apex amp uses, ``X.step()`` calls and anything the codemod cannot migrate."""

    def __init__(self, qualified: QualifiedNames) -> None:
        super().__init__()
        self.qualified = qualified
        self.uses: list[Use] = []
        self.steps: list[Use] = []
        self.problems: list[Problem] = []
        self.scale_withs: dict[cst.With, Use] = {}
        self._handled: set[cst.CSTNode] = set()

    @property
    def init(self) -> Use:
        """The (single, checked) ``amp.initialize`` call."""
        return next(u for u in self.uses if u.api == "initialize")

    def api(self, node: cst.CSTNode) -> str | None:
        """The apex amp function ``node`` names ("" for the module itself), or None."""
        for name in self.qualified(node):
            if matches_prefix(name, ("apex.amp",)):
                return name[len("apex.amp.") :]
        return None

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> bool:
        return not isinstance(node.target, cst.Name)  # `amp = None` fallbacks are not uses

    def visit_With(self, node: cst.With) -> None:
        item = node.items[0] if len(node.items) == 1 else None
        if (
            item is not None
            and isinstance(item.item, cst.Call)
            and self.api(item.item.func) == "scale_loss"
            and item.asname is not None
            and isinstance(item.asname.name, cst.Name)
            and isinstance(node.body, cst.IndentedBlock)
        ):
            self.scale_withs[node] = Use("scale_loss", item.item, self.function, node)

    def visit_Call(self, node: cst.Call) -> None:
        api = self.api(node.func)
        if api is None:
            if isinstance(node.func, cst.Attribute) and node.func.attr.value == "step":
                self.steps.append(Use("step", node, self.function, self.statement))
            return
        self._handled.add(node.func)
        parent = self.statements[-2] if len(self.statements) > 1 else None
        top = len(self.statements) == 1 or (parent is not None and parent is self.function)
        condition = None
        if api == "initialize" and not top and isinstance(parent, cst.If) and _in_body(parent, self.statement):
            grand = self.statements[-3] if len(self.statements) > 2 else None
            if len(self.statements) == 2 or (grand is not None and grand is self.function):
                top, condition = True, parent
        if api not in _SUPPORTED:
            self.problems.append((node, f"`amp.{api}` has no torch.amp equivalent"))
        elif api == "scale_loss" and not any(use.call is node for use in self.scale_withs.values()):
            self.problems.append((node, "amp.scale_loss is only migrated as `with amp.scale_loss(...) as x:`"))
        else:
            self.uses.append(Use(api, node, self.function, self.statement, top, condition))

    def _reference(self, node: cst.Name | cst.Attribute) -> bool:
        if node in self._handled:
            return False
        if self.api(node) is not None:
            self.problems.append((node, "apex amp is used other than through a supported call"))
            return False
        return True

    def visit_Name(self, node: cst.Name) -> bool:
        return self._reference(node)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        return self._reference(node)


def _in_body(node: cst.If, stmt: cst.BaseStatement | None) -> bool:
    """Whether ``stmt`` is a statement of ``node``'s own body (not of its ``else``/``elif``)."""
    return isinstance(node.body, cst.IndentedBlock) and any(s is stmt for s in node.body.body)


def _is_expr_stmt(use: Use) -> bool:
    return isinstance(use.stmt, cst.SimpleStatementLine) and any(
        isinstance(small, cst.Expr) and small.value is use.call for small in use.stmt.body
    )


def optimizers_by_function(scan: ApexScan) -> dict[cst.FunctionDef | None, set[str]]:
    """Source of the optimizers passed to amp.scale_loss, by enclosing function."""
    default = bind_args(scan.init.call, INIT_PARAMS) or {}
    found: dict[cst.FunctionDef | None, set[str]] = {}
    for use in scan.scale_withs.values():
        opt = (bind_args(use.call, SCALE_LOSS_PARAMS) or {}).get("optimizers", default.get("optimizers"))
        if opt is not None:
            found.setdefault(use.function, set()).add(code_of(opt.value))
    return found


def check(scan: ApexScan) -> list[Problem]:
    """Problems that make the file unsafe to migrate (empty if it can be migrated)."""
    if scan.problems:
        return scan.problems
    inits = [u for u in scan.uses if u.api == "initialize"]
    if len(inits) != 1:
        why = "several amp.initialize calls" if inits else "no amp.initialize in this file"
        return [((inits or scan.uses)[-1].call, why)]
    init = inits[0]
    bound = bind_args(init.call, INIT_PARAMS)
    stmt = init.stmt
    small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
    if bound is None or not init.top_level or not isinstance(small, cst.Assign | cst.Expr):
        return [
            (init.call, "amp.initialize must be a plain statement in a function or module body, or in one `if` there")
        ]
    if isinstance(small, cst.Assign) and len(small.targets) != 1:
        return [(init.call, "chained assignment of amp.initialize")]
    if init.condition is not None and "enabled" in bound:
        return [(init.call, "amp.initialize(enabled=...) under an `if`: two conditions for one scaler")]
    if "optimizers" not in bound or not isinstance(bound["optimizers"].value, _SIMPLE):
        return [(init.call, "amp.initialize needs exactly one optimizer (not a list, not inference-only)")]
    level = bound.get("opt_level")
    literal = level.value if level is not None and isinstance(level.value, cst.SimpleString) else None
    if literal is not None and literal.evaluated_value not in ("O0", "O1", "O2", "O3"):
        return [(init.call, f"unknown opt_level {code_of(literal)}")]
    if literal is not None and literal.evaluated_value == "O3" and init.condition is not None:
        # O3 has no loss scaling: a disabled scaler could not carry the condition to autocast elsewhere
        return [(init.call, "apex O3 under an `if`: no scaler to carry the condition")]
    problems: list[Problem] = []
    for use in scan.scale_withs.values():
        args = bind_args(use.call, SCALE_LOSS_PARAMS)
        optimizer = (args or {}).get("optimizers", bound["optimizers"]).value
        if args is None or "loss" not in args or not isinstance(optimizer, _SIMPLE):
            problems.append((use.call, "amp.scale_loss needs a loss and one optimizer"))
    for use in scan.uses:
        if use.api == "master_params" and not (len(use.call.args) == 1 and isinstance(use.call.args[0].value, _SIMPLE)):
            problems.append((use.call, "amp.master_params needs one optimizer argument"))
    for function, optimizers in optimizers_by_function(scan).items():
        steps = [s for s in scan.steps if s.function is function and receiver(s.call) in optimizers]
        if not steps or any(s.call.args or not _is_expr_stmt(s) for s in steps):
            where = next(u.call for u in scan.scale_withs.values() if u.function is function)
            problems.append((where, "no plain `optimizer.step()` after amp.scale_loss in this function"))
    return problems


def level_plan(
    bound: dict[str, cst.Arg], torch: str, scaler: str
) -> tuple[list[cst.Arg], list[cst.Arg] | None, list[str], list[str]]:
    """Translate ``amp.initialize`` options.

    Args:
        bound: The ``amp.initialize`` arguments by parameter name.
        torch: Name bound to the torch module.
        scaler: Name of the GradScaler variable.

    Returns:
        GradScaler arguments, autocast arguments after the device (None: no autocast, for O0), the
        notes to leave as comments, and the parameters whose values no longer do anything (dropped, or a
        non-literal ``opt_level``).
    """
    level_arg = bound.get("opt_level")
    level: str | None = "O1"
    notes = []
    if level_arg is not None:
        level = str(level_arg.value.evaluated_value) if isinstance(level_arg.value, cst.SimpleString) else None
        if level is None:
            notes.append(f"opt_level={code_of(level_arg.value)} is not a literal: migrated as O1")
    if level in _LEVEL_NOTES:
        notes.append(_LEVEL_NOTES[level])
    scaler_args = [cst.Arg(string("cuda"))]
    loss_scale = bound.get("loss_scale")
    dropped = [p for p in INIT_PARAMS[4:] if p in bound and p not in ("loss_scale", "verbosity")]
    if loss_scale is not None and isinstance(loss_scale.value, cst.Integer | cst.Float):
        scaler_args.append(tight_kwarg("init_scale", loss_scale.value))
        notes.append(f"apex's static loss_scale={code_of(loss_scale.value)} is now the initial dynamic scale")
    elif loss_scale is not None and getattr(loss_scale.value, "evaluated_value", None) != "dynamic":
        dropped.append("loss_scale")
    enabled = bound.get("enabled")
    if level == "O0" or (level == "O3" and loss_scale is None):
        scaler_args.append(tight_kwarg("enabled", cst.Name("False")))  # apex used loss scale 1.0 here
        if enabled is not None and level == "O3":
            dropped.append("enabled")  # autocast would read it from the scaler, which is off
            enabled = None
    elif enabled is not None:
        scaler_args.append(tight_kwarg("enabled", enabled.value))
    if dropped:
        notes.append("dropped amp.initialize options: " + ", ".join(dropped))
    dead = (["opt_level"] if level_arg is not None and level is None else []) + dropped
    if level == "O0":
        return scaler_args, None, notes, dead
    autocast = [tight_kwarg("dtype", cst.parse_expression(f"{torch}.float16"))]
    if enabled is not None:
        autocast.append(tight_kwarg("enabled", cst.parse_expression(f"{scaler}.is_enabled()")))
    return scaler_args, autocast, notes, dead
