"""ConvertSpec: amplite.convert's options validated once into one typed, frozen value."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import amplite
from amplite.errors import ConfigError
from amplite.policy import Level, Override, RuleSource
from amplite.spec import ConvertSpec, RangeSpec
from fixtures.zoo import make


def test_build_types_every_field_and_the_report_config_is_the_spec(monkeypatch) -> None:
    monkeypatch.delenv("AMPLITE_LEVEL", raising=False)
    spec = ConvertSpec.build(precision="bf16", level="2", keep_fp32=["op:gelu"], dynamic_dims=["x:0"],
                             fuse_contractions="off", range_percentile=99.9)  # fmt: skip
    assert spec.precision is torch.bfloat16 and spec.level is Level.O2 and spec.level_source == "argument"
    assert spec.overrides == (Override("keep_fp32", "op:gelu", RuleSource.USER),)
    assert spec.dims() == {"x": [0]} and spec.fuse is False and spec.fuse_reason == "off (requested)"
    assert spec.policy().low_dtype is torch.bfloat16 and spec.range_rules().percentile == 99.9
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.level = Level.O1  # type: ignore[misc]
    model, inputs = make("mlp")
    result = amplite.convert(model, inputs, precision="bf16", level="2", keep_fp32=["op:gelu"],
                             dynamic_dims=["x:0"], fuse_contractions="off", range_percentile=99.9)  # fmt: skip
    config = result.report.data["config"]
    assert {k: config[k] for k in spec.to_config()} == spec.to_config()


def test_level_source_and_range_rules_follow_the_level(monkeypatch) -> None:
    monkeypatch.setenv("AMPLITE_LEVEL", "O3")
    spec = ConvertSpec.build()
    assert (spec.level, spec.level_source) == (Level.O3, "AMPLITE_LEVEL")
    assert spec.range_rules() is None, "O3 is the speed baseline: no range rules unless asked"
    assert ConvertSpec.build(range_rules=True).range_rules() is not None
    monkeypatch.delenv("AMPLITE_LEVEL")
    assert ConvertSpec.build().level_source == "default" and ConvertSpec.build().range_rules() is not None


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"precision": "fp32"}, "unknown precision 'fp32'"),
        ({"precision": torch.float32}, "unknown precision"),
        ({"level": "O4"}, "unknown level 'O4'"),
        ({"range_percentile": 40.0}, "range percentile 40 is out of range"),
        ({"data_max": -1.0}, "data_max -1.0 is not positive"),
        ({"dynamic_dims": ["x"]}, "cannot parse --dynamic-dim 'x'"),
        ({"fuse_contractions": "sometimes"}, "unknown fuse-contractions choice"),
        ({"keep_fp32": [""]}, "empty override pattern"),
    ],
)
def test_a_bad_value_is_one_config_error_naming_it(kwargs: dict, names: str) -> None:
    with pytest.raises(ConfigError, match=names) as info:
        ConvertSpec.build(**kwargs)
    assert "\n" not in info.value.one_line() and info.value.exit_code == 2


def test_with_overrides_adds_pins_without_touching_the_spec() -> None:
    spec = ConvertSpec.build(keep_fp32=["op:gelu"])
    pinned = spec.with_overrides([Override("keep_fp32", "node:linear", RuleSource.BUDGET)])
    assert len(spec.overrides) == 1 and len(pinned.overrides) == 2
    assert pinned.patterns("keep_fp32") == ["op:gelu", "node:linear"]
    assert pinned.policy().decide("linear.default", "", "linear").source is RuleSource.BUDGET
    assert RangeSpec() == spec.ranges
