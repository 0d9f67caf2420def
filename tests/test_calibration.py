"""Calibration in one compiled forward records exactly what per-node interpretation recorded.

The oracle is the former implementation (``fx.Interpreter``, one ``ValueRange.update`` per value, views
sharing their source's range), kept here only to pin the results: same keys, same fields, same sharing.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn
from torch.fx._pytree import tree_flatten_spec

from amplite.converter import calibration
from amplite.converter.calibration import _SAME_ELEMENTS, collect_ranges
from amplite.converter.pipeline import strip_export_checks
from amplite.passes.range_guard import ValueRange
from fixtures.zoo import TEST_FIXTURES, make


@pytest.fixture(autouse=True, params=["interpreted", "compiled"])
def execution(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs both ways of executing the graph: interpreted (few batches) and compiled."""
    monkeypatch.setattr(calibration, "COMPILE_FROM", 10**9 if request.param == "interpreted" else 1)
    return request.param


class _Oracle(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, ranges: dict[str, ValueRange], percentile: float | None) -> None:
        super().__init__(gm)
        self.ranges, self.percentile = ranges, percentile

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        src = n.args[0] if n.args else None
        if n.target in _SAME_ELEMENTS and isinstance(src, torch.fx.Node) and src.name in self.ranges:
            self.ranges.setdefault(n.name, self.ranges[src.name])
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                self.ranges.setdefault(n.name, ValueRange()).update(t, self.percentile)
                break
        return out


def oracle(gm: torch.fx.GraphModule, batches: list, percentile: float | None = None) -> dict[str, ValueRange]:
    ranges: dict[str, ValueRange] = {}
    with torch.no_grad():
        for args, kwargs in batches:
            _Oracle(gm, ranges, percentile).run(*tree_flatten_spec((args, kwargs), gm._in_spec))
    return ranges


def snapshot(ranges: Any) -> tuple[dict[str, tuple], list[list[str]]]:
    """Every range's fields, and which names share one range object (views of one value)."""
    values = {k: tuple(getattr(r, f.name) for f in dataclasses.fields(ValueRange)) for k, r in ranges.items()}
    groups: dict[int, list[str]] = {}
    for k, r in ranges.items():
        groups.setdefault(id(r), []).append(k)
    return values, sorted(sorted(g) for g in groups.values())


def assert_same(gm: torch.fx.GraphModule, batches: list, percentile: float | None = None) -> Any:
    expected = snapshot(oracle(gm, batches, percentile))
    got = collect_ranges(gm, batches, percentile)
    assert snapshot(got) == expected
    return got


def more_batches(inputs: tuple, n: int) -> list:
    """``n`` batches like ``inputs``: floats rescaled and shifted per batch, integers rolled."""

    def vary(x: Any, k: int) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
            return x * (1.0 + 0.5 * k) + 0.01 * k
        return x.roll(k) if isinstance(x, torch.Tensor) else x

    args, kwargs = inputs
    return [(tuple(vary(a, k) for a in args), {key: vary(v, k) for key, v in kwargs.items()}) for k in range(n)]


def program(model: nn.Module, inputs: tuple, decompose: bool = False) -> torch.fx.GraphModule:
    ep = torch.export.export(model, inputs[0], inputs[1])
    if decompose:
        ep = ep.run_decompositions()
    gm = ep.module()
    strip_export_checks(gm)
    return gm


_PROGRAMS: dict[str, tuple[torch.fx.GraphModule, tuple]] = {}


def fixture_program(name: str) -> tuple[torch.fx.GraphModule, tuple]:
    """The fixture's program and inputs, exported once for both execution paths (no fixture writes state)."""
    if name not in _PROGRAMS:
        model, inputs = make(name)
        _PROGRAMS[name] = program(model, inputs), inputs
    return _PROGRAMS[name]


@pytest.mark.parametrize("name", TEST_FIXTURES)
def test_ranges_equal_interpretation_on_every_fixture(name: str) -> None:
    gm, inputs = fixture_program(name)
    code = gm.code
    assert_same(gm, [inputs])
    assert_same(gm, more_batches(inputs, 3))  # several batches (--calib DIR): sampled counts add up
    assert gm.code == code  # the instrumented forward is a copy


@pytest.mark.parametrize("name", ["transformer", "causal", "rmsnorm"])
def test_percentile_option_equals_interpretation(name: str) -> None:
    gm, inputs = fixture_program(name)
    got = assert_same(gm, more_batches(inputs, 2), percentile=99.9)
    assert any(r.percentile_abs is not None for r in got.values())


class _Tiny(nn.Module):
    """Weights and activations below 2^-10 (the underflow statistic is sampled), a weight tied twice,
    a weight read through its transpose, a multi-output op and an integer output."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) * 1e-5)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 64, bias=False)
        self.tied = self.head.weight

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x @ self.w.t()  # tiny: the underflow sample is taken
        h = self.norm(h) + self.tied.sum() * 1e-3
        y = self.head(h).reshape(8, 8, 8)
        v, i = y.max(dim=-1)  # multi-output: values (float) and indices (int64)
        return v * 2, i


def test_tiny_values_tied_weights_views_and_multi_output_nodes() -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    for decompose in (False, True):  # decomposed: native_layer_norm's (out, mean, rstd) and getitems
        gm = program(_Tiny().eval(), ((x,), {}), decompose)
        got = assert_same(gm, more_batches(((x,), {}), 3))
        targets = {n.name: str(n.target) for n in gm.graph.nodes}
        assert any("max" in t for t in targets.values())
        ints = [n.name for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
                and not n.meta["val"].dtype.is_floating_point]
        assert ints and not set(ints) & set(got)  # integer values have no range
        tiny = [r for r in got.values() if r.sampled_nonzero]
        assert tiny and all(r.max_abs < 2**-10 for r in tiny)
    decomposed = program(_Tiny().eval(), ((x,), {}), decompose=True)
    assert any("native_layer_norm" in str(n.target) for n in decomposed.graph.nodes)


class _NonFinite(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = x * 1e38  # overflows to +-inf where |x| > ~3.4
        nan = torch.log(x)  # NaN where x < 0
        allinf = (x.abs() + 1.0) * float("inf")  # nothing finite at all
        return big.sum() + nan.nansum() + allinf.mean()


def test_non_finite_values_are_ignored_like_interpretation() -> None:
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)) * 4
    gm = program(_NonFinite(), ((x,), {}))
    batches = more_batches(((x,), {}), 2)
    got = assert_same(gm, batches)
    names = {str(n.target).split(".")[1]: n.name for n in gm.graph.nodes if n.op == "call_function"}
    logs = torch.cat([torch.log(b[0][0]).flatten() for b in batches])
    assert got[names["log"]].max_abs == float(logs[logs.isfinite()].abs().max())
    assert got[names["mul"]].max_abs < 3.4e38  # the largest finite |x|, not inf


class _Counter(nn.Module):
    """A buffer written in place by the forward: weights are then read eagerly, batch by batch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * self.seen
        self.seen.mul_(3.0)
        return out


def test_a_buffer_mutated_by_the_forward_is_recorded_per_batch() -> None:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))
    batches = more_batches(((x,), {}), 3)
    expected = snapshot(oracle(program(_Counter(), ((x,), {})), batches))
    got = collect_ranges(program(_Counter(), ((x,), {})), batches)
    assert snapshot(got) == expected
    seen = next(k for k in got if "seen" in k)
    assert got[seen].max_abs == 9.0  # 1, 3, 9 over three batches: the value each batch read


def test_a_weight_changed_after_calibration_is_an_error_not_a_wrong_range() -> None:
    gm = program(_Tiny().eval(), ((torch.randn(8, 64),), {}))
    ranges = collect_ranges(gm, [((torch.randn(8, 64),), {})])
    with torch.no_grad():
        gm.w.mul_(2.0)
    with pytest.raises(RuntimeError, match="changed in place after calibration"):
        _ = ranges["w"].max_abs


def test_each_distinct_value_is_reduced_once_and_weights_only_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    gm = program(_Tiny().eval(), ((x,), {}), decompose=True)
    reduced: list[torch.Tensor] = []
    update = ValueRange.update
    monkeypatch.setattr(ValueRange, "update", lambda self, t, p=None: (reduced.append(t), update(self, t, p))[1])
    ranges = collect_ranges(gm, [((x,), {})])
    weights = {n.name for n in gm.graph.nodes if n.op == "get_attr"}
    values = {n.name for n in gm.graph.nodes if n.op != "get_attr" and n.target not in _SAME_ELEMENTS
              and n.target is not operator.getitem and n.op != "output" and _float(n)}
    assert len(reduced) == len(values)  # no pass for weights, views, getitems of the same tensor, the output
    assert len({id(t) for t in reduced}) == len(reduced)
    _ = ranges["head_weight"].max_abs  # a weight's range is computed when read, and then is exact
    assert len(reduced) == len(values) + 1 and weights <= set(ranges)


def _float(n: torch.fx.Node) -> bool:
    val = n.meta.get("val")
    val = val[0] if isinstance(val, (tuple, list)) else val
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point
