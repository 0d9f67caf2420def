"""Batch results and summaries: one row per model, written as ``summary.json`` and ``summary.md``;
merging shards.

This module imports neither torch nor amplite's converter, so merging summaries is cheap.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from amplite.errors import ConfigError
from amplite.escape import markdown
from amplite.paths import check_output, derived_output

SCHEMA = "amplite.batch_summary"
SCHEMA_VERSION = 1
#: Every status a row can have; only ``ok`` counts as converted and verified. ``unverified``: converted with
#: ``verify = false`` (nothing compared it with FP32).
STATUSES = ("ok", "unverified", "verify_failed", "error", "oom", "timeout", "crashed", "cancelled")
#: Statuses of a model that converted (its files are kept; ``--resume`` may skip it).
CONVERTED = ("ok", "unverified")
COLUMNS = (
    "model",
    "status",
    "params",
    "low-prec compute",
    "casts",
    "size ratio",
    "worst SQNR dB",
    "time s",
    "error",
)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: The process umask, read once (reading it means setting it): temp files get the mode a plain file would.
UMASK = _umask()


class MergeError(ConfigError):
    """Shard summaries cannot be merged (missing, inconsistent or overlapping shards)."""


def failure_row(job: Mapping[str, Any], status: str, error: str | None) -> dict[str, Any]:
    """A summary row with every column; metrics are None until a conversion fills them in."""
    return {
        "name": job["name"],
        "status": status,
        "error": error,
        "params": None,
        "low_precision_share": None,
        "casts": None,
        "size_ratio": None,
        "worst_sqnr_db": None,
        "verified": None,
        "seconds": None,
        "precision": job.get("precision"),
        "level": job.get("level"),
        "source": job.get("path"),
        "output_dir": job["name"],
        "files": [],
        "key": None,
        "resumed": False,
    }


#: The files a batch writes into its ``-o`` directory itself (next to the per-model directories).
SUMMARY_FILES = ("summary.json", "summary.md")
_MAX_OURS = 64 << 20  # a summary larger than this is not one amplite wrote (4,000 models take ~4 MB)


def written_by_batch(path: Path) -> bool:
    """Whether the regular file ``path`` is a summary ``amplite batch`` wrote (its schema, or its heading)."""
    try:
        if path.stat().st_size > _MAX_OURS:
            return False
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            doc = json.loads(text)
            return isinstance(doc, dict) and doc.get("schema") == SCHEMA
        return text.startswith("# amplite batch: ")
    except (OSError, ValueError, RecursionError):
        return False


def guard_summaries(out_dir: Path, option: str = "-o") -> None:
    """Refuse a batch (or merge) whose ``summary.json``/``summary.md`` would replace a file amplite did not
    write: the rule of the converter's default names (:func:`amplite.paths.derived_output`).

    Raises:
        ConfigError: Naming the file and the fix.
    """
    for name in SUMMARY_FILES:
        derived_output(out_dir / name, written_by_batch, f"the batch summary ({option})",
                       f"pass another {option} directory, or move that file away")  # fmt: skip


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (temp file in the same directory, then rename)."""
    check_output(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: Path, data: Any) -> Path:
    """Write JSON atomically."""
    return write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def counts(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Rows per status, in :data:`STATUSES` order."""
    c = Counter(r["status"] for r in rows)
    return {s: c[s] for s in STATUSES if c[s]}


def exit_code(rows: Sequence[Mapping[str, Any]]) -> int:
    """0 when every model converted and verified (an empty shard included), else 1.

    An ``unverified`` model (``verify = false``) makes it 1 too: 0 promises that every model was compared
    with FP32. The counts tell an all-``unverified`` batch from a failed one.
    """
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def write_summary(
    out_dir: Path, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]
) -> tuple[Path, Path]:
    """Write ``summary.json`` and ``summary.md`` into ``out_dir``; returns both paths."""
    doc = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **meta,
        "counts": counts(rows),
        "exit_code": exit_code(rows),
        "models": list(rows),
    }
    js = write_json(out_dir / "summary.json", doc)
    md = write_text(out_dir / "summary.md", render_markdown(doc))
    return js, md


def _fmt(row: Mapping[str, Any], col: str) -> str:
    v = {
        "model": row["name"],
        "status": row["status"] + (" (resumed)" if row.get("resumed") else ""),
        "params": row.get("params"),
        "low-prec compute": row.get("low_precision_share"),
        "casts": row.get("casts"),
        "size ratio": row.get("size_ratio"),
        "worst SQNR dB": row.get("worst_sqnr_db"),
        "time s": row.get("seconds"),
        "error": row.get("error"),
    }[col]
    if v is None:
        return "" if col == "error" else "–"
    if col == "params":
        return f"{v / 1e6:.2f} M" if v >= 1e5 else f"{v:,}"
    if col == "low-prec compute":
        return f"{v:.1%}"
    if col in ("size ratio", "time s"):
        return f"{v:.2f}"
    if col == "worst SQNR dB" and not isinstance(v, str):
        return f"{v:.1f}"
    return markdown(v)  # names and error text: no markup from a manifest or a model's error in summary.md


def render_markdown(doc: Mapping[str, Any]) -> str:
    """The summary as a Markdown table, failures first so they are seen."""
    rows = sorted(doc["models"], key=lambda r: (r["status"] == "ok", r["name"]))
    head = ", ".join(f"{n} {s}" for s, n in doc["counts"].items()) or "no models"
    lines = [f"# amplite batch: {head}", ""]
    if doc.get("shard"):
        lines += [f"Shard {doc['shard']}.", ""]
    if doc.get("interrupted"):
        lines += ["**Interrupted**: models not finished are listed as cancelled.", ""]
    if doc.get("seconds") is not None:
        lines += [f"Wall time {doc['seconds']:.1f} s.", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r, c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def read_result(model_dir: Path) -> dict[str, Any] | None:
    """The ``result.json`` row of one model's output directory (None when absent or unreadable)."""
    try:
        row = json.loads((model_dir / "result.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(row, dict) or "status" not in row:
        return None
    files = row.get("files", [])
    return row if isinstance(files, list) and all(isinstance(f, str) for f in files) else None


@dataclass
class JobResult:
    """The outcome of one model: ``row`` is its ``summary.json`` entry."""

    name: str
    status: str
    error: str | None
    row: dict[str, Any] = field(repr=False)

    @property
    def ok(self) -> bool:
        """Converted and verified."""
        return self.status == "ok"

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> JobResult:
        """Wrap a summary row."""
        return cls(row["name"], row["status"], row.get("error"), row)


@dataclass
class BatchResult:
    """A finished batch.

    Attributes:
        results: One per model, in job order.
        out_dir: Where ``summary.json``, ``summary.md`` and ``<name>/`` live.
        seconds: Wall time.
        interrupted: Stopped by Ctrl-C (unfinished models are ``cancelled``).
    """

    results: list[JobResult]
    out_dir: Path
    seconds: float = 0.0
    interrupted: bool = False

    @property
    def succeeded(self) -> list[JobResult]:
        """Models converted and verified."""
        return [r for r in self.results if r.ok]

    @property
    def unverified(self) -> list[JobResult]:
        """Models converted with ``verify = false`` (not compared with FP32)."""
        return [r for r in self.results if r.status == "unverified"]

    @property
    def failed(self) -> list[JobResult]:
        """Models that did not convert or failed verification (errors, timeouts, crashes, cancelled...)."""
        return [r for r in self.results if r.status not in CONVERTED]

    @property
    def counts(self) -> dict[str, int]:
        """Models per status."""
        return counts(r.row for r in self.results)

    @property
    def exit_code(self) -> int:
        """0 when every model converted and verified, else 1 (also when some are only ``unverified``);
        2 is for errors raised before a batch runs."""
        return exit_code([r.row for r in self.results])

    def describe(self) -> str:
        """One line for the end of a CLI run: counts and where the summary is."""
        counts = ", ".join(f"{n} {s}" for s, n in self.counts.items()) or "no models"
        stop = " (interrupted)" if self.interrupted else ""
        return f"{len(self.results)} model(s): {counts}{stop} — summary: {self.summary_md}"

    @property
    def summary_json(self) -> Path:
        """Path of ``summary.json``."""
        return self.out_dir / "summary.json"

    @property
    def summary_md(self) -> Path:
        """Path of ``summary.md``."""
        return self.out_dir / "summary.md"
