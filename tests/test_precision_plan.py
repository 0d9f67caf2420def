"""X"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from amplite import op_tables
from amplite.converter.calibration import collect_ranges
from amplite.converter.pipeline import strip_export_checks
from amplite.passes.annotate_precision import AnnotatePrecision
from amplite.passes.meta import OUT_DTYPE_KEY, PRECISION_KEY, RANGE_KEY, RANGE_LOW_KEY
from amplite.passes.precision_facts import bridges_fp32, broadcast_by_mul, discrete_cone, feeds_norm, tensor_inputs
from amplite.passes.range_guard import SMALL_POW, RangeGuard, RangeRules, ValueRange, weight_reason
from amplite.policy import Decision, Level, NodeFacts, PrecisionPolicy, make_overrides
from tests.exported import export_eval

aten = torch.ops.aten


# --- the small-integer-pow rule: range_guard clears x**2 / x**3, annotate_precision lets it follow ---


class _PowPlusOne(nn.Module):
    """``x.pow(n) + 1``: the power's one reader is an add (not FP32)."""

    def __init__(self, n: object) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(self.n) + 1


class _LinearPow(nn.Module):
    """A linear (low at O1) feeding ``pow(2) + 1``: a following power computes in the linear's fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).pow(2) + 1


class _PowOut(nn.Module):
    """The power is the graph output: its only user is the output node, which has no decision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(2)


class _PowMean(nn.Module):
    """RMSNorm's ``x.pow(2).mean()``: the reader is an FP32 reduction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(2).mean(-1)


@functools.cache
def _exported(key: str) -> torch.fx.GraphModule:
    models = {
        "pow2": _PowPlusOne(2),
        "pow3": _PowPlusOne(3),
        "pow2.0": _PowPlusOne(2.0),
        "pow4": _PowPlusOne(4),
        "pow2.5": _PowPlusOne(2.5),
        "powTrue": _PowPlusOne(True),
        "pow1": _PowPlusOne(1),
        "linear_pow": _LinearPow(),
        "pow_out": _PowOut(),
        "pow_mean": _PowMean(),
    }
    gm = torch.export.export(models[key].eval(), (torch.randn(2, 4),), strict=False).module()
    strip_export_checks(gm)
    return gm


def _fresh(key: str) -> torch.fx.GraphModule:
    """The cached export of ``key`` with every amplite annotation removed (the passes only write meta)."""
    gm = _exported(key)
    for node in gm.graph.nodes:
        for k in [k for k in node.meta if k.startswith("amplite_")]:
            del node.meta[k]
    return gm


def _pow_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.target is aten.pow.Tensor_Scalar)


def _guard_pow(key: str, dtype: torch.dtype, ranges: dict | None = None, rules: RangeRules | None = None) -> tuple:
    gm = _fresh(key)
    result = RangeGuard(ranges or {}, rules or RangeRules(), dtype)(gm)
    node = _pow_node(gm)
    return node.meta.get(RANGE_LOW_KEY), node.meta.get(RANGE_KEY), dict(result.counters)


@pytest.mark.parametrize("key", ["pow2", "pow3", "pow2.0"])
def test_bf16_square_and_cube_are_cleared_without_a_range(key: str) -> None:
    """bf16 has FP32's exponent range: x**2 and x**3 (int or float 2.0) may follow their input, no range needed."""
    low, kept, counters = _guard_pow(key, torch.bfloat16)
    assert (low, kept) == (SMALL_POW, None)
    assert counters.items() >= {"low_ok:small-integer-pow": 1}.items()


@pytest.mark.parametrize("key", ["pow4", "pow2.5", "powTrue", "pow1"])
def test_other_exponents_are_not_small_integer_pows(key: str) -> None:
    """x**4, x**2.5, x**True and x**1 are not the 2-or-3 multiplies the rule is about: no clearance, no counter."""
    for dtype in (torch.bfloat16, torch.float16):
        low, kept, counters = _guard_pow(key, dtype, {"pow_1": ValueRange(max_abs=1.0)})
        assert (low, kept, counters) == (None, None, {}), (key, dtype)


def test_fp16_square_needs_a_calibrated_range_within_data_max() -> None:
    """fp16: cleared only when the power's calibrated |x^n| was seen and is <= data_max (equal is allowed)."""
    assert _guard_pow("pow2", torch.float16) == (None, None, {}), "no calibrated range: stays on the FP32 list"
    assert _guard_pow("pow2", torch.float16, {"x": ValueRange(max_abs=1.0)}) == (None, None, {}), "only its input's"
    at_limit = _guard_pow("pow3", torch.float16, {"pow_1": ValueRange(max_abs=512.0)})
    assert at_limit == (SMALL_POW, None, {"low_ok:small-integer-pow": 1})
    custom = _guard_pow("pow2", torch.float16, {"pow_1": ValueRange(max_abs=8.0)}, RangeRules(data_max=8.0))
    assert custom[0] == SMALL_POW, "the limit is the configured data_max"
    over = _guard_pow("pow2", torch.float16, {"pow_1": ValueRange(max_abs=600.0)})
    # the power and its reader (the add, whose input is the power) are both kept FP32 by the activation rule
    assert over == (None, "range:activation output |x|=600>512", {"kept_fp32:range:activation": 2})


def test_fp16_square_over_data_max_is_not_cleared_even_when_the_percentile_rule_passes_it() -> None:
    """With a percentile, the activation rule ignores a rare 600; the pow rule still judges the true maximum."""
    rules = RangeRules(percentile=99.0)
    ranges = {"pow_1": ValueRange(max_abs=600.0, percentile_abs=1.0)}
    assert _guard_pow("pow2", torch.float16, ranges, rules) == (None, None, {})
    ranges = {"pow_1": ValueRange(max_abs=500.0, percentile_abs=1.0)}
    assert _guard_pow("pow2", torch.float16, ranges, rules)[0] == SMALL_POW


def _plan(gm: torch.fx.GraphModule, level: Level, precision: str = "fp16", **kw: object) -> dict[str, dict]:
    AnnotatePrecision(PrecisionPolicy(precision, level, **kw))(gm)
    return {n.name: n.meta[PRECISION_KEY] for n in gm.graph.nodes if PRECISION_KEY in n.meta}


def _cleared(key: str) -> torch.fx.GraphModule:
    gm = _fresh(key)
    _pow_node(gm).meta[RANGE_LOW_KEY] = SMALL_POW
    return gm


@pytest.mark.parametrize("level", [Level.O1, Level.O2])
def test_cleared_square_follows_its_low_input(level: Level) -> None:
    """A cleared pow after an fp16 linear computes in fp16 with the rule's reason (O1 and O2)."""
    plan = _plan(_cleared("linear_pow"), level)
    assert plan["pow_1"] == {"mode": "follow", "dtype": torch.float16, "reason": SMALL_POW, "rule": "range"}
    plan = _plan(_fresh("linear_pow"), level)
    assert plan["pow_1"] == {
        "mode": "fp32",
        "dtype": torch.float32,
        "reason": "fp32-list:transcendental",
        "rule": "op-table",
    }


def test_cleared_square_at_o0_and_o3_keeps_the_level_decision() -> None:
    """O0 converts nothing and O3 runs everything low: the pow rule changes neither."""
    assert _plan(_cleared("linear_pow"), Level.O0)["pow_1"]["reason"] == "level:O0"
    assert _plan(_cleared("linear_pow"), Level.O3)["pow_1"] == {
        "mode": "low",
        "dtype": torch.float16,
        "reason": "level:O3",
        "rule": "level",
    }


def test_cleared_square_read_by_an_fp32_op_keeps_fp32_squares() -> None:
    """RMSNorm's x.pow(2).mean(): the mean is FP32, so its squares stay FP32; the graph output is no FP32 reader."""
    plan = _plan(_cleared("pow_mean"), Level.O1)
    assert plan["pow_1"]["mode"] == "fp32" and plan["pow_1"]["reason"] == "fp32-list:transcendental"
    plan = _plan(_cleared("pow_out"), Level.O1)
    assert plan["pow_1"]["reason"] == SMALL_POW, "a power returned as the output follows its input"


def test_user_overrides_win_over_the_pow_rule() -> None:
    """A user's keep/force stays as it is on a cleared pow."""
    keep = _plan(_cleared("linear_pow"), Level.O1, overrides=make_overrides(keep_fp32=["op:pow"]))
    assert keep["pow_1"] == {"mode": "fp32", "dtype": torch.float32, "reason": "user:keep op:pow", "rule": "user"}
    low = _plan(_cleared("linear_pow"), Level.O1, overrides=make_overrides(force_low=["op:pow"]))
    assert low["pow_1"] == {"mode": "low", "dtype": torch.float16, "reason": "user:low op:pow", "rule": "user"}


# --- ValueRange.update: exact maximum, percentile, strided underflow statistics ---


def test_value_range_percentile_is_the_kth_smallest_magnitude_and_its_max_over_batches() -> None:
    """percentile p picks the ceil(p/100 * n)-th smallest |x| (at least the first); batches keep the largest."""
    t = torch.arange(1.0, 101.0) * torch.tensor([1.0, -1.0]).repeat(50)  # |x| = 1..100, half negative
    r = ValueRange()
    r.update(t)
    assert r.percentile_abs is None and r.max_abs == 100.0, "no percentile asked: none kept"
    r.update(t, percentile=50.5)  # 50.5 % of 100 = 50.5 -> the 51st smallest
    assert r.percentile_abs == 51.0
    r.update(t / 10, percentile=50.5)  # 5.1 < 51: the larger stays
    assert r.percentile_abs == 51.0
    r.update(t * 2, percentile=50.5)
    assert r.percentile_abs == 102.0 and r.max_abs == 200.0
    low = ValueRange()
    low.update(t, percentile=0.0)
    assert low.percentile_abs == 1.0, "percentile 0 is the smallest |x| (k is at least 1)"
    top = ValueRange()
    top.update(t, percentile=100.0)
    assert top.percentile_abs == 100.0


def test_value_range_percentile_ignores_non_finite_and_empty_values() -> None:
    """NaN/Inf never enter the percentile sample; empty or all-non-finite tensors change nothing."""
    r = ValueRange()
    r.update(torch.tensor([float("inf"), float("nan"), 1.0, -2.0, 3.0, 4.0, float("-inf")]), percentile=100.0)
    assert (r.percentile_abs, r.max_abs) == (4.0, 4.0)
    r.update(torch.tensor([float("nan"), float("inf")]), percentile=100.0)
    assert (r.percentile_abs, r.max_abs) == (4.0, 4.0)
    empty = ValueRange()
    empty.update(torch.tensor([]), percentile=99.0)
    empty.update(torch.tensor([float("nan")]), percentile=99.0)
    assert (empty.percentile_abs, empty.max_abs, empty.sampled_nonzero) == (None, 0.0, 0)


@pytest.mark.parametrize(("numel", "expected"), [(1 << 20, 5.0), ((1 << 20) + 2, 1.0)])
def test_value_range_percentile_samples_every_element_up_to_2_20(numel: int, expected: float) -> None:
    """Up to 2^20 elements every |x| counts; above, a stride of numel // 2^20 + 1 (here 2: the even ones)."""
    t = torch.ones(numel)
    t[1::2] = -5.0  # the odd elements, skipped by a stride of 2
    r = ValueRange()
    r.update(t, percentile=100.0)
    assert r.percentile_abs == expected
    assert r.max_abs == 5.0, "the maximum is exact, never sampled"


def test_value_range_maximum_of_magnitudes_ignores_non_finite() -> None:
    """max |x| takes the negative side too; NaN/Inf are dropped; an all-Inf batch changes nothing."""
    for t, expected in [([-3.0, 1.0], 3.0), ([-1.0, 3.0], 3.0), ([float("inf"), -3.0, float("nan")], 3.0)]:
        r = ValueRange()
        r.update(torch.tensor(t))
        assert r.max_abs == expected, t
    r = ValueRange()
    r.update(torch.tensor([float("inf"), float("-inf")]))
    assert (r.max_abs, r.sampled_nonzero) == (0.0, 0)


def test_value_range_counts_non_zeros_below_fp16_normal_for_tiny_values() -> None:
    """Only values whose max |x| < 2^-10 are sampled: non-zeros counted, those strictly below 2^-14 are tiny."""
    t = torch.tensor([0.0, 0.0, 1e-6, -1e-6, 1e-6, 2.0**-14, 1e-4, -5e-4])
    r = ValueRange()
    r.update(t)
    assert (r.sampled_nonzero, r.sampled_tiny) == (6, 3)
    assert r.tiny_share == 0.5
    r.update(torch.tensor([float("nan"), 1e-6, 0.0]))  # a NaN is dropped, the rest still sampled
    assert (r.sampled_nonzero, r.sampled_tiny) == (7, 4)
    at_limit = ValueRange()
    at_limit.update(torch.tensor([2.0**-10, 1e-6]))
    assert (at_limit.sampled_nonzero, at_limit.tiny_share) == (0, 0.0), "max |x| = 2^-10: not sampled"
    below = ValueRange()
    below.update(torch.tensor([2.0**-11, 1e-6]))
    assert (below.sampled_nonzero, below.sampled_tiny) == (2, 1)
    below.update(torch.tensor([1.0]))
    below.update(torch.tensor([1e-6, 1e-6]))  # the running maximum is now 1: no longer sampled
    assert (below.sampled_nonzero, below.sampled_tiny) == (2, 1)


@pytest.mark.parametrize(("numel", "nonzero"), [(4096, 2048), (4098, 0)])
def test_value_range_underflow_sample_strides_above_4096(numel: int, nonzero: int) -> None:
    """Up to 2^12 elements all are sampled; above, every (numel // 4096 + 1)-th (here the even ones, all zero)."""
    t = torch.zeros(numel)
    t[1::2] = 1e-6
    r = ValueRange()
    r.update(t)
    assert (r.sampled_nonzero, r.sampled_tiny) == (nonzero, nonzero)


# --- AnnotatePrecision._plan_node / _predict_out: compute dtype, reason, counters, predicted output dtypes ---


class _Mixed(nn.Module):
    """One node per branch of the plan: low-list, follow with a 0-dim operand, float64, integers only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, i: torch.Tensor, d: torch.Tensor) -> tuple:
        h = self.fc(x)  # linear: low
        a = h + y  # y is a 0-dim fp32 tensor: it does not widen the add
        b = x.sum(-1, dtype=torch.float64)  # produces float64 from fp32
        c = x + d  # d is float64
        e = i + 1  # integers only: no plan
        f = torch.arange(4) / 2  # float result, no float operand
        v, idx = h.max(-1)  # two outputs: values and indices
        return a, b, c, e, f, v, idx


_MIXED_INPUTS = (torch.randn(2, 4), torch.tensor(2.0), torch.arange(4), torch.randn(2, 4, dtype=torch.float64))


@functools.cache
def _mixed_export() -> torch.fx.GraphModule:
    gm = torch.export.export(_Mixed().eval(), _MIXED_INPUTS, strict=False).module()
    strip_export_checks(gm)
    return gm


def _mixed(level: Level, precision: str = "fp16") -> tuple[dict, dict, dict]:
    gm = _mixed_export()
    for node in gm.graph.nodes:
        for k in [k for k in node.meta if k.startswith("amplite_")]:
            del node.meta[k]
    result = AnnotatePrecision(PrecisionPolicy(precision, level))(gm)
    plan = {n.name: n.meta.get(PRECISION_KEY) for n in gm.graph.nodes}
    out = {n.name: n.meta[OUT_DTYPE_KEY] for n in gm.graph.nodes}
    return plan, out, dict(result.counters)


def test_plan_of_each_branch_at_o1() -> None:
    """O1 fp16: linear low; the add follows its fp16 tensor, not its 0-dim fp32 operand; float64 is kept;
    integer-only ops get no plan; a float result without float operands has no compute dtype."""
    f16, f32, f64 = torch.float16, torch.float32, torch.float64
    plan, out, counters = _mixed(Level.O1)
    assert plan["linear"] == {"mode": "low", "dtype": f16, "reason": "low-list:linear", "rule": "op-table"}
    assert plan["add"] == {"mode": "follow", "dtype": f16, "reason": "follow-inputs", "rule": "level"}
    assert out["add"] == f16
    assert plan["sum_1"] == {"mode": "follow", "dtype": f32, "reason": "float64-kept", "rule": "dtype"}, (
        "float64 output is kept"
    )
    assert out["sum_1"] == f64, "an explicit dtype= keeps its output dtype"
    assert plan["add_1"] == {"mode": "follow", "dtype": f64, "reason": "float64-kept", "rule": "dtype"}
    assert out["add_1"] == f64
    assert plan["add_2"] is None and out["add_2"] == torch.int64, "integer-only op: no plan"
    assert plan["arange"] is None
    assert plan["div"] == {"mode": "follow", "dtype": None, "reason": "no-float-operands", "rule": "dtype"}
    assert out["div"] == f32
    assert out["x"] == f32 and out["i"] == torch.int64 and out["output"] is None
    assert plan["max_1"] == {"mode": "follow", "dtype": f16, "reason": "follow-inputs", "rule": "level"}
    # follow: add, sum_1, add_1, div, max_1; compute fp16: linear, add, max_1 (div has none)
    assert counters.items() >= {
        "nodes:low": 1,
        "nodes:follow": 5,
        "compute:float16": 3,
        "compute:float32": 1,
        "compute:float64": 1,
    }.items(), counters


def test_plan_at_o3_bf16_runs_low_and_predicts_multi_output_dtypes() -> None:
    """O3 bf16: float ops compute in bfloat16; max.dim's values take bf16, its indices stay int64, and the
    getitems read those dtypes from the tuple."""
    bf = torch.bfloat16
    plan, out, counters = _mixed(Level.O3, "bf16")
    assert plan["linear"] == {"mode": "low", "dtype": bf, "reason": "level:O3", "rule": "level"}
    assert plan["max_1"] == {"mode": "low", "dtype": bf, "reason": "level:O3", "rule": "level"}
    assert out["max_1"] == (bf, torch.int64)
    assert out["getitem"] == bf and out["getitem_1"] == torch.int64
    assert out["add"] == bf
    assert plan["add_1"]["reason"] == "float64-kept" and out["add_1"] == torch.float64
    assert counters["compute:bfloat16"] == 3 and counters["nodes:low"] == 3, counters


def _inplace_graph(dest: torch.Tensor, src: torch.Tensor) -> torch.fx.GraphModule:
    """``dest.add_(src)`` as a hand-built graph (export functionalises in-place ops away)."""
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    a.meta["val"], b.meta["val"] = dest, src
    node = graph.call_function(aten.add_.Tensor, (a, b))
    node.meta["val"] = dest
    graph.output(node)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("level", [Level.O1, Level.O3])
def test_in_place_op_computes_in_its_destination_dtype(level: Level) -> None:
    """An in-place op cannot change its destination's dtype: it computes in it (O3's 'low' included);
    an integer destination leaves no compute dtype."""
    gm = _inplace_graph(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3))
    result = AnnotatePrecision(PrecisionPolicy("fp16", level))(gm)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert node.meta[PRECISION_KEY] == {
        "mode": "follow",
        "dtype": torch.bfloat16,
        "reason": "in-place",
        "rule": "dtype",
    }
    assert node.meta[OUT_DTYPE_KEY] == torch.bfloat16
    assert result.counters.items() >= {"nodes:follow": 1, "compute:bfloat16": 1}.items()
    gm = _inplace_graph(torch.zeros(3, dtype=torch.int64), torch.zeros(3))
    AnnotatePrecision(PrecisionPolicy("fp16", level))(gm)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert node.meta[PRECISION_KEY] == {"mode": "follow", "dtype": None, "reason": "in-place", "rule": "dtype"}
    assert node.meta[OUT_DTYPE_KEY] == torch.int64


# --- RangeGuard._depth: long reductions stay FP32 at any low dtype ---


class _Reductions(nn.Module):
    """Reductions over 4097 elements (one more than the default limit) and over 2."""

    def forward(self, x: torch.Tensor) -> tuple:
        return (
            x.sum(-1),  # 4097 per output
            x.mean(0),  # 2 per output
            x.cumsum(-1),  # a running sum along the 4097-long dim
            torch.softmax(x, -1),  # normalises over 4097
            torch.softmax(x, 0),  # over 2
            aten.var_mean.correction(x, [-1]),  # two outputs, each over 4097
            x.sum(),  # 8194 into one
        )


@functools.cache
def _reductions_export() -> torch.fx.GraphModule:
    gm = torch.export.export(_Reductions(), (torch.randn(2, 4097),), strict=False).module()
    strip_export_checks(gm)
    return gm


def _depth_flags(rules: RangeRules, dtype: torch.dtype) -> tuple[dict[str, str], dict]:
    gm = _reductions_export()
    for node in gm.graph.nodes:
        node.meta.pop(RANGE_KEY, None)
    result = RangeGuard({}, rules, dtype)(gm)
    flags = {
        str(n.target).removeprefix("aten."): n.meta[RANGE_KEY]
        for n in gm.graph.nodes
        if RANGE_KEY in n.meta
    }
    return flags, dict(result.counters)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reductions_deeper_than_the_limit_are_kept_fp32(dtype: torch.dtype) -> None:
    """Depth = elements folded into each output (softmax/cumsum: the length of their dim); strictly above
    the limit is flagged, for fp16 and bf16 alike."""
    flags, counters = _depth_flags(RangeRules(), dtype)
    deep = "range:reduction-depth 4097>4096"
    assert flags == {
        "sum.dim_IntList": deep,
        "cumsum.default": deep,
        "softmax.int": deep,
        "var_mean.correction": deep,
        "sum.default": "range:reduction-depth 8194>4096",
    }, flags
    assert counters.items() >= {"kept_fp32:range:reduction-depth": 5}.items()
    flags, _ = _depth_flags(RangeRules(max_reduction_depth=4097), dtype)
    assert flags == {"sum.default": "range:reduction-depth 8194>4097"}, "a depth equal to the limit is allowed"
    assert _depth_flags(RangeRules(max_reduction_depth=None), dtype) == ({}, {}), "None: no depth limit"


# --- RangeGuard._activation / _underflow on x -> pow_1 -> add, with given ranges ---


def _flags(key: str, ranges: dict, rules: RangeRules | None = None, dtype: torch.dtype = torch.float16) -> tuple:
    gm = _fresh(key)
    result = RangeGuard(ranges, rules or RangeRules(), dtype)(gm)
    flags = {n.name: n.meta[RANGE_KEY] for n in gm.graph.nodes if RANGE_KEY in n.meta}
    return flags, dict(result.counters)


def test_percentile_activation_rule_flags_overflow_and_percentiles_above_data_max() -> None:
    """With a percentile: a max above 65504 is flagged whatever the percentile; otherwise the percentile is
    judged against data_max (strictly above); a value without a percentile falls back to its maximum."""
    pct = RangeRules(percentile=99.9)
    assert _flags("pow2", {"x": ValueRange(max_abs=70000.0, percentile_abs=1.0)}, pct) == (
        {"pow_1": "range:activation input x |x|=7e+04>65504"},
        {"kept_fp32:range:activation": 1},
    )
    assert _flags("pow2", {"x": ValueRange(max_abs=65504.0, percentile_abs=1.0)}, pct) == ({}, {})
    flags, _ = _flags("pow2", {"x": ValueRange(max_abs=1000.0, percentile_abs=600.0)}, pct)
    assert flags == {"pow_1": "range:activation input x p99.9|x|=600>512"}
    assert _flags("pow2", {"x": ValueRange(max_abs=1000.0, percentile_abs=512.0)}, pct) == ({}, {})
    flags, _ = _flags("pow2", {"x": ValueRange(max_abs=600.0)}, pct)
    assert flags == {"pow_1": "range:activation input x |x|=600>512"}, "no percentile recorded: the maximum"
    flags, _ = _flags("pow2", {"x": ValueRange(max_abs=600.0, percentile_abs=1.0)})
    assert flags == {"pow_1": "range:activation input x |x|=600>512"}, "no percentile rule: the maximum"


def test_activation_rule_reads_every_input_and_skips_missing_ranges() -> None:
    """A node is judged on its output and each input with a range (a missing one is skipped, not the end)."""
    flags, counters = _flags("pow2", {"pow_1": ValueRange(max_abs=1000.0)})
    assert flags == {
        "pow_1": "range:activation output |x|=1e+03>512",
        "add": "range:activation input pow_1 |x|=1e+03>512",
    }
    assert counters.items() >= {"kept_fp32:range:activation": 2}.items()


def _tiny(max_abs: float = 1e-4, nonzero: int = 10, tiny: int = 6) -> ValueRange:
    return ValueRange(max_abs=max_abs, sampled_nonzero=nonzero, sampled_tiny=tiny)


def test_underflow_rule_flags_mostly_subnormal_small_values_in_fp16_only() -> None:
    """More than half the non-zeros below 2^-14, with max |x| < 2^-10: the node and its readers stay FP32."""
    flags, counters = _flags("pow2", {"pow_1": _tiny()})
    assert flags == {
        "pow_1": "range:underflow output 60% of non-zeros <2^-14 (|x|max=0.0001)",
        "add": "range:underflow input pow_1 60% of non-zeros <2^-14 (|x|max=0.0001)",
    }, flags
    assert counters.items() >= {"kept_fp32:range:underflow": 2}.items()
    assert _flags("pow2", {"pow_1": _tiny(tiny=5)})[0] == {}, "a share equal to the limit is allowed"
    assert _flags("pow2", {"pow_1": _tiny(max_abs=2.0**-10)})[0] == {}, "max |x| = 2^-10: rounding is harmless"
    assert _flags("pow2", {"pow_1": _tiny(tiny=3)}, RangeRules(data_underflow_share=0.25))[0] != {}
    assert _flags("pow2", {"pow_1": _tiny()}, dtype=torch.bfloat16) == ({}, {"low_ok:small-integer-pow": 1})


def test_activation_rule_is_reported_before_underflow() -> None:
    """When an input is too large and the output mostly subnormal, the activation reason is the one given."""
    flags, _ = _flags("pow2", {"x": ValueRange(max_abs=600.0), "pow_1": _tiny()})
    assert flags["pow_1"] == "range:activation input x |x|=600>512"
    assert flags["add"].startswith("range:underflow input pow_1 60%")


def test_weight_ranges_are_not_judged_as_activations_or_underflow() -> None:
    """get_attr inputs (the weights) have their own rule: their calibrated range never flags a reader."""
    ranges = {"fc_weight": ValueRange(max_abs=1000.0), "fc_bias": _tiny(tiny=10)}
    assert _flags("linear_pow", ranges)[0] == {}


# --- AnnotatePrecision._decisions / _discrete_decisions: range flags, discrete-decision rule ---


class _ArgmaxChain(nn.Module):
    """x -> linear -> relu -> argmax: the argmax and the producers of the values it reads stay FP32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        h = self.fc(x)
        return h.relu().argmax(-1), h * 2  # the mul reads the linear but feeds no decision


@functools.cache
def _argmax_export() -> torch.fx.GraphModule:
    gm = torch.export.export(_ArgmaxChain().eval(), (torch.randn(2, 4),), strict=False).module()
    strip_export_checks(gm)
    return gm


def _argmax_plan(level: Level, **kw: object) -> dict[str, dict]:
    gm = _argmax_export()
    for node in gm.graph.nodes:
        for k in [k for k in node.meta if k.startswith("amplite_")]:
            del node.meta[k]
    return _plan(gm, level, **kw)


@pytest.mark.parametrize("level", [Level.O1, Level.O2])
def test_discrete_decision_keeps_its_value_producers_fp32(level: Level) -> None:
    """The argmax, the relu it reads and the linear before it compute in FP32 ('discrete-decision'); the
    mul that only shares the linear's input keeps its own plan."""
    plan = _argmax_plan(level)
    for name in ("argmax", "relu", "linear"):
        assert plan[name] == {
            "mode": "fp32",
            "dtype": torch.float32,
            "reason": "discrete-decision",
            "rule": "fidelity",
        }, name
    assert plan["mul"]["reason"] != "discrete-decision"
    expected = {Level.O1: ("follow-inputs", torch.float32), Level.O2: ("level:O2", torch.float16)}[level]
    assert (plan["mul"]["reason"], plan["mul"]["dtype"]) == expected, "O1: it follows the FP32 linear"


def test_discrete_decision_rule_leaves_o3_and_user_force_low_alone() -> None:
    """O3 runs everything low; a user's force-low on the linear wins over the fidelity rule."""
    plan = _argmax_plan(Level.O3)
    assert plan["linear"]["reason"] == "level:O3" and plan["relu"]["reason"] == "level:O3"
    plan = _argmax_plan(Level.O1, overrides=make_overrides(force_low=["op:linear"]))
    assert plan["linear"] == {"mode": "low", "dtype": torch.float16, "reason": "user:low op:linear", "rule": "user"}
    assert plan["relu"]["reason"] == "discrete-decision"


def test_range_flag_turns_a_low_decision_fp32_but_not_a_user_one() -> None:
    """range_guard's flag makes a low/follow node FP32 with the flag as reason; a user override still wins;
    an op the FP32 list also holds is reported under the stronger layer, range (priority 2 beats 5)."""
    gm = _fresh("linear_pow")
    linear = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    linear.meta[RANGE_KEY] = "range:activation output |x|=600>512"
    add.meta[RANGE_KEY] = "range:activation input pow_1 |x|=600>512"
    _pow_node(gm).meta[RANGE_KEY] = "range:activation output |x|=600>512"
    plan = _plan(gm, Level.O1)
    assert plan["linear"] == {
        "mode": "fp32",
        "dtype": torch.float32,
        "reason": "range:activation output |x|=600>512",
        "rule": "range",
    }
    assert plan["add"]["reason"] == "range:activation input pow_1 |x|=600>512"
    assert (plan["pow_1"]["reason"], plan["pow_1"]["rule"]) == ("range:activation output |x|=600>512", "range")
    plan = _plan(gm, Level.O1, overrides=make_overrides(force_low=["op:linear"]))
    assert plan["linear"]["reason"] == "user:low op:linear"


def test_analysis_passes_report_the_graph_unmodified() -> None:
    """range_guard and annotate_precision only write metadata: their results say modified is False."""
    gm = _fresh("pow2")
    guard = RangeGuard({}, RangeRules(), torch.bfloat16)(gm)
    assert guard.modified is False and guard.graph_module is gm
    plan = AnnotatePrecision(PrecisionPolicy("fp16", Level.O1))(gm)
    assert plan.modified is False and plan.graph_module is gm
    assert plan.counters.items() >= {"nodes:follow": 2, "compute:float32": 2}.items(), "the pow and the add follow x"


# --- weight_reason: the fp16 weight rule on one tensor ---


def test_weight_reason_ignores_integer_and_empty_tensors() -> None:
    """Only non-empty floating tensors are judged: an int64 buffer of 1e5 is no fp16 overflow."""
    assert weight_reason(torch.tensor([100000, 3]), RangeRules()) is None
    assert weight_reason(torch.zeros(0), RangeRules()) is None
    assert weight_reason(torch.tensor([100000.0]), RangeRules()) == "range:weight-overflow |w|=1e+05"


@pytest.mark.parametrize(
    ("numel", "expected"),
    [
        (1 << 20, "range:weight-underflow 50.0% flush to zero"),  # every element is read
        ((1 << 20) + 2, None),  # stride 2: only the even (0.5) elements are read
    ],
)
def test_weight_reason_reads_every_value_up_to_2_20(numel: int, expected: str | None) -> None:
    """The flush-to-zero share is exact up to 2^20 values, then estimated with a stride of numel // 2^20 + 1."""
    t = torch.full((numel,), 0.5)
    t[1::2] = 1e-9  # flushes to zero in fp16
    assert weight_reason(t, RangeRules()) == expected


# range_guard


class _BigButSafeWeight(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.fc.weight.fill_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _guard(model: nn.Module, x: torch.Tensor, rules: RangeRules, dtype: torch.dtype = torch.float16) -> tuple:
    gm = torch.export.export(model.eval(), (x,), strict=False).module()
    strip_export_checks(gm)
    result = RangeGuard(collect_ranges(gm, [((x,), {})]), rules, dtype)(gm)
    flags = {n.name: n.meta[RANGE_KEY] for n in gm.graph.nodes if RANGE_KEY in n.meta}
    return flags, result


def test_weights_are_not_activations_and_the_weight_limit_is_a_strict_bound() -> None:
    x = torch.full((2, 4), 1e-3)
    flags, result = _guard(_BigButSafeWeight(1000.0), x, RangeRules())  # |w| = 1000 > data_max, < 65504
    assert flags == {} and not result.modified and not any(result.counters.values()), flags
    flags, _ = _guard(_BigButSafeWeight(1000.0), x, RangeRules(weight_max=1000.0))
    assert flags == {}, "|w| equal to weight_max is allowed"
    flags, result = _guard(_BigButSafeWeight(1000.0), x, RangeRules(weight_max=999.0))
    assert flags == {"linear": "range:weight-overflow fc.weight |w|=1e+03"}, flags
    assert result.counters.items() >= {"kept_fp32:range:weight-overflow": 1}.items()


def test_activation_limit_is_strict_and_names_output_or_input() -> None:
    x = torch.full((2, 4), 0.25)
    model = _BigButSafeWeight(1.0)  # y = 1.0 exactly
    assert _guard(model, x, RangeRules(data_max=1.0))[0] == {}
    flags, result = _guard(model, x, RangeRules(data_max=0.5))
    assert flags == {"linear": "range:activation output |x|=1>0.5"}, flags
    assert result.counters.items() >= {"kept_fp32:range:activation": 1}.items()
    flags, _ = _guard(model, x, RangeRules(data_max=0.25))
    assert flags["linear"] == "range:activation output |x|=1>0.25"
    flags, _ = _guard(_BigButSafeWeight(1e-3), x * 4, RangeRules(data_max=0.5))  # y = 4e-3, x = 1
    assert flags == {"linear": "range:activation input x |x|=1>0.5"}, "the input is named when it is too large"
    assert _guard(model, x * 1e4, RangeRules(data_max=1.0), torch.bfloat16)[0] == {}, "bf16: no activation rule"


class _Underflow(nn.Module):
    def __init__(self, tiny: int, shape: tuple[int, int] = (20, 10)) -> None:
        super().__init__()
        self.fc = nn.Linear(shape[1], shape[0], bias=False)
        with torch.no_grad():
            w = self.fc.weight.view(-1)
            w.fill_(0.5)
            w[:tiny] = -1e-9  # flushes to zero in fp16 (negative: the share is of magnitudes)
            w[-10:] = 0.0  # zeros are not counted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_underflow_share_is_of_the_non_zero_weights_and_strict() -> None:
    x = torch.rand(2, 10)
    assert _guard(_Underflow(1), x, RangeRules())[0] == {}  # 1 of 190 non-zero weights: 0.5 % <= 1 %
    flags, result = _guard(_Underflow(2), x, RangeRules())  # 2 / 190 = 1.05 %
    assert flags == {"linear": "range:weight-underflow fc.weight 1.1% flush to zero"}, flags
    assert result.counters.items() >= {"kept_fp32:range:weight-underflow": 1}.items()
    assert _guard(_Underflow(2), x, RangeRules(underflow_share=2 / 190))[0] == {}, "a share equal to the limit is kept"
    assert _guard(_Underflow(2), x, RangeRules(), torch.bfloat16)[0] == {}, "bf16: no weight rules"


def test_underflow_share_of_a_large_weight_is_estimated_on_a_sample() -> None:
    shape = (1024, 1025)  # 1_049_600 values: more than the 2^20 sampled
    flags, _ = _guard(_Underflow(600_000, shape), torch.rand(1, 1025), RangeRules())
    assert flags["linear"].startswith("range:weight-underflow fc.weight 57."), flags


class _EpsBeforeOutput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(2).mean(-1, keepdim=True) + 1e-6  # the add feeds the graph output, not an FP32 op


class _ConstantBetweenNorms(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, -1) * torch.arange(4.0).exp()  # arange: no floating operand at all


def test_only_nodes_between_fp32_ops_are_bridges() -> None:
    gm = export_eval(_EpsBeforeOutput(), torch.randn(2, 4))
    AnnotatePrecision(PrecisionPolicy("fp16", Level.O2))(gm)
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    assert add.meta[PRECISION_KEY]["reason"] == "level:O2", "an add that feeds the output is no bridge"
    gm = export_eval(_ConstantBetweenNorms(), torch.randn(2, 4))
    AnnotatePrecision(PrecisionPolicy("fp16", Level.O2))(gm)
    arange = next(n for n in gm.graph.nodes if "arange" in str(n.target))
    reason = arange.meta[PRECISION_KEY]["reason"]
    assert reason == "no-float-operands", "a node without float operands is no bridge"


class _ShortReductions(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.sum(-1), x.softmax(0), x.cumsum(-1), x.amax(-1)


def test_only_reductions_deeper_than_the_limit_are_flagged() -> None:
    x = torch.rand(3, 16)
    flags, result = _guard(_ShortReductions(), x, RangeRules(data_max=1e9, max_reduction_depth=4))
    # softmax(0) runs over 3 values; amax is a normaliser, not a reduction table entry
    assert flags == {"sum_1": "range:reduction-depth 16>4", "cumsum": "range:reduction-depth 16>4"}, flags
    assert result.counters.items() >= {"kept_fp32:range:reduction-depth": 2}.items()
    flags, _ = _guard(_ShortReductions(), x, RangeRules(data_max=1e9, max_reduction_depth=2))
    assert flags["softmax"] == "range:reduction-depth 3>2", "softmax's depth is the size of its dim"
    assert _guard(_ShortReductions(), x, RangeRules(data_max=1e9, max_reduction_depth=16))[0] == {}, "16 is allowed"
    assert _guard(_ShortReductions(), x, RangeRules(data_max=1e9, max_reduction_depth=None))[0] == {}


class _OneElementWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor([1e5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


def test_a_one_element_weight_beyond_fp16_is_flagged() -> None:
    flags, _ = _guard(_OneElementWeight(), torch.full((2, 3), 1e-6), RangeRules())
    assert flags == {"mul": "range:weight-overflow s |w|=1e+05"}, flags


class _IntsAndCompare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.avg.mul_(0.5).add_(x.mean(0))  # in-place ops stay in-place in the unlifted graph
        return ids + 1, self.lin(x) > 0


def test_annotation_covers_float_nodes_only_and_in_place_ops_follow() -> None:
    gm = export_eval(_IntsAndCompare(), torch.randn(2, 4), torch.arange(3))
    AnnotatePrecision(PrecisionPolicy("fp16", Level.O2))(gm)
    plan = _precision(gm)
    int_add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor and n.args[0].name == "ids")
    assert int_add.name not in plan, "a node without floating inputs or outputs gets no precision plan"
    gt = next(n for n in gm.graph.nodes if "gt" in str(n.target))
    assert plan[gt.name]["dtype"] == torch.float16, "a comparison of float values is planned"
    assert plan["mul_"] == {"mode": "follow", "dtype": torch.float32, "reason": "in-place", "rule": "dtype"}, plan[
        "mul_"
    ]
    assert plan["add_"]["mode"] == "follow" and plan["add_"]["reason"] == "in-place"


def _precision(gm: torch.fx.GraphModule) -> dict[str, dict]:
    return {n.name: n.meta[PRECISION_KEY] for n in gm.graph.nodes if PRECISION_KEY in n.meta}


# --- the graph facts of passes/precision_facts.py, on hand-built FX graphs (no export: well under 10 ms each) ---


class _Graph:
    """An FX graph built by hand whose nodes carry an example value in ``meta['val']``, as torch.export's do."""

    def __init__(self) -> None:
        self.graph = torch.fx.Graph()

    def input(self, name: str, *shape: int, dtype: torch.dtype = torch.float32) -> torch.fx.Node:
        node = self.graph.placeholder(name)
        node.meta["val"] = torch.empty(shape, dtype=dtype)
        return node

    def op(self, target: object, *args: object, shape: tuple = (2, 4), val: object = None) -> torch.fx.Node:
        node = self.graph.call_function(target, args)
        node.meta["val"] = torch.empty(shape) if val is None else val
        return node


def test_tensor_inputs_are_the_tensor_valued_nodes_among_nested_arguments() -> None:
    g = _Graph()
    x, y = g.input("x", 2, 4), g.input("y", 2, 4)
    size = g.op(aten.sym_size.int, x, 0, val=2)  # a node whose value is a (Sym)int, not a tensor
    view = g.op(aten.view.default, x, [size, 4])
    cat = g.op(aten.cat.default, [x, y], 0, shape=(4, 4))
    assert tensor_inputs(view) == [x], "a size node among the arguments is not a tensor input"
    assert tensor_inputs(cat) == [x, y], "tensors nested in a list argument are inputs"


def test_discrete_cone_walks_every_float_operand_up_to_the_first_compute_bound_op() -> None:
    g = _Graph()
    x, w = g.input("x", 2, 4), g.input("w", 4, 4)
    pre = g.op(aten.relu.default, x)
    mm1, mm2 = g.op(aten.mm.default, pre, w), g.op(aten.mm.default, x, w)
    left, right = g.op(aten.relu.default, mm1), g.op(aten.neg.default, mm2)
    both = g.op(aten.add.Tensor, left, right)
    # the graph input comes first among the operands: it has no facts and must not end the walk of the others
    total = g.op(aten.add.Tensor, x, both)
    pick = g.op(aten.argmax.default, total, -1, shape=(2,))
    facts = {n: NodeFacts(op_tables.op_name(n.target)) for n in g.graph.nodes if n.op == "call_function"}
    cone = discrete_cone(facts)
    assert cone == {pick, total, both, left, right, mm1, mm2}, sorted(n.name for n in cone)
    assert pre not in cone, "the walk stops at the first compute-bound op on each path (mm), which it includes"


def test_feeds_norm_follows_views_only_and_every_path() -> None:
    g = _Graph()
    x = g.input("x", 2, 4)
    h = g.op(aten.relu.default, x)
    to_norm = g.op(aten.view.default, h, [2, 4])  # h's first reader: popped last
    norm = g.op(aten.layer_norm.default, to_norm, [4])
    alias = g.op(aten.view.default, h, [2, 4])
    g.op(aten.add.Tensor, h, alias)  # reached twice: directly and through the alias
    assert feeds_norm(to_norm), "a normalisation reading the value directly"
    assert feeds_norm(h), "through a view, after a reader already seen on another path"
    assert not feeds_norm(norm), "no reader"
    other = g.op(aten.relu.default, x)
    g.op(aten.layer_norm.default, g.op(aten.neg.default, other), [4])
    assert not feeds_norm(other), "an elementwise op between the value and the norm is not a view"


def test_broadcast_by_mul_needs_a_mul_whose_result_is_larger() -> None:
    g = _Graph()
    x, p, y = g.input("x", 2, 4, 8, 8), g.input("p", 2, 4, 1, 1), g.input("y", 2, 4)
    gate = g.op(aten.sigmoid.default, p, shape=(2, 4, 1, 1))
    g.op(aten.mul.Tensor, x, gate, shape=(2, 4, 8, 8))
    same = g.op(aten.sigmoid.default, y)
    g.op(aten.mul.Tensor, same, y)
    added = g.op(aten.sigmoid.default, p, shape=(2, 4, 1, 1))
    g.op(aten.add.Tensor, x, added, shape=(2, 4, 8, 8))
    pair = g.op(aten.max.dim, p, 1, val=(torch.empty(2, 1, 1), torch.empty(2, 1, 1, dtype=torch.long)))
    assert broadcast_by_mul(gate), "a squeeze-excitation gate: mul broadcasts it over the feature map"
    assert not broadcast_by_mul(same), "a mul of the same size broadcasts nothing"
    assert not broadcast_by_mul(added), "a broadcasting add is not a gate"
    assert not broadcast_by_mul(pair), "a node whose value is not a tensor"


_FP32, _FOLLOW, _LOW = Decision("fp32", "fp32-list:x"), Decision("follow", "follow-inputs"), Decision("low", "level:O2")


def test_bridges_fp32_between_fp32_ops_only() -> None:
    g = _Graph()
    x = g.input("x", 2, 4)
    mean = g.op(aten.mean.dim, x, [-1], True, shape=(2, 1))
    eps = g.op(aten.add.Tensor, mean, 1e-6, shape=(2, 1))
    rsqrt = g.op(aten.rsqrt.default, eps, shape=(2, 1))
    g.op(aten.mul.Tensor, x, rsqrt)
    unread = g.op(aten.add.Tensor, mean, 2.0, shape=(2, 1))
    decisions = {mean: _FP32, eps: _FOLLOW, rsqrt: _FP32, unread: _FOLLOW}
    assert bridges_fp32(eps, decisions, outputs_fp32=False), "mean(x) + eps between mean and rsqrt"
    assert not bridges_fp32(rsqrt, decisions, outputs_fp32=False), "its operand is not FP32"
    assert not bridges_fp32(unread, decisions, outputs_fp32=True), "a node nobody reads bridges nothing"
    assert not bridges_fp32(x, decisions, outputs_fp32=True), "a node with no float operand bridges nothing"


def _scalar_loss(count: str = "fp32", casts: int = 0, shape: tuple = ()) -> tuple[torch.fx.Node, dict]:
    """``sum(x) / n`` read by the graph output, ``n`` an input (fp32/fp16) behind ``casts`` undecided casts."""
    g = _Graph()
    x = g.input("x", 8, 3)
    n = g.input("n", *shape, dtype=torch.float16 if count == "fp16" else torch.float32)
    if count == "module":  # an opaque call: its body is unseen, so it passes nothing on
        n = g.graph.call_module("scale", (n,))
        n.meta["val"] = torch.empty(shape)
    for _ in range(casts):
        n = g.op(aten.to.dtype, n, torch.float32, shape=shape)
    total = g.op(aten.sum.dim_IntList, x, [0] if shape else [0, 1], shape=shape)
    loss = g.op(aten.div.Tensor, total, n, shape=shape)
    g.graph.output(loss)
    return loss, {total: _FP32, loss: _FOLLOW}


def test_bridges_fp32_scalar_between_an_fp32_op_and_the_output_when_outputs_keep_their_dtype() -> None:
    loss, decisions = _scalar_loss()
    assert bridges_fp32(loss, decisions, outputs_fp32=True), "sum / num_items of a loss stays FP32"
    assert not bridges_fp32(loss, decisions, outputs_fp32=False), "low graph outputs: the output is no FP32 reader"
    loss, decisions = _scalar_loss(shape=(3,))
    assert not bridges_fp32(loss, decisions, outputs_fp32=True), "scalars only: a 1-dim value is not one"
    loss, decisions = _scalar_loss("fp16")
    assert not bridges_fp32(loss, decisions, outputs_fp32=True), "an fp16 graph input is not an FP32 operand"
    loss, decisions = _scalar_loss("module")
    assert not bridges_fp32(loss, decisions, outputs_fp32=True), "an undecided call_module passes nothing on"


@pytest.mark.parametrize(("casts", "bridges"), [(1, True), (3, True), (4, False)])
def test_bridges_fp32_looks_through_up_to_three_undecided_fp32_nodes(casts: int, bridges: bool) -> None:
    loss, decisions = _scalar_loss(casts=casts)
    assert bridges_fp32(loss, decisions, outputs_fp32=True) is bridges
