"""Non-finite floats in report.json: the one way they are written and the one way they are read.

JSON has no Infinity or NaN. A float that is not finite is written as the string ``"inf"``, ``"-inf"`` or
``"nan"`` (schema: ``$defs/number``); ``null`` means "not measured" (or "does not apply"), never "not
finite". :func:`encode_float` / :func:`encode_numbers` write, :func:`decode_float` reads: every writer of
a report goes through :func:`amplite.report.schema.write_report` (which encodes the whole document) and
every reader of a number from a report (``check --baseline``, the batch summary, the budget search, the
Markdown/HTML renderers) through :func:`decode_float`. docs/verification.md describes the format.

Layer: ``verify`` (below ``report``), so that the baseline comparison and the budget search can use it.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["NON_FINITE", "decode_float", "encode_float", "encode_numbers", "format_float"]

#: The strings a non-finite float is written as.
NON_FINITE = ("inf", "-inf", "nan")


def encode_float(v: Any) -> Any:
    """A value as report.json holds it: a non-finite float becomes ``"inf"``, ``"-inf"`` or ``"nan"``.

    Anything else is returned unchanged.
    """
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def encode_numbers(tree: Any) -> Any:
    """A copy of a JSON-like tree (dicts, lists, tuples) with every non-finite float encoded."""
    if isinstance(tree, dict):
        return {k: encode_numbers(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [encode_numbers(v) for v in tree]
    return encode_float(tree)


def decode_float(v: Any) -> float | None:
    """A number read from a report: ints and floats as floats, ``"inf"``/``"-inf"``/``"nan"`` as the
    non-finite floats, ``None`` (not measured) and anything else as ``None``."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v in NON_FINITE:
        return float(v)
    return None


def format_float(v: Any, spec: str = ".4g", missing: str = "—") -> str:
    """A report number for display: decoded, then ``format(v, spec)``; ``inf``/``nan`` as such, ``missing``
    for None."""
    f = decode_float(v)
    if f is None:
        return missing
    if not math.isfinite(f):
        return "nan" if math.isnan(f) else ("inf" if f > 0 else "-inf")
    return format(f, spec)
