"""Golden references: save, check against, regenerate explicitly, refuse bad directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import amplite
from amplite.errors import AmpliteError, InputSpecError
from amplite.gate import check, make_golden
from amplite.verify import golden as golden_mod
from fixtures.zoo import make


@pytest.fixture(scope="module")
def mlp_golden(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(model .pt2, converted .pt2, golden directory) for the MLP fixture."""
    d = tmp_path_factory.mktemp("golden")
    model, (args, kwargs) = make("mlp")
    src = d / "mlp.pt2"
    torch.export.save(torch.export.export(model, args, kwargs), str(src))
    conv = d / "mlp.fp16.pt2"
    amplite.convert(src, level="O1", verify=False).save(conv)
    gold = make_golden(src, output=d / "golden", random_batches=3)
    return src, conv, gold


def test_golden_directory_layout(mlp_golden: tuple[Path, Path, Path]) -> None:
    src, _, gold = mlp_golden
    meta = json.loads((gold / "golden.json").read_text())
    assert meta["schema"] == "amplite.golden" and meta["schema_version"] == 1
    assert meta["source"]["sha256"] == golden_mod.file_sha256(src)
    assert len(meta["batches"]) == 3
    loaded = golden_mod.load_golden(gold)
    model, _ = make("mlp")
    for (_, (args, kwargs)), out in zip(loaded.batches, loaded.outputs, strict=True):
        assert torch.allclose(model(*args, **kwargs), out, atol=1e-5)  # outputs are the FP32 model's
    x0, x1 = loaded.batches[0][1][0][0], loaded.batches[1][1][0][0]
    assert not torch.equal(x0, x1)  # seeded random batches differ from each other


def test_golden_round_trip_and_perturbed_weight(mlp_golden: tuple[Path, Path, Path], tmp_path: Path) -> None:
    src, conv, gold = mlp_golden
    ok = check(src, converted=conv, golden=gold, layerwise=False)
    assert ok.exit_code == 0, ok.reasons
    assert ok.report.data["verification"]["batches"] == 3
    assert ok.report.data["golden"]["reference_drift"][0]["sqnr_db"] == "inf"  # the FP32 model is unchanged
    program = torch.export.load(str(conv))
    with torch.no_grad():
        program.state_dict["fc2.weight"][0, 0] += 5.0  # one weight, far beyond fp16 rounding
    bad = tmp_path / "perturbed.pt2"
    torch.export.save(program, str(bad))
    res = check(src, converted=bad, golden=gold, report_dir=tmp_path / "rep")
    assert res.exit_code == 1
    assert any("sqnr_db>=40" in r for r in res.reasons)
    assert res.report.data["layerwise"]["top_introducers"][0]["module"] == "fc2"


def test_golden_is_only_replaced_on_request(mlp_golden: tuple[Path, Path, Path], tmp_path: Path) -> None:
    src, _, _ = mlp_golden
    d = make_golden(src, output=tmp_path / "g")
    with pytest.raises(golden_mod.GoldenError, match=r"already exists.*--update-golden"):
        make_golden(src, output=d)
    first = json.loads((d / "golden.json").read_text())["batches"][0]["inputs"]["sha256"]
    make_golden(src, output=d, update=True, random_batches=1, input_specs=["x:4x32:float32[0,1)"])
    second = json.loads((d / "golden.json").read_text())["batches"][0]["inputs"]["sha256"]
    assert first != second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]  # no temp or backup directory left behind
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(golden_mod.GoldenError, match="not a golden directory"):
        make_golden(src, output=tmp_path / "other", update=True)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_corrupt_and_foreign_golden(mlp_golden: tuple[Path, Path, Path], tmp_path: Path) -> None:
    src, conv, gold = mlp_golden
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in gold.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    data = bytearray((broken / "outputs_001.safetensors").read_bytes())
    data[-4:] = b"\x00\xff\x00\xff"
    (broken / "outputs_001.safetensors").write_bytes(bytes(data))
    with pytest.raises(golden_mod.GoldenError) as info:
        check(src, converted=conv, golden=broken)
    assert info.value.exit_code == 2 and "checksum" in info.value.one_line() and "\n" not in info.value.one_line()
    (broken / "golden.json").write_text("{not json")
    with pytest.raises(golden_mod.GoldenError, match="corrupt"):
        golden_mod.load_golden(broken)
    with pytest.raises(golden_mod.GoldenError, match="does not exist"):
        check(src, converted=conv, golden=tmp_path / "missing")
    emb, emb_inputs = make("embedding")
    foreign = make_golden(emb, emb_inputs, output=tmp_path / "emb")
    with pytest.raises(AmpliteError, match="another model"):
        check(src, converted=conv, golden=foreign)


def test_nan_in_golden_reference_is_an_error(mlp_golden: tuple[Path, Path, Path], tmp_path: Path) -> None:
    src, conv, _ = mlp_golden
    d = make_golden(src, output=tmp_path / "nan")
    path = d / "outputs_000.safetensors"
    tensors = load_file(str(path))
    tensors["0"][0, 0] = float("nan")
    save_file(tensors, str(path))
    meta = json.loads((d / "golden.json").read_text())
    meta["batches"][0]["outputs"]["sha256"] = golden_mod.file_sha256(path)
    (d / "golden.json").write_text(json.dumps(meta))
    with pytest.raises(InputSpecError, match="golden reference output output has 1 NaN"):
        check(src, converted=conv, golden=d)


def test_update_golden_from_check(tmp_path: Path) -> None:
    model, inputs = make("mlp")
    res = check(model, inputs, golden=tmp_path / "g", update_golden=True, level="O1", layerwise=False)
    assert res.exit_code == 0 and res.report.data["golden"]["updated"] is True
    assert (tmp_path / "g" / "golden.json").is_file()
