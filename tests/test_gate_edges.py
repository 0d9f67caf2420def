"""``amplite check`` at its edges: option values that would silently weaken the gate, and the JUnit file a
CI reads (exit codes, failure elements, names with XML's special characters). One tiny MLP, in-process."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def mlp(model_files, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    files = dict(model_files("mlp"))  # the session's files, shared with the other CLI tests
    data = tmp_path_factory.mktemp("gate") / "data"
    data.mkdir()
    example = torch.load(files["inputs"])
    for i in range(3):  # three batches, each the example scaled differently
        torch.save(tuple(x * (i + 1) for x in example), data / f"b{i}.pt")
    files["data"] = data
    return files


@pytest.mark.parametrize("max_batches", ["0", "-1"])
def test_max_batches_below_one_is_a_usage_error(cli, mlp: dict[str, Path], tmp_path: Path, max_batches: str) -> None:
    """0 crashed (IndexError, exit 3) and -1 sliced the last batch off silently (the report said 2 batches)."""
    res = cli("check", mlp["pt2"], "--data", mlp["data"], "--max-batches", max_batches, "--no-layerwise",
              "--report", tmp_path / "r")  # fmt: skip
    assert res.exit_code == 2, res.stderr
    assert f"--max-batches {max_batches}" in res.stderr and "fix:" in res.stderr
    assert not (tmp_path / "r").exists()


def test_max_batches_takes_that_many_batches_in_name_order(cli, mlp: dict[str, Path], tmp_path: Path) -> None:
    res = cli("check", mlp["pt2"], "--data", mlp["data"], "--max-batches", "2", "--no-layerwise",
              "--report", tmp_path / "r")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    verification = json.loads((tmp_path / "r" / "report.json").read_text())["verification"]
    assert verification["batches"] == 2 and "2 batches" in verification["inputs"]


@pytest.fixture(scope="module")
def baseline(mlp: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from amplite.gate import check

    d = tmp_path_factory.mktemp("base")
    assert check(mlp["pt2"], layerwise=False, level="O0", report_dir=d).exit_code == 0  # O0: FP32, exact
    return d / "report.json"


@pytest.mark.parametrize("margin", ["nan", "-1", "inf"])
def test_a_baseline_margin_that_is_not_a_finite_number_of_db_is_refused(
    cli, mlp: dict[str, Path], baseline: Path, tmp_path: Path, margin: str
) -> None:
    """A NaN margin made every comparison False, so no regression was ever found: the O1 model below
    regresses against its exact O0 baseline, and passed with --baseline-margin nan."""
    res = cli("check", mlp["pt2"], "--baseline", baseline, "--baseline-margin", margin, "--no-layerwise",
              "--report", tmp_path / "r", "--junit", tmp_path / "j.xml")  # fmt: skip
    assert res.exit_code == 2, res.stderr
    assert "--baseline-margin" in res.stderr and "fix:" in res.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "j.xml").exists()


def test_a_regression_against_the_baseline_fails_with_a_junit_failure(
    cli, mlp: dict[str, Path], baseline: Path, tmp_path: Path
) -> None:
    """The case the NaN margin hid: fp16 O1 against an exact FP32 baseline loses SQNR beyond 1 dB."""
    res = cli("check", mlp["pt2"], "--baseline", baseline, "--no-layerwise", "--junit", tmp_path / "j.xml")
    assert res.exit_code == 1, res.stderr
    suite = ET.parse(tmp_path / "j.xml").getroot()
    assert suite.get("failures") == "1"
    (failure,) = suite.iter("failure")
    assert "sqnr_db" in failure.get("message") and "regressed" in failure.get("message")


def test_junit_of_a_tolerance_failure_names_the_criterion(cli, mlp: dict[str, Path], tmp_path: Path) -> None:
    res = cli("check", mlp["pt2"], "--tolerance", "max_abs<=0", "--no-layerwise", "--junit", tmp_path / "j.xml")
    assert res.exit_code == 1
    root = ET.parse(tmp_path / "j.xml").getroot()
    assert root.tag == "testsuites" and root.get("tests") == "1" and root.get("failures") == "1"
    (case,) = root.iter("testcase")
    (failure,) = case.iter("failure")
    assert "max_abs" in failure.get("message") and failure.get("type") == "AccuracyFailure"
    passed = cli("check", mlp["pt2"], "--no-layerwise", "--junit", tmp_path / "ok.xml")
    assert passed.exit_code == 0 and not list(ET.parse(tmp_path / "ok.xml").getroot().iter("failure"))


def test_junit_keeps_a_name_with_xml_special_characters(cli, mlp: dict[str, Path], tmp_path: Path) -> None:
    name = 'a<b>&"c\''
    res = cli("check", mlp["pt2"], "--no-layerwise", "--name", name, "--junit", tmp_path / "j.xml")
    assert res.exit_code == 0, res.stderr
    suite = next(ET.parse(tmp_path / "j.xml").getroot().iter("testsuite"))
    assert suite.get("name").endswith(name)  # escaped in the file, the same text once parsed


@pytest.fixture(scope="module")
def int_batches(mlp: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four batches of the right shape, saved as int64 where the model takes float32."""
    d = tmp_path_factory.mktemp("int")
    (x,) = torch.load(mlp["inputs"])
    for i in range(4):
        torch.save(((x * 10).long() + i,), d / f"b{i}.pt")
    return d


def test_a_first_batch_that_does_not_fit_is_named_when_it_traces_the_model(
    cli, mlp: dict[str, Path], int_batches: Path
) -> None:
    """Without --input the first batch stands in for the example inputs; its failure named "the example
    inputs" and suggested --input, as if the user had given some."""
    res = cli("check", mlp["pt2"], "--data", int_batches, "--no-layerwise")
    assert res.exit_code == 2
    assert "batch 0 (b0.pt)" in res.stderr and "the example inputs do not fit" not in res.stderr
    assert "fix:" in res.stderr


def test_a_batch_of_the_wrong_dtype_names_the_input_and_the_fix(cli, mlp: dict[str, Path], int_batches: Path) -> None:
    res = cli("check", mlp["pt2"], "--inputs", mlp["inputs"], "--data", int_batches, "--no-layerwise")
    assert res.exit_code == 2
    assert "batch 0 (b0.pt): input 'x' is int64, the model takes float32" in res.stderr
    assert "fix:" in res.stderr and "float32" in res.stderr.split("fix:")[1]  # the message had no fix


@pytest.mark.parametrize("n", [1, 4])  # 4: calibration compiles the instrumented graph (COMPILE_FROM)
def test_calibration_batches_that_do_not_run_are_an_input_error(
    cli, mlp: dict[str, Path], int_batches: Path, tmp_path: Path, n: int
) -> None:
    """They crashed the conversion as an internal error (exit 3, "report it")."""
    calib = tmp_path / "calib"
    calib.mkdir()
    for f in sorted(int_batches.iterdir())[:n]:
        (calib / f.name).write_bytes(f.read_bytes())
    res = cli("convert", mlp["pt2"], "--calib", calib, "-o", tmp_path / "out.pt2")
    assert res.exit_code == 2, res.stderr
    assert "calibration batch 0" in res.stderr and "fix:" in res.stderr and "report it" not in res.stderr
    assert not list(tmp_path.glob("out*"))


def test_update_golden_refuses_a_directory_that_is_not_golden_naming_the_option(
    cli, mlp: dict[str, Path], tmp_path: Path
) -> None:
    """--update-golden replaces a golden directory as a whole: never one holding other files. The refusal
    names the option the user gave (check's --golden, golden's -o): check's said "-o", which it has not."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a golden file")
    res = cli("check", mlp["pt2"], "--golden", mine, "--update-golden", "--no-layerwise")
    assert res.exit_code == 2 and "not a golden directory" in res.stderr
    assert "--golden" in res.stderr.split("fix:")[1] and "-o" not in res.stderr.split("fix:")[1]
    res = cli("golden", mlp["pt2"], "-o", mine, "--update-golden")
    assert res.exit_code == 2 and "-o" in res.stderr.split("fix:")[1]
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
