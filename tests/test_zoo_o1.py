"""Issue 47 item 4: O1 at least torch.autocast's accuracy on the structures where the zoo sweep found it short.

- MViTv2 (mvit_v2_s): a stage transition restarts the residual stream from a low projection, after which every
  add of the stream read two low operands and rounded the stream low at O1. The ``residual-stream`` rule now
  keeps such adds FP32 at O1 too.
- ResNet (resnet18, bf16): BatchNorm at its init has the scale 1/√(1 + 1e-5) = 1 − 5e-6. O1's FP32 ``mul`` by it
  put every low conv output just below a bf16 grid point, so each rounding of a sum of them (the FP32 residual
  stream, read by the next conv) rounded a tie toward zero instead of to even: 1.5 dB below autocast. ``fold_batchnorm``
  now puts a scale the low dtype rounds to 1 into the copied weight where the BatchNorm enters a ReLU'd sum.
- RepViT (repvit_m1): the squeeze-excitation gate, rounded low, is one relative error shared by every position
  of a channel. The ``broadcast-gate`` rule computes it in FP32 at O1.

SQNR is measured on batches of 4–8 and 100 logits: on 2 × 10 logits the same plan's SQNR moved by ±3 dB
between input draws, more than the effects measured here.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.export import ExportedProgram

import amplite
from tests.zoo_models import MViTLike, RepViTBlockNet

pytestmark = pytest.mark.usefixtures("one_thread")

#: O1 may trail CPU torch.autocast by this much (the issue's goal: O1 ≥ autocast − 0.5 dB).
AUTOCAST_MARGIN_DB = 0.5


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return 20 * math.log10(float(ref.norm()) / float((ref - out).norm()))


Export = Callable[[nn.Module, torch.Tensor], ExportedProgram]


@pytest.fixture(scope="module")
def export() -> Export:
    """``export(model, x)``: ``model``'s program, traced once per architecture and input shape in this module.

    The seeds of a test build the same graph with other weights, and tracing is most of a conversion's time:
    each call gets a copy of the architecture's one trace holding ``model``'s parameters and buffers. The key
    is the class, the input shape and the tensors' names and shapes: a constructor argument that changes the
    forward but no tensor needs a class of its own.
    """
    traced: dict[tuple, ExportedProgram] = {}

    def get(model: nn.Module, x: torch.Tensor) -> ExportedProgram:
        state = model.state_dict()
        key = (type(model), tuple(x.shape), tuple((name, tuple(t.shape)) for name, t in state.items()))
        if key not in traced:
            traced[key] = torch.export.export(model, (x,), strict=False)
        program = copy.deepcopy(traced[key])  # the trace holds the first model's own tensors: leave them be
        assert program.state_dict.keys() == state.keys() and not program.constants, "not every tensor is reloaded"
        with torch.no_grad():
            for name, tensor in program.state_dict.items():
                tensor.copy_(state[name])
        return program

    return get


def _o1_and_autocast(
    model: torch.nn.Module, x: torch.Tensor, export: Export | None = None, **kw
) -> tuple[float, float, list[dict]]:
    """O1's and CPU autocast's SQNR against FP32 (bf16, same inputs), and O1's plan (converted from the shared
    trace when ``export`` is given, else from the model)."""
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = _sqnr(ref, model(x).float())
    subject = export(model, x) if export is not None else model
    result = amplite.convert(subject, ((x,), {}), precision="bf16", level="O1", verify=False, **kw)
    with torch.no_grad():
        o1 = _sqnr(ref, result.module()(x).float())
    return o1, autocast, result.report.data["plan"]


@pytest.mark.parametrize("seed", range(4))
def test_o1_keeps_a_restarted_residual_stream_fp32_on_an_mvit_like_model(seed: int, export: Export) -> None:
    """Before the rule, seed 1 gave O1 0.84 dB below autocast (mvit_v2_s: 2.1 dB below); with it every seed is
    within 0.1 dB of autocast or above it."""
    torch.manual_seed(seed)
    model = MViTLike().eval()
    o1, autocast, plan = _o1_and_autocast(model, torch.randn(4, 3, 2, 32, 32), export)
    assert o1 >= autocast - AUTOCAST_MARGIN_DB, (o1, autocast)
    stream = {e["node"]: e for e in plan if e["reason"] == "residual-stream"}
    assert stream and all(e["dtype"] == "float32" and e["rule"] == "structure" for e in stream.values())
    # after the stage transition (block 1's projection, low) every block's two stream adds are kept FP32: the
    # last block's second add is read by the final norm, so it counts too
    late = [e for e in plan if e["op"] == "add.Tensor" and e["module"].startswith(("blocks.2", "blocks.3"))]
    late_stream = [e for e in late if e["node"] in stream]
    assert len(late_stream) == 4 and all(e["dtype"] == "float32" for e in late_stream), late


@pytest.mark.parametrize("seed", range(4))
def test_o1_computes_a_squeeze_excitation_gate_in_fp32_on_a_repvit_like_model(seed: int, export: Export) -> None:
    """O1 ≥ autocast on each seed (before the rule seed 3 was 0.28 dB below it, and O1 gained 0.67 dB on
    average over 8 seeds with the gate FP32); the gate is FP32 by the ``broadcast-gate`` rule."""
    torch.manual_seed(seed)
    model = RepViTBlockNet().eval()
    o1, autocast, plan = _o1_and_autocast(model, torch.randn(8, 3, 64, 64), export)
    assert o1 >= autocast, (o1, autocast)
    gates = [e for e in plan if e["op"] == "sigmoid.default"]
    assert len(gates) == len(model.blocks)
    assert all(e["dtype"] == "float32" and e["reason"] == "broadcast-gate" and e["rule"] == "structure"
               for e in gates), gates  # fmt: skip


class _SiLUByHand(torch.nn.Module):
    """``x * sigmoid(x)``: the mul does not broadcast the sigmoid, so it is no gate."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h * torch.sigmoid(h))


def test_only_a_sigmoid_a_mul_broadcasts_is_a_gate_and_a_pin_beats_the_rule(export: Export) -> None:
    torch.manual_seed(0)
    plan = amplite.convert(_SiLUByHand().eval(), ((torch.randn(4, 16),), {}), precision="bf16", level="O1",
                           verify=False).report.data["plan"]  # fmt: skip
    (silu,) = [e for e in plan if e["op"] == "sigmoid.default"]
    assert silu["reason"] == "follow-inputs" and silu["dtype"] == "bfloat16", silu
    model, x = RepViTBlockNet(depth=1).eval(), torch.randn(2, 3, 32, 32)
    for level, pins, dtype in [("O1", [], "float32"), ("O1", ["op:sigmoid"], "bfloat16"), ("O2", [], "bfloat16")]:
        plan = amplite.convert(export(model, x), ((x,), {}), precision="bf16", level=level, verify=False,
                               force_low=pins).report.data["plan"]  # fmt: skip
        assert {e["dtype"] for e in plan if e["op"] == "sigmoid.default"} == {dtype}, (level, pins)


class _BasicBlock(nn.Module):
    """ResNet's basic block: two conv+BatchNorm, a projection (conv+BatchNorm) where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class _ResNetLike(nn.Module):
    """torchvision's resnet18 in small (4 stages × 2 blocks, 16–128 channels), BatchNorm at its init."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64, 128), classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks += [_BasicBlock(cin, w, 2 if i else 1), _BasicBlock(w, w, 1)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):  # torchvision's init
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


@pytest.mark.parametrize("seed", range(4))
def test_o1_is_within_half_a_db_of_autocast_on_a_resnet_like_model_at_batchnorm_init(seed: int, export: Export) -> None:
    """Before the fix seeds 1 and 2 were 0.90 and 2.71 dB below autocast (6 seeds: −0.97 dB on average); with it
    each of 6 is within 0.4 dB or above (+0.44 on average)."""
    torch.manual_seed(seed)
    model = _ResNetLike().eval()
    o1, autocast, plan = _o1_and_autocast(model, torch.randn(4, 3, 32, 32), export)
    assert o1 >= autocast - AUTOCAST_MARGIN_DB, (o1, autocast)
    # the BatchNorms entering a residual sum have their scale (1 in bf16) in the weight: no FP32 mul; those
    # before a conv keep it
    muls = sorted(e["module"] for e in plan if e["op"] == "mul.Tensor")
    assert muls == sorted(["stem.1"] + [f"blocks.{i}.bn1" for i in range(8)]), muls
    assert [e["dtype"] for e in plan if e["op"] == "conv2d.default"] == ["bfloat16"] * 20
