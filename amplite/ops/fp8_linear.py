"""``amplite::fp8_linear``: ``x @ w.T + bias`` with ``x`` and ``w`` in ``float8_e4m3fn`` and FP32 scales.

``fp8_linear(x, w, w_scale, x_scale, bias) -> bf16``

* ``x``: the activation ``[..., K]`` in bf16 (or fp16/FP32); quantized here: with ``x_scale`` (a static FP32
  scalar from calibration) as ``saturate(x / x_scale)``, without it dynamically, one scale per token (row)
  from the row's own ``amax`` (:func:`amplite.ops.fp8_numerics.quantize_dynamic_per_token`).
* ``w``: the weight ``[N, K]`` already in e4m3 (stored so in the converted program), ``w_scale`` its FP32
  scales: ``[N]`` (per output channel) or ``[]`` (per tensor).
* ``bias``: ``[N]`` or None, added by the kernel; the result is ``[..., N]`` in ``bias``' dtype or bf16.

Numerics follow the one convention of :mod:`amplite.ops.fp8_numerics` (scale = amax/448), so a result
computed here equals ``dequantize(x_q) @ dequantize(w_q).T`` accumulated in FP32, rounded once.

Kernels, chosen per call: ``torch._scaled_mm`` (CPU since torch 2.5, any shape, per-tensor or row-wise
scales; on CUDA SM89+ it needs both matrix dims of each operand to be multiples of 16 and row-wise scales
with a bf16 output, so operands are zero-padded there and the padding sliced off — zeros add nothing
to a dot product). Where ``_scaled_mm`` is missing or refuses the call (older torch, a device without
FP8 GEMMs), :func:`reference` computes the same values from the dequantized operands in FP32. Importing
this module registers the op and its fake (shape) implementation, so ``torch.export`` keeps one node and
a saved ``.pt2`` loads after ``import amplite``.
"""

from __future__ import annotations

import functools
import logging

import torch

from amplite.ops.fp8_numerics import FP8_DTYPE, quantize, quantize_dynamic_per_token

_log = logging.getLogger(__name__)
#: ``torch._scaled_mm``'s operand size granule on CUDA (both dims of each operand).
CUDA_GRANULE = 16


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` (2-D) zero-padded at the end to ``[rows, cols]`` (the same tensor when no padding is needed)."""
    r, c = t.shape
    if (r, c) == (rows, cols):
        return t
    out = torch.zeros(rows, cols, dtype=t.dtype, device=t.device)
    out[:r, :c] = t
    return out


def _up(n: int, granule: int) -> int:
    return -(-n // granule) * granule


def scaled_mm_2d(
    xq: torch.Tensor,
    wq: torch.Tensor,
    sx: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    granule: int = 1,
) -> torch.Tensor:
    """``torch._scaled_mm`` of ``xq [M, K]`` and ``wq [N, K]`` with scales ``sx`` (``[]`` or ``[M, 1]``) and
    ``sw`` (``[]`` or ``[N]``), padded to multiples of ``granule`` and cropped back to ``[M, N]``.

    Row-wise (``[M, 1]``/``[1, N]``) scales are used whenever either side is not per tensor: the kernel
    takes both per tensor or both row-wise.
    """
    m, k = xq.shape
    n = wq.shape[0]
    mp, kp, np_ = _up(m, granule), _up(k, granule), _up(n, granule)
    if sx.dim() == 0 and sw.dim() == 0:
        sa, sb = sx.float(), sw.float()
    else:
        sa = _pad(sx.float().reshape(-1, 1).expand(m, 1), mp, 1).contiguous()
        sb = _pad(sw.float().reshape(1, -1).expand(1, n), 1, np_).contiguous()
        if mp != m:  # padded rows/cols get scale 1, not 0: a zero scale would only be multiplied by zeros
            sa[m:] = 1.0
        if np_ != n:
            sb[:, n:] = 1.0
    a = _pad(xq, mp, kp)
    b = _pad(wq.contiguous(), np_, kp).t()  # [K, N] column-major, as the kernel wants its second operand
    bias_p = None if bias is None else _pad(bias.to(out_dtype).reshape(1, -1), 1, np_).reshape(-1)
    out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias_p, out_dtype=out_dtype)
    return out[:m, :n] if (mp, np_) != (m, n) else out


def reference(
    xq: torch.Tensor,
    wq: torch.Tensor,
    sx: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """What ``_scaled_mm`` computes, from the dequantized operands: FP32 products and bias, one rounding."""
    sxm = sx.float().reshape(-1, 1) if sx.dim() else sx.float()
    swm = sw.float().reshape(1, -1) if sw.dim() else sw.float()
    out = (xq.float() @ wq.float().t()) * sxm * swm
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@functools.lru_cache(maxsize=8)
def _kernel_ok(device_type: str) -> bool:
    """Whether ``torch._scaled_mm`` runs on this device type (probed once with a 16×16 product)."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    try:
        a = torch.zeros(16, 16, device=device_type).to(FP8_DTYPE)
        one = torch.ones((), device=device_type)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:  # no FP8 GEMM here: the reference path computes
        _log.info("torch._scaled_mm unavailable on %s (%s): using the reference FP8 product", device_type, exc)
        return False
    return True


def _quantize_input(x2: torch.Tensor, x_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if x_scale is None:
        q, s = quantize_dynamic_per_token(x2)
        return q, s.reshape(-1)
    return quantize(x2, x_scale.float()), x_scale.float().reshape(())


@torch.library.custom_op("amplite::fp8_linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ dequantize(w).T + bias`` with ``x`` quantized to e4m3 (static ``x_scale`` or per token)."""
    out_dtype = bias.dtype if bias is not None and bias.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    k, n = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, k)
    xq, sx = _quantize_input(x2, x_scale)
    sw = w_scale.float().reshape(-1) if w_scale.dim() else w_scale.float()
    if _kernel_ok(x.device.type):
        granule = CUDA_GRANULE if x.device.type == "cuda" else 1
        if x.device.type == "cuda" and out_dtype != torch.bfloat16 and (sx.dim() or sw.dim()):
            out = scaled_mm_2d(xq, w, sx, sw, None, torch.bfloat16, granule)  # row-wise scales: bf16 output only
            out = (out.float() + bias.float()).to(out_dtype) if bias is not None else out.to(out_dtype)
        else:
            out = scaled_mm_2d(xq, w, sx, sw, bias, out_dtype, granule)
    else:
        out = reference(xq, w, sx, sw, bias, out_dtype)
    return out.reshape(*x.shape[:-1], n)


@fp8_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor | None,
      bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    out_dtype = bias.dtype if bias is not None and bias.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype)
