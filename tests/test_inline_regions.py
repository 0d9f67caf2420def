"""Higher-order ops in forward (issue 44 item 5): grad-mode regions are inlined and converted like the rest of
the graph; control flow (torch.cond) runs its sub-graphs exactly as traced, fed the dtypes they were traced with."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amplite


class NoGradRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():  # export: higher_order.wrap_with_set_grad_enabled(False, submod_1, ...)
            h = self.b(h).relu()
        return self.c(h)


class CondBranch(nn.Module):
    def __init__(self, sign: float) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.sign = sign

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.cond(h.sum() * self.sign > -1e9, lambda t: self.b(t), lambda t: self.c(t), (h,))
        return self.c(h)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_no_grad_region_is_converted_like_the_rest_of_the_graph(precision: str) -> None:
    torch.manual_seed(0)
    res = amplite.convert(NoGradRegion().eval(), (torch.randn(4, 16),), precision=precision, level="O2")
    low = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    linears = {p["module"]: p["dtype"] for p in res.report.data["plan"] if p["op"].startswith("linear")}
    assert linears == {"a": low, "b": low, "c": low}  # b, inside the region, too
    counters = next(p["counters"] for p in res.report.data["passes"] if p["name"] == "inline_regions")
    assert counters.items() >= {"inlined:wrap_with_set_grad_enabled": 1}.items()
    assert res.passed and res.report.data["verification"]["outputs"][0]["sqnr_db"] > 35
    prog = res.program.module()
    assert not [n for n, m in prog.named_children() if isinstance(m, torch.fx.GraphModule)]  # no sub-graph left
    torch.manual_seed(0)
    model, x = NoGradRegion().eval(), torch.randn(4, 16)  # the converted model's weights, other inputs
    with torch.no_grad():
        expected, got = model(x), prog(x).float()
    assert 10 * torch.log10(expected.pow(2).sum() / (got - expected).pow(2).sum()) > 35


@pytest.mark.parametrize("sign", [1.0, -1.0])  # either branch taken
def test_cond_sub_graphs_run_as_traced_under_a_low_precision_parent(sign: float) -> None:
    torch.manual_seed(0)
    model = CondBranch(sign).eval()
    x = torch.randn(4, 16)
    res = amplite.convert(model, (x,), precision="bf16", level="O2")
    assert res.passed, res.report.data["verification"]
    counters = next(p["counters"] for p in res.report.data["passes"] if p["name"] == "inline_regions")
    assert counters["control_flow_kept_fp32"] == 1 and counters["operands_cast"] == 5  # h and b/c's weights
    other = torch.randn(4, 16)
    with torch.no_grad():
        expected, got = model(other), res.program.module()(other).float()
    sqnr = 10 * torch.log10(expected.pow(2).sum() / (got - expected).pow(2).sum())
    assert sqnr > 30


# --- The pass called directly on exported graphs (fast: the mutation run's per-mutant budget reaches these).

import operator  # noqa: E402

from amplite.passes.base import PostconditionError  # noqa: E402
from amplite.passes.inline_regions import InlineRegions, has_regions  # noqa: E402
from tests.exported import export_eval  # noqa: E402

_HOPS = (torch.ops.higher_order.wrap_with_set_grad_enabled, torch.ops.higher_order.wrap_with_autocast,
         torch.ops.higher_order.cond)  # fmt: skip


class Nested(nn.Module):
    """An autocast region inside a no-grad region; both outputs of the no-grad region are used."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        with torch.no_grad():
            h2 = self.b(h).relu()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h3 = h2 * 2
        return h3 + h, h2


def _calls(gm: torch.fx.GraphModule, target: object) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def test_nested_regions_are_inlined_and_a_no_grad_regions_outputs_are_detached() -> None:
    torch.manual_seed(0)
    model, x = Nested(), torch.randn(2, 4)
    gm = export_eval(model, x)
    assert has_regions(gm)
    with pytest.raises(PostconditionError, match=r"\(wrap_with_set_grad_enabled\) is still a sub-graph"):
        InlineRegions().ensures(gm)
    # the nested region's sub-graph is ``submod_1`` inside ``submod_1``: on the parent it needs a fresh name,
    # and the next one is taken by a buffer the graph reads
    gm.register_buffer("submod_1_1", torch.full((4,), 7.0))
    out = gm.graph.output_node()
    with gm.graph.inserting_before(out):
        plus = gm.graph.call_function(torch.ops.aten.add.Tensor, (out.args[0][0], gm.graph.get_attr("submod_1_1")))
    out.args = ((plus, out.args[0][1]),)
    gm.recompile()
    res = InlineRegions()(gm)
    assert res.modified
    assert res.counters.items() >= {"inlined:wrap_with_set_grad_enabled": 1, "inlined:wrap_with_autocast": 1}.items()
    InlineRegions().ensures(gm)
    assert not has_regions(gm) and not any(n.target in _HOPS for n in gm.graph.nodes)
    assert not [n for n, m in gm.named_children() if isinstance(m, torch.fx.GraphModule)]  # unused: deleted
    assert [str(n.target) for n in gm.graph.nodes if n.op == "call_function"].count("aten.linear.default") == 2
    detached = _calls(gm, torch.ops.aten.detach.default)
    assert len(detached) == 2  # both outputs of the no-grad region, not those of the autocast region inside it
    assert all(d.meta["val"].shape == (2, 4) and d.meta["nn_module_stack"] for d in detached)
    assert all(d.meta["stack_trace"] and d.meta["stack_trace"] == d.args[0].meta["stack_trace"] for d in detached)
    out = gm.graph.output_node().args[0]
    assert out[1] in detached and out[0].args[0].args[0] in detached
    model.train()
    got, want = gm(x), model(x)
    assert torch.equal(got[0], want[0] + 7) and torch.equal(got[1], want[1])  # the buffer kept its name
    assert got[0].requires_grad and not got[1].requires_grad  # no gradient leaves the no-grad region


def test_a_region_used_whole_is_replaced_by_a_tuple_of_its_outputs() -> None:
    torch.manual_seed(0)
    model, x = Nested().eval(), torch.randn(2, 4)
    gm = export_eval(model, x)
    region = _calls(gm, torch.ops.higher_order.wrap_with_set_grad_enabled)[0]
    out = gm.graph.output_node()
    with gm.graph.inserting_before(out):
        whole = gm.graph.call_function(operator.getitem, (gm.graph.call_function(list, (region,)), 1))
    out.args = ((out.args[0][0], whole),)  # the second output read through the whole region
    gm.recompile()
    InlineRegions()(gm)
    assert _calls(gm, tuple) and not has_regions(gm)
    got, want = gm(x), model(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class CondInt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return torch.cond(h.sum() > 0, lambda t, j: self.b(t) + j, lambda t, j: t - j, (h, i))


def test_control_flow_operands_are_cast_to_the_traced_dtype_and_the_rest_left_alone() -> None:
    torch.manual_seed(0)
    model, x, i = CondInt().eval(), torch.randn(2, 4), torch.arange(4)
    gm = export_eval(model, x, i)
    cond = _calls(gm, torch.ops.higher_order.cond)[0]
    traced = {n.name: n.meta["val"] for n in gm.true_graph_0.graph.nodes if n.op == "placeholder"}
    res = InlineRegions()(gm)
    assert res.modified and res.counters.items() >= {"control_flow_kept_fp32": 1, "operands_cast": 3}.items()
    pred, *_, operands = cond.args
    assert pred.target is torch.ops.aten.gt.Scalar  # the predicate is no operand: not cast
    casts = _calls(gm, torch.ops.aten._to_copy.default)
    assert [c.kwargs["dtype"] for c in casts] == [torch.float32] * 3
    assert [c.args[0].name for c in casts] == ["linear", "b_bias", "b_weight"]
    assert operands[1].name == "i"  # integer: left alone
    assert [c.meta["val"] for c in casts] == [v for v in traced.values() if v.dtype.is_floating_point]
    assert torch.equal(gm(x, i), model(x, i))
    assert isinstance(gm.true_graph_0, torch.fx.GraphModule)  # control flow is kept as a sub-graph


def test_a_graph_without_regions_is_left_as_it_is() -> None:
    gm = export_eval(nn.Linear(4, 4), torch.randn(2, 4))
    before = str(gm.graph)
    res = InlineRegions()(gm)
    assert (res.modified, dict(res.counters), str(gm.graph)) == (False, {}, before)
    assert not has_regions(gm)
