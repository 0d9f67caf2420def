"""One escaper per medium for text that came from a file (module, node, input and output names, file names,
error text): every writer of that medium calls the one here, never its own.

A model file chooses its names freely, so a name may hold HTML (``<img src=…>``), Markdown (``[x](http://…)``),
terminal escape sequences (a hidden OSC 8 hyperlink, ``ESC[2K`` erasing the line, a fake green ``PASS``),
tabs and newlines (a forged TSV row) or characters XML cannot hold. Each function returns text that shows
those characters as text in its medium and can do nothing else there:

- :func:`terminal`: C0/C1 control characters (ESC, CR, BEL, NUL...), DEL and Unicode bidirectional overrides
  are shown as ``\\x1b``/``\\u202e``; newlines are kept only where asked.
- :func:`tsv`: one field of tab-separated output: tab, newline and backslash as ``\\t``, ``\\n``, ``\\\\``.
- :func:`markdown` (text) and :func:`markdown_code` (a code span): no raw HTML, images, links or autolinks,
  one line, table pipes escaped (GitHub-flavoured Markdown: report.md and the step summary).
- :func:`html`: HTML-escaped, quotes included (HTML report, and the labels of its plotly charts).
- :func:`xml`: characters XML 1.0 cannot hold shown as ``\\x01`` (JUnit; ElementTree escapes ``<&>"``).
- :func:`console`: the CLI's rich consoles, which apply :func:`terminal` to everything they print.
"""

from __future__ import annotations

import html as _html
import re
from collections.abc import Iterable
from typing import Any

__all__ = ["console", "html", "markdown", "markdown_code", "terminal", "tsv", "xml"]

# C0 controls but tab and newline, DEL, C1 controls; the bidi overrides/isolates and line/paragraph separators;
# lone surrogates (an undecodable byte of a file name, \udcff): no UTF-8 writer could write them
_OTHER = "\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_CONTROL = re.compile(f"[\x00-\x08\x0b-\x1f{_OTHER}]")  # newlines kept
_CONTROL_NL = re.compile(f"[\x00-\x08\x0a-\x1f{_OTHER}]")  # tabs kept
_ANY_CONTROL = re.compile(f"[\x00-\x1f{_OTHER}]")
# what XML 1.0 cannot hold at all (tab, LF and CR it can)
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
# what starts markup in (GitHub-flavoured) Markdown inside a line: emphasis, code, links and images, HTML tags
# and entities, table pipes, strikethrough, email autolinks; ``://`` and ``www.`` (URL autolinks) separately
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>&|~!#@])")
_MD_URL = re.compile(r"(://|(?i:www)\.)")


def _visible(match: re.Match[str]) -> str:
    c = match.group(0)
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def terminal(text: object, newlines: bool = False) -> str:
    """``text`` for a terminal: every control character (ESC included) shown as ``\\x1b``; tabs are kept,
    newlines too when ``newlines``."""
    return (_CONTROL if newlines else _CONTROL_NL).sub(_visible, str(text))


def tsv(text: object) -> str:
    """One field of tab-separated output (``amplite inspect``): no tab or newline can split the row."""
    s = str(text).replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
    return _ANY_CONTROL.sub(_visible, s)


def markdown(text: object) -> str:
    """Plain text in Markdown (a paragraph or a table cell): one line, the characters that start markup
    backslash-escaped (CommonMark: any ASCII punctuation may be), so no HTML tag, entity, link, image,
    emphasis or autolink can form."""
    s = _ANY_CONTROL.sub(_visible, str(text).replace("\r\n", " ").replace("\n", " ").replace("\t", " "))
    s = _MD_SPECIAL.sub(r"\\\1", s)
    return _MD_URL.sub(lambda m: m.group(0).replace("/", "\\/").replace(".", "\\."), s)


def markdown_code(text: object) -> str:
    """``text`` as a Markdown code span (shown verbatim: HTML and Markdown inside are inert), one line, with
    a fence longer than any backtick run inside and pipes escaped for tables."""
    s = _ANY_CONTROL.sub(_visible, str(text).replace("\r\n", " ").replace("\n", " ").replace("\t", " "))
    s = s.replace("|", "\\|")
    longest = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if s.startswith("`") or s.endswith("`") or not s.strip() else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def html(text: object) -> str:
    """Text for HTML (and for plotly labels, which read a few tags): escaped, control characters visible (tab
    and newline are whitespace there and stay)."""
    return _html.escape(_CONTROL.sub(_visible, str(text)), quote=True)


def xml(text: object) -> str:
    """Text for an XML document: characters XML 1.0 cannot hold (most C0 controls, lone surrogates) shown
    as ``\\x01``; ElementTree then escapes the markup characters."""
    return _XML_INVALID.sub(_visible, str(text))


def console(**kwargs: Any) -> Any:
    """A ``rich`` Console that shows control characters in everything it prints as text (:func:`terminal`):
    rich passes ESC through, so a name could otherwise hide a hyperlink, erase a line or print a green PASS.
    rich's own styling is added after this, so colours still work."""
    from rich.console import Console
    from rich.segment import Segment

    class _SafeConsole(Console):
        def _render_buffer(self, buffer: Iterable[Segment]) -> str:
            return super()._render_buffer(
                seg if seg.control else Segment(terminal(seg.text, newlines=True), seg.style, None) for seg in buffer
            )

    return _SafeConsole(**kwargs)
