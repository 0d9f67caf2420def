"""docs/training.md's example script runs as shown (train, checkpoint, resume) and the docs copy matches it."""

from __future__ import annotations

import re
import runpy
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_amplite.py"


def test_docs_show_the_example_script_in_full():
    doc = (ROOT / "docs" / "training.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert SCRIPT.read_text() in blocks


def _run(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runpy.run_path(str(SCRIPT), run_name="__main__")


def test_example_trains_saves_and_resumes(tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "ckpt.pt"
    _run(monkeypatch, "--precision", "fp16", "--level", "O1", "--steps", "2", "--accumulate", "1", "--save", str(ckpt))
    state = torch.load(ckpt)
    assert state["opt"]["amplite"]["scaler"]["scale"] == 2.0**16 and state["opt"]["amplite"]["steps"] == 2
    assert all(v.dtype != torch.float16 for v in state["model"].values())  # the FP32 checkpoint
    _run(monkeypatch, "--precision", "fp16", "--level", "O1", "--steps", "2", "--accumulate", "1",
         "--resume", str(ckpt), "--save", str(tmp_path / "again.pt"))  # fmt: skip
    assert torch.load(tmp_path / "again.pt")["opt"]["amplite"]["steps"] == 4
    assert "eval accuracy" in capsys.readouterr().out
