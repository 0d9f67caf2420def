"""``model, opt = amplite.prepare_training(model, opt, ...)`` keeps working as a stand-in (issue 43, item 7).

Attribute and method access reach the model, the names are the model's, the optimizer state dict is a torch
optimizer's (plus amplite's key) both ways, ``step(closure)`` returns the loss, ``BatchNorm1d(momentum=None)``
trains, errors speak of arguments, and a re-trace is reported in amplite's words.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amplite
from amplite.errors import AmpliteError
from amplite.passes.meta import PRECISION_KEY

warnings.filterwarnings("ignore", category=FutureWarning)


class _Gpt(nn.Module):
    """A nanoGPT-shaped model: methods the training script calls on the (wrapped) model."""

    def __init__(self) -> None:
        super().__init__()
        self.block_size = 8
        self.wte, self.fc, self.head = nn.Embedding(20, 16), nn.Linear(16, 16), nn.Linear(16, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.wte(ids))))

    def get_num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float) -> float:
        return 6 * self.get_num_params() * fwdbwd_per_iter / dt / 1e12

    def configure_optimizers(self, lr: float) -> torch.optim.Optimizer:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in self.named_parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=lr)


def _ids(n: int = 4) -> torch.Tensor:
    return torch.randint(0, 20, (n, 8), generator=torch.Generator().manual_seed(n))


def test_attributes_methods_and_names_are_the_models():
    torch.manual_seed(0)
    model = _Gpt()
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    optimizer = model.configure_optimizers(1e-3)
    model, _ = amplite.prepare_training(model, optimizer, _ids(), level="O2")  # the idiom: rebinds `model`
    assert model.block_size == 8
    assert model.get_num_params() == sum(p.numel() for p in model.parameters())
    assert model.estimate_mfu(1, 1.0) == pytest.approx(6 * model.get_num_params() / 1e12)
    assert isinstance(model.configure_optimizers(1e-3), torch.optim.AdamW)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == names
    assert [n for n, _ in model.named_buffers()] == []
    with pytest.raises(AttributeError):
        model.no_such_attribute  # noqa: B018


def test_optimizer_state_dict_loads_into_a_plain_optimizer_and_back():
    torch.manual_seed(0)
    model = _Gpt()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    net, opt = amplite.prepare_training(model, plain, _ids(), level="O2")
    for _ in range(2):
        opt.backward(F.cross_entropy(net(_ids()).flatten(0, 1), _ids().flatten()))
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    assert saved["amplite"]["steps"] == 2 and "param_groups" in saved
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(saved)  # a script that loads before (or without) wrapping
    assert torch.equal(fresh.state[model.fc.weight]["exp_avg"], plain.state[model.fc.weight]["exp_avg"])

    # and a plain optimizer's state into the wrapper (after wrapping): the loss scaler and step count stay
    model2 = copy.deepcopy(model)
    _, opt2 = amplite.prepare_training(model2, torch.optim.AdamW(model2.parameters(), lr=1e-3), _ids(), level="O2")
    other = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    other.load_state_dict(saved)
    opt2.load_state_dict(other.state_dict())
    assert torch.equal(opt2.state[model2.fc.weight]["exp_avg"], plain.state[model.fc.weight]["exp_avg"])
    assert opt2.steps == 0
    opt2.load_state_dict({"optimizer": other.state_dict(), "amplite": {"scaler": None, "steps": 5}})  # old layout
    assert opt2.steps == 5
    with pytest.raises(AmpliteError, match="not an optimizer state dict"):
        opt2.load_state_dict({"weights": 1})


def test_step_with_a_closure_returns_the_loss():
    torch.manual_seed(0)
    model = _Gpt()
    net, opt = amplite.prepare_training(model, torch.optim.LBFGS(model.parameters(), max_iter=2), _ids())
    ids = _ids()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(net(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        return loss

    out = opt.step(closure)
    assert isinstance(out, torch.Tensor) and out.dim() == 0 and 2.0 < out.item() < 4.0  # ln(20) ~ 3.0


def test_batchnorm_with_cumulative_average_trains_like_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=None), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    net, _ = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.0), torch.randn(4, 6),
                                        level="O1")  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(16, 6, generator=g) * 3 + 1
        net(x)
        ref(x)
    bn, rbn = model[1], ref[1]
    assert bn.momentum is None and int(bn.num_batches_tracked) == int(rbn.num_batches_tracked) == 5
    # the cumulative mean of 5 batches (not the last batch, not an EMA): bf16 matmul before it, so 2 %
    assert torch.allclose(bn.running_mean, rbn.running_mean, rtol=0.02, atol=0.02)
    assert torch.allclose(bn.running_var, rbn.running_var, rtol=0.02, atol=0.02)
    net.eval()
    before = bn.running_mean.clone()
    net(torch.randn(16, 6))
    assert torch.equal(bn.running_mean, before)  # eval reads the statistics, does not update them


def test_api_errors_name_arguments_not_cli_flags():
    model = _Gpt()
    with pytest.raises(AmpliteError) as err:
        amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), _ids(), level="O7")
    assert "level= argument" in str(err.value) and "--" not in str(err.value)
    with pytest.raises(AmpliteError) as err:
        amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), ((_ids(), _ids()), {}))
    assert "forward(" in str(err.value) and "--input" not in str(err.value)


def test_a_retrace_is_reported_in_amplites_words():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    net, _ = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 5, 8))
    with pytest.warns(UserWarning, match=r"amplite traced graph 2 of at most 8 for this batch: input #0 has size 3 "
                                         r"at dim 1; a graph was traced with that size fixed at 5") as rec:  # fmt: skip
        net(torch.randn(4, 3, 8))
    text = " ".join(str(w.message) for w in rec)
    assert "Dim.DYNAMIC" not in text and "re-export" not in text and "LeafSpec" not in text
    reason = net.info["retraces"][0]["reason"]
    assert reason == "input #0 has size 3 at dim 1; a graph was traced with that size fixed at 5"


def test_a_summed_loss_divided_by_a_token_count_input_stays_fp32_at_o2():
    """transformers' loss with ``num_items_in_batch``: ``cross_entropy(sum) / n`` with ``n`` an FP32 input.
    At O2 the division used to run in bf16 between two casts (the reported loss bf16-rounded, 0.2-0.4 %)."""

    class Lm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 20)

        def forward(self, x: torch.Tensor, y: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            logits = self.fc(x).float()
            return F.cross_entropy(logits, y, reduction="sum") / n.to(logits.device)

    torch.manual_seed(0)
    model = Lm()
    x, y, n = torch.randn(8, 16), torch.randint(0, 20, (8,)), torch.tensor(7.0)
    net, _ = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y, n), level="O2")
    divs = [nd for nd in net.graph_module.graph.nodes if nd.target is torch.ops.aten.div.Tensor]
    assert divs and all(nd.meta[PRECISION_KEY]["dtype"] == torch.float32 for nd in divs)
    loss = net(x, y, n)
    assert loss.dtype == torch.float32
    assert loss.item() != loss.to(torch.bfloat16).float().item()  # not a bf16-rounded value
