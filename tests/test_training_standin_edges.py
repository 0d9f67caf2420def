"""The training stand-in where models differ from a plain MLP: a weight tied between embedding and head, a
Linear used twice, a buffer, a parameter frozen after ``prepare_training``, an LR scheduler driving ``opt``,
and the fp16 loss scale carried through ``opt.state_dict()``. Each compared with torch's own FP32 training."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amplite

pytestmark = pytest.mark.usefixtures("one_thread")
warnings.filterwarnings("ignore", category=FutureWarning)
IDS = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(2))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(20, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 20, bias=False)
        self.head.weight = self.emb.weight  # one parameter, read by the lookup and by the head
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(self.emb(ids))) * self.scale
        return self.head(h) + self.fc(h).sum(-1, keepdim=True)  # fc read twice


def _loss(out: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), TARGET.flatten())


@pytest.mark.parametrize(("precision", "level", "atol"), [("bf16", "O2", 2e-3), ("fp16", "O2", 3e-4),
                                                          ("fp16", "O1", 3e-4)])  # fmt: skip
def test_a_tied_weight_gets_the_gradient_of_both_readers(precision: str, level: str, atol: float) -> None:
    """Three SGD steps: the tied weight (and the twice-read Linear) follow torch's FP32 training within the
    low dtype's rounding, stay one parameter, and move far more than that tolerance (a reader's gradient
    lost would show)."""
    torch.manual_seed(0)
    ref = _Tied()
    model = copy.deepcopy(ref)
    start = ref.emb.weight.detach().clone()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    net, opt = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.5), (IDS,),
                                        precision=precision, level=level)  # fmt: skip
    for _ in range(3):
        _loss(ref(IDS)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.backward(_loss(net(IDS)))
        assert opt.step() is True
        opt.zero_grad()
    assert model.head.weight is model.emb.weight
    assert (ref.emb.weight - start).abs().max() > 20 * atol
    torch.testing.assert_close(model.emb.weight, ref.emb.weight, rtol=0, atol=atol)
    torch.testing.assert_close(model.fc.weight, ref.fc.weight, rtol=0, atol=4 * atol)
    assert list(net.state_dict()) == list(ref.state_dict())  # the model's names, the tied one and the buffer


def test_a_parameter_frozen_after_prepare_training_stops_moving_at_o2() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 4))
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    net, opt = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), (x,),
                                        precision="bf16", level="O2")  # fmt: skip

    def step() -> None:
        opt.backward(((net(x).float() - y) ** 2).mean())
        opt.step()
        opt.zero_grad()

    step()
    model[0].weight.requires_grad_(False)
    frozen, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    step()
    assert torch.equal(model[0].weight, frozen) and model[0].weight.grad is None
    assert not torch.equal(model[0].bias, bias)  # its neighbour still trains


def test_an_lr_scheduler_on_opt_drives_the_users_optimizer_and_the_step_size() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1, bias=False)
    x = torch.randn(16, 8)
    inner = torch.optim.SGD(model.parameters(), lr=0.2)
    net, opt = amplite.prepare_training(model, inner, (x,), precision="bf16", level="O1")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    moves = []
    for _ in range(2):
        before = model.weight.detach().clone()
        opt.backward(net(x).float().mean())  # d/dw = mean of x: the same gradient each step
        opt.step()
        opt.zero_grad()
        sched.step()
        moves.append((model.weight - before).abs().sum().item())
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    assert moves[1] == pytest.approx(moves[0] / 2, rel=0.02)  # the halved lr halved the step


def test_the_fp16_loss_scale_survives_a_state_dict_round_trip() -> None:
    """A skipped step halves the scale; a new opt loaded from the state dict starts from the halved scale."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x = torch.randn(5, 8)
    net, opt = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), (x,), precision="fp16")
    start = opt.loss_scale
    opt.backward(net(x).float().sum() * float("inf"))
    assert opt.step() is False and opt.loss_scale == start / 2
    opt.zero_grad()
    again = copy.deepcopy(model)
    _, opt2 = amplite.prepare_training(again, torch.optim.SGD(again.parameters(), lr=0.1), (x,), precision="fp16")
    opt2.load_state_dict(opt.state_dict())
    assert opt2.loss_scale == start / 2


class _Flags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, scale: float = 1.0, flip: bool = False) -> torch.Tensor:
        y = self.b(torch.relu(self.a(x))) * scale
        return -y if flip else y


def test_python_arguments_are_honoured_not_baked_into_the_first_trace() -> None:
    """A float or bool argument becomes a constant of the trace: another value must not reuse that graph."""
    torch.manual_seed(0)
    model = _Flags()
    x = torch.randn(4, 8)
    net, _ = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), (x,), precision="bf16",
                                      level="O2")  # fmt: skip
    with torch.no_grad():
        base = net(x).float()
        torch.testing.assert_close(net(x, scale=2.0).float(), 2 * base)
        torch.testing.assert_close(net(x, flip=True).float(), -base)
        torch.testing.assert_close(net(x, 2.0).float(), 2 * base)  # positional, as the model takes it
        with pytest.raises(amplite.AmpliteError) as info:
            net(x.double())
        assert "float64" in info.value.problem and "float32" in info.value.problem and info.value.fix


def test_a_call_that_needs_one_graph_more_than_max_graphs_is_refused_and_the_others_still_run() -> None:
    torch.manual_seed(0)
    model = _Flags()
    x = torch.randn(4, 8)
    net, _ = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), (x,), precision="bf16",
                                      level="O2", max_graphs=2)  # fmt: skip
    with torch.no_grad():
        base = net(x).float()
        torch.testing.assert_close(net(x, scale=2.0).float(), 2 * base)  # graph 2 of 2
        with pytest.raises(amplite.AmpliteError) as info:
            net(x, flip=True)  # a third calling convention
        assert info.value.exit_code == 2 and "max_graphs" in info.value.one_line()
        torch.testing.assert_close(net(x).float(), base)  # the cached graphs still serve their calls
        torch.testing.assert_close(net(x, scale=2.0).float(), 2 * base)
