"""``SavedConversion.exit_code``: 1 when any verification that ran (Torch, ONNX Runtime, AOTInductor) failed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from amplite.report.document import Report
from amplite.save import SavedConversion


def _saved(passed: bool | None, **sections: Any) -> SavedConversion:
    result = SimpleNamespace(passed=passed, report=Report(sections))
    return SavedConversion(result=result, written=[], report_path=Path("report.json"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("passed", "onnx", "aoti", "code"),
    [
        (True, None, None, 0),  # no ONNX, no AOTI written
        (None, None, None, 0),  # verification off
        (False, None, None, 1),
        (True, False, None, 1),
        (True, None, False, 1),
        (True, True, True, 0),
        (True, True, False, 1),
        (True, False, True, 1),
        (True, {}, {}, 0),  # a section without a verdict (the runtime could not run the file) is no failure
    ],
)
def test_exit_code_is_1_when_any_verification_failed(passed: Any, onnx: Any, aoti: Any, code: int) -> None:
    sections = {}
    for key, value in (("verification_onnx", onnx), ("verification_aoti", aoti)):
        if value is not None:
            sections[key] = value if isinstance(value, dict) else {"passed": value}
    assert _saved(passed, **sections).exit_code == code
