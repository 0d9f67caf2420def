"""prepare_training is never silently wrong: input checks on every graph, the user's model as the source of
truth at O2 (freeze, unfreeze, load_state_dict), clipping over net.parameters(), FP32 accumulation with a
plain loss.backward(), gradient checkpointing refused, step-time input errors as AmpliteErrors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import amplite
from amplite.errors import AmpliteError, ConfigError, InputSpecError

warnings.filterwarnings("ignore", category=FutureWarning)


class _MeanBySeq(nn.Module):
    """Divides by the sequence length: a traced size baked into the graph would scale the output."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc(self.emb(ids))))
        return self.head(h.sum(1) / ids.size(1))


class _Mlp(nn.Module):
    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 3)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = checkpoint(self.b, h, use_reentrant=False) if self.ckpt else self.b(h)
        return self.c(torch.relu(h))


def _prep(model, level="O2", precision="bf16", x=None, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amplite.prepare_training(model, opt, torch.randn(4, 8) if x is None else x, precision=precision,
                                    level=level, **kw)  # fmt: skip


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_eval_graph_does_not_run_a_baked_size(level):
    torch.manual_seed(0)
    model = _MeanBySeq()
    net, _ = _prep(model, level, x=torch.randint(0, 50, (2, 16)))
    net.eval()
    model.eval()
    ids = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        out, ref = net(ids), model(ids)
    assert (out - ref).abs().max() < 0.02  # today: off by ~0.19 (16 baked in for 8)
    assert net.graphs == 2 and net.info["retraces"][0]["dynamic"]
    with torch.no_grad():  # a third length runs the dynamic graph, no third trace
        assert (net(ids[:, :5]) - model(ids[:, :5])).abs().max() < 0.02
    assert net.graphs == 2


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_wrong_dtype_is_an_input_error_with_the_fix(mode):
    model = _Mlp()
    net, _ = _prep(model)
    net.train(mode == "train")
    with pytest.raises(InputSpecError, match=r"float64.*traced\s+with float32.*x\.float\(\)"):
        net(torch.randn(4, 8, dtype=torch.float64))


def test_o2_freeze_unfreeze_and_load_state_dict_reach_the_graph():
    torch.manual_seed(0)
    model = _Mlp()
    net, opt = _prep(model)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    # load_state_dict after prepare: the very next forward uses the loaded weights
    other = _Mlp()
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert (net(x) - other(x)).abs().max() < 0.05
    # freeze: a frozen parameter gets no gradient and does not move
    model.a.weight.requires_grad_(False)
    frozen = model.a.weight.clone()
    loss = F.cross_entropy(net(x), y)
    opt.backward(loss)
    assert model.a.weight.grad is None and model.b.weight.grad is not None
    opt.step()
    opt.zero_grad()
    assert torch.equal(model.a.weight, frozen)
    # unfreeze: gradients arrive again, and match FP32's within bf16 error
    model.a.weight.requires_grad_(True)
    ref = copy.deepcopy(model)
    opt.backward(F.cross_entropy(net(x), y))
    F.cross_entropy(ref(x), y).backward()
    assert model.a.weight.grad is not None
    assert torch.allclose(model.a.weight.grad, ref.a.weight.grad, atol=2e-3, rtol=5e-2)


def test_replacing_a_parameter_object_is_refused():
    model = _Mlp()
    net, _ = _prep(model)
    model.a.weight = nn.Parameter(torch.zeros(32, 8))
    with pytest.raises(ConfigError, match=r"'a.weight' was replaced"):
        net(torch.randn(4, 8))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_over_net_parameters_covers_every_gradient(level):
    torch.manual_seed(0)
    model = _Mlp()
    net, opt = _prep(model, level)
    ref = copy.deepcopy(model)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    opt.backward(F.cross_entropy(net(x), y))
    F.cross_entropy(ref(x), y).backward()
    true = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
    assert norm == pytest.approx(true.item(), rel=2e-2)  # today at O2: the norm of part of the gradients
    assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) <= 1e-3 * 1.01


def test_plain_backward_accumulates_micro_batches_in_fp32_masters():
    torch.manual_seed(0)
    model = _Mlp()
    net, _ = _prep(model)
    net.eval()  # deterministic: equal micro-batches give equal gradients
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    F.cross_entropy(net(x), y).backward()
    once = [p.grad.clone() for p in model.parameters()]
    for _ in range(7):
        F.cross_entropy(net(x), y).backward()
    for g, p in zip(once, model.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, 8 * g)  # FP32 sums of identical terms are exact; bf16 would round


def test_gradient_checkpointing_is_refused_with_the_fix():
    model = _Mlp(ckpt=True)
    with pytest.raises(ConfigError, match=r"gradient checkpointing.*gradient_checkpointing_disable"):
        _prep(model)


def test_state_dict_of_net_is_the_model_checkpoint_and_loads_back(tmp_path):
    torch.manual_seed(0)
    model = _Mlp()
    net, opt = _prep(model)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    opt.backward(F.cross_entropy(net(x), y))
    opt.step()
    sd = net.state_dict()
    assert list(sd) == list(model.state_dict()) and all(v.dtype == torch.float32 for v in sd.values())
    torch.save(sd, tmp_path / "net.pt")
    fresh = _Mlp()
    fresh.load_state_dict(torch.load(tmp_path / "net.pt"))  # loads into a plain model
    with torch.no_grad():
        net.eval()
        fresh.eval()
        assert (net(x) - fresh(x)).abs().max() < 0.05
    net2, _ = _prep(_Mlp())
    net2.load_state_dict(torch.load(tmp_path / "net.pt"))  # and into another net
    with torch.no_grad():
        assert torch.equal(net2.eval()(x), net(x))
    with pytest.raises(AmpliteError, match=r"net\.state_dict\(\)"):
        torch.save(net, tmp_path / "whole.pt")
