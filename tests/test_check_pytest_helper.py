"""``amplite.testing``: the assert helper and the pytest fixture users put in their own suites."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fixtures.zoo import make

pytest_plugins = ["amplite.testing"]  # what the `amplite` pytest11 entry point does for installed users


def test_assert_passes_and_returns_the_result() -> None:
    from amplite.testing import assert_mixed_precision_close  # imported by pytest first, as a plugin

    model, inputs = make("mlp")
    res = assert_mixed_precision_close(model, inputs, level="O1", layerwise=False)
    assert res.exit_code == 0 and res.outputs[0].sqnr_db > 40


def test_assert_fails_with_the_culprit() -> None:
    from amplite.testing import assert_mixed_precision_close

    model, inputs = make("overflow")
    with pytest.raises(AssertionError) as info:
        assert_mixed_precision_close(model, inputs, level="O3")
    text = str(info.value)
    assert "fp16 O3" in text and "new_nonfinite<=0" in text
    assert "1. node pow_1" in text and "introduces NaN/Inf" in text and "zoo.py:" in text


def test_fixture_keeps_reports(amplite_check: Callable, tmp_path: Path) -> None:
    model, inputs = make("mlp")
    res = amplite_check(model, inputs, precision="bf16", tolerance=["sqnr>=20"])
    assert res.report.data["config"]["precision"] == "bf16"
    assert (tmp_path / "amplite" / "report.html").is_file()
    with pytest.raises(AssertionError, match="sqnr_db>=200"):
        amplite_check(model, inputs, tolerance=["sqnr>=200"], layerwise=False)
