"""Tests added for mutants that survived ``make mutate`` (docs/testing.md lists them by module).

Each test pins a behaviour the rest of the suite reached but did not check: exact user-facing messages
(the one-line error promise), pattern scoping, small helpers' edge cases.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import types

import pytest
import torch

import amplite.ops  # registers amplite::contract
from amplite.converter.criteria import Criterion, parse_tolerance
from amplite.errors import ConfigError
from amplite.ops import cutensor_backend
from amplite.policy import Level, Override, resolve_level

contract_mod = importlib.import_module("amplite.ops.contract")  # amplite.ops.contract is also the op

# policy


@pytest.mark.parametrize(
    ("pattern", "op", "module", "node", "hit"),
    [
        ("op:linear", "add.Tensor", "", "linear", False),  # an op: pattern never matches node names
        ("op:linear", "linear.default", "", "x", True),
        ("op:linear.default", "linear.default", "", "x", True),
        ("module:enc", "enc.Tensor", "dec", "enc", False),  # nor a module: pattern ops or nodes
        ("module:enc", "add.Tensor", "enc", "x", True),
        ("module:enc.*", "add.Tensor", "enc", "x", True),  # the module itself
        ("module:enc.*", "add.Tensor", "encoder", "x", False),
        ("node:mul_1", "mul_1", "mul_1", "x", False),  # nor a node: pattern ops or modules
        ("node:mul_*", "mul.Tensor", "", "mul_1", True),
        ("linear", "linear.default", "", "x", True),  # unprefixed: op, module or node, any one
        ("enc", "add.Tensor", "enc", "x", True),
        ("mul_1", "add.Tensor", "", "mul_1", True),
        ("enc", "add.Tensor", "", "x", False),  # no module: an empty path matches nothing
    ],
)
def test_override_patterns_match_only_what_their_prefix_names(
    pattern: str, op: str, module: str, node: str, hit: bool
) -> None:
    assert Override("keep_fp32", pattern).matches(op, module, node) is hit, (pattern, op, module, node)


def test_override_kind_and_glob() -> None:
    assert (Override("keep_fp32", "op:softmax").kind, Override("keep_fp32", "op:softmax").glob) == ("op", "softmax")
    assert (Override("keep_fp32", "enc:x").kind, Override("keep_fp32", "enc:x").glob) == ("any", "enc:x")


@pytest.mark.parametrize(
    ("text", "level"), [("0", Level.O0), ("1", Level.O1), ("2", Level.O2), ("3", Level.O3), (" o2 ", Level.O2)]
)
def test_level_accepts_digits_and_lower_case(text: str, level: Level) -> None:
    assert resolve_level(text) is level


def test_level_errors_name_their_source(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_level("O9")
    assert info.value.one_line() == "unknown level 'O9' (from --level) — fix: use one of O0, O1, O2, O3"
    monkeypatch.setenv("AMPLITE_LEVEL", "fast")
    with pytest.raises(ConfigError) as info:
        resolve_level(None)
    assert info.value.one_line() == "unknown level 'fast' (from AMPLITE_LEVEL) — fix: use one of O0, O1, O2, O3"
    monkeypatch.setenv("AMPLITE_LEVEL", "")
    assert resolve_level(None) is Level.O1  # an empty variable is unset
    assert resolve_level(Level.O3) is Level.O3


# criteria


def test_unscoped_criterion_applies_to_every_output() -> None:
    c = Criterion("sqnr_db", ">=", 40.0)
    assert c.applies_to("output") and c.applies_to("output['logits']") and c.applies_to("output[3]")
    scoped = Criterion("sqnr_db", ">=", 40.0, "logits")
    assert scoped.applies_to("output['logits']") and not scoped.applies_to("output['hidden']")


def test_unknown_precision_in_tolerance_names_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        parse_tolerance([], "fp8")
    assert info.value.one_line() == "unknown precision 'fp8' — fix: use fp16 or bf16"


# ops


def test_backend_description_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(contract_mod.ENV_BACKEND, raising=False)
    assert contract_mod.backend_description("cpu") == "torch.einsum on FP32-upcast operands (CPU)"
    monkeypatch.setattr(cutensor_backend, "is_available", lambda: False)
    assert contract_mod.backend_description("cuda") == "torch.einsum (CUDA; nvmath-python not installed or overridden)"
    monkeypatch.setattr(cutensor_backend, "is_available", lambda: True)
    monkeypatch.setattr(cutensor_backend, "nvmath_version", lambda: "9.8.7")
    assert contract_mod.backend_description("cuda:0") == "cutensor (nvmath-python 9.8.7)"


def test_nvmath_version_reads_the_distribution_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []

    def version(name: str) -> str:
        asked.append(name)
        return "1.2.3"

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert cutensor_backend.nvmath_version() == "1.2.3" and asked == ["nvmath-python"]

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cutensor_backend.nvmath_version() == "?"


@pytest.mark.parametrize(("ptr", "align"), [(0, 256), (1, 1), (6, 2), (4096 + 128, 128), (512, 256), (256, 256)])
def test_pointer_alignment_is_the_lowest_set_bit_capped_at_256(ptr: int, align: int) -> None:
    assert cutensor_backend._alignment(types.SimpleNamespace(data_ptr=lambda: ptr)) == align


def test_contract_is_registered() -> None:
    assert amplite.ops is not None and hasattr(torch.ops.amplite, "contract")
