"""Issue 19: constants the low dtype cannot hold, the dtype checker, vanishing activations."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import amplite
from amplite.converter import sequence
from amplite.converter.dtype_check import CheckDtypes
from amplite.errors import InternalError
from amplite.passes.base import PassBase, PassResult
from amplite.passes.graph_utils import make_cast
from amplite.passes.meta import CAST_KEY

CONFIGS = [("fp16", "O1"), ("bf16", "O1"), ("fp16", "O2"), ("bf16", "O2")]


class MaskedAttention(nn.Module):
    """Attention whose padding mask is filled with finfo(float32).min, as transformers models do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) / 4.0
        scores = scores.masked_fill(~mask[:, None, :], torch.finfo(torch.float32).min)
        return self.out(scores.softmax(-1) @ v)


def _saturated(result: amplite.ConversionResult) -> list[dict]:
    record = next(p for p in result.report.data["passes"] if p["name"] == "saturate_fills")
    return record.get("details", {}).get("saturated", [])


@pytest.mark.parametrize(("precision", "level"), CONFIGS)
def test_finfo_min_mask_fill_is_saturated(precision: str, level: str) -> None:
    x = torch.randn(2, 6, 16)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    model = MaskedAttention().eval()
    if precision == "fp16":  # with range rules the fill's |x| keeps it FP32: no saturation needed, and it passes
        default = amplite.convert(model, (x, mask), precision=precision, level=level)
        assert default.passed and not _saturated(default)
        fill = next(e for e in default.report.data["plan"] if e["op"] == "masked_fill.Scalar")
        assert fill["dtype"] == "float32" and fill["reason"].startswith("range:activation")
    result = amplite.convert(model, (x, mask), precision=precision, level=level, range_rules=False)
    assert result.passed, result.report.outputs
    (entry,) = _saturated(result)
    limit = torch.finfo(torch.float16 if precision == "fp16" else torch.bfloat16).max
    assert entry["op"] == "masked_fill.Scalar" and entry["to"] == -limit
    assert entry["from"] == torch.finfo(torch.float32).min
    # Fully masked rows give FP32's uniform distribution too (masking semantics preserved).
    mask[0, :] = False
    got = result.program.module()(x, mask)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, MaskedAttention().eval()(x, mask), atol=0.05, rtol=0.05)


class LargeBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc((self.fc(x) + 1e5) - 1e5)  # 1e5 > fp16's 65504: add and sub must not run in fp16


def test_other_unrepresentable_constant_keeps_its_op_fp32() -> None:
    result = amplite.convert(LargeBias().eval(), torch.randn(4, 8), precision="fp16", level="O2", range_rules=False)
    reasons = {e["node"]: e["reason"] for e in result.report.data["plan"]}
    assert reasons["add"].startswith("range:constant") and reasons["sub"].startswith("range:constant")
    assert result.passed, result.report.outputs
    record = next(p for p in result.report.data["passes"] if p["name"] == "guard_constants")
    assert record["counters"]["kept_fp32:range:constant"] == 2


class EvalDropoutChain(nn.Module):
    """Ops that return their input in eval mode between linears, and an int/int division that makes floats."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1]) / 4  # int / int: float32 whatever the plan says
        h = self.drop(self.a(x) * pos[None, :, None]).clone().contiguous()
        return self.b(self.drop(torch.ops.aten.alias(h)).view(x.shape))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_eval_dropout_chain_converts_at_o2(precision: str) -> None:
    x = torch.randn(2, 5, 16)
    result = amplite.convert(EvalDropoutChain().eval(), x, precision=precision, level="O2")
    assert result.passed, result.report.outputs
    check = next(p for p in result.report.data["passes"] if p["name"] == "check_dtypes")
    assert check["counters"]["nodes_checked"] > 10
    assert "dtype_check" in result.report.data["timings"]
    div = next(e for e in result.report.data["plan"] if e["op"] == "div.Tensor")
    assert div["dtype"] is None and div["reason"] == "no-float-operands"


class _PlantWrongCast(PassBase):
    """A broken pass: retargets the first fp16 cast to fp32 while the plan still says fp16."""

    name = "plant_wrong_cast"

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        for node in gm.graph.nodes:
            src = node.args[0] if node.args else None
            if node.meta.get(CAST_KEY) and node.kwargs.get("dtype") == torch.float16 and src.op != "placeholder":
                with gm.graph.inserting_after(node):
                    wrong = make_cast(gm.graph, node.args[0], torch.float32)
                wrong.meta["val"] = node.meta["val"]  # planned fp16, runs fp32
                node.replace_all_uses_with(wrong)
                gm.graph.erase_node(node)
                return PassResult(gm, True)
        raise AssertionError("no fp16 cast to break")


def _with_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sequence.build_passes
    monkeypatch.setattr(sequence, "build_passes", lambda *a, **k: [*real(*a, **k), _PlantWrongCast()])


def test_checker_reports_a_planted_wrong_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_planted_bug(monkeypatch)
    with pytest.raises(InternalError) as info:
        amplite.convert(EvalDropoutChain().eval(), torch.randn(2, 5, 16), level="O2")
    msg = str(info.value)
    assert info.value.exit_code == 3
    assert "amplite bug" in msg and "planned to produce float16 but produces float32" in msg
    assert "test_constants_and_dtypes.py:" in msg  # the user's source line of the node
    assert "While executing" not in msg and "\n" not in msg


def test_checker_needs_no_user_change_and_cli_exits_3(
    monkeypatch: pytest.MonkeyPatch, cli, model_files, tmp_path: Path
) -> None:
    assert CheckDtypes().name == "check_dtypes"
    _with_planted_bug(monkeypatch)
    res = cli("convert", model_files("transformer")["pt2"], "-o", tmp_path / "t.pt2", "--level", "O2")
    assert res.exit_code == 3, res.stderr
    text = " ".join(res.stderr.split())
    assert text.startswith("internal error:") and "amplite bug" in text and "Traceback" not in text
    assert not list(tmp_path.glob("*"))


class VanishingCNN(nn.Module):
    """A CNN whose activations shrink to ~1e-25, like a randomly initialised MobileNetV2."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.ModuleList(nn.Conv2d(8 if i else 3, 8, 3, padding=1) for i in range(6))
        for conv in self.convs:
            nn.init.normal_(conv.weight, std=1e-4)
            nn.init.zeros_(conv.bias)
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = torch.nn.functional.relu6(conv(x))
        return self.head(x.mean((2, 3)))


def test_vanishing_activations_stay_fp32_in_fp16() -> None:
    model = VanishingCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert 0 < float(model(x).abs().max()) < 1e-15
    result = amplite.convert(model, x, precision="fp16", level="O1")
    assert result.passed, result.report.outputs
    reasons = [e["reason"] for e in result.report.data["plan"]]
    assert sum(r.startswith("range:underflow") for r in reasons) >= 5
    sqnr = result.report.outputs[0]["sqnr_db"]
    assert math.isinf(sqnr) or sqnr > 40


def test_converted_program_failing_at_run_time_is_an_internal_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from amplite.passes import guard_constants

    # Without saturation the fp16 masked_fill fails at run time, which FakeTensor propagation cannot see.
    monkeypatch.setattr(guard_constants.SaturateFills, "_computes_low", lambda self, node: False)
    x, mask = torch.randn(2, 6, 16), torch.ones(2, 6, dtype=torch.bool)
    with pytest.raises(InternalError, match="amplite bug: the converted program fails on the example inputs"):
        amplite.convert(MaskedAttention().eval(), (x, mask), precision="fp16", level="O1", range_rules=False)


def test_a_crashing_pass_is_an_internal_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    class Crash(PassBase):
        name = "crash"

        def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
            raise KeyError("boom")

    real = sequence.build_passes
    monkeypatch.setattr(sequence, "build_passes", lambda *a, **k: [Crash(), *real(*a, **k)])
    with pytest.raises(InternalError, match="amplite bug: pass crash failed: KeyError: 'boom'"):
        amplite.convert(LargeBias().eval(), torch.randn(4, 8))
