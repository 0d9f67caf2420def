"""The sections of report.json: one typed, frozen section per top-level key, declared once, with its builder.

A section is the value of one top-level key of the document (schema: amplite/schemas/report.schema.json),
typed field by field (:mod:`amplite.report.typed`; the entries shared by several sections are in
:mod:`amplite.report.entries`). Each has ``from_json``/``to_json`` and one builder, ``of(...)``, from the
values amplite already has (pass records, output metrics, tolerances, or the JSON value a lower layer built).
This module holds the sections every conversion writes and the files written; the checks' sections are in
:mod:`amplite.report.checks` and the analyses' in :mod:`amplite.report.analysis`. :data:`SECTIONS` lists them
all. :class:`~amplite.report.document.Report` holds sections (its builder refuses a type not in
:data:`SECTIONS`); renderers and callers read their fields, never raw keys of the document.

To add a section: a typed subclass with its ``key`` (and ``of`` when it is built from other values), listed in
:data:`SECTIONS`, and its key in the schema (tests/test_report_sections.py checks both ways; docs/architecture.md,
"Where to add ...").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from amplite.passes.base import PassRecord
from amplite.report.analysis import Estimate, Fp8Checkpoint, Gradients, Layerwise, Llm, Ranges, Training
from amplite.report.checks import (
    Baseline,
    Budget,
    Check,
    Golden,
    Verification,
    VerificationAoti,
    VerificationOnnx,
)  # fmt: skip
from amplite.report.entries import GraphStats, PlanEntry
from amplite.report.typed import Entry, ListSection, MapSection, Record, Section

#: The keys of a ``fp32_nodes`` entry (a plan entry without its mode and dtype).
FP32_NODE_KEYS = ("node", "op", "module", "source", "reason", "rule")


def _rounded(seconds: Mapping[str, float]) -> dict[str, float]:
    return {k: round(float(v), 4) for k, v in seconds.items()}


@dataclass(frozen=True, kw_only=True)
class Source(Section):
    """``source``: what was converted (path, format, and facts such as the traced mode or shard count)."""

    key = "source"
    path: str | None = None
    format: str | None = None
    mode: str | None = None
    graph_fingerprint: str | None = None

    @classmethod
    def of(cls, path: Any, format: str, **facts: Any) -> Source:  # type: ignore[override]
        """The source from its path, format and the facts known about it (None values are left out)."""
        return cls.from_json({"path": str(path) if path is not None else path, "format": format,
                              **{k: v for k, v in facts.items() if v is not None}})  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Config(Section):
    """``config``: the conversion's settings (``ConvertSpec.to_config()`` or the checkpoint's own; its JSON
    shape is the spec's: the fields typed here are those the renderers read, the rest stays as written)."""

    key = "config"
    precision: str | None = None
    level: str | None = None
    fp8: Mapping[str, Any] | None = None
    level_source: str | None = None
    keep_fp32: Sequence[str] | None = None
    force_low: Sequence[str] | None = None
    low_precision_io: bool | None = None
    dynamic_batch: bool | None = None
    dynamic_dims: Mapping[str, Any] | None = None
    fuse_contractions: bool | None = None
    fuse_contractions_reason: str | None = None
    fold_batchnorm: bool | None = None
    range_rules: Mapping[str, Any] | None = None
    range_rules_scope: str | None = None
    contract_backend: str | None = None
    converted: str | None = None


@dataclass(frozen=True, kw_only=True)
class PassEntry(Entry):
    """One pass run: its name, whether it changed the graph, its counters, seconds and details."""

    name: str | None = None
    modified: bool | None = None
    counters: Mapping[str, int] | None = None
    seconds: float | None = None
    details: Mapping[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class Passes(ListSection):
    """``passes``: one entry per pass run."""

    key = "passes"
    item = PassEntry
    items: tuple[PassEntry, ...] = ()

    @classmethod
    def of(cls, records: Iterable[PassRecord]) -> Passes:  # type: ignore[override]
        """The section from the pass manager's records."""
        return cls.from_json([
            {"name": r.name, "modified": r.modified, "counters": r.counters, "seconds": round(r.seconds, 4)}
            | ({"details": r.details} if r.details else {})
            for r in records
        ])  # fmt: skip

    def modified(self, name: str) -> bool:
        """Whether the pass ``name`` ran and changed the graph."""
        return any(p.name == name and p.modified for p in self.items)

    def counter(self, name: str, key: str) -> int:
        """One counter of one pass (0 when absent)."""
        return next((int((p.counters or {}).get(key, 0)) for p in self.items if p.name == name), 0)


@dataclass(frozen=True, kw_only=True)
class Graph(Section):
    """``graph``: node statistics of the FP32 and the converted graph."""

    key = "graph"
    before: GraphStats | None = None
    after: GraphStats | None = None

    @classmethod
    def of(cls, before: Mapping[str, Any] | GraphStats, after: Mapping[str, Any]) -> Graph:  # type: ignore[override]
        """The section from ``graph_stats`` of both graphs."""
        before = before.to_json() if isinstance(before, Record) else before
        return cls.from_json({"before": before, "after": after})


@dataclass(frozen=True, kw_only=True)
class Weights(Section):
    """``weights``: bytes of the weights before and after, and their ratio."""

    key = "weights"
    bytes_before: int | None = None
    bytes_after: int | None = None
    ratio: float | None = None

    @classmethod
    def of(cls, bytes_before: int, bytes_after: int) -> Weights:  # type: ignore[override]
        """The section from the two byte counts (ratio 1.0 for a model without weights)."""
        ratio = round(bytes_after / bytes_before, 4) if bytes_before else 1.0
        return cls(bytes_before=int(bytes_before), bytes_after=int(bytes_after), ratio=ratio)


@dataclass(frozen=True, kw_only=True)
class Plan(ListSection):
    """``plan``: one entry per planned node (mode, dtype, reason)."""

    key = "plan"
    item = PlanEntry
    items: tuple[PlanEntry, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Fp32Nodes(ListSection):
    """``fp32_nodes``: the plan's FP32 entries, with their reasons."""

    key = "fp32_nodes"
    item = PlanEntry
    items: tuple[PlanEntry, ...] = ()

    @classmethod
    def of(cls, plan: Iterable[Mapping[str, Any]]) -> Fp32Nodes:  # type: ignore[override]
        """The section from the plan."""
        return cls.from_json([{k: p[k] for k in FP32_NODE_KEYS if k in p} for p in plan if p["mode"] == "fp32"])


@dataclass(frozen=True, kw_only=True)
class Timings(MapSection):
    """``timings``: seconds per phase (rounded to 0.1 ms)."""

    key = "timings"

    @classmethod
    def of(cls, seconds: Mapping[str, float]) -> Timings:  # type: ignore[override]
        """The section from phase -> seconds."""
        return cls(values=_rounded(seconds))

    def add(self, **seconds: float) -> Timings:
        """These timings with more phases (a phase given again is replaced)."""
        return Timings(values={**self.values, **_rounded(seconds)})


@dataclass(frozen=True, kw_only=True)
class Warnings(ListSection):
    """``warnings``: one line per warning."""

    key = "warnings"
    items: tuple[str, ...] = ()

    @classmethod
    def of(cls, lines: Iterable[str]) -> Warnings:  # type: ignore[override]
        """The section from the warning lines."""
        return cls(items=tuple(str(w) for w in lines))


@dataclass(frozen=True, kw_only=True)
class OutputFile(Entry):
    """One model file written (``outputs`` entry: the file, and what the writer knows of it)."""

    format: str | None = None
    device: str | None = None
    decomposed_contractions: int | None = None
    compile_seconds: float | None = None
    path: str | None = None
    bytes: int | None = None
    data_path: str | None = None
    opset: int | None = None
    casts: int | None = None
    casts_in_functions: int | None = None
    contract_nodes: int | None = None
    cleanup: Mapping[str, Any] | None = None
    inputs: Sequence[Any] | None = None
    outputs: Sequence[Any] | None = None
    checker: str | None = None
    timings: Mapping[str, float] | None = None


@dataclass(frozen=True, kw_only=True)
class Outputs(ListSection):
    """``outputs``: the model files written, one entry per path."""

    key = "outputs"
    item = OutputFile
    items: tuple[OutputFile, ...] = ()

    def with_entries(self, *entries: Mapping[str, Any]) -> Outputs:
        """These outputs with ``entries`` (a later save to the same path replaces its entry)."""
        fresh = {str(e["path"]) for e in entries}
        kept = [e.to_json() for e in self.items if e.path not in fresh]
        return Outputs.from_json([*kept, *entries])


@dataclass(frozen=True, kw_only=True)
class Output(Section):
    """``output``: older reports' one file written (superseded by ``outputs``; read, never written)."""

    key = "output"
    path: str | None = None
    bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class Build(Section):
    """``build``: how the converted ExportedProgram was built (direct, re-export or the original)."""

    key = "build"
    path: str | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class Streaming(Section):
    """``streaming``: memory of a streamed checkpoint conversion."""

    key = "streaming"
    peak_rss_bytes: int | None = None
    largest_shard_bytes: int | None = None
    shards: int | None = None

    @classmethod
    def of(cls, peak_rss_bytes: int, largest_shard_bytes: int, shards: int) -> Streaming:  # type: ignore[override]
        """The section from the process's peak RSS and the checkpoint's shards."""
        return cls(peak_rss_bytes=peak_rss_bytes, largest_shard_bytes=largest_shard_bytes, shards=shards)


@dataclass(frozen=True, kw_only=True)
class WeightRule(Entry):
    """A module a checkpoint's weight statistics kept in FP32, and why."""

    module: str | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class WeightRules(ListSection):
    """``weight_rules``: modules a checkpoint's streamed weight statistics kept in FP32."""

    key = "weight_rules"
    item = WeightRule
    items: tuple[WeightRule, ...] = ()

    @classmethod
    def of(cls, flagged: Mapping[str, str]) -> WeightRules:  # type: ignore[override]
        """The section from module path -> reason."""
        return cls(items=tuple(WeightRule(module=m, reason=r) for m, r in flagged.items()))


#: Every section a report may hold, by key; ``ReportBuilder.add`` refuses any other.
SECTIONS: dict[str, type[Section]] = {
    cls.key: cls
    for cls in (
        Source, Config, Passes, Graph, Weights, Fp32Nodes, Plan, Timings, Warnings, Verification, Estimate,
        Build, Outputs, VerificationAoti, VerificationOnnx, Budget, Llm, Streaming, WeightRules, Golden,
        Baseline, Check, Layerwise, Ranges, Gradients, Training, Output, Fp8Checkpoint,
    )
}  # fmt: skip

__all__ = ["FP32_NODE_KEYS", "SECTIONS", "OutputFile", "PassEntry", "Section", "WeightRule",
           *(cls.__name__ for cls in SECTIONS.values())]  # fmt: skip
