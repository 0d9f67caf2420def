"""X"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

from amplite.converter.pipeline import strip_export_checks
from amplite.passes.annotate_precision import AnnotatePrecision
from amplite.passes.base import PassBase, PassManager
from amplite.passes.cleanup_casts import CleanupCasts
from amplite.passes.graph_utils import cast_dtype
from amplite.passes.guard_constants import GuardConstants, SaturateFills
from amplite.passes.insert_casts import InsertCasts
from amplite.passes.meta import OUT_DTYPE_KEY, PRECISION_KEY, RANGE_KEY, SATURATE_KEY
from amplite.passes.store_low_params import StoreLowPrecisionParams
from amplite.policy import Level, PrecisionPolicy
from tests.exported import Fn, export_eval

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
    return next(n for n in gm.graph.nodes if n.name.replace("_to_copy_default", "_to_copy") == name)


def test_guard_constants_does_nothing_for_a_dtype_without_a_limit() -> None:
    """float32 has no narrower range to guard: the same module, unmodified, no counters, nothing flagged."""
    gm = _gm(lambda g, x, r: _call(g, aten.add.Tensor, (x, 1e30)))
    result = GuardConstants(torch.float32)(gm)
    assert result.graph_module is gm and result.modified is False and not any(result.counters.values())
    assert all(RANGE_KEY not in n.meta for n in gm.graph.nodes)


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
    assert result.counters.items() >= {"kept_fp32:range:constant": 3}.items()
    reasons = {n.name: n.meta.get(RANGE_KEY) for n in gm.graph.nodes if n.op == "call_function"}
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
    assert result.counters.items() >= {"marked_for_saturation": 2, "kept_fp32:range:constant": 2}.items()
    assert _node(gm, "masked_fill").meta[SATURATE_KEY] == [("args", 2)]
    assert _node(gm, "clamp").meta[SATURATE_KEY] == [("kwargs", "max")]
    assert _node(gm, "masked_fill_1").meta[RANGE_KEY] == "range:constant -1e+09>65504"
    assert _node(gm, "add").meta[RANGE_KEY] == "range:constant 1.33e+36>65504"
    assert RANGE_KEY not in _node(gm, "masked_fill").meta


def test_guard_constants_flags_the_float_readers_of_an_unrepresentable_creation_op() -> None:
    """full(1e5) (a creation op, not extreme): its readers computing in float are flagged, with the
    creation node's name in the reason; an earlier range reason stays; the full itself is not flagged."""
    ints = torch.zeros(2, dtype=torch.int64)

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> torch.fx.Node:
        full = _call(g, aten.full.default, ([2], 1e5), val=torch.zeros(2))
        lt = _call(g, aten.lt.Tensor, (x, full), val=torch.zeros(2, dtype=torch.bool))  # float in, bool out
        kept = _call(g, aten.mul.Tensor, (x, full))
        kept.meta[RANGE_KEY] = "range:activation earlier"
        ifull = _call(g, aten.full.default, ([2], 7e4), {"dtype": torch.int64}, val=ints)
        div = _call(g, aten.div.Tensor, (ifull, ifull), val=torch.zeros(2))  # int in, float out
        idx = _call(g, aten.neg.default, (ifull,), val=ints)  # int in, int out: no float math
        return (lt, kept, div, idx)

    gm = _gm(build)
    result = GuardConstants(torch.float16)(gm)
    assert result.counters.items() >= {"kept_fp32:range:constant": 2}.items()
    assert _node(gm, "lt").meta[RANGE_KEY] == "range:constant full=1e+05>65504"
    assert _node(gm, "div").meta[RANGE_KEY] == "range:constant full_1=7e+04>65504"
    assert _node(gm, "mul").meta[RANGE_KEY] == "range:activation earlier"
    assert RANGE_KEY not in _node(gm, "neg").meta and RANGE_KEY not in _node(gm, "full").meta


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
    gm.register_buffer("x_alias", consts["x_alias"])  # GraphModule copies only the get_attr targets
    result = GuardConstants(torch.float16)(gm)
    flagged = {n.name: n.meta[RANGE_KEY] for n in gm.graph.nodes if RANGE_KEY in n.meta}
    assert flagged == {
        "add": "range:constant sub.c |c|=1e+05>65504",
        "add_1": "range:constant edge |c|=1e+05>65504",
    }
    assert result.counters.items() >= {"kept_fp32:range:constant": 2}.items() and result.modified is False


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
            n.meta[PRECISION_KEY] = {"dtype": low}
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
    assert result.counters.items() >= {"fills_saturated": 2, "clamp_bounds_saturated": 1}.items()
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
    assert all(SATURATE_KEY not in n.meta for n in gm.graph.nodes)


def test_saturate_fills_leaves_fp32_ops_alone_and_reports_nothing() -> None:
    """Marked ops planned FP32 (and whose readers are FP32) keep their constants: unmodified, no details."""
    gm = _marked(torch.float32)
    c = _node(gm, "clamp")
    user = gm.graph.call_function(aten.relu.default, (c,))
    user.meta[PRECISION_KEY] = {"dtype": torch.float16}  # a low reader does not matter for a non-creation op
    result = SaturateFills(torch.float16)(gm)
    assert result.modified is False and not any(result.counters.values()) and result.details == {}
    assert _node(gm, "masked_fill").args[2] == -3.0e38 and c.args[1] == -1e5


def test_saturate_fills_without_a_finite_limit_uses_infinity() -> None:
    """For a dtype with no finite limit in the table the marked constant becomes ±inf, its sign kept."""
    gm = _marked(torch.float32)
    result = SaturateFills(torch.float32)(gm)
    assert _node(gm, "masked_fill").args[2] == -math.inf and _node(gm, "clamp").args[1] == -math.inf
    assert result.counters.items() >= {"fills_saturated": 2, "clamp_bounds_saturated": 1}.items()


def _creation(reader: str) -> tuple[torch.fx.GraphModule, torch.fx.Node]:
    """full(-3e38) marked for saturation, read by an FP32 op and then by ``reader`` (fp16 plan, fp16 cast, fp32)."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> torch.fx.Node:
        full = _call(g, aten.full.default, ([2, 3], -3.0e38))
        first = _call(g, aten.add.Tensor, (x, full))
        first.meta[PRECISION_KEY] = {"dtype": torch.float32}
        if reader == "cast":
            second = _call(g, torch.ops.prims.convert_element_type.default, (full, torch.float16))
        else:
            second = _call(g, aten.mul.Tensor, (x, full))
            second.meta[PRECISION_KEY] = {"dtype": torch.float16 if reader == "plan" else torch.float32}
        return (first, second)

    gm = _gm(build)
    GuardConstants(torch.float16)(gm)
    return gm, _node(gm, "full")


def test_saturate_fills_saturates_a_creation_op_read_in_the_low_dtype() -> None:
    """A full() is saturated when any reader computes in fp16 (planned fp16 or a cast to fp16) — also after an
    FP32 reader — and kept when every reader is FP32."""
    for reader, expected in (("plan", -F16_MAX), ("cast", -F16_MAX), ("fp32", -3.0e38)):
        gm, full = _creation(reader)
        assert full.meta[SATURATE_KEY] == [("args", 1)]
        result = SaturateFills(torch.float16)(gm)
        assert full.args[1] == expected, reader
        assert result.counters == ({"fills_saturated": 1} if expected == -F16_MAX else {}), reader


def _cleanup(build: Build) -> tuple[torch.fx.GraphModule, Any, list[str]]:
    """Run CleanupCasts on a tiny graph; returns the module, the result and the graph as 'name=op(args)' lines."""
    from amplite.passes.cleanup_casts import CleanupCasts

    gm = _gm(build)
    result = CleanupCasts()(gm)
    gm.graph.lint()
    lines = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            dt = n.kwargs.get("dtype")
            args = ",".join(a.name if isinstance(a, torch.fx.Node) else str(a) for a in n.args)
            lines.append(f"{n.name}={n.target._opname}({args}){'->' + str(dt) if dt else ''}")
        elif n.op == "output":
            lines.append("out:" + ",".join(a.name for a in n.all_input_nodes))
    return gm, result, [line.replace("_to_copy_default", "_to_copy") for line in lines]


def _cast(g: torch.fx.Graph, value: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    from amplite.passes.graph_utils import make_cast

    return make_cast(g, value, dtype)


def test_cleanup_removes_identity_casts_and_reports_them() -> None:
    """A cast of an FP32 value to FP32 disappears; its reader reads the value."""
    _, result, lines = _cleanup(lambda g, x, r: _call(g, aten.relu.default, (_cast(g, x, torch.float32),)))
    assert lines == ["relu=relu(x)", "out:relu"]
    assert result.modified is True and result.counters.items() >= {"identity_removed": 1}.items()


def test_cleanup_leaves_a_graph_without_redundant_casts_unchanged() -> None:
    """One rounding cast: nothing to do, modified False, no counters."""
    _, result, lines = _cleanup(lambda g, x, r: _cast(g, x, torch.float16))
    assert lines == ["_to_copy=_to_copy(x)->torch.float16", "out:_to_copy"]
    assert result.modified is False and not any(result.counters.values())


def test_cleanup_folds_exact_round_trips_and_keeps_rounding_ones() -> None:
    """fp32->fp64->fp32 is exact: folded to x. fp32->bf16->fp32 rounds: the plan's rounding stays."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        exact = _cast(g, _cast(g, x, torch.float64), torch.float32)
        rounding = _cast(g, _cast(g, x, torch.bfloat16), torch.float32)
        return (_call(g, aten.neg.default, (exact,)), _call(g, aten.relu.default, (rounding,)))

    _, result, lines = _cleanup(build)
    assert lines == [
        "_to_copy_2=_to_copy(x)->torch.bfloat16",
        "_to_copy_3=_to_copy(_to_copy_2)->torch.float32",
        "neg=neg(x)",
        "relu=relu(_to_copy_3)",
        "out:neg,relu",
    ]
    assert result.counters.items() >= {"round_trips_folded": 1}.items()


def test_cleanup_shortens_chains_whose_first_step_is_exact() -> None:
    """fp16->fp32->bf16: the bf16 cast reads the fp16 value directly; the fp32 step goes when unused, and
    stays while another op reads it."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        h = _cast(g, x, torch.float16)
        up = _cast(g, h, torch.float32)
        alone = _cast(g, _cast(g, h, torch.float32), torch.bfloat16)
        shared = _cast(g, up, torch.bfloat16)
        return (alone, shared, _call(g, aten.neg.default, (up,)))

    _, result, lines = _cleanup(build)
    assert lines == [
        "_to_copy=_to_copy(x)->torch.float16",
        "_to_copy_1=_to_copy(_to_copy)->torch.float32",
        "_to_copy_3=_to_copy(_to_copy)->torch.bfloat16",
        "neg=neg(_to_copy_1)",
        "out:_to_copy_3,neg",  # both bf16 casts are one now
    ]
    assert result.counters.items() >= {"chains_shortened": 2, "duplicates_merged": 1}.items()


def test_cleanup_merges_duplicate_casts() -> None:
    """Two fp16 casts of x become one that both readers share."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        a = _call(g, aten.neg.default, (_cast(g, x, torch.float16),))
        return _call(g, aten.mul.Tensor, (a, _cast(g, x, torch.float16)))

    _, result, lines = _cleanup(build)
    assert lines == ["_to_copy=_to_copy(x)->torch.float16", "neg=neg(_to_copy)", "mul=mul(neg,_to_copy)", "out:mul"]
    assert result.counters.items() >= {"duplicates_merged": 1}.items()


def test_cleanup_moves_a_cast_below_a_shrinking_slice() -> None:
    """slice(cast(x)) -> cast(slice(x)) when the slice has fewer elements and is the cast's only reader; the
    slice's recorded value is FP32 again, the new cast's fp16."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        c = _cast(g, x, torch.float16)
        return _call(g, aten.slice.Tensor, (c, 0, 0, 1), val=torch.zeros(1, 3, dtype=torch.float16))

    gm, result, lines = _cleanup(build)
    assert lines == ["slice_1=slice(x,0,0,1)", "_to_copy_1=_to_copy(slice_1)->torch.float16", "out:_to_copy_1"]
    assert result.counters.items() >= {"moved_below_data_movement": 1}.items()
    assert _node(gm, "slice_1").meta["val"].dtype == torch.float32
    assert _node(gm, "_to_copy_1").meta["val"].dtype == torch.float16


def test_cleanup_keeps_a_cast_above_a_slice_that_does_not_shrink_or_is_shared() -> None:
    """A full-size slice, or a cast read by two ops, stays where it is."""
    h16 = torch.zeros(2, 3, dtype=torch.float16)

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        full = _call(g, aten.slice.Tensor, (_cast(g, x, torch.float16), 0, 0, 2), val=h16)
        y = _call(g, aten.neg.default, (x,))
        c = _cast(g, y, torch.float16)
        s = _call(g, aten.slice.Tensor, (c, 0, 0, 1), val=torch.zeros(1, 3, dtype=torch.float16))
        return (full, s, _call(g, aten.relu.default, (c,), val=h16))

    _, result, lines = _cleanup(build)
    assert lines == [
        "_to_copy=_to_copy(x)->torch.float16",
        "slice_1=slice(_to_copy,0,0,2)",
        "neg=neg(x)",
        "_to_copy_1=_to_copy(neg)->torch.float16",
        "slice_2=slice(_to_copy_1,0,0,1)",
        "relu=relu(_to_copy_1)",
        "out:slice_1,slice_2,relu",
    ]
    assert result.modified is False and not any(result.counters.values())


def test_cleanup_moves_a_cast_above_a_growing_expand() -> None:
    """cast(expand(x)) -> expand(cast(x)) casts 2 elements instead of 6; the expand now records fp16."""
    x1 = torch.zeros(2, 1)

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        col = _call(g, aten.slice.Tensor, (x, 1, 0, 1), val=x1)
        e = _call(g, aten.expand.default, (col, [2, 3]))
        return _cast(g, e, torch.float16)

    gm, result, lines = _cleanup(build)
    assert lines == [
        "slice_1=slice(x,1,0,1)",
        "_to_copy_1=_to_copy(slice_1)->torch.float16",
        "expand=expand(_to_copy_1,[2, 3])",
        "out:expand",
    ]
    assert result.counters.items() >= {"moved_above_data_movement": 1}.items()
    assert _node(gm, "expand").meta["val"].dtype == torch.float16


def test_cleanup_moves_a_cast_above_a_permute_only_to_merge_with_an_existing_cast() -> None:
    """permute keeps the element count: its cast moves up only when x already has that cast (after the
    permute in graph order, so it is moved before it); without one it stays."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        p = _call(g, aten.permute.default, (x, [1, 0]), val=torch.zeros(3, 2))
        moved = _cast(g, p, torch.float16)
        partner = _cast(g, x, torch.float16)
        y = _call(g, aten.neg.default, (x,))
        q = _call(g, aten.permute.default, (y, [1, 0]), val=torch.zeros(3, 2))
        return (moved, partner, _cast(g, q, torch.float16))

    gm, result, lines = _cleanup(build)
    assert lines == [
        "_to_copy_1=_to_copy(x)->torch.float16",
        "permute=permute(_to_copy_1,[1, 0])",
        "neg=neg(x)",
        "permute_1=permute(neg,[1, 0])",
        "_to_copy_2=_to_copy(permute_1)->torch.float16",
        "out:permute,_to_copy_1,_to_copy_2",
    ]
    assert result.counters.items() >= {"moved_above_data_movement": 1}.items()
    assert _node(gm, "permute").meta["val"].dtype == torch.float16


def _insert(build: Build, **kw: Any) -> tuple[torch.fx.GraphModule, Any, list[str]]:
    """Run InsertCasts on a tiny graph; returns the module, the result and the graph lines as in _cleanup."""
    from amplite.passes.insert_casts import InsertCasts

    gm = _gm(build)
    result = InsertCasts(**kw)(gm)
    lines = []
    for n in gm.graph.nodes:
        args = ",".join(a.name if isinstance(a, torch.fx.Node) else str(a) for a in n.args if n.op != "output")
        if n.op == "call_function":
            dt = n.kwargs.get("dtype")
            lines.append(f"{n.name}={n.target._opname}({args}){'->' + str(dt) if dt else ''}")
        elif n.op == "output":
            lines.append("out:" + ",".join(a.name for a in n.all_input_nodes))
    return gm, result, [line.replace("_to_copy_default", "_to_copy") for line in lines]


def _planned(node: torch.fx.Node, dtype: torch.dtype, mode: str = "compute") -> torch.fx.Node:
    node.meta[PRECISION_KEY] = {"mode": mode, "dtype": dtype, "reason": "test"}
    if mode == "compute":
        node.meta[OUT_DTYPE_KEY] = dtype
    return node


def test_insert_casts_casts_inputs_once_and_outputs_back() -> None:
    """Two fp16 ops reading x share one cast; the fp16 result is cast back to fp32 at the output (counted),
    and its recorded value is fp16."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        a = _planned(_call(g, aten.relu.default, (x,)), torch.float16)
        return _planned(_call(g, aten.mul.Tensor, (a, x)), torch.float16)

    gm, result, lines = _insert(build)
    assert lines == [
        "_to_copy=_to_copy(x)->torch.float16",
        "relu=relu(_to_copy)",
        "mul=mul(relu,_to_copy)",
        "_to_copy_1=_to_copy(mul)->torch.float32",
        "out:_to_copy_1",
    ]
    assert result.modified is True and result.counters.items() >= {"casts_inserted": 2, "casts_shared": 1}.items()
    assert _node(gm, "mul").meta["val"].dtype == torch.float16 and _node(gm, "x").meta["val"].dtype == torch.float32


def test_insert_casts_low_precision_io_leaves_outputs_low() -> None:
    """With low_precision_io the fp16 result is returned as is: only the input cast."""
    _, result, lines = _insert(
        lambda g, x, r: _planned(_call(g, aten.relu.default, (x,)), torch.float16), low_precision_io=True
    )
    assert lines == ["_to_copy=_to_copy(x)->torch.float16", "relu=relu(_to_copy)", "out:relu"]
    assert result.counters.items() >= {"casts_inserted": 1}.items()


def test_insert_casts_follow_ops_promote_in_kernel_and_skip_scalars_and_fp64() -> None:
    """An FP32 'follow' add of an fp16 value and x promotes in the kernel (no cast, counted); a 0-dim operand of a
    follow op, an fp64 operand and an operand already in the compute dtype are never cast."""
    h16 = torch.zeros(2, 3, dtype=torch.float16)

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        h = _planned(_call(g, aten.relu.default, (x,), val=h16), torch.float16)
        h.meta.pop(OUT_DTYPE_KEY)
        h.meta["val"] = h16  # already fp16 (as after an earlier rewrite)
        add = _planned(_call(g, aten.add.Tensor, (h, x)), torch.float32, mode="follow")
        s = _call(g, aten.select.int, (h, 0, 0), val=torch.zeros((), dtype=torch.float16))
        sc = _planned(_call(g, aten.div.Tensor, (x, s)), torch.float16, mode="follow")
        d = _call(g, aten.neg.default, (x,), val=torch.zeros(2, 3, dtype=torch.float64))
        keep = _planned(_call(g, aten.mul.Tensor, (d, h)), torch.float16, mode="follow")
        return (add, sc, keep)

    _, result, lines = _insert(build, low_precision_io=True)
    assert lines == [
        "_to_copy=_to_copy(x)->torch.float16",  # for the fp16 relu, shared by the follow div
        "relu=relu(_to_copy)",
        "add=add(relu,x)",  # FP32 follow add: fp16 relu promotes in the kernel
        "select=select(relu,0,0)",
        "div=div(_to_copy,select)",  # the 0-dim select is not cast
        "neg=neg(x)",
        "mul=mul(neg,relu)",  # fp64 neg is not cast, relu is already fp16
        "out:add,div,mul",
    ]
    assert result.counters.items() >= {"promotions_in_kernel": 1, "casts_inserted": 1, "casts_shared": 1}.items()


# --- StoreLowPrecisionParams: every kind of holder, tied aliases, exact counters -------------------------


def _store_graph(targets: list[str], root: torch.nn.Module) -> torch.fx.GraphModule:
    """``root`` itself as the graph module (holders kept as built: a GraphModule built *from* a root would copy
    only the read attributes, plain tensors as buffers), running ``sum(cast_fp16(get_attr(t)))``: every
    tensor is read only through an fp16 cast."""
    g = torch.fx.Graph()
    acc = None
    for target in targets:
        attr = g.get_attr(target)
        path, _, name = target.rpartition(".")
        attr.meta["val"] = getattr(root.get_submodule(path), name)
        cast = g.call_function(aten._to_copy.default, (attr,), {"dtype": torch.float16})
        acc = cast if acc is None else g.call_function(aten.add.Tensor, (acc, cast))
    g.output(acc)
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    for name, child in root._modules.items():  # not named_children(): it skips a module's second name
        gm.add_module(name, child)
    for name, value in vars(root).items():
        if isinstance(value, torch.Tensor):
            object.__setattr__(gm, name, value)
    for store in ("_parameters", "_buffers"):
        getattr(gm, store).update(getattr(root, store))
    gm.graph = g
    return gm


def test_store_low_params_replaces_parameters_buffers_and_plain_constants_in_their_own_holder() -> None:
    """A parameter stays a Parameter in _parameters, a buffer stays in _buffers, a plain tensor attribute
    (a lifted constant, also one whose name starts with '_') stays a plain attribute: each is the new fp16
    tensor that the graph's get_attr now reads, the originals are untouched, and the counters are exact."""
    from amplite.passes.store_low_params import StoreLowPrecisionParams

    root, sub = torch.nn.Module(), torch.nn.Module()
    root.add_module("sub", sub)
    w = torch.nn.Parameter(torch.full((2, 3), 1.5))
    sub.register_parameter("w", w)
    b = torch.full((2, 3), 2.5)
    sub.register_buffer("b", b)
    c, hidden = torch.full((2, 3), 3.5), torch.full((2, 3), 4.5)
    root.lifted_tensor_0 = c
    root._hidden = hidden  # not found by the alias scan ('_' names are internals): the reader's path is used
    gm = _store_graph(["sub.w", "sub.b", "lifted_tensor_0", "_hidden"], root)
    result = StoreLowPrecisionParams()(gm)
    root = gm  # the graph module holds root's attributes
    assert result.modified is True
    expected = {"tensors_stored_low": 4, "casts_removed": 4, "aliases_kept_tied": 0, "bytes_saved": 48}
    assert result.counters.items() >= expected.items()
    assert isinstance(sub._parameters["w"], torch.nn.Parameter) and sub._parameters["w"].dtype == torch.float16
    assert "w" not in sub._buffers and "b" not in sub._parameters, "a holder's kind must not change"
    assert sub._buffers["b"].dtype == torch.float16
    for name in ("lifted_tensor_0", "_hidden"):
        assert name not in root._buffers and name not in root._parameters, f"{name} must stay a plain attribute"
        assert getattr(root, name).dtype == torch.float16, f"{name}: the graph must read the fp16 copy"
    assert [t.dtype for t in (w, b, c, hidden)] == [torch.float32] * 4, "the originals are new tensors' sources"
    assert not any(n.target is aten._to_copy.default for n in gm.graph.nodes), "the casts are gone"
    torch.testing.assert_close(gm(), torch.full((2, 3), 12.0, dtype=torch.float16))


def test_store_low_params_keeps_every_alias_of_a_tied_tensor_tied_and_counts_them() -> None:
    """One parameter under three names and one plain constant under two, each read through one name: every
    name gets the one new fp16 tensor, and aliases_kept_tied counts the extra names of both (2 + 1)."""
    from amplite.passes.store_low_params import StoreLowPrecisionParams

    root, a, b = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    root.add_module("a", a)
    root.add_module("b", b)
    w = torch.nn.Parameter(torch.ones(4))
    for owner, name in ((a, "w"), (b, "w"), (root, "head")):
        owner.register_parameter(name, w)
    k = torch.full((4,), 2.0)
    root.lifted_tensor_0 = k
    a.lifted_tensor_1 = k
    gm = _store_graph(["a.w", "lifted_tensor_0"], root)
    result = StoreLowPrecisionParams()(gm)
    root = gm  # the graph module holds root's attributes
    assert result.counters.items() >= {"tensors_stored_low": 2, "casts_removed": 2, "aliases_kept_tied": 3,
                               "bytes_saved": 2 * 4 * 2}.items()  # fmt: skip
    assert a.w is b.w is root.head and a.w.dtype == torch.float16 and isinstance(root.head, torch.nn.Parameter)
    assert root.lifted_tensor_0 is a.lifted_tensor_1 and a.lifted_tensor_1.dtype == torch.float16


def test_store_low_params_reports_modified_for_a_single_tensor() -> None:
    """Storing exactly one tensor low is a modification (the pass manager recompiles on it)."""
    from amplite.passes.store_low_params import StoreLowPrecisionParams

    root = torch.nn.Module()
    root.register_buffer("only", torch.ones(3))
    result = StoreLowPrecisionParams()(_store_graph(["only"], root))
    assert result.modified is True and result.counters["tensors_stored_low"] == 1


def test_store_low_params_updates_a_tied_buffer_everywhere_and_a_shared_module_once() -> None:
    """A buffer held by two modules gets the new fp16 tensor in both; a submodule reachable under two names
    is one holder (its parameter is not counted as a tied alias of itself)."""
    from amplite.passes.store_low_params import StoreLowPrecisionParams

    root, a, b, shared = torch.nn.Module(), torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    buf = torch.full((3,), 2.0)
    a.register_buffer("scale", buf)
    b.register_buffer("scale", buf)
    shared.register_parameter("w", torch.nn.Parameter(torch.ones(3)))
    for name, child in (("a", a), ("b", b), ("s1", shared), ("s2", shared)):
        root.add_module(name, child)
    gm = _store_graph(["a.scale", "s1.w"], root)
    result = StoreLowPrecisionParams()(gm)
    assert result.counters.items() >= {"tensors_stored_low": 2, "casts_removed": 2, "aliases_kept_tied": 1,
                               "bytes_saved": 2 * 3 * 2}.items()  # fmt: skip
    assert gm.a.scale is gm.b.scale and gm.b.scale.dtype == torch.float16 and "scale" in gm.b._buffers
    assert gm.s2.w.dtype == torch.float16


# store_low_params


class _Mixed(nn.Module):
    """A Linear (stored low at O2), a buffer read only through a cast, a frozen weight and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8, bias=False).requires_grad_(False)
        self.ln = nn.LayerNorm(8)
        self.register_buffer("scale", torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.frozen(self.lin(x) * self.scale))


def _o2(model: nn.Module, x: torch.Tensor, prefix: str | None = None) -> tuple[torch.fx.GraphModule, dict]:
    gm = torch.export.export(model.eval(), (x,), strict=False).module()
    strip_export_checks(gm)
    policy = PrecisionPolicy("fp16", Level.O2)
    gm, records = PassManager(
        [AnnotatePrecision(policy), InsertCasts(), CleanupCasts(), StoreLowPrecisionParams(prefix)]
    )(gm)
    return gm, records[-1].counters


def test_store_low_keeps_kinds_requires_grad_and_counts() -> None:
    model, x = _Mixed(), torch.randn(3, 8)
    gm, counters = _o2(model, x)
    assert gm.lin.weight.dtype == gm.scale.dtype == gm.frozen.weight.dtype == torch.float16
    assert isinstance(gm.lin.weight, nn.Parameter) and gm.lin.weight.requires_grad
    assert isinstance(gm.frozen.weight, nn.Parameter) and not gm.frozen.weight.requires_grad
    assert "scale" in gm._buffers and not isinstance(gm.scale, nn.Parameter), "a buffer stays a buffer"
    assert gm.ln.weight.dtype == gm.ln.bias.dtype == torch.float32
    n_low = 64 + 8 + 8 + 64  # lin.weight, lin.bias, scale, frozen.weight
    expected = {"tensors_stored_low": 4, "casts_removed": 4, "bytes_saved": n_low * 2, "aliases_kept_tied": 0}
    assert counters.items() >= expected.items()
    for node in gm.graph.nodes:  # the readers' example values carry the stored dtype
        if node.op == "get_attr" and not node.target.startswith("ln."):
            assert node.meta["val"].dtype == torch.float16, node.target
    assert not [n for n in gm.graph.nodes if cast_dtype(n) is not None and n.args[0].op == "get_attr"]
    torch.testing.assert_close(gm(x), model(x), atol=2e-2, rtol=2e-2)
    assert model.lin.weight.dtype == torch.float32 and model.scale.dtype == torch.float32


def test_store_low_with_a_prefix_touches_only_matching_tensors() -> None:
    gm, counters = _o2(_Mixed(), torch.randn(3, 8), prefix="lin.")
    assert gm.lin.weight.dtype == gm.lin.bias.dtype == torch.float16
    assert gm.scale.dtype == gm.frozen.weight.dtype == torch.float32
    assert counters["tensors_stored_low"] == 2


class _Float64(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(8, dtype=torch.float64))
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.w.to(torch.float16)


def test_store_low_leaves_non_fp32_tensors_alone() -> None:
    gm, counters = _o2(_Float64(), torch.randn(2, 8))
    assert gm.w.dtype == torch.float64, "only FP32 tensors are stored low"
    assert counters["tensors_stored_low"] == 2


class _Detailed(PassBase):
    name = "detailed"

    def __call__(self, gm: torch.fx.GraphModule) -> object:
        return types.SimpleNamespace(graph_module=gm, modified=False, counters={"n": 1}, details={"why": ["x"]})


def test_pass_manager_keeps_details_and_store_low_reports_modified() -> None:
    gm = export_eval(nn.Linear(2, 2), torch.randn(1, 2))
    _, (record,) = PassManager([_Detailed()])(gm)
    assert (record.name, record.modified, record.counters, record.details) == (
        "detailed",
        False,
        {"n": 1},
        {"why": ["x"]},
    )
    gm = export_eval(nn.LayerNorm(4), torch.randn(2, 4))  # nothing read only through casts
    assert not StoreLowPrecisionParams()(gm).modified
    gm, _ = _o2(nn.Linear(4, 4), torch.randn(2, 4))
    assert gm.weight.dtype == torch.float16
    gm2 = export_eval(nn.Linear(4, 4), torch.randn(2, 4))
    PassManager([AnnotatePrecision(PrecisionPolicy("fp16", Level.O2)), InsertCasts(), CleanupCasts()])(gm2)
    assert StoreLowPrecisionParams()(gm2).modified


class _ScalarAndGains(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.g1, self.g2 = nn.Parameter(torch.rand(4) + 0.5), nn.Parameter(torch.rand(4) + 0.5)
        self.s = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.g1 + self.b(x) * self.g2 + self.a(x) * self.s


def test_promotions_are_counted_and_zero_dim_operands_are_not_cast() -> None:
    model, x = _ScalarAndGains().eval(), torch.randn(3, 4)
    gm = export_eval(model, x)
    gm, records = PassManager([AnnotatePrecision(PrecisionPolicy("fp16", Level.O1)), InsertCasts()])(gm)
    counters = records[-1].counters
    assert counters["promotions_in_kernel"] == 3, counters  # two fp16 * FP32-gain products, one fp32 + fp16 add
    s = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "s")
    assert all(cast_dtype(u) is None for u in s.users), "a 0-dim FP32 operand of a follow op is read as it is"
    torch.testing.assert_close(gm(x), model(x), atol=2e-2, rtol=2e-2)


class _UserCastThenFollow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.half()
        return h + h  # a follow op on a user cast computes in the cast's dtype


def test_user_cast_output_dtype_is_the_cast_dtype() -> None:
    gm = export_eval(_UserCastThenFollow(), torch.randn(2, 3))
    AnnotatePrecision(PrecisionPolicy("bf16", Level.O1))(gm)
    cast = next(n for n in gm.graph.nodes if cast_dtype(n) is not None)
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    assert cast.meta[OUT_DTYPE_KEY] == torch.float16
    assert add.meta[PRECISION_KEY]["dtype"] == torch.float16, add.meta[PRECISION_KEY]


@pytest.mark.parametrize("partner_first", [True, False])
def test_cast_after_data_movement_merges_with_the_existing_cast(partner_first: bool) -> None:
    def both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if partner_first:
            return x.half() * 2, x.t().half() * 3
        t = x.t().half() * 3
        return x.half() * 2, t

    x = torch.randn(3, 4)
    gm = export_eval(Fn(both), x)
    result = CleanupCasts()(gm)
    gm.recompile()
    casts = [n for n in gm.graph.nodes if cast_dtype(n) is not None]
    assert len(casts) == 1 and result.counters["moved_above_data_movement"] == 1, (casts, result.counters)
    gm.graph.lint()
    got = gm(x)
    assert torch.equal(got[0], x.half() * 2) and torch.equal(got[1], x.t().half() * 3)


def test_two_movable_casts_in_one_graph_both_move() -> None:
    x, y = torch.randn(3, 4), torch.randn(5, 2)
    gm = export_eval(Fn(lambda x, y: (x.half() + 1, x.t().half() * 3, y.half() - 1, y.t().half() * 2)), x, y)
    result = CleanupCasts()(gm)
    gm.recompile()
    assert result.counters["moved_above_data_movement"] == 2, result.counters
    assert len([n for n in gm.graph.nodes if cast_dtype(n) is not None]) == 2
    assert torch.equal(gm(x, y)[3], y.t().half() * 2)


# --- CleanupCasts: the rounds, the order of skipped casts, exact counters, its postcondition ----------------


def _bare_cast(g: torch.fx.Graph, value: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    """A cast with no recorded example value (as another pass may leave one): its dtype is known, its size not."""
    return g.call_function(aten._to_copy.default, (value,), {"dtype": dtype})


def test_cleanup_repeats_its_rules_until_a_cast_moved_above_an_expand_folds() -> None:
    """cast16(expand(cast32(h))) with h fp16: moving the fp16 cast above the expand (the only change of the
    first round) leaves an exact round trip fp16 -> fp32 -> fp16, which the next round folds: the expand reads
    h. The moved cast is counted once, as a move (the cast it replaces is not also an identity removal)."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        col = _call(g, aten.slice.Tensor, (x, 1, 0, 1), val=torch.zeros(2, 1))
        h = _cast(g, col, torch.float16)
        e = _call(g, aten.expand.default, (_cast(g, h, torch.float32), [2, 3]))
        return _cast(g, e, torch.float16)

    gm, result, lines = _cleanup(build)
    assert lines == [
        "slice_1=slice(x,1,0,1)",
        "_to_copy=_to_copy(slice_1)->torch.float16",
        "expand=expand(_to_copy,[2, 3])",
        "out:expand",
    ]
    assert result.counters.items() >= {"moved_above_data_movement": 1, "round_trips_folded": 1}.items()
    assert result.counters["identity_removed"] == 0
    assert _node(gm, "expand").meta["val"].dtype == torch.float16


def test_cleanup_repeats_its_rules_until_a_cast_moved_below_a_slice_folds() -> None:
    """cast16(slice(cast32(h))) with h fp16: moving the exact fp32 cast below the slice (the only change of the
    first round) leaves slice(h) -> fp32 -> fp16, an exact round trip the next round folds; h's cast, now read
    only by the slice, then moves below it too."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        h = _cast(g, x, torch.float16)
        s = _call(g, aten.slice.Tensor, (_cast(g, h, torch.float32), 0, 0, 1), val=torch.zeros(1, 3))
        return _cast(g, s, torch.float16)

    gm, result, lines = _cleanup(build)
    assert lines == ["slice_1=slice(x,0,0,1)", "_to_copy_4=_to_copy(slice_1)->torch.float16", "out:_to_copy_4"]
    assert result.counters.items() >= {"moved_below_data_movement": 2, "round_trips_folded": 1}.items()
    assert _node(gm, "slice_1").meta["val"].dtype == torch.float32


def test_cleanup_repeats_its_rules_after_an_identity_cast_goes() -> None:
    """A cast whose source has no recorded value is left alone (its source dtype is unknown) until an earlier
    round shows it: removing the identity cast it reads makes it an identity cast of x, removed next round."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        return _cast(g, _bare_cast(g, x, torch.float32), torch.float32)

    _, result, lines = _cleanup(build)
    assert lines == ["out:x"]
    assert result.counters["identity_removed"] == 2


def test_cleanup_repeats_its_rules_after_duplicates_merge() -> None:
    """Three fp16 casts of x are one after merging (counted twice); a cast of the second, whose source had no
    recorded value, then reads the kept fp16 cast: an identity cast, removed in the next round."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        first = _cast(g, x, torch.float16)
        twice = _cast(g, _bare_cast(g, x, torch.float16), torch.float16)
        third = _cast(g, x, torch.float16)
        return (_call(g, aten.neg.default, (first,)), twice, _call(g, aten.relu.default, (third,)))

    _, result, lines = _cleanup(build)
    assert lines == ["_to_copy=_to_copy(x)->torch.float16", "neg=neg(_to_copy)", "relu=relu(_to_copy)",
                     "out:neg,_to_copy,relu"]  # fmt: skip
    assert result.counters.items() >= {"duplicates_merged": 2, "identity_removed": 1}.items()


def test_cleanup_repeats_its_rules_after_a_round_trip_folds() -> None:
    """fp16 -> fp32 -> fp16 (the last step without a recorded value) folds to the fp16 value; the cast that read
    that last step is then an identity cast of it, removed in the next round."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        h = _cast(g, x, torch.float16)
        return _cast(g, _bare_cast(g, _cast(g, h, torch.float32), torch.float16), torch.float16)

    _, result, lines = _cleanup(build)
    assert lines == ["_to_copy=_to_copy(x)->torch.float16", "out:_to_copy"]
    assert result.counters.items() >= {"round_trips_folded": 1, "identity_removed": 1}.items()


def test_cleanup_counts_every_fold_and_keeps_a_positional_dtype_when_shortening() -> None:
    """Two exact round trips fold (counted twice), two shrinking slices take their casts below them (counted
    twice), and a chain whose last cast names its dtype positionally (prims.convert_element_type) keeps it."""
    h16 = torch.zeros(2, 3, dtype=torch.float16)

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        h = _cast(g, x, torch.float16)
        n = _call(g, aten.neg.default, (h,), val=h16)
        trips = [_cast(g, _cast(g, v, torch.float32), torch.float16) for v in (h, n)]
        bf = _call(g, torch.ops.prims.convert_element_type.default, (_cast(g, n, torch.float32), torch.bfloat16),
                   val=torch.zeros(2, 3, dtype=torch.bfloat16))  # fmt: skip
        y = _call(g, aten.relu.default, (x,))
        one16 = torch.zeros(1, 3, dtype=torch.float16)
        slices = [
            _call(g, aten.slice.Tensor, (_cast(g, v, torch.float16), 0, 0, 1), val=one16)
            for v in (y, _call(g, aten.abs.default, (x,)))
        ]
        return (*trips, bf, *slices)

    gm, result, lines = _cleanup(build)
    bf = next(n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default)
    assert bf.args == (_node(gm, "neg"), torch.bfloat16) and cast_dtype(bf) == torch.bfloat16
    assert result.counters.items() >= {"round_trips_folded": 2, "chains_shortened": 1,
                                       "moved_below_data_movement": 2}.items()  # fmt: skip
    assert lines[-1] == "out:_to_copy,neg,convert_element_type,_to_copy_8,_to_copy_9"


def test_cleanup_moves_a_cast_below_a_slice_after_skipping_casts_it_must_keep() -> None:
    """Casts read twice, read by a reduction (fewer elements, but a reduction is no data movement: the sum must
    stay fp16), read by a slice that keeps every element, or of unknown size stay; a later cast still moves
    below its shrinking slice."""
    h16, one16 = torch.zeros(2, 3, dtype=torch.float16), torch.zeros(1, 3, dtype=torch.float16)

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        twice = _cast(g, x, torch.float16)
        summed = _cast(g, _call(g, aten.neg.default, (x,)), torch.float16)
        full = _cast(g, _call(g, aten.relu.default, (x,)), torch.float16)
        unknown = _bare_cast(g, _call(g, aten.abs.default, (x,)), torch.float16)
        moved = _cast(g, _call(g, aten.exp.default, (x,)), torch.float16)
        return (
            _call(g, aten.neg.default, (twice,), val=h16),
            _call(g, aten.relu.default, (twice,), val=h16),
            _call(g, aten.sum.default, (summed,), val=torch.zeros((), dtype=torch.float16)),
            _call(g, aten.slice.Tensor, (full, 0, 0, 2), val=h16),
            _call(g, aten.slice.Tensor, (unknown, 0, 0, 1), val=one16),
            _call(g, aten.slice.Tensor, (moved, 0, 0, 1), val=one16),
        )

    _, result, lines = _cleanup(build)
    assert lines[-8:] == [
        "neg_1=neg(_to_copy)",
        "relu_1=relu(_to_copy)",
        "sum_1=sum(_to_copy_1)",  # the sum still reads the fp16 cast
        "slice_1=slice(_to_copy_2,0,0,2)",
        "slice_2=slice(_to_copy_3,0,0,1)",
        "slice_3=slice(exp,0,0,1)",
        "_to_copy_5=_to_copy(slice_3)->torch.float16",
        "out:neg_1,relu_1,sum_1,slice_1,slice_2,_to_copy_5",
    ]
    assert result.counters["moved_below_data_movement"] == 1


def test_cleanup_moves_a_cast_above_an_expand_after_skipping_casts_it_must_keep() -> None:
    """A cast of the graph input (no data movement before it), a dead cast, the cast of an expand that another op
    also reads (that op needs the FP32 expand) and a permute's cast with no cast of its source to merge with all
    stay (the dead one goes as dead code, not counted as a move); a later expand still takes its cast above it."""
    col = torch.zeros(2, 1)

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        first = _cast(g, x, torch.bfloat16)
        cols = [_call(g, aten.slice.Tensor, (x, 1, i, i + 1), val=col) for i in range(3)]
        _cast(g, _call(g, aten.expand.default, (cols[0], [2, 3])), torch.float16)  # dead: nothing reads it
        shared = _call(g, aten.expand.default, (cols[1], [2, 3]))
        kept = (_cast(g, shared, torch.float16), _call(g, aten.relu.default, (shared,)))
        p = _call(g, aten.permute.default, (_call(g, aten.neg.default, (x,)), [1, 0]), val=torch.zeros(3, 2))
        kept += (_cast(g, p, torch.float16),)
        return (first, *kept, _cast(g, _call(g, aten.expand.default, (cols[2], [2, 3])), torch.float16))

    _, result, lines = _cleanup(build)
    assert lines == [
        "_to_copy=_to_copy(x)->torch.bfloat16",
        "slice_2=slice(x,1,1,2)",
        "slice_3=slice(x,1,2,3)",
        "expand_1=expand(slice_2,[2, 3])",  # read by the relu too: stays FP32
        "_to_copy_2=_to_copy(expand_1)->torch.float16",
        "relu=relu(expand_1)",
        "neg=neg(x)",
        "permute=permute(neg,[1, 0])",
        "_to_copy_3=_to_copy(permute)->torch.float16",
        "_to_copy_5=_to_copy(slice_3)->torch.float16",  # moved above the last expand
        "expand_2=expand(_to_copy_5,[2, 3])",
        "out:_to_copy,_to_copy_2,relu,_to_copy_3,expand_2",
    ]
    assert result.counters["moved_above_data_movement"] == 1


def test_cleanup_postcondition_names_each_broken_guarantee() -> None:
    """ensures() accepts what the pass leaves (a lossy round trip is the plan's rounding) and names an identity
    cast, a second cast of one value to one dtype (the dtype without 'torch.') and a skippable exact step."""
    from amplite.passes.base import PostconditionError

    def check(build: Build) -> str | None:
        try:
            CleanupCasts().ensures(_gm(build))
        except PostconditionError as err:
            return err.condition
        return None

    assert check(lambda g, x, r: _cast(g, _cast(g, x, torch.float16), torch.float32)) is None
    assert check(lambda g, x, r: _cast(g, x, torch.float32)) == (
        "cast _to_copy_default converts x to the dtype it already has"
    )
    assert check(lambda g, x, r: (_cast(g, x, torch.bfloat16), _cast(g, x, torch.bfloat16))) == (
        "x is cast to bfloat16 more than once"
    )
    h = check(lambda g, x, r: _cast(g, _cast(g, _cast(g, x, torch.float16), torch.float32), torch.bfloat16))
    assert h == "cast _to_copy_default_2 reads cast _to_copy_default_1, an exact conversion it could skip"


# --- InsertCasts: what it reports, outputs that keep their dtype, every node retyped, its postcondition ------


def test_insert_casts_reports_modified_only_when_it_inserted_a_cast() -> None:
    """An FP32 plan needs no cast: modified False, and an output that keeps its dtype is not cast back. One
    inserted cast is a modification."""
    _, result, lines = _insert(lambda g, x, r: _planned(_call(g, aten.relu.default, (x,)), torch.float32))
    assert lines == ["relu=relu(x)", "out:relu"]
    assert result.modified is False and result.counters["casts_inserted"] == 0
    _, result, _ = _insert(
        lambda g, x, r: _planned(_call(g, aten.relu.default, (x,)), torch.float16), low_precision_io=True
    )
    assert result.modified is True and result.counters["casts_inserted"] == 1


def test_insert_casts_records_the_planned_dtype_of_inputs_and_constants() -> None:
    """A graph input and a constant planned in fp16 while their recorded values are FP32 carry an fp16 value
    afterwards, like every computed node: the plan, not the export, says what each node holds."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        x.meta[OUT_DTYPE_KEY] = torch.float16
        w = _attr(g, "w", r.w)
        w.meta[OUT_DTYPE_KEY] = torch.float16
        return _planned(_call(g, aten.mul.Tensor, (x, w)), torch.float16)

    gm = _gm(build, w=torch.ones(2, 3))
    InsertCasts(low_precision_io=True)(gm)
    assert [n.meta["val"].dtype for n in gm.graph.nodes if n.op != "output"] == [torch.float16] * 3
    assert not any(cast_dtype(n) is not None for n in gm.graph.nodes), "nothing to cast: both are fp16 already"


def _scalar(g: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
    """A 0-dim FP32 value computed from x: ``select(sum(x, 1), 0, 0)``."""
    row_sums = _call(g, aten.sum.dim_IntList, (x, [1]), val=torch.zeros(2))
    return _call(g, aten.select.int, (row_sums, 0, 0), val=torch.zeros(()))


@pytest.mark.parametrize(
    ("op", "mode", "operands", "culprit"),
    [
        (aten.add.Tensor, "compute", ("h", "x"), "x"),  # add promotes in the kernel only as an FP32 follow op
        (aten.div.Tensor, "follow", ("h", "x"), "x"),  # a follow op planned fp16 reads fp16 too
        (aten.mul.Tensor, "compute", ("h", "s"), "select"),  # a 0-dim operand is exempt for follow ops only
        (aten.add.Tensor, "follow", ("s", "x"), "x"),  # after an exempt 0-dim operand, the next one is checked
    ],
)
def test_insert_casts_postcondition_names_the_operand_read_in_the_wrong_dtype(
    op: Any, mode: str, operands: tuple[str, ...], culprit: str
) -> None:
    """Without the casts, a node planned in fp16 that reads an FP32 operand breaks the postcondition, which
    names the node, its dtype, the operand and the operand's dtype."""
    from amplite.passes.base import PostconditionError

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        values = {
            "x": x,
            "h": _cast(g, x, torch.float16),
            "s": _scalar(g, x),
        }
        node = _planned(_call(g, op, tuple(values[o] for o in operands)), torch.float16, mode=mode)
        node.name = "node"
        return node

    with pytest.raises(PostconditionError) as info:
        InsertCasts().ensures(_gm(build))
    assert info.value.condition == f"node node is planned in float16 but reads {culprit} in float32"


def test_insert_casts_postcondition_accepts_its_exceptions() -> None:
    """An FP32 follow add reading fp16 promotes in the kernel, a 0-dim FP32 operand of an fp16 follow op and an
    fp64 operand are read as they are: the postcondition holds."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        h = _cast(g, x, torch.float16)
        s = _scalar(g, x)
        d = _cast(g, x, torch.float64)
        return (
            _planned(_call(g, aten.add.Tensor, (h, x)), torch.float32, mode="follow"),
            _planned(_call(g, aten.mul.Tensor, (h, s)), torch.float16, mode="follow"),
            _planned(_call(g, aten.mul.Tensor, (h, d)), torch.float16),
        )

    assert InsertCasts().ensures(_gm(build)) is None


# --- StoreLowPrecisionParams: its postcondition, mixed low readers, a shared holder of a plain constant ------


def test_store_low_postcondition_names_an_fp32_tensor_read_only_in_a_low_dtype() -> None:
    """Before the pass, a weight read only through fp16 casts breaks its postcondition, which names the weight
    (after the graph input and a get_attr of a module, which are no tensors to check); with a prefix, only
    matching tensors are checked."""
    from amplite.passes.base import PostconditionError

    root, sub = torch.nn.Module(), torch.nn.Module()
    root.add_module("sub", sub)
    sub.register_buffer("w", torch.ones(2, 3))
    gm = _store_graph(["sub.w"], root)
    with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
        gm.graph.placeholder("x")
        gm.graph.get_attr("sub")  # a module, not a tensor
    with pytest.raises(PostconditionError) as info:
        StoreLowPrecisionParams().ensures(gm)
    assert info.value.condition == "sub.w is only read as torch.float16 but stored in FP32"
    with pytest.raises(PostconditionError):
        StoreLowPrecisionParams(prefix="sub.").ensures(gm)
    assert StoreLowPrecisionParams(prefix="other.").ensures(gm) is None


def test_store_low_postcondition_holds_for_a_tied_tensor_read_in_fp32_under_another_name() -> None:
    """One tensor under two names, read in FP32 through the first and through an fp16 cast through the second,
    must stay FP32: the postcondition holds (and the pass leaves it)."""
    root, a, b = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    w = torch.nn.Parameter(torch.ones(3))
    root.add_module("a", a)
    root.add_module("b", b)
    a.register_parameter("w", w)
    b.register_parameter("w", w)
    g = torch.fx.Graph()
    first, second = g.get_attr("a.w"), g.get_attr("b.w")
    first.meta["val"] = second.meta["val"] = w
    fp32 = g.call_function(aten.neg.default, (first,))
    low = g.call_function(aten._to_copy.default, (second,), {"dtype": torch.float16})
    g.output((fp32, low))
    gm = torch.fx.GraphModule(root, g)
    assert StoreLowPrecisionParams().ensures(gm) is None
    result = StoreLowPrecisionParams()(gm)
    assert result.modified is False and gm.a.w.dtype == torch.float32


def test_store_low_keeps_fp32_a_tensor_cast_to_two_low_dtypes() -> None:
    """A weight cast to fp16 by one reader and to bf16 by another has no one low dtype to be stored in."""
    root = torch.nn.Module()
    root.register_buffer("w", torch.ones(3))
    g = torch.fx.Graph()
    w = g.get_attr("w")
    w.meta["val"] = root.w
    casts = tuple(g.call_function(aten._to_copy.default, (w,), {"dtype": dt}) for dt in (torch.float16, torch.bfloat16))
    g.output(casts)
    gm = torch.fx.GraphModule(root, g)
    result = StoreLowPrecisionParams()(gm)
    assert result.modified is False and gm.w.dtype == torch.float32
    assert [cast_dtype(n) for n in gm.graph.nodes if n.op == "call_function"] == [torch.float16, torch.bfloat16]


def test_store_low_counts_no_tied_alias_for_a_plain_constant_of_a_shared_module() -> None:
    """A plain tensor constant of a submodule reachable under two names is one holder: stored low once, no
    tied alias counted."""
    root, shared = torch.nn.Module(), torch.nn.Module()
    shared.lifted_tensor_0 = torch.full((3,), 2.0)
    root.add_module("s1", shared)
    root.add_module("s2", shared)
    gm = _store_graph(["s1.lifted_tensor_0"], root)
    result = StoreLowPrecisionParams()(gm)
    assert result.counters.items() >= {"tensors_stored_low": 1, "aliases_kept_tied": 0}.items()
    assert gm.s2.lifted_tensor_0.dtype == torch.float16 and "lifted_tensor_0" not in shared._buffers


def test_store_low_postcondition_names_a_tensor_stored_in_another_dtype_than_planned() -> None:
    """A weight stored in fp16 whose node still records an FP32 value breaks the postcondition, which names the
    weight and both dtypes."""
    from amplite.passes.base import PostconditionError

    root = torch.nn.Module()
    root.register_buffer("w", torch.ones(3, dtype=torch.float16))
    gm = _store_graph(["w"], root)
    next(n for n in gm.graph.nodes if n.op == "get_attr").meta["val"] = torch.ones(3)
    with pytest.raises(PostconditionError) as info:
        StoreLowPrecisionParams().ensures(gm)
    assert info.value.condition == "w is stored in torch.float16 but planned in torch.float32"


def test_insert_casts_counts_each_shared_read_and_leaves_operands_of_unknown_dtype() -> None:
    """Three fp16 ops reading x share one cast (two shared reads); an operand with no recorded value is read as
    it is, by the pass and by its postcondition."""

    def build(g: torch.fx.Graph, x: torch.fx.Node, r: torch.nn.Module) -> Any:
        ops = [_planned(_call(g, op, (x,)), torch.float16) for op in (aten.relu.default, aten.neg.default)]
        unknown = _call(g, aten.abs.default, (x,), val=None)
        return (*ops, _planned(_call(g, aten.mul.Tensor, (x, unknown)), torch.float16))

    gm, result, lines = _insert(build, low_precision_io=True)
    assert "mul=mul(_to_copy,abs_1)" in lines
    assert result.counters.items() >= {"casts_inserted": 1, "casts_shared": 2}.items()
    assert InsertCasts().ensures(gm) is None
