"""Tests that kill surviving mutants of `make mutate` (issue 20), area: einsum.

Each test pins a behaviour users rely on, with values chosen so that a wrong implementation is off clearly;
docs/testing.md explains the loop (run mutants, read survivors, add a test or list an equivalent).

Graphs are built by hand (no torch.export) so each test runs in milliseconds: FoldBatchNorm on
conv → batch_norm graphs whose tensors live at the root and in nested submodules, the graph helpers on
nodes with fake values, and SymbolicExtents on placeholders whose fake values have symbolic sizes.
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
import sympy
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from amplite.passes import graph_utils as gu
from amplite.passes.einsum_modes import ModeTable, NotFusable, Operand, exact_div, norm_size
from amplite.passes.fold_batchnorm import FoldBatchNorm

aten = torch.ops.aten

# --- fold_batchnorm on hand-built graphs ------------------------------------------------------------------


def _tensors(cout: int = 4, cin: int = 3, k: int = 3, dims: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """Conv weight/bias and BN statistics/affine parameters far from the identity (so each one matters)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(cout, cin, *(k,) * dims, generator=gen),
        "b": torch.randn(cout, generator=gen),
        "gamma": torch.rand(cout, generator=gen) + 0.5,
        "beta": torch.randn(cout, generator=gen),
        "mean": torch.randn(cout, generator=gen),
        "var": torch.rand(cout, generator=gen) * 0.2 + 0.05,  # small: eps = 0.25 changes the scale a lot
    }


def _owner(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parts, attr = path.split(".")
    mod = root
    for p in parts:
        if not hasattr(mod, p):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    return mod, attr


def _conv_bn_graph(
    where: dict[str, str | None],
    t: dict[str, torch.Tensor],
    *,
    dims: int = 2,
    eps: float = 0.25,
    training: bool = False,
    conv_args: int = 3,
    root: nn.Module | None = None,
    graph: torch.fx.Graph | None = None,
    x: torch.fx.Node | None = None,
) -> tuple[nn.Module, torch.fx.Graph, torch.fx.Node, torch.fx.Node]:
    """Add conv → batch_norm to ``graph``; ``where`` maps each tensor to its dotted attribute (None: absent).

    Weights go in as parameters, the statistics as buffers, like nn.BatchNorm's.
    """
    root = root if root is not None else nn.Module()
    graph = graph if graph is not None else torch.fx.Graph()
    x = x if x is not None else graph.placeholder("x")
    nodes: dict[str, torch.fx.Node | None] = {}
    for key, path in where.items():
        if path is None:
            nodes[key] = None
            continue
        mod, attr = _owner(root, path)
        if key in ("mean", "var"):
            mod.register_buffer(attr, t[key].clone())
        else:
            mod.register_parameter(attr, nn.Parameter(t[key].clone(), requires_grad=False))
        nodes[key] = graph.get_attr(path)
    conv_target = {1: aten.conv1d.default, 2: aten.conv2d.default, 3: aten.conv3d.default}[dims]
    args = (x, nodes["w"], nodes.get("b"))[:conv_args]
    conv = graph.call_function(conv_target, args)
    bn = graph.call_function(
        aten.batch_norm.default,
        (conv, nodes.get("gamma"), nodes.get("beta"), nodes["mean"], nodes["var"], training, 0.1, eps, False),
    )
    return root, graph, conv, bn


def _reference(x: torch.Tensor, t: dict[str, torch.Tensor], present: dict[str, Any], dims: int, eps: float):
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    y = conv(x.double(), t["w"].double(), t["b"].double() if present.get("b") else None)
    g = t["gamma"].double() if present.get("gamma") else None
    b = t["beta"].double() if present.get("beta") else None
    return F.batch_norm(y, t["mean"].double(), t["var"].double(), g, b, training=False, eps=eps)


FULL = {"w": "w", "b": "b", "gamma": "gamma", "beta": "beta", "mean": "mean", "var": "var"}


@pytest.mark.parametrize(
    ("where", "dims", "conv_args"),
    [
        # tensors at the root, two levels down (a.b.w: the owner path has a dot) and one level down
        ({"w": "w", "b": "a.b.bias", "gamma": "bn.weight", "beta": "bn.bias", "mean": "a.b.mean", "var": "var"}, 2, 3),
        ({**FULL, "b": None}, 1, 3),  # conv with an explicit None bias
        ({**FULL, "b": None}, 3, 2),  # conv called as conv3d(x, w): no bias argument at all
        ({**FULL, "gamma": None}, 2, 3),  # BN without weight: scale is 1/sqrt(var + eps)
        ({**FULL, "beta": None}, 1, 3),  # BN without bias: nothing added
    ],
)
def test_fold_batchnorm_matches_conv_then_bn_and_drops_the_old_tensors(
    where: dict[str, str | None], dims: int, conv_args: int
) -> None:
    """The folded conv computes bn(conv(x)) (eps honoured), and every old tensor is removed from its owner."""
    t = _tensors(dims=dims)
    root, graph, _conv, bn = _conv_bn_graph(where, t, dims=dims, conv_args=conv_args)
    graph.output(bn)
    gm = torch.fx.GraphModule(root, graph)
    x = torch.randn(2, 3, *(6,) * dims, generator=torch.Generator().manual_seed(1))
    present = {k: v is not None for k, v in where.items()}
    want = _reference(x, t, present, dims, eps=0.25)
    before = gm(x)
    result = FoldBatchNorm()(gm)
    gm.graph.lint()
    gm.recompile()
    n_tensors = sum(present.values())
    assert result.modified
    assert result.counters == {"folded": 1, "tensors_dropped": n_tensors}, result.counters
    assert not [n for n in gm.graph.nodes if n.target is aten.batch_norm.default]
    torch.testing.assert_close(gm(x).double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(before.double(), want, rtol=1e-5, atol=1e-5)
    params = dict(gm.named_parameters())
    assert set(params) == {"amplite_folded_0_weight", "amplite_folded_0_bias"}, set(params)
    assert not dict(gm.named_buffers()), "the BN statistics are dropped with the rest"
    new_w = params["amplite_folded_0_weight"]
    assert new_w.shape == t["w"].shape and not new_w.requires_grad
    conv = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert [a.target for a in conv.args[1:3]] == ["amplite_folded_0_weight", "amplite_folded_0_bias"]
    assert len(conv.args) == 3, conv.args


def test_two_folds_get_distinct_names_after_an_existing_one() -> None:
    """Each fold takes the first free ``amplite_folded_<n>``: an earlier run's 0 is kept, the new are 1 and 2."""
    t1, t2 = _tensors(seed=2), _tensors(cout=3, cin=4, seed=3)
    root, graph, _, bn1 = _conv_bn_graph({k: f"one.{k}" for k in FULL}, t1)
    root, graph, _, bn2 = _conv_bn_graph({k: f"two.{k}" for k in FULL}, t2, root=root, graph=graph, x=bn1)
    graph.output(bn2)
    gm = torch.fx.GraphModule(root, graph)
    gm.register_parameter("amplite_folded_0_weight", nn.Parameter(torch.zeros(1), requires_grad=False))
    x = torch.randn(1, 3, 9, 9)
    want = gm(x)
    result = FoldBatchNorm()(gm)
    gm.recompile()
    assert result.counters == {"folded": 2, "tensors_dropped": 12}, result.counters
    torch.testing.assert_close(gm(x), want, rtol=1e-4, atol=1e-4)
    names = {n for n, _ in gm.named_parameters()}
    new = {f"amplite_folded_{i}_{k}" for i in (1, 2) for k in ("weight", "bias")}
    assert names == {"amplite_folded_0_weight"} | new, names
    assert gm.amplite_folded_0_weight.shape == (1,), "an existing folded tensor is never overwritten"
    assert gm.amplite_folded_1_weight.shape == t1["w"].shape and gm.amplite_folded_2_weight.shape == t2["w"].shape


def test_half_weights_fold_in_float64_and_are_stored_half() -> None:
    """New weight and bias have the conv weight's dtype and equal the FP64 fold rounded once."""
    t = {k: v.half() for k, v in _tensors().items()}
    root, graph, _, bn = _conv_bn_graph(FULL, t)
    graph.output(bn)
    gm = torch.fx.GraphModule(root, graph)
    FoldBatchNorm()(gm)
    d = {k: v.double() for k, v in t.items()}
    scale = d["gamma"] / torch.sqrt(d["var"] + 0.25)
    want_w = (d["w"] * scale.reshape(-1, 1, 1, 1)).half()
    want_b = ((d["b"] - d["mean"]) * scale + d["beta"]).half()
    assert gm.amplite_folded_0_weight.dtype == torch.float16 and gm.amplite_folded_0_bias.dtype == torch.float16
    torch.testing.assert_close(gm.amplite_folded_0_weight.data, want_w, rtol=0, atol=0)
    torch.testing.assert_close(gm.amplite_folded_0_bias.data, want_b, rtol=0, atol=0)


def _kept(gm: torch.fx.GraphModule) -> dict:
    before = [(n.op, n.target, n.args) for n in gm.graph.nodes]
    result = FoldBatchNorm()(gm)
    assert [(n.op, n.target, n.args) for n in gm.graph.nodes] == before, "a kept BN leaves the graph as it was"
    assert not result.modified
    return dict(result.counters)


def test_training_mode_batchnorm_is_kept() -> None:
    """batch_norm with training=True normalises by batch statistics: never folded."""
    root, graph, _, bn = _conv_bn_graph(FULL, _tensors(), training=True)
    graph.output(bn)
    assert _kept(torch.fx.GraphModule(root, graph)) == {"kept:training-mode": 1}


def test_conv_with_a_second_user_or_no_conv_is_kept() -> None:
    """BN after a conv whose output is also used elsewhere, or after a non-conv, is kept with its reason."""
    root, graph, conv, bn = _conv_bn_graph(FULL, _tensors())
    graph.output((bn, conv))
    assert _kept(torch.fx.GraphModule(root, graph)) == {"kept:input-not-a-single-use-conv": 1}
    root, graph, conv, bn = _conv_bn_graph(FULL, _tensors())
    with graph.inserting_before(bn):
        relu = graph.call_function(aten.relu.default, (conv,))
    bn.args = (relu, *bn.args[1:])
    graph.output(bn)
    assert _kept(torch.fx.GraphModule(root, graph)) == {"kept:input-not-a-single-use-conv": 1}


@pytest.mark.parametrize("fed", ["w", "b", "gamma", "beta", "mean", "var"])
def test_a_tensor_fed_from_an_input_keeps_the_batchnorm(fed: str) -> None:
    """Conv weight/bias or BN statistics/affine computed at run time (a graph input) cannot be folded."""
    t = _tensors()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    p = graph.placeholder("p")
    root, graph, conv, bn = _conv_bn_graph(FULL, t, graph=graph, x=x)
    slot = {"w": (conv, 1), "b": (conv, 2), "gamma": (bn, 1), "beta": (bn, 2), "mean": (bn, 3), "var": (bn, 4)}
    node, i = slot[fed]
    args = list(node.args)
    args[i] = p
    node.args = tuple(args)
    graph.output(bn)
    graph.eliminate_dead_code()
    assert _kept(torch.fx.GraphModule(root, graph)) == {"kept:non-constant-parameters": 1}


def test_a_get_attr_of_a_non_tensor_is_not_a_constant() -> None:
    """A get_attr naming a submodule (not a tensor) as the BN mean keeps the BN."""
    root, graph, _, bn = _conv_bn_graph(FULL, _tensors())
    root.add_module("sub", nn.Module())
    with graph.inserting_before(bn):
        sub = graph.get_attr("sub")
    args = list(bn.args)
    args[3] = sub
    bn.args = tuple(args)
    graph.output(bn)
    assert _kept(torch.fx.GraphModule(root, graph)) == {"kept:non-constant-parameters": 1}


def test_folded_conv_takes_the_bn_source_location_only_when_it_has_none() -> None:
    """The report places the folded conv by its own location; the BN's is copied only where the conv has none."""
    for conv_meta, want in [({}, "bn"), ({"nn_module_stack": "conv", "stack_trace": "conv"}, "conv")]:
        root, graph, conv, bn = _conv_bn_graph(FULL, _tensors())
        graph.output(bn)
        conv.meta.update(conv_meta)
        bn.meta.update({"nn_module_stack": "bn", "stack_trace": "bn"})
        FoldBatchNorm()(torch.fx.GraphModule(root, graph))
        assert (conv.meta["nn_module_stack"], conv.meta["stack_trace"]) == (want, want)


def test_folded_tensors_get_fake_values_of_the_weight_mode() -> None:
    """With a fake weight value, the new get_attr nodes get fake values (same mode) of the folded shapes."""
    t = _tensors()
    root, graph, conv, bn = _conv_bn_graph(FULL, t)
    graph.output(bn)
    mode = FakeTensorMode()
    conv.args[1].meta["val"] = mode.from_tensor(t["w"])
    FoldBatchNorm()(torch.fx.GraphModule(root, graph))
    w_node, b_node = conv.args[1:3]
    for node, shape in ((w_node, (4, 3, 3, 3)), (b_node, (4,))):
        val = node.meta["val"]
        assert val.fake_mode is mode and tuple(val.shape) == shape and val.dtype == torch.float32, node
    root, graph, conv, bn = _conv_bn_graph(FULL, t)
    graph.output(bn)
    gm = torch.fx.GraphModule(root, graph)
    FoldBatchNorm()(gm)
    val = conv.args[1].meta["val"]
    assert not hasattr(val, "fake_mode") and torch.equal(val, gm.amplite_folded_0_weight), "no fake weight: the tensor"


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
        _node(g, torch.zeros(2, 3).half(), "h"), _node(g, torch.zeros(4, dtype=torch.int64), "i"),
        _node(g, (torch.zeros(1), [torch.zeros(1).half()]), "p"), _node(g, None, "b"),
    )
    assert gu.fake_value(half).shape == (2, 3) and gu.fake_value(bare) is None and gu.fake_value(3) is None
    assert (gu.value_dtype(half), gu.value_dtype(ints), gu.value_dtype(pair), gu.value_dtype(bare)) == (
        torch.float16, torch.int64, None, None)
    assert gu.is_float_tensor(half) and not gu.is_float_tensor(ints) and not gu.is_float_tensor(bare)
    assert (gu.numel(half), gu.numel(ints), gu.numel(pair), gu.numel(bare), gu.numel(2.0)) == (6, 4, None, None, None)
    assert gu.dtypes_of(gu.fake_value(pair)) == (torch.float32, (torch.float16,)) and gu.dtypes_of(1.0) is None


def test_cast_dtype_recognises_pure_casts_only() -> None:
    """The dtype a pure cast produces, for each recorded spelling; device moves and memory-format casts are None."""
    g = torch.fx.Graph()
    x = _node(g, torch.zeros(2))
    cases = [
        (aten._to_copy.default, (x,), {"dtype": torch.float16}, torch.float16),
        (aten._to_copy.default, (x,), {"dtype": torch.float16, "device": torch.device("cpu"), "layout": torch.strided,
                                       "pin_memory": False, "non_blocking": False, "copy": True}, torch.float16),
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
        torch.float16)
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
    x.meta.update({"nn_module_stack": {"k": ("enc", nn.Linear)}, "stack_trace": "File \"m.py\", line 3"})
    cast = gu.make_cast(g, x, torch.bfloat16)
    assert (cast.target, cast.args, cast.kwargs) == (aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
    assert cast.meta["val"].dtype == torch.bfloat16 and cast.meta["amplite_cast"] is True
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
    for raw, want in [("enc.layers.0", "enc.layers.0"), ("L['self'].enc.attn", "enc.attn"), ("L__self__.dec", "dec"),
                      ("L['self'].L__self__.x", "x"), ("xL['self'].enc", "xL['self'].enc")]:
        node.meta["nn_module_stack"] = {"a": ("outer", nn.Module), "b": (raw, nn.Linear)}
        assert gu.module_path(node) == want, raw


def test_source_line_is_the_last_user_frame() -> None:
    """file:line of the innermost frame outside torch and site-packages; malformed lines are skipped."""
    g = torch.fx.Graph()
    node = _node(g)
    assert gu.source_line(node) == ""
    node.meta["stack_trace"] = "\n".join([
        '  File "/home/u/model.py", line 12, in forward',
        "    y = self.block(x)",
        '  File "/home/u/block.py", line 40, in forward',
        '  File "/usr/lib/python3/site-packages/foo/bar.py", line 7, in f',
        '  File "/x/torch/nn/modules/linear.py", line 125, in forward',
        '  File "broken.py"',
    ])
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
    [lambda: S0 + 1, lambda: S0 / 2, lambda: -2 * S0, lambda: sympy.Symbol("other", positive=True) * S0,
     lambda: S1 ** sympy.Rational(1, 2), lambda: 1 / S1, lambda: 0 * S0 + sympy.Integer(0) * S1 - S1],
)
def test_extents_that_are_not_products_of_input_sizes_are_not_fusable(size: Any) -> None:
    """check() raises symbolic_view with the extent in the message for sums, fractions, negatives, unknown symbols."""
    g, _x, _y = _sym_graph()
    ext = gu.SymbolicExtents(g)
    expr = size()
    with pytest.raises(NotFusable) as info:
        ext.check([3, S0, expr], "left operand")
    assert info.value.reason == "symbolic_view"
    assert info.value.detail == f"left operand extent {expr} is not a product of input sizes"
    ext.check([3, S0, S1 * S2, 2 * S0], "fine")  # products pass


# --- einsum_modes: extents, the mode table and operand movement -------------------------------------------

_A, _B = sympy.symbols("a b", positive=True, integer=True)


def test_norm_size_and_exact_division() -> None:
    """Extents normalise to ints when numeric; exact_div divides only when the quotient is a positive monomial."""
    assert norm_size(6) == 6 and type(norm_size(sympy.Integer(6))) is int and norm_size(2 * _A) == 2 * _A
    assert exact_div(12, 4) == 3 and exact_div(12, 5) is None and exact_div(3, 0) is None and exact_div(0, 3) == 0
    assert exact_div(6 * _A, 3 * _A) == 2 and type(exact_div(6 * _A, 3 * _A)) is int
    assert exact_div(_A, _A) == 1 and exact_div(-2 * _A, _A) is None, "a non-positive quotient is no extent"
    assert exact_div(_A, 2 * _A) is None and exact_div(_A, _B) is None and exact_div(_A * _B + _A, _A) is None
    assert exact_div(_A * _B * 6, 2 * _B) == 3 * _A and exact_div(-_A * _B, _B) is None and exact_div(_A, 2) is None
    assert exact_div(_A**2, _A) == _A and exact_div(sympy.sqrt(_A) * _A, _A) is None


def test_not_fusable_message_and_fields() -> None:
    """NotFusable's text is 'reason: detail' (or the reason alone); the counter name is the reason."""
    err = NotFusable("bad_view", "detail here")
    assert (str(err), err.reason, err.detail) == ("bad_view: detail here", "bad_view", "detail here")
    bare = NotFusable("zero_size")
    assert (str(bare), bare.reason, bare.detail) == ("zero_size", "zero_size", "")


def test_mode_table_split_union_and_extents() -> None:
    """Splits expand row-major, unions share a representative and extents multiply (1 for an empty group)."""
    t = ModeTable()
    m, n, k = t.new(12), t.new(12), t.new(sympy.Integer(4))
    assert (m, n, k) == (0, 1, 2) and t.size(k) == 4 and type(t.size(k)) is int
    assert t.extent([]) == 1 and t.extent([m, k]) == 48
    head, tail = t.split(m, [3, 4])
    assert t.expand([m, k]) == [head, tail, k] and t.extent([m]) == 12
    t.union(tail, k)
    assert t.find(k) == t.find(tail) == tail and t.expand([m]) == [head, tail]
    t.union(k, tail)  # already one class
    assert t.find(k) == tail
    with pytest.raises(AssertionError):
        t.union(head, k)  # extents differ
    with pytest.raises(AssertionError):
        t.split(n, [5, 2])  # 10 != 12
    with pytest.raises(AssertionError):
        t.split(m, [2, 6])  # already split
    a, b, c = t.new(2), t.new(2), t.new(2)
    t.union(a, b)
    t.union(b, c)
    t.union(t.new(2), a)
    assert len({t.find(x) for x in (a, b, c)}) == 1 and t.find(c) == t.find(a)


def test_operand_shape_source_view_and_zero_size() -> None:
    """An operand's source view lists each atomic mode; zero-size sources are not fusable."""
    t = ModeTable()
    with pytest.raises(NotFusable) as info:
        Operand.from_shape(t, [2, 0, 3])
    assert (info.value.reason, info.value.detail) == ("zero_size", "")
    op = Operand.from_shape(t, [6, 4])
    assert op.scale == 1.0 and op.shape(t) == [6, 4] and op.source_view(t) == [6, 4]
    op.view(t, [2, 3, 4])
    assert op.shape(t) == [2, 3, 4] and op.source_view(t) == [2, 3, 4] and len(op.source_modes(t)) == 3
    op.permute([2, 0, 1])
    assert op.shape(t) == [4, 2, 3] and op.source_view(t) == [2, 3, 4], "the source keeps memory order"


def test_permute_transpose_and_bad_dims() -> None:
    """permute/transpose reorder dimensions (negative dims count from the end); bad ones say why."""
    t = ModeTable()
    op = Operand.from_shape(t, [2, 3, 5])
    op.permute([-1, 0, 1])
    assert op.shape(t) == [5, 2, 3]
    op.transpose(0, -1)
    assert op.shape(t) == [3, 2, 5]
    for order, detail in [([0, 0, 1], "[0, 0, 1]"), ([0, 1], "[0, 1]"), ([-1, 2, 0], "[2, 2, 0]")]:
        with pytest.raises(NotFusable) as info:
            op.permute(order)
        assert (info.value.reason, info.value.detail) == ("bad_permutation", detail)
    for d in (3, -4):
        with pytest.raises(NotFusable) as info:
            op.transpose(d, 0)
        assert (info.value.reason, info.value.detail) == ("bad_dim", f"{d} for rank 3")
    op.transpose(-3, 2)
    assert op.shape(t) == [5, 2, 3]


def test_unsqueeze_squeeze_round_trip() -> None:
    """unsqueeze adds size-1 groups (at the end for -1), squeeze drops the named or all size-1 ones only."""
    t = ModeTable()
    op = Operand.from_shape(t, [2, 1, 3])
    op.unsqueeze(-1)
    assert op.shape(t) == [2, 1, 3, 1]
    op.unsqueeze(0)
    assert op.shape(t) == [1, 2, 1, 3, 1]
    with pytest.raises(NotFusable) as info:
        op.unsqueeze(-7)
    assert (info.value.reason, info.value.detail) == ("bad_dim", "-7 for rank 5")
    op.squeeze(t, [0, 1, -1])  # dim 1 has extent 2: kept
    assert op.shape(t) == [2, 1, 3]
    op.squeeze(t, None)
    assert op.shape(t) == [2, 3]
    with pytest.raises(NotFusable):
        op.squeeze(t, [2])


def test_view_splits_merges_and_rejects_irregular_reshapes() -> None:
    """view regroups row-major modes, splitting a mode at a divisor; other boundaries are irregular."""
    t = ModeTable()
    op = Operand.from_shape(t, [4, 6])
    op.view(t, [2, 12])
    assert op.shape(t) == [2, 12] and op.source_view(t) == [2, 2, 6]
    op.view(t, [24, 1])
    assert op.shape(t) == [24, 1]
    op.view(t, [24])
    assert op.shape(t) == [24]
    with pytest.raises(NotFusable) as info:
        op.view(t, [5, 5])
    assert (info.value.reason, info.value.detail) == ("bad_view", "[5, 5] for 24 elements")
    other = Operand.from_shape(t, [4, 6])
    with pytest.raises(NotFusable) as info:
        other.view(t, [3, 8])  # 3 does not divide the 4-mode
    assert (info.value.reason, info.value.detail) == ("irregular_reshape", "[4, 6] -> [3, 8]")
    sym = Operand.from_shape(t, [_A * 8, 32])
    sym.view(t, [_A, 8, 32])
    assert sym.shape(t) == [_A, 8, 32]
    with pytest.raises(NotFusable) as info:
        Operand.from_shape(t, [_A, 6]).view(t, [2, 3 * _A])
    assert info.value.reason == "irregular_reshape"


def test_expand_broadcasts_size_one_dims_and_adds_leading_ones() -> None:
    """expand: new leading dims (size 1 stays an empty group), -1 or the same size keep, 1 -> n is a new mode."""
    t = ModeTable()
    op = Operand.from_shape(t, [1, 3])
    op.expand_to(t, [4, 1, 2, -1])
    assert op.shape(t) == [4, 1, 2, 3] and op.dims[1] == [] and op.source_view(t) == [1, 3]
    op.expand_to(t, [4, 5, 2, 3])
    assert op.shape(t) == [4, 5, 2, 3]
    for shape, detail in [([2, 3], "[2, 3]"), ([4, 5, 2, 6], "3 -> 6")]:
        with pytest.raises(NotFusable) as info:
            op.expand_to(t, shape)
        assert (info.value.reason, info.value.detail) == ("bad_expand", detail)
