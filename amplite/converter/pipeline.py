"""The conversion pipeline: export → precision passes → build the converted program.

Passes edit ``ep.module()``, a GraphModule whose weights share storage with the user's model; passes
never write into those tensors (they assign new ones), so the user's model stays bit-identical.
The converted ExportedProgram is then built from the rewritten graph directly
(:mod:`amplite.converter.direct`: weights lifted back to placeholders, signature and call graph rebuilt,
the passes' FakeTensor metadata kept), checked cheaply, and only when that cannot be done or does not
check out is the rewritten module exported again (about one more ``torch.export``). Which path built
the program, and why, is in the ``build_program`` record; ``AMPLITE_REEXPORT=1`` (or
``run_pipeline(..., reexport=True)``) forces re-export.
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from amplite import op_tables
from amplite.converter.calibration import ValueRange, collect_ranges
from amplite.converter.direct import NotDirect, lift, prove
from amplite.converter.dtype_check import CheckDtypes
from amplite.converter.inputs import bind_to_program
from amplite.converter.tracing import DynamicDims, Inputs, export_model, static_batch_inputs
from amplite.errors import ExportError, InternalError
from amplite.passes.annotate_precision import AnnotatePrecision
from amplite.passes.base import Pass, PassManager, PassRecord
from amplite.passes.cleanup_casts import CleanupCasts
from amplite.passes.fold_batchnorm import FOLDED_PREFIX, FoldBatchNorm
from amplite.passes.fp8_matmul import Fp8Matmul
from amplite.passes.graph_utils import module_path, retype, source_line
from amplite.passes.guard_constants import GuardConstants, SaturateFills
from amplite.passes.inline_regions import InlineRegions, has_regions
from amplite.passes.insert_casts import InsertCasts
from amplite.passes.meta import PRECISION_KEY
from amplite.passes.range_guard import RangeGuard, RangeRules
from amplite.passes.store_low_params import StoreLowPrecisionParams
from amplite.policy import Level, PrecisionPolicy

_EXPORT_CHECKS = {torch.ops.aten._assert_tensor_metadata.default}


@dataclass
class PipelineOutput:
    """Everything the pipeline produced.

    Attributes:
        original: The FP32 ExportedProgram of the user's model.
        converted: The rewritten program (built directly, or re-exported: see ``build``).
        records: One record per pass (counters and time), ``build_program`` last.
        plan: One entry per planned node: name, op, module, source, mode, dtype, reason.
        timings: Seconds spent in ``export``, ``passes``, ``rebuild`` (the direct build, also when
            it fell back) and ``reexport`` (0 when the direct build was used).
        ranges: The calibrated value ranges (None without range rules), for reuse.
        build: ``{"path": "direct"|"reexport", "reason": why re-export was used ("" for direct)}``.
    """

    original: ExportedProgram
    converted: ExportedProgram
    records: list[PassRecord] = field(default_factory=list)
    plan: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    ranges: Mapping[str, ValueRange] | None = None
    build: dict[str, str] = field(default_factory=dict)


def build_passes(
    policy: PrecisionPolicy,
    *,
    fuse_contractions: bool = False,
    ranges: Mapping[str, ValueRange] | None = None,
    range_rules: RangeRules | None = None,
    fp8_ranges: Mapping[str, ValueRange] | None = None,
) -> list[Pass]:
    """The pass list for a policy, in order (``range_guard`` first when ranges are given; ``fp8_ranges``: the
    calibrated ranges static FP8 activation scales come from)."""
    passes: list[Pass] = []
    if ranges is not None and range_rules is not None:
        passes.append(RangeGuard(ranges, range_rules, policy.low_dtype))
    passes += [
        GuardConstants(policy.low_dtype),  # correctness, not accuracy: runs with or without range rules
        AnnotatePrecision(policy, fp8_ranges, fp8_clip_check=range_rules is not None),
        SaturateFills(policy.low_dtype),
        InsertCasts(low_precision_io=policy.low_precision_io),
        CleanupCasts(),
    ]
    if policy.fp8:  # after the plan and its casts, before weights are stored low
        passes.append(Fp8Matmul())
    if policy.level in (Level.O2, Level.O3):
        passes.append(StoreLowPrecisionParams())
    else:  # O1: the user's weights stay FP32; constants amplite derived (folded BatchNorm) need not
        passes.append(StoreLowPrecisionParams(prefix=FOLDED_PREFIX))
    if fuse_contractions:
        from amplite.passes.fuse_contractions import FuseContractions

        passes.append(FuseContractions())
    return passes


def strip_export_checks(gm: torch.fx.GraphModule) -> None:
    """Remove the input guards and dtype asserts export recorded, in the sub-graphs of higher-order ops too;
    re-export recreates valid ones."""
    for sub in gm.modules():
        if isinstance(sub, torch.fx.GraphModule) and sub is not gm:
            _strip_asserts(sub)
    for node in list(gm.graph.nodes):
        if (node.op == "call_module" and node.target == "_guards_fn") or (
            node.op == "call_function" and node.target in _EXPORT_CHECKS
        ):
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    _rename_lifted_constants(gm)
    gm.recompile()


def _strip_asserts(gm: torch.fx.GraphModule) -> None:
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _EXPORT_CHECKS]:
        gm.graph.erase_node(node)
    gm.recompile()


def _rename_lifted_constants(gm: torch.fx.GraphModule) -> None:
    """Give tensor constants that export lifted (``lifted_tensor_N``) names of amplite's own.

    Re-exporting a module that still holds attributes named ``lifted_tensor_N`` makes torch lift them
    under the same names again, and the program's ``.module()`` then fails (``lifted_tensor_0 is not a
    buffer``; seen with transformers' DynamicCache). Distinct names avoid the collision.
    """
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(node.target, str) and node.target.startswith("lifted_tensor_"):
            new = "amplite_constant_" + node.target.removeprefix("lifted_tensor_")
            if not hasattr(gm, new):
                setattr(gm, new, getattr(gm, node.target))
                delattr(gm, node.target)
            node.target = new


def lower_inputs(inputs: Inputs, dtype: torch.dtype) -> Inputs:
    """The example inputs with every FP32 tensor cast to ``dtype`` (for low-precision I/O)."""

    def low(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x

    return pytree.tree_map(low, inputs)


@dataclass
class Rewrite:
    """The rewritten (not yet re-exported) module and what the passes recorded.

    Attributes:
        module: The rewritten GraphModule (callable like the model; no export metadata).
        records: One record per pass.
        plan: The precision decision of every planned node.
        ranges: The calibrated value ranges the range rules used (None without range rules).
        timings: Seconds in ``calibration`` (when run), ``passes`` (calibration included) and
            ``dtype_check`` (the checker that the rewritten graph's dtypes match the plan).
    """

    module: torch.fx.GraphModule
    records: list[PassRecord]
    plan: list[dict[str, Any]]
    ranges: Mapping[str, ValueRange] | None
    timings: dict[str, float]


def rewrite(
    original: ExportedProgram,
    inputs: Inputs,
    policy: PrecisionPolicy,
    *,
    fuse_contractions: bool = False,
    range_rules: RangeRules | None = None,
    calibration: Iterable[Inputs] | None = None,
    fold_batchnorm: bool = True,
    ranges: Mapping[str, ValueRange] | None = None,
) -> Rewrite:
    """Run amplite's passes on a fresh ``original.module()`` (the program itself is not touched).

    Args:
        original: The FP32 program.
        inputs: Example inputs ``(args, kwargs)`` (calibration batch by default).
        policy: The precision policy.
        fuse_contractions: Run the contraction-fusion pass last.
        range_rules: Apply these range rules (None: no range rules).
        calibration: Batches for the range rules (default: the example inputs).
        fold_batchnorm: Fold inference-mode BatchNorm into the preceding convolution first.
        ranges: Value ranges from an earlier ``rewrite`` of the same program with the same
            ``fold_batchnorm`` and batches: calibration is skipped (the budget search's trials).
    """
    timings: dict[str, float] = {}
    start = perf_counter()
    gm = original.module()
    # calibration batches in the program's calling convention (named inputs onto positional parameters)
    batches = [inputs] if calibration is None else [bind_to_program(gm, b) for b in calibration]
    records: list[PassRecord] = []
    if has_regions(gm):  # grad-mode/autocast regions: their ops join the graph; control flow stays exact
        gm, records = PassManager([InlineRegions()])(gm)
    strip_export_checks(gm)
    if policy.low_precision_io:
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dtype == torch.float32:
                node.meta["val"] = retype(val, policy.low_dtype)
    if fold_batchnorm:  # before calibration: folding changes the conv outputs the ranges describe
        # O1 adds the folded shift in FP32 after the low conv, as BatchNorm does under autocast; at O2 that
        # add would run low anyway, so the shift goes into the conv's bias (docs/policy.md, BatchNorm folding)
        o1 = policy.level is Level.O1
        gm, folded = PassManager([FoldBatchNorm("affine" if o1 else "full", policy.low_dtype if o1 else None)])(gm)
        records += folded
    static_fp8 = policy.fp8 == "static"  # activation scales from calibrated ranges, whatever the low dtype
    if range_rules is None and not static_fp8:
        ranges = None
    elif ranges is None and policy.low_dtype != torch.float16 and not static_fp8:
        ranges = {}  # bf16 has FP32's range: only the depth rule applies, and it needs shapes, not values
    elif ranges is None:
        calib_start = perf_counter()
        ranges = collect_ranges(gm, batches, range_rules.percentile if range_rules is not None else None)
        timings["calibration"] = perf_counter() - calib_start
    # bf16's range rules judge shapes only (as without FP8); FP8 reads the values for its scales
    guard = ranges if policy.low_dtype == torch.float16 or ranges is None else {}
    passes = build_passes(policy, fuse_contractions=fuse_contractions, ranges=guard, range_rules=range_rules,
                          fp8_ranges=ranges if static_fp8 else None)  # fmt: skip
    with quiet_shapes(original):  # a pass reading a symbolic size must not pin the program's dynamic dims
        gm, rest = PassManager(passes)(gm)
    timings["passes"] = perf_counter() - start
    gm, check = PassManager([CheckDtypes()])(gm)  # raises InternalError when a pass broke the plan
    timings["dtype_check"] = check[0].seconds
    return Rewrite(gm, records + rest + check, collect_plan(gm), ranges, timings)


def quiet_shapes(program: ExportedProgram) -> contextlib.AbstractContextManager[Any]:
    """Suppress guards in ``program``'s shape environment while the passes run.

    The passes share the program's FakeTensors; one that reads a symbolic size as an ``int`` (a rule
    judged on the example's shapes) would otherwise specialize that dynamic dim for the program built
    from the rewritten graph. Re-export, which traces afresh, never saw those guards either.
    """
    for node in program.graph.nodes:
        env = getattr(getattr(node.meta.get("val"), "fake_mode", None), "shape_env", None)
        if env is not None:
            return env.suppress_guards()
    return contextlib.nullcontext()


def run_pipeline(
    model: torch.nn.Module | ExportedProgram,
    inputs: Inputs,
    policy: PrecisionPolicy,
    *,
    dynamic_batch: bool = False,
    dynamic_dims: DynamicDims | None = None,
    fuse_contractions: bool = False,
    range_rules: RangeRules | None = None,
    calibration: Iterable[Inputs] | None = None,
    fold_batchnorm: bool = True,
    reexport: bool | None = None,
) -> PipelineOutput:
    """Export ``model`` (unless it already is a program), rewrite it under ``policy``, build the program.

    Args:
        model: The FP32 model or its ExportedProgram.
        inputs: Example inputs ``(args, kwargs)`` for tracing.
        policy: The precision policy.
        dynamic_batch: Make dim 0 of every input dynamic.
        dynamic_dims: Also make these dims of these named inputs dynamic (``{"ids": [1]}``).
        fuse_contractions: Run the contraction-fusion pass last.
        range_rules: Apply these range rules (None: no range rules).
        calibration: Batches for the range rules (default: the example inputs).
        fold_batchnorm: Fold inference-mode BatchNorm into the preceding convolution first.
        reexport: Build the converted program by exporting the rewritten module again instead of
            directly (None: only when the environment variable ``AMPLITE_REEXPORT`` is ``1``).
    """
    timings: dict[str, float] = {}
    start = perf_counter()
    dynamic = {"dynamic_batch": dynamic_batch, "dynamic_dims": dynamic_dims}
    original = model if isinstance(model, ExportedProgram) else export_model(model, inputs, **dynamic)
    timings["export"] = perf_counter() - start
    if policy.level is Level.O0:
        return PipelineOutput(original, original, timings=timings | {"passes": 0.0, "rebuild": 0.0, "reexport": 0.0},
                              build={"path": "original", "reason": "O0 changes nothing"})  # fmt: skip

    done = rewrite(
        original, inputs, policy, fuse_contractions=fuse_contractions, range_rules=range_rules,
        calibration=calibration, fold_batchnorm=fold_batchnorm,
    )  # fmt: skip
    timings.update(done.timings)
    if reexport is None:
        reexport = os.environ.get("AMPLITE_REEXPORT", "") == "1"
    start = perf_counter()
    converted, reason = None, "forced (reexport=True or AMPLITE_REEXPORT=1)"
    given = isinstance(model, ExportedProgram)
    if not reexport and given and (dynamic_dims or (dynamic_batch and static_batch_inputs(original))):
        reexport, reason = True, "the program passed in is static where dynamic dims were asked: re-export makes them"
    if not reexport:
        converted, reason = build_direct(original, done.module, policy, inputs)
    timings["rebuild"] = perf_counter() - start
    record = PassRecord("build_program", converted is None, {"direct": int(converted is not None),
                        "reexport": int(converted is None)}, timings["rebuild"],
                        {"fallback": [{"reason": reason}]} if converted is None else {})  # fmt: skip
    if converted is not None:  # ``reexport`` stays a key (0 s) for readers that sum the phases
        timings["reexport"] = 0.0
        return PipelineOutput(original, converted, [*done.records, record], done.plan, timings, done.ranges,
                              {"path": "direct", "reason": ""})  # fmt: skip
    start = perf_counter()
    export_inputs = lower_inputs(inputs, policy.low_dtype) if policy.low_precision_io else inputs
    try:
        converted = export_model(done.module, export_inputs, **dynamic, what="the converted model")
    except ExportError as exc:  # the FP32 model traced: a failure now is amplite's rewrite, not the user's code
        raise InternalError(
            f"amplite bug: {exc.problem.replace('torch.export could not trace', 'torch.export rejected')}"
        ) from exc.__cause__
    timings["reexport"] = perf_counter() - start
    record.seconds += timings["reexport"]
    return PipelineOutput(original, converted, [*done.records, record], done.plan, timings, done.ranges,
                          {"path": "reexport", "reason": reason})  # fmt: skip


def build_direct(
    original: ExportedProgram, module: torch.fx.GraphModule, policy: PrecisionPolicy, inputs: Inputs
) -> tuple[ExportedProgram | None, str]:
    """The converted program lifted from the rewritten ``module`` and checked, or None and why not."""
    example = original.example_inputs if original.example_inputs is not None else inputs
    if example is not None and policy.low_precision_io:
        example = lower_inputs(example, policy.low_dtype)
    try:
        program = lift(original, module, example)
        prove(program, module, example)
    except NotDirect as exc:
        return None, str(exc)
    except Exception as exc:  # a case lifting does not foresee: re-export, which does not depend on it
        return None, f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    return program, ""


def collect_plan(gm: torch.fx.GraphModule) -> list[dict[str, Any]]:
    """The precision decision of every planned node, in graph order."""
    plan = []
    for node in gm.graph.nodes:
        decision = node.meta.get(PRECISION_KEY)
        if decision is None or node.target is operator.getitem:
            continue
        dtype = decision["dtype"]
        plan.append(
            {
                "node": node.name,
                "op": op_tables.op_name(node.target) or str(node.target),
                "module": module_path(node),
                "source": source_line(node),
                "mode": decision["mode"],
                "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
                "reason": decision["reason"],
                "rule": decision.get("rule", "level"),
            }
        )
    return plan
