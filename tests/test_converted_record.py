"""A converted .pt2 records how it was made (``extra/amplite.json``), and ``check --converted`` reports that
instead of guessing it from the graph; a record that is not amplite's is refused, not trusted."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

import amplite
from amplite.converter.emit import read_conversion
from amplite.errors import ConfigError, LoadError
from amplite.gate import check
from amplite.policy import Level
from amplite.spec import ConvertSpec
from fixtures.zoo import make


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, object]:
    model, inputs = make("mlp")
    path = tmp_path_factory.mktemp("rec") / "mlp.pt2"
    # O1 with a user rule: nothing in the graph alone says "O1" or which pattern the user wrote
    amplite.convert(model, inputs, precision="bf16", level="O1", keep_fp32=["module:fc2.*"]).save(path)
    return path, model, inputs


def test_the_saved_file_records_its_conversion_and_still_loads_with_torch(saved) -> None:
    path, _, inputs = saved
    record = read_conversion(path)
    assert record is not None and record.amplite == amplite.__version__
    spec = record.spec  # read back as the spec it was converted with, every field
    assert (spec.precision, spec.level, spec.patterns("keep_fp32")) == (torch.bfloat16, Level.O1, ["module:fc2.*"])
    assert spec == ConvertSpec.build(precision="bf16", level="O1", keep_fp32=["module:fc2.*"])
    extra = {"amplite.json": ""}
    program = torch.export.load(path, extra_files=extra)  # torch's own loader is unaffected
    assert json.loads(extra["amplite.json"])["spec"]["level"] == "O1"
    args, kwargs = inputs
    assert torch.isfinite(program.module()(*args, **kwargs)).all()


def test_check_converted_reports_the_recorded_config(saved, tmp_path: Path) -> None:
    path, model, inputs = saved
    res = check(model, inputs, converted=path, layerwise=False, report_dir=tmp_path / "rep")
    cfg = res.report.data["config"]
    assert res.exit_code == 0
    assert (cfg["precision"], cfg["level"], cfg["keep_fp32"]) == ("bf16", "O1", ["module:fc2.*"])
    assert cfg["level_source"] == "recorded in the converted file" and cfg["converted"] == str(path)
    written = json.loads((tmp_path / "rep" / "report.json").read_text())  # validated on write by the suite
    assert written["config"]["level_source"] == "recorded in the converted file"


def test_a_precision_that_contradicts_the_file_is_refused(saved) -> None:
    path, model, inputs = saved
    with pytest.raises(ConfigError, match=r"--precision fp16 does not match .*converted to bf16"):
        check(model, inputs, converted=path, precision="fp16", layerwise=False)


def _rewrite_record(src: Path, dst: Path, text: str) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            zout.writestr(info, text.encode() if info.filename.endswith("/extra/amplite.json") else data)


def _spec_text(**changes: object) -> str:
    return json.dumps({"amplite": "x", "spec": {**ConvertSpec.build().to_json(), **changes}})


@pytest.mark.parametrize(
    "text",
    [
        '{"spec": {"level": "O9"}}',  # not every field
        _spec_text(level="O9"),
        _spec_text(precision="fp8"),  # the low dtype is fp16 or bf16; FP8 is its own field
        _spec_text(overrides=[{"action": "keep_fp32", "pattern": ["op:*"], "source": "user", "why": ""}]),
        _spec_text(overrides=[{"action": "keep_fp32", "pattern": "op:*", "source": "range", "why": ""}]),
        _spec_text(ranges={"enabled": "yes", "data_max": 512.0, "max_reduction_depth": None, "percentile": None}),
        _spec_text(dynamic_dims={"x": [True]}),
        _spec_text(script="<script>alert(1)</script>"),  # an unknown field is refused, never carried along
        '{"amplite": "x"}',
        "[1, 2]",
        "{not json",
    ],
)
def test_a_record_amplite_did_not_write_is_refused(saved, tmp_path: Path, text: str) -> None:
    path, model, inputs = saved
    bad = tmp_path / "bad.pt2"
    _rewrite_record(path, bad, text)
    with pytest.raises(LoadError, match="is not the record amplite writes"):
        check(model, inputs, converted=bad, layerwise=False)


def test_only_the_spec_reaches_the_report(saved, tmp_path: Path) -> None:
    path, model, inputs = saved
    bad = tmp_path / "extra.pt2"
    text = json.dumps({"amplite": "x", "spec": ConvertSpec.build(level="O2").to_json(),
                       "config": {"level": "O3", "script": "<script>alert(1)</script>"}})  # fmt: skip
    _rewrite_record(path, bad, text)
    record = read_conversion(bad)
    assert record is not None and record.amplite == "x" and record.spec.level is Level.O2
    cfg = check(model, inputs, converted=bad, layerwise=False).report.data["config"]
    assert cfg["level"] == "O2" and "script" not in cfg


def test_a_record_from_before_the_spec_is_inferred_from_the_graph(saved, tmp_path: Path) -> None:
    path, model, inputs = saved
    old = tmp_path / "old.pt2"
    _rewrite_record(path, old, '{"amplite": "0.9", "config": {"level": "O1", "precision": "bf16"}}')
    assert read_conversion(old) is None
    cfg = check(model, inputs, converted=old, layerwise=False).report.data["config"]
    assert cfg["level_source"] == "inferred from the converted file"


def test_a_file_without_a_record_is_inferred_as_before(tmp_path: Path) -> None:
    model, inputs = make("mlp")
    result = amplite.convert(model, inputs, level="O2", verify=False)
    plain = tmp_path / "plain.pt2"
    torch.export.save(result.program, plain)  # saved by torch, not amplite
    assert read_conversion(plain) is None
    res = check(model, inputs, converted=plain, layerwise=False)
    cfg = res.report.data["config"]
    assert (cfg["level"], cfg["level_source"]) == ("O2", "inferred from the converted file")
