"""Calibration: value ranges of every node of the FP32 graph over one or more batches.

Feeds the range rules (``amplite.passes.range_guard``): which values would overflow or lose too much
precision in the target dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx
from torch.fx._pytree import tree_flatten_spec

from amplite.passes.range_guard import ValueRange

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
aten = torch.ops.aten
#: Ops whose output holds exactly the elements of their first input (views, copies, relayouts).
_SAME_ELEMENTS = frozenset((
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default, aten.flatten.using_ints,
    aten.unflatten.int, aten.expand.default,
))  # fmt: skip


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, ranges: dict[str, ValueRange], percentile: float | None) -> None:
        super().__init__(gm)
        self.ranges = ranges
        self.percentile = percentile

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        src = n.args[0] if n.args else None
        if n.target in _SAME_ELEMENTS and isinstance(src, torch.fx.Node) and src.name in self.ranges:
            # Same elements as its input, laid out anew: the input's range is this value's range exactly
            # (shared, so later batches update both), and no second pass over the data is paid.
            self.ranges.setdefault(n.name, self.ranges[src.name])
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                self.ranges.setdefault(n.name, ValueRange()).update(t, self.percentile)
                break  # the first float output is the value (e.g. native_layer_norm's result)
        return out


def collect_ranges(
    gm: torch.fx.GraphModule, batches: Iterable[Inputs], percentile: float | None = None
) -> dict[str, ValueRange]:
    """Run ``gm`` (an ``ep.module()`` graph) on every batch and record each node's value range.

    Args:
        gm: The FP32 GraphModule amplite's passes will rewrite (node names are the keys).
        batches: ``(args, kwargs)`` pairs as the model's forward takes them.
        percentile: Also record this percentile of |value| per node (``--range-percentile``).
    """
    ranges: dict[str, ValueRange] = {}
    spec = getattr(gm, "_in_spec", None)
    with torch.no_grad():
        for args, kwargs in batches:
            flat = tree_flatten_spec((args, kwargs), spec) if spec is not None else [*args, *kwargs.values()]
            _Recorder(gm, ranges, percentile).run(*flat)
    return ranges
