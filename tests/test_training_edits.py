"""Changes to the model after prepare_training are followed or refused at the next call (issue 43, items 1, 3).

Item 1: at O2 every way of changing a weight is seen by the next forward, ``.data`` edits included (they do
not bump the version counter the cache was keyed on). Item 3: the model's own train/eval mode is followed;
a new dropout rate, a hook registered later, a submodule added (and given to the optimizer), a per-module
mode are refused with the fix. Tiny MLPs, a few ms per call.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import amplite
from amplite.errors import AmpliteError, ConfigError

warnings.filterwarnings("ignore", category=FutureWarning)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(8, 32), nn.Dropout(0.0), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


def _prep(level: str = "O2", **kw):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net, aopt = amplite.prepare_training(model, opt, torch.randn(4, 8), level=level, **kw)
    return model, net, aopt


def _ema(p: torch.Tensor) -> None:
    p.data.mul_(0.5).add_(torch.ones_like(p.data), alpha=0.5)


def _assign(p: torch.Tensor) -> None:
    p.data = p.data * 3.0  # new storage through .data


def _no_grad_inplace(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.mul_(3.0)


def _copy(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.copy_(torch.randn_like(p))


EDITS = {
    "data_clamp": lambda p: p.data.clamp_(-0.01, 0.01),  # WGAN clipping
    "data_ema": _ema,
    "data_assign": _assign,
    "no_grad_inplace": _no_grad_inplace,
    "copy": _copy,
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_every_weight_edit_reaches_the_next_forward_at_o2(edit):
    model, net, opt = _prep("O2")
    x = torch.randn(6, 8)
    loss = net(x).square().mean()
    opt.backward(loss)
    opt.step()
    net(x)  # the copies are current after the step
    for p in (model.a.weight, model.b.weight):
        EDITS[edit](p)
    want = model(x)
    got = net(x)
    # bf16 weights and activations: within 2 % of the output scale; a stale copy is off by the edit itself
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item() + 1e-3
    assert opt.pairs and all(torch.equal(low, m.detach().to(low.dtype)) for low, m in opt.pairs)


def test_load_state_dict_into_the_model_reaches_the_next_forward():
    model, net, _ = _prep("O2")
    x = torch.randn(6, 8)
    net(x)
    other = _Net()
    model.load_state_dict(other.state_dict())
    want, got = other(x), net(x)
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item() + 1e-3


def test_on_change_mode_trusts_the_version_counter_and_refresh_catches_up():
    model, net, opt = _prep("O2", recast="on_change")
    x = torch.randn(6, 8)
    before = net(x).detach()
    model.a.weight.data.mul_(4.0)  # invisible to the version counter: on_change keeps the old copy
    assert torch.equal(net(x).detach(), before)
    opt.refresh()
    assert not torch.equal(net(x).detach(), before)
    with pytest.raises(ConfigError, match="recast="):
        _prep("O2", recast="sometimes")


def test_model_eval_and_train_on_the_held_model_are_followed():
    model, net, _ = _prep("O1")
    model.drop.p = 0.0
    x = torch.randn(5, 8)
    model.eval()
    net(x)
    assert not net.training
    model.train()
    net(x)
    assert net.training
    net.eval()  # and the net's switch sets the model's mode
    assert not model.training and not model.a.training


def test_model_eval_switches_dropout_off_in_the_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net, _ = amplite.prepare_training(model, opt, torch.randn(4, 8), level="O1")
    x = torch.randn(4, 8)
    model.eval()
    with torch.no_grad():
        assert torch.equal(net(x), net(x))  # no dropout: deterministic
        assert torch.allclose(net(x), model(x), atol=0.05, rtol=0.05)


def test_a_changed_dropout_rate_is_refused_with_the_fix():
    model, net, _ = _prep("O1")
    model.drop.p = 0.3
    with pytest.raises(ConfigError, match=r"drop\.p changed from 0\.0 to 0\.3.*call prepare_training again"):
        net(torch.randn(4, 8))


@pytest.mark.parametrize("where", ["model", "submodule"])
def test_a_forward_hook_registered_later_is_refused(where):
    model, net, _ = _prep("O1")
    target = model if where == "model" else model.a
    handle = target.register_forward_hook(lambda m, i, o: o * 2)
    name = "'model'" if where == "model" else "'a'"
    with pytest.raises(ConfigError, match=f"forward hook was registered on .*{name}.*register hooks before"):
        net(torch.randn(4, 8))
    handle.remove()
    net(torch.randn(4, 8))  # back to the traced model: runs


def test_a_global_forward_hook_registered_later_is_refused():
    _, net, _ = _prep("O1")
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        with pytest.raises(ConfigError, match="global module hook"):
            net(torch.randn(4, 8))
    finally:
        handle.remove()


def test_a_submodule_added_and_given_to_the_optimizer_is_refused():
    model, net, opt = _prep("O2")
    model.extra = nn.Linear(3, 3)
    with pytest.raises(AmpliteError, match=r"'extra.weight' was added to the model after prepare_training"):
        opt.add_param_group({"params": model.extra.parameters()})
    with pytest.raises(ConfigError, match="submodule of 'model' was added"):
        net(torch.randn(4, 8))


def test_a_per_module_mode_is_refused():
    model, net, _ = _prep("O1")
    model.a.eval()
    with pytest.raises(ConfigError, match=r"submodule 'a' is in eval mode while the model is in train mode"):
        net(torch.randn(4, 8))


def test_o2_copies_hold_no_memory_between_the_step_and_the_next_forward():
    import gc
    import weakref

    model, net, opt = _prep("O2")
    x = torch.randn(6, 8)
    opt.backward(net(x).square().mean())
    held = [weakref.ref(low) for low, _ in opt.pairs]
    assert held
    opt.step()
    gc.collect()
    assert all(r() is None for r in held)  # released at the step (recast at the next forward anyway)
    want = model(x)
    assert (net(x) - want).abs().max().item() <= 0.02 * want.abs().max().item() + 1e-3
