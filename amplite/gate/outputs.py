"""What a gate command reads and writes: path guards, the report trio, JUnit, the GitHub summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amplite.converter import emit
from amplite.errors import ConfigError, EmitError
from amplite.paths import check_output
from amplite.report.document import Report, ReportBuilder
from amplite.report.schema import write_report
from amplite.report.sections import Check
from amplite.verify.compare import OutputMetrics


@dataclass
class CheckResult:
    """What ``check`` found.

    Attributes:
        exit_code: 0 pass, 1 accuracy failure or regression.
        report: The report (``report.data`` is report.json).
        reasons: One line per failure.
        outputs: Per-output metrics over all batches.
        files: Paths written, by kind (``json``, ``md``, ``html``, ``junit``).
    """

    exit_code: int
    report: Report
    reasons: list[str] = field(default_factory=list)
    outputs: list[OutputMetrics] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Whether the check passed."""
        return self.exit_code == 0


def finish(report: Report | ReportBuilder, reasons: list[str], metrics: list[OutputMetrics], name: str,
            out_dir: Path | None, junit: str | Path | None) -> CheckResult:  # fmt: skip
    """The verdict (``check`` section, exit code) and the files, the same for every kind of check.

    ``report``: the check's builder (built here, once, with the verdict), or the finished report of the stage
    that checked (a new report with the verdict is made from it: that one is left as it is).
    """
    check = Check.of(name, reasons)
    report = report.add(check).build() if isinstance(report, ReportBuilder) else report.with_sections(check)
    res = CheckResult(check.exit_code, report, reasons, metrics)
    res.files = write_outputs(report, out_dir, junit)
    return res


#: The files ``--report DIR`` holds.
REPORT_FILES = ("report.json", "report.md", "report.html")


def write_reports(data: Report | dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md and report.html into ``out_dir`` (each atomically)."""
    from amplite.report.html import render_html
    from amplite.report.markdown import render_markdown

    d = Path(out_dir)
    try:
        d.mkdir(exist_ok=True)
    except OSError as exc:
        raise EmitError(f"cannot create report directory {str(d)!r}: {exc.strerror or type(exc).__name__}",
                        "choose a writable --report directory") from None  # fmt: skip
    return {
        "json": write_report(d / "report.json", data),
        "md": emit.write_text(d / "report.md", render_markdown(data)),
        "html": emit.write_text(d / "report.html", render_html(data)),
    }


def write_outputs(data: Report | dict[str, Any], out_dir: Path | None, junit: str | Path | None) -> dict[str, Path]:
    """The files every kind of check writes: the report trio into ``out_dir``, JUnit to ``junit``."""
    files: dict[str, Path] = {}
    if out_dir is not None:
        files = write_reports(data, out_dir)
    if junit is not None:
        from amplite.report.junit import junit_xml

        files["junit"] = emit.write_text(junit, junit_xml(data))
    return files


def prepare_outputs(report_dir: str | Path | None, junit: str | Path | None) -> Path | None:
    """Fail before any work when an output cannot be written (the report directory is made only when the
    reports are written, so a failed run leaves nothing behind)."""
    d = Path(report_dir) if report_dir is not None else None
    if d is not None:
        check_output(d, "--report", directory=True)
        if d.exists() and not d.is_dir():
            raise ConfigError(f"--report {str(d)!r} is a file", "give a directory for the reports")
        for name in REPORT_FILES if d.is_dir() else ():  # each is checked now: none is written if one is a link
            check_output(d / name, "--report")
        emit.check_writable(d / "report.json" if d.is_dir() else d)
    if junit is not None:
        j = Path(junit)
        if d is None or j.parent.resolve() != d.resolve() or d.is_dir():
            emit.check_writable(j)
    return d


def read_paths(model: Any, inputs_file: Any, data: Any, calibration: Any = None) -> list[tuple[str, Any]]:
    """What a gate command reads from disk, labelled for :func:`amplite.paths.guard_outputs`."""
    path = lambda v: v if isinstance(v, (str, Path)) else None  # noqa: E731
    calib = path(calibration) if calibration is not None and Path(str(calibration)).exists() else None
    return [("the model", path(model)), ("the --inputs file", inputs_file), ("the --data directory", path(data)),
            ("the --calib directory", calib)]  # fmt: skip


def model_name(model: Any, report: dict[str, Any]) -> str:
    """The name JUnit and annotations show: the source file's stem, else the model's class name."""
    path = report.get("source", {}).get("path")
    if path:
        return Path(path).name.split(".")[0]
    return type(model).__name__


def publish_github_summary(report: dict[str, Any]) -> bool:
    """On GitHub Actions, write the Markdown report to the job summary and annotations (else do nothing)."""
    from amplite.report.junit import publish_github
    from amplite.report.markdown import render_markdown

    return publish_github(report, render_markdown(report))
