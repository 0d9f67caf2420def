"""Runtime casts (issue 17): a GELU-tanh's x³ follows its fp16/bf16 input (``range:small-integer-pow``)
instead of forming an FP32 island, an RMSNorm's x² keeps FP32, and the saved file still matches FP32."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import amplite
from amplite.passes.graph_utils import cast_dtype
from tests import fresh

ROOT = Path(__file__).resolve().parents[1]


class GeluTanhMLP(nn.Module):
    """GPT-2's MLP: linear, GELU written out with ``x ** 3`` (transformers' NewGELU), linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.proj(h)


class RMSNormMLP(nn.Module):
    """A linear into a written-out RMSNorm: ``x.pow(2).mean()`` keeps FP32 squares."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.weight = nn.Linear(32, 32), nn.Parameter(torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


def _inputs() -> tuple[tuple, dict]:
    return (torch.randn(4, 32, generator=torch.Generator().manual_seed(0)),), {}


def _pow_plan(result: amplite.ConversionResult) -> dict:
    return next(p for p in result.report.data["plan"] if p["op"].startswith("pow"))


def _graph_casts(result: amplite.ConversionResult) -> int:
    return sum(cast_dtype(n) is not None for n in result.module().graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gelu_tanh_cube_follows_its_low_input(precision: str, level: str) -> None:
    model, inputs = GeluTanhMLP().eval(), _inputs()
    result = amplite.convert(model, inputs, precision=precision, level=level)
    plan = _pow_plan(result)
    assert (plan["mode"], plan["dtype"], plan["reason"]) == ("follow", precision.replace("fp", "float").replace(
        "bf16", "bfloat16"), "range:small-integer-pow")
    # O1: x, fc.weight, fc.bias, proj.weight, proj.bias down and the output back up; no cast around the GELU
    assert _graph_casts(result) == (6 if level == "O1" else 2)
    guard = next(p for p in result.report.data["passes"] if p["name"] == "range_guard")
    assert guard["counters"]["low_ok:small-integer-pow"] == 1
    assert result.passed
    with torch.no_grad():
        ref, out = model(*inputs[0]), result.module()(*inputs[0])
    sqnr = 20 * math.log10(float(ref.norm() / (ref - out).norm()))
    assert out.dtype == torch.float32 and sqnr > (40 if precision == "fp16" else 25)


def test_without_the_rule_the_cube_is_an_fp32_island() -> None:
    """Pinned FP32 by the user, the cube costs the two casts the rule saves (and says why)."""
    model, inputs = GeluTanhMLP().eval(), _inputs()
    pinned = amplite.convert(model, inputs, keep_fp32=["op:pow"])
    assert _pow_plan(pinned)["mode"] == "fp32" and _graph_casts(pinned) == 8


def test_fp16_cube_without_a_calibrated_range_stays_fp32() -> None:
    model, inputs = GeluTanhMLP().eval(), _inputs()
    result = amplite.convert(model, inputs, range_rules=False)
    assert _pow_plan(result)["reason"] == "fp32-list:transcendental"


def test_fp16_cube_over_the_activation_limit_stays_fp32() -> None:
    model, inputs = GeluTanhMLP().eval(), _inputs()
    result = amplite.convert(model, inputs, data_max=1e-3)
    assert _pow_plan(result)["mode"] == "fp32"


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_rmsnorm_square_keeps_fp32(precision: str) -> None:
    result = amplite.convert(RMSNormMLP().eval(), _inputs(), precision=precision)
    plan = _pow_plan(result)
    assert plan["mode"] == "fp32" and plan["reason"] == "fp32-list:transcendental"


def test_saved_file_matches_in_a_fresh_process(tmp_path: Path) -> None:
    model, inputs = GeluTanhMLP().eval(), _inputs()
    result = amplite.convert(model, inputs, precision="fp16", level="O1")
    path = result.save(tmp_path / "gelu.pt2")
    new = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    torch.save(new, tmp_path / "x.pt")
    code = (
        "import sys, torch; x = torch.load(sys.argv[2]); m = torch.export.load(sys.argv[1]).module()\n"
        "g = [n for n in m.graph.nodes if 'pow' in str(n.target)]\n"
        "assert g and g[0].meta['val'].dtype == torch.float16, g\n"
        "torch.save(m(x), sys.argv[3])"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = fresh.run([sys.executable, "-c", code, str(path), str(tmp_path / "x.pt"), str(tmp_path / "y.pt")],
                     timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = torch.load(tmp_path / "y.pt")
    with torch.no_grad():
        ref = model(new)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=5e-3, rtol=5e-3)
