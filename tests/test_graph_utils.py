"""X"""

from __future__ import annotations

import operator
import types
from typing import Any

import pytest
import sympy
import torch
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from amplite.passes import graph_utils as gu
from amplite.passes.einsum_modes import NotFusable
from amplite.passes.meta import CAST_KEY
from tests.exported import export_eval

aten = torch.ops.aten


# --- graph_utils helpers -----------------------------------------------------------------------------------


def test_exact_conversions_are_the_widening_float_ones() -> None:
    """fp16/bf16 → fp32/fp64 and fp32 → fp64 are exact, as is any dtype to itself; narrowing or fp16↔bf16 is not."""
    floats = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    rank = {dt: i for i, dt in enumerate(floats)}
    exact = {(a, b) for a in floats for b in floats if a == b or (rank[b] >= 2 and rank[a] < rank[b])}
    for a in floats:
        for b in floats:
            assert gu.is_exact_conversion(a, b) == ((a, b) in exact), (a, b)
    assert gu.is_exact_conversion(torch.int32, torch.int32) and not gu.is_exact_conversion(torch.int32, torch.float32)


def _node(graph: torch.fx.Graph, val: Any = None, name: str = "x") -> torch.fx.Node:
    node = graph.placeholder(name)
    if val is not None:
        node.meta["val"] = val
    return node


def test_value_helpers_read_the_recorded_example_value() -> None:
    """fake_value/value_dtype/is_float_tensor/numel/dtypes_of read meta['val']; non-nodes and non-tensors give None."""
    g = torch.fx.Graph()
    half, ints, pair, bare = (
        _node(g, torch.zeros(2, 3).half(), "h"),
        _node(g, torch.zeros(4, dtype=torch.int64), "i"),
        _node(g, (torch.zeros(1), [torch.zeros(1).half()]), "p"),
        _node(g, None, "b"),
    )
    assert gu.fake_value(half).shape == (2, 3) and gu.fake_value(bare) is None and gu.fake_value(3) is None
    assert (gu.value_dtype(half), gu.value_dtype(ints), gu.value_dtype(pair), gu.value_dtype(bare)) == (
        torch.float16,
        torch.int64,
        None,
        None,
    )
    assert gu.is_float_tensor(half) and not gu.is_float_tensor(ints) and not gu.is_float_tensor(bare)
    assert (gu.numel(half), gu.numel(ints), gu.numel(pair), gu.numel(bare), gu.numel(2.0)) == (6, 4, None, None, None)
    assert gu.dtypes_of(gu.fake_value(pair)) == (torch.float32, (torch.float16,)) and gu.dtypes_of(1.0) is None


def test_cast_dtype_recognises_pure_casts_only() -> None:
    """The dtype a pure cast produces, for each recorded spelling; device moves and memory-format casts are None."""
    g = torch.fx.Graph()
    x = _node(g, torch.zeros(2))
    cases = [
        (aten._to_copy.default, (x,), {"dtype": torch.float16}, torch.float16),
        (
            aten._to_copy.default,
            (x,),
            {
                "dtype": torch.float16,
                "device": torch.device("cpu"),
                "layout": torch.strided,
                "pin_memory": False,
                "non_blocking": False,
                "copy": True,
            },
            torch.float16,
        ),
        (aten._to_copy.default, (x,), {"dtype": torch.float16, "device": torch.device("meta")}, None),  # a move
        (aten._to_copy.default, (x,), {"dtype": torch.float16, "memory_format": torch.channels_last}, None),
        (aten._to_copy.default, (x,), {}, None),  # no dtype: a copy
        (aten.to.dtype, (x, torch.bfloat16), {}, torch.bfloat16),
        (aten.to.dtype, (x,), {"dtype": torch.float64}, torch.float64),
        (aten.to.dtype_layout, (x,), {"dtype": torch.float16}, torch.float16),
        (torch.ops.prims.convert_element_type.default, (x, torch.float16), {}, torch.float16),
        (aten.add.Tensor, (x, x), {}, None),
    ]
    for target, args, kwargs, want in cases:
        node = g.call_function(target, args, kwargs)
        assert gu.cast_dtype(node) == want, (target, kwargs)
    y = _node(g, None, "y")  # no fake value for the source: a device kwarg cannot be compared, the cast counts
    assert gu.cast_dtype(g.call_function(aten._to_copy.default, (y,), {"dtype": torch.float16, "device": "cuda"})) is (
        torch.float16
    )
    assert gu.cast_dtype(g.call_method("to", (x, torch.float16))) is None, "only call_function nodes are casts"


def test_retype_replaces_dtypes_structurally() -> None:
    """retype keeps a value of the right dtype as is, retypes tensors inside tuples/lists, passes the rest through."""
    t = torch.zeros(2, 3)
    assert gu.retype(t, torch.float32) is t
    half = gu.retype(t, torch.float16)
    assert half.dtype == torch.float16 and half.shape == (2, 3)
    pair = gu.retype([t, (t, 1)], (torch.float16, (torch.bfloat16, None)))
    assert isinstance(pair, list) and pair[0].dtype == torch.float16 and pair[1][0].dtype == torch.bfloat16
    assert pair[1][1] == 1
    assert gu.retype((t, t), (torch.float16,)) == (t, t) or gu.retype((t, t), (torch.float16,))[0] is t, "length"
    short = gu.retype((t, t), (torch.float16,))
    assert short[0] is t and short[1] is t, "a dtype tuple of another length changes nothing"
    assert gu.retype(t, (torch.float16,)) is t and gu.retype(5, torch.float16) == 5


def test_retype_of_fake_values_keeps_mode_shape_and_strides() -> None:
    """A static fake value is retyped within its mode (shape, strides, device kept); a symbolic one via .to."""
    mode = FakeTensorMode()
    fake = mode.from_tensor(torch.zeros(3, 4).t())
    out = gu.retype(fake, torch.float16)
    assert out.fake_mode is mode and out.dtype == torch.float16
    assert (tuple(out.shape), out.stride()) == ((4, 3), (1, 4)), "strides of the transposed value are kept"
    sym = _SYM_X
    out = gu.retype(sym, torch.float16)
    assert out.dtype == torch.float16 and out.shape == sym.shape and out.fake_mode is sym.fake_mode


def test_make_cast_inherits_location_and_records_dtype() -> None:
    """make_cast creates _to_copy(value, dtype), with a retyped fake value, the producer's location and the mark."""
    g = torch.fx.Graph()
    x = _node(g, torch.zeros(2, 2))
    x.meta.update({"nn_module_stack": {"k": ("enc", nn.Linear)}, "stack_trace": 'File "m.py", line 3'})
    cast = gu.make_cast(g, x, torch.bfloat16)
    assert (cast.target, cast.args, cast.kwargs) == (aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
    assert cast.meta["val"].dtype == torch.bfloat16 and cast.meta[CAST_KEY] is True
    assert all(cast.meta[k] == x.meta[k] for k in ("nn_module_stack", "stack_trace"))
    bare = gu.make_cast(g, _node(g, None, "y"), torch.float16)
    assert "val" not in bare.meta and "nn_module_stack" not in bare.meta and "stack_trace" not in bare.meta
    assert gu.cast_dtype(cast) == torch.bfloat16


def test_module_path_is_the_innermost_module_without_export_prefixes() -> None:
    """The report's module column: the last nn_module_stack entry, with dynamo's L['self'] prefixes stripped."""
    g = torch.fx.Graph()
    node = _node(g)
    assert gu.module_path(node) == ""
    node.meta["nn_module_stack"] = {}
    assert gu.module_path(node) == ""
    for raw, want in [
        ("enc.layers.0", "enc.layers.0"),
        ("L['self'].enc.attn", "enc.attn"),
        ("L__self__.dec", "dec"),
        ("L['self'].L__self__.x", "x"),
        ("xL['self'].enc", "xL['self'].enc"),
    ]:
        node.meta["nn_module_stack"] = {"a": ("outer", nn.Module), "b": (raw, nn.Linear)}
        assert gu.module_path(node) == want, raw


def test_source_line_is_the_last_user_frame() -> None:
    """file:line of the innermost frame outside torch and site-packages; malformed lines are skipped."""
    g = torch.fx.Graph()
    node = _node(g)
    assert gu.source_line(node) == ""
    node.meta["stack_trace"] = "\n".join(
        [
            '  File "/home/u/model.py", line 12, in forward',
            "    y = self.block(x)",
            '  File "/home/u/block.py", line 40, in forward',
            '  File "/usr/lib/python3/site-packages/foo/bar.py", line 7, in f',
            '  File "/x/torch/nn/modules/linear.py", line 125, in forward',
            '  File "broken.py"',
        ]
    )
    assert gu.source_line(node) == "/home/u/block.py:40"
    node.meta["stack_trace"] = '  File "/a/b.py", line 9'
    assert gu.source_line(node) == "/a/b.py:9"


# --- SymbolicExtents -----------------------------------------------------------------------------------------

_MODE = FakeTensorMode(shape_env=ShapeEnv())


_D, _S = DimDynamic.DYNAMIC, DimDynamic.STATIC


_SYM_X = _MODE.from_tensor(torch.empty(5, 8), symbolic_context=StatelessSymbolicContext(dynamic_sizes=[_D, _S]))


_SYM_Y = _MODE.from_tensor(torch.empty(3, 7, 2), symbolic_context=StatelessSymbolicContext(dynamic_sizes=[_S, _D, _D]))


S0 = _SYM_X.shape[0].node.expr


S1, S2 = (s.node.expr for s in _SYM_Y.shape[1:])


def _sym_graph() -> tuple[torch.fx.Graph, torch.fx.Node, torch.fx.Node]:
    g = torch.fx.Graph()
    x, y = _node(g, _SYM_X, "x"), _node(g, _SYM_Y, "y")
    _node(g, 1.5, "scale")  # a placeholder without a tensor value
    return g, x, y


def _run(g: torch.fx.Graph, out: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    g.output(out)
    return torch.fx.GraphModule(nn.Module(), g)(x, y, 1.5)


def test_symbolic_extents_find_each_symbol_at_its_first_input_dimension() -> None:
    """Each symbol is read from the first placeholder dimension that holds it; static dims and non-tensors add none."""
    g, x, y = _sym_graph()
    z = _node(g, _MODE.from_tensor(torch.empty(2), symbolic_context=StatelessSymbolicContext(dynamic_sizes=[_S])), "z")
    w = _node(g, _SYM_X, "w")  # S0 again, later: the first one is kept
    ext = gu.SymbolicExtents(g)
    assert ext.where == {S0: (x, 0), S1: (y, 1), S2: (y, 2)}
    assert ext.cursor is w and z in g.nodes


@pytest.mark.parametrize(
    ("size", "want"),
    [
        (lambda: S0, 11),
        (lambda: 6 * S0, 66),
        (lambda: S0 * S1 * S2, 11 * 13 * 4),
        (lambda: 3 * S1**2, 3 * 13 * 13),
        (lambda: 128 * S0 * S2, 128 * 11 * 4),
    ],
)
def test_symbolic_extent_nodes_compute_the_extent_at_run_time(size: Any, want: int) -> None:
    """arg(size) builds sym_size/mul nodes right after the placeholders that evaluate to size for new inputs."""
    g, _x, _y = _sym_graph()
    ext = gu.SymbolicExtents(g)
    expr = size()
    ext.check([4, expr], "test")
    node = ext.arg(expr)
    assert ext.arg(expr) is node, "each extent is built once"
    assert ext.arg(7) == 7
    assert sympy.simplify(node.meta["val"].node.expr - expr) == 0, "the fake value is the extent itself"
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    assert list(g.nodes)[: len(placeholders)] == placeholders, "extent nodes come after every placeholder"
    assert all(n.target in (aten.sym_size.int, operator.mul) for n in g.nodes if n.op == "call_function")
    assert _run(g, node, torch.empty(11, 8), torch.empty(3, 13, 4)) == want


def test_two_extents_share_nothing_but_stay_in_order() -> None:
    """A second extent is emitted after the first (the cursor moves), and both evaluate correctly."""
    g, _x, _y = _sym_graph()
    ext = gu.SymbolicExtents(g)
    a, b = ext.arg(2 * S0), ext.arg(S1 * S0)
    order = list(g.nodes)
    assert order.index(a) < order.index(b)
    assert _run(g, (a, b), torch.empty(5, 8), torch.empty(3, 6, 2)) == (10, 30)


@pytest.mark.parametrize(
    "size",
    [
        lambda: S0 + 1,
        lambda: S0 / 2,
        lambda: -2 * S0,
        lambda: sympy.Symbol("other", positive=True) * S0,
        lambda: S1 ** sympy.Rational(1, 2),
        lambda: 1 / S1,
        lambda: 0 * S0 + sympy.Integer(0) * S1 - S1,
    ],
)
def test_extents_that_are_not_products_of_input_sizes_are_not_fusable(size: Any) -> None:
    """check() raises symbolic_view with the extent in the message for sums, fractions, negatives, unknown symbols."""
    g, _x, _y = _sym_graph()
    ext = gu.SymbolicExtents(g)
    expr = size()
    with pytest.raises(NotFusable) as info:
        ext.check([3, S0, expr], "left operand")
    assert info.value.reason == "symbolic_view"
    assert info.value.detail.startswith(f"left operand extent {expr} ")  # the operand and its extent
    ext.check([3, S0, S1 * S2, 2 * S0], "fine")  # products pass


def test_source_line_skips_a_frame_without_a_line_number() -> None:
    from amplite.passes.graph_utils import source_line

    trace = "\n".join(
        [
            '  File "/home/me/model.py", line 12, in forward',
            '  File "/home/me/broken.py" (no number)',
            '  File "/home/me/block.py", line 40, in forward',
            '  File "/usr/lib/python3/site-packages/torch/nn/modules/module.py", line 1, in _call_impl',
            "    return forward_call(*args)",
        ]
    )
    assert source_line(types.SimpleNamespace(meta={"stack_trace": trace})) == "/home/me/block.py:40"
    assert source_line(types.SimpleNamespace(meta={})) == ""


def test_retype_of_a_real_tensor_converts_it() -> None:
    from amplite.passes.graph_utils import retype

    out = retype(torch.ones(2), torch.float16)
    assert out.dtype == torch.float16 and torch.equal(out, torch.ones(2, dtype=torch.float16))
    assert retype(3, torch.float16) == 3


def test_retype_of_tuples_and_same_dtype() -> None:
    from amplite.passes.graph_utils import retype

    t = torch.ones(2)
    assert retype(t, torch.float32) is t, "same dtype: the value itself"
    fake = next(n for n in export_eval(nn.Linear(2, 2), torch.randn(1, 2)).graph.nodes if n.op == "placeholder").meta[
        "val"
    ]
    assert retype(fake, fake.dtype) is fake and retype(fake, torch.float16).dtype == torch.float16
    pair = retype((t, t), (torch.float16, torch.float32))
    assert isinstance(pair, tuple) and pair[0].dtype == torch.float16 and pair[1] is t
    assert retype([t], (torch.float16,))[0].dtype == torch.float16
    assert retype((t, t), None) == (t, t) and retype((t, t), (torch.float16,)) == (t, t)  # no or mismatched dtypes


def test_cast_dtype_is_none_when_the_dtype_argument_is_no_dtype() -> None:
    """A cast whose dtype argument is not a torch.dtype (an int code, a missing one) is not a pure cast."""
    g = torch.fx.Graph()
    x = _node(g, torch.zeros(2))
    for target, args, kwargs in [
        (aten.to.dtype, (x, 5), {}),
        (torch.ops.prims.convert_element_type.default, (x, 5), {}),
        (aten._to_copy.default, (x,), {"dtype": 5}),
        (aten.to.dtype, (x,), {}),
    ]:
        assert gu.cast_dtype(g.call_function(target, args, kwargs)) is None, (target, args, kwargs)


def test_an_exponential_extent_is_not_a_product_of_input_sizes() -> None:
    """2**s0 is no product of input sizes (its base, 2, is no input size): check() refuses it."""
    g, _x, _y = _sym_graph()
    with pytest.raises(NotFusable) as info:
        gu.SymbolicExtents(g).check([2**S0], "left operand")
    assert info.value.reason == "symbolic_view"


def test_retype_of_an_expanded_fake_value_keeps_its_zero_strides() -> None:
    """A broadcast (expanded) value keeps its stride-0 layout when retyped, as a transposed one keeps its strides:
    the retyped value describes the same node's output, not a contiguous copy of it."""
    mode = FakeTensorMode()
    wide = mode.from_tensor(torch.zeros(3, 1).expand(3, 4))
    out = gu.retype(wide, torch.bfloat16)
    assert (out.dtype, tuple(out.shape), out.stride()) == (torch.bfloat16, (3, 4), (1, 0))
    assert out.fake_mode is mode
