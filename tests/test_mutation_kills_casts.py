"""Tests that kill surviving mutants of `make mutate` (issue 20), area: casts.

Each test pins a behaviour users rely on, with values chosen so that a wrong implementation is off clearly;
docs/testing.md explains the loop (run mutants, read survivors, add a test or list an equivalent).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from amplite.passes.guard_constants import GuardConstants, SaturateFills

aten = torch.ops.aten
F16_MAX = 65504.0
X = torch.zeros(2, 3)


Build = Callable[[torch.fx.Graph, torch.fx.Node, torch.nn.Module], Any]


def _gm(build: Build, **consts: torch.Tensor) -> torch.fx.GraphModule:
    """A tiny graph: placeholder ``x`` (float, meta['val'] set), ``build`` adds nodes and returns the output."""
    root = torch.nn.Module()
    for name, value in consts.items():
        owner = root
        *path, leaf = name.split("__")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_buffer(leaf, value)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = X
    g.output(build(g, x, root))
    return torch.fx.GraphModule(root, g)


def _call(g: torch.fx.Graph, target: Any, args: tuple, kwargs: dict | None = None, val: Any = X) -> torch.fx.Node:
    node = g.create_node("call_function", target, args, kwargs or {}, name=getattr(target, "_opname", None))
    node.meta["val"] = val
    return node


def _attr(g: torch.fx.Graph, target: str, val: torch.Tensor) -> torch.fx.Node:
    node = g.get_attr(target)
    node.meta["val"] = val
    return node


def _node(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def test_guard_constants_does_nothing_for_a_dtype_without_a_limit() -> None:
    """float32 has no narrower range to guard: the same module, unmodified, no counters, nothing flagged."""
    gm = _gm(lambda g, x, r: _call(g, aten.add.Tensor, (x, 1e30)))
    result = GuardConstants(torch.float32)(gm)
    assert result.graph_module is gm and result.modified is False and result.counters == {}
    assert all("amplite_range" not in n.meta for n in gm.graph.nodes)


def test_guard_constants_flags_scalars_above_the_fp16_max_only() -> None:
    """A scalar above 65504 keeps its op FP32 with the value and limit in the reason; 65504 itself fits."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> torch.fx.Node:
        a = _call(g, aten.add.Tensor, (x, 1e5))  # 'Tensor' slot: a wrapped scalar
        b = _call(g, aten.add.Tensor, (a, F16_MAX))  # exactly the limit: representable
        c = _call(g, aten.huber_loss.default, (b, x, 1, 2e5))  # 'float' slot
        return _call(g, aten.nan_to_num.default, (c,), {"posinf": 3e5})  # 'Optional[float]' kwarg

    gm = _gm(build)
    result = GuardConstants(torch.float16)(gm)
    assert result.graph_module is gm and result.modified is False
    assert result.counters == {"kept_fp32:range:constant": 3}
    reasons = {n.name: n.meta.get("amplite_range") for n in gm.graph.nodes if n.op == "call_function"}
    assert reasons == {
        "add": "range:constant 1e+05>65504",
        "add_1": None,
        "huber_loss": "range:constant 2e+05>65504",
        "nan_to_num": "range:constant 3e+05>65504",
    }


def test_guard_constants_marks_extreme_fills_and_clamps_for_saturation() -> None:
    """Fills of |v| >= 2**120 and clamp bounds (args or kwargs) are marked by slot, not flagged FP32;
    a -1e9 fill or an extreme value in a non-fill op is flagged FP32 instead."""
    mask = torch.ones(2, 3, dtype=torch.bool)

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> torch.fx.Node:
        m = g.placeholder("m")
        m.meta["val"] = mask
        f1 = _call(g, aten.masked_fill.Scalar, (x, m, -(2.0**120)))  # exactly the extreme threshold
        f2 = _call(g, aten.masked_fill.Scalar, (f1, m, -1e9))  # unrepresentable, not extreme: FP32
        c = _call(g, aten.clamp.default, (f2,), {"max": 1e5})  # min absent, max in kwargs
        return _call(g, aten.add.Tensor, (c, 2.0**120))  # extreme, but not a fill

    gm = _gm(build)
    result = GuardConstants(torch.float16)(gm)
    assert result.counters == {"marked_for_saturation": 2, "kept_fp32:range:constant": 2}
    assert _node(gm, "masked_fill").meta["amplite_saturate"] == [("args", 2)]
    assert _node(gm, "clamp").meta["amplite_saturate"] == [("kwargs", "max")]
    assert _node(gm, "masked_fill_1").meta["amplite_range"] == "range:constant -1e+09>65504"
    assert _node(gm, "add").meta["amplite_range"] == "range:constant 1.33e+36>65504"
    assert "amplite_range" not in _node(gm, "masked_fill").meta


def test_guard_constants_flags_the_float_readers_of_an_unrepresentable_creation_op() -> None:
    """full(1e5) (a creation op, not extreme): its readers computing in float are flagged, with the
    creation node's name in the reason; an earlier range reason stays; the full itself is not flagged."""
    ints = torch.zeros(2, dtype=torch.int64)

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> torch.fx.Node:
        full = _call(g, aten.full.default, ([2], 1e5), val=torch.zeros(2))
        lt = _call(g, aten.lt.Tensor, (x, full), val=torch.zeros(2, dtype=torch.bool))  # float in, bool out
        kept = _call(g, aten.mul.Tensor, (x, full))
        kept.meta["amplite_range"] = "range:activation earlier"
        ifull = _call(g, aten.full.default, ([2], 7e4), {"dtype": torch.int64}, val=ints)
        div = _call(g, aten.div.Tensor, (ifull, ifull), val=torch.zeros(2))  # int in, float out
        idx = _call(g, aten.neg.default, (ifull,), val=ints)  # int in, int out: no float math
        return (lt, kept, div, idx)

    gm = _gm(build)
    result = GuardConstants(torch.float16)(gm)
    assert result.counters == {"kept_fp32:range:constant": 2}
    assert _node(gm, "lt").meta["amplite_range"] == "range:constant full=1e+05>65504"
    assert _node(gm, "div").meta["amplite_range"] == "range:constant full_1=7e+04>65504"
    assert _node(gm, "mul").meta["amplite_range"] == "range:activation earlier"
    assert "amplite_range" not in _node(gm, "neg").meta and "amplite_range" not in _node(gm, "full").meta


def test_guard_constants_checks_small_float_constant_tensors() -> None:
    """A lifted float constant (dotted get_attr, 1..4096 elements, on a real device) whose largest finite
    |value| exceeds 65504 keeps its reader FP32; boundary sizes/values, infinities, bool, meta tensors,
    casts, outputs and inputs that share a buffer's name are not flagged."""
    big4096 = torch.zeros(4096)
    big4096[7] = -1e5
    big4097 = torch.zeros(4097)
    big4097[0] = 1e5
    consts = {
        "sub__c": torch.tensor([1e5]),  # one element
        "edge": big4096,
        "huge": big4097,
        "limit": torch.tensor([F16_MAX, -F16_MAX]),
        "infs": torch.tensor([-math.inf, math.nan]),
        "mask": torch.tensor([True, False, True]),
        "on_meta": torch.empty(3, device="meta"),
        "x_alias": torch.tensor([1e5]),
    }

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> torch.fx.Node:
        outs = []
        for name, t in consts.items():
            if name == "x_alias":
                continue
            outs.append(_call(g, aten.add.Tensor, (x, _attr(g, name.replace("__", "."), t))))
        cvt = torch.ops.prims.convert_element_type.default
        cast = _call(g, cvt, (_attr(g, "sub.c", consts["sub__c"]), torch.float16))
        alias = g.placeholder("x_alias")  # an input, not a constant, though a buffer has its name
        alias.meta["val"] = X
        return (*outs, cast, _call(g, aten.mul.Tensor, (x, alias)), _attr(g, "sub.c", consts["sub__c"]))

    gm = _gm(build, **consts)
    result = GuardConstants(torch.float16)(gm)
    flagged = {n.name: n.meta["amplite_range"] for n in gm.graph.nodes if "amplite_range" in n.meta}
    assert flagged == {
        "add": "range:constant sub.c |c|=1e+05>65504",
        "add_1": "range:constant edge |c|=1e+05>65504",
    }
    assert result.counters == {"kept_fp32:range:constant": 2} and result.modified is False


def _marked(low: torch.dtype) -> torch.fx.GraphModule:
    """Two fills and a clamp bound marked by GuardConstants(fp16), planned in ``low``; a full() with a low reader."""
    mask = torch.ones(2, 3, dtype=torch.bool)

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> torch.fx.Node:
        m = g.placeholder("m")
        m.meta["val"] = mask
        f1 = _call(g, aten.masked_fill.Scalar, (x, m, -3.0e38))
        f2 = _call(g, aten.masked_fill.Scalar, (f1, m), {"value": 3.0e38})
        c = _call(g, aten.clamp.default, (f2, -1e5))
        for n in (f1, f2, c):
            n.meta["amplite_precision"] = {"dtype": low}
        return c

    gm = _gm(build)
    GuardConstants(torch.float16)(gm)
    return gm


def test_saturate_fills_replaces_marked_values_in_low_ops_and_reports_each() -> None:
    """fp16 ops get ±65504 in place of the marked constants (args and kwargs), counted per kind, with the
    node, op, old and new value and source line in details; the marks are consumed."""
    gm = _marked(torch.float16)
    result = SaturateFills(torch.float16)(gm)
    assert result.graph_module is gm and result.modified is True
    assert result.counters == {"fills_saturated": 2, "clamp_bounds_saturated": 1}
    assert _node(gm, "masked_fill").args[2] == -F16_MAX
    assert _node(gm, "masked_fill_1").kwargs == {"value": F16_MAX}
    assert _node(gm, "clamp").args[1] == -F16_MAX
    assert result.details == {
        "saturated": [
            {"node": "masked_fill", "op": "masked_fill.Scalar", "from": -3.0e38, "to": -F16_MAX, "source": ""},
            {"node": "masked_fill_1", "op": "masked_fill.Scalar", "from": 3.0e38, "to": F16_MAX, "source": ""},
            {"node": "clamp", "op": "clamp.default", "from": -1e5, "to": -F16_MAX, "source": ""},
        ]
    }
    assert all("amplite_saturate" not in n.meta for n in gm.graph.nodes)


def test_saturate_fills_leaves_fp32_ops_alone_and_reports_nothing() -> None:
    """Marked ops planned FP32 (and whose readers are FP32) keep their constants: unmodified, no details."""
    gm = _marked(torch.float32)
    c = _node(gm, "clamp")
    user = gm.graph.call_function(aten.relu.default, (c,))
    user.meta["amplite_precision"] = {"dtype": torch.float16}  # a low reader does not matter for a non-creation op
    result = SaturateFills(torch.float16)(gm)
    assert result.modified is False and result.counters == {} and result.details == {}
    assert _node(gm, "masked_fill").args[2] == -3.0e38 and c.args[1] == -1e5


def test_saturate_fills_without_a_finite_limit_uses_infinity() -> None:
    """For a dtype with no finite limit in the table the marked constant becomes ±inf, its sign kept."""
    gm = _marked(torch.float32)
    result = SaturateFills(torch.float32)(gm)
    assert _node(gm, "masked_fill").args[2] == -math.inf and _node(gm, "clamp").args[1] == -math.inf
    assert result.counters == {"fills_saturated": 2, "clamp_bounds_saturated": 1}


def _creation(reader: str) -> tuple[torch.fx.GraphModule, torch.fx.Node]:
    """full(-3e38) marked for saturation, read by an FP32 op and then by ``reader`` (fp16 plan, fp16 cast, fp32)."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> torch.fx.Node:
        full = _call(g, aten.full.default, ([2, 3], -3.0e38))
        first = _call(g, aten.add.Tensor, (x, full))
        first.meta["amplite_precision"] = {"dtype": torch.float32}
        if reader == "cast":
            second = _call(g, torch.ops.prims.convert_element_type.default, (full, torch.float16))
        else:
            second = _call(g, aten.mul.Tensor, (x, full))
            second.meta["amplite_precision"] = {"dtype": torch.float16 if reader == "plan" else torch.float32}
        return (first, second)

    gm = _gm(build)
    GuardConstants(torch.float16)(gm)
    return gm, _node(gm, "full")


def test_saturate_fills_saturates_a_creation_op_read_in_the_low_dtype() -> None:
    """A full() is saturated when any reader computes in fp16 (planned fp16 or a cast to fp16) — also after an
    FP32 reader — and kept when every reader is FP32."""
    for reader, expected in (("plan", -F16_MAX), ("cast", -F16_MAX), ("fp32", -3.0e38)):
        gm, full = _creation(reader)
        assert full.meta["amplite_saturate"] == [("args", 1)]
        result = SaturateFills(torch.float16)(gm)
        assert full.args[1] == expected, reader
        assert result.counters == ({"fills_saturated": 1} if expected == -F16_MAX else {}), reader
