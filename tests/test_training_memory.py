"""What ``prepare_training`` holds beyond the user's tensors (issue 43 item 8: no heavier than autocast).

autocast holds nothing before its first forward and casts the weights inside each forward; amplite's net
must not hold a second copy of the weights after preparing either: its graphs read the user's own tensors,
and the O2 low-precision copies are cast at the first forward; with ``recast="every_forward"`` the net
drops its references after each forward (autograd keeps what backward needs, freed as backward passes it).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amplite

warnings.filterwarnings("ignore", category=FutureWarning)
pytestmark = pytest.mark.usefixtures("one_thread")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)
        self.norm = nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(F.gelu(self.up(x))))


def _held_bytes(net, model: nn.Module) -> int:
    """Bytes of tensors the net's graphs and low copies hold that are not the user's own tensors."""
    user = {id(t) for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, torch.Tensor] = {}
    for variant in net._variants:
        for gm in {id(g): g for g in (variant.train, variant.eval, variant.flat) if g is not None}.values():
            for mod in gm.modules():
                found = [*mod._parameters.values(), *mod._buffers.values(), *vars(mod).values()]
                seen.update({id(t): t for t in found if isinstance(t, torch.Tensor)})
    seen.update({id(low): low for _, low, _ in net._copies._copies.values() if low is not None})
    return sum(t.nbytes for k, t in seen.items() if k not in user)


@pytest.mark.parametrize("recast", ["every_forward", "on_change"])
def test_prepare_holds_no_second_copy_of_the_weights(recast):
    level = "O2"  # O1 reads every weight through in-graph casts (nothing to hold)
    torch.manual_seed(0)
    model = MLP()
    param_bytes = sum(p.nbytes for p in model.parameters())
    net, opt = amplite.prepare_training(model, torch.optim.AdamW(model.parameters()), torch.randn(8, 64),
                                        level=level, recast=recast)  # fmt: skip
    assert _held_bytes(net, model) <= 0.01 * param_bytes  # bound: 1 % of the FP32 parameter bytes
    loss = net(torch.randn(8, 64)).float().square().mean()
    held = _held_bytes(net, model)
    if recast == "every_forward":  # the forward's copies live only in what autograd saved (freed by backward)
        assert held <= 0.01 * param_bytes
    else:  # kept between forwards: half the FP32 bytes of the weights the graph reads low
        assert held >= 0.45 * param_bytes
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()
    opt.zero_grad()
    after = _held_bytes(net, model)
    assert after <= 0.01 * param_bytes if recast == "every_forward" else after <= 0.51 * param_bytes
    x = torch.randn(8, 64)
    with torch.no_grad():  # the next forward casts again, from the stepped masters
        assert torch.allclose(net(x).float(), model(x), rtol=0.05, atol=0.05)
