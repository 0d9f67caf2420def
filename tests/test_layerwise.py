"""Layer-wise localisation: node pairing, accumulated vs isolated error, NaN/Inf attribution, ranges,
gradient check."""

from __future__ import annotations

import math
import operator

import pytest
import torch

import amplite
from amplite.passes.graph_utils import cast_dtype
from amplite.verify import layerwise
from amplite.verify.gradcheck import gradient_check
from amplite.verify.layerwise import analyze, node_error, pair_nodes
from amplite.verify.ranges import range_stats, recommend_loss_scale
from fixtures.zoo import make


@pytest.fixture(scope="module")
def overflow() -> dict[str, amplite.ConversionResult]:
    model, inputs = make("overflow")
    return {lvl: amplite.convert(model, inputs, level=lvl, verify=False) for lvl in ("O1", "O3")}


@pytest.fixture(scope="module")
def transformer() -> amplite.ConversionResult:
    model, inputs = make("transformer")
    return amplite.convert(model, inputs, level="O1", verify=False)


def _by_node(res: layerwise.LayerwiseResult) -> dict[str, layerwise.NodeError]:
    return {e.node: e for e in res.nodes}


def test_overflow_o3_names_the_pow_that_overflows(overflow: dict) -> None:
    r = overflow["O3"]
    res = analyze(r.original, r.program, r.inputs, r.inputs)
    top = res.top(3)
    assert top[0].node == "pow_1" and top[0].op.startswith("pow")
    assert top[0].introduces_nonfinite and top[0].isolated["new_nonfinite"] > 0
    assert top[0].source.endswith(":" + str(_pow_line())) and "zoo.py" in top[0].source
    nodes = _by_node(res)
    ln = nodes["layer_norm"]
    # layer_norm gets inf straight from pow's fp16 output: it inherits NaN/Inf, it does not introduce it
    assert ln.inherited_nonfinite and not ln.introduces_nonfinite
    assert ln.module == "ln"
    assert nodes["pow_1"].range["overflow"] > 0  # the FP32 value does not fit fp16
    assert nodes["linear_1"].range["overflow"] == 0
    # downstream of the overflow the accumulated error is NaN/Inf, the isolated error stays small
    assert nodes["linear_2"].accumulated["new_nonfinite"] > 0
    assert nodes["linear_2"].isolated["sqnr_db"] > 60


def _pow_line() -> int:
    import inspect

    from fixtures import zoo

    src, start = inspect.getsourcelines(zoo.Overflow.forward)
    return start + next(i for i, line in enumerate(src) if ".pow(2)" in line)


def test_overflow_o1_keeps_pow_exact(overflow: dict) -> None:
    r = overflow["O1"]
    res = analyze(r.original, r.program, r.inputs, r.inputs)
    nodes = _by_node(res)
    assert nodes["pow_1"].dtype == "float32" and nodes["pow_1"].exact
    assert nodes["pow_1"].isolated["sqnr_db"] == math.inf  # an FP32 island on FP32 inputs adds nothing
    assert not any(e.introduces_nonfinite or e.accumulated["new_nonfinite"] for e in res.nodes)
    assert "pow_1" not in [e.node for e in res.top()]
    # the first low-precision node sees the model's own inputs: accumulated and isolated error coincide
    first = res.nodes[0]
    assert first.dtype == "float16"
    assert first.isolated["sqnr_db"] == pytest.approx(first.accumulated["sqnr_db"], abs=1e-9)
    # errors accumulate: the last node's accumulated error is worse than its own
    last = res.nodes[-1]
    assert last.accumulated["sqnr_db"] < last.isolated["sqnr_db"]


def test_every_computed_node_is_paired(transformer: amplite.ConversionResult) -> None:
    r = transformer
    res = analyze(r.original, r.program, r.inputs, r.inputs)
    assert res.unpaired == []
    conv_gm = r.program.module()
    computed = [n for n in conv_gm.graph.nodes if n.op == "call_function" and cast_dtype(n) is None]
    assert res.paired == len(computed)
    assert len(res.nodes) > 20
    assert {e.layer for e in res.nodes} >= {"layers.0", "layers.1"}
    assert all(e.accumulated["sqnr_db"] > 40 for e in res.nodes)
    layers = {row["layer"]: row for row in res.layers()}
    assert layers["layers.1"]["nodes"] == sum(1 for e in res.nodes if e.layer == "layers.1")


def test_pairing_falls_back_to_op_module_and_occurrence(transformer: amplite.ConversionResult) -> None:
    ref_gm, conv_gm = transformer.original.module(), transformer.program.module()
    for n in conv_gm.graph.nodes:  # names differ, as after a tool that renames nodes
        if n.op == "call_function" and n.target is not operator.getitem:
            n.name = "renamed_" + n.name
    pairs = pair_nodes(ref_gm.graph, conv_gm.graph)
    matched = {c.name.removeprefix("renamed_"): r.name for c, r in pairs.items() if c.op == "call_function"}
    casts = [n for n in conv_gm.graph.nodes if n.op == "call_function" and cast_dtype(n) is not None]
    assert all(c not in pairs for c in casts)  # amplite's casts stay unpaired
    assert matched and all(k == v for k, v in matched.items())  # same op, module and occurrence: same node


def test_node_error_numbers() -> None:
    ref = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    e = node_error(ref, ref * (1 + 1e-2))
    assert e["sqnr_db"] == pytest.approx(40.0, abs=1e-3)
    assert e["rel_l2"] == pytest.approx(1e-2, rel=1e-4)
    out = ref.clone()
    out[0] = float("nan")
    assert node_error(ref, out)["new_nonfinite"] == 1
    assert node_error(ref, ref[:10]) is None and node_error(torch.arange(3), torch.arange(3)) is None


def test_range_stats_follow_rounding() -> None:
    t = torch.tensor([70000.0, 1e-9, 1e-6, 1.0])
    s = range_stats(t, torch.float16)
    assert (s["overflow"], s["flush_to_zero"], s["subnormal"]) == (0.25, 0.25, 0.25)
    assert s["max_abs"] == 70000.0
    b = range_stats(t, torch.bfloat16)  # bf16 has fp32's exponent range: nothing overflows or flushes
    assert (b["overflow"], b["flush_to_zero"], b["subnormal"]) == (0.0, 0.0, 0.0)


def test_loss_scale_recommendation() -> None:
    grads = [torch.full((900,), 1e-9), torch.full((100,), 1.0)]
    rec = recommend_loss_scale(grads, torch.float16)
    assert rec["underflow_unscaled"] == pytest.approx(0.9)
    assert rec["recommended_loss_scale"] == 2.0**14  # 65504 / (2 * 1.0) ≈ 2^15 - 1 → 2^14
    assert rec["underflow_scaled"] == 0.0  # 1e-9 · 16384 ≈ 1.6e-5 is a (subnormal) fp16 value
    assert rec["subnormal_scaled"] == pytest.approx(0.9)


def test_gradient_check(overflow: dict) -> None:
    r1, r3 = overflow["O1"], overflow["O3"]
    ok = gradient_check(r1.original.module(), r1.program.module(), r1.inputs, r1.inputs)
    assert ok["passed"] and ok["parameters"] == 8 and ok["min_sqnr_db"] > 40
    assert ok["reference_loss"] == pytest.approx(ok["converted_loss"], rel=1e-2)
    bad = gradient_check(r3.original.module(), r3.program.module(), r3.inputs, r3.inputs)
    assert not bad["passed"] and bad["nonfinite_parameters"]
    custom = gradient_check(r1.original.module(), r1.program.module(), r1.inputs, r1.inputs,
                            loss=lambda out: (out**2).mean())  # fmt: skip
    assert custom["loss"].endswith("<lambda>") and custom["reference_loss"] > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_range_stats_equal_what_a_cast_does(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    mags = torch.exp2(torch.empty(20000).uniform_(-140, 127, generator=g))  # every binade of both dtypes
    fi = torch.finfo(dtype)
    nmant = round(-math.log2(fi.eps))
    half_sub = fi.smallest_normal * 2.0 ** -(nmant + 1)
    edges = [fi.max, fi.max + fi.max * 2.0 ** -(nmant + 2), half_sub, fi.smallest_normal - half_sub, 0.0]
    x = torch.cat([mags, torch.tensor(edges, dtype=torch.float32)])
    x = torch.where(torch.rand(x.shape, generator=g) < 0.5, -x, x)
    c = x.to(dtype)
    s = range_stats(x, dtype)
    n = x.numel()
    assert s["overflow"] == int((torch.isinf(c) & torch.isfinite(x)).sum()) / n
    assert s["flush_to_zero"] == int(((c == 0) & (x != 0)).sum()) / n
    assert s["subnormal"] == int(((c != 0) & (c.abs() < fi.smallest_normal)).sum()) / n
    assert s["max_abs"] == float(x.abs().max())
