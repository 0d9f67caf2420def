"""Every check says exactly what it checked: layer-wise error under BatchNorm folding, scoped tolerances,
the precision of a converted file, the gradient check of a BatchNorm CNN (issue 13, items 4-7)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import amplite
from amplite.errors import ConfigError
from amplite.gate import check
from amplite.verify.compare import parse_tolerance
from amplite.verify.layerwise import analyze
from amplite.verify.ranges import recommend_loss_scale
from fixtures.zoo import make

ROOT = Path(__file__).resolve().parents[1]


def bn_cnn() -> tuple[nn.Module, tuple]:
    """The zoo's CNN with non-trivial BatchNorm statistics and affine parameters (a trained model's)."""
    model, inputs = make("cnn")
    g = torch.Generator().manual_seed(3)
    for bn in (model.bn1, model.bn2):
        c = bn.num_features
        bn.running_mean.copy_(torch.rand(c, generator=g) * 4 - 2)
        bn.running_var.copy_(torch.rand(c, generator=g) * 3 + 0.2)
        bn.weight.data.copy_(torch.rand(c, generator=g) + 0.5)
        bn.bias.data.copy_(torch.rand(c, generator=g) - 0.5)
    return model, inputs


@pytest.fixture(scope="module")
def folded() -> amplite.ConversionResult:
    model, inputs = bn_cnn()
    return amplite.convert(model, inputs, level="O2")  # O2 folds all of the BatchNorm into the conv


def test_layerwise_compares_a_folded_conv_with_conv_plus_batchnorm(folded: amplite.ConversionResult) -> None:
    r = folded
    assert any(p["name"] == "fold_batchnorm" and p["counters"].get("folded") == 2 for p in r.report.data["passes"])
    out_sqnr = r.report.outputs[0]["sqnr_db"]
    assert out_sqnr > 50
    res = analyze(r.original, r.program, r.inputs, r.inputs)
    nodes = {e.node: e for e in res.nodes}
    convs = [e for e in res.nodes if e.op.startswith("conv2d")]
    assert len(convs) == 2 and all(e.op.endswith("+batch_norm") for e in convs)
    for e in convs:  # like with like: one fp16 rounding of a conv+BN, not the pre-BN value (-10 dB before)
        assert e.accumulated["sqnr_db"] > 50 and e.isolated["sqnr_db"] > 50
        assert e.node in {p["node"] for p in r.report.data["plan"]}  # named as the plan names it
    assert nodes["relu"].isolated["sqnr_db"] > 50  # fed the reference's BN output, not its conv output
    assert min(e.accumulated["sqnr_db"] for e in res.nodes) > out_sqnr - 15


def test_layerwise_at_o1_pairs_the_conv_with_the_conv_and_the_fp32_affine_with_the_batchnorm() -> None:
    """O1 keeps the user's conv and adds the BatchNorm's scale and shift in FP32 after it: the conv is
    compared with the reference's conv (not its BN output), the affine's last op with the BN's output."""
    model, inputs = bn_cnn()
    r = amplite.convert(model, inputs, level="O1", verify=False)
    res = analyze(r.original, r.program, r.inputs, r.inputs)
    got = [(e.op, e.dtype) for e in res.nodes if e.op.startswith(("conv2d", "batch_norm"))]
    assert got == [("conv2d.default", "float16"), ("batch_norm.default", "float32")] * 2, got
    assert all(e.accumulated["sqnr_db"] > 50 and e.isolated["sqnr_db"] > 50 for e in res.nodes), res.nodes


def test_layerwise_without_folding_still_pairs_bn_with_bn() -> None:
    model, inputs = bn_cnn()
    r = amplite.convert(model, inputs, level="O1", fold_batchnorm=False, verify=False)
    res = analyze(r.original, r.program, r.inputs, r.inputs)
    ops = [e.op for e in res.nodes]
    assert "batch_norm.default" in ops and not any(o.endswith("+batch_norm") for o in ops)
    assert all(e.accumulated["sqnr_db"] > 50 for e in res.nodes)


def test_scoped_tolerance_naming_a_missing_output_is_an_error(cli, model_files) -> None:
    model, inputs = make("mlp")
    with pytest.raises(ConfigError, match=r"names output 'logits'.*outputs are output"):
        check(model, inputs, level="O1", tolerance=["logits:sqnr>=200"], layerwise=False)
    with pytest.raises(ConfigError, match="names output 'logits'"):
        amplite.convert(model, inputs, tolerance=parse_tolerance(["logits:sqnr>=200"]))
    res = cli("check", model_files("mlp")["pt2"], "--tolerance", "logits:sqnr>=200", "--no-layerwise")
    assert res.exit_code == 2 and "output" in res.stderr and "Traceback" not in res.stderr
    assert check(model, inputs, level="O1", tolerance=["output:sqnr>=200"], layerwise=False).exit_code == 1


class Classifier(nn.Module):
    """The classifier docs/ci.md describes: its forward returns ``{"logits": ...}``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.net(x)}


def _doc_commands(text: str, section: str) -> list[list[str]]:
    """The shell commands of the first ```bash block after heading ``section`` (continuations joined)."""
    body = text.split(section, 1)[1]
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def test_docs_ci_gate_runs_as_written(cli, tmp_path: Path, monkeypatch) -> None:
    torch.manual_seed(0)
    model = Classifier().eval()
    (tmp_path / "models").mkdir()
    (tmp_path / "tests" / "batches").mkdir(parents=True)
    torch.export.save(torch.export.export(model, (torch.randn(8, 32),)), str(tmp_path / "models/classifier.pt2"))
    for i in range(3):
        torch.save(torch.randn(8, 32), tmp_path / f"tests/batches/{i}.pt")
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "docs/ci.md").read_text()
    commands = _doc_commands(text, "## 1. Save") + _doc_commands(text, "## 2. The gate")
    assert [c[0] for c in commands] == ["mkdir", "amplite", "amplite", "cp", "amplite"]
    for cmd in commands:
        if cmd[0] in ("cp", "mkdir"):
            _ = shutil.copy(cmd[1], cmd[2]) if cmd[0] == "cp" else [Path(d).mkdir(parents=True) for d in cmd[2:]]
            continue
        res = cli(*cmd[1:])
        assert res.exit_code == 0, (cmd, res.stdout, res.stderr)
    report = json.loads((tmp_path / "reports/amplite/report.json").read_text())
    checks = report["verification"]["outputs"][0]["checks"]
    assert checks[0]["criterion"] == "logits:top1>=0.999" and checks[0]["passed"]


def test_check_converted_bf16_file_is_judged_as_bf16(cli, tmp_path: Path) -> None:
    model, inputs = make("mlp")
    conv = tmp_path / "mlp.bf16.pt2"
    amplite.convert(model, inputs, precision="bf16", level="O2", verify=False).save(conv)
    src = tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(model, *inputs), str(src))
    res = cli("check", src, "--converted", conv, "--report", tmp_path / "rep", "--no-layerwise")
    assert res.exit_code == 0, res.stdout
    data = json.loads((tmp_path / "rep/report.json").read_text())
    assert data["config"]["precision"] == "bf16" and data["config"]["level"] == "O2"
    assert data["verification"]["tolerance"]["min_sqnr_db"] == 25.0  # bf16's default, not fp16's 40
    api = check(model, inputs, converted=conv, layerwise=False).report.data
    assert api["config"]["precision"] == "bf16" and api["config"]["level"] == "O2"
    # a --precision that contradicts what the file records is refused (the report would misstate the file);
    # a stricter bar is --tolerance
    res = cli("check", src, "--converted", conv, "-p", "fp16", "--report", tmp_path / "rep2", "--no-layerwise")
    assert res.exit_code == 2 and "does not match" in res.stderr and not (tmp_path / "rep2").exists()


def test_grad_on_a_batchnorm_cnn_compares_every_parameter(cli, tmp_path: Path) -> None:
    model, inputs = bn_cnn()
    res = check(model, inputs, level="O1", grad=True, layerwise=False)
    g = res.report.data["gradients"]
    assert g["parameters"] == 10 and g["missing_gradients"] == [] and g["passed"]
    assert g["graph"] == "unfolded BatchNorm"
    (fold,) = [p for p in res.report.data["passes"] if p["name"] == "fold_batchnorm"]
    assert fold["counters"]["folded"] == 2  # the checked model itself stays folded
    path = tmp_path / "cnn.pt2"
    torch.export.save(torch.export.export(model, *inputs), str(path))
    out = cli("check", path, "--grad", "--no-layerwise")
    assert out.exit_code == 0 and "Gradients (" in out.stdout and "10 parameters compared" in out.stdout


def test_a_parameter_without_gradient_fails_the_check(tmp_path: Path) -> None:
    model, inputs = bn_cnn()
    conv = tmp_path / "cnn.pt2"
    amplite.convert(model, inputs, level="O1", verify=False).save(conv)  # folded: conv/BN params are gone
    res = check(model, inputs, converted=conv, grad=True, layerwise=False)
    g = res.report.data["gradients"]
    assert not g["passed"] and len(g["missing_gradients"]) == 8 and "no-fold-batchnorm" in g["hint"]
    assert res.exit_code == 1 and any("8 parameter(s) not compared" in r for r in res.reasons)


def test_bf16_recommends_no_loss_scaling() -> None:
    grads = [torch.full((100,), 1e-6)]
    assert recommend_loss_scale(grads, torch.float16)["recommended_loss_scale"] > 1
    bf = recommend_loss_scale(grads, torch.bfloat16)
    assert bf["recommended_loss_scale"] == 1.0 and "no loss scaling" in bf["advice"]
