"""Every report.json a command writes validates against amplite/schemas/report.schema.json.

Every write is validated when it happens (amplite/report/schema.py, no flag); each test also re-validates
what is on disk, after a JSON round trip, the way a consumer reads it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers

import amplite
from amplite.batch import convert_many
from amplite.errors import InternalError
from amplite.report.schema import report_json, validate_report, write_report
from amplite.save import convert_to_files
from amplite.verify.numbers import decode_float, encode_float
from fixtures import zoo
from fixtures.write_fixtures import write


def _on_disk(path: Path) -> dict:
    doc = json.loads(path.read_text())
    validate_report(doc)
    return doc


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny transformers Llama from a config, saved with save_pretrained (two shards)."""
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                   tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama") / "tiny-llama"
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path, max_shard_size="20KB", safe_serialization=True)
    return path


def test_convert_of_a_module_writes_a_valid_report(tmp_path: Path) -> None:
    model, inputs = zoo.make("mlp")
    result = amplite.convert(model, inputs, level="O1")
    path = result.report.save(tmp_path / "m.report.json")
    doc = _on_disk(path)
    assert doc["source"]["format"] and doc["verification"]["outputs"]


def test_convert_of_a_pt2_writes_a_valid_report(tmp_path: Path) -> None:
    pt2 = write("mlp", tmp_path, ("pt2",))["pt2"]
    saved = convert_to_files(pt2, output=tmp_path / "out.pt2", level="O2")
    doc = _on_disk(saved.report_path)
    assert doc["source"]["format"] == "pt2" and [o["format"] for o in doc["outputs"]] == ["pt2"]


def test_convert_of_a_checkpoint_directory_writes_a_valid_report(llama_dir: Path, tmp_path: Path) -> None:
    saved = convert_to_files(llama_dir, output=tmp_path / "llama.fp16", precision="fp16", level="O1")
    doc = _on_disk(saved.report_path)
    # the keys the schema requires that this path used to leave out
    assert doc["schema"] == "amplite.report" and doc["schema_version"] == 1 and doc["versions"]["torch"]
    assert doc["passes"] and all(isinstance(p["counters"], dict) for p in doc["passes"])
    assert doc["source"]["format"] == "checkpoint"
    out = doc["outputs"][0]
    assert out["format"] == "safetensors" and out["bytes"] == sum(
        f.stat().st_size for f in (tmp_path / "llama.fp16").rglob("*") if f.is_file())
    assert doc["config"]["range_rules"]["data_max"] > 0 and doc["config"]["range_rules_scope"]


def test_check_of_a_checkpoint_directory_writes_a_valid_report(llama_dir: Path, tmp_path: Path) -> None:
    res = amplite.check(llama_dir, precision="bf16", report_dir=tmp_path / "rep")
    doc = _on_disk(res.files["json"])
    assert doc["check"]["exit_code"] == res.exit_code == 0


def test_check_writes_a_valid_report(tmp_path: Path) -> None:
    model, inputs = zoo.make("overflow")
    res = amplite.check(model, inputs, level="O3", report_dir=tmp_path / "rep")
    doc = _on_disk(res.files["json"])
    assert res.exit_code == 1 and doc["check"]["passed"] is False
    assert doc["layerwise"]["top_introducers"][0]["introduces_nonfinite"]


def test_check_train_steps_writes_a_valid_report(tmp_path: Path) -> None:
    model, _ = zoo.make("overflow")
    res = amplite.check(model, zoo.make("overflow")[1], train_steps=3, precision="fp16", level="O3",
                        report_dir=tmp_path / "rep")  # fmt: skip
    doc = _on_disk(res.files["json"])
    t = doc["training"]
    assert res.exit_code == 1 and len(t["amplite_losses"]) == 3
    # non-finite values are the strings of $defs/number, never null or bare Infinity
    assert t["max_gap"] == "inf" and "Infinity" not in res.files["json"].read_text()
    assert all(decode_float(v) is not None for v in t["amplite_losses"])


def test_batch_writes_valid_reports(tmp_path: Path) -> None:
    pt2 = write("mlp", tmp_path, ("pt2",))["pt2"]
    result = convert_many([{"path": str(pt2)}], tmp_path / "out", workers=1)
    assert result.exit_code == 0, [r.row for r in result.results]
    doc = _on_disk(tmp_path / "out" / "mlp" / "report.json")
    assert doc["verification"]["passed"] is True


def _valid_report() -> dict:
    model, inputs = zoo.make("mlp")
    return amplite.convert(model, inputs, level="O1").report.to_dict()  # a writable copy: the tests plant values


def test_a_planted_invalid_report_fails_naming_the_key(tmp_path: Path) -> None:
    data = _valid_report()
    validate_report(data)
    data["verification"]["outputs"][0]["sqnr_db"] = "high"
    with pytest.raises(InternalError, match=r"verification\.outputs\[0\]\.sqnr_db"):
        validate_report(data)
    with pytest.raises(InternalError, match=r"verification\.outputs\[0\]\.sqnr_db"):
        write_report(tmp_path / "r.json", data)
    assert not (tmp_path / "r.json").exists()
    del data["weights"]
    with pytest.raises(InternalError, match="'weights' is a required property"):
        validate_report(data)


def test_non_finite_numbers_are_written_one_way_and_read_back(tmp_path: Path) -> None:
    data = _valid_report()
    out = data["verification"]["outputs"][0]
    out["sqnr_db"], out["max_rel"], out["kl_div"] = math.inf, math.nan, None
    path = write_report(tmp_path / "r.json", data)
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    back = json.loads(text)["verification"]["outputs"][0]
    assert back["sqnr_db"] == "inf" and back["max_rel"] == "nan" and back["kl_div"] is None
    assert decode_float(back["sqnr_db"]) == math.inf and math.isnan(decode_float(back["max_rel"]))
    assert decode_float(back["kl_div"]) is None and decode_float(True) is None
    assert encode_float(-math.inf) == "-inf" and encode_float(1.5) == 1.5
    # a string that is not one of the three is not a number
    out["sqnr_db"] = "nan/inf"
    with pytest.raises(InternalError, match="sqnr_db"):
        validate_report(data)
    assert json.loads(report_json(data))["verification"]["outputs"][0]["sqnr_db"] == "nan/inf"
