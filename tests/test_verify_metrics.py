"""Verification metrics, tolerance criteria and their parser (no model conversion here)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from amplite.errors import ConfigError
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
        parse_tolerance([], "fp8")


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
