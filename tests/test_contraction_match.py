"""Fusion rules as pattern / check / typed match / rewrite: ``ContractionRule.match`` returns a
``ContractionMatch`` or a ``NoMatch`` naming why (never raises), and ``rewrite`` computes what the graph did."""

from __future__ import annotations

import torch
import torch.fx

from amplite.passes.contraction_chains import SymbolicExtents
from amplite.passes.contraction_rules import (
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
