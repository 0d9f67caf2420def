"""Test helpers for users' own suites: assert that a model survives mixed precision.

::

    from amplite.testing import assert_mixed_precision_close

    def test_model_fp16():
        assert_mixed_precision_close(MyModel().eval(), (torch.randn(2, 16),), level="O1")

    def test_model_bf16(amplite_check):  # the fixture keeps the reports under tmp_path/amplite
        amplite_check(MyModel().eval(), (torch.randn(2, 16),), precision="bf16", tolerance=["sqnr>=30"])

The fixture is registered when pytest loads ``amplite.testing``: ``pytest_plugins = ["amplite.testing"]``
in a conftest.py (there is deliberately no pytest11 entry point: it would import torch in every pytest run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from amplite.gate import CheckResult
    from amplite.verify.compare import Tolerance

__all__ = ["amplite_check", "assert_mixed_precision_close"]


def assert_mixed_precision_close(
    model: Any,
    example_inputs: Any = None,
    *,
    precision: str = "fp16",
    level: str | None = "O1",
    tolerance: Tolerance | Sequence[str] | None = None,
    converted: Any = None,
    data: str | Path | None = None,
    layerwise: bool = True,
    report_dir: str | Path | None = None,
    **options: Any,
) -> CheckResult:
    """Convert ``model`` (or take ``converted``), verify it against FP32, and fail the test if it is off.

    Args:
        model: nn.Module, ExportedProgram or model file.
        example_inputs: As for ``amplite.convert``.
        precision: ``fp16`` or ``bf16``.
        level: ``O0``-``O3`` (default O1).
        tolerance: A Tolerance or ``--tolerance`` strings such as ``["sqnr>=45", "logits:top1>=0.999"]``.
        converted: An already converted .pt2 or ExportedProgram to check instead.
        data: A directory of batches to verify on (default: the example inputs).
        layerwise: Name the nodes that introduce the error in the failure message.
        report_dir: Keep report.json/md/html there.
        **options: Other ``amplite.check``/``amplite.convert`` options (keep_fp32, grad, golden, ...).

    Returns:
        The check result (for further assertions).

    Raises:
        AssertionError: When an output is outside tolerance, with the metrics and the worst nodes.
    """
    from amplite.gate import check

    opts = dict(options)
    if converted is None:
        opts.update(precision=precision, level=level)
    result = check(model, example_inputs, converted=converted, tolerance=tolerance, data=data,
                   layerwise=layerwise, report_dir=report_dir, **opts)  # fmt: skip
    if not result.passed:
        raise AssertionError(failure_message(result.report.data))
    return result


def failure_message(data: dict[str, Any], top_n: int = 3) -> str:
    """A readable failure: what failed, and the nodes that introduce the most error."""
    cfg = data.get("config", {})
    lines = [f"mixed precision ({cfg.get('precision')} {cfg.get('level')}) is not close to FP32:"]
    lines += [f"  - {r}" for r in data.get("check", {}).get("reasons", [])]
    for i, e in enumerate(data.get("layerwise", {}).get("top_introducers", [])[:top_n], 1):
        what = "introduces NaN/Inf" if e["introduces_nonfinite"] else f"isolated SQNR {e['isolated']['sqnr_db']} dB"
        lines.append(f"  {i}. node {e['node']} ({e['op']}) in {e['module'] or '(root)'} at {e['source']}: {what}")
    return "\n".join(lines)


@pytest.fixture
def amplite_check(tmp_path: Path) -> Callable[..., CheckResult]:
    """:func:`assert_mixed_precision_close` with reports written to ``tmp_path / "amplite"``."""

    def run(model: Any, example_inputs: Any = None, **kwargs: Any) -> CheckResult:
        kwargs.setdefault("report_dir", tmp_path / "amplite")
        return assert_mixed_precision_close(model, example_inputs, **kwargs)

    return run
