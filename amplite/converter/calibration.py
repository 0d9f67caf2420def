"""Calibration: value ranges of every node of the FP32 graph over one or more batches.

Feeds the range rules (``amplite.passes.range_guard``): which values would overflow or lose too much
precision in the target dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx._pytree import tree_flatten_spec

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class ValueRange:
    """Range of one node's value over all calibration batches.

    Only the maximum is kept: every range rule is a threshold on the largest finite |value| (one
    overflow is one Inf), and it costs a single ``aminmax`` pass per value.

    Attributes:
        max_abs: Largest finite |value| seen.
    """

    max_abs: float = 0.0

    def update(self, t: torch.Tensor) -> None:
        """Fold one tensor into the range (non-finite values are ignored)."""
        a = t.detach().flatten()
        if a.numel() == 0:
            return
        biggest = max_abs(a)
        if not math.isfinite(biggest):  # rare: only then pay for masking out NaN/Inf
            a = a[torch.isfinite(a)]
            if a.numel() == 0:
                return
            biggest = float(a.abs().max())
        self.max_abs = max(self.max_abs, biggest)


def max_abs(t: torch.Tensor) -> float:
    """max |t| in one pass without allocating |t| (aminmax propagates NaN, so the caller sees it)."""
    lo, hi = torch.aminmax(t)
    return max(-float(lo), float(hi))


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
