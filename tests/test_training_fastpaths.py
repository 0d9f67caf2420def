"""The performance paths of training keep the numbers: GELU-tanh's x³ low at bf16 (as autocast on CPU runs it),
and the low-copy cast that ``torch.compile`` traces instead of the cache (issue 28, "no slower")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amplite


class _GeluTanhMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.b(h)


def _prep(level: str, precision: str = "bf16"):
    torch.manual_seed(0)
    model = _GeluTanhMlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net, opt = amplite.prepare_training(model, opt, torch.randn(4, 8), precision=precision, level=level)
    return model, net, opt


def _pow_dtypes(net) -> list[torch.dtype]:
    pows = [n for n in net.graph_module.graph.nodes if n.target is torch.ops.aten.pow.Tensor_Scalar]
    return [n.meta["val"].dtype for n in pows]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bf16_small_pow_runs_low_and_matches_autocast(level):
    model, net, _ = _prep(level)
    assert _pow_dtypes(net) == [torch.bfloat16]  # no FP32 island (and its two casts) around x³
    x = torch.randn(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x).float()
    out = net.eval()(x)
    assert out.dtype == torch.float32
    assert torch.allclose(out, ref, atol=3e-2, rtol=3e-2)
    assert (out - model(x)).abs().max() < 0.05  # within bf16 rounding of FP32


def test_fp16_small_pow_stays_fp32_without_calibrated_ranges():
    _, net, _ = _prep("O1", "fp16")
    assert _pow_dtypes(net) == [torch.float32]


def test_compiled_low_copy_path_gives_the_cached_copy_and_fp32_gradients(monkeypatch):
    model, net, _ = _prep("O2")
    net.eval()
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    F.cross_entropy(net(x), y).backward()
    eager = [p.grad.clone() for p in model.parameters()]
    out_eager = net(x).detach()
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = net(x)
    F.cross_entropy(out, y).backward()
    assert torch.equal(out.detach(), out_eager)
    for g, p in zip(eager, model.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, g)
