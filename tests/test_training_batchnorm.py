"""Training BatchNorm reads the low-precision activation and keeps FP32 statistics (issue 43 item 8).

As under CPU autocast and cuDNN: in the bf16/fp16 training graph ``batch_norm`` takes the low activation and
the user's own FP32 weight, bias and running statistics, and returns the low dtype, so a ResNet's
conv → BN → ReLU → add chain runs low instead of FP32 between casts.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amplite

warnings.filterwarnings("ignore", category=FutureWarning)
pytestmark = pytest.mark.usefixtures("one_thread")
_BN = torch.ops.aten.batch_norm.default


class Block(nn.Module):
    """A ResNet basic block: conv → BN → ReLU → conv → BN, plus the identity, then ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


class ResNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(Block(8), Block(8))
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


def _model() -> ResNetLike:
    torch.manual_seed(0)
    return ResNetLike().train()


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 8, 8, generator=g) for _ in range(n)]


def _casts(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target is torch.ops.aten._to_copy.default for n in gm.graph.nodes)


def _bn_nodes(net) -> list[torch.fx.Node]:
    return [n for n in net.graph_module.graph.nodes if n.op == "call_function" and n.target is _BN]


def _attr(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor:
    path, _, attr = str(node.target).rpartition(".")
    return getattr(gm.get_submodule(path) if path else gm, attr)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_batchnorm_reads_low_input_and_the_users_fp32_statistics(level):
    model = _model()
    net, _ = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1)[0],
                                      level=level)  # fmt: skip
    gm, bns = net.graph_module, _bn_nodes(net)
    assert len(bns) == 5
    user = {id(t) for t in (*model.parameters(), *model.buffers())}
    for bn in bns:
        assert bn.args[0].meta["val"].dtype == torch.bfloat16  # the conv's low output, no cast up
        assert bn.meta["val"].dtype == torch.bfloat16
        for slot in bn.args[1:5]:  # weight, bias, running_mean, running_var: the user's FP32 tensors themselves
            assert slot.op == "get_attr" and id(_attr(gm, slot)) in user and _attr(gm, slot).dtype == torch.float32
    assert net.info["batchnorm"]["batchnorm_low_input"] == 5


@pytest.mark.parametrize(("level", "before", "after"), [("O1", 19, 11), ("O2", 14, 4)])
def test_low_input_batchnorm_removes_the_fp32_islands(level, before, after):
    # keep_fp32 on the BatchNorms gives the previous plan (BN FP32, so conv → BN → ReLU → add ran FP32)
    counts = {}
    for keep in ((), ("op:batch_norm*",)):
        model = _model()
        net, _ = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1)[0],
                                          level=level, keep_fp32=keep)  # fmt: skip
        counts[bool(keep)] = _casts(net.graph_module)
        dtypes = {bn.args[0].meta["val"].dtype for bn in _bn_nodes(net)}
        assert dtypes == ({torch.float32} if keep else {torch.bfloat16})  # a user's keep_fp32 still wins
    assert (counts[True], counts[False]) == (before, after)


def test_running_statistics_and_gradients_match_fp32_and_autocast():
    model = _model()
    ref, auto = copy.deepcopy(model), copy.deepcopy(model)
    net, opt = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.05), _batches(1)[0],
                                        level="O1")  # fmt: skip
    assert {bn.args[0].meta["val"].dtype for bn in _bn_nodes(net)} == {torch.bfloat16}
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, auto)]
    for i, x in enumerate(_batches(4)):
        target = torch.arange(4) % 5
        loss = F.cross_entropy(net(x).float(), target)
        loss.backward()
        F.cross_entropy(ref(x), target).backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = auto(x)
        F.cross_entropy(out.float(), target).backward()
        if i == 0:  # the first step's gradients, from the same weights: autocast's, within bf16 rounding
            for (name, p), a in zip(model.named_parameters(), auto.parameters(), strict=True):
                assert p.grad.dtype == torch.float32
                # bf16 activations move a 3x3-conv gradient by ~10 % of its scale from FP32's in both runs
                assert (p.grad - a.grad).abs().max() <= 0.03 * a.grad.abs().max(), name
        opt.step()
        opt.zero_grad()
        for o in opts:
            o.step()
            o.zero_grad()
    for (name, b), r in zip(model.named_buffers(), ref.buffers(), strict=True):
        assert b.dtype == r.dtype
        if b.is_floating_point():  # running_mean / running_var: the FP32 run's, within bf16 input rounding
            assert torch.allclose(b, r, rtol=0.02, atol=2e-3), name
        else:
            assert torch.equal(b, r), name  # num_batches_tracked counted 4 steps
    assert model.stem[1].num_batches_tracked.item() == 4
    net.eval()
    x = _batches(1)[0]
    with torch.no_grad():
        assert torch.allclose(net(x), ref.eval()(x), rtol=0.05, atol=0.02)  # eval reads the running statistics


class SharedScale(nn.Module):
    """The BatchNorm's weight is also read by another op (the low copy stays for that reader)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x)).mean((2, 3))
        return self.fc(y) * self.bn.weight


def test_batchnorm_weight_shared_with_another_op_stays_the_users_tensor_at_o2():
    torch.manual_seed(0)
    model = SharedScale().train()
    ref = copy.deepcopy(model)
    net, opt = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.05), _batches(1)[0],
                                        level="O2")  # fmt: skip
    (bn,) = _bn_nodes(net)
    assert bn.args[0].meta["val"].dtype == torch.bfloat16
    assert _attr(net.graph_module, bn.args[1]) is model.bn.weight
    assert _attr(net.graph_module, bn.args[3]) is model.bn.running_mean
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x in _batches(3):
        net(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert torch.allclose(model.bn.running_mean, ref.bn.running_mean, rtol=0.02, atol=2e-3)
    assert torch.allclose(model.bn.running_var, ref.bn.running_var, rtol=0.02, atol=2e-3)
    assert torch.allclose(model.bn.weight, ref.bn.weight, rtol=0.02, atol=2e-3)  # trained through both readers
