"""Range rules: calibrated ranges keep FP32 what would overflow or lose too much in low precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amplite
from amplite.converter.calibration import ValueRange, collect_ranges
from amplite.converter.pipeline import strip_export_checks
from amplite.passes.range_guard import RangeGuard, RangeRules
from fixtures.zoo import make


def test_overflow_fixture_is_finite_only_with_range_rules() -> None:
    model, inputs = make("overflow")
    off = amplite.convert(model, inputs, level="O3", range_rules=False)
    assert off.report.outputs[0]["out_nonfinite"] > 0 and off.passed is False
    on = amplite.convert(model, inputs, level="O3", range_rules=True)
    assert on.report.outputs[0]["out_nonfinite"] == 0 and on.passed
    reasons = {n["node"]: n["reason"] for n in on.report.fp32_nodes}
    assert reasons["pow_1"].startswith("range:activation output")
    assert reasons["layer_norm"].startswith("range:activation input pow_1")
    assert on.report.data["config"]["range_rules"]["data_max"] == 512.0
    record = next(p for p in on.report.data["passes"] if p["name"] == "range_guard")
    assert record["counters"]["kept_fp32:range:activation"] == 2


def test_range_reasons_win_over_table_reasons_when_both_say_fp32() -> None:
    """The stronger layer reports the decision (range, priority 2, before the op table, 5)."""
    model, inputs = make("overflow")
    entries = {n["node"]: n for n in amplite.convert(model, inputs, level="O1").report.fp32_nodes}
    assert entries["pow_1"]["reason"].startswith("range:activation output") and entries["pow_1"]["rule"] == "range"


def test_data_max_is_configurable_and_bf16_ignores_activation_rules() -> None:
    model, inputs = make("overflow")
    strict = amplite.convert(model, inputs, level="O2", data_max=1.0)
    flagged = [n for n in strict.report.fp32_nodes if n["reason"].startswith("range:")]
    assert len(flagged) > 2  # the big linear (|h| ~ 500) is now kept FP32 as well
    bf16 = amplite.convert(model, inputs, level="O3", precision="bf16", range_rules=True)
    assert not [n for n in bf16.report.fp32_nodes if n["reason"].startswith("range:activation")]
    assert bf16.report.outputs[0]["out_nonfinite"] == 0  # bf16 has FP32's range


class TinyWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        with torch.no_grad():
            self.b.weight.mul_(1e-7)  # every weight flushes to zero in fp16
            self.b.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + 1e6 * self.b(x)


def test_weights_that_flush_to_zero_keep_their_reader_fp32() -> None:
    model = TinyWeights().eval()
    x = torch.randn(4, 16)
    result = amplite.convert(model, (x,), level="O1", data_max=1e9)
    reasons = {n["node"]: n["reason"] for n in result.report.fp32_nodes}
    assert reasons["linear_1"].startswith("range:weight-underflow")
    assert "linear" not in reasons
    off = amplite.convert(model, (x,), level="O1", range_rules=False)
    assert result.report.outputs[0]["sqnr_db"] > off.report.outputs[0]["sqnr_db"] + 20


class LongSum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1)


def test_long_reductions_stay_fp32_even_at_o3() -> None:
    x = torch.rand(2, 8192)
    gm = torch.export.export(LongSum(), (x,), strict=False).module()
    strip_export_checks(gm)
    ranges = collect_ranges(gm, [((x,), {})])
    result = RangeGuard(ranges, RangeRules(data_max=1e9), torch.float16)(gm)
    assert result.counters["kept_fp32:range:reduction-depth"] == 1
    converted = amplite.convert(LongSum(), (x,), level="O3", range_rules=True, data_max=1e9)
    assert converted.passed  # an fp16 running sum of 8192 terms in [0, 1) would stagnate near 2048
    # bf16 needs no calibration run for it (the depth rule reads shapes), yet keeps the sum FP32 all the same
    bf16 = amplite.convert(LongSum(), (x,), level="O3", precision="bf16", range_rules=True)
    assert "calibration" not in bf16.report.data["timings"]
    assert [n["reason"] for n in bf16.report.fp32_nodes if n["reason"].startswith("range:")] == [
        "range:reduction-depth 8192>4096"]
    assert "calibration" in converted.report.data["timings"]


def test_value_range_tracks_largest_finite_magnitude() -> None:
    r = ValueRange()
    r.update(torch.cat([torch.ones(9999), torch.tensor([-1000.0])]))
    r.update(torch.tensor([float("inf"), float("nan"), 3.0]))  # non-finite values are ignored
    r.update(torch.tensor([]))
    assert r.max_abs == 1000.0
    r.update(torch.tensor([-2048.0], dtype=torch.float16))
    assert r.max_abs == 2048.0


def test_relayout_ops_share_their_inputs_range_exactly() -> None:
    """A transpose/view holds the same elements as its input: calibration reuses that range (no second
    pass over the data) and it equals the true max |value| of the relaid-out tensor."""

    class Relayout(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 3.0
            return y.transpose(0, 1).reshape(-1).exp()

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    gm = torch.export.export(Relayout(), (x,)).module()
    ranges = collect_ranges(gm, [((x,), {})])
    names = {n.target.__name__.split(".")[0]: n.name for n in gm.graph.nodes if n.op == "call_function"}
    mul, transpose, reshape = ranges[names["mul"]], ranges[names["transpose"]], ranges[names["reshape"]]
    assert transpose is mul and reshape is mul
    assert mul.max_abs == pytest.approx(float((x * 3.0).abs().max()))
    exp = ranges[names["exp"]]
    assert exp is not mul and exp.max_abs == pytest.approx(float((x * 3.0).exp().max()))


class _Outlier(torch.nn.Module):
    """One rare large activation (|x| = 2000 in one element of 20000) feeding a matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(100, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_range_percentile_ignores_a_rare_outlier_but_never_an_overflow() -> None:
    import amplite

    x = torch.randn(200, 100, generator=torch.Generator().manual_seed(0))
    x[3, 7] = 2000.0  # above data_max (512), below fp16's 65504
    model = _Outlier().eval()
    by_max = amplite.convert(model, (x,), precision="fp16", level="O1")
    reasons = {n["node"]: n["reason"] for n in by_max.report.fp32_nodes}
    assert reasons.get("linear", "").startswith("range:activation input x |x|=2e+03"), reasons
    by_pct = amplite.convert(model, (x,), precision="fp16", level="O1", range_percentile=99.99)
    assert "linear" not in {n["node"] for n in by_pct.report.fp32_nodes}  # p99.99 of |x| is ~4, not 2000
    assert by_pct.report.data["config"]["range_rules"]["percentile"] == 99.99
    # an outlier that overflows fp16 keeps the node FP32 whatever the percentile says
    from amplite.passes.range_guard import RangeGuard, RangeRules, ValueRange

    gm = torch.export.export(model, (x,)).module()
    linear = next(n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target))
    ranges = {"x": ValueRange(max_abs=1e5, percentile_abs=3.0),
              linear.name: ValueRange(max_abs=4.0, percentile_abs=2.0)}
    guard = RangeGuard(ranges, RangeRules(percentile=99.99), torch.float16)
    assert guard._activation(linear) == "range:activation input x |x|=1e+05>65504"
    ranges["x"] = ValueRange(max_abs=600.0, percentile_abs=3.0)  # an outlier above data_max only: ignored
    assert guard._activation(linear) is None


def test_range_percentile_out_of_range_is_a_config_error() -> None:
    import amplite
    from amplite.errors import ConfigError

    with pytest.raises(ConfigError, match="percentile"):
        amplite.convert(_Outlier().eval(), (torch.randn(2, 100),), range_percentile=100.0)
