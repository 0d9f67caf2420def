"""The precision sequence: every pass ``rewrite()`` runs, declared as one list that can be printed.

``precision_sequence(...)`` builds a :class:`~amplite.passes.base.PassManager` named ``precision`` whose
passes run in this order (bracketed ones only under the settings that need them)::

    inline_regions → strip_export_checks → [retype_inputs] → [fold_batchnorm] → [calibrate] →
    [range_guard] → guard_constants → annotate_precision → saturate_fills → insert_casts → cleanup_casts →
    [fp8_matmul] → store_low_params → [fuse_contractions]; ensures check_dtypes

Each pass's ``requires`` runs before it and its ``ensures`` after it; the sequence's own postcondition is
:class:`~amplite.converter.dtype_check.CheckDtypes` (every node runs in the dtype the plan gave it).
``describe()`` prints it, ``names()`` lists it, and the records the run returns follow that list, one per
pass, with the counters the report keeps under each pass's name. Calibration fills a mapping that the
range rules and FP8's static scales were built with, so no pass is built after another has run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx

from amplite.converter.calibration import Calibrate, Inputs, ValueRange
from amplite.converter.dtype_check import CheckDtypes
from amplite.passes.annotate_precision import AnnotatePrecision
from amplite.passes.base import Pass, PassBase, PassManager, PassResult
from amplite.passes.cleanup_casts import CleanupCasts
from amplite.passes.fold_batchnorm import FOLDED_PREFIX, FoldBatchNorm
from amplite.passes.fp8_matmul import Fp8Matmul
from amplite.passes.graph_utils import retype
from amplite.passes.guard_constants import GuardConstants, SaturateFills
from amplite.passes.inline_regions import InlineRegions
from amplite.passes.insert_casts import InsertCasts
from amplite.passes.range_guard import RangeGuard, RangeRules
from amplite.passes.store_low_params import StoreLowPrecisionParams
from amplite.policy import Level, PrecisionPolicy

_EXPORT_CHECKS = {torch.ops.aten._assert_tensor_metadata.default}
_LIFTED = "lifted_tensor_"


def strip_export_checks(gm: torch.fx.GraphModule) -> Counter[str]:
    """Remove the input guards and dtype asserts export recorded, in the sub-graphs of higher-order ops too;
    re-export recreates valid ones. Returns what was removed and renamed."""
    counters: Counter[str] = Counter()
    for sub in gm.modules():
        if isinstance(sub, torch.fx.GraphModule) and sub is not gm:
            counters["checks_removed"] += _strip_asserts(sub)
    for node in list(gm.graph.nodes):
        if (node.op == "call_module" and node.target == "_guards_fn") or (
            node.op == "call_function" and node.target in _EXPORT_CHECKS
        ):
            gm.graph.erase_node(node)
            counters["checks_removed"] += 1
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    counters["constants_renamed"] += _rename_lifted_constants(gm)
    gm.recompile()
    return counters


def _strip_asserts(gm: torch.fx.GraphModule) -> int:
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _EXPORT_CHECKS]
    for node in found:
        gm.graph.erase_node(node)
    gm.recompile()
    return len(found)


def _rename_lifted_constants(gm: torch.fx.GraphModule) -> int:
    """Give tensor constants that export lifted (``lifted_tensor_N``) names of amplite's own.

    Re-exporting a module that still holds attributes named ``lifted_tensor_N`` makes torch lift them
    under the same names again, and the program's ``.module()`` then fails (``lifted_tensor_0 is not a
    buffer``; seen with transformers' DynamicCache). Distinct names avoid the collision.
    """
    renamed = 0
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(node.target, str) and node.target.startswith(_LIFTED):
            new = "amplite_constant_" + node.target.removeprefix(_LIFTED)
            if not hasattr(gm, new):
                setattr(gm, new, getattr(gm, node.target))
                delattr(gm, node.target)
            node.target = new
            renamed += 1
    return renamed


class StripExportChecks(PassBase):
    """Remove export's input guards and dtype asserts (the rewrite changes dtypes they pin)."""

    name = "strip_export_checks"

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters = strip_export_checks(gm)
        return PassResult(gm, counters["checks_removed"] + counters["constants_renamed"] > 0, counters)

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """No guard, no dtype assert (in any sub-graph) and no ``lifted_tensor_`` constant is left."""
        for sub in gm.modules():
            if not isinstance(sub, torch.fx.GraphModule):
                continue
            for node in sub.graph.nodes:
                if (node.op == "call_module" and node.target == "_guards_fn") or (
                    node.op == "call_function" and node.target in _EXPORT_CHECKS
                ):
                    raise self.broken(f"export check {node.name} is still in the graph")
                if node.op == "get_attr" and str(node.target).startswith(_LIFTED):
                    raise self.broken(f"constant {node.target} keeps the name re-export would lift it under")


class RetypeInputs(PassBase):
    """Low-precision I/O: the graph's FP32 inputs arrive in the low dtype, so the plan starts from it.

    Args:
        low_dtype: The conversion's low dtype.
    """

    name = "retype_inputs"

    def __init__(self, low_dtype: torch.dtype) -> None:
        self.low_dtype = low_dtype

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dtype == torch.float32:
                node.meta["val"] = retype(val, self.low_dtype)
                counters["inputs_retyped"] += 1
        return PassResult(gm, False, counters)  # metadata only: the graph's code is unchanged

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """Before the plan, which reads the inputs' dtypes."""
        self.require_unplanned(gm)

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """No graph input is FP32 any more."""
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dtype == torch.float32:
                raise self.broken(f"input {node.name} is still float32")


def build_passes(
    policy: PrecisionPolicy,
    *,
    fuse_contractions: bool = False,
    ranges: Mapping[str, ValueRange] | None = None,
    range_rules: RangeRules | None = None,
    fp8_ranges: Mapping[str, ValueRange] | None = None,
) -> list[Pass]:
    """The precision passes for a policy, in order (``range_guard`` first when ranges are given; ``fp8_ranges``:
    the calibrated ranges static FP8 activation scales come from). The ranges may still be empty: they are
    read when the passes run."""
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


@dataclass
class Sequence:
    """The declared sequence and the ranges it calibrates (or was given).

    Attributes:
        manager: The ``precision`` pass manager (``describe()`` prints it; calling it runs it).
        ranges: The value ranges the range rules read: filled by ``calibrate`` when it is in the sequence,
            the given ones otherwise; None without range rules and static FP8.
    """

    manager: PassManager
    ranges: dict[str, ValueRange] | None


def precision_sequence(
    policy: PrecisionPolicy,
    batches: list[Inputs],
    *,
    fuse_contractions: bool = False,
    range_rules: RangeRules | None = None,
    fold_batchnorm: bool = True,
    ranges: Mapping[str, ValueRange] | None = None,
) -> Sequence:
    """The one sequence of passes ``rewrite()`` runs for these settings (arguments as ``rewrite``'s)."""
    passes: list[Pass] = [InlineRegions(), StripExportChecks()]
    if policy.low_precision_io:
        passes.append(RetypeInputs(policy.low_dtype))
    if fold_batchnorm:  # before calibration: folding changes the conv outputs the ranges describe
        # O1 adds the folded shift in FP32 after the low conv, as BatchNorm does under autocast; at O2 that
        # add would run low anyway, so the shift goes into the conv's bias (docs/policy.md, BatchNorm folding)
        o1 = policy.level is Level.O1  # O1: a scale of 1 in the low dtype before a ReLU'd sum goes into the weight
        passes.append(FoldBatchNorm("affine" if o1 else "full", policy.low_dtype if o1 else None))
    static_fp8 = policy.fp8 == "static"  # activation scales from calibrated ranges, whatever the low dtype
    store: dict[str, ValueRange] | None
    if range_rules is None and not static_fp8:
        store = None
    elif ranges is not None:
        store = dict(ranges)
    elif policy.low_dtype != torch.float16 and not static_fp8:
        store = {}  # bf16 has FP32's range: only the depth rule applies, and it needs shapes, not values
    else:
        store = {}
        passes.append(Calibrate(batches, range_rules.percentile if range_rules is not None else None, store,
                                fp8_scales=static_fp8))
    # bf16's range rules judge shapes only (as without FP8); FP8 reads the values for its scales
    guard = store if policy.low_dtype == torch.float16 or store is None else {}
    passes += build_passes(policy, fuse_contractions=fuse_contractions, ranges=guard, range_rules=range_rules,
                           fp8_ranges=store if static_fp8 else None)  # fmt: skip
    return Sequence(PassManager(passes, name="precision", postcondition=CheckDtypes()), store)
