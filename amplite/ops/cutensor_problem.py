"""Which einsum problems go to cuTENSOR, and in what form (shapes and strides only, no nvmath).

:func:`canonicalize` squeezes out the size-1 modes found in one operand alone; a problem with a larger such
mode, a zero extent or a broadcast (stride-0) operand mode is answered None, and
:mod:`amplite.ops.cutensor_backend` hands it to the ``torch`` GEMM before planning anything.
"""

from __future__ import annotations

import torch


def canonicalize(
    equation: str, a: torch.Tensor, b: torch.Tensor
) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """Rewrite a problem into one cuTENSOR accepts, or None when it cannot be.

    Size-1 modes found in exactly one input (and not in the output) are squeezed out of that input.
    """
    lhs, out = equation.split("->")
    sa, sb = lhs.split(",")
    keep: list[str] = []
    views: list[torch.Tensor] = []
    for subs, t, other in ((sa, a, sb), (sb, b, sa)):
        kept = ""
        dims = []
        for ch, n, st in zip(subs, t.shape, t.stride(), strict=True):
            alone = ch not in other and ch not in out
            if alone and n == 1:
                continue
            if alone or n == 0 or (st == 0 and n > 1):
                return None
            kept += ch
            dims.append(n)
        keep.append(kept)
        views.append(t.reshape(dims) if kept != subs else t)
    return f"{keep[0]},{keep[1]}->{out}", views[0], views[1]
