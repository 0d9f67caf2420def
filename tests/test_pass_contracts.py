"""Executable pass contracts: each pass's ``requires``/``ensures`` refuses a graph that breaks its condition
(with a typed error naming the pass), the manager runs them around every pass, and the declared precision
sequence is what ``rewrite()`` runs, holding every contract on the test models."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

import amplite.ops  # noqa: F401  (registers amplite::contract)
from amplite.converter import sequence
from amplite.converter.calibration import Calibrate
from amplite.converter.pipeline import rewrite
from amplite.converter.sequence import RetypeInputs, StripExportChecks, precision_sequence
from amplite.errors import InternalError
from amplite.passes.annotate_precision import AnnotatePrecision
from amplite.passes.base import (
    PassBase,
    PassContractError,
    PassManager,
    PassResult,
    PostconditionError,
    PreconditionError,
)
from amplite.passes.cleanup_casts import CleanupCasts
from amplite.passes.fold_batchnorm import FoldBatchNorm
from amplite.passes.fp8_matmul import Fp8Matmul
from amplite.passes.fuse_contractions import CONTRACT, FuseContractions
from amplite.passes.graph_utils import make_cast
from amplite.passes.guard_constants import GuardConstants, SaturateFills
from amplite.passes.inline_regions import InlineRegions
from amplite.passes.insert_casts import InsertCasts
from amplite.passes.meta import FP8_KEY, OUT_DTYPE_KEY, PRECISION_KEY, RANGE_KEY, RANGE_LOW_KEY, SATURATE_KEY
from amplite.passes.range_guard import RangeGuard, RangeRules, ValueRange
from amplite.passes.store_low_params import StoreLowPrecisionParams
from amplite.policy import Level, PrecisionPolicy
from amplite.spec import ConvertSpec
from fixtures.zoo import make
from tests.exported import export_eval

aten = torch.ops.aten
FP16 = PrecisionPolicy("fp16", Level.O2)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _ConvBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


def _mlp() -> torch.fx.GraphModule:
    return export_eval(_Mlp(), torch.randn(2, 8))


def _planned() -> torch.fx.GraphModule:
    gm = _mlp()
    AnnotatePrecision(FP16)(gm)
    return gm


def _node(gm: torch.fx.GraphModule, target: object) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.target is target)


def _refuses(error: type[PassContractError], name: str, check: object, gm: torch.fx.GraphModule, words: str) -> None:
    """``check(gm)`` raises ``error`` naming pass ``name`` and a condition containing ``words``."""
    with pytest.raises(error) as info:
        check(gm)  # type: ignore[operator]
    assert info.value.pass_name == name and words in info.value.condition, info.value.condition
    assert info.value.exit_code == 3 and f"pass {name}" in str(info.value)


# --- the manager ------------------------------------------------------------------------------------------


class _Recording(PassBase):
    name = "recording"

    def __init__(self, log: list[str], refuse: str = "") -> None:
        self.log, self.refuse = log, refuse

    def requires(self, gm: torch.fx.GraphModule) -> None:
        self.log.append("requires")
        if self.refuse == "requires":
            raise self.refuse_input("needs something else")

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        self.log.append("call")
        return PassResult(gm, False, Counter(seen=1))

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        self.log.append("ensures")
        if self.refuse == "ensures":
            raise self.broken("left the graph wrong")


def test_manager_runs_requires_then_the_pass_then_ensures_for_every_pass() -> None:
    log: list[str] = []
    _, records = PassManager([_Recording(log), _Recording(log)])(_mlp())
    assert log == ["requires", "call", "ensures"] * 2 and [r.counters for r in records] == [{"seen": 1}] * 2


def test_a_broken_precondition_stops_before_the_pass_and_a_broken_postcondition_after_it() -> None:
    log: list[str] = []
    _refuses(PreconditionError, "recording", PassManager([_Recording(log, "requires")]), _mlp(), "something else")
    assert log == ["requires"], "the pass did not run"
    log.clear()
    _refuses(PostconditionError, "recording", PassManager([_Recording(log, "ensures")]), _mlp(), "graph wrong")
    assert log == ["requires", "call", "ensures"]


def test_a_pass_without_a_contract_is_refused_and_a_crashing_condition_is_an_amplite_bug() -> None:
    class Bare:
        name = "bare"

        def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
            return PassResult(gm, False)

    with pytest.raises(TypeError, match="bare"):
        PassManager([Bare()])  # type: ignore[list-item]

    class Crashing(PassBase):
        name = "crashing"

        def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
            return PassResult(gm, False)

        def ensures(self, gm: torch.fx.GraphModule) -> None:
            raise KeyError("x")

    with pytest.raises(InternalError) as info:
        PassManager([Crashing()])(_mlp())
    assert "pass crashing (ensures) failed: KeyError" in str(info.value)


# --- each pass's condition --------------------------------------------------------------------------------


def test_inline_regions_ensures_no_region_is_left() -> None:
    gm = _mlp()
    region = torch.ops.higher_order.wrap_with_set_grad_enabled
    with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
        gm.graph.call_function(region, (False, None))
    _refuses(PostconditionError, "inline_regions", InlineRegions().ensures, gm, "still a sub-graph")


def test_strip_export_checks_ensures_no_assert_and_no_lifted_name() -> None:
    gm = torch.export.export(_Mlp().eval(), (torch.randn(2, 8),), strict=False).module()
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(x):
        gm.graph.call_function(aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32})
    _refuses(PostconditionError, "strip_export_checks", StripExportChecks().ensures, gm, "export check")
    _, (record,) = PassManager([StripExportChecks()])(gm)
    assert record.counters["checks_removed"] >= 1
    gm.register_buffer("lifted_tensor_0", torch.ones(1))
    with gm.graph.inserting_after(x):
        gm.graph.get_attr("lifted_tensor_0")
    _refuses(PostconditionError, "strip_export_checks", StripExportChecks().ensures, gm, "lifted_tensor_0")


def test_retype_inputs_requires_no_plan_and_ensures_no_fp32_input() -> None:
    _refuses(PreconditionError, "retype_inputs", RetypeInputs(torch.float16).requires, _planned(), "before the plan")
    _refuses(PostconditionError, "retype_inputs", RetypeInputs(torch.float16).ensures, _mlp(), "still float32")
    gm = _mlp()
    PassManager([RetypeInputs(torch.float16)])(gm)
    assert {n.meta["val"].dtype for n in gm.graph.nodes if n.op == "placeholder"} == {torch.float16}


def test_fold_batchnorm_requires_no_plan_and_ensures_no_foldable_batchnorm_is_left() -> None:
    gm = export_eval(_ConvBn(), torch.randn(1, 3, 8, 8))
    _refuses(PostconditionError, "fold_batchnorm", FoldBatchNorm().ensures, gm, "foldable convolution")
    AnnotatePrecision(FP16)(gm)
    _refuses(PreconditionError, "fold_batchnorm", FoldBatchNorm().requires, gm, "before the plan")
    gm = export_eval(_ConvBn(), torch.randn(1, 3, 8, 8))
    _, (record,) = PassManager([FoldBatchNorm()])(gm)
    assert record.counters["folded"] == 1


def test_calibrate_requires_the_fp32_graph_and_ensures_a_range_for_every_float_value() -> None:
    batch = ((torch.randn(2, 8),), {})
    _refuses(PreconditionError, "calibrate", Calibrate([batch], None, {}).requires, _planned(), "before the plan")
    _refuses(PostconditionError, "calibrate", Calibrate([batch], None, {}).ensures, _mlp(), "no calibrated range")
    Calibrate([], None, {}).ensures(_mlp())  # no batch, nothing to promise
    store: dict = {}
    gm = _mlp()
    _, (record,) = PassManager([Calibrate([batch], None, store)])(gm)
    linear = _node(gm, aten.linear.default)
    assert record.counters["batches"] == 1 and store[linear.name].max_abs > 0


def test_range_flags_are_reasons_and_never_both_kept_and_cleared() -> None:
    guard = RangeGuard({}, RangeRules(), torch.float16)
    gm = _mlp()
    _refuses(PreconditionError, "range_guard", guard.requires, _planned(), "before the plan")
    relu = _node(gm, aten.relu.default)
    relu.meta[RANGE_KEY] = ""
    _refuses(PostconditionError, "range_guard", guard.ensures, gm, "not a reason")
    relu.meta[RANGE_KEY], relu.meta[RANGE_LOW_KEY] = "range:activation", "small-integer-pow"
    _refuses(PostconditionError, "range_guard", guard.ensures, gm, "both")
    _refuses(PostconditionError, "guard_constants", GuardConstants(torch.float16).ensures, gm, "both")


def test_guard_constants_marks_only_fills_and_saturate_fills_consumes_every_mark() -> None:
    gm = _mlp()
    _node(gm, aten.linear.default).meta[SATURATE_KEY] = [("args", 1)]
    _refuses(PostconditionError, "guard_constants", GuardConstants(torch.float16).ensures, gm, "no fill, clamp")
    _refuses(PreconditionError, "saturate_fills", SaturateFills(torch.float16).requires, gm, "no planned dtype")
    AnnotatePrecision(FP16)(gm)
    _refuses(PostconditionError, "saturate_fills", SaturateFills(torch.float16).ensures, gm, "saturation mark")


def test_annotate_precision_requires_no_cast_and_ensures_every_float_op_is_decided() -> None:
    gm = _mlp()
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(x):
        make_cast(gm.graph, x, torch.float16)
    _refuses(PreconditionError, "annotate_precision", AnnotatePrecision(FP16).requires, gm, "plan before inserting")
    gm = _planned()
    relu = _node(gm, aten.relu.default)
    del relu.meta[PRECISION_KEY]
    _refuses(PostconditionError, "annotate_precision", AnnotatePrecision(FP16).ensures, gm, f"{relu.name} (relu")
    relu.meta[PRECISION_KEY] = {"mode": "half", "dtype": torch.float16, "reason": "", "rule": "level"}
    _refuses(PostconditionError, "annotate_precision", AnnotatePrecision(FP16).ensures, gm, "'half'")


def test_insert_casts_requires_the_plan_and_ensures_every_operand_arrives_in_the_compute_dtype() -> None:
    _refuses(PreconditionError, "insert_casts", InsertCasts().requires, _mlp(), "annotate_precision must run first")
    gm = _planned()  # planned fp16, no cast inserted: the first linear reads the fp32 input
    _refuses(PostconditionError, "insert_casts", InsertCasts().ensures, gm, "planned in float16 but reads x in float32")

    class Lazy(InsertCasts):  # a broken insert_casts: inserts nothing
        def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
            return PassResult(gm, False)

    with pytest.raises(PostconditionError, match="insert_casts"):
        PassManager([AnnotatePrecision(FP16), Lazy()])(_mlp())
    PassManager([AnnotatePrecision(FP16), InsertCasts()])(_mlp())  # the real one holds it


@pytest.mark.parametrize("kind", ["identity", "duplicate", "exact_chain"])
def test_cleanup_casts_ensures_no_identity_no_duplicate_and_no_exact_chain(kind: str) -> None:
    gm = _mlp()
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    linear = _node(gm, aten.linear.default)
    with gm.graph.inserting_before(linear):
        if kind == "identity":
            cast = make_cast(gm.graph, x, torch.float32)
        elif kind == "duplicate":
            make_cast(gm.graph, x, torch.float16)
            cast = make_cast(gm.graph, x, torch.float16)
        else:  # fp32 -> fp64 is exact: fp32 -> fp64 -> fp16 could read x directly
            cast = make_cast(gm.graph, make_cast(gm.graph, x, torch.float64), torch.float16)
    linear.args = (cast, *linear.args[1:])
    words = {"identity": "already has", "duplicate": "more than once", "exact_chain": "exact conversion"}[kind]
    _refuses(PostconditionError, "cleanup_casts", CleanupCasts().ensures, gm, words)
    _, (record,) = PassManager([CleanupCasts()])(gm)  # the pass itself removes it
    assert sum(record.counters.values()) >= 1


def test_fp8_matmul_ensures_no_site_is_left_unrewritten() -> None:
    gm = _planned()
    _node(gm, aten.linear.default).meta[FP8_KEY] = {"x": 0, "w": 1, "layout": "nk", "amax": None}
    _refuses(PreconditionError, "fp8_matmul", Fp8Matmul().requires, _mlp(), "no planned dtype")
    _refuses(PostconditionError, "fp8_matmul", Fp8Matmul().ensures, gm, "not rewritten")


def test_store_low_params_ensures_weights_stored_in_their_planned_dtype() -> None:
    gm = _mlp()
    weight = next(n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).endswith("weight"))
    with gm.graph.inserting_after(weight):
        cast = make_cast(gm.graph, weight, torch.float16)
    for user in list(weight.users):
        if user is not cast:
            user.replace_input_with(weight, cast)
    _refuses(PostconditionError, "store_low_params", StoreLowPrecisionParams().ensures, gm, "stored in FP32")
    StoreLowPrecisionParams(prefix="amplite_folded_").ensures(gm)  # out of its scope at O1
    PassManager([StoreLowPrecisionParams()], lint=False)(gm)
    assert weight.meta["val"].dtype == torch.float16
    weight.meta["val"] = weight.meta["val"].to(torch.float32)  # the plan and the stored tensor disagree
    _refuses(PostconditionError, "store_low_params", StoreLowPrecisionParams().ensures, gm, "planned in torch.float32")


@pytest.mark.parametrize(
    ("equation", "words"), [("ij,jk", "invalid equation"), ("ij,jk->ikl", "invalid equation"), ("i,jk->ik", "rank-2")]
)
def test_fuse_contractions_ensures_every_contract_has_a_valid_equation(equation: str, words: str) -> None:
    gm = export_eval(nn.Linear(8, 4, bias=False), torch.randn(2, 8))
    fuse = FuseContractions(dtypes=(torch.float32,), fuse_plain=True)
    PassManager([fuse])(gm)
    contract = _node(gm, CONTRACT)
    assert contract.args[0] and fuse.ensures(gm) is None  # the real fusion holds it
    contract.args = (equation, *contract.args[1:])
    _refuses(PostconditionError, "fuse_contractions", fuse.ensures, gm, words)


def test_a_plan_the_graph_does_not_compute_breaks_the_sequences_postcondition(monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_dtypes`` is the precision sequence's ensures: a pass that makes a node compute in another dtype
    than planned (and states no condition of its own) is caught there, as the sequence's PostconditionError."""

    class Widen(PassBase):
        name = "widen"

        def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
            relu = _node(gm, aten.relu.default)
            with gm.graph.inserting_before(relu):
                wide = gm.graph.call_function(aten._to_copy.default, (relu.args[0],), {"dtype": torch.float64})
            relu.args = (wide, *relu.args[1:])
            return PassResult(gm, True)

    real = sequence.build_passes
    monkeypatch.setattr(sequence, "build_passes", lambda *a, **k: [*real(*a, **k), Widen()])
    model, x = _Mlp().eval(), torch.randn(2, 8)
    with pytest.raises(PostconditionError) as info:
        rewrite(torch.export.export(model, (x,), strict=False), ((x,), {}), _spec(FP16))
    assert info.value.pass_name == "precision" and "planned to produce float16 but produces float64" in str(info.value)


# --- the declared sequence --------------------------------------------------------------------------------


def _spec(
    policy: PrecisionPolicy,
    range_rules: RangeRules | None = None,
    fold_batchnorm: bool = True,
    fuse_contractions: bool = False,
) -> ConvertSpec:
    """The spec ``rewrite`` takes for a policy and the sequence's settings (default range rules only)."""
    assert range_rules in (None, RangeRules())
    precision = "fp8" if policy.fp8 else "fp16" if policy.low_dtype == torch.float16 else "bf16"
    return ConvertSpec.build(precision=precision, level=policy.level, low_precision_io=policy.low_precision_io,
                             range_rules=range_rules is not None, fold_batchnorm=fold_batchnorm,
                             fuse_contractions=fuse_contractions, calibrated=policy.fp8 == "static")  # fmt: skip


_SETTINGS = [
    ("cnn", PrecisionPolicy("fp16", Level.O1), {"range_rules": RangeRules()}),
    ("cnn", PrecisionPolicy("bf16", Level.O2), {"range_rules": RangeRules(), "fold_batchnorm": False}),
    ("transformer", PrecisionPolicy("fp16", Level.O2), {"range_rules": RangeRules(), "fuse_contractions": True}),
    ("transformer", PrecisionPolicy("fp16", Level.O2, low_precision_io=True), {}),
    ("rmsnorm", PrecisionPolicy("fp16", Level.O3), {"range_rules": RangeRules()}),
    ("mlp", PrecisionPolicy("bf16", Level.O2, fp8="static"), {"range_rules": RangeRules()}),
]


@pytest.mark.parametrize(("fixture", "policy", "settings"), _SETTINGS, ids=lambda v: getattr(v, "__name__", None))
def test_the_printed_sequence_is_what_runs_and_holds_every_contract_on_the_test_models(
    fixture: str, policy: PrecisionPolicy, settings: dict
) -> None:
    model, inputs = make(fixture)
    program = torch.export.export(model, inputs[0], inputs[1], strict=False)
    declared = precision_sequence(policy, [inputs], **settings).manager
    done = rewrite(program, inputs, _spec(policy, **settings))  # every requires/ensures ran, and the postcondition
    assert [r.name for r in done.records] == declared.names()
    line = declared.describe()
    assert line.startswith("precision: inline_regions → strip_export_checks → ")
    assert line.endswith("; ensures check_dtypes")
    assert line.removeprefix("precision: ").removesuffix("; ensures check_dtypes").split(" → ") == declared.names()[:-1]
    ran = set(declared.names())
    assert ("fold_batchnorm" in ran) == settings.get("fold_batchnorm", True)
    assert ("calibrate" in ran) == (
        (policy.low_dtype == torch.float16 and "range_rules" in settings) or policy.fp8 == "static"
    )
    assert ("retype_inputs" in ran) == policy.low_precision_io
    assert ("fuse_contractions" in ran) == settings.get("fuse_contractions", False)


def test_docs_quote_the_full_sequence() -> None:
    """docs/architecture.md shows the sequence with every optional pass on, as ``describe()`` prints it."""
    from pathlib import Path

    policy = PrecisionPolicy("bf16", Level.O2, low_precision_io=True, fp8="static")
    line = precision_sequence(policy, [], range_rules=RangeRules(), fuse_contractions=True).manager.describe()
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    assert line in " ".join(text.split()), line


def test_a_given_range_map_skips_calibration_and_is_what_the_range_rules_read() -> None:
    model, inputs = make("mlp")
    program = torch.export.export(model, inputs[0], inputs[1], strict=False)
    first = rewrite(program, inputs, _spec(FP16, range_rules=RangeRules()))
    again = rewrite(program, inputs, _spec(FP16, range_rules=RangeRules()), ranges=first.ranges)
    assert "calibrate" in [r.name for r in first.records] and "calibrate" not in [r.name for r in again.records]
    assert again.ranges == first.ranges and again.plan == first.plan
    assert "calibration" in first.timings and "calibration" not in again.timings


# --- annotate_precision on graphs built by hand (milliseconds: within the mutation run's per-mutant budget) ---


def _call(graph: torch.fx.Graph, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
    """A ``call_function`` node whose value is ``target`` run on its arguments' values."""
    node = graph.call_function(target, args, kwargs)
    a, k = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    node.meta["val"] = target(*a, **k)
    return node


def _value(graph: torch.fx.Graph, name: str, value: torch.Tensor, op: str = "placeholder") -> torch.fx.Node:
    node = graph.placeholder(name) if op == "placeholder" else graph.get_attr(name)
    node.meta["val"] = value
    return node


def halve(x: torch.Tensor) -> torch.Tensor:
    return x / 2


@pytest.mark.parametrize(
    ("low", "level", "build"),
    [
        # a 0-dim FP32 operand does not widen a float16 product (type promotion): the product takes the compute dtype
        ("bf16", Level.O2, lambda g: _call(g, aten.mul.Tensor, _value(g, "x", torch.randn(4, 8, dtype=torch.float16)),
                                           _value(g, "s", torch.tensor(2.0)))),
        # a norm's FP32 statistics of a bf16 input stay FP32 in float16 too; its result takes the compute dtype
        ("fp16", Level.O3, lambda g: _call(g, aten._fused_rms_norm.default,
                                           _value(g, "x", torch.randn(2, 8, dtype=torch.bfloat16)), [8],
                                           _value(g, "w", torch.randn(8, dtype=torch.bfloat16)), 1e-5)),
        # an explicit dtype= keeps its dtype
        ("fp16", Level.O3, lambda g: _call(g, aten.sum.dim_IntList, _value(g, "x", torch.randn(2, 8)), [1],
                                           dtype=torch.float32)),
    ],
    ids=["half-times-fp32-scalar", "rms-norm-fp32-statistics", "explicit-dtype"],
)  # fmt: skip
def test_the_planned_dtype_is_what_the_op_gives_on_operands_cast_to_its_compute_dtype(
    low: str, level: Level, build: Any
) -> None:
    g = torch.fx.Graph()
    node = build(g)
    g.output(node)
    AnnotatePrecision(PrecisionPolicy(low, level))(torch.fx.GraphModule(nn.Module(), g))
    compute = node.meta[PRECISION_KEY]["dtype"]
    assert compute is not None and compute != torch.float32, node.meta[PRECISION_KEY]

    def cast(a: torch.fx.Node) -> Any:
        v = a.meta["val"]
        return v.to(compute) if v.dtype.is_floating_point else v

    a, k = torch.fx.node.map_arg((node.args, node.kwargs), cast)
    out = node.target(*a, **k)
    actual = tuple(t.dtype for t in out) if isinstance(out, tuple) else out.dtype
    assert node.meta[OUT_DTYPE_KEY] == actual


def test_annotate_precision_ensures_every_op_reading_or_producing_a_float_has_a_decision() -> None:
    g = torch.fx.Graph()
    x = _value(g, "x", torch.randn(2, 8))
    arg, zeros, third = (_call(g, aten.argmax.default, x, 1), _call(g, aten.zeros.default, [2, 8]),
                         _call(g, halve, x))  # fmt: skip
    g.output((arg, zeros, third))
    gm = torch.fx.GraphModule(nn.Module(), g)
    check = AnnotatePrecision(FP16)
    check(gm)
    check.ensures(gm)
    # a float operand and an integer result, no operand and a float result, a Python function
    for node, op in ((arg, "argmax.default"), (zeros, "zeros.default"), (third, str(halve))):
        plan = node.meta.pop(PRECISION_KEY)
        words = f"node {node.name} ({op}) touches a float"
        _refuses(PostconditionError, "annotate_precision", check.ensures, gm, words)
        node.meta[PRECISION_KEY] = plan
    del zeros.meta[OUT_DTYPE_KEY]
    _refuses(PostconditionError, "annotate_precision", check.ensures, gm, f"node {zeros.name} has no planned dtype")


def test_fp8_keeps_an_activation_that_overflows_e4m3_out_unless_the_clip_check_is_off() -> None:
    """The overflow rule is on by default; only low products run in FP8, other low ops keep their reason."""
    root = nn.Module()
    root.W = nn.Parameter(torch.randn(8, 16))

    def planned(**kw: Any) -> dict[str, torch.fx.Node]:
        g = torch.fx.Graph()
        x = _value(g, "x", torch.randn(4, 16))
        linear = _call(g, aten.linear.default, x, _value(g, "W", root.W, op="get_attr"))
        g.output(_call(g, aten.add.Tensor, linear, linear))
        gm = torch.fx.GraphModule(root, g)
        ranges = {"x": ValueRange(max_abs=1000.0, percentile_abs=1.0)}  # max far beyond 448 x its scale
        AnnotatePrecision(PrecisionPolicy("bf16", Level.O2, fp8="static"), ranges, **kw)(gm)
        return {n.name: n for n in gm.graph.nodes}

    nodes = planned()
    linear = next(n for n in nodes.values() if n.target is aten.linear.default)
    add = next(n for n in nodes.values() if n.target is aten.add.Tensor)
    assert linear.meta[PRECISION_KEY]["reason"].startswith("fp8-range:overflow max|x|=1000")
    assert FP8_KEY not in linear.meta and add.meta[PRECISION_KEY]["reason"] == "level:O2"
    nodes = planned(fp8_clip_check=False)
    linear = next(n for n in nodes.values() if n.target is aten.linear.default)
    add = next(n for n in nodes.values() if n.target is aten.add.Tensor)
    assert linear.meta[PRECISION_KEY]["reason"] == "fp8:static" and linear.meta[FP8_KEY]["amax"] == 1.0
    assert FP8_KEY not in add.meta and add.meta[PRECISION_KEY]["reason"] == "level:O2"
