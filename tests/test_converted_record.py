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
    assert record is not None and record["amplite"] == amplite.__version__
    cfg = record["config"]
    assert (cfg["precision"], cfg["level"], cfg["keep_fp32"]) == ("bf16", "O1", ["module:fc2.*"])
    extra = {"amplite.json": ""}
    program = torch.export.load(path, extra_files=extra)  # torch's own loader is unaffected
    assert json.loads(extra["amplite.json"])["config"]["level"] == "O1"
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


@pytest.mark.parametrize(
    "text", ['{"config": {"level": "O9"}}', '{"config": {"keep_fp32": "op:*"}}', "[1, 2]", "{not json"]
)
def test_a_record_amplite_did_not_write_is_refused(saved, tmp_path: Path, text: str) -> None:
    path, model, inputs = saved
    bad = tmp_path / "bad.pt2"
    _rewrite_record(path, bad, text)
    with pytest.raises(LoadError, match="is not the record amplite writes"):
        check(model, inputs, converted=bad, layerwise=False)


def test_unknown_record_keys_never_reach_the_report(saved, tmp_path: Path) -> None:
    path, _, _ = saved
    bad = tmp_path / "extra.pt2"
    _rewrite_record(path, bad, '{"amplite": "x", "config": {"level": "O2", "script": "<script>alert(1)</script>"}}')
    record = read_conversion(bad)
    assert record == {"amplite": "x", "config": {"level": "O2"}}


def test_a_file_without_a_record_is_inferred_as_before(tmp_path: Path) -> None:
    model, inputs = make("mlp")
    result = amplite.convert(model, inputs, level="O2", verify=False)
    plain = tmp_path / "plain.pt2"
    torch.export.save(result.program, plain)  # saved by torch, not amplite
    assert read_conversion(plain) is None
    res = check(model, inputs, converted=plain, layerwise=False)
    cfg = res.report.data["config"]
    assert (cfg["level"], cfg["level_source"]) == ("O2", "inferred from the converted file")
