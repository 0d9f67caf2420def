"""Architectures of every family convert from sharded checkpoint directories (CI subset of the sweep).

The full sweep (19 architectures x bf16 O2 and fp16 O1) is ``python bench/checkpoint_archs.py``; its table
is in docs/models.md. Here: one or two per family (decoder, MoE, encoder, encoder-decoder), alternating
the two configurations, and the refusal of a constant the meta trace cannot give values to.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.checkpoint_archs import make_checkpoint, run_one

CASES = [("llama", "bf16", "O2"), ("gpt2", "fp16", "O1"), ("mixtral", "bf16", "O2"), ("qwen2_moe", "fp16", "O1"),
         ("bert", "bf16", "O2"), ("t5", "bf16", "O2"), ("gpt_neox", "fp16", "O1"),
         ("falcon", "bf16", "O2")]  # fmt: skip


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's folder of tiny checkpoints (``run_one`` builds ``work / name`` once) and their outputs."""
    return tmp_path_factory.mktemp("archs")


def _source(work: Path, name: str) -> Path:
    """``name``'s tiny checkpoint in ``work``, built if no test of the module has built it yet (read only)."""
    return work / name if (work / name).exists() else make_checkpoint(name, work / name)


@pytest.fixture(scope="module")
def runs(work: Path) -> Callable[[str, str, str], tuple[dict[str, Any], Path]]:
    """``run_one`` once per (architecture, precision, level) in the module, in one folder: a conversion the
    parametrized test and a test of its outputs both read is done once, and an architecture's checkpoint is
    built once for both of its configurations. Returns the row and the folder holding the outputs."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}

    def run(name: str, precision: str, level: str) -> tuple[dict[str, Any], Path]:
        key = (name, precision, level)
        if key not in rows:
            rows[key] = run_one(name, precision, level, work)
        return rows[key], work

    return run


@pytest.mark.parametrize(("name", "precision", "level"), CASES)
def test_architecture_converts_verifies_and_loads_with_from_pretrained(
    runs: Callable, name: str, precision: str, level: str
) -> None:
    row, _ = runs(name, precision, level)
    assert row["exit"] == 0, row.get("error")
    assert row["sqnr_db"] >= (35 if level == "O2" else 55), row
    fp = row["from_pretrained"]
    assert fp["loads"], fp
    if level == "O2":  # the output stores low precision, and from_pretrained loads it as such
        assert row["ratio"] == pytest.approx(0.5, abs=0.02)
        assert fp["dtypes"] == [{"bf16": "bfloat16", "fp16": "float16"}[precision]] and fp["sqnr_db"] >= 35
    else:  # O1 keeps the FP32 masters and says so
        assert row["ratio"] == 1.0 and any("source dtype" in w for w in row["warnings"])
        assert fp["sqnr_db"] > 100  # the weights are the source's, unchanged


def test_moe_experts_are_stored_low_at_o2(runs: Callable) -> None:
    """transformers 5 fuses per-expert weights on load: amplite maps them the same way and stores them low."""
    from safetensors.torch import load_file

    row, work = runs("mixtral", "bf16", "O2")  # the conversion of the parametrized case above
    assert row["exit"] == 0, row.get("error")
    out = work / "mixtral.bf16.O2"
    state = {k: v for s in out.glob("*.safetensors") for k, v in load_file(s).items()}
    experts = [k for k in state if ".experts." in k]
    assert len(experts) == 2 * 4 * 3  # layers x experts x (w1, w2, w3), in the source's layout
    assert {state[k].dtype for k in experts} == {torch.bfloat16}


def test_tied_weights_are_stored_once_in_the_pt2(runs: Callable) -> None:
    row, work = runs("gpt2", "bf16", "O2")  # the gpt2 checkpoint of the fp16 O1 case above
    assert row["exit"] == 0, row.get("error")
    pt2 = work / "gpt2.bf16.O2.pt2"
    with zipfile.ZipFile(pt2) as zf:
        cfg_name = next(n for n in zf.namelist() if n.endswith("weights_config.json"))
        entries = json.loads(zf.read(cfg_name))["config"]
        files = [n for n in zf.namelist() if "/data/weights/weight_" in n]
    assert entries["lm.lm_head.weight"]["path_name"] == entries["lm.transformer.wte.weight"]["path_name"]
    assert len(files) == len(entries) - 1
    ep = torch.export.load(pt2)  # torch reads the shared file for both names
    assert torch.equal(ep.state_dict["lm.lm_head.weight"], ep.state_dict["lm.transformer.wte.weight"])
    assert ep.state_dict["lm.lm_head.weight"].dtype == torch.bfloat16


def test_a_constant_made_from_python_data_leaves_no_pt2_but_the_safetensors_output_is_converted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, work: Path
) -> None:
    """A tensor the forward builds from Python data (GPT-Neo, GraniteMoE; Falcon before transformers 5.25) is
    traced on meta and loses its values: no .pt2 can be written (the warning names the constant), but the
    safetensors output needs no trace: it is converted, verified through from_pretrained, and loads.
    Planted in Llama's RMSNorm so the case does not depend on one release's modelling code."""
    from transformers.models.llama import modeling_llama

    norm = modeling_llama.LlamaRMSNorm.forward

    def with_constant(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return norm(self, hidden) * torch.tensor([1.0], device=hidden.device, dtype=hidden.dtype)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", with_constant)
    shutil.copytree(_source(work, "llama"), tmp_path / "llama")  # the module's llama (run_one reads tmp_path/llama)
    row = run_one("llama", "bf16", "O2", tmp_path)
    assert row["exit"] == 0, row
    assert any("no .pt2" in w and "constant tensor" in w and "lifted_tensor" in w for w in row["warnings"]), row
    assert (tmp_path / "llama.bf16.O2").is_dir() and not (tmp_path / "llama.bf16.O2.pt2").exists()
    fp = row["from_pretrained"]
    assert fp["loads"] and fp["dtypes"] == ["bfloat16"] and fp["sqnr_db"] >= 35, fp
    assert row["ratio"] == pytest.approx(0.5, abs=0.02)


def test_sharded_checkpoints_have_several_shards(work: Path) -> None:
    src = _source(work, "t5")  # the t5 case's checkpoint
    assert len(list(src.glob("*.safetensors"))) >= 3
