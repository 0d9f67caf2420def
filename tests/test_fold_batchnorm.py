"""X"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from amplite.passes.fold_batchnorm import FoldBatchNorm
from tests.exported import export_eval

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
    assert result.counters.items() >= {"folded": 1, "tensors_dropped": n_tensors}.items(), result.counters
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
    assert result.counters.items() >= {"folded": 2, "tensors_dropped": 12}.items(), result.counters
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


# fold_batchnorm


class _ConvBn(nn.Module):
    def __init__(self, bias: bool, affine: bool = True) -> None:
        super().__init__()
        # padding=1 makes export keep the bias argument (None when bias=False) in the conv's args
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1, bias=bias), nn.BatchNorm2d(4, affine=affine)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


@pytest.mark.parametrize(("bias", "affine"), [(False, True), (True, False)])
def test_conv_without_bias_and_bn_without_affine_fold(bias: bool, affine: bool) -> None:
    model, x = _ConvBn(bias, affine).eval(), torch.randn(2, 3, 8, 8)
    gm = export_eval(model, x)
    result = FoldBatchNorm()(gm)
    gm.recompile()
    assert result.counters["folded"] == 1, result.counters
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


class _BnFromInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("var", torch.ones(4))

    def forward(self, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(self.conv(x), mean, self.var, training=False)


def test_batchnorm_with_statistics_from_an_input_is_kept() -> None:
    gm = export_eval(_BnFromInput(), torch.randn(1, 3, 6, 6), torch.zeros(4))
    assert FoldBatchNorm()(gm).counters.items() >= {"kept:non-constant-parameters": 1}.items()


def test_folded_tensors_get_static_fake_values() -> None:
    model, x = _ConvBn(True).eval(), torch.randn(2, 3, 8, 8)
    gm = export_eval(model, x)
    FoldBatchNorm()(gm)
    folded = [n for n in gm.graph.nodes if n.op == "get_attr" and "amplite_folded_" in n.target]
    assert len(folded) == 2
    for node in folded:
        val = node.meta["val"]
        assert hasattr(val, "fake_mode") and all(isinstance(s, int) for s in val.shape), node.target


# --- The ops after the conv (affine/shift modes) and where a BatchNorm enters a ReLU'd sum (issue 46: mutation
# survivors)


@pytest.mark.parametrize("mode", ["affine", "shift"])
def test_the_ops_after_the_conv_take_the_batchnorms_value_and_source_location(mode: str) -> None:
    root, graph, conv, bn = _conv_bn_graph(FULL, _tensors())
    graph.output(bn)
    bn.meta.update({"val": torch.empty(2, 4, 6, 6), "nn_module_stack": "bn", "stack_trace": "bn:1"})
    conv.meta.update({"val": torch.empty(1), "nn_module_stack": "conv", "stack_trace": "conv:1"})
    FoldBatchNorm(mode)(torch.fx.GraphModule(root, graph))
    after = [n for n in graph.nodes if n.op == "call_function" and n is not conv]
    assert [n.target for n in after] == ([aten.mul.Tensor] if mode == "affine" else []) + [aten.add.Tensor]
    for n in after:
        assert n.meta["val"] is bn.meta["val"] and (n.meta["nn_module_stack"], n.meta["stack_trace"]) == ("bn", "bn:1")
    assert list(graph.nodes).index(conv) < list(graph.nodes).index(after[0])  # the conv's tensors come before it
    del bn.meta["val"]
    root, graph, conv, bn = _conv_bn_graph(FULL, _tensors())
    graph.output(bn)
    conv.meta["val"] = torch.empty(3)
    FoldBatchNorm(mode)(torch.fx.GraphModule(root, graph))
    assert all(n.meta["val"] is conv.meta["val"] for n in graph.nodes if n.target in (aten.mul.Tensor, aten.add.Tensor))
    assert all("nn_module_stack" not in n.meta for n in graph.nodes if n.target is aten.add.Tensor)


@pytest.mark.parametrize(
    ("users", "unit"),
    [
        ("add-relu", True),  # the ResNet block: the scale goes into the weight
        ("add-relu,add-relu", True),
        ("add-relu,mul", False),  # one reader is not a sum
        ("add-relu+mul", False),  # the sum is also read by something that is not a ReLU
        ("add", False),  # a sum the output reads
        ("relu", False),  # a ReLU without the residual sum
    ],
)
def test_a_unit_scale_goes_into_the_weight_only_where_every_reader_is_a_relud_sum(users: str, unit: bool) -> None:
    t = _tensors()
    t["var"][:], t["gamma"][:] = 0.75, 1 - 5e-6  # every scale rounds to 1 in bf16 (eps = 0.25)
    root, graph, _conv, bn = _conv_bn_graph(FULL, t)
    outs = []
    for chain in users.split(","):
        first, *rest = chain.split("+")
        node = graph.call_function(aten.add.Tensor if first.startswith("add") else aten.mul.Tensor if first == "mul"
                                   else aten.relu.default, (bn, bn) if first != "relu" else (bn,))  # fmt: skip
        if first == "add-relu":
            outs.append(graph.call_function(aten.relu.default, (node,)))
        if rest:
            outs.append(graph.call_function(aten.mul.Tensor, (node, node)))
        if first in ("add", "mul", "relu"):
            outs.append(node)
    graph.output(tuple(outs))
    gm = torch.fx.GraphModule(root, graph)
    result = FoldBatchNorm("affine", torch.bfloat16)(gm)
    assert result.counters.get("scale_in_weight:channels", 0) == (4 if unit else 0), result.counters
    assert hasattr(gm, "amplite_folded_0_scale") is not unit  # every channel in the weight: no mul


def test_a_get_attr_of_a_missing_attribute_is_not_a_constant() -> None:
    root, graph, _conv, bn = _conv_bn_graph(FULL, _tensors())
    graph.output(bn)
    gm = torch.fx.GraphModule(root, graph)
    bn.args[3].target = "nowhere.mean"  # no such attribute (any more): not a constant, and nothing raised
    assert FoldBatchNorm()(gm).counters["kept:non-constant-parameters"] == 1


def test_unit_scale_channels_are_counted_over_every_folded_batchnorm() -> None:
    t = _tensors()
    t["var"][:3], t["gamma"][:3] = 0.75, 1 - 5e-6  # three channels of each BatchNorm round to 1 in bf16
    root, graph, _conv, bn = _conv_bn_graph(FULL, t)
    t2 = {k: v.clone() for k, v in t.items()}
    t2["w"] = torch.randn(4, 4, 3, 3, generator=torch.Generator().manual_seed(2))
    where2 = {k: f"second.{v}" for k, v in FULL.items()}
    relu = graph.call_function(aten.relu.default, (graph.call_function(aten.add.Tensor, (bn, bn)),))
    _, _, _, bn2 = _conv_bn_graph(where2, t2, root=root, graph=graph, x=relu)
    graph.output(graph.call_function(aten.relu.default, (graph.call_function(aten.add.Tensor, (bn2, bn2)),)))
    result = FoldBatchNorm("affine", torch.bfloat16)(torch.fx.GraphModule(root, graph))
    assert (result.counters["folded"], result.counters["scale_in_weight:channels"]) == (2, 6)
