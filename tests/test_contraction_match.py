"""Fusion rules as pattern / check / typed match / rewrite: ``ContractionRule.match`` returns a
``ContractionMatch`` or a ``NoMatch`` naming why (never raises), and ``rewrite`` computes what the graph did."""

from __future__ import annotations

import torch
import torch.fx

from amplite.passes.contraction_chains import Rejection, SymbolicExtents
from amplite.passes.contraction_rules import (
    AddmmRule,
    ContractionMatch,
    EinsumRule,
    FusionContext,
    MatmulRule,
    NoMatch,
    absorbed_kinds,
)

aten = torch.ops.aten


class ScaledScores(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q @ k.transpose(-1, -2)) * 0.125


class ThreeWay(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ij,jk,kl->il", a, b, c)


def _graph(model: torch.nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    return torch.export.export(model, args).module()


def _ctx(gm: torch.fx.GraphModule, *dtypes: torch.dtype) -> FusionContext:
    return FusionContext(dtypes or (torch.float32,), SymbolicExtents(gm.graph))


def _node(gm: torch.fx.GraphModule, *targets: object) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def test_match_is_typed_and_rewrite_computes_the_same_values() -> None:
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    gm = _graph(ScaledScores(), q, k)
    ref = gm(q, k)
    node = _node(gm, aten.matmul.default, aten.bmm.default)
    found = MatmulRule().match(node, _ctx(gm))
    assert isinstance(found, ContractionMatch) and found.pays
    assert found.alpha == 0.125 and found.bias is None  # the output scaling is absorbed into alpha
    assert "transpose" in absorbed_kinds(found) and "scale" in absorbed_kinds(found)
    fusion, erased = MatmulRule().rewrite(gm.graph, found, _ctx(gm))
    gm.graph.lint()
    gm.recompile()
    assert node in erased and fusion.rule == "matmul"
    contracts = [n for n in gm.graph.nodes if n.target is torch.ops.amplite.contract.default]
    assert len(contracts) == 1 and contracts[0].args[0] == fusion.equation
    torch.testing.assert_close(gm(q, k), ref, rtol=1e-5, atol=1e-5)


def test_no_match_names_the_reason_and_raises_nothing() -> None:
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    gm = _graph(ScaledScores(), q, k)
    node = _node(gm, aten.matmul.default, aten.bmm.default)
    before = [(n.op, n.target) for n in gm.graph.nodes]
    found = MatmulRule().match(node, _ctx(gm, torch.float16))  # FP32 operands, fp16 fusion only
    assert isinstance(found, NoMatch) and found.rejection.reason == "dtype_not_enabled"
    assert found.rejection.node == node.name and found.rejection.rule == "matmul"
    a, b, c = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5, 6)
    gm3 = _graph(ThreeWay(), a, b, c)
    refused = EinsumRule().match(_node(gm3, aten.einsum.default), _ctx(gm3))
    assert isinstance(refused, NoMatch) and refused.rejection.reason == "einsum_operands"
    assert [(n.op, n.target) for n in gm.graph.nodes] == before, "a failed match leaves the graph as it was"


# --- Fast direct tests of match's typed fields and rejections (issue 46: mutation survivors)


def _scores(scale_a: float | None = None, scale_b: float | None = None) -> torch.fx.GraphModule:
    """``((q·scale_a) @ (k·scale_b).transpose(-1, -2)) * 0.125`` built by hand with its values (milliseconds, no
    export: these tests stay within the mutation run's per-mutant budget)."""
    g = torch.fx.Graph()

    def call(target: object, args: tuple, *shape: int) -> torch.fx.Node:
        n = g.call_function(target, args)
        n.meta["val"] = torch.empty(*shape)
        return n

    q, k = g.placeholder("q"), g.placeholder("k")
    q.meta["val"], k.meta["val"] = torch.empty(2, 8, 16), torch.empty(2, 8, 16)
    a = call(aten.mul.Tensor, (q, scale_a), 2, 8, 16) if scale_a is not None else q
    b = call(aten.mul.Tensor, (k, scale_b), 2, 8, 16) if scale_b is not None else k
    mm = call(aten.matmul.default, (a, call(aten.transpose.int, (b, -1, -2), 2, 16, 8)), 2, 8, 8)
    g.output(call(aten.mul.Tensor, (mm, 0.125), 2, 8, 8))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_match_folds_every_scaling_into_alpha_and_counts_the_kernels_and_views_it_saves() -> None:
    gm = _scores(0.5, 4.0)
    found = MatmulRule().match(_node(gm, aten.matmul.default), _ctx(gm))
    assert isinstance(found, ContractionMatch)
    assert found.alpha == 0.5 * 4.0 * 0.125
    # absorbed: q * 0.5, k * 4 and the transpose (operand chains), * 0.125 (tail); the two scalings and the
    # tail are kernels, the transpose a free view, and the operands need no new view
    assert (found.kernels_saved, found.views_saved, len(found.tail)) == (3, 1, 1)
    gm = _scores()  # only the transpose and the output scaling
    found = MatmulRule().match(_node(gm, aten.matmul.default), _ctx(gm))
    assert (found.alpha, found.kernels_saved, found.views_saved) == (0.125, 1, 1)


class BroadcastSum(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x[:, None].expand(3, 4) @ y[None, :].expand(4, 5)  # K = 4 summed over a constant


def test_a_contracted_mode_both_operands_broadcast_becomes_a_factor_of_alpha() -> None:
    x, y = torch.randn(3), torch.randn(5)
    gm = _graph(BroadcastSum(), x, y)
    ref = gm(x, y)
    found = MatmulRule().match(_node(gm, aten.matmul.default, aten.mm.default), _ctx(gm))
    assert isinstance(found, ContractionMatch) and found.equation.factor == 4.0 and found.alpha == 4.0
    MatmulRule().rewrite(gm.graph, found, _ctx(gm))
    gm.recompile()
    torch.testing.assert_close(gm(x, y), ref, rtol=1e-5, atol=1e-5)


def test_rejections_name_the_node_the_rule_the_reason_and_the_detail() -> None:
    g = torch.fx.Graph()
    b, x, w = g.placeholder("b"), g.placeholder("x"), g.placeholder("w")
    for n, shape in ((b, (5,)), (x, (3, 4)), (w, (4, 5))):
        n.meta["val"] = torch.empty(shape)
    node = g.call_function(aten.addmm.default, (b, x, w), {"beta": b})  # a tensor scalar: the rule refuses it
    node.meta["val"] = torch.empty(3, 5)
    g.output(node)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    refused = AddmmRule().match(node, _ctx(gm))
    assert isinstance(refused, NoMatch)
    assert refused.rejection == Rejection(node.name, "addmm", "non_constant_scalar")
    gm = _scores()
    node = _node(gm, aten.matmul.default)
    node.args[1].meta["val"] = node.args[1].meta["val"].half()  # operands of two dtypes
    mixed = MatmulRule().match(node, _ctx(gm, torch.float16, torch.float32))
    assert mixed.rejection == Rejection(node.name, "matmul", "dtype_mismatch", "['torch.float16', 'torch.float32']")
    gm = _scores()
    node = _node(gm, aten.matmul.default)
    node.meta["val"] = torch.empty(2, 8, 9)  # a product whose recorded shape the operands cannot give
    wrong = MatmulRule().match(node, _ctx(gm))
    assert wrong.rejection == Rejection(node.name, "matmul", "shape_mismatch", node.name)


class BiasAdd(torch.nn.Module):
    def __init__(self, alpha: float | None) -> None:
        super().__init__()
        self.alpha = alpha

    def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.add(x @ w, b, alpha=self.alpha) if self.alpha is not None else (x @ w) + b


class SharedProduct(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ w
        return y + b, y * 2


def test_the_output_chain_absorbs_a_bias_add_with_its_alpha_and_notes_where_it_stops() -> None:
    x, w, b = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)

    def match(model: torch.nn.Module, bias: torch.Tensor) -> ContractionMatch:
        gm = _graph(model, x, w, bias)
        found = MatmulRule().match(_node(gm, aten.matmul.default, aten.mm.default), _ctx(gm))
        assert isinstance(found, ContractionMatch)
        return found

    scaled = match(BiasAdd(2.0), b)
    assert (scaled.beta, str(scaled.bias), len(scaled.tail)) == (2.0, "b", 1)  # add(y, b, alpha=2): beta 2
    plain = match(BiasAdd(None), b)
    assert (plain.beta, str(plain.bias)) == (1.0, "b")
    other = match(BiasAdd(None), b.double())  # a bias of another dtype: the add stays, and the note says why
    assert other.bias is None and other.notes == (
        Rejection("add", "matmul", "bias_dtype", "add: bias b not absorbed (torch.float64 vs torch.float32)"),)
    shared = match(SharedProduct(), b)  # the product is read twice: nothing after it is absorbed
    assert shared.bias is None and not shared.tail
    assert [(n.reason, n.detail) for n in shared.notes] == [("shared_intermediate", "output scaling/bias not absorbed")]


def test_an_operand_view_the_graph_also_returns_stays_and_is_noted_under_the_rule() -> None:
    gm = _scores(0.5, 4.0)
    transpose = _node(gm, aten.transpose.int)
    out = gm.graph.output_node()
    out.args = ((out.args[0], transpose),)  # k's transpose is also an output of the graph
    found = MatmulRule().match(_node(gm, aten.matmul.default), _ctx(gm))
    assert isinstance(found, ContractionMatch) and not found.b.chain  # the chain stops before the transpose
    assert found.alpha == 0.5 * 0.125  # so k * 4 stays in the graph, behind it
    assert found.notes == (Rejection(transpose.name, "matmul", "intermediate_is_graph_output",
                                     f"not absorbed into {found.node.name}"),)  # fmt: skip
