"""A report is built once, then frozen (issue 46 item 4): sections are collected by a ``ReportBuilder``; a
stage that runs after the report was handed out (a save, a check) makes a new report with
``Report.with_sections`` and leaves the one already shown as it was."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

import amplite
from amplite.errors import InternalError
from amplite.report.document import HEADER_KEYS, ReportBuilder
from amplite.report.sections import Check, Outputs, Source, Timings
from fixtures import zoo


@pytest.fixture(scope="module")
def converted() -> amplite.ConversionResult:
    model, inputs = zoo.make("mlp")
    return amplite.convert(model, inputs, level="O1")


def test_a_built_report_has_no_mutating_method_and_refuses_every_change(converted: amplite.ConversionResult) -> None:
    report = converted.report
    before = report.to_json()
    assert not hasattr(report, "attach") and not hasattr(report, "copy")
    with pytest.raises(AttributeError, match="frozen"):
        report._sections = {}  # type: ignore[misc]
    with pytest.raises(AttributeError, match="frozen"):
        del report._data
    with pytest.raises(TypeError):
        report.sections["check"] = Check.of("x", [])  # type: ignore[index]
    with pytest.raises(TypeError):
        report.data["check"] = {}  # type: ignore[index]
    with pytest.raises(TypeError):
        report.data["timings"]["x"] = 1.0  # type: ignore[index]
    assert copy.copy(report) is report and copy.deepcopy(report) is report  # nothing to copy: it cannot change
    assert pickle.loads(pickle.dumps(report)).to_json() == before
    assert report.to_json() == before


def test_with_sections_returns_a_new_report_and_leaves_this_one(converted: amplite.ConversionResult) -> None:
    report = converted.report
    newer = report.with_sections(Check.of("mlp", ["out: bad"]), report.section(Timings).add(extra=0.5))
    assert newer is not report and "check" not in report.data and "extra" not in report.data["timings"]
    assert newer.data["check"]["exit_code"] == 1 and newer.data["timings"]["extra"] == 0.5
    assert list(newer.data)[: len(report.data)] == list(report.data)  # replaced in place, added at the end
    assert [newer.data[k] for k in HEADER_KEYS] == [report.data[k] for k in HEADER_KEYS]


def test_a_builder_builds_once_and_then_refuses_more(converted: amplite.ConversionResult) -> None:
    builder = converted.report.builder().add(Check.of("mlp", []))
    assert builder.section(Check).passed and builder.section(Outputs) is None
    built = builder.build()
    assert built.data["check"]["passed"] is True and "check" not in converted.report.data
    with pytest.raises(InternalError, match="already built"):
        builder.build()
    with pytest.raises(InternalError, match="already built"):
        builder.add(Check.of("mlp", ["late"]))
    assert built.data["check"]["reasons"] == []
    partial = converted.report.builder()
    with pytest.raises(InternalError, match="no report section"):
        partial.add(Check.of("mlp", []), {"path": "x"})  # type: ignore[arg-type]
    assert partial.section(Check) is None  # a bad section in the call adds none of them
    fresh = ReportBuilder().add(Source.from_json({"path": "m.pt2", "format": "pt2"})).build()
    assert list(fresh.data) == [*HEADER_KEYS, "source"]


def test_a_save_rebinds_a_new_report_and_leaves_the_one_shown(converted: amplite.ConversionResult,
                                                              tmp_path: Path) -> None:  # fmt: skip
    model, inputs = zoo.make("mlp")
    result = amplite.convert(model, inputs, level="O1")
    shown = result.report
    text = shown.to_json()
    out = result.save(tmp_path / "m.pt2")
    assert result.report is not shown and shown.to_json() == text  # the report already shown did not change
    assert result.report.data["outputs"] == [{"format": "pt2", "path": str(out), "bytes": out.stat().st_size}]
    assert "save_pt2" in result.report.data["timings"]
    assert list(result.report.data) == [*shown.data, "outputs"]  # the same document, with the file written


def test_a_check_builds_its_own_report_from_the_conversion(tmp_path: Path) -> None:
    model, inputs = zoo.make("mlp")
    res = amplite.check(model, inputs, tolerance=["sqnr>=1"], golden=tmp_path / "gold", update_golden=True,
                        level="O1")  # fmt: skip
    keys = list(res.report.data)
    assert keys[: len(HEADER_KEYS)] == list(HEADER_KEYS) and keys[-1] == "check"
    assert {"verification", "golden", "check"} <= set(keys) and res.report.data["check"]["exit_code"] == 0
    assert not hasattr(res.report, "attach")
