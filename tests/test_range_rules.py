"""Range rules: calibrated ranges keep FP32 what would overflow or lose too much in low precision."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


# --- RangeGuard on hand-built graphs: which node is flagged, and why ---------------------------------------

_aten = torch.ops.aten


def _guard_graph(build: Callable[..., Any], **buffers: torch.Tensor) -> torch.fx.GraphModule:
    """A graph module over placeholder ``x`` (2x3, FP32) and ``buffers``; ``build(g, x)`` returns the output."""
    root = nn.Module()
    root.add_module("sub", nn.Linear(1, 1))
    for name, value in buffers.items():
        root.register_buffer(name, value)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.zeros(2, 3)
    g.output(build(g, x))
    return torch.fx.GraphModule(root, g)


def _op(g: torch.fx.Graph, target: Any, args: tuple, val: Any = None, **kwargs: Any) -> torch.fx.Node:
    node = g.call_function(target, args, kwargs)
    node.meta["val"] = val
    return node


def test_small_integer_powers_are_cleared_low_and_counted_other_ops_are_not() -> None:
    """x**2 and x**3.0 may follow a bf16 input (each counted); a multiply by 2 is no power, and a power whose
    exponent is a keyword (export records it positionally) is left to the op table."""
    from amplite.passes.meta import RANGE_LOW_KEY

    def build(g: torch.fx.Graph, x: torch.fx.Node) -> tuple:
        pow_ = _aten.pow.Tensor_Scalar
        return (_op(g, pow_, (x, 2)), _op(g, pow_, (x, 3.0)), _op(g, _aten.mul.Tensor, (x, 2)),
                _op(g, pow_, (x,), exponent=2))  # fmt: skip

    gm = _guard_graph(build)
    result = RangeGuard({}, RangeRules(), torch.bfloat16)(gm)
    cleared = [RANGE_LOW_KEY in n.meta for n in gm.graph.nodes if n.op == "call_function"]
    assert cleared == [True, True, False, False] and result.counters["low_ok:small-integer-pow"] == 2


def test_a_weight_above_fp16_max_keeps_its_reader_fp32_past_other_constants() -> None:
    """The weight rule reads every get_attr: an integer buffer and a submodule read by the graph are no float
    weights to judge, and the matmul reading the huge weight after them is flagged with the weight's name."""
    from amplite.passes.meta import RANGE_KEY

    def build(g: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
        idx, sub, big = (g.get_attr(t) for t in ("idx", "sub", "big"))
        idx.meta["val"], big.meta["val"] = torch.zeros(3, dtype=torch.int64), torch.zeros(3, 3)
        return (_op(g, _aten.mm.default, (x, big), torch.zeros(2, 3)), idx, sub)

    gm = _guard_graph(build, idx=torch.arange(3), big=torch.full((3, 3), 1e5))
    result = RangeGuard({}, RangeRules(), torch.float16)(gm)
    mm = next(n for n in gm.graph.nodes if n.target is _aten.mm.default)
    assert mm.meta[RANGE_KEY] == "range:weight-overflow big |w|=1e+05"
    assert result.counters["kept_fp32:range:weight-overflow"] == 1


def test_the_flush_to_zero_share_counts_values_below_the_smallest_subnormal_only() -> None:
    """2^-24 is fp16's smallest subnormal: stored exactly, it does not flush; half of it does."""
    from amplite.passes.range_guard import weight_reason

    assert weight_reason(torch.full((8,), 2.0**-24), RangeRules()) is None
    assert weight_reason(torch.full((8,), 2.0**-25), RangeRules()) == "range:weight-underflow 100.0% flush to zero"


def test_reduction_depth_reads_the_softmax_dim_given_positionally_or_by_keyword() -> None:
    """A softmax over 8192 elements stays FP32 whether its dim is an argument or a keyword (it is not the last
    dim here); one over 3 does not; a reduction whose recorded value is missing is not judged."""
    from amplite.passes.meta import RANGE_KEY

    long = torch.zeros(2, 8192, 3)

    def build(g: torch.fx.Graph, x: torch.fx.Node) -> tuple:
        y = _op(g, _aten.expand.default, (x, [2, 8192, 3]), long)
        return (
            _op(g, _aten._softmax.default, (y, 1, False), long),
            _op(g, _aten.softmax.int, (y,), long, dim=1),
            _op(g, _aten.softmax.int, (y,), long, dim=2),
            _op(g, _aten.cumsum.default, (y, -2), long),
            _op(g, _aten.sum.default, (y,)),  # no recorded value
            _op(g, _aten.var_mean.correction, (y, [1]), (torch.zeros(2, 3), torch.zeros(2, 3))),
            _op(g, _aten.select.int, (y, 1, 0), torch.zeros(2, 3)),  # fewer elements, but no reduction
        )

    gm = _guard_graph(build)
    RangeGuard({}, RangeRules(), torch.bfloat16)(gm)
    deep = "range:reduction-depth 8192>4096"
    flags = [n.meta.get(RANGE_KEY) for n in gm.graph.nodes if n.op == "call_function"]
    # expand, the three softmaxes, cumsum, sum, var_mean (its first output's size), select
    assert flags == [None, deep, deep, None, deep, None, deep, None]


@pytest.mark.parametrize(("limit", "flag"), [(5, "range:reduction-depth 6>5"), (6, None)])
def test_a_full_reduction_is_as_deep_as_its_input_and_flagged_only_beyond_the_limit(
    limit: int, flag: str | None
) -> None:
    """sum(x) over 6 elements is 6 deep: kept FP32 with a limit of 5, not with a limit of 6."""
    from amplite.passes.meta import RANGE_KEY

    gm = _guard_graph(lambda g, x: _op(g, _aten.sum.default, (x,), torch.zeros(())))
    RangeGuard({}, RangeRules(max_reduction_depth=limit), torch.bfloat16)(gm)
    assert next(n for n in gm.graph.nodes if n.op == "call_function").meta.get(RANGE_KEY) == flag
