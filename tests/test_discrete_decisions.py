"""Fidelity for discrete decisions: the producers of values a topk/argmax/sort reads stay FP32 (the
``discrete-decision`` rule), overridable, and verification compares the decisions themselves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amplite
from amplite.verify.layerwise import analyze


class Router(nn.Module):
    """An MoE layer: a linear router, softmax, top-2 experts. Experts 0 and 1 have router rows a hair apart,
    so which of them wins is decided by differences far below fp16's rounding of the logits."""

    def __init__(self, d: int = 32, experts: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))
        with torch.no_grad():
            w = torch.randn(experts, d, generator=g)
            w[1] = w[0] + 1e-4 * torch.randn(d, generator=g)
            w[2:] *= 0.1
            self.router.weight.copy_(w)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = torch.softmax(self.router(x), -1).topk(2, -1)
        outs = torch.stack([e(x) for e in self.experts], 1)
        picked = torch.gather(outs, 1, chosen[..., None].expand(-1, -1, outs.shape[-1]))
        return (weights[..., None] * picked).sum(1), chosen


def _inputs(n: int = 512, seed: int = 1) -> tuple[tuple[torch.Tensor], dict]:
    return (torch.randn(n, 32, generator=torch.Generator().manual_seed(seed)).abs(),), {}


def _plan(result: amplite.ConversionResult) -> dict[str, dict]:
    return {p["node"]: p for p in result.report.data["plan"]}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_router_and_topk_stay_fp32_and_decisions_agree(level: str) -> None:
    model = Router().eval()
    res = amplite.convert(model, _inputs(), level=level)
    plan = _plan(res)
    assert plan["linear"]["dtype"] == "float32" and plan["linear"]["reason"] == "discrete-decision"
    assert plan["topk"]["dtype"] == "float32" and plan["topk"]["reason"] == "discrete-decision"
    assert plan["softmax"]["reason"] == "discrete-decision"  # fidelity (3) is stronger than the op table (5)
    assert plan["linear_1"]["dtype"] == "float16"  # the experts are not decisions: they stay low
    chosen = res.report.outputs[1]
    assert chosen["dtype"] == "int64" and chosen["mismatch"] == 0.0
    other = _inputs(seed=7)  # a batch other than the example
    ref, out = model(*other[0]), res.program.module()(*other[0])
    assert torch.equal(ref[1], out[1])
    lw = analyze(res.original, res.program, res.inputs, res.inputs)
    assert [d["op"] for d in lw.decisions] == ["topk.default"] and lw.decisions[0]["agreement"] == 1.0


def test_force_low_overrides_the_rule_and_the_flips_are_reported(cli, tmp_path) -> None:
    model = Router().eval()
    res = amplite.convert(model, _inputs(), level="O1", force_low=["node:linear"], verify=False)
    assert _plan(res)["linear"]["reason"] == "user:low node:linear"
    lw = analyze(res.original, res.program, res.inputs, res.inputs)
    assert lw.decisions and lw.decisions[0]["agreement"] < 0.99  # fp16 router logits flip experts 0 and 1
    assert "decisions" in lw.to_dict()
    o3 = amplite.convert(model, _inputs(), level="O3", verify=False)
    assert _plan(o3)["linear"]["dtype"] == "float16"  # O3: everything low, no fidelity rule
    path = tmp_path / "router.pt2"
    torch.export.save(torch.export.export(model, *_inputs()), str(path))
    out = cli("check", path, "--force-low", "node:linear", "--report", tmp_path / "rep")
    assert out.exit_code == 1 and "decision topk (topk.default):" in out.stdout
