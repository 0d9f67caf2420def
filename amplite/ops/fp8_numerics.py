"""FP8 (``float8_e4m3fn``) scale arithmetic shared by the graph path and the checkpoint writer.

One convention everywhere, the one ``torch._scaled_mm``, vLLM and ModelOpt use: a tensor ``x`` is stored
as ``q = saturate(x / scale)`` in e4m3 and read back as ``q.float() * scale``; ``scale = amax / E4M3_MAX``,
so the largest magnitude maps onto the format's largest finite value (448). Scales are FP32. A
calibrated module may map a larger ``amax`` onto 448 (headroom: static activation scales and, per output
channel, weight scales chosen by measured error in ``amplite.converter.fp8_scales``); the codes are
always ``saturate(x / scale)`` with the scale stored beside them.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite ``float8_e4m3fn`` value.
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
#: Smallest scale handed out: an all-zero tensor still gets a positive, finite scale.
MIN_SCALE = 1e-12


def scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """The FP32 scale that maps ``amax`` onto ``E4M3_MAX`` (elementwise for a tensor of maxima)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.clamp(amax.float() / E4M3_MAX, min=MIN_SCALE)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated to ±``E4M3_MAX`` and rounded to e4m3 (``scale`` broadcasts against ``x``)."""
    return (x.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The value ``q`` stands for: ``q * scale`` in ``dtype``."""
    return (q.float() * scale.float()).to(dtype)


def quantize_weight(
    w: torch.Tensor, per_channel: bool = True, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[out, in, ...]`` weight as e4m3 with FP32 scales.

    Args:
        w: The weight; dim 0 is the output channel.
        per_channel: One scale per output channel (shape ``[out, 1, ...]``); False: one per tensor
            (shape ``[]``).
        amax: Per channel only: the magnitude each channel's scale maps onto 448 (``[out]``; at least the
            channel's own maximum, or it saturates); default each channel's maximum.

    Returns:
        ``(q, scale)`` with ``dequantize(q, scale) ≈ w``.
    """
    w32 = w.detach().float()
    if per_channel and w32.dim() >= 1:
        if amax is None:
            amax = w32.abs().reshape(w32.shape[0], -1).amax(dim=1)
        scale = scale_from_amax(amax.float().reshape(-1)).reshape((w32.shape[0],) + (1,) * (w32.dim() - 1))
    else:
        scale = scale_from_amax(w32.abs().amax() if w32.numel() else torch.tensor(0.0))
    return quantize(w32, scale), scale


def quantize_dynamic_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An activation ``[..., k]`` as e4m3 with one scale per row (token): shape ``[..., 1]``."""
    x32 = x.detach().float()
    scale = scale_from_amax(x32.abs().amax(dim=-1, keepdim=True))
    return quantize(x32, scale), scale
