"""The report sections of the checks: output verification (the program, the ONNX file, the AOTInductor
package), the accuracy-budget search, the golden reference, the baseline comparison and the gate's verdict.

Typed as :mod:`amplite.report.sections` describes; numbers that may be non-finite are :data:`Num`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from amplite.report.entries import OutputMetricsEntry, ToleranceEntry
from amplite.report.format import PLAIN, Style
from amplite.report.typed import Entry, Num, Section
from amplite.verify.compare import OutputMetrics, Tolerance

__all__ = ["Baseline", "BlockError", "Budget", "BudgetStep", "Check", "DriftEntry", "Golden", "MovedNode",
           "PruneFacts", "Regression", "Verification", "VerificationAoti", "VerificationOnnx"]  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class BlockError(Entry):
    """One block of a checkpoint's block-wise check (``verification.blocks``)."""

    block: str | None = None
    sqnr_db: Num | None = None
    max_abs: Num | None = None


@dataclass(frozen=True, kw_only=True)
class Verification(Section):
    """``verification``: the verdict and per-output metrics (module, gate) or the block-wise check."""

    key = "verification"
    inputs: str | None = None
    batches: int | None = None
    tolerance: ToleranceEntry | None = None
    passed: bool | None = None
    outputs: tuple[OutputMetricsEntry, ...] | None = None
    blocks: tuple[BlockError, ...] | None = None
    peak_weight_bytes: int | None = None

    @classmethod
    def of(cls, metrics: Iterable[OutputMetrics], tolerance: Tolerance | None,  # type: ignore[override]
           inputs: str = "example inputs", batches: int | None = None) -> Verification:  # fmt: skip
        """The section from the compared outputs and the tolerance they were judged by."""
        metrics = list(metrics)
        tol = {**vars(tolerance), "criteria": list(tolerance.criteria)} if tolerance is not None else None
        return cls.from_json({"inputs": inputs, **({"batches": batches} if batches is not None else {}),
                              "tolerance": tol, "passed": all(m.passed for m in metrics),
                              "outputs": [m.to_dict() for m in metrics]})  # fmt: skip

    def folded(self, passed: bool) -> Verification:
        """This verification with another check's verdict folded into ``passed`` (both must hold)."""
        return Verification.from_json({**self.to_json(), "passed": bool(True if self.passed is None else self.passed)
                                       and passed})  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class VerificationAoti(Section):
    """``verification_aoti``: the written AOTInductor package against the FP32 reference."""

    key = "verification_aoti"
    runtime: str | None = None
    path: str | None = None
    device: str | None = None
    passed: bool | None = None
    tolerance: ToleranceEntry | None = None
    outputs: tuple[OutputMetricsEntry, ...] | None = None
    seconds: float | None = None
    notes: Sequence[str] | None = None


@dataclass(frozen=True, kw_only=True)
class VerificationOnnx(Section):
    """``verification_onnx``: the saved .onnx in ONNX Runtime against the FP32 reference."""

    key = "verification_onnx"
    runtime: str | None = None
    path: str | None = None
    provider: str | None = None
    providers_requested: Sequence[str] | None = None
    runnable: bool | None = None
    not_runnable: str | None = None
    unsupported_ops: Sequence[str] | None = None
    caveat: str | None = None
    passed: bool | None = None
    tolerance: ToleranceEntry | None = None
    outputs: tuple[OutputMetricsEntry, ...] | None = None
    seconds: float | None = None
    notes: Sequence[str] | None = None


@dataclass(frozen=True, kw_only=True)
class MovedNode(Entry):
    """A node the budget search moved out of the low dtype, with its isolated error."""

    node: str | None = None
    op: str | None = None
    module: str | None = None
    source: str | None = None
    isolated_sqnr_db: Num | None = None
    to: str | None = None


@dataclass(frozen=True, kw_only=True)
class BudgetStep(Entry):
    """One trial of the budget search."""

    trial: int | None = None
    kind: str | None = None
    moved: int | None = None
    passed: bool | None = None
    worst_sqnr_db: Num | None = None
    seconds: float | None = None


@dataclass(frozen=True, kw_only=True)
class PruneFacts(Entry):
    """The prune phase of the budget search: nodes before and after, trials and their bound."""

    before: int | None = None
    after: int | None = None
    trials: int | None = None
    bound: int | None = None


@dataclass(frozen=True, kw_only=True)
class Budget(Section):
    """``budget``: the accuracy-budget search (``fallback_search``)."""

    key = "budget"
    tolerance: ToleranceEntry | None = None
    passed: bool | None = None
    candidates: int | None = None
    trials: int | None = None
    trial_bound: int | None = None
    search: Mapping[str, int] | None = None
    moved_to_fp32: tuple[MovedNode, ...] | None = None
    prune: PruneFacts | None = None
    steps: tuple[BudgetStep, ...] | None = None
    seconds: float | None = None
    message: str | None = None

    def moved_where(self) -> str:
        """Where the search moved nodes: FP8 products go back to bf16, other low nodes to FP32."""
        to = {m.to or "float32" for m in self.moved_to_fp32 or ()}
        if "bfloat16" not in to:
            return "to FP32"
        return "from FP8 to bf16" if to == {"bfloat16"} else "to bf16 (FP8) / FP32"

    def summary(self, style: Style = PLAIN, names: int = 5) -> str:
        """The one sentence on the search every renderer prints: verdict, nodes moved (the first ``names``),
        trials and time, the prune phase, and the search's message."""
        spec = self.tolerance.spec() if self.tolerance is not None else "sqnr_db>=None"
        moved = [m.node for m in self.moved_to_fp32 or ()]
        shown = ", ".join(style.code(n) for n in moved[:names]) + (", …" if len(moved) > names else "")
        prune = self.prune
        return (
            f"{style.strong('Accuracy budget')} ({style.code(spec)}): "
            f"{'met' if self.passed else style.strong('NOT met')} with {len(moved)} of {self.candidates} "
            f"candidate nodes moved {self.moved_where()}{f' ({shown})' if moved else ''}, {self.trials} trials "
            f"(bound {self.trial_bound}), {style.num(self.seconds, 3)} s."
            + (f" The prune phase took {prune.before} nodes down to {prune.after}." if prune and prune.trials else "")
            + (f" {style.text(self.message)}" if self.message else "")
        )


@dataclass(frozen=True, kw_only=True)
class DriftEntry(Entry):
    """How far today's FP32 model drifted from the golden reference on one output."""

    output: str | None = None
    sqnr_db: Num | None = None


@dataclass(frozen=True, kw_only=True)
class Golden(Section):
    """``golden``: where a check's reference came from and how far the FP32 model drifted from it."""

    key = "golden"
    path: str | None = None
    created: str | None = None
    source: Mapping[str, Any] | None = None
    updated: bool | None = None
    reference_drift: tuple[DriftEntry, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class Regression(Entry):
    """One metric of one output that regressed against the baseline."""

    output: str | None = None
    metric: str | None = None
    baseline: Any = None
    current: Any = None
    limit: Any = None


@dataclass(frozen=True, kw_only=True)
class Baseline(Section):
    """``baseline``: the comparison with an accepted report (``check --baseline``)."""

    key = "baseline"
    margin_db: float | None = None
    regressions: tuple[Regression, ...] | None = None
    passed: bool | None = None
    created: str | None = None

    @classmethod
    def of(cls, margin_db: float, regressions: list[dict[str, Any]],  # type: ignore[override]
           created: str | None) -> Baseline:  # fmt: skip
        """The section from the margin, the regressions found and the baseline's creation time."""
        return cls.from_json({"margin_db": margin_db, "regressions": regressions, "passed": not regressions,
                              "created": created})  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Check(Section):
    """``check``: a gate's verdict."""

    key = "check"
    name: str | None = None
    passed: bool | None = None
    exit_code: int | None = None
    reasons: Sequence[str] | None = None

    @classmethod
    def of(cls, name: str, reasons: list[str]) -> Check:  # type: ignore[override]
        """The section from the check's name and its failure reasons (none: it passed, exit code 0)."""
        code = 1 if reasons else 0
        return cls(name=name, passed=code == 0, exit_code=code, reasons=list(reasons))
