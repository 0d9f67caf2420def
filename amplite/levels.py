"""Levels and low precisions: the names users write (``O1``, ``bf16``) and what they resolve to.

The vocabulary of :mod:`amplite.policy` (which re-exports it), kept apart so that the policy module holds the
rules. :func:`precision_dtype` is the one place a precision name becomes a ``torch.dtype``.
"""

from __future__ import annotations

import os
from enum import Enum

import torch

from amplite.errors import ConfigError

LEVEL_ENV = "AMPLITE_LEVEL"


class Level(str, Enum):
    """Optimisation levels, after apex amp's names."""

    O0 = "O0"  # no conversion: the FP32 baseline
    O1 = "O1"  # compute-bound ops low, FP32 list FP32, the rest follows its inputs; weights stay FP32
    O2 = "O2"  # everything low except the FP32 list; weights used only in low precision stored low
    O3 = "O3"  # everything low (speed baseline)


PRECISIONS: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}

_NAMES = {dtype: name for name, dtype in PRECISIONS.items()}

#: The FP8 precision's name: matrix products in ``float8_e4m3fn`` with FP32 scales, everything else as bf16.
FP8 = "fp8"


def precision_dtype(precision: str | torch.dtype) -> torch.dtype:
    """``"fp16"``/``"bf16"`` or the dtype itself, as the dtype (``ConfigError`` for anything else: FP32 is not
    a low precision)."""
    if isinstance(precision, torch.dtype) and precision in _NAMES:
        return precision
    if isinstance(precision, str) and precision.strip().lower() in PRECISIONS:
        return PRECISIONS[precision.strip().lower()]
    raise ConfigError(f"unknown precision {precision!r}", f"use one of: {', '.join(PRECISIONS)}")


def split_precision(precision: str | torch.dtype) -> tuple[torch.dtype, bool]:
    """A precision name as ``(low dtype, fp8)``: ``"fp8"`` is bf16 with FP8 matrix products.

    Entry points that support FP8 parse with this; :func:`precision_dtype` (fp16/bf16 only) refuses ``"fp8"``.

    Raises:
        ConfigError: For a name that is none of fp16, bf16, fp8.
    """
    if isinstance(precision, str) and precision.strip().lower() == FP8:
        return torch.bfloat16, True
    try:
        return precision_dtype(precision), False
    except ConfigError:
        raise ConfigError(
            f"unknown precision {precision!r}", f"use one of: {', '.join((*PRECISIONS, FP8))}"
        ) from None


def precision_name(dtype: torch.dtype) -> str:
    """``fp16`` or ``bf16`` for a low dtype."""
    return _NAMES[precision_dtype(dtype)]


def resolve_level(
    level: str | Level | None, precision: str | torch.dtype | None = None, source: str = "--level"
) -> Level:
    """Resolve the level: explicit argument > ``AMPLITE_LEVEL`` > O1 (O2 for ``precision="fp8"``, whose
    weights are stored in e4m3 as O2 stores them low).

    Args:
        level: The explicit level, or None.
        precision: The precision it goes with (the default level depends on it).
        source: How the caller names the explicit level in an error (a CLI flag or an API argument).

    Raises:
        ConfigError: If the level (from either source) is not O0-O3.
    """
    if level is None:
        level = os.environ.get(LEVEL_ENV) or None
        source = LEVEL_ENV
    if level is None:
        fp8 = isinstance(precision, str) and precision.strip().lower() == FP8
        return Level.O2 if fp8 else Level.O1
    if isinstance(level, Level):
        return level
    text = str(level).strip().upper()
    if text in ("0", "1", "2", "3"):
        text = "O" + text
    try:
        return Level(text)
    except ValueError:
        raise ConfigError(f"unknown level {level!r} (from {source})", "use one of O0, O1, O2, O3") from None
