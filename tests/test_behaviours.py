"""Behaviours that once had no test: each test here kills a bug that was planted and survived (issue 20).

Every assertion message names the behaviour, so a failure says what the user would lose.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import amplite
import amplite.ops  # registers amplite::contract
from amplite.converter import emit
from amplite.converter.calibration import collect_ranges
from amplite.converter.pipeline import strip_export_checks
from amplite.errors import ConfigError, EmitError
from amplite.levels import precision_dtype, resolve_level, split_precision
from amplite.passes.annotate_precision import AnnotatePrecision
from amplite.passes.base import PassManager
from amplite.passes.cleanup_casts import CleanupCasts
from amplite.passes.graph_utils import cast_dtype
from amplite.passes.insert_casts import InsertCasts
from amplite.passes.meta import PRECISION_KEY, RANGE_KEY
from amplite.passes.range_guard import RangeGuard, RangeRules
from amplite.passes.store_low_params import StoreLowPrecisionParams
from amplite.policy import Level, PrecisionPolicy, make_overrides
from amplite.verify.compare import DEFAULT_TOLERANCES, tensor_metrics

aten = torch.ops.aten
CONTRACT = torch.ops.amplite.contract.default


def _gm(model: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    gm = torch.export.export(model.eval(), args, strict=False).module()
    strip_export_checks(gm)
    return gm


def _plan(gm: torch.fx.GraphModule, policy: PrecisionPolicy, extra: tuple = ()) -> torch.fx.GraphModule:
    gm, _ = PassManager([AnnotatePrecision(policy), InsertCasts(), CleanupCasts(), *extra])(gm)
    return gm


def _precision(gm: torch.fx.GraphModule) -> dict[str, dict]:
    return {n.name: n.meta[PRECISION_KEY] for n in gm.graph.nodes if PRECISION_KEY in n.meta}


# 1. store_low_params: a parameter read both by an FP32 op and through a cast stays FP32.


class SharedNormWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.lin(x)) * self.ln.weight  # ln.weight: read by layer_norm (FP32) and by mul (fp16)


def test_parameter_with_an_fp32_reader_and_a_cast_reader_stays_fp32_at_o2() -> None:
    model = SharedNormWeight().eval()
    x = torch.randn(4, 8)
    gm = _plan(_gm(model, x), PrecisionPolicy("fp16", Level.O2), (StoreLowPrecisionParams(),))
    assert gm.ln.weight.dtype == torch.float32, (
        "store_low_params stored a parameter in fp16 although layer_norm reads it in FP32 (mixed readers)"
    )
    assert gm.lin.weight.dtype == torch.float16, "store_low_params: a weight read only through casts is stored low"
    reader = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    assert any(cast_dtype(a) == torch.float16 for a in reader.args), "the fp16 reader must keep its cast"
    fresh = torch.randn(4, 8)  # other values, the exported (static) shape
    try:
        got = gm(fresh)
    except RuntimeError as exc:  # the bug: layer_norm gets an fp16 weight and an FP32 input
        pytest.fail(f"store_low_params: the converted graph with a mixed-reader parameter crashes: {exc}")
    torch.testing.assert_close(got, model(fresh), atol=2e-2, rtol=2e-2)


# 2. range_guard: a weight beyond fp16's range keeps its reader FP32.


class HugeWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight[0, 0] = 1e5  # inf in fp16; the input it multiplies is tiny, so |y| stays small

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _huge_weight_inputs() -> torch.Tensor:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    x[:, 0] = 1e-6
    return x


def test_weight_beyond_fp16_range_keeps_its_reader_fp32() -> None:
    x = _huge_weight_inputs()
    gm = _gm(HugeWeight(), x)
    ranges = collect_ranges(gm, [((x,), {})])
    RangeGuard(ranges, RangeRules(), torch.float16)(gm)
    linear = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    flag = linear.meta.get(RANGE_KEY, "")
    assert flag.startswith("range:weight-overflow"), f"range_guard did not flag the |w|=1e5 reader: {flag!r}"
    assert "1e+05" in flag, flag
    # bf16 shares FP32's range: no weight rule applies there.
    gm16 = _gm(HugeWeight(), x)
    RangeGuard(ranges, RangeRules(), torch.bfloat16)(gm16)
    assert not [n for n in gm16.graph.nodes if RANGE_KEY in n.meta], "weight rules are fp16 only"


def test_weight_overflow_gives_finite_outputs_end_to_end() -> None:
    model, x = HugeWeight().eval(), _huge_weight_inputs()
    result = amplite.convert(model, (x,), level="O1")
    reasons = {n["node"]: n["reason"] for n in result.report.fp32_nodes}
    assert reasons.get("linear", "").startswith("range:weight-overflow"), f"weight-overflow rule: {reasons}"
    fresh = torch.randn(8, 4)
    fresh[:, 0] = 1e-6
    out = result.module()(fresh)
    assert torch.isfinite(out).all(), "a Linear with |w| = 1e5 produced non-finite outputs in fp16"
    torch.testing.assert_close(out, model(fresh), atol=1e-5, rtol=1e-5)
    off = amplite.convert(model, (x,), level="O1", range_rules=False)
    off_reasons = {n["node"]: n["reason"] for n in off.report.fp32_nodes}
    # without the range rules the weight-overflow reason is gone (guard_constants still keeps a small
    # constant-like weight FP32 at every level, under its own reason)
    assert not off_reasons.get("linear", "").startswith("range:weight-overflow"), off_reasons


# 3. atomic_write: a failed write leaves the user's existing file as it was.


def test_failed_write_leaves_the_existing_file_intact(tmp_path: Path) -> None:
    dest = tmp_path / "model.fp16.pt2"
    dest.write_bytes(b"the user's previous conversion")

    def write(path: str) -> None:
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(EmitError) as info:
        emit.atomic_write(dest, write)
    assert "No space left" in str(info.value)
    assert dest.read_bytes() == b"the user's previous conversion", "atomic_write: a failed write changed the file"
    assert sorted(p.name for p in tmp_path.iterdir()) == [dest.name], "atomic_write left a temporary file behind"


def test_successful_write_replaces_the_file_and_sees_the_final_name(tmp_path: Path) -> None:
    dest = tmp_path / "report.json"
    dest.write_text("old")
    seen = []

    def write(path: str) -> None:
        seen.append(Path(path))
        Path(path).write_text("new")

    assert emit.atomic_write(dest, write) == dest
    assert dest.read_text() == "new"
    assert seen[0].name == dest.name and seen[0] != dest, "the temp file carries the final name, elsewhere"
    assert sorted(p.name for p in tmp_path.iterdir()) == [dest.name]


def test_interrupted_write_is_not_wrapped_and_leaves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "out.pt2"

    def write(path: str) -> None:
        Path(path).write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        emit.atomic_write(dest, write)
    assert list(tmp_path.iterdir()) == [], "an interrupted write left files behind"


# 4. annotate_precision: user overrides beat range rules.


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_force_low_override_beats_a_range_flag() -> None:
    gm = _gm(TwoLinears(), torch.randn(2, 8))
    for n in gm.graph.nodes:
        if n.target is aten.linear.default:
            n.meta[RANGE_KEY] = "range:activation output |x|=1e+03>512"
    policy = PrecisionPolicy("fp16", Level.O1, make_overrides(force_low=["node:linear"]))
    AnnotatePrecision(policy)(gm)
    plan = _precision(gm)
    assert plan["linear"]["mode"] == "low" and plan["linear"]["reason"] == "user:low node:linear", (
        f"a range flag overrode the user's force_low=['node:linear']: {plan['linear']}"
    )
    assert plan["linear_1"] == {
        "mode": "fp32",
        "dtype": torch.float32,
        "reason": "range:activation output |x|=1e+03>512",
        "rule": "range",
    }, "without an override the range flag keeps the node FP32"


def test_force_low_override_beats_range_rules_end_to_end() -> None:
    from fixtures.zoo import make

    model, inputs = make("overflow")
    flagged = amplite.convert(model, inputs, level="O3", range_rules=True)
    assert {n["node"]: n["reason"] for n in flagged.report.fp32_nodes}["pow_1"].startswith("range:")
    forced = amplite.convert(model, inputs, level="O3", range_rules=True, force_low=["node:pow_1"])
    assert "pow_1" not in {n["node"] for n in forced.report.fp32_nodes}, "force_low lost to a range rule"


# 5. cleanup_casts: duplicates are merged per (value, dtype), never across dtypes.


class UserCasts(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.half() * 2, x.bfloat16() * 2, x.to(torch.float16) + 1


def test_casts_of_one_value_to_different_dtypes_are_not_merged() -> None:
    x = torch.randn(3, 5)
    gm = _gm(UserCasts(), x)
    result = CleanupCasts()(gm)
    gm.recompile()
    half, bf16, half2 = gm(x)
    assert (half.dtype, bf16.dtype, half2.dtype) == (torch.float16, torch.bfloat16, torch.float16), (
        "cleanup_casts merged a value's fp16 and bf16 casts (the duplicate key must include the dtype)"
    )
    assert result.counters["duplicates_merged"] == 1, "the two fp16 casts of x are one"
    assert torch.equal(bf16, x.bfloat16() * 2) and torch.equal(half2, x.half() + 1)


# 6. annotate_precision: a normaliser that reaches an FP32 op through one op stays FP32.


class StableExp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (h - h.amax(-1, keepdim=True)).exp()  # amax reaches exp only through sub


class AmaxIntoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.out(h - h.amax(-1, keepdim=True))  # no FP32 op downstream


@pytest.mark.parametrize("level", [Level.O1, Level.O2])
def test_normaliser_feeding_an_fp32_op_through_one_op_stays_fp32(level: Level) -> None:
    gm = _gm(StableExp(), torch.randn(4, 8))
    AnnotatePrecision(PrecisionPolicy("fp16", level))(gm)
    plan = _precision(gm)
    assert plan["amax"]["reason"] == "fp32-list:normaliser-feeds-fp32", (
        f"normaliser propagation: amax in h - h.amax() feeding exp dropped to {plan['amax']}"
    )
    assert plan["amax"]["dtype"] == torch.float32
    if level is Level.O1:  # sub follows its inputs: FP32 once amax is
        assert plan["sub"]["dtype"] == torch.float32, f"normaliser propagation: sub dropped to {plan['sub']}"
    assert plan["exp"]["dtype"] == torch.float32


def test_normaliser_without_an_fp32_consumer_is_not_pinned() -> None:
    gm = _gm(AmaxIntoLinear(), torch.randn(4, 8))
    AnnotatePrecision(PrecisionPolicy("fp16", Level.O1))(gm)
    plan = _precision(gm)
    assert plan["amax"]["reason"] == "follow-inputs" and plan["amax"]["dtype"] == torch.float16, plan["amax"]


# Weak kill 1: the contract op accumulates and scales in FP32 on CPU.


def test_contract_keeps_an_intermediate_beyond_fp16_range() -> None:
    # sum_k a*b = 4 * 200 * 100 = 80000 > 65504: finite only if the sum is not rounded to fp16 before alpha
    # and beta are applied; the result (80000 * 0.25 - 2 * 5000 = 10000) is exact in fp16.
    a = torch.full((2, 4), 200.0, dtype=torch.float16)
    b = torch.full((4, 3), 100.0, dtype=torch.float16)
    c = torch.full((3,), 5000.0, dtype=torch.float16)
    out = CONTRACT("mk,kn->mn", a, b, c, 0.25, -2.0)
    assert torch.isfinite(out).all(), f"contract: the fp16 sum overflowed before scaling (no FP32 accumulation): {out}"
    assert out.dtype == torch.float16 and torch.equal(out, torch.full((2, 3), 10000.0, dtype=torch.float16))
    # beta * c beyond fp16 too: 60000 * 2 = 120000 must be added in FP32, to 80000 - 120000 = -40000.
    c_big = torch.full((3,), 60000.0, dtype=torch.float16)
    out = CONTRACT("mk,kn->mn", a, b, c_big, 1.0, -2.0)
    assert torch.equal(out, torch.full((2, 3), -40000.0, dtype=torch.float16)), f"contract: beta*c in fp16: {out}"


def test_contract_scales_the_unrounded_sum() -> None:
    # 2049 (not an fp16 value; the sum rounds to 2048) times alpha = 1/2049 is 1.0 only from the FP32 sum.
    a = torch.tensor([[2048.0, 1.0]], dtype=torch.float16)
    b = torch.ones(2, 1, dtype=torch.float16)
    out = CONTRACT("mk,kn->mn", a, b, None, 1.0 / 2049, 0.0)
    assert out.item() == 1.0, f"contract: alpha scaled a sum rounded to fp16 ({out.item()} != 1.0)"


# Weak kill 2: SQNR is the reference's norm over the error's.


@pytest.mark.parametrize(("scale", "want_db"), [(0.1, 20 * math.log10(1 / 0.9)), (10.0, 20 * math.log10(1 / 9))])
def test_sqnr_uses_the_reference_as_signal(scale: float, want_db: float) -> None:
    ref = torch.randn(512, generator=torch.Generator().manual_seed(4)).double()
    m = tensor_metrics("o", ref, ref * scale, DEFAULT_TOLERANCES["fp16"])
    # Output norm = 0.1x or 10x the reference's: a signal taken from the wrong tensor is off by 20 dB.
    assert m.sqnr_db == pytest.approx(want_db, abs=0.01), f"SQNR is not |ref| / |out - ref| in dB: {m.sqnr_db}"
    assert m.cosine == pytest.approx(1.0, abs=1e-9) and not m.passed


def test_sqnr_of_a_small_error_on_a_big_signal_and_its_verdict() -> None:
    ref = torch.randn(1000, generator=torch.Generator().manual_seed(5)).double() * 100
    noise = torch.randn(1000, generator=torch.Generator().manual_seed(6)).double()
    noise *= float(ref.norm()) / float(noise.norm()) * 10 ** (-45 / 20)  # exactly 45 dB
    m = tensor_metrics("o", ref, ref + noise, DEFAULT_TOLERANCES["fp16"])
    assert m.sqnr_db == pytest.approx(45.0, abs=1e-6), f"SQNR of a 45 dB perturbation: {m.sqnr_db}"
    assert m.passed, "45 dB passes the fp16 default of 40 dB"
    zeros = tensor_metrics("o", ref * 0, noise, DEFAULT_TOLERANCES["fp16"])
    assert zeros.sqnr_db == -math.inf, "a zero reference with a non-zero error has no SQNR above -inf"
    assert not zeros.passed


def test_low_precision_names_resolve_and_fp32_is_refused_naming_the_choices() -> None:
    assert precision_dtype(" BF16 ") is torch.bfloat16 and precision_dtype(torch.float16) is torch.float16
    with pytest.raises(ConfigError) as info:
        precision_dtype(torch.float32)
    assert "torch.float32" in info.value.problem, "FP32 is not a low precision, even given as a dtype"
    assert info.value.fix.startswith("use one of: ") and info.value.fix.endswith(" fp16, bf16"), info.value.fix


def test_fp8_is_bf16_with_fp8_products_and_an_unknown_name_lists_all_three() -> None:
    assert split_precision(" FP8") == (torch.bfloat16, True)
    assert split_precision(torch.float16) == (torch.float16, False)
    with pytest.raises(ConfigError) as info:
        split_precision("int8")
    assert "'int8'" in info.value.problem, "the problem names the value given"
    assert info.value.fix.startswith("use one of: ") and info.value.fix.endswith(" fp16, bf16, fp8"), info.value.fix


def test_unknown_level_names_the_cli_flag_unless_told_another_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AMPLITE_LEVEL", raising=False)
    with pytest.raises(ConfigError) as info:
        resolve_level("O7")
    assert "'O7'" in info.value.problem and "(from --level)" in info.value.problem, info.value.problem
    with pytest.raises(ConfigError) as info:
        resolve_level("O7", source="level=")
    assert "(from level=)" in info.value.problem, info.value.problem


def test_default_level_is_o2_for_fp8_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AMPLITE_LEVEL", raising=False)
    assert resolve_level(None, " FP8 ") is Level.O2, "fp8 stores its weights in e4m3, as O2 stores them low"
    assert resolve_level(None, "bf16") is Level.O1 and resolve_level(None, torch.float16) is Level.O1
    assert resolve_level(None) is Level.O1
