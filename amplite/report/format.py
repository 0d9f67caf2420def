"""Formatting shared by the renderers (Markdown, HTML, the training section): numbers and tables.

The bottom of ``amplite.report``'s renderers: :mod:`~amplite.report.markdown`, :mod:`~amplite.report.html`
and :mod:`~amplite.report.training` import it and it imports none of them (tests/test_import_cycles.py).
Numbers are read with :func:`amplite.verify.numbers.decode_float`, the one decoder of report numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from amplite.escape import html as escape
from amplite.escape import markdown, markdown_code
from amplite.verify.numbers import NON_FINITE, decode_float, encode_float

__all__ = ["CAP_DB", "PLAIN", "Style", "cell", "code", "db", "fmt", "html_table"]

CAP_DB = 160.0  # exact values (infinite SQNR) are drawn at this height


def fmt(v: Any, digits: int = 4) -> str:
    """A metric for a table: floats to ``digits`` significant digits, ``inf``/``-inf``/``nan`` as such,
    None as a dash, booleans as yes/no, other strings unchanged."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int) or (isinstance(v, str) and v not in NON_FINITE):
        return str(v)
    f = decode_float(v)
    if f is None:
        return str(v)
    if not math.isfinite(f):
        return str(encode_float(f))
    return f"{f:.{digits}g}"


@dataclass(frozen=True)
class Style:
    """How one renderer marks up a section's summary line (:meth:`Budget.summary`, :meth:`Gradients.summary`),
    so that the line is worded once and each renderer (Markdown, HTML, the terminal) only escapes and marks it.

    Attributes:
        text: Free text from the report (escaped for the medium).
        code: A name (node, module).
        strong: Emphasis (a label, a failed verdict); receives text already escaped.
    """

    text: Callable[[Any], str] = str
    code: Callable[[Any], str] = str
    strong: Callable[[str], str] = str

    def num(self, v: Any, digits: int = 4) -> str:
        """A number (:func:`fmt`), escaped as text."""
        return self.text(fmt(v, digits))


#: Plain text (no markup, no escaping).
PLAIN = Style()


def cell(text: Any) -> str:
    """Text for Markdown (a table cell or a line): one line, no markup (:func:`amplite.escape.markdown`)."""
    return markdown(text)


def code(text: Any) -> str:
    """A name as a Markdown code span, inert (:func:`amplite.escape.markdown_code`)."""
    return markdown_code(text)


def db(v: Any) -> float | None:
    """An SQNR for a chart: clipped to [-20, 160] dB; None for NaN (non-finite output) or not measured."""
    f = decode_float(v)
    if f is None or math.isnan(f):
        return None
    return max(min(f, CAP_DB), -20.0)


def html_table(headers: list[str], rows: list[list[Any]], raw: set[int] = frozenset()) -> str:
    """An HTML table; cells are escaped except the columns in ``raw`` (already HTML)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{c if i in raw else escape(str(c))}</td>" for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
