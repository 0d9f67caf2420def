"""The fallback of ``amplite::contract``: one batched GEMM on the operands' own dtype.

``alpha * einsum(eq, a, b) + beta * c`` is lowered to ``baddbmm(c', A', B', beta=beta, alpha=alpha)`` (``addmm``
when there is no batch mode, as ``F.linear``) where
``A'`` and ``B'`` are permute/reshape views of ``a`` and ``b`` (batch, rows, contracted) and (batch,
contracted, columns). The GEMM (cuBLAS on CUDA, oneDNN / ATen's blocked kernels on the CPU) accumulates
fp16/bf16 products in FP32, applies ``alpha`` and ``beta`` in FP32 and rounds once to the operands' dtype:
the numerics docs/contract.md promises, without the FP32 copies of the operands and the FP32 GEMM that an
upcast einsum costs (0.21x the speed of permute+bmm on an H200). This is what the unfused graph runs, so
the fallback is never slower than not fusing: the only copies are the ones a reshape of a non-viewable
layout needs (in the operands' dtype, as the unfused graph's ``contiguous`` would) and the final permute
of the result into the equation's output order when that order is not the GEMM's.

Mode classes, for ``eq = "<sa>,<sb>-><so>"``:

* batch: in a, b and the output;  rows (M): in a and the output;  columns (N): in b and the output;
* contracted (K): in a and b, not the output;
* summed alone: in one input only, not the output. They become contracted modes with the other operand
  broadcast along them (a stride-0 expand), so the sum happens inside the GEMM's FP32 accumulator rather
  than as a separate low-precision reduction (a second rounding).

When the output order is (batch, columns, rows) the GEMM is issued transposed (``Bᵀ Aᵀ``) so the result
needs no permute.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=1024)
def plan(equation: str) -> tuple[str, str, str, str, str, str, bool]:
    """Mode classes of a binary einsum: (a, b, batch, rows, cols, contracted, swap).

    ``a``/``b`` are the operands' subscripts with the modes each sums alone folded into the contracted
    modes; ``swap`` is True when the GEMM is issued as ``Bᵀ Aᵀ`` to produce the output order directly.
    """
    # The op validated the equation (contract.parse_equation) before lowering it.
    lhs, so = equation.replace(" ", "").split("->")
    sa, sb = lhs.split(",")
    batch = "".join(ch for ch in so if ch in sa and ch in sb)
    rows = "".join(ch for ch in so if ch in sa and ch not in sb)
    cols = "".join(ch for ch in so if ch in sb and ch not in sa)
    contracted = "".join(ch for ch in sa if ch not in so)  # with b or alone in a
    contracted += "".join(ch for ch in sb if ch not in so and ch not in sa)  # alone in b
    swap = bool(rows and cols) and so == batch + cols + rows
    return sa, sb, batch, rows, cols, contracted, swap


def _operand(t: torch.Tensor, subs: str, order: str, sizes: dict[str, int]) -> torch.Tensor:
    """``t`` permuted to ``order`` (missing modes broadcast by a stride-0 expand), as one 3-D view."""
    present = [ch for ch in order if ch in subs]
    view = t.permute([subs.index(ch) for ch in present])
    if len(present) != len(order):
        shape = [sizes[ch] if ch in subs else 1 for ch in order]
        view = view.reshape(shape).expand([sizes[ch] for ch in order])
    return view


def gemm_contract(
    equation: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, alpha: float, beta: float
) -> torch.Tensor:
    """``alpha * einsum(equation, a, b) + beta * c`` as one ``bmm``/``baddbmm`` in the operands' dtype.

    The caller has validated shapes and dtypes (``contract._check``). The result is contiguous.
    """
    sa, sb, batch, rows, cols, contracted, swap = plan(equation)
    so = equation.replace(" ", "").split("->")[1]
    sizes = dict(zip(sa, a.shape, strict=True)) | dict(zip(sb, b.shape, strict=True))

    def numel(modes: str) -> int:
        return math.prod(sizes[ch] for ch in modes)

    nb, nm, nn, nk = numel(batch), numel(rows), numel(cols), numel(contracted)
    a3 = _operand(a, sa, batch + rows + contracted, sizes).reshape(nb, nm, nk)
    b3 = _operand(b, sb, batch + contracted + cols, sizes).reshape(nb, nk, nn)
    if swap:  # (Bᵀ Aᵀ) = (A B)ᵀ: the GEMM writes the (batch, cols, rows) output order itself
        a3, b3, nm, nn = b3.transpose(1, 2), a3.transpose(1, 2), nn, nm
        gemm_order = batch + cols + rows
    else:
        gemm_order = batch + rows + cols
    c3 = None
    if c is not None and beta != 0.0:
        # The bias in GEMM order: right-aligned broadcast to the output, then the same permute; a
        # broadcast bias stays a stride-0 view (the GEMM copies it into the result in its own dtype).
        full = c.expand([sizes[ch] for ch in so])
        c3 = full.permute([so.index(ch) for ch in gemm_order]).reshape(nb, nm, nn)
    out3 = _gemm(a3, b3, c3, alpha, beta, batched=bool(batch))
    out = out3.reshape([sizes[ch] for ch in gemm_order])
    if gemm_order != so:
        out = out.permute([gemm_order.index(ch) for ch in so])
    return out.contiguous()


def _gemm(
    a3: torch.Tensor, b3: torch.Tensor, c3: torch.Tensor | None, alpha: float, beta: float, batched: bool
) -> torch.Tensor:
    """``beta * c3 + alpha * (a3 @ b3)`` in one GEMM call, alpha and beta applied by the GEMM in FP32.

    Without batch modes it is one ``mm``/``addmm``, the call ``F.linear`` makes: a bias per column is passed
    1-D, the form cuBLASLt adds in its epilogue (no separate pass over the result).
    """
    if batched:
        if c3 is not None:
            return torch.baddbmm(c3, a3, b3, beta=beta, alpha=alpha)
        if alpha != 1.0:  # beta = 0: the input is ignored (no read, no NaN propagation)
            return torch.baddbmm(a3.new_zeros(()).expand(a3.shape[0], a3.shape[1], b3.shape[2]), a3, b3,
                                 beta=0.0, alpha=alpha)  # fmt: skip
        return torch.bmm(a3, b3)
    a2, b2 = a3[0], b3[0]
    if c3 is not None:
        c2 = c3[0]
        if c2.stride(0) == 0:  # the same row for every output row: a bias per column
            c2 = c2[0]
        return torch.addmm(c2, a2, b2, beta=beta, alpha=alpha)[None]
    if alpha != 1.0:
        return torch.addmm(a2.new_zeros(()).expand(a2.shape[0], b2.shape[1]), a2, b2, beta=0.0, alpha=alpha)[None]
    return torch.mm(a2, b2)[None]
