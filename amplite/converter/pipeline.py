"""The conversion pipeline: export → precision passes → build the converted program.

Passes edit ``ep.module()``, a GraphModule whose weights share storage with the user's model; passes
never write into those tensors (they assign new ones), so the user's model stays bit-identical.
The converted ExportedProgram is then built from the rewritten graph directly
(:mod:`amplite.converter.direct`: weights lifted back to placeholders, signature and call graph rebuilt,
the passes' FakeTensor metadata kept), checked cheaply, and only when that cannot be done or does not
check out is the rewritten module exported again (about one more ``torch.export``). Which path built
the program, and why, is in the ``build_program`` record; ``AMPLITE_REEXPORT=1`` (or
``run_pipeline(..., reexport=True)``) forces re-export.

The settings arrive as one :class:`~amplite.spec.ConvertSpec`; what is not a setting (the example inputs,
calibration batches, ranges already calibrated) stays an argument.
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
from amplite.converter.calibration import Calibrate, ValueRange
from amplite.converter.direct import NotDirect, lift, prove
from amplite.converter.dtype_check import CheckDtypes
from amplite.converter.inputs import bind_to_program
from amplite.converter.sequence import build_passes, precision_sequence, strip_export_checks
from amplite.converter.tracing import Inputs, export_model, static_batch_inputs
from amplite.errors import ExportError, InternalError
from amplite.passes.base import PassRecord
from amplite.passes.graph_utils import module_path, source_line
from amplite.passes.meta import PRECISION_KEY
from amplite.policy import Level, PrecisionPolicy
from amplite.spec import ConvertSpec

#: Kept importable from here (tests, training): the sequence module holds them.
__all__ = ["PipelineOutput", "Rewrite", "build_passes", "collect_plan", "rewrite", "run_pipeline",
           "strip_export_checks"]  # fmt: skip


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
            ``dtype_check`` (the sequence's postcondition: the rewritten graph's dtypes match the plan).
    """

    module: torch.fx.GraphModule
    records: list[PassRecord]
    plan: list[dict[str, Any]]
    ranges: Mapping[str, ValueRange] | None
    timings: dict[str, float]


def rewrite(
    original: ExportedProgram,
    inputs: Inputs,
    spec: ConvertSpec,
    *,
    calibration: Iterable[Inputs] | None = None,
    ranges: Mapping[str, ValueRange] | None = None,
) -> Rewrite:
    """Run the precision sequence (:func:`amplite.converter.sequence.precision_sequence`) on a fresh
    ``original.module()`` (the program itself is not touched).

    Args:
        original: The FP32 program.
        inputs: Example inputs ``(args, kwargs)`` (calibration batch by default).
        spec: The conversion: its policy, range rules, fusion and BatchNorm folding.
        calibration: Batches for the range rules (default: the example inputs).
        ranges: Value ranges from an earlier ``rewrite`` of the same program with the same
            ``fold_batchnorm`` and batches: calibration is skipped (the budget search's trials).
    """
    policy = spec.policy()
    start = perf_counter()
    gm = original.module()
    # calibration batches in the program's calling convention (named inputs onto positional parameters)
    batches = [inputs] if calibration is None else [bind_to_program(gm, b) for b in calibration]
    sequence = precision_sequence(policy, batches, fuse_contractions=spec.fuse, range_rules=spec.range_rules(),
                                  fold_batchnorm=spec.fold_batchnorm, ranges=ranges)  # fmt: skip
    with quiet_shapes(original):  # a pass reading a symbolic size must not pin the program's dynamic dims
        gm, records = sequence.manager(gm)  # raises InternalError when a pass broke its contract or the plan
    seconds = {r.name: r.seconds for r in records}
    check = seconds[CheckDtypes.name]  # the sequence's postcondition, timed apart as before
    timings = {"passes": perf_counter() - start - check, "dtype_check": check}
    if Calibrate.name in seconds:
        timings["calibration"] = seconds[Calibrate.name]
    return Rewrite(gm, records, collect_plan(gm), sequence.ranges, timings)


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
    spec: ConvertSpec,
    *,
    calibration: Iterable[Inputs] | None = None,
    reexport: bool | None = None,
) -> PipelineOutput:
    """Export ``model`` (unless it already is a program), rewrite it as ``spec`` says, build the program.

    Args:
        model: The FP32 model or its ExportedProgram.
        inputs: Example inputs ``(args, kwargs)`` for tracing.
        spec: The conversion (precision policy, dynamic dims, range rules, fusion, BatchNorm folding).
        calibration: Batches for the range rules (default: the example inputs).
        reexport: Build the converted program by exporting the rewritten module again instead of
            directly (None: only when the environment variable ``AMPLITE_REEXPORT`` is ``1``).
    """
    timings: dict[str, float] = {}
    start = perf_counter()
    policy, dynamic_batch, dynamic_dims = spec.policy(), spec.dynamic_batch, spec.dims()
    dynamic: dict[str, Any] = {"dynamic_batch": dynamic_batch, "dynamic_dims": dynamic_dims}
    original = model if isinstance(model, ExportedProgram) else export_model(model, inputs, **dynamic)
    timings["export"] = perf_counter() - start
    if policy.level is Level.O0:
        return PipelineOutput(original, original, timings=timings | {"passes": 0.0, "rebuild": 0.0, "reexport": 0.0},
                              build={"path": "original", "reason": "O0 changes nothing"})  # fmt: skip

    done = rewrite(original, inputs, spec, calibration=calibration)
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
