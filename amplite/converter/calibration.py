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

#: High percentile recorded beside the maximum (outliers vs. the bulk of the values).
PERCENTILE = 0.999
_SAMPLE = 1 << 16  # the percentile comes from a strided sample of at most 64K values (~65 above p99.9)


@dataclass
class ValueRange:
    """Range of one node's value over all calibration batches.

    Attributes:
        max_abs: Largest |value| seen.
        p999_abs: Largest 99.9th percentile of |value| over the batches.
    """

    max_abs: float = 0.0
    p999_abs: float = 0.0

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
        sample = a[:: a.numel() // _SAMPLE + 1] if a.numel() > _SAMPLE else a
        sample = sample.abs().float()
        k = max(1, int(PERCENTILE * sample.numel()))
        self.p999_abs = max(self.p999_abs, float(sample.kthvalue(k).values))


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
