"""Verification metrics, tolerance criteria and their parser (no model conversion here)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from amplite.errors import ConfigError, InputSpecError
from amplite.verify.compare import (
    DEFAULT_TOLERANCES,
    Criterion,
    Tolerance,
    compare,
    compare_batches,
    parse_criterion,
    parse_tolerance,
    tensor_metrics,
)
from amplite.verify.criteria import check_scopes

FP16 = DEFAULT_TOLERANCES["fp16"]


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    ("text", "metric", "op", "threshold", "output"),
    [
        ("sqnr>=45", "sqnr_db", ">=", 45.0, None),
        ("top1>=0.999", "top1", ">=", 0.999, None),
        ("max_abs<=1e-2", "max_abs", "<=", 1e-2, None),
        ("logits:sqnr>=40", "sqnr_db", ">=", 40.0, "logits"),
        ("quantile<=0.5", "p99_abs", "<=", 0.5, None),
        ("p95<=1e-3", "p95_abs", "<=", 1e-3, None),
        ("out*:cos > 0.99", "cosine", ">", 0.99, "out*"),
    ],
)
def test_parse_criterion(text: str, metric: str, op: str, threshold: float, output: str | None) -> None:
    c = parse_criterion(text)
    assert (c.metric, c.op, c.threshold, c.output) == (metric, op, threshold, output)
    assert parse_criterion(str(c)) == c  # the canonical text reads back to the same criterion


def test_parse_allclose_and_precise_thresholds() -> None:
    c = parse_criterion("x:allclose(atol=1e-3,rtol=1e-2)")
    assert (c.metric, c.atol, c.rtol, c.op, c.threshold, c.output) == ("allclose", 1e-3, 1e-2, ">=", 1.0, "x")
    assert parse_criterion(str(parse_criterion("top1>=0.99999999"))).threshold == 0.99999999


@pytest.mark.parametrize("bad", ["sqnr", "foo>=3", "sqnr>=x", "allclose(btol=1)", ">=3", "p0<=1"])
def test_parse_criterion_rejects(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_criterion(bad)
    assert "\n" not in info.value.one_line() and "fix:" in info.value.one_line()


def test_parse_tolerance_splits_and_keeps_defaults() -> None:
    tol = parse_tolerance(["sqnr>=45; logits:top1>=0.999", "allclose(atol=1e-3,rtol=1e-3),max<=1"], "bf16")
    assert tol.min_sqnr_db == DEFAULT_TOLERANCES["bf16"].min_sqnr_db
    assert [parse_criterion(c).metric for c in tol.criteria] == ["sqnr_db", "top1", "allclose", "max_abs"]
    json.dumps(vars(tol))  # the report stores vars(tolerance): it must be JSON as it is
    with pytest.raises(ConfigError):
        parse_tolerance([], "fp4")
    assert parse_tolerance([], "fp8").min_sqnr_db == DEFAULT_TOLERANCES["fp8"].min_sqnr_db  # --precision fp8


def test_scoped_criteria_replace_unscoped_for_their_output() -> None:
    tol = parse_tolerance(["sqnr>=45", "logits:top1>=0.999"])
    logits = [str(c) for c in tol.criteria_for("output['logits']", True)]
    other = [str(c) for c in tol.criteria_for("output['hidden']", True)]
    assert logits == ["logits:top1>=0.999", "new_nonfinite<=0"]
    assert other == ["sqnr_db>=45", "new_nonfinite<=0"]
    assert [str(c) for c in FP16.criteria_for("output", True)] == ["sqnr_db>=40", "cosine>=0.999", "new_nonfinite<=0"]
    assert [str(c) for c in FP16.criteria_for("output", False)] == ["mismatch<=0.01"]


def test_metrics_of_a_known_relative_error() -> None:
    ref = torch.randn(64, 100, generator=_g(), dtype=torch.float64)
    eps = 1e-3
    m = tensor_metrics("output", ref, ref * (1 + eps), FP16)
    assert m.sqnr_db == pytest.approx(-20 * math.log10(eps), abs=1e-6)
    assert m.cosine == pytest.approx(1.0, abs=1e-12)
    assert m.min_atol == pytest.approx(float(ref.abs().max()) * eps, rel=1e-6)
    assert m.min_rtol == pytest.approx(eps, rel=1e-6)
    diff = (ref.double() * eps).abs().flatten().numpy()
    assert m.p99_abs == pytest.approx(float(np.percentile(diff, 99, method="inverted_cdf")), rel=1e-9)
    assert m.mean_abs == pytest.approx(float(diff.mean()), rel=1e-9)
    assert m.top1 == 1.0 and m.top5 == 1.0
    assert 0 < m.kl_div < 1e-5  # scaling logits by 1.001 is a slight change of temperature
    assert m.passed


def test_top1_top5_and_kl() -> None:
    ref = torch.randn(10, 8, generator=_g(1)).double()
    out = ref.clone()
    a = int(ref[0].argmax())
    b = int(ref[0].argsort()[-2])  # runner-up: swapping makes row 0 disagree on top-1 but keeps top-5
    out[0, a], out[0, b] = ref[0, b], ref[0, a]
    out[1] = -ref[1]  # row 1: the reference's top class becomes the smallest (outside the top-5 of 8)
    m = tensor_metrics("output", ref, out, Tolerance(0, 0))
    assert m.top1 == pytest.approx(0.8)
    assert m.top5 == pytest.approx(0.9)
    p, q = torch.softmax(ref, -1), torch.softmax(out, -1)
    assert m.kl_div == pytest.approx(float((p * (p.log() - q.log())).sum(-1).mean()), rel=1e-9)


def test_allclose_and_quantile_criteria() -> None:
    ref = torch.zeros(1000, dtype=torch.float64)
    out = ref.clone()
    out[:10] = 1.0  # 1 % of the elements are off by 1
    tol = parse_tolerance(["allclose(atol=0.5,rtol=0)>=0.99", "p98<=0.1", "p99.5<=0.1"])
    m = tensor_metrics("output", ref, out, tol)
    values = {c["criterion"]: (c["value"], c["passed"]) for c in m.checks}
    assert values["allclose(atol=0.5,rtol=0)>=0.99"] == (0.99, True)
    assert values["p98_abs<=0.1"] == (0.0, True)
    assert values["p99.5_abs<=0.1"] == (1.0, False)
    assert not m.passed


def test_default_tolerance_is_tighter_for_fp16_than_bf16() -> None:
    ref = torch.randn(4096, generator=_g(2)).double()
    noise = torch.randn(4096, generator=_g(3)).double()
    out = ref + noise * (ref.norm() / noise.norm()) * 10 ** (-32 / 20)  # exactly 32 dB SQNR
    assert tensor_metrics("o", ref, out, FP16).sqnr_db == pytest.approx(32.0, abs=1e-6)
    assert not tensor_metrics("o", ref, out, FP16).passed
    assert tensor_metrics("o", ref, out, DEFAULT_TOLERANCES["bf16"]).passed


def test_nonfinite_handling() -> None:
    ref = torch.ones(8)
    out = ref.clone()
    out[3] = float("inf")
    m = tensor_metrics("o", ref, out, FP16)
    assert (m.new_nonfinite, m.passed) == (1, False)
    ref_inf = ref.clone()
    ref_inf[0] = -float("inf")
    m = tensor_metrics("o", ref_inf, ref_inf.clone(), FP16)
    assert m.passed and m.ref_nonfinite == 1 and m.new_nonfinite == 0
    ref_nan = ref.clone()
    ref_nan[0] = float("nan")
    m = tensor_metrics("o", ref_nan, ref_nan.clone(), FP16)
    assert not m.passed and m.ref_nan == 1  # no fake pass against a broken reference
    assert "NaN" in m.notes[0]


def test_inapplicable_unscoped_criterion_falls_back_to_defaults() -> None:
    tol = parse_tolerance(["top1>=0.9"])
    ref = torch.randn(16, generator=_g(4))  # a vector: top-1 does not apply (it has no class dimension)
    m = tensor_metrics("o", ref.unsqueeze(0)[:, :1].flatten(), (ref * 2).unsqueeze(0)[:, :1].flatten(), tol)
    assert {c["criterion"] for c in m.checks} >= {"sqnr_db>=40", "cosine>=0.999"}
    assert not m.passed  # a factor of 2 is far outside the default
    scoped = parse_tolerance(["o:top1>=0.9"])
    m = tensor_metrics("o", ref[:1], ref[:1], scoped)
    assert not m.passed and m.checks[0]["value"] is None  # asked for explicitly: cannot be judged = fail


def test_integer_outputs_use_mismatch() -> None:
    ref = torch.arange(200)
    out = ref.clone()
    out[:3] = -1
    m = tensor_metrics("ids", ref, out, FP16)
    assert m.mismatch == pytest.approx(0.015) and not m.passed
    assert tensor_metrics("ids", ref, out, Tolerance(40, 0.999, max_mismatch=0.02)).passed


def test_batches_are_judged_together() -> None:
    refs = [torch.randn(3, 7, generator=_g(i)) for i in range(3)]
    outs = [r + 1e-3 * torch.randn(3, 7, generator=_g(10 + i)) for i, r in enumerate(refs)]
    joined = compare(torch.cat(refs), torch.cat(outs), FP16)[0]
    per = compare_batches(list(zip(refs, outs, strict=True)), FP16)[0]
    assert per.batches == 3 and per.shape == [3, 7]
    for key in ("sqnr_db", "max_abs", "mean_abs", "p99_abs", "cosine", "top1", "kl_div", "min_rtol"):
        assert getattr(per, key) == pytest.approx(getattr(joined, key), rel=1e-12)


def test_output_names_and_to_dict() -> None:
    ref = {"logits": torch.randn(2, 4, generator=_g()), "aux": (torch.ones(3), torch.arange(3))}
    ms = compare(ref, ref, FP16)
    assert [m.name for m in ms] == ["output['logits']", "output['aux'][0]", "output['aux'][1]"]
    d = ms[0].to_dict()
    assert d["sqnr_db"] == "inf" and json.loads(json.dumps(d))["passed"] is True


def test_criterion_scope_matches_key_and_glob() -> None:
    c = Criterion("sqnr_db", ">=", 1, "log*")
    assert c.applies_to("output['logits']") and not c.applies_to("output['hidden']")
    assert Criterion("sqnr_db", ">=", 1, "0").applies_to("output[0]")


INF, NAN = float("inf"), float("nan")


def test_float_metrics_of_hand_computed_errors() -> None:
    """Every float metric of a 4-element output whose errors are worked out by hand.

    ref = [1000, 1, 0.5, 0], out = [1000, 1.5, 1, 0]: |diff| = [0, 0.5, 0.5, 0].
    max_rel counts only |ref| >= 1e-3 * 1000 = 1 (the boundary element 1 is in, 0.5 is out): 0.5 / 1.
    min_rtol is over every non-zero reference element: max(0, 0.5, 1.0) = 1.0 (the zero has no error).
    SQNR = 20 log10(|ref| / |diff|) with |ref|^2 = 1e6 + 1.25, |diff|^2 = 0.5.
    """
    ref = torch.tensor([1000.0, 1.0, 0.5, 0.0])
    out = torch.tensor([1000.0, 1.5, 1.0, 0.0], dtype=torch.float16)
    m = tensor_metrics("output", ref, out, FP16)
    assert (m.name, m.shape, m.dtype) == ("output", [4], "float16"), "shape of the reference, dtype of the output"
    assert (m.elements, m.compared, m.batches) == (4, 4, 1)
    assert m.max_abs == 0.5 and m.min_atol == 0.5 and m.mean_abs == 0.25
    assert m.p99_abs == 0.5, "nearest rank: ceil(0.99 * 4) = 4th smallest |diff|"
    assert m.max_rel == 0.5, "|ref| = 1 is exactly 1e-3 of the largest, so it counts; |ref| = 0.5 does not"
    assert m.min_rtol == 1.0
    rn, en, on = math.sqrt(1e6 + 1.25), math.sqrt(0.5), math.sqrt(1e6 + 2.25 + 1)
    assert m.sqnr_db == pytest.approx(20 * math.log10(rn / en), abs=1e-9)
    assert m.cosine == pytest.approx((1e6 + 1.5 + 0.5) / (rn * on), abs=1e-12)
    assert (m.ref_nonfinite, m.out_nonfinite, m.new_nonfinite, m.ref_nan) == (0, 0, 0, 0)
    assert m.notes == []
    assert m.passed, "about 63 dB, cosine ~1: the fp16 default passes"
    assert m.checks == [
        {"criterion": "sqnr_db>=40", "value": m.sqnr_db, "passed": True},
        {"criterion": "cosine>=0.999", "value": m.cosine, "passed": True},
        {"criterion": "new_nonfinite<=0", "value": 0.0, "passed": True},
    ]


def test_batch_shape_is_reported_when_given() -> None:
    """compare_batches passes one batch's shape; tensor_metrics reports it instead of the stacked shape."""
    m = tensor_metrics("o", torch.ones(6), torch.ones(6), FP16, batch_shape=[3])
    assert m.shape == [3] and m.elements == 6


def test_zero_reference_values() -> None:
    """A zero reference element that differs makes min_rtol infinite; an all-zero reference gives -inf dB."""
    m = tensor_metrics("o", torch.tensor([0.0, 2.0]), torch.tensor([0.25, 2.0]), FP16)
    assert m.min_rtol == INF, "no rtol makes |0.25 - 0| <= rtol * 0"
    assert m.max_rel == 0.0, "the zero is below 1e-3 of the largest |ref|: not a relative error"
    zero = tensor_metrics("o", torch.zeros(3), torch.tensor([0.0, 0.5, 0.0]), FP16)
    assert zero.sqnr_db == -INF and zero.cosine == 0.0 and zero.min_rtol == INF
    assert not zero.passed
    same = tensor_metrics("o", torch.zeros(3), torch.zeros(3), FP16)
    assert same.sqnr_db == INF and same.cosine == 1.0, "two zero vectors are identical: cosine 1"
    assert (same.min_rtol, same.max_abs) == (0.0, 0.0) and same.passed
    zero_out = tensor_metrics("o", torch.tensor([1.0, 2.0]), torch.zeros(2), FP16)
    assert zero_out.cosine == 0.0 and zero_out.sqnr_db == 0.0, "|ref| / |ref - 0| = 1: 0 dB"


def test_nonfinite_counts_and_notes() -> None:
    """±Inf in the reference is left out, NaN/Inf new in the output fails, and the notes say how many."""
    ref = torch.tensor([1.0, INF, 2.0, 4.0])
    out = torch.tensor([1.0, INF, NAN, 4.0])
    m = tensor_metrics("o", ref, out, FP16)
    assert (m.ref_nonfinite, m.out_nonfinite, m.new_nonfinite, m.ref_nan) == (1, 2, 1, 0)
    assert (m.elements, m.compared) == (4, 2)
    assert m.notes == [
        "metrics computed on the finite part only (2 of 4 elements, 50.0%); 2 are NaN/Inf",
        "reference has 1 ±Inf values: they are excluded from the metrics",
        "1 values are NaN/Inf in the converted output only",
    ]
    assert m.top1 is None and m.kl_div is None, "class metrics need every value finite"
    assert m.sqnr_db == INF and not m.passed
    assert m.checks[-1] == {"criterion": "new_nonfinite<=0", "value": 1.0, "passed": False}


def test_nan_in_the_reference_fails_even_when_every_check_holds() -> None:
    """NaN in the FP32 reference: nothing to verify against, so the output fails with its own note."""
    ref = torch.tensor([NAN, 1.0, 2.0])
    m = tensor_metrics("o", ref, ref.clone(), FP16)
    assert (m.ref_nan, m.ref_nonfinite, m.out_nonfinite, m.new_nonfinite) == (1, 1, 1, 0)
    assert m.notes == [
        "metrics computed on the finite part only (2 of 3 elements, 66.7%); 1 are NaN/Inf",
        "the FP32 reference output has 1 NaN values: nothing to verify against",
    ]
    assert all(c["passed"] for c in m.checks) and not m.passed


def test_no_finite_values() -> None:
    """All values NaN/Inf in one of the two: -inf dB, cosine 0, fail with a note, defaults still listed."""
    m = tensor_metrics("o", torch.ones(2, 3), torch.full((2, 3), INF), FP16)
    assert (m.sqnr_db, m.cosine, m.compared, m.elements) == (-INF, 0.0, 0, 6)
    assert m.notes == [
        "metrics computed on the finite part only (0 of 6 elements, 0.0%); 6 are NaN/Inf",
        "6 values are NaN/Inf in the converted output only",
        "no finite values to compare",
    ]
    assert [c["criterion"] for c in m.checks] == ["sqnr_db>=40", "cosine>=0.999", "new_nonfinite<=0"]
    assert not m.passed


def test_integer_and_bool_outputs() -> None:
    """Integer/bool outputs are judged by the fraction of differing elements, after casting to the ref dtype."""
    m = tensor_metrics("ids", torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4], dtype=torch.int32), FP16)
    assert (m.mismatch, m.elements, m.compared, m.dtype) == (0.25, 4, 4, "int32")
    assert m.checks == [{"criterion": "mismatch<=0.01", "value": 0.25, "passed": False}] and not m.passed
    assert m.sqnr_db == INF and m.top1 is None, "float metrics stay at their defaults"
    flags = tensor_metrics("mask", torch.tensor([True, False]), torch.tensor([True, False]), FP16)
    assert flags.mismatch == 0.0 and flags.passed and flags.dtype == "bool"
    floats_out = tensor_metrics("ids", torch.tensor([1, 2]), torch.tensor([1.0, 3.0]), FP16)
    assert floats_out.mismatch == 0.5, "the output is compared in the reference's integer dtype"
    as_ints = tensor_metrics("mask", torch.tensor([False, True]), torch.tensor([0, 3]), FP16)
    assert as_ints.mismatch == 0.0, "a mask returned as integers reads as bool: non-zero is True"


def test_class_metrics_need_two_classes_and_top5_needs_six() -> None:
    """top1 from a last dimension of 2, top5 only from 6 classes on; a 0-d output has neither."""
    two = tensor_metrics("o", torch.tensor([[1.0, 2.0]]), torch.tensor([[2.0, 1.0]]), Tolerance(0, -1))
    assert two.top1 == 0.0 and two.top5 is None
    one = tensor_metrics("o", torch.tensor([[1.0], [2.0]]), torch.tensor([[1.0], [2.0]]), FP16)
    assert one.top1 is None and one.kl_div is None
    scalar = tensor_metrics("o", torch.tensor(3.0), torch.tensor(3.0), FP16)
    assert scalar.top1 is None and scalar.shape == []
    five = tensor_metrics("o", torch.arange(5.0), torch.arange(5.0).flip(0), Tolerance(0, -1))
    assert five.top1 == 0.0 and five.top5 is None
    six_ref = torch.arange(6.0)
    six_out = six_ref.clone()
    six_out[5] = -1.0  # the reference's top class (5) becomes the smallest: outside the top 5 of 6
    six = tensor_metrics("o", six_ref, six_out, Tolerance(0, -1))
    assert six.top1 == 0.0 and six.top5 == 0.0
    six_out[5] = 1.5  # now fourth largest (above 1 and 0): inside the top 5
    assert tensor_metrics("o", six_ref, six_out, Tolerance(0, -1)).top5 == 1.0


def test_kl_divergence_of_two_known_distributions() -> None:
    """KL(softmax(ref) || softmax(out)) of [0, 0] against [0, ln 3]: p = (1/2, 1/2), q = (1/4, 3/4)."""
    ref, out = torch.tensor([0.0, 0.0], dtype=torch.float64), torch.tensor([0.0, math.log(3)], dtype=torch.float64)
    m = tensor_metrics("o", ref, out, Tolerance(0, -1))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert m.kl_div == pytest.approx(expected, abs=1e-12) and m.kl_div > 0
    same = tensor_metrics("o", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), FP16)
    assert same.kl_div == 0.0


def test_allclose_boundary_and_quantiles() -> None:
    """allclose counts |diff| <= atol + rtol * |ref| (equality is close); pNN is the nearest-rank percentile."""
    ref = torch.tensor([1.0, 2.0, 4.0, 8.0])
    out = torch.tensor([1.5, 2.0, 5.0, 8.0])  # |diff| = [0.5, 0, 1, 0]
    tol = parse_tolerance(["allclose(atol=0.25,rtol=0.25)", "p50<=0", "p51<=0", "p99<=1", "p100<=1"])
    m = tensor_metrics("o", ref, out, tol)
    values = {c["criterion"]: (c["value"], c["passed"]) for c in m.checks}
    # limits 0.5, 0.75, 1.25, 2.25: the first is met with equality, so every element is close
    assert values["allclose(atol=0.25,rtol=0.25)>=1"] == (1.0, True)
    assert values["p50_abs<=0"] == (0.0, True), "ceil(0.5 * 4) = 2nd smallest |diff| = 0"
    assert values["p51_abs<=0"] == (0.5, False), "ceil(0.51 * 4) = 3rd smallest = 0.5"
    assert values["p99_abs<=1"] == (1.0, True) and values["p100_abs<=1"] == (1.0, True)
    tight = tensor_metrics("o", ref, out, parse_tolerance(["allclose(atol=0.2,rtol=0.25)"]))
    assert tight.checks[0]["value"] == 0.75, "limit 0.45 at ref 1: one of four elements is not close"


def test_scoped_inapplicable_criterion_fails_with_a_note() -> None:
    """A criterion scoped to an output whose metric it lacks fails with a note; unscoped, it is skipped."""
    tol = parse_tolerance(["o:top1>=0.5"])
    m = tensor_metrics("o", torch.tensor([[1.0], [2.0]]), torch.tensor([[1.0], [2.0]]), tol)
    assert not m.passed
    assert m.checks[0] == {"criterion": "o:top1>=0.5", "value": None, "passed": False}
    assert m.notes == ["top1 cannot be computed for this output"]
    unscoped = tensor_metrics(
        "o", torch.tensor([[1.0], [2.0]]), torch.tensor([[1.0], [2.0]]), parse_tolerance(["top1>=0.5", "max_abs<=0"])
    )
    assert unscoped.passed and [c["criterion"] for c in unscoped.checks] == ["max_abs<=0", "new_nonfinite<=0"]


def test_unmatched_scope_fails_loudly_with_the_output_keys() -> None:
    """A scope that matches no output raises, listing the outputs' keys once each and a fixed example."""
    tol = parse_tolerance(["hidden:sqnr>=40"])
    with pytest.raises(ConfigError) as info:
        check_scopes(tol, ["output['logits']", "output[0]", "output['a']['logits']"])
    # the criterion and its scope, the outputs it could name (each once), and a fixed example of the criterion
    problem, fix = info.value.problem, info.value.fix
    assert "'hidden:sqnr_db>=40'" in problem and "'hidden'" in problem and problem.count("logits") == 1
    assert problem.endswith("logits, 0")
    assert "e.g. logits:sqnr_db>=40" in fix and fix.endswith(" or leave the scope out to judge every output")
    with pytest.raises(ConfigError) as info:
        check_scopes(tol, [])
    assert "(e.g. output:sqnr_db>=40)" in info.value.one_line()
    with pytest.raises(ConfigError) as info:  # a scope may hold ':' (the last one ends it): the example drops it all
        check_scopes(parse_tolerance(["a:b:sqnr>=40"]), ["output['logits']"])
    assert "names output 'a:b'" in info.value.one_line() and "(e.g. logits:sqnr_db>=40)" in info.value.one_line()
    check_scopes(parse_tolerance(["logits:sqnr>=40", "sqnr>=30"]), ["output['logits']"])  # matched: no error
    check_scopes(parse_tolerance(["0:sqnr>=40"]), ["output['logits']", "output[0]"])  # the second matches


def test_compare_batches_names_outputs_after_the_reference() -> None:
    """Output names come from the reference's pytree, and a matching scope is applied, not rejected."""
    t = torch.tensor([[1.0, 2.0]])
    (m,) = compare_batches([({"logits": t}, (t.clone(),))], parse_tolerance(["logits:max_abs<=0"]))
    assert m.name == "output['logits']" and m.passed
    assert [c["criterion"] for c in m.checks] == ["logits:max_abs<=0", "new_nonfinite<=0"]
    with pytest.raises(ConfigError):
        compare_batches([({"logits": t}, (t,))], parse_tolerance(["hidden:max_abs<=0"]))


def test_compare_batches_rejects_a_different_number_of_outputs() -> None:
    """Converted and reference outputs must agree in number, in every batch, with the message users see."""
    t = torch.ones(2)
    with pytest.raises(InputSpecError) as info:
        compare_batches([((t, t), (t,))], FP16)
    assert "returned 1 outputs" in info.value.problem and "reference 2" in info.value.problem
    assert info.value.fix.startswith("compare models with the same outputs") and "--debug" in info.value.fix
    with pytest.raises(InputSpecError) as info:  # batch 2 returns three outputs in both models
        compare_batches([((t, t), (t, t)), ((t, t, t), (t, t, t))], FP16)
    assert "returned 3 outputs" in info.value.problem and "reference 3" in info.value.problem


def test_max_rel_of_an_all_zero_reference() -> None:
    """An exact all-zero output has no relative error (it was NaN, 0/0, failing max_rel<=0.01 on a perfect
    match); a non-zero output against an all-zero reference has an infinite one."""
    tol = parse_tolerance(["max_rel<=0.01"])
    same = tensor_metrics("o", torch.zeros(3), torch.zeros(3), tol)
    assert same.max_rel == 0.0 and same.passed
    off = tensor_metrics("o", torch.zeros(3), torch.tensor([0.0, 0.5, 0.0]), tol)
    assert off.max_rel == INF and not off.passed


def test_integer_output_is_never_judged_by_the_nonfinite_check_alone() -> None:
    """``--tolerance nonfinite<=0`` leaves nothing to judge an integer output by: the mismatch default joins
    it (integers have no NaN/Inf, so the check alone let any integer output pass)."""
    tol = parse_tolerance(["nonfinite<=0"])
    assert [str(c) for c in tol.criteria_for("ids", False)] == ["new_nonfinite<=0", "mismatch<=0.01"]
    m = tensor_metrics("ids", torch.arange(4), torch.zeros(4, dtype=torch.int64), tol)
    assert m.mismatch == 0.75 and not m.passed
    explicit = parse_tolerance(["nonfinite<=0", "mismatch<=0.8"])
    assert [str(c) for c in explicit.criteria_for("ids", False)] == ["new_nonfinite<=0", "mismatch<=0.8"]
    assert tensor_metrics("ids", torch.arange(4), torch.zeros(4, dtype=torch.int64), explicit).passed


def test_shape_mismatch_fails_with_a_false_verdict() -> None:
    """A converted output of another shape is a plain failure (``passed`` False, not None, in the report)."""
    m = tensor_metrics("o", torch.ones(2, 3), torch.ones(3, 2), FP16)
    assert m.passed is False and m.checks == [] and m.notes == ["shape differs: converted [3, 2]"]


def test_batches_of_vectors_are_rows_of_classes() -> None:
    """Batches of 1-D logits stack as rows (one per batch), so top-1 is judged per batch, not over the
    concatenation; a 0-d batch among them makes the whole output one flat vector."""
    refs = [torch.tensor([0.0, 1, 2, 3, 9]), torch.tensor([0.0, 1, 2, 3, 4])]
    outs = [refs[0].clone(), torch.tensor([4.0, 1, 2, 3, 0])]  # batch 2's top class moves from 4 to 0
    (m,) = compare_batches(list(zip(refs, outs, strict=True)), Tolerance(0, -1))
    assert m.top1 == 0.5, "one batch of two agrees (flat, the shared maximum 9 would give 1.0)"
    pairs = [(torch.ones(2), torch.ones(2)), (torch.tensor(1.0), torch.tensor(1.0))]
    (flat,) = compare_batches(pairs, FP16)
    assert flat.passed and flat.elements == 3 and flat.shape == [2]


def test_no_finite_values_with_only_a_nonfinite_criterion_uses_the_defaults() -> None:
    """``nonfinite<=10`` alone judges nothing but the NaN/Inf count: the precision's defaults join it, and an
    output with no finite value fails on them (SQNR -inf, cosine 0) as well as on its verdict."""
    m = tensor_metrics("o", torch.ones(4), torch.full((4,), NAN), parse_tolerance(["nonfinite<=10"]))
    assert [(c["criterion"], c["passed"]) for c in m.checks] == [
        ("sqnr_db>=40", False),
        ("cosine>=0.999", False),
        ("new_nonfinite<=10", True),
    ]
    assert not m.passed


def test_sqnr_and_cosine_of_small_outputs() -> None:
    """Norms below 1 are ordinary: ref = [0.3, 0.4], out = [0.4, 0.3] (both norm 0.5, |diff| = 0.1·√2) gives
    cosine 0.24 / 0.25 = 0.96 and SQNR 20·log10(0.5 / (0.1·√2)) ≈ 10.97 dB."""
    ref = torch.tensor([0.3, 0.4], dtype=torch.float64)
    m = tensor_metrics("o", ref, ref.flip(0), FP16)
    assert m.cosine == pytest.approx(0.96, abs=1e-12)
    assert m.sqnr_db == pytest.approx(20 * math.log10(0.5 / (0.1 * math.sqrt(2))), abs=1e-9)


def test_run_model_passes_kwargs_on_a_fresh_copy_without_autograd() -> None:
    """Each run sees the same inputs although the model appends to one in place (a KV cache), keyword
    arguments reach the model, and no autograd graph is recorded."""
    from amplite.verify.compare import run_model

    def model(x: torch.Tensor, cache: list[torch.Tensor], *, scale: float = 1.0) -> torch.Tensor:
        cache.append(x)
        return x * scale * len(cache)

    w = torch.ones(2, requires_grad=True)
    inputs = ((w, []), {"scale": 3.0})
    first, second = run_model(model, inputs), run_model(model, inputs)
    assert first.tolist() == second.tolist() == [3.0, 3.0] and inputs[0][1] == []
    assert not first.requires_grad


# criteria


def test_unscoped_criterion_applies_to_every_output() -> None:
    c = Criterion("sqnr_db", ">=", 40.0)
    assert c.applies_to("output") and c.applies_to("output['logits']") and c.applies_to("output[3]")
    scoped = Criterion("sqnr_db", ">=", 40.0, "logits")
    assert scoped.applies_to("output['logits']") and not scoped.applies_to("output['hidden']")


def test_unknown_precision_in_tolerance_names_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        parse_tolerance([], "fp4")
    assert "'fp4'" in info.value.problem
    assert all(name in info.value.fix for name in ("fp16", "bf16", "fp8"))


def test_batches_are_stacked_by_rows_of_the_last_dimension() -> None:
    from amplite.verify.compare import DEFAULT_TOLERANCES, compare_batches

    g = torch.Generator().manual_seed(7)
    refs = [torch.randn(2, 3, 5, generator=g).double() for _ in range(2)]
    outs = [r.clone() for r in refs]
    outs[1][1, 2] = -outs[1][1, 2]  # one row of 5 logits (of 12) flips its top class
    (m,) = compare_batches(list(zip(refs, outs, strict=True)), DEFAULT_TOLERANCES["fp16"])
    assert m.batches == 2 and m.shape == [2, 3, 5]
    assert m.top1 == pytest.approx(11 / 12), "top-1 is over rows of the last dimension of every batch"
    # Batches whose last dimensions differ are judged as one flat vector.
    pairs = [(torch.ones(2, 3), torch.ones(2, 3)), (torch.ones(2, 4), torch.ones(2, 4))]
    (flat,) = compare_batches(pairs, DEFAULT_TOLERANCES["fp16"])
    assert flat.passed and flat.sqnr_db == float("inf") and flat.shape == [2, 3]


def test_verification_edge_cases() -> None:
    from amplite.verify.compare import DEFAULT_TOLERANCES, json_float, tensor_metrics

    fp16 = DEFAULT_TOLERANCES["fp16"]
    assert [json_float(v) for v in (float("inf"), -float("inf"), float("nan"), 1.5)] == ["inf", "-inf", "nan", 1.5]
    shape = tensor_metrics("o", torch.ones(2, 3), torch.ones(3, 2), fp16)
    assert not shape.passed and shape.notes == ["shape differs: converted [3, 2]"]
    empty = tensor_metrics("o", torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), fp16)
    assert empty.mismatch == 0.0 and empty.passed, "an empty integer output has no mismatch"
    vec = tensor_metrics("o", torch.tensor([0.1, 2.0, 0.3]), torch.tensor([0.1, 0.2, 0.3]), fp16)
    assert vec.top1 == 0.0, "a 1-D output is one row of classes"
    # No finite value to compare fails even when the user's criteria would hold for the defaults.
    tol = parse_tolerance(["max_abs<=1", "nonfinite<=100"])
    none = tensor_metrics("o", torch.ones(4), torch.full((4,), float("inf")), tol)
    assert not none.passed and "no finite values to compare" in none.notes
