"""Range statistics: does a value fit the target dtype?

For a tensor computed in FP32 and a low dtype (fp16/bf16) this counts, exactly as a cast rounds them:

- ``overflow``: finite values that become ±inf (|x| beyond the dtype's max, 65504 for fp16);
- ``flush_to_zero``: non-zero values that become 0 (below half the smallest subnormal, ~3e-8 in fp16);
- ``subnormal``: values that land among the subnormals (below the smallest normal, 6.1e-5 in fp16), where
  precision drops bit by bit.

Each is a fraction of the tensor's elements. The same counts on gradients give the underflow a loss scale
has to cure (:func:`recommend_loss_scale`).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _bounds(dtype: torch.dtype) -> tuple[float, float, float]:
    """FP32 thresholds of ``dtype``'s rounding: (flush below, subnormal below, overflow from).

    Round to nearest even: values up to half the smallest subnormal become 0 (the tie goes to the even
    0); from the smallest normal minus that half they round up to the smallest normal; from max + half
    an ulp on they become inf (the tie goes up: max's significand is odd). So the counts are those a
    cast would give, without making the cast. All three are exact FP32 values.
    """
    if dtype not in _BOUNDS:
        fi = torch.finfo(dtype)
        nmant = round(-math.log2(fi.eps))  # significand bits after the point: 10 for fp16, 7 for bf16
        half_sub = fi.smallest_normal * 2.0 ** -(nmant + 1)
        overflow = fi.max + 2.0 ** (math.log2(fi.max / (2 - 2.0**-nmant)) - nmant - 1)
        flush_below = torch.nextafter(torch.tensor(half_sub), torch.tensor(math.inf)).item()  # "≤ half_sub"
        _BOUNDS[dtype] = (flush_below, fi.smallest_normal - half_sub, overflow)
    return _BOUNDS[dtype]


_BOUNDS: dict[torch.dtype, tuple[float, float, float]] = {}


def range_stats(t: torch.Tensor, dtype: torch.dtype) -> dict[str, Any] | None:
    """Max |value| and the fractions that overflow, flush to zero or turn subnormal in ``dtype``.

    Counted against the rounding boundaries (no cast): one pass for the maximum, one to pick out the
    small values, and the small ones (few, as a rule) are classified on their own. Returns None for
    non-float or empty tensors.
    """
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.numel() == 0:
        return None
    a = t.detach().abs().reshape(-1)
    if a.dtype != torch.float32:
        a = a.float()
    flush_below, sub_hi, overflow_at = _bounds(dtype)
    max_abs = float(a.max())
    overflow = 0
    if not max_abs < overflow_at:  # some value overflows (or is inf/NaN already): count them
        overflow = int(((a >= overflow_at) & (a < math.inf)).sum())
        finite = a[torch.isfinite(a)]
        max_abs = float(finite.max()) if finite.numel() else 0.0
    small = a[a < sub_hi]
    flush = int(((small < flush_below) & (small > 0)).sum()) if small.numel() else 0
    zeros = int((small == 0).sum()) if small.numel() else 0
    n = a.numel()
    return {
        "max_abs": max_abs,
        "overflow": overflow / n,
        "flush_to_zero": flush / n,
        "subnormal": (small.numel() - flush - zeros) / n,
    }


def summarize(per_node: dict[str, dict[str, Any]], dtype: torch.dtype) -> dict[str, Any]:
    """Which nodes overflow or lose small values in ``dtype`` (names sorted by severity)."""
    over = sorted((n for n, s in per_node.items() if s["overflow"] > 0), key=lambda n: -per_node[n]["overflow"])
    flush = sorted(
        (n for n, s in per_node.items() if s["flush_to_zero"] > 0), key=lambda n: -per_node[n]["flush_to_zero"]
    )
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "dtype_max": torch.finfo(dtype).max,
        "dtype_smallest_normal": torch.finfo(dtype).smallest_normal,
        "nodes": len(per_node),
        "overflowing_nodes": over,
        "flushing_nodes": flush,
        "max_abs": max((s["max_abs"] for s in per_node.values()), default=0.0),
    }


def recommend_loss_scale(grads: list[torch.Tensor], dtype: torch.dtype = torch.float16) -> dict[str, Any]:
    """The underflow of FP32 gradients in ``dtype`` and a loss scale that cures most of it.

    The scale is the largest power of two that keeps the largest gradient at least 2× below the dtype's
    max (headroom for activation gradients, which the parameters' do not show), capped at 2^24;
    the underflow left after scaling is reported too. bf16 has FP32's exponent range: what underflows
    there underflows in FP32 training too, so its recommendation is 1 (no loss scaling).
    """
    vals = [g.detach().reshape(-1).float() for g in grads if isinstance(g, torch.Tensor) and g.numel()]
    if not vals:
        return {"dtype": str(dtype).removeprefix("torch."), "values": 0}
    flat = torch.cat(vals)
    finite = flat[torch.isfinite(flat)]
    max_abs = float(finite.abs().max()) if finite.numel() else 0.0
    fmax = torch.finfo(dtype).max
    exp = 24 if max_abs == 0 else max(0, min(24, math.floor(math.log2(fmax / (2 * max_abs)))))
    if dtype == torch.bfloat16:
        exp = 0
    scale = float(2**exp)

    def fractions(x: torch.Tensor) -> tuple[float, float]:
        s = range_stats(x, dtype) or {"flush_to_zero": 0.0, "subnormal": 0.0}
        return s["flush_to_zero"], s["subnormal"]

    ftz, sub = fractions(finite)
    ftz_s, sub_s = fractions(finite * scale)
    nonzero = float((finite != 0).double().mean()) if finite.numel() else 0.0
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "values": int(flat.numel()),
        "nonzero_fraction": nonzero,
        "max_abs": max_abs,
        "underflow_unscaled": ftz,
        "subnormal_unscaled": sub,
        "recommended_loss_scale": scale,
        "advice": "no loss scaling (bf16 has FP32's range)" if dtype == torch.bfloat16 else f"loss scale {scale:g}",
        "underflow_scaled": ftz_s,
        "subnormal_scaled": sub_s,
    }
