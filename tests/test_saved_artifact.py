"""Issue 13, the saved artifact: what `convert` writes keeps every option, named inputs bind to a .pt2's
signature, the user's model is never changed, unwritable destinations are clean errors, and the report
says exactly what it measured."""

from __future__ import annotations

import copy
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import amplite
from amplite.converter.graph_stats import graph_stats
from amplite.errors import ConfigError, EmitError
from fixtures.zoo import make
from tests import fresh

ROOT = Path(__file__).resolve().parents[1]


def run_fresh(code: str, timeout: int = 240) -> str:
    """Run ``code`` in a new Python process (nothing of this process's state); return its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = fresh.run([sys.executable, "-c", textwrap.dedent(code)], timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _placeholder_dims(program: torch.export.ExportedProgram) -> list[list[object]]:
    user = {s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
    return [list(n.meta["val"].shape) for n in program.graph.nodes if n.op == "placeholder" and n.name in user]


# ---- 1. symbolic dims survive the report and the save ------------------------------------------------------


def test_graph_stats_do_not_specialise_a_dynamic_batch() -> None:
    model, inputs = make("mlp")
    program = torch.export.export(model, *inputs, dynamic_shapes=({0: torch.export.Dim.AUTO},), strict=False)
    before = graph_stats(program.graph, torch.float16)
    (dims,) = _placeholder_dims(program)
    assert isinstance(dims[0], torch.SymInt) and str(dims[0]).startswith("s"), dims  # still a symbol
    # FLOPs are counted at the example's batch (4): 2*4*32*64 + 2*4*64*10 + gelu/bias terms
    assert before["low_precision_flop_share"] == 0.0 and before["nodes_by_dtype"]


def test_dynamic_batch_and_dim_survive_save_in_a_fresh_process(cli, model_files, tmp_path: Path) -> None:
    res = cli("convert", model_files("mlp")["pt2"], "--dynamic-batch", "-o", tmp_path / "c.pt2")  # issue's repro
    assert res.exit_code == 0, res.stderr
    model, inputs = make("transformer")
    result = amplite.convert(model, inputs, dynamic_batch=True, dynamic_dims=["ids:1"])
    assert result.report.data["config"]["dynamic_dims"] == {"ids": [1]}
    result.save(tmp_path / "t.pt2")
    mlp, mlp_in = make("mlp")
    amplite.convert(mlp, mlp_in, dynamic_batch=True, precision="bf16", level="O2").save(tmp_path / "m.pt2")
    # an fp16 input times a 0-dim FP32 buffer is float16 (type promotion): planned as such, it converts to bf16
    # (it once failed the precision sequence's postcondition at O2/O3); its saved file runs on another batch
    half = _HalfTimesScalar().eval()
    result = amplite.convert(half, ((torch.randn(4, 8).half(),), {}), precision="bf16", level="O2", dynamic_batch=True)
    assert result.passed, result.report.outputs
    result.save(tmp_path / "h.pt2")
    x7 = torch.randn(7, 8).half()
    torch.save(x7, tmp_path / "x7.pt")
    out = run_fresh(f"""
        import torch
        t = torch.export.load({str(tmp_path / "t.pt2")!r}).module()
        print(tuple(t(torch.randint(0, 1000, (5, 9))).shape))
        m = torch.export.load({str(tmp_path / "m.pt2")!r}).module()
        print(tuple(m(torch.randn(7, 32)).shape))
        c = torch.export.load({str(tmp_path / "c.pt2")!r}).module()
        print(tuple(c(torch.randn(7, 32)).shape))
        h = torch.export.load({str(tmp_path / "h.pt2")!r}).module()
        torch.save(h(torch.load({str(tmp_path / "x7.pt")!r})), {str(tmp_path / "h7.pt")!r})
    """)
    assert out.split() == ["(5,", "10)", "(7,", "10)", "(7,", "10)"]
    got, want = torch.load(tmp_path / "h7.pt"), half(x7)
    assert got.shape == (7, 8) and got.dtype == torch.float16  # the model's output dtype, on a batch of 7
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)  # bf16 compute, fp16 output


class _HalfTimesScalar(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("scale", torch.tensor(0.5))
        self.lin = torch.nn.Linear(8, 8).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.scale)


def test_dynamic_dim_errors_name_the_problem() -> None:
    model, inputs = make("mlp")
    with pytest.raises(ConfigError, match="fixes that dim to 32"):
        amplite.convert(model, inputs, dynamic_dims=["x:1"], verify=False)
    with pytest.raises(ConfigError, match=r"no tensor input 'y'.*x"):
        amplite.convert(model, inputs, dynamic_dims=["y:0"], verify=False)
    with pytest.raises(ConfigError, match="cannot parse --dynamic-dim"):
        amplite.convert(model, inputs, dynamic_dims=["x"], verify=False)


# ---- 2. named inputs bind to a .pt2's positional signature --------------------------------------------------


def test_named_inputs_on_a_pt2_from_every_source(cli, model_files, tmp_path: Path) -> None:
    pt2 = model_files("mlp")["pt2"]
    res = cli("convert", pt2, "--input", "x:4x32:float32", "-o", tmp_path / "a.pt2")
    assert res.exit_code == 0, res.stderr
    torch.save({"x": torch.randn(4, 32)}, tmp_path / "in.pt")
    np.savez(tmp_path / "in.npz", x=np.random.default_rng(0).standard_normal((4, 32)).astype("float32"))
    from safetensors.torch import save_file

    save_file({"x": torch.randn(4, 32)}, str(tmp_path / "in.safetensors"))
    for f in ("in.pt", "in.npz", "in.safetensors"):
        res = cli("convert", pt2, "--inputs", tmp_path / f, "-o", tmp_path / f"{f}.pt2")
        assert res.exit_code == 0, (f, res.stderr)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        torch.save({"x": torch.randn(4, 32)}, data / f"b{i}.pt")
    res = cli("check", pt2, "--data", data, "--no-layerwise")
    assert res.exit_code == 0, res.stderr
    res = cli("check", pt2, "--input", "x:4x32:float32", "--random-batches", "2", "--no-layerwise")
    assert res.exit_code == 0, res.stderr
    res = cli("golden", pt2, "--input", "x:4x32:float32", "-o", tmp_path / "gold")
    assert res.exit_code == 0, res.stderr
    res = cli("check", pt2, "--golden", tmp_path / "gold", "--no-layerwise")
    assert res.exit_code == 0, res.stderr
    res = cli("convert", pt2, "--input", "y:4x32:float32", "-o", tmp_path / "bad.pt2")
    assert res.exit_code == 2 and "one of: x" in " ".join(res.stderr.split())


# ---- 8. the user's model is never changed ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_convert_and_check_leave_the_model_bit_identical(mode: str) -> None:
    from amplite.gate import check

    model, inputs = make("cnn")
    model.train(mode == "train")
    before = copy.deepcopy(model.state_dict())
    result = amplite.convert(model, inputs)
    assert result.report.data["source"]["mode"] == mode
    check(model, inputs, layerwise=False)
    after = model.state_dict()
    assert model.training is (mode == "train")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, changed
    if mode == "train":
        assert any("train mode" in w for w in result.report.data["warnings"])


# ---- 9. unwritable destinations -------------------------------------------------------------------------------


def test_unwritable_destinations_exit_2(cli, model_files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pt2 = model_files("mlp")["pt2"]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for dest in ("/proc/x.pt2", blocker / "sub" / "x.pt2"):
        res = cli("convert", pt2, "-o", dest)
        assert res.exit_code == 2, (dest, res.stdout, res.stderr)
        assert res.stderr.startswith("error:") and "Traceback" not in res.stderr
    out = tmp_path / "out"
    out.mkdir()

    def full_disk(*_a: object, **_k: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.export, "save", full_disk)
    res = cli("convert", pt2, "-o", out / "m.pt2")
    assert res.exit_code == 2 and "No space left on device" in res.stderr, res.stderr
    assert not list(out.iterdir())  # nothing partial: no model, no report, no temp directory


def test_a_later_failed_write_removes_the_earlier_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from amplite.report.document import Report
    from amplite.save import convert_to_files

    model_path = tmp_path / "m.pt2"
    model, inputs = make("mlp")
    torch.export.save(torch.export.export(model, *inputs), str(model_path))
    monkeypatch.setattr(Report, "save", lambda self, path: (_ for _ in ()).throw(EmitError("disk full")))
    with pytest.raises(EmitError):
        convert_to_files(model_path, output=tmp_path / "out.pt2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt2"]


# ---- 10. level source, NaN outputs, baseline of another model --------------------------------------------------


def test_level_source_is_env_from_the_cli(fresh_cli_convert: dict) -> None:
    proc = fresh_cli_convert  # AMPLITE_LEVEL=O2 python -m amplite convert (conftest: one run for two tests)
    assert proc["returncode"] == 0, proc["stderr"]
    config = proc["report"]["config"]
    assert (config["level"], config["level_source"]) == ("O2", "AMPLITE_LEVEL")


def test_nan_outputs_say_metrics_are_on_the_finite_part(cli, tmp_path: Path) -> None:
    from amplite.report.html import render_html
    from amplite.report.markdown import render_markdown
    from amplite.verify.compare import DEFAULT_TOLERANCES, compare

    ref = torch.randn(4, 64, dtype=torch.float64)
    out = ref.clone().float()
    out.view(-1)[: 3 * 64] = float("nan")  # 75 % NaN, the rest exact
    (m,) = compare(ref.float(), out, DEFAULT_TOLERANCES["fp16"])
    d = m.to_dict()
    assert not m.passed and (d["elements"], d["compared"], d["out_nonfinite"]) == (256, 64, 192)
    assert d["notes"][0].startswith("metrics computed on the finite part only (64 of 256")
    report = {"schema": "amplite.report", "config": {"precision": "fp16", "level": "O1"}, "source": {"path": "m"},
              "verification": {"inputs": "example inputs", "passed": False, "outputs": [d], "tolerance": {}}}
    assert "| 192 |" in render_markdown(report) and "inf†" in render_markdown(report)
    assert "192 (192 new)" in render_html(report) and "finite part only (64 of 256" in render_html(report)

    from types import SimpleNamespace

    from amplite.cli import output
    from amplite.report.document import as_report

    # the terminal verdict of `check`: the NaN/Inf count, and every float metric marked † (finite part only)
    with output.out.capture() as cap:
        output.print_check(SimpleNamespace(exit_code=1, report=as_report(report), reasons=[], files={}))
    (row,) = [line for line in cap.get().splitlines() if "│ 192" in line]
    assert row.count("†") == 3, row
    assert "finite part only (64 of 256 elements; 192 NaN/Inf)" in cap.get()


def test_baseline_of_another_model_is_refused(tmp_path: Path) -> None:
    from amplite.gate import check

    mlp, mlp_in = make("mlp")
    rms, rms_in = make("rmsnorm")
    first = check(mlp, mlp_in, layerwise=False, report_dir=tmp_path / "r")
    assert first.exit_code == 0
    assert check(mlp, mlp_in, layerwise=False, baseline=first.files["json"]).exit_code == 0
    with pytest.raises(ConfigError, match="report of another model"):
        check(rms, rms_in, layerwise=False, baseline=first.files["json"])


# ---- 12. calibration from the CLI --------------------------------------------------------------------------


def test_calib_dir_and_loader_change_the_ranges(cli, model_files, tmp_path: Path, monkeypatch) -> None:
    pt2 = model_files("mlp")["pt2"]
    calib = tmp_path / "calib"
    calib.mkdir()
    torch.save({"x": 1000.0 * torch.randn(4, 32)}, calib / "big.pt")  # activations beyond fp16's range
    (tmp_path / "calmod.py").write_text("import torch\ndef batches():\n    yield {'x': 1000.0 * torch.randn(4, 32)}\n")
    monkeypatch.chdir(tmp_path)
    plain = cli("inspect", pt2, "--only", "fp32")
    for opts in (["--calib", calib], ["--calib-loader", "calmod:batches"]):
        res = cli("inspect", pt2, "--only", "fp32", *opts)
        assert res.exit_code == 0, res.stderr
        assert "range" in res.stdout and res.stdout != plain.stdout, res.stdout
    res = cli("inspect", pt2, "--calib", calib, "--calib-loader", "calmod:batches")
    assert res.exit_code == 2 and "both given" in res.stderr
    res = cli("convert", pt2, "--calib", tmp_path / "missing", "-o", tmp_path / "x.pt2")
    assert res.exit_code == 2 and "--calib" in res.stderr
