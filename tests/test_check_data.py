"""Verification data for ``amplite check``: directories, loaders, random batches, and every bad input."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from amplite.errors import AmpliteError, ConfigError, InputSpecError
from amplite.gate import check
from fixtures.zoo import make


@pytest.fixture(scope="module")
def mlp() -> tuple:
    return make("mlp")


def _one_line(exc: AmpliteError) -> str:
    text = exc.one_line()
    assert "\n" not in text and exc.exit_code == 2
    return text


def test_data_directory_batches_are_aggregated(mlp: tuple, tmp_path: Path) -> None:
    model, _ = mlp
    g = torch.Generator().manual_seed(1)
    torch.save((torch.randn(4, 32, generator=g),), tmp_path / "a.pt")
    np.savez(tmp_path / "b.npz", torch.randn(4, 32, generator=g).numpy())
    save_file({"x": torch.randn(4, 32, generator=g)}, str(tmp_path / "c.safetensors"))
    (tmp_path / "README.txt").write_text("ignored")
    res = check(model, data=tmp_path, level="O1", layerwise=False)
    assert res.exit_code == 0
    v = res.report.data["verification"]
    assert v["batches"] == 3 and v["outputs"][0]["batches"] == 3 and "data directory" in v["inputs"]


def test_empty_or_missing_data_directory(mlp: tuple, tmp_path: Path) -> None:
    model, inputs = mlp
    with pytest.raises(InputSpecError) as info:
        check(model, inputs, data=tmp_path, level="O1")
    assert "no .pt" in _one_line(info.value)
    with pytest.raises(InputSpecError, match="not a directory"):
        check(model, inputs, data=tmp_path / "nope", level="O1")
    (tmp_path / "x.pt").write_bytes(b"garbage")
    with pytest.raises(InputSpecError, match="cannot read inputs file"):
        check(model, inputs, data=tmp_path, level="O1")


@pytest.fixture
def loaders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_loaders.py").write_text(
        textwrap.dedent("""
        import torch

        def good():
            for i in range(4):
                yield torch.randn(4, 32, generator=torch.Generator().manual_seed(i))

        def raises():
            yield torch.randn(4, 32)
            raise RuntimeError("disk on fire")

        def wrong_shape():
            yield torch.randn(4, 31)

        def wrong_name():
            yield {"ids": torch.randn(4, 32)}

        def empty():
            return []

        def not_tensors():
            yield object()
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_loaders"
    sys.modules.pop("my_loaders", None)


def test_data_loader(mlp: tuple, loaders: str) -> None:
    model, inputs = mlp
    res = check(model, inputs, data_loader=f"{loaders}:good", level="O1", layerwise=False, max_batches=3)
    assert res.exit_code == 0 and res.report.data["verification"]["batches"] == 3
    cases = {
        "raises": "disk on fire",
        "wrong_shape": "input 'x' has shape [4, 31], the model takes [4, 32]",
        "wrong_name": "does not fit the model's inputs (x)",
        "empty": "yielded no batches",
        "not_tensors": "not supported",
    }
    for fn, message in cases.items():
        with pytest.raises(InputSpecError) as info:
            check(model, inputs, data_loader=f"{loaders}:{fn}", level="O1", layerwise=False)
        assert message in _one_line(info.value), fn
    with pytest.raises(InputSpecError, match="failed"):
        check(model, inputs, data_loader="no_such_module_xyz:fn", level="O1")
    with pytest.raises(ConfigError, match="both given"):
        check(model, inputs, data_loader=f"{loaders}:good", data=".", level="O1")


def test_random_batches(mlp: tuple) -> None:
    model, inputs = mlp
    res = check(model, inputs, random_batches=4, level="O1", layerwise=False)
    assert res.exit_code == 0 and res.report.data["verification"]["batches"] == 4
    spec = check(model, inputs, random_batches=2, input_specs=["x:4x32:float32[-3,3)"], level="O1", layerwise=False)
    assert spec.report.data["verification"]["inputs"] == "2 seeded random batches"


def test_nan_reference_is_an_error_not_a_pass(tmp_path: Path) -> None:
    class NaNModel(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x)  # NaN for negative inputs, in FP32 as in fp16

    x = torch.tensor([[1.0, -1.0, 2.0]])
    with pytest.raises(InputSpecError) as info:
        check(NaNModel(), (x,), level="O3", report_dir=tmp_path / "r")
    assert "FP32 model output output has 1 NaN" in _one_line(info.value)
    assert not (tmp_path / "r").exists()
