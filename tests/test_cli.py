"""CLI behaviour: exit codes, one-line errors without tracebacks, nothing written on failure."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch

from tests import fresh
from tests.models.broken import DataDependent


def assert_clean_error(res: object, out_dir: Path, message: str) -> None:
    assert res.exit_code == 2, (res.stdout, res.stderr)
    text = res.stderr.strip()
    assert text.startswith("error:") and message in " ".join(text.split()), text
    assert "fix:" in text and "Traceback" not in res.stdout + res.stderr
    assert not list(out_dir.glob("*")), list(out_dir.glob("*"))  # nothing partially written


def test_convert_writes_model_and_report(cli, model_files, tmp_path: Path) -> None:
    res = cli("convert", model_files("transformer")["pt2"], "-o", tmp_path / "t.pt2", "--level", "O2")
    assert res.exit_code == 0, res.stderr
    assert "pass" in res.stdout and "wrote" in res.stdout
    report = json.loads((tmp_path / "t.report.json").read_text())
    assert report["config"]["level"] == "O2" and report["verification"]["passed"] is True
    assert [o["path"] for o in report["outputs"]] == [str(tmp_path / "t.pt2")]
    program = torch.export.load(str(tmp_path / "t.pt2"))
    assert program.module()(torch.randint(0, 1000, (2, 16))).dtype == torch.float32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.pt2", "t.report.json"]  # no temp files


def test_verification_failure_exits_1(cli, model_files, tmp_path: Path) -> None:
    res = cli("convert", model_files("overflow")["pt2"], "-o", tmp_path / "o.pt2", "--level", "O3")
    assert res.exit_code == 1
    assert "FAIL" in res.stdout and (tmp_path / "o.pt2").exists()


def test_keep_fp32_and_inspect(cli, model_files) -> None:
    res = cli("inspect", model_files("transformer")["pt2"], "--keep-fp32", "module:layers.1.*", "--only", "fp32")
    assert res.exit_code == 0, res.stderr
    assert "user:keep module:layers.1.*" in res.stdout and "fp32-list:softmax" in res.stdout
    assert "low-list" not in res.stdout


def test_env_level_is_used(cli, model_files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMPLITE_LEVEL", "O2")
    res = cli("convert", model_files("mlp")["pt2"], "-o", tmp_path / "m.pt2")
    assert res.exit_code == 0
    assert json.loads((tmp_path / "m.report.json").read_text())["config"]["level"] == "O2"


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


def test_bad_files(cli, model_files, tmp_path: Path, out_dir: Path) -> None:
    o = ["-o", out_dir / "m.pt2"]
    assert_clean_error(cli("convert", tmp_path / "missing.pt2", *o), out_dir, "does not exist")
    assert_clean_error(cli("convert", tmp_path, *o), out_dir, "is a directory")
    noise = random.Random(0).randbytes(4096)
    (tmp_path / "rand.pt2").write_bytes(noise)
    assert_clean_error(cli("convert", tmp_path / "rand.pt2", *o), out_dir, "not a model file")
    # noise after a pickle's first byte (1 file in 256 of random bytes), then after a whole protocol header: not
    # "contains pickled Python objects, pass --trust-pickle" (what the weights-only reader's error said)
    for head, why in ((b"\x80\xb7", "not a model file amplite can read"), (b"\x80\x02", "a damaged pickle")):
        (tmp_path / "noise.pt").write_bytes(head + noise)
        assert_clean_error(cli("convert", tmp_path / "noise.pt", *o), out_dir, why)
    data = model_files("mlp")["pt2"].read_bytes()
    (tmp_path / "trunc.pt2").write_bytes(data[: len(data) // 3])
    assert_clean_error(cli("convert", tmp_path / "trunc.pt2", *o), out_dir, "truncated or corrupt zip")


def test_bad_pickles_and_factories(cli, model_files, out_dir: Path) -> None:
    o = ["-o", out_dir / "m.pt2", "--inputs", model_files("mlp")["inputs"]]
    assert_clean_error(cli("convert", model_files("mlp")["pickle"], *o), out_dir, "--trust-pickle")
    state = model_files("mlp")["state_dict"]
    assert_clean_error(cli("convert", state, *o), out_dir, "--model-factory")
    assert_clean_error(cli("convert", state, *o, "--model-factory", "nope.nope:f"), out_dir, "cannot import")
    assert_clean_error(
        cli("convert", state, *o, "--model-factory", "tests.models.broken:not_a_module"), out_dir, "not an nn.Module"
    )


def test_inputs_that_do_not_fit(cli, model_files, out_dir: Path) -> None:
    pt2 = model_files("mlp")["pt2"]
    o = ["-o", out_dir / "m.pt2"]
    assert_clean_error(cli("convert", pt2, *o, "--input", "x:4x31:float32"), out_dir, "do not fit the model")
    assert_clean_error(cli("convert", pt2, *o, "--input", "x:4x32:int64"), out_dir, "do not fit the model")
    state = model_files("mlp")["state_dict"]
    res = cli("convert", state, *o, "--model-factory", "fixtures.zoo:mlp", "--input", "y:4x32:float32")
    assert_clean_error(res, out_dir, "do not fit forward(x")
    assert_clean_error(cli("convert", pt2, *o, "--input", "x:4x32"), out_dir, "cannot parse --input")


def test_export_failure_names_the_source_line(cli, tmp_path: Path, out_dir: Path) -> None:
    torch.save(DataDependent().state_dict(), tmp_path / "dd.pt")
    res = cli(
        "convert",
        tmp_path / "dd.pt",
        "-o",
        out_dir / "m.pt2",
        "--input",
        "x:2x4:float32",
        "--model-factory",
        "tests.models.broken:data_dependent",
    )
    assert_clean_error(res, out_dir, "torch.export could not trace the model")
    assert "broken.py:" in res.stderr and "if y.sum() > 0" in res.stderr


def test_bad_options_and_outputs(cli, model_files, tmp_path: Path, out_dir: Path) -> None:
    pt2 = model_files("mlp")["pt2"]
    assert_clean_error(cli("convert", pt2, "-o", out_dir / "m.pt2", "--level", "O7"), out_dir, "unknown level")
    assert_clean_error(cli("convert", pt2, "-o", out_dir / "m.pt2", "-p", "fp4"), out_dir, "unknown precision")
    assert_clean_error(cli("convert", pt2, "-o", tmp_path / "nodir" / "m.pt2"), out_dir, "does not exist")
    assert_clean_error(cli("convert", pt2, "-o", out_dir), out_dir, "is a directory")
    assert_clean_error(cli("convert", pt2, "-o", out_dir / "m.bin"), out_dir, "output format")


def test_unwritable_directory(cli, model_files, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores directory permissions: nothing to test then
            pytest.skip("running as a user that can write to read-only directories (root)")
        res = cli("convert", model_files("mlp")["pt2"], "-o", ro / "m.pt2")
        assert_clean_error(res, ro, "not writable")
    finally:
        ro.chmod(0o700)


def test_debug_shows_the_traceback(cli, tmp_path: Path) -> None:
    res = cli("convert", tmp_path / "missing.pt2", "--debug")
    assert res.exit_code == 2 and "Traceback" in res.stderr


def test_python_dash_m_matches_the_script(fresh_cli_convert: dict, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = fresh_cli_convert  # `AMPLITE_LEVEL=O2 python -m amplite convert mlp.pt2` (conftest: one run, two tests)
    assert res["returncode"] == 0, res["stderr"]
    assert res["written"] and "wrote" in res["stdout"]
    res = fresh.run([sys.executable, "-m", "amplite", "convert", str(tmp_path / "none.pt2")], env=env, timeout=300)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_migrate_command(cli, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\n\nwith torch.cuda.amp.autocast():  # keep me\n    pass\n")
    before = script.read_text()
    res = cli("migrate", script, "--check")
    assert res.exit_code == 1 and "would rewrite" in res.stdout and script.read_text() == before
    res = cli("migrate", script, "--diff")
    assert res.exit_code == 0 and '+with torch.amp.autocast("cuda"):  # keep me' in res.stdout
    assert script.read_text() == before
    assert cli("migrate", script).exit_code == 0
    assert script.read_text() == 'import torch\n\nwith torch.amp.autocast("cuda"):  # keep me\n    pass\n'
    assert cli("migrate", script, "--check").exit_code == 0
    assert cli("migrate", script, "--check", "--diff").exit_code == 2


def test_batch_command_reports_each_model_and_bad_keys(cli, model_files, tmp_path: Path) -> None:
    manifest = tmp_path / "zoo.toml"
    manifest.write_text(
        f'[defaults]\nlevel = "O2"\n\n[[model]]\npath = "{model_files("mlp")["pt2"]}"\n\n'
        f'[[model]]\npath = "{model_files("embedding")["pt2"]}"\n\n'
        f'[[model]]\nname = "broken"\npath = "{tmp_path / "missing.pt2"}"\n'
    )
    res = cli("batch", manifest, "-o", tmp_path / "all", "--jobs", "1", "--no-progress")
    assert res.exit_code == 1, res.stdout + res.stderr
    summary = json.loads((tmp_path / "all" / "summary.json").read_text())
    status = {row["name"]: row["status"] for row in summary["models"]}
    assert status == {"mlp": "ok", "embedding": "ok", "broken": "error"}
    assert (tmp_path / "all" / "mlp").is_dir()
    bad = tmp_path / "bad.toml"
    bad.write_text('[[model]]\npath = "x.pt2"\ncolour = "red"\n')
    res = cli("batch", bad, "-o", tmp_path / "b")
    assert res.exit_code == 2 and "colour" in res.stderr and "line 3" in res.stderr


def test_check_gate_exit_codes_junit_and_golden(cli, model_files, tmp_path: Path) -> None:
    import xml.etree.ElementTree as ET

    pt2 = model_files("overflow")["pt2"]
    res = cli("check", pt2, "--level", "O3", "--report", tmp_path / "o3", "--junit", tmp_path / "o3.xml")
    assert res.exit_code == 1, res.stdout + res.stderr
    assert "1. pow_1 (pow.Tensor_Scalar)" in res.stdout and "introduces NaN/Inf" in res.stdout
    assert f"json: {tmp_path / 'o3' / 'report.json'}" in res.stdout  # long paths are never wrapped
    suite = ET.parse(tmp_path / "o3.xml").getroot()
    assert suite.find(".//testcase/failure") is not None
    assert {p.name for p in (tmp_path / "o3").iterdir()} >= {"report.json", "report.md", "report.html"}
    assert cli("check", pt2, "--level", "O1", "--no-layerwise").exit_code == 0

    gold = tmp_path / "gold"
    assert cli("golden", pt2, "-o", gold).exit_code == 0
    assert cli("golden", pt2, "-o", gold).exit_code == 2  # regenerating is explicit
    assert cli("check", pt2, "--golden", gold, "--no-layerwise").exit_code == 0
    other = cli("check", model_files("mlp")["pt2"], "--golden", gold)
    assert other.exit_code == 2 and "golden" in other.stderr


def test_onnx_layernorm_option(cli, model_files, tmp_path: Path) -> None:
    import onnx

    pt2 = model_files("transformer")["pt2"]
    casts = {}
    for mode in ("stash", "off"):
        # O2 keeps the residual stream (each add a LayerNorm reads) FP32 since issue 47: pin the adds low so
        # that the LayerNorms read a low input, the case --onnx-layernorm is for
        res = cli("convert", pt2, "-o", tmp_path / f"{mode}.onnx", "-l", "O2", "--onnx-layernorm", mode,
                  "--force-low", "op:add.Tensor")  # fmt: skip
        assert res.exit_code == 0, res.stdout + res.stderr
        graph = onnx.load(str(tmp_path / f"{mode}.onnx")).graph
        casts[mode] = sum(n.op_type == "Cast" for n in graph.node)
        report = json.loads((tmp_path / f"{mode}.report.json").read_text())
        assert report["verification_onnx"]["passed"] is True
    assert casts["stash"] < casts["off"]  # the fixture's LayerNorm weights are exact in fp16
    res = cli("convert", pt2, "-o", tmp_path / "bad.onnx", "--onnx-layernorm", "sometimes")
    assert res.exit_code == 2 and "--onnx-layernorm" in res.stderr and not list(tmp_path.glob("bad*"))
    res = cli("convert", pt2, "-o", tmp_path / "p.pt2", "--onnx-layernorm", "stash")
    assert res.exit_code == 2 and "apply to ONNX output" in res.stderr


def test_convert_to_pt2_and_onnx(cli, model_files, tmp_path: Path) -> None:
    import onnx

    res = cli("convert", model_files("mlp")["pt2"], "-o", tmp_path / "m.pt2", "--format", "pt2,onnx", "-l", "O2")
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "ONNX Runtime (CPUExecutionProvider): pass" in res.stdout
    onnx.checker.check_model(str(tmp_path / "m.onnx"), full_check=True)
    report = json.loads((tmp_path / "m.report.json").read_text())
    assert [o["format"] for o in report["outputs"]] == ["pt2", "onnx"]
    assert report["verification_onnx"]["passed"] is True
    res = cli("convert", model_files("mlp")["pt2"], "-o", tmp_path / "x.pt2", "--opset", "18")
    assert res.exit_code == 2 and "--opset" in res.stderr and not (tmp_path / "x.pt2").exists()
    assert cli("convert", model_files("mlp")["pt2"], "-o", tmp_path / "y.pt2", "--format", "pt2,tflite").exit_code == 2
