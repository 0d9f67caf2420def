"""The typed entries shared by several report sections (the schema's ``$defs``): tolerances, one output's
metrics, graph statistics, plan entries and one node's error.

Every field is optional in the type (None: absent), because a report read back may come from an older
amplite or a hand edit; which keys a written report must hold is the schema's to say (one writer checks it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from amplite.report.typed import Entry, Num

__all__ = ["CriterionCheck", "ErrorStats", "GraphStats", "NodeError", "OutputMetricsEntry", "PlanEntry",
           "ToleranceEntry"]  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ToleranceEntry(Entry):
    """A tolerance as judged: the default rule's thresholds and the criteria given (``$defs/tolerance``)."""

    min_sqnr_db: float | None = None
    min_cosine: float | None = None
    max_mismatch: float | None = None
    criteria: Sequence[str] | None = None

    def spec(self, default: str = "sqnr_db>={}") -> str:
        """The criteria as one line, or the default rule (``default`` formatted with ``min_sqnr_db``)."""
        return ", ".join(self.criteria or []) or default.format(self.min_sqnr_db)


@dataclass(frozen=True, kw_only=True)
class CriterionCheck(Entry):
    """One criterion judged: ``criterion``, the measured ``value``, whether it ``passed``."""

    criterion: str | None = None
    value: Num | None = None
    passed: bool | None = None


@dataclass(frozen=True, kw_only=True)
class OutputMetricsEntry(Entry):
    """One output compared with its reference (``$defs/output_metrics``)."""

    name: str | None = None
    shape: Sequence[int] | None = None
    dtype: str | None = None
    max_abs: Num | None = None
    mean_abs: Num | None = None
    p99_abs: Num | None = None
    max_rel: Num | None = None
    cosine: Num | None = None
    sqnr_db: Num | None = None
    mismatch: Num | None = None
    top1: Num | None = None
    top5: Num | None = None
    kl_div: Num | None = None
    min_atol: Num | None = None
    min_rtol: Num | None = None
    ref_nonfinite: int | None = None
    out_nonfinite: int | None = None
    new_nonfinite: int | None = None
    elements: int | None = None
    compared: int | None = None
    ref_nan: int | None = None
    batches: int | None = None
    passed: bool | None = None
    checks: tuple[CriterionCheck, ...] | None = None
    extra: Mapping[str, Any] | None = None
    notes: Sequence[str] | None = None

    @property
    def partial(self) -> bool:
        """Whether the metrics cover only the finite part of the output (fewer compared than elements)."""
        return (self.compared or 0) < (self.elements or 0)

    @property
    def failed_criteria(self) -> list[str]:
        """The criteria this output missed."""
        return [c.criterion or "" for c in self.checks or () if not c.passed]


@dataclass(frozen=True, kw_only=True)
class GraphStats(Entry):
    """Node statistics of one graph (``$defs/graph_stats``)."""

    nodes_by_dtype: Mapping[str, int] | None = None
    compute_bound_ops_by_dtype: Mapping[str, Any] | None = None
    casts: int | None = None
    low_precision_flop_share: float | None = None


@dataclass(frozen=True, kw_only=True)
class PlanEntry(Entry):
    """One planned node (``$defs/plan_entry``; an ``fp32_nodes`` entry has no ``mode`` nor ``dtype``)."""

    node: str | None = None
    op: str | None = None
    module: str | None = None
    source: str | None = None
    mode: str | None = None
    dtype: str | None = None
    reason: str | None = None
    rule: str | None = None


@dataclass(frozen=True, kw_only=True)
class ErrorStats(Entry):
    """The error of one node against the reference (``$defs/error``)."""

    sqnr_db: Num | None = None
    max_abs: Num | None = None
    rel_l2: Num | None = None
    new_nonfinite: int | None = None


@dataclass(frozen=True, kw_only=True)
class NodeError(Entry):
    """One node's accumulated and isolated error, and its FP32 range (``$defs/node_error``)."""

    index: int | None = None
    node: str | None = None
    op: str | None = None
    module: str | None = None
    source: str | None = None
    layer: str | None = None
    dtype: str | None = None
    accumulated: ErrorStats | None = None
    isolated: ErrorStats | None = None
    exact: bool | None = None
    introduces_nonfinite: bool | None = None
    inherited_nonfinite: bool | None = None
    range: Mapping[str, Any] | None = None
