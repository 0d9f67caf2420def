"""``amplite check --train-steps``: the training gate, its report sections and exit codes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import torch

import amplite
from amplite.errors import ConfigError
from amplite.report.document import Report
from fixtures import train_zoo, zoo

SCHEMA = json.loads((Path(amplite.__file__).parent / "schemas" / "report.schema.json").read_text())


def _validate(data: dict) -> None:
    jsonschema.Draft202012Validator(SCHEMA).validate(json.loads(Report(data).to_json()))


def test_train_steps_passes_on_a_fixture_and_reports_both_curves(tmp_path):
    model, _ = train_zoo.make("cnn")
    before = copy.deepcopy(model.state_dict())
    res = amplite.check(model, None, train_steps=12, data_loader="fixtures.train_zoo:batches_cnn",
                        precision="fp16", level="O2", report_dir=tmp_path / "rep")  # fmt: skip
    assert res.exit_code == 0, res.reasons
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the user's model untouched
    t = res.report.data["training"]
    assert t["loss"] == "cross_entropy" and t["batches"] == 64 and t["low_copies"] > 0
    assert len(t["fp32_losses"]) == len(t["amplite_losses"]) == 12
    assert t["fp32_losses"][0] == pytest.approx(t["amplite_losses"][0], rel=0.02)
    assert t["max_gap"] <= 0.02 and all(e["gap"] <= 0.02 for e in t["logged"])
    assert t["loss_scale_history"] == [2.0**16] * 12 and t["skipped_steps"] == []
    assert {u["parameter"] for u in t["gradient_underflow"]} == {n for n, _ in model.named_parameters()}
    _validate(res.report.data)
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "**Training** (12 steps" in md and "| step | FP32 loss | amplite loss | gap |" in md
    html = (tmp_path / "rep" / "report.html").read_text()
    assert 'id="training"' in html and "Training loss" in html


def test_cli_train_steps_exits_1_on_o3_fp16_overflow_and_0_at_o1(tmp_path, cli):
    model, _ = zoo.make("overflow")
    path = tmp_path / "overflow.pt"
    torch.save(model.state_dict(), path)
    common = [path, "--model-factory", "fixtures.zoo:overflow", "--input", "x:4x16:float32", "--train-steps", "6",
              "--precision", "fp16"]  # fmt: skip
    res = cli("check", *common, "--level", "O3", "--report", tmp_path / "o3", "--junit", tmp_path / "o3.xml")
    assert res.exit_code == 1, res.stdout
    junit = (tmp_path / "o3.xml").read_text()
    assert 'name="training"' in junit and 'type="TrainingFailure"' in junit and 'failures="1"' in junit
    data = json.loads((tmp_path / "o3" / "report.json").read_text())
    t = data["training"]
    assert t["max_gap"] == "inf" and t["skipped_steps"] == list(range(6))
    assert t["loss_scale_history"] == [2.0**16 / 2**i for i in range(6)]
    assert data["check"]["passed"] is False and "train_loss_gap" in data["check"]["reasons"][0]
    assert any("without FP32 master" in w for w in data["warnings"])
    _validate(data)
    res = cli("check", *common, "--level", "O1", "--tolerance", "train_loss_gap<=0.05")
    assert res.exit_code == 0, res.stdout
    assert "max loss gap" in res.stdout


def test_train_steps_rejects_inference_criteria():
    model, inputs = zoo.make("mlp")
    with pytest.raises(ConfigError, match="train_loss_gap"):
        amplite.check(model, inputs, train_steps=2, tolerance=["sqnr>=40"])
    with pytest.raises(ConfigError, match=r"--golden .*not apply to --train-steps"):
        amplite.check(model, inputs, train_steps=2, golden="somewhere")
    with pytest.raises(ConfigError, match=r"fuse_contractions .*not apply to --train-steps"):
        amplite.check(model, inputs, train_steps=2, fuse_contractions=True)  # would be ignored: refused


def _tiny_gpt2():
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def test_train_gate_uses_the_models_own_loss_on_labelled_batches():
    from amplite.training.gate import train_check

    model = _tiny_gpt2()
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(4):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        batches.append((f"b{i}", ((), {"input_ids": ids, "labels": ids})))
    report, reasons = train_check(model, None, batches, steps=8, lr=3e-3, precision="bf16", level="O2")
    t = report.data["training"]
    assert t["loss"] == "the model's own loss", t["loss"]
    ref = copy.deepcopy(model).train()  # the FP32 curve is the model's language-model loss, and it falls
    torch.manual_seed(0)  # the gate's seed for step 0 (the same dropout mask)
    first = ref(**batches[0][1][1]).loss.item()
    assert t["fp32_losses"][0] == pytest.approx(first, rel=1e-5)
    assert t["fp32_losses"][-1] < t["fp32_losses"][0]
    assert not reasons, reasons


class _BlowsUpInFp16(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 1e3  # > 65504 in fp16 once x is large


def test_train_gate_checks_every_step_including_the_last_partial_window():
    from amplite.training.gate import train_check

    torch.manual_seed(0)
    model = _BlowsUpInFp16()
    small = torch.randn(8, 4) * 1e-2
    batches = [(f"b{i}", ((small,), {"target": torch.zeros(8, 4)})) for i in range(40)]
    batches.append(("last", ((small * 1e5,), {"target": torch.zeros(8, 4)})))  # step 41 of 41 overflows
    _, reasons = train_check(model, None, batches, steps=41, lr=1e-6, precision="fp16", level="O1")
    assert any("not finite at 1 of 41 steps (first at step 41)" in r for r in reasons), reasons
