"""The conversion report: a versioned JSON document (schema: amplite/schemas/report.schema.json).

A :class:`Report` is its header (schema, version, creation time, versions) and its typed sections
(:mod:`amplite.report.sections`), assembled once by :func:`build_report`; later stages add or replace a
section with :meth:`Report.attach`. Readers take a section by its type (:meth:`Report.section`) and read its
fields; :attr:`Report.data`, the JSON document the sections write, is read-only.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import torch

from amplite.errors import InternalError
from amplite.passes.base import PassRecord
from amplite.report.entries import OutputMetricsEntry, PlanEntry
from amplite.report.frozen import FrozenDict, freeze, thaw
from amplite.report.schema import report_json, write_report
from amplite.report.sections import (
    SECTIONS,
    Config,
    Fp32Nodes,
    Graph,
    Passes,
    Plan,
    Section,
    Source,
    Timings,
    Verification,
    Warnings,
    Weights,
)  # fmt: skip
from amplite.verify.compare import OutputMetrics, Tolerance
from amplite.version import __version__

__all__ = ["HEADER_KEYS", "SCHEMA", "SCHEMA_VERSION", "Report", "as_report", "build_report", "report_header"]

SCHEMA = "amplite.report"
SCHEMA_VERSION = 1
#: The keys every report starts with (not sections: :func:`report_header` writes them).
HEADER_KEYS = ("schema", "schema_version", "created", "versions")
S = TypeVar("S", bound=Section)


def report_header() -> dict[str, Any]:
    """The keys every report starts with: schema name and version, creation time, versions."""
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "amplite": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


class Report:
    """A conversion report: its header and its sections; ``data`` is the (read-only) JSON document.

    ``Report(document)`` reads a document (as written, or a gate's working copy) back into sections;
    :func:`build_report` assembles a new one.

    Raises:
        InternalError: A document key that is no section of :data:`~amplite.report.sections.SECTIONS`.
    """

    def __init__(self, document: Mapping[str, Any] | None = None) -> None:
        doc = dict(document) if document is not None else report_header()
        self._header = freeze({k: doc[k] for k in HEADER_KEYS if k in doc})
        self._sections: dict[str, Section] = {}
        self._data: FrozenDict | None = None
        for key, value in doc.items():
            if key in HEADER_KEYS:
                continue
            if key not in SECTIONS:
                raise InternalError(f"report key {key!r} is no report section: declare it in "
                                    "amplite/report/sections.py (SECTIONS) and the schema")  # fmt: skip
            try:
                section = SECTIONS[key].from_json(value)
            except TypeError as exc:
                raise InternalError(f"report key {key!r} does not hold a {SECTIONS[key].__name__}: {exc}") from exc
            self.attach(section)

    @classmethod
    def assemble(cls, sections: Iterable[Section]) -> Report:
        """A new report (header now) holding ``sections``, in order."""
        report = cls()
        for section in sections:
            report.attach(section)
        return report

    def attach(self, section: Section) -> Report:
        """Add ``section``, or replace the one of its kind; the one way a report changes.

        Raises:
            InternalError: ``section`` is not one of the declared sections (amplite/report/sections.py).
        """
        key = getattr(section, "key", None)
        if SECTIONS.get(key) is not type(section):  # type: ignore[arg-type]
            raise InternalError(f"{type(section).__name__} ({key!r}) is no report section: declare it in "
                                "amplite/report/sections.py (SECTIONS) and the schema")  # fmt: skip
        self._sections[section.key] = section
        self._data = None
        return self

    def section(self, kind: type[S]) -> S | None:
        """The section of this kind (None when the report has none)."""
        found = self._sections.get(kind.key)
        return found if isinstance(found, kind) else None

    @property
    def sections(self) -> Mapping[str, Section]:
        """The sections, by key, in document order."""
        return dict(self._sections)

    @property
    def data(self) -> Mapping[str, Any]:
        """The JSON document, read-only (a change raises ``TypeError``; use :meth:`attach`)."""
        if self._data is None:
            self._data = FrozenDict({**self._header, **{k: s.value for k, s in self._sections.items()}})
        return self._data

    def to_dict(self) -> dict[str, Any]:
        """The JSON document as a plain, writable copy."""
        return thaw(self.data)

    def copy(self) -> Report:
        """An independent report with the same header and sections (sections are immutable: shared)."""
        other = Report({})
        other._header, other._sections = self._header, dict(self._sections)
        return other

    def __deepcopy__(self, memo: dict[int, Any]) -> Report:
        return self.copy()

    @property
    def passed(self) -> bool | None:
        """Verification verdict (None when verification was skipped)."""
        ver = self.section(Verification)
        return ver.passed if ver is not None else None

    @property
    def verified_outputs(self) -> tuple[OutputMetricsEntry, ...]:
        """Per-output metrics, typed (none when verification was skipped)."""
        ver = self.section(Verification)
        return tuple(ver.outputs or ()) if ver is not None else ()

    @property
    def planned(self) -> tuple[PlanEntry, ...]:
        """The precision plan's entries, typed (for the layers below the report, which cannot import it)."""
        plan = self.section(Plan)
        return tuple(plan.items) if plan is not None else ()

    def pass_modified(self, name: str) -> bool:
        """Whether the pass ``name`` ran and changed the graph."""
        passes = self.section(Passes)
        return passes is not None and passes.modified(name)

    @property
    def outputs(self) -> list[dict[str, Any]]:
        """Per-output metrics as JSON (the public view; typed: :attr:`verified_outputs`)."""
        return self.data.get("verification", {}).get("outputs", [])

    @property
    def fp32_nodes(self) -> list[dict[str, Any]]:
        """Nodes kept in FP32, with their reasons, as JSON."""
        return self.data.get("fp32_nodes", [])

    def counter(self, pass_name: str, key: str) -> int:
        """One counter of one pass (0 when absent)."""
        passes = self.section(Passes)
        return passes.counter(pass_name, key) if passes is not None else 0

    def to_json(self) -> str:
        """The report as indented JSON (non-finite floats as ``"inf"``/``"-inf"``/``"nan"``)."""
        return report_json(self.data)

    def save(self, path: str | Path) -> Path:
        """Write the JSON report atomically (:func:`amplite.report.schema.write_report`)."""
        return write_report(path, self.data)


def as_report(report: Report | Mapping[str, Any]) -> Report:
    """A report, or a document already read (report.json) read into its typed sections: the renderers'
    one accessor."""
    return report if isinstance(report, Report) else Report(report)


def build_report(
    *,
    source: Source | Mapping[str, Any],
    config: Mapping[str, Any],
    records: list[PassRecord],
    plan: list[dict[str, Any]],
    stats_before: dict[str, Any],
    stats_after: dict[str, Any],
    weights: tuple[int, int],
    metrics: list[OutputMetrics] | None,
    tolerance: Tolerance | None,
    timings: dict[str, float],
    warnings: list[str],
    extra: Iterable[Section] = (),
) -> Report:
    """Assemble the report of a conversion from its sections (the one place a conversion's report is built:
    modules, programs and files, checkpoint directories and the training gate).

    Args:
        source: The ``source`` section (or its dict).
        config: The conversion's settings.
        records: The pass records.
        plan: The precision plan (its FP32 entries make ``fp32_nodes``).
        stats_before: ``graph_stats`` of the FP32 graph.
        stats_after: ``graph_stats`` of the converted graph.
        weights: Weight bytes before and after.
        metrics: Per-output metrics (None: not verified, no ``verification`` section).
        tolerance: The tolerance the metrics were judged by.
        timings: Seconds per phase.
        warnings: Warning lines.
        extra: More sections of this conversion (``estimate``, ``build``, ``weight_rules``...).
    """
    sections: list[Section] = [
        source if isinstance(source, Source) else Source.from_json(source),
        Config.of(config),
        Passes.of(records),
        Graph.of(stats_before, stats_after),
        Weights.of(*weights),
        Fp32Nodes.of(plan),
        Plan.of(plan),
        Timings.of(timings),
        Warnings.of(warnings),
    ]
    if metrics is not None:
        sections.append(Verification.of(metrics, tolerance))
    return Report.assemble([*sections, *extra])
