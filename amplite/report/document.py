"""The conversion report: a versioned JSON document (schema: amplite/schemas/report.schema.json).

A :class:`Report` is its header (schema, version, creation time, versions) and its typed sections
(:mod:`amplite.report.sections`), collected by a :class:`ReportBuilder` and built once (:func:`build_report`).
A built report is frozen: it has no mutating method, its attributes cannot be set and :attr:`Report.data`
refuses every change. A stage that runs after the report was handed out (a save, a check) makes a NEW report
with :meth:`Report.with_sections` and its owner rebinds it. Readers take a section by its type
(:meth:`Report.section`) and read its fields.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn, TypeVar

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

__all__ = [
    "HEADER_KEYS", "SCHEMA", "SCHEMA_VERSION", "Report", "ReportBuilder", "as_report", "build_report", "report_header",
]  # fmt: skip

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


def _checked(section: Section) -> Section:
    """``section``, when it is one of the declared sections.

    Raises:
        InternalError: ``section`` is not one of the declared sections (amplite/report/sections.py).
    """
    key = getattr(section, "key", None)
    if SECTIONS.get(key) is not type(section):  # type: ignore[arg-type]
        raise InternalError(f"{type(section).__name__} ({key!r}) is no report section: declare it in "
                            "amplite/report/sections.py (SECTIONS) and the schema")  # fmt: skip
    return section


class ReportBuilder:
    """Collects the typed sections of one report, then builds it once.

    A section of a kind already collected replaces it (in place in the document order). After
    :meth:`build`, the builder refuses more sections and a second build (InternalError): the report it
    built is the one report of what it collected.
    """

    def __init__(self, base: Report | None = None) -> None:
        self._header: Mapping[str, Any] = base._header if base is not None else freeze(report_header())
        self._sections: dict[str, Section] = dict(base._sections) if base is not None else {}
        self._built = False

    def add(self, *sections: Section) -> ReportBuilder:
        """Collect ``sections`` (each replaces the one of its kind).

        Raises:
            InternalError: A section that is not declared, or the report was already built.
        """
        if self._built:
            raise InternalError("this report was already built: a built report is frozen (Report.with_sections "
                                "makes a new one)")  # fmt: skip
        checked = [_checked(section) for section in sections]  # all or none: a bad one adds nothing
        self._sections.update((section.key, section) for section in checked)
        return self

    def section(self, kind: type[S]) -> S | None:
        """The collected section of this kind (None when there is none yet)."""
        found = self._sections.get(kind.key)
        return found if isinstance(found, kind) else None

    def build(self) -> Report:
        """The frozen report of the collected sections (once).

        Raises:
            InternalError: The report was already built.
        """
        if self._built:
            raise InternalError("this report was already built: build it once")
        self._built = True
        return Report._of(self._header, self._sections)


class Report:
    """A conversion report, frozen: its header and its sections; ``data`` is the (read-only) JSON document.

    ``Report(document)`` reads a document (as written, or a gate's working copy) back into sections;
    :func:`build_report` (a :class:`ReportBuilder`) assembles a new one. Nothing changes a report once made:
    :meth:`with_sections` returns a new one.

    Raises:
        InternalError: A document key that is no section of :data:`~amplite.report.sections.SECTIONS`.
    """

    __slots__ = ("_data", "_header", "_sections")

    def __init__(self, document: Mapping[str, Any] | None = None) -> None:
        doc = dict(document) if document is not None else report_header()
        sections: dict[str, Section] = {}
        for key, value in doc.items():
            if key in HEADER_KEYS:
                continue
            if key not in SECTIONS:
                raise InternalError(f"report key {key!r} is no report section: declare it in "
                                    "amplite/report/sections.py (SECTIONS) and the schema")  # fmt: skip
            try:
                sections[key] = SECTIONS[key].from_json(value)
            except TypeError as exc:
                raise InternalError(f"report key {key!r} does not hold a {SECTIONS[key].__name__}: {exc}") from exc
        self._init(freeze({k: doc[k] for k in HEADER_KEYS if k in doc}), sections)

    def _init(self, header: Mapping[str, Any], sections: Mapping[str, Section]) -> None:
        own = MappingProxyType(dict(sections))
        object.__setattr__(self, "_header", header)
        object.__setattr__(self, "_sections", own)
        object.__setattr__(self, "_data", FrozenDict({**header, **{k: s.value for k, s in own.items()}}))

    @classmethod
    def _of(cls, header: Mapping[str, Any], sections: Mapping[str, Section]) -> Report:
        report = cls.__new__(cls)
        report._init(header, sections)
        return report

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(f"a built report is frozen (cannot set {name!r}): Report.with_sections makes a new one")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"a built report is frozen (cannot delete {name!r})")

    @classmethod
    def assemble(cls, sections: Iterable[Section]) -> Report:
        """A new report (header now) holding ``sections``, in order."""
        return ReportBuilder().add(*sections).build()

    def with_sections(self, *sections: Section) -> Report:
        """A NEW report: this one's header and sections, with ``sections`` added or replacing those of their
        kind. This report is unchanged; for stages that run after the report was handed out (a save, a check),
        whose owner rebinds the new one.

        Raises:
            InternalError: A section that is not declared.
        """
        return ReportBuilder(self).add(*sections).build()

    def builder(self) -> ReportBuilder:
        """A builder holding this report's header and sections (for a stage adding several of its own)."""
        return ReportBuilder(self)

    def section(self, kind: type[S]) -> S | None:
        """The section of this kind (None when the report has none)."""
        found = self._sections.get(kind.key)
        return found if isinstance(found, kind) else None

    @property
    def sections(self) -> Mapping[str, Section]:
        """The sections, by key, in document order (read-only)."""
        return self._sections

    @property
    def data(self) -> Mapping[str, Any]:
        """The JSON document, read-only (a change raises ``TypeError``; :meth:`with_sections` makes a new one)."""
        return self._data

    def to_dict(self) -> dict[str, Any]:
        """The JSON document as a plain, writable copy."""
        return thaw(self.data)

    def __copy__(self) -> Report:
        return self  # frozen: a copy is the same report

    def __deepcopy__(self, memo: dict[int, Any]) -> Report:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Report, (self.to_dict(),))

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
