"""Higher-order ops in forward (issue 44 item 5): grad-mode regions are inlined and converted like the rest of
the graph; control flow (torch.cond) runs its sub-graphs exactly as traced, fed the dtypes they were traced with."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amplite


class NoGradRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():  # export: higher_order.wrap_with_set_grad_enabled(False, submod_1, ...)
            h = self.b(h).relu()
        return self.c(h)


class CondBranch(nn.Module):
    def __init__(self, sign: float) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.sign = sign

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.cond(h.sum() * self.sign > -1e9, lambda t: self.b(t), lambda t: self.c(t), (h,))
        return self.c(h)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_no_grad_region_is_converted_like_the_rest_of_the_graph(precision: str) -> None:
    torch.manual_seed(0)
    res = amplite.convert(NoGradRegion().eval(), (torch.randn(4, 16),), precision=precision, level="O2")
    low = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    linears = {p["module"]: p["dtype"] for p in res.report.data["plan"] if p["op"].startswith("linear")}
    assert linears == {"a": low, "b": low, "c": low}  # b, inside the region, too
    counters = next(p["counters"] for p in res.report.data["passes"] if p["name"] == "inline_regions")
    assert counters.items() >= {"inlined:wrap_with_set_grad_enabled": 1}.items()
    assert res.passed and res.report.data["verification"]["outputs"][0]["sqnr_db"] > 35
    prog = res.program.module()
    assert not [n for n, m in prog.named_children() if isinstance(m, torch.fx.GraphModule)]  # no sub-graph left
    torch.manual_seed(0)
    model, x = NoGradRegion().eval(), torch.randn(4, 16)  # the converted model's weights, other inputs
    with torch.no_grad():
        expected, got = model(x), prog(x).float()
    assert 10 * torch.log10(expected.pow(2).sum() / (got - expected).pow(2).sum()) > 35


@pytest.mark.parametrize("sign", [1.0, -1.0])  # either branch taken
def test_cond_sub_graphs_run_as_traced_under_a_low_precision_parent(sign: float) -> None:
    torch.manual_seed(0)
    model = CondBranch(sign).eval()
    x = torch.randn(4, 16)
    res = amplite.convert(model, (x,), precision="bf16", level="O2")
    assert res.passed, res.report.data["verification"]
    counters = next(p["counters"] for p in res.report.data["passes"] if p["name"] == "inline_regions")
    assert counters["control_flow_kept_fp32"] == 1 and counters["operands_cast"] == 5  # h and b/c's weights
    other = torch.randn(4, 16)
    with torch.no_grad():
        expected, got = model(other), res.program.module()(other).float()
    sqnr = 10 * torch.log10(expected.pow(2).sum() / (got - expected).pow(2).sum())
    assert sqnr > 30
