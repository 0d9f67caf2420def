"""amplite.prepare_training: train/eval graphs, masters and low copies, loss scaling, resume, errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amplite
from amplite.errors import AmpliteError, ExportError
from amplite.training import TrainingError
from fixtures import train_zoo

warnings.filterwarnings("ignore", category=FutureWarning)


def _setup(name: str, precision: str = "bf16", level: str = "O2", opt_cls=torch.optim.SGD, **opt_kw):
    model, _ = train_zoo.make(name)
    optimizer = opt_cls(model.parameters(), **(opt_kw or {"lr": 0.05, "momentum": 0.9}))
    batches = train_zoo.loader(name, 8)
    net, opt = amplite.prepare_training(model, optimizer, batches[0][0], precision=precision, level=level)
    return model, net, opt, batches


def _step(net, opt, x, y) -> float:
    loss = F.cross_entropy(net(x), y)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("name", ["transformer", "cnn"])
@pytest.mark.parametrize(("precision", "level"), [("bf16", "O1"), ("bf16", "O2"), ("fp16", "O1"), ("fp16", "O2")])
def test_snippet_trains_and_leaves_model_as_fp32_checkpoint(name, precision, level):
    model, _ = train_zoo.make(name)
    before = copy.deepcopy(model.state_dict())
    ref = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    batches = train_zoo.loader(name, 4)
    net, opt = amplite.prepare_training(model, optimizer, batches[0][0], precision=precision, level=level)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "preparing changed the model"
    losses, ref_losses = [], []
    for i, (x, y) in enumerate(batches):
        torch.manual_seed(i)  # the same dropout masks in both runs
        losses.append(_step(net, opt, x, y))
        torch.manual_seed(i)
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=0.02)  # the FP32 run's loss curve, step by step
    sd = model.state_dict()
    assert all(v.dtype == before[k].dtype for k, v in sd.items())  # still the FP32 checkpoint
    assert any(not torch.equal(before[k], v) for k, v in sd.items() if v.is_floating_point())
    low = torch.bfloat16 if precision == "bf16" else torch.float16
    # the net's parameters are the user's at every level; O2 reads cached low-precision casts of them
    assert [id(p) for p in net.parameters()] == [id(p) for p in model.parameters()]
    assert bool(opt.pairs) == (level == "O2") and all(c.dtype == low for c, _ in opt.pairs)


def test_dropout_only_in_train_and_eval_matches_model():
    model, net, _, batches = _setup("transformer", level="O1")
    x = batches[0][0]
    net.train()
    with torch.no_grad():
        assert not torch.equal(net(x), net(x))  # dropout live
        torch.manual_seed(7)
        a = net(x)
        torch.manual_seed(7)
        b = copy.deepcopy(model).train()(x)  # same seed → same dropout mask as the FP32 model
    assert torch.allclose(a, b, atol=0.05, rtol=0.05)
    net.eval()
    assert not net.training
    with torch.no_grad():
        assert torch.equal(net(x), net(x))
        ref = copy.deepcopy(model).eval()(x)
    assert torch.allclose(net(x), ref, atol=0.05, rtol=0.05)
    assert net.info["mode_switch"]["dropout_disabled"] == 2  # after the embedding and after the block


def test_batchnorm_batch_stats_in_train_running_stats_in_eval_and_user_buffers_updated():
    model, net, opt, batches = _setup("cnn", level="O2")
    stats = model.bn1.running_mean.clone(), model.bn1.running_var.clone()
    x, y = batches[0]
    ref = copy.deepcopy(model)
    _step(net, opt, x, y)
    assert int(model.bn1.num_batches_tracked) == 1
    assert not torch.equal(model.bn1.running_mean, stats[0])
    ref.train()(x)  # the FP32 model's running-statistics update on the same batch
    assert torch.allclose(model.bn1.running_mean, ref.bn1.running_mean, atol=1e-2)
    assert torch.allclose(model.bn1.running_var, ref.bn1.running_var, rtol=2e-2)
    # eval: running statistics are read, not updated
    net.eval()
    after = model.bn1.running_mean.clone()
    with torch.no_grad():
        out = net(x)
    assert torch.equal(model.bn1.running_mean, after) and int(model.bn1.num_batches_tracked) == 1
    ref_eval = copy.deepcopy(model).eval()
    with torch.no_grad():
        assert torch.allclose(out, ref_eval(x), atol=0.05, rtol=0.05)
        single = net(x[:1])  # eval BatchNorm does not depend on the rest of the batch
    assert torch.allclose(single, out[:1], atol=1e-2)
    assert net.info["mode_switch"]["batchnorm_to_running_stats"] == 2


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_o2_masters_equal_fp32_optimizer_on_the_same_gradients(precision):
    model, net, opt, batches = _setup("transformer", precision, "O2", torch.optim.Adam, lr=1e-3)
    shadow = copy.deepcopy(model)
    shadow_opt = torch.optim.Adam(shadow.parameters(), lr=1e-3)
    low = torch.bfloat16 if precision == "bf16" else torch.float16
    for x, y in batches[:4]:
        opt.backward(F.cross_entropy(net(x), y))
        opt.unscale_()
        for p, q in zip(model.parameters(), shadow.parameters(), strict=True):
            q.grad = p.grad.clone()  # the (low-precision-born, unscaled) gradients the masters got
        assert opt.step()
        shadow_opt.step()
        opt.zero_grad()
        shadow_opt.zero_grad()
    for p, q in zip(model.parameters(), shadow.parameters(), strict=True):
        assert torch.equal(p, q)
    assert len(opt.pairs) > 0
    for copy_, master in opt.pairs:
        assert copy_.dtype == low and torch.equal(copy_, master.detach().to(low))


def test_fp16_injected_inf_skips_the_step_and_halves_the_scale_then_grows():
    model, net, opt, batches = _setup("cnn", "fp16", "O2")
    assert opt.loss_scale == 2.0**16
    x, y = batches[0]
    opt.backward(F.cross_entropy(net(x), y))
    model.head.weight.grad[0, 0] = float("inf")
    before = copy.deepcopy(model.state_dict())
    assert opt.step() is False
    opt.zero_grad()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if "running" not in k)
    assert opt.loss_scale == 2.0**15 and opt.scaler.skipped == [0]
    opt.scaler.growth_interval = 3
    for x, y in batches[1:4]:
        _step(net, opt, x, y)
    assert opt.loss_scale == 2.0**16 and opt.scaler.history == [2.0**16, 2.0**15, 2.0**15, 2.0**15]


def test_fp16_backward_is_scaled_and_unscale_then_clip_works_on_masters():
    model, net, opt, batches = _setup("transformer", "fp16", "O1")
    shadow = copy.deepcopy(model)
    x, y = batches[0]
    torch.manual_seed(1)
    opt.backward(F.cross_entropy(net(x), y))
    scaled = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    opt.unscale_()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    torch.manual_seed(1)
    F.cross_entropy(shadow(x), y).backward()
    ref = torch.nn.utils.get_total_norm([p.grad for p in shadow.parameters()])
    assert scaled / norm == pytest.approx(2.0**16, rel=1e-3)
    assert norm == pytest.approx(ref.item(), rel=2e-2)
    assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) <= 0.5 + 1e-4
    with pytest.raises(TrainingError, match="twice"):
        opt.unscale_()
    assert opt.step()


def test_gradient_accumulation_adds_in_fp32_masters():
    model, net, opt, batches = _setup("transformer", "bf16", "O2")
    net.eval()  # deterministic forward, so two backwards of one batch give equal gradients
    x, y = batches[0]
    opt.backward(F.cross_entropy(net(x), y))
    once = [p.grad.clone() for p in model.parameters()]
    assert all(c.grad is None for c, _ in opt.pairs)  # moved into the masters
    opt.backward(F.cross_entropy(net(x), y))
    for g, p in zip(once, model.parameters(), strict=True):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, 2 * g)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_checkpoint_and_resume_give_the_same_losses(tmp_path):
    model, net, opt, batches = _setup("cnn", "fp16", "O2", torch.optim.AdamW, lr=1e-3)
    torch.manual_seed(11)
    for x, y in batches[:3]:
        _step(net, opt, x, y)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()},
               tmp_path / "ckpt.pt")  # fmt: skip
    first = [_step(net, opt, x, y) for x, y in batches[3:]]

    state = torch.load(tmp_path / "ckpt.pt")
    model2, _ = train_zoo.make("cnn")
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    net2, opt2 = amplite.prepare_training(model2, optimizer2, batches[0][0], precision="fp16", level="O2")
    model2.load_state_dict(state["model"])  # after prepare: opt.load_state_dict refreshes the low copies
    opt2.load_state_dict(state["opt"])
    assert opt2.loss_scale == opt.scaler.history[3]
    torch.set_rng_state(state["rng"])
    second = [_step(net2, opt2, x, y) for x, y in batches[3:]]
    assert first == second


def test_level_from_environment_and_o3_warns(monkeypatch):
    monkeypatch.setenv("AMPLITE_LEVEL", "O2")
    model, net, opt, _ = _setup("cnn", level=None)
    assert net.info["level"] == "O2" and opt.pairs
    model, _ = train_zoo.make("cnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="without FP32 master"):
        net, opt = amplite.prepare_training(model, optimizer, train_zoo.loader("cnn", 1)[0][0], level="O3")
    x, y = train_zoo.loader("cnn", 1)[0]
    _step(net, opt, x, y)
    for p in model.parameters():  # no FP32 masters: every weight the net holds low is rounded
        if p.dim() > 1:
            assert torch.equal(p, p.to(torch.bfloat16).float())


def test_step_without_backward_under_fp16_is_an_error():
    _model, net, opt, batches = _setup("cnn", "fp16", "O1")
    x, y = batches[0]
    F.cross_entropy(net(x), y).backward()
    with pytest.raises(TrainingError, match=r"opt.step\(\) without opt.backward\(loss\)"):
        opt.step()


def test_optimizer_over_foreign_parameters_is_an_error():
    model, _ = train_zoo.make("cnn")
    other = nn.Linear(3, 3)
    optimizer = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(AmpliteError, match="not a parameter of the model"):
        amplite.prepare_training(model, optimizer, train_zoo.loader("cnn", 1)[0][0])


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.sum() > 0:  # data-dependent branch, only in train mode
            return self.fc(x)
        return x


def test_untraceable_train_mode_forward_names_the_line():
    model = _Untraceable().eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ExportError, match=r"train mode.*test_training.py:\d+") as info:
        amplite.prepare_training(model, optimizer, torch.randn(2, 4))
    assert "x.sum() > 0" in str(info.value)
    assert not model.training  # the user's mode is restored


@pytest.mark.slow  # torch.compile of the graph takes ~100 s on two shared CPU cores
def test_torch_compile_of_net_trains():
    _model, net, opt, batches = _setup("cnn", "bf16", "O2")
    compiled = torch.compile(net)
    losses = []
    for x, y in batches[:3]:
        loss = F.cross_entropy(compiled(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    net.eval()
    x = batches[0][0]
    with torch.no_grad():
        assert torch.allclose(torch.compile(net)(x), net(x), atol=2e-2)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5 if self.training else 0.0)


def test_attention_dropout_is_off_in_eval():
    model = _Attention()
    net, _ = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 8, 16))
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        assert not torch.equal(net(x), net(x))
        net.eval()
        assert torch.equal(net(x), net(x))
        assert torch.allclose(net(x), model.eval()(x), atol=2e-2)
    assert net.info["mode_switch"]["attention_dropout_disabled"] == 1
