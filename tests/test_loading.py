"""Loading by content, safe unpickling, and the bad inputs of the loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import amplite
from amplite.converter.inputs import inputs_from_specs, load_inputs_file
from amplite.converter.loading import detect_format, load_model
from amplite.errors import InputSpecError, LoadError


class Payload:
    """Unpickling this object writes a marker file: a stand-in for arbitrary code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def test_malicious_pickle_is_not_executed_without_trust(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"model": Payload(marker)}, path)
    with pytest.raises(LoadError, match="--trust-pickle"):
        load_model(path)
    assert not marker.exists()
    # The payload is real: with trust it runs (and the file then holds no model).
    with pytest.raises(LoadError, match="neither a state dict nor a module"):
        load_model(path, trust_pickle=True)
    assert marker.read_text() == "pwned"


def test_format_is_detected_from_content_not_extension(model_files, tmp_path: Path) -> None:
    files = model_files("mlp")
    for fmt, expected in (("pt2", "pt2"), ("torchscript", "torchscript"), ("state_dict", "torch_zip")):
        renamed = tmp_path / f"model_{fmt}.bin"
        renamed.write_bytes(files[fmt].read_bytes())
        assert detect_format(renamed) == expected


def test_pt2_uses_its_stored_example_inputs(model_files) -> None:
    result = amplite.convert(model_files("mlp")["pt2"])
    assert result.passed and result.report.data["source"]["format"] == "pt2"
    assert result.inputs[0][0].shape == (4, 32)


def test_state_dict_with_factory(model_files) -> None:
    path = model_files("embedding")["state_dict"]
    with pytest.raises(LoadError, match="--model-factory"):
        load_model(path)
    result = amplite.convert(path, inputs_from_specs(["ids:4x12:int64[0,500)"]), model_factory="fixtures.zoo:embedding")
    assert result.passed
    with pytest.raises(LoadError, match=r"does not fit fixtures\.zoo:mlp"):
        load_model(path, model_factory="fixtures.zoo:mlp")
    with pytest.raises(LoadError, match=r"cannot import 'no_such_pkg\.models'"):
        load_model(path, model_factory="no_such_pkg.models:build")


def test_whole_pickle_needs_trust(model_files) -> None:
    path = model_files("cnn")["pickle"]
    with pytest.raises(LoadError, match=r"class fixtures\.zoo\.CNN.*--trust-pickle"):
        load_model(path)
    loaded = load_model(path, trust_pickle=True)
    assert loaded.kind == "pickle" and isinstance(loaded.module, torch.nn.Module)


def test_torchscript_is_converted(model_files) -> None:
    files = model_files("mlp")
    result = amplite.convert(files["torchscript"], load_inputs_file(files["inputs"]))
    assert result.passed and result.report.data["source"]["format"] == "torchscript"
    assert result.report.data["graph"]["after"]["compute_bound_ops_by_dtype"] == {"float16": 2}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        (b"\x13\x37" * 500, "not a model file"),
        ("truncate", "truncated or corrupt zip"),
        ("dir", "is a directory"),
    ],
)
def test_unreadable_files(tmp_path: Path, model_files, content: object, message: str) -> None:
    path = tmp_path / "m.pt2"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "truncate":
        data = model_files("mlp")["pt2"].read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif content == "dir":
        path.mkdir()
    with pytest.raises(LoadError, match=message):
        detect_format(path)


def test_input_specs() -> None:
    _, kw = inputs_from_specs(["x:2x3:float32", "ids:4x5:int64[7,9)", "m:2:bool", "u:3:float16[-1,1]"])
    assert kw["x"].shape == (2, 3) and kw["x"].dtype == torch.float32
    assert kw["ids"].dtype == torch.int64 and set(kw["ids"].unique().tolist()) <= {7, 8}
    assert kw["m"].dtype == torch.bool and kw["u"].dtype == torch.float16 and kw["u"].abs().max() <= 1
    again = inputs_from_specs(["x:2x3:float32"])[1]["x"]
    assert torch.equal(again, kw["x"])  # seeded
    for bad, msg in (
        ("x:2x3", "cannot parse"),
        ("x:2x3:float8", "unknown dtype"),
        ("x:0x3:float32", "positive"),
        ("x:3:int64[5,2)", "empty value range"),
    ):
        with pytest.raises(InputSpecError, match=msg):
            inputs_from_specs([bad])


def test_inputs_files(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.torch import save_file

    t = torch.randn(2, 3)
    torch.save((t, t + 1), tmp_path / "a.pt")
    np.savez(tmp_path / "b.npz", t.numpy())
    save_file({"x": t}, str(tmp_path / "c.safetensors"))
    assert torch.equal(load_inputs_file(tmp_path / "a.pt")[0][1], t + 1)
    assert torch.equal(load_inputs_file(tmp_path / "b.npz")[0][0], t)
    assert torch.equal(load_inputs_file(tmp_path / "c.safetensors")[1]["x"], t)
    torch.save({"obj": Payload(tmp_path / "x")}, tmp_path / "evil.pt")
    with pytest.raises(InputSpecError, match="cannot read inputs file"):
        load_inputs_file(tmp_path / "evil.pt")
    assert not (tmp_path / "x").exists()
