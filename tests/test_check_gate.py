"""``amplite check`` as a CI gate: exit codes, reports, schema, JUnit, baseline, GitHub annotations."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest

import amplite
from amplite.errors import ConfigError
from amplite.gate import check, write_reports
from amplite.report.document import Report
from amplite.report.junit import github_annotations, junit_xml, publish_github
from amplite.report.markdown import render_markdown
from amplite.verify.compare import parse_tolerance
from fixtures.zoo import make

SCHEMA = json.loads((Path(amplite.__file__).parent / "schemas" / "report.schema.json").read_text())


def validate(data: dict) -> None:
    """Validate a report the way a consumer reads it: after a JSON round trip."""
    doc = json.loads(Report(data).to_json())
    jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.FormatChecker()).validate(doc)


@pytest.fixture(scope="module")
def overflow_checks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("check")
    model, inputs = make("overflow")
    out = {}
    for lvl in ("O3", "O1"):
        out[lvl] = check(model, inputs, level=lvl, report_dir=d / lvl, junit=d / lvl / "junit.xml", grad=True)
    return out


def test_overflow_o3_fails_and_names_the_overflowing_node(overflow_checks: dict) -> None:
    res = overflow_checks["O3"]
    assert res.exit_code == 1 and not res.passed
    data = res.report.data
    top = data["layerwise"]["top_introducers"][0]
    assert top["node"] == "pow_1" and top["introduces_nonfinite"]
    assert "zoo.py:" in top["source"]
    assert data["ranges"]["overflowing_nodes"][0] == "pow_1"
    assert any("new_nonfinite" in r for r in res.reasons)
    assert data["check"] == {"name": "Overflow", "passed": False, "exit_code": 1, "reasons": res.reasons}


def test_overflow_o1_passes_with_its_fp32_islands(overflow_checks: dict) -> None:
    res = overflow_checks["O1"]
    assert res.exit_code == 0, res.reasons
    data = res.report.data
    assert "pow_1" in [n["node"] for n in data["fp32_nodes"]]
    assert data["gradients"]["passed"] and data["gradients"]["underflow"]["recommended_loss_scale"] >= 1
    assert all(o["passed"] for o in data["verification"]["outputs"])


def test_reports_are_written_and_valid(overflow_checks: dict) -> None:
    for res in overflow_checks.values():
        assert set(res.files) == {"json", "md", "html", "junit"}
        on_disk = json.loads(res.files["json"].read_text())
        assert on_disk["check"]["exit_code"] == res.exit_code
        validate(on_disk)
        md = res.files["md"].read_text()
        assert ("PASS" if res.passed else "FAIL") in md and "| output |" in md
    assert "`pow_1`" in overflow_checks["O3"].files["md"].read_text()


def test_convert_report_validates_against_schema() -> None:
    model, inputs = make("mlp")
    result = amplite.convert(model, inputs, level="O1", tolerance=parse_tolerance(["sqnr>=30"]))
    validate(result.report.data)
    assert result.report.data["verification"]["outputs"][0]["checks"][0]["criterion"] == "sqnr_db>=30"
    bad = json.loads(result.report.to_json())
    bad["verification"]["outputs"][0]["sqnr_db"] = "high"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_convert_report_with_range_rules_budget_and_onnx_validates(tmp_path: Path) -> None:
    model, inputs = make("overflow")
    opts = {"level": "O2", "data_max": 100.0, "fuse_contractions": True}
    plain = amplite.convert(model, inputs, **opts)
    tol = parse_tolerance([f"sqnr>={plain.report.outputs[0]['sqnr_db'] + 3:.2f}"])
    result = amplite.convert(model, inputs, **opts, tolerance=tol, fallback_search=True)
    result.save(tmp_path / "m.onnx")
    result.save(tmp_path / "m.pt2")
    data = result.report.data
    # every section under test is really there, so the validation below is not vacuous
    assert data["budget"]["moved_to_fp32"] and data["verification_onnx"]["outputs"]
    assert [o["format"] for o in data["outputs"]] == ["onnx", "pt2"]
    assert data["config"]["range_rules"]["data_max"] == 100.0
    assert any(p["reason"].startswith("range:") for p in data["plan"])
    assert data["config"]["contract_backend"] and any(p.get("details") for p in data["passes"])
    assert {"calibration", "save_onnx", "save_pt2"} <= set(data["timings"])
    validate(data)
    bad_values = [
        (("budget", "steps", 0, "kind"), "guess"),
        (("budget", "moved_to_fp32", 0, "isolated_sqnr_db"), "high"),
        (("outputs", 0, "format"), "tflite"),
        (("outputs", 0, "inputs", 0), "x"),
        (("config", "range_rules", "data_max"), "big"),
        (("verification_onnx", "runtime"), "tensorrt"),
        (("passes", 0, "details"), ["not", "a", "mapping"]),
        (("timings", "save_onnx"), "slow"),
    ]
    for path, value in bad_values:
        doc = json.loads(result.report.to_json())
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            validate(doc)


def test_junit_parses(overflow_checks: dict) -> None:
    res = overflow_checks["O3"]
    root = ET.fromstring(res.files["junit"].read_text())
    assert root.tag == "testsuites"
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["output", "gradients"]
    assert suite.get("tests") == "2" and suite.get("failures") == "2"
    props = {p.get("name"): p.get("value") for p in cases[0].find("properties")}
    assert float(props["new_nonfinite"]) > 0 and "sqnr_db" in props
    assert "pow_1" in cases[0].find("failure").text
    junitparser = pytest.importorskip("junitparser")
    xml = junitparser.JUnitXml.fromfile(str(res.files["junit"]))
    parsed = [case for s in xml for case in s]
    assert len(parsed) == 2 and all(not c.is_passed for c in parsed)
    ok = junitparser.JUnitXml.fromfile(str(overflow_checks["O1"].files["junit"]))
    assert all(c.is_passed for s in ok for c in s)


def test_github_annotations(overflow_checks: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    data = overflow_checks["O3"].report.data
    repo = Path(data["layerwise"]["top_introducers"][0]["source"].rpartition(":")[0]).parents[1]
    lines = github_annotations(data, workspace=str(repo))
    assert lines[0].startswith("::error title=amplite check Overflow::")
    assert any(ln.startswith("::warning file=fixtures/zoo.py,line=") and "pow_1" in ln for ln in lines)
    assert all("\n" not in ln for ln in lines)
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    import io

    buf = io.StringIO()
    assert publish_github(data, render_markdown(data), stream=buf)
    assert buf.getvalue().count("::error") == len(data["check"]["reasons"])
    assert "amplite check" in summary.read_text()
    monkeypatch.setenv("GITHUB_ACTIONS", "false")
    assert not publish_github(data, "x")


def test_baseline_regressions(overflow_checks: dict, tmp_path: Path) -> None:
    accepted = overflow_checks["O1"].report.data
    model, inputs = make("overflow")
    same = check(model, inputs, level="O1", baseline=accepted, layerwise=False)
    assert same.exit_code == 0 and same.report.data["baseline"]["passed"]
    better = json.loads(json.dumps(accepted))
    out = better["verification"]["outputs"][0]
    out["sqnr_db"] += 2.0  # the accepted report was 2 dB better: now 2 dB worse than accepted
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(better))
    worse = check(model, inputs, level="O1", baseline=path, layerwise=False)
    assert worse.exit_code == 1
    regressions = worse.report.data["baseline"]["regressions"]
    assert [r["metric"] for r in regressions] == ["sqnr_db"]
    assert regressions[0]["limit"] == pytest.approx(out["sqnr_db"] - 1.0, abs=1e-6)
    lenient = check(model, inputs, level="O1", baseline=path, baseline_margin_db=3.0, layerwise=False)
    assert lenient.exit_code == 0
    o3 = check(model, inputs, level="O3", baseline=accepted, layerwise=False)
    assert {"new_nonfinite", "passed"} <= {r["metric"] for r in o3.report.data["baseline"]["regressions"]}
    (tmp_path / "bad.json").write_text('{"schema": "something else"}')
    with pytest.raises(ConfigError, match="not an amplite report"):
        check(model, inputs, level="O1", baseline=tmp_path / "bad.json")


def test_tolerance_strings_and_converted_file(tmp_path: Path) -> None:
    model, inputs = make("mlp")
    strict = check(model, inputs, level="O1", tolerance=["sqnr>=200"], layerwise=False)
    assert strict.exit_code == 1 and "sqnr_db>=200" in strict.reasons[0]
    loose = check(model, inputs, level="O1", tolerance=["output:max_abs<=1", "top1>=0.5"], layerwise=False)
    assert loose.exit_code == 0
    assert [c["criterion"] for c in loose.outputs[0].checks] == ["output:max_abs<=1", "new_nonfinite<=0"]
    conv = tmp_path / "mlp.pt2"
    amplite.convert(model, inputs, level="O2", verify=False).save(conv)
    res = check(model, inputs, converted=conv, report_dir=tmp_path / "rep")
    assert res.exit_code == 0
    data = res.report.data
    assert data["config"]["level"] == "O2" and data["config"]["converted"] == str(conv)
    assert data["graph"]["after"]["nodes_by_dtype"].get("float16", 0) >= 2
    assert data["layerwise"]["unpaired_converted_nodes"] == []  # names survive save/load
    assert data["weights"]["ratio"] < 0.6  # O2 stored the weights in fp16
    validate(data)
    with pytest.raises(ConfigError, match=r"unknown conversion option.*levels"):
        check(model, inputs, levels="O1")


def test_nothing_written_on_error(tmp_path: Path) -> None:
    model, inputs = make("mlp")
    rep = tmp_path / "rep"
    with pytest.raises(amplite.AmpliteError) as info:
        check(model, inputs, level="O1", tolerance=["bogus>=1"], report_dir=rep, junit=rep / "junit.xml")
    assert info.value.exit_code == 2
    assert not rep.exists()
    with pytest.raises(amplite.AmpliteError):
        check(model, inputs, junit=tmp_path / "no" / "dir" / "junit.xml")


def test_report_renderers_take_a_convert_report() -> None:
    model, inputs = make("mlp")
    data = amplite.convert(model, inputs, level="O1").report.data
    assert "PASS" in render_markdown(data)
    assert ET.fromstring(junit_xml(data)).find("testsuite").get("tests") == "1"


def test_write_reports_from_json(overflow_checks: dict, tmp_path: Path) -> None:
    data = json.loads(overflow_checks["O3"].files["json"].read_text())
    files = write_reports(data, tmp_path / "again")
    assert files["html"].read_text().count("plotly-graph-div") >= 3
