"""``amplite.convert(DIR)`` returns a result used like a module's (issue 29): ``.save``, ``.report``, ``.passed``,
and a ``.module()`` that says what to do instead of returning meta weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import amplite  # noqa: E402
from amplite.errors import ConfigError  # noqa: E402
from tests.test_checkpoint import _config, _ids  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama-api") / "tiny-llama"
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(_config()).eval().save_pretrained(path, max_shard_size="40KB")
    return path


def test_save_writes_verifies_and_records_both_formats(ckpt: Path, tmp_path: Path) -> None:
    result = amplite.convert(ckpt, precision="bf16", level="O2")
    assert result.passed is None
    pt2 = result.save(tmp_path / "llama.bf16.pt2")
    assert result.passed is True and result.report.data["verification"]["passed"] is True
    out_dir = result.save(tmp_path / "llama-bf16")
    assert [e["format"] for e in result.report.data["outputs"]] == ["pt2", "safetensors"]

    # what was written is what users load: the .pt2 program and from_pretrained agree with the FP32 model
    ref = transformers.LlamaForCausalLM.from_pretrained(ckpt).eval()
    loaded = transformers.LlamaForCausalLM.from_pretrained(out_dir).eval()
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids = _ids(5)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got_dir = loaded(input_ids=ids).logits.float()
        got_pt2 = torch.export.load(str(pt2)).module()(ids).float()
    for got in (got_dir, got_pt2):
        rel = (got - want).norm() / want.norm()
        assert rel < 0.05, rel  # bf16 weights: close to FP32, and not an FP32 copy
    assert not torch.equal(got_pt2, want)
    json.dumps(result.report.data)  # the report stays serialisable
    # both outputs record the spec whole: a checkpoint's (level O2 by default, the wrapper's module prefix)
    from amplite.converter.emit import read_conversion

    assert read_conversion(pt2).spec == result.spec  # type: ignore[union-attr]
    assert (result.spec.path, result.spec.level, result.spec.precision) == ("checkpoint", amplite.Level.O2,
                                                                             torch.bfloat16)  # fmt: skip
    assert json.loads((out_dir / "amplite-plan.json").read_text())["spec"] == result.spec.to_json()


def test_module_names_the_way_to_a_module_and_bad_formats_are_refused(ckpt: Path, tmp_path: Path) -> None:
    result = amplite.convert(ckpt, precision="fp16", level="O1")
    with pytest.raises(ConfigError, match=r"no in-memory module.*fix: result\.save\(DIR\).*torch\.export\.load"):
        result.module()
    with pytest.raises(ConfigError, match="onnx"):
        result.save(tmp_path / "m.onnx", format="onnx")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize(
    ("option", "value"),
    [("fuse_contractions", True), ("dynamic_batch", True), ("data_max", 100.0), ("calibration", "x")],
)
def test_an_option_a_streamed_directory_would_ignore_is_refused(ckpt: Path, tmp_path: Path, option: str,
                                                                value: object, cli) -> None:  # fmt: skip
    """The API and the CLI refuse (one line, exit 2) what a checkpoint directory has no use for, naming it;
    nothing is written."""
    with pytest.raises(ConfigError, match=rf"{option} does not apply to a checkpoint directory"):
        amplite.convert(ckpt, **{option: value})
    flag = {"fuse_contractions": ["--fuse-contractions"], "dynamic_batch": ["--dynamic-batch"],
            "data_max": ["--data-max", "100"], "calibration": ["--calib", str(tmp_path)]}[option]  # fmt: skip
    res = cli("convert", ckpt, "-o", tmp_path / "out", *flag)
    assert res.exit_code == 2 and "not apply to a checkpoint directory" in res.stderr  # type: ignore[attr-defined]
    assert not (tmp_path / "out").exists()
