"""The typed report (issue 30): sections declared once with one builder each, assembled once, never changed
(``Report.with_sections`` makes a new one), a read-only ``report.data``, and the same shared sections for a
module and a checkpoint."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

import amplite
from amplite.errors import InternalError
from amplite.report.document import HEADER_KEYS, Report, ReportBuilder
from amplite.report.markdown import render_markdown
from amplite.report.schema import load_schema, validate_report
from amplite.report.sections import (
    SECTIONS,
    Baseline,
    Check,
    Outputs,
    Section,
    Source,
    Streaming,
    Timings,
    Verification,
    WeightRules,
)  # fmt: skip
from amplite.verify.compare import OutputMetrics, Tolerance
from amplite.verify.numbers import decode_float
from fixtures import zoo

#: The sections every conversion report holds (the schema's required keys, less the header).
SHARED = {"source", "config", "passes", "graph", "weights", "fp32_nodes", "plan", "timings", "warnings"}


@pytest.fixture(scope="module")
def module_report() -> Report:
    model, inputs = zoo.make("mlp")
    return amplite.convert(model, inputs, level="O1").report


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    from tests.test_checkpoint import _config

    path = tmp_path_factory.mktemp("sections") / "tiny-llama"
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(_config()).eval().save_pretrained(path, max_shard_size="40KB")
    return path


@pytest.fixture(scope="module")
def checkpoint_report(checkpoint_path: Path) -> Report:
    return amplite.convert(checkpoint_path, precision="fp16", level="O2").report


def test_every_declared_section_is_in_the_schema_and_the_header_is_not_a_section() -> None:
    props = load_schema()["properties"]
    assert SHARED | set(HEADER_KEYS) == set(load_schema()["required"])
    missing = sorted(k for k in SECTIONS if k not in props)
    assert missing == [], f"sections without a schema entry: {missing}"
    assert not set(HEADER_KEYS) & set(SECTIONS)
    assert all(cls.key == key for key, cls in SECTIONS.items())


def test_each_builder_validates_on_an_assembled_report(module_report: Report) -> None:
    report = module_report
    assert {"estimate", "build", "verification"} | SHARED <= set(report.sections)
    validate_report(report)
    entry = {"format": "pt2", "path": "/tmp/m.pt2", "bytes": 10}
    report = report.with_sections(Outputs.of([entry]))
    report = report.with_sections(report.section(Outputs).with_entries({**entry, "bytes": 12}))
    assert report.data["outputs"] == [{**entry, "bytes": 12}]  # a later save to the same path replaces it
    report = report.with_sections(report.section(Timings).add(save_pt2=0.123456))
    assert report.data["timings"]["save_pt2"] == 0.1235
    report = report.with_sections(Streaming.of(2**20, 4096, 3),
                                  WeightRules.of({"model.lm_head": "range:weight-overflow"}),
                                  Baseline.of(3.0, [], None), Check.of("mlp", ["out: sqnr_db>=40 (got 12)"]))
    validate_report(report)
    assert report.data["check"] == {"name": "mlp", "passed": False, "exit_code": 1,
                                    "reasons": ["out: sqnr_db>=40 (got 12)"]}  # fmt: skip
    assert report.data["baseline"]["passed"] is True
    assert report.section(Verification).folded(False).value["passed"] is False
    # the new reports left the conversion's own report as it was
    assert "check" not in module_report.data and "save_pt2" not in module_report.data["timings"]
    # the one document serialises the same through every renderer's accessor
    assert "mlp" in render_markdown(report) and render_markdown(report) == render_markdown(report.data)


def test_an_unknown_section_is_refused_naming_it(module_report: Report) -> None:
    class Bogus(Section):
        key = "bogus"

    class FakeSource(Source):  # a known key under another type is no declared section either
        pass

    report = module_report
    with pytest.raises(InternalError, match=r"Bogus \('bogus'\) is no report section.*sections\.py"):
        report.with_sections(Bogus.from_json({"x": 1}))
    with pytest.raises(InternalError, match="FakeSource"):
        report.with_sections(FakeSource.from_json({"path": "x", "format": "y"}))
    with pytest.raises(InternalError, match="no report section"):
        ReportBuilder().add({"path": "x"})  # type: ignore[arg-type]
    with pytest.raises(InternalError, match="report key 'bogus' is no report section"):
        Report({**module_report.to_dict(), "bogus": 1})
    assert "bogus" not in report.data


def test_report_data_cannot_be_changed(module_report: Report) -> None:
    data = module_report.data
    before = module_report.to_json()
    with pytest.raises(TypeError, match=r"read-only.*with_sections"):
        data["budget"] = {}
    with pytest.raises(TypeError):
        data["timings"]["save_pt2"] = 1.0
    with pytest.raises(TypeError):
        data["plan"].append({})
    with pytest.raises(TypeError):
        data["verification"]["outputs"][0]["sqnr_db"] = "high"
    with pytest.raises(TypeError):
        data["config"].update(level="O3")
    with pytest.raises(TypeError):
        del data["weights"]
    with pytest.raises(TypeError):
        module_report.section(Source).value["path"] = "elsewhere"
    mine = copy.deepcopy(data)  # copies are plain and writable, and do not reach the report
    mine["timings"]["save_pt2"] = 1.0
    mine["plan"].append({})
    assert type(mine) is dict and type(mine["plan"]) is list
    assert module_report.to_json() == before
    assert json.loads(before) == json.loads(json.dumps(module_report.to_dict()))


def test_module_and_checkpoint_reports_share_their_sections(module_report: Report, checkpoint_report: Report) -> None:
    assert set(module_report.sections) >= SHARED and set(checkpoint_report.sections) >= SHARED
    only_module = set(module_report.sections) - set(checkpoint_report.sections)
    only_checkpoint = set(checkpoint_report.sections) - set(module_report.sections)
    assert only_module == {"verification", "estimate", "build"}  # the module path verifies and estimates now
    assert only_checkpoint == {"weight_rules"}
    for key in SHARED:  # built by the same builders: the same JSON type, the same entry keys
        a, b = module_report.data[key], checkpoint_report.data[key]
        assert type(a) is type(b), key
    assert set(checkpoint_report.data["weights"]) == set(module_report.data["weights"])
    assert set(checkpoint_report.data["graph"]) == {"before", "after"}
    fp32 = checkpoint_report.data["fp32_nodes"]
    assert fp32 and all(set(e) <= {"node", "op", "module", "source", "reason", "rule"} for e in fp32)
    assert checkpoint_report.data["source"]["format"] == "checkpoint"
    validate_report(checkpoint_report)


def test_a_saved_checkpoint_lists_its_output_with_its_size(checkpoint_path: Path, tmp_path: Path) -> None:
    result = amplite.convert(checkpoint_path, precision="bf16", level="O2")
    out = result.save(tmp_path / "m.pt2", verify=False)
    assert result.report.data["outputs"] == [{"format": "pt2", "path": str(out), "bytes": out.stat().st_size}]
    validate_report(result.report)  # "bytes" is required of every outputs entry


def test_non_finite_sqnr_round_trips_in_the_one_encoding(module_report: Report, tmp_path: Path) -> None:
    tol = Tolerance(min_sqnr_db=40.0, min_cosine=0.999)
    metrics = [OutputMetrics("out", [2], "float16", sqnr_db=math.inf), OutputMetrics("nan", [2], "float16",
                                                                                      sqnr_db=math.nan)]  # fmt: skip
    report = module_report.with_sections(Verification.of(metrics, tol))
    assert report.data["verification"]["outputs"][0]["sqnr_db"] == "inf"  # OutputMetrics.to_dict encodes it
    path = report.save(tmp_path / "r.json")  # validated on every write
    text = path.read_text()
    assert '"sqnr_db": "inf"' in text and '"sqnr_db": "nan"' in text and "Infinity" not in text
    back = json.loads(text)
    got = [decode_float(o["sqnr_db"]) for o in back["verification"]["outputs"]]
    assert got[0] == math.inf and math.isnan(got[1])
    again = Report(back)  # a document read back is the same sections
    assert set(again.sections) == set(report.sections) and again.to_json() == text
