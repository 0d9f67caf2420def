"""Issue 47 items 1 and 2: files with torch-legal module names read back; ``--dynamic-batch`` from a batch-1
example gives a program that runs at other batch sizes (or a warning naming the real cause)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import amplite
from tests.test_saved_artifact import run_fresh
from tests.test_security import P, json_edit, rebuild


class RegNetLike(nn.Module):
    """Submodule names torchvision's RegNet writes (``block1-0``), via add_module and an nn.ModuleDict."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential()
        self.trunk.add_module("block1-0", nn.Conv2d(3, 8, 3, padding=1))
        self.trunk.add_module("block1-1", nn.BatchNorm2d(8))
        self.heads = nn.ModuleDict({"act-1": nn.ReLU()})
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.heads["act-1"](self.trunk(x)).mean((2, 3)))


@pytest.fixture(scope="module")
def regnet_pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("regnet") / "regnet.pt2"
    torch.export.save(torch.export.export(RegNetLike().eval(), (torch.randn(2, 3, 8, 8),)), str(path))
    return path


def test_a_module_path_torch_writes_reads_back_through_every_command(cli, regnet_pt2: Path, tmp_path: Path) -> None:
    assert torch.export.load(str(regnet_pt2)) is not None  # torch's own loader reads it
    res = cli("inspect", regnet_pt2)
    assert res.exit_code == 0, res.stderr
    assert "trunk.block1-0" in res.stdout and "heads.act-1" in res.stdout
    out = tmp_path / "regnet.bf16.pt2"
    res = cli("convert", regnet_pt2, "--precision", "bf16", "-o", out)
    assert res.exit_code == 0, res.stderr
    res = cli("inspect", out)  # the file amplite wrote reads back
    assert res.exit_code == 0, res.stderr
    res = cli("check", regnet_pt2, "--converted", out, "--no-layerwise")
    assert res.exit_code == 0, res.stderr
    # and converting amplite's own output again (its weights keep the names)
    res = cli("convert", out, "--precision", "bf16", "-o", tmp_path / "again.pt2")
    assert res.exit_code == 0, res.stderr


@pytest.mark.parametrize("name", ['block"1', "block\\1", "block\n1"])
def test_a_module_path_that_would_end_fx_s_string_literal_is_refused(cli, regnet_pt2: Path, tmp_path: Path,
                                                                      name: str) -> None:  # fmt: skip
    """FX writes ``getattr(self, "part")`` for a part that is not an identifier: a quote, backslash or newline
    there would be code, so those stay refused (exit 2, one line)."""

    def rename(doc: dict) -> None:
        text = json.dumps(doc).replace("trunk.block1-0.weight", "trunk." + json.dumps(name)[1:-1] + ".weight")
        doc.clear()
        doc.update(json.loads(text))

    bad = rebuild(regnet_pt2, tmp_path / "bad.pt2", {P: json_edit(rename)})
    res = cli("inspect", bad)
    assert res.exit_code == 2
    assert "is not a module path" in res.stderr or "control characters" in res.stderr, res.stderr


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(2).mean(-1))


def test_dynamic_batch_from_a_batch_one_example_runs_at_batch_three(cli, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ConvNet().eval()
    result = amplite.convert(model, (torch.randn(1, 3, 16, 16),), dynamic_batch=True, precision="bf16")
    assert not [w for w in result.report.data["warnings"] if "stayed static" in w]
    result.save(tmp_path / "api.pt2")
    # the usual user path: the model exported at batch 1 and saved, then `amplite convert --dynamic-batch`
    torch.export.save(torch.export.export(model, (torch.randn(1, 3, 16, 16),)), str(tmp_path / "b1.pt2"))
    res = cli("convert", tmp_path / "b1.pt2", "--dynamic-batch", "-o", tmp_path / "cli.pt2")
    assert res.exit_code == 0, res.stderr
    report = json.loads((tmp_path / "cli.report.json").read_text())
    assert not [w for w in report["warnings"] if "stayed static" in w]
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    out = run_fresh(f"""
        import torch
        from tests.test_zoo_readback import ConvNet
        model = ConvNet().eval()
        model.load_state_dict(torch.load({str(tmp_path / "sd.pt")!r}))
        for name in ("api", "cli"):
            m = torch.export.load({str(tmp_path)!r} + "/" + name + ".pt2").module()
            for b in (3, 1):
                x = torch.randn(b, 3, 16, 16)
                y = m(x).float()
                err = (y - model(x)).abs().max().item()
                print(tuple(y.shape), err < 0.05 * model(x).abs().max().item())
    """)
    assert out.split() == ["(3,", "5)", "True", "(1,", "5)", "True"] * 2


class SqueezesBatch(nn.Module):
    """Branches on the batch size (``squeeze(0)``): traced at batch 2 it is another program."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x.squeeze(0) * 2.0)


def test_a_batch_one_example_the_model_branches_on_keeps_the_batch_one_trace_and_says_why() -> None:
    result = amplite.convert(SqueezesBatch(), (torch.randn(1, 4, 6),), dynamic_batch=True)
    (warning,) = [w for w in result.report.data["warnings"] if "stayed static" in w]
    assert "example size is 1" in warning and "batch >= 2" in warning, warning
    assert result.module()(torch.randn(1, 4, 6)).shape == (4, 6)
