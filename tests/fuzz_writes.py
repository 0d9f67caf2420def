"""Fuzz targets for what amplite *writes* (issue 45): names and metadata from files through every report medium,
and the batch summaries ``amplite batch merge`` reads. Registered in :data:`tests.fuzz.TARGETS`.

A case is a finding when a renderer raises (anything but a refusal) or when its output breaks the rule of its
medium (:func:`check_media`): raw HTML, a link or an image in report.md (rendered by markdown-it with HTML on),
a hostile tag in report.html, JUnit that is not XML, a control character on the terminal, a TSV row with a
field too many.
"""

from __future__ import annotations

import io
import json
import random
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

# The targets have tests.fuzz.Target's interface (name, seed, mutate, read) without importing it: tests.fuzz
# imports this module to build its TARGETS, also when it runs as ``python -m tests.fuzz``.

#: Text a model file may carry in its names (tags and links are unique markers, looked for in the outputs).
HOSTILE_TEXT = [
    "<img src=x onerror=fuzz()>", "<a href=http://fuzz.invalid>x</a>", "<script>fuzz()</script>",
    "[x](http://fuzz.invalid)", "![i](http://fuzz.invalid/i.png)", "http://fuzz.invalid/", "www.fuzz.invalid",
    "**b** _i_ `c` ~~s~~ | cell | # h", "\x1b]8;;http://fuzz.invalid\x07hidden\x1b]8;;\x07", "\x1b[2K\r\x1b[32mPASS",
    "\x9b31m", "tab\there", "new\nline", "cr\rret", "\x00\x01\x08\x0b\x0c\x7f", "\u202egnp.exe", "\ud800", "\ufffe",
    "a" * 5000, "&amp; &lt; &#x3C;", "]]><x/>", "%0A::error::fuzz", "`` ``` `", "\\|\\", "'\"",
]  # fmt: skip
# what the hostile text would become if it were markup (amplite's own headings and bold are not matched)
_TAGS = re.compile(r"<(img|a|script)\b|<strong>b</strong>|<em>i</em>|<del>s</del>|<h1>\s*h|fuzz\.invalid[^<]*\"", re.I)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def mutate_strings(doc: Any, rng: random.Random, n: int = 3) -> Any:
    """Replace ``n`` random string values (and dict keys that are names) of ``doc`` by hostile text."""
    slots: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            if isinstance(v, str):
                slots.append((node, k))
            walk(v)

    walk(doc)
    for node, key in rng.sample(slots, min(n, len(slots))):
        node[key] = rng.choice(HOSTILE_TEXT) + rng.choice(["", node[key], rng.choice(HOSTILE_TEXT)])
    return doc


def check_media(data: dict[str, Any]) -> None:
    """Render ``data`` (report.json) in every medium; raise AssertionError when one breaks its medium's rule."""
    from markdown_it import MarkdownIt

    from amplite.cli import output
    from amplite.report.html import render_html
    from amplite.report.junit import github_annotations, junit_xml
    from amplite.report.markdown import render_markdown

    md = render_markdown(data)
    rendered = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"]).render(md)
    assert not _TAGS.search(rendered), f"markup from a name in report.md: {_TAGS.search(rendered)[0]!r}"
    assert not _CONTROL.search(md), "a control character in report.md"
    md.encode("utf-8")
    html = render_html(data)
    for raw in ("<img src=x onerror", "<a href=http://fuzz", "<script>fuzz", "\x1b"):
        assert raw not in html, f"{raw!r} in report.html"
    ET.fromstring(junit_xml(data).encode("utf-8"))  # and each file can be written as UTF-8 (no lone surrogate)
    html.encode("utf-8")
    for line in github_annotations(data, workspace="/nonexistent"):
        assert "\n" not in line and not _CONTROL.search(line), f"annotation {line[:80]!r}"
    # rich's own capture: the console's file is left as it was (setting and restoring .file would pin the
    # stdout of the moment, and later CLI calls in this process would print there)
    with output.out.capture() as captured:
        from types import SimpleNamespace

        from amplite.report.document import Report

        report = Report(data)  # the terminal reads the typed sections, as for a report just made
        reasons = (data.get("check") or {}).get("reasons") or []
        res = SimpleNamespace(report=report, exit_code=1, reasons=reasons,
                              files={"json": Path(str((data.get("source") or {}).get("path")))})  # fmt: skip
        output.print_check(res)
        output.print_summary(report, [], Path("r.json"))
    assert not _CONTROL.search(captured.get()), "a control character reached the terminal"
    tsv = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(tsv):
        output.print_plan(Report(data), None)  # `out` is not a terminal here: the tab-separated form
    rows = tsv.getvalue().splitlines()[:-1]
    bad = [r for r in rows if r.count("\t") != 4 or _CONTROL.search(r)]
    assert not bad, f"inspect row {bad[0][:80]!r}"


class Reports:
    """report.json of a checked model with hostile names, through Markdown, HTML, JUnit, terminal and TSV."""

    name = "reports"

    def seed(self, d: Path) -> Path:
        from amplite.gate import check
        from tests.test_security_io import Small

        torch.manual_seed(0)
        program = torch.export.export(Small().eval(), (torch.randn(2, 4),))
        res = check(program, (torch.randn(2, 4),), name="seed")
        path = d / "report.json"
        path.write_text(json.dumps(res.report.data))
        return path

    def mutate(self, seed: Path, dst: Path, rng: random.Random, hostile: list[Any]) -> Path:
        doc = mutate_strings(json.loads(seed.read_text()), rng, rng.randint(1, 6))
        out = dst.with_suffix(".json")
        out.write_text(json.dumps(doc))
        return out

    def read(self, path: Path) -> None:
        check_media(json.loads(path.read_text()))


class Summaries:
    """A shard's summary.json through ``batch merge`` (structure and names), then its summary.md checked."""

    name = "summaries"

    def seed(self, d: Path) -> Path:
        row = {"name": "m", "status": "ok", "params": 123, "low_precision_share": 0.5, "casts": 2,
               "size_ratio": 0.5, "worst_sqnr_db": 60.0, "seconds": 1.0, "error": None, "output_dir": "m"}  # fmt: skip
        doc = {"schema": "amplite.batch_summary", "schema_version": 1, "shard": "0/1", "seconds": 1.0,
               "models": [row, {**row, "name": "n", "status": "error", "error": "boom", "output_dir": "n"}]}
        path = d / "shard"
        path.mkdir()
        (path / "summary.json").write_text(json.dumps(doc))
        return path

    def mutate(self, seed: Path, dst: Path, rng: random.Random, hostile: list[Any]) -> Path:
        from tests.fuzz import dumps, mutate_json

        doc = json.loads((seed / "summary.json").read_text())
        if rng.random() < 0.5:
            doc = mutate_json(doc, rng, [*hostile, "0/999999999", "5/3", {"a": 1}, "unknown"])
        else:
            doc = mutate_strings(doc, rng, rng.randint(1, 4))
        dst.mkdir()
        (dst / "summary.json").write_bytes(dumps(doc))
        return dst

    def read(self, path: Path) -> None:
        from markdown_it import MarkdownIt

        from amplite.batch.merge import merge_summaries

        _, _, md_path = merge_summaries([path], path / "merged")
        md = md_path.read_text()
        rendered = MarkdownIt("commonmark", {"html": True}).enable("table").render(md)
        assert not _TAGS.search(rendered), f"markup from a name in summary.md: {_TAGS.search(rendered)[0]!r}"
        assert not _CONTROL.search(md), "a control character in summary.md"
