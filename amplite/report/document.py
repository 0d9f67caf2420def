"""The conversion report: a versioned JSON document (schema: amplite/schemas/report.schema.json)."""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from amplite.passes.base import PassRecord
from amplite.report.schema import report_json, write_report
from amplite.verify.compare import OutputMetrics, Tolerance
from amplite.version import __version__

SCHEMA = "amplite.report"
SCHEMA_VERSION = 1


class Report:
    """A conversion report; ``data`` is the JSON document."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    @property
    def passed(self) -> bool | None:
        """Verification verdict (None when verification was skipped)."""
        return self.data.get("verification", {}).get("passed")

    @property
    def outputs(self) -> list[dict[str, Any]]:
        """Per-output metrics."""
        return self.data.get("verification", {}).get("outputs", [])

    @property
    def fp32_nodes(self) -> list[dict[str, Any]]:
        """Nodes kept in FP32, with their reasons."""
        return self.data.get("fp32_nodes", [])

    def counter(self, pass_name: str, key: str) -> int:
        """One counter of one pass (0 when absent)."""
        for record in self.data.get("passes", []):
            if record["name"] == pass_name:
                return int(record["counters"].get(key, 0))
        return 0

    def to_json(self) -> str:
        """The report as indented JSON (non-finite floats as ``"inf"``/``"-inf"``/``"nan"``)."""
        return report_json(self.data)

    def save(self, path: str | Path) -> Path:
        """Write the JSON report atomically (:func:`amplite.report.schema.write_report`)."""
        return write_report(path, self.data)


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


def pass_records(records: list[PassRecord]) -> list[dict[str, Any]]:
    """The ``passes`` section: one entry per pass record."""
    return [
        {"name": r.name, "modified": r.modified, "counters": r.counters, "seconds": round(r.seconds, 4)}
        | ({"details": r.details} if r.details else {})
        for r in records
    ]


def build_report(
    *,
    source: dict[str, Any],
    config: dict[str, Any],
    records: list[PassRecord],
    plan: list[dict[str, Any]],
    stats_before: dict[str, Any],
    stats_after: dict[str, Any],
    weights: tuple[int, int],
    metrics: list[OutputMetrics] | None,
    tolerance: Tolerance | None,
    timings: dict[str, float],
    warnings: list[str],
) -> Report:
    """Assemble the report document."""
    before, after = weights
    data: dict[str, Any] = {
        **report_header(),
        "source": source,
        "config": config,
        "passes": pass_records(records),
        "graph": {"before": stats_before, "after": stats_after},
        "weights": {
            "bytes_before": before,
            "bytes_after": after,
            "ratio": round(after / before, 4) if before else 1.0,
        },
        "fp32_nodes": [
            {k: p[k] for k in ("node", "op", "module", "source", "reason", "rule") if k in p}
            for p in plan
            if p["mode"] == "fp32"
        ],
        "plan": plan,
        "timings": {k: round(v, 4) for k, v in timings.items()},
        "warnings": warnings,
    }
    if metrics is not None:
        data["verification"] = {
            "inputs": "example inputs",
            "tolerance": vars(tolerance) if tolerance else None,
            "passed": all(m.passed for m in metrics),
            "outputs": [m.to_dict() for m in metrics],
        }
    return Report(data)
