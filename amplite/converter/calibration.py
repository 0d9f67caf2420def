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


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, ranges: dict[str, ValueRange]) -> None:
        super().__init__(gm)
        self.ranges = ranges

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                self.ranges.setdefault(n.name, ValueRange()).update(t)
                break  # the first float output is the value (e.g. native_layer_norm's result)
        return out


def collect_ranges(gm: torch.fx.GraphModule, batches: Iterable[Inputs]) -> dict[str, ValueRange]:
    """Run ``gm`` (an ``ep.module()`` graph) on every batch and record each node's value range.

    Args:
        gm: The FP32 GraphModule amplite's passes will rewrite (node names are the keys).
        batches: ``(args, kwargs)`` pairs as the model's forward takes them.
    """
    ranges: dict[str, ValueRange] = {}
    spec = getattr(gm, "_in_spec", None)
    with torch.no_grad():
        for args, kwargs in batches:
            flat = tree_flatten_spec((args, kwargs), spec) if spec is not None else [*args, *kwargs.values()]
            _Recorder(gm, ranges).run(*flat)
    return ranges
