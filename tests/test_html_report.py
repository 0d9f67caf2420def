"""report.html renders in a real headless Chromium without console errors, and is self-contained.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: commands on fd 3,
replies on fd 4, NUL-separated JSON), collecting uncaught exceptions, ``console.error`` calls and error log
entries. Skipped when no Chromium binary is installed (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import time
from html import escape
from pathlib import Path
from typing import Any

import pytest

import amplite
from amplite.gate import check, write_reports
from amplite.report.html import render_html
from amplite.report.markdown import render_markdown
from amplite.verify.compare import parse_tolerance
from fixtures.zoo import make

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
CHROMIUM = os.environ.get("AMPLITE_CHROMIUM") or next((p for b in BROWSERS if (p := shutil.which(b))), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary (apt-get install chromium)")


class Browser:
    """A minimal DevTools-protocol client over Chromium's pipe transport."""

    def __init__(self, profile: Path) -> None:
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        def to_fds_3_and_4() -> None:  # in the child: the pipe ends Chromium expects
            a, b = os.dup(cmd_r), os.dup(out_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                 "--remote-debugging-pipe", "about:blank"]  # fmt: skip
        self.proc = subprocess.Popen([CHROMIUM, *flags], preexec_fn=to_fds_3_and_4, pass_fds=(3, 4),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip
        os.close(cmd_r)
        os.close(out_w)
        self._buf, self._id, self.events = b"", 0, []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict[str, Any]:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        wanted = self._id
        reply = self.wait(lambda m: m.get("id") == wanted)
        assert "error" not in reply, reply
        return reply.get("result", {})

    def wait(self, pred: Any, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                msg = json.loads(raw)
                self.events.append(msg)
                if pred(msg):
                    return msg
            if select.select([self._out_r], [], [], 0.2)[0]:
                chunk = os.read(self._out_r, 1 << 16)
                if not chunk:
                    raise RuntimeError("Chromium closed the DevTools pipe")
                self._buf += chunk
        raise TimeoutError("no reply from Chromium")

    def load(self, path: Path, settle: float = 1.0) -> tuple[str, list[dict[str, Any]]]:
        """Open ``path``; return the id of its session and the errors seen."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.send(f"{domain}.enable", session=session)
        self.send("Page.navigate", {"url": path.resolve().as_uri()}, session)
        self.wait(lambda m: m.get("method") == "Page.loadEventFired" and m.get("sessionId") == session)
        time.sleep(settle)  # let plotly finish drawing (it renders asynchronously)
        return session, [m for m in self.events if m.get("sessionId") == session and _is_error(m)]

    def evaluate(self, session: str, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        return result["result"].get("value")

    def close(self) -> None:
        try:
            os.write(self._cmd_w, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)


def _is_error(m: dict[str, Any]) -> bool:
    method, params = m.get("method"), m.get("params", {})
    return (
        method == "Runtime.exceptionThrown"
        or (method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"))
        or (method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error")
    )


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("html")
    model, inputs = make("overflow")
    out = {"O3": check(model, inputs, level="O3", report_dir=d / "O3", grad=True).files["html"]}
    tmodel, tinputs = make("transformer")
    out["transformer"] = check(tmodel, tinputs, level="O1", report_dir=d / "t").files["html"]
    return out


@pytest.fixture(scope="module")
def budgets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Reports of the real fallback search on the MLP: one that meets a tolerance 3 dB above the rule-based
    plan, one that cannot (fp16 graph inputs keep their rounding, so 200 dB is out of reach)."""
    model, inputs = make("mlp")
    plain = amplite.convert(model, inputs, level="O2", low_precision_io=False)
    target = plain.report.outputs[0]["sqnr_db"] + 3.0
    out = {}
    for key, low_io, spec in (("met", False, f"sqnr>={target:.2f}"), ("missed", True, "sqnr>=200")):
        result = amplite.convert(model, inputs, level="O2", low_precision_io=low_io,
                                 tolerance=parse_tolerance([spec], "fp16"), fallback_search=True)  # fmt: skip
        files = write_reports(result.report.data, tmp_path_factory.mktemp(key))
        out[key] = {"data": result.report.data, "spec": spec, **files}
    return out


def _budget_table(html: str) -> list[list[str]]:
    """Rows (cells as text) of the table after 'Moved to FP32' in a report page."""
    table = html.split("Moved to FP32", 1)[1].split("</table>", 1)[0]
    return [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table)[1:]]


def test_budget_section_lists_the_moved_nodes_and_the_search(budgets: dict[str, dict[str, Any]]) -> None:
    met = budgets["met"]
    budget, html = met["data"]["budget"], met["html"].read_text()
    assert budget["passed"] and 0 < len(budget["moved_to_fp32"]) <= budget["candidates"]
    assert "<h2>Accuracy budget</h2>" in html and 'id="budget-search"' in html
    rows = _budget_table(html)
    assert [r[1] for r in rows] == [m["node"] for m in budget["moved_to_fp32"]]
    assert [r[4] for r in rows] == [m["source"] for m in budget["moved_to_fp32"]]
    assert all("zoo.py:" in r[4] for r in rows)  # the user's source line, not amplite's
    assert [float(r[5]) for r in rows] == pytest.approx([m["isolated_sqnr_db"] for m in budget["moved_to_fp32"]],
                                                        rel=1e-3)  # fmt: skip
    assert f"<code>{escape(met['spec'].replace('sqnr', 'sqnr_db'))}</code>" in html  # the contract, as parsed
    md = met["md"].read_text()
    assert f"met with {len(budget['moved_to_fp32'])} of {budget['candidates']} candidate nodes" in md
    assert all(f"`{m['node']}`" in md for m in budget["moved_to_fp32"])

    missed = budgets["missed"]
    assert missed["data"]["budget"]["passed"] is False
    html = missed["html"].read_text()
    assert "NOT met" in html and "even with all" in html
    assert "**NOT met**" in missed["md"].read_text()


def test_range_rule_decisions_are_listed_in_the_precision_map() -> None:
    model, inputs = make("overflow")
    on = amplite.convert(model, inputs, level="O3", range_rules=True).report.data
    html = render_html(on)
    section = html.split("<h3>Range rules</h3>", 1)[1].split("</table>", 1)[0]
    assert html.index("<h2>Precision map</h2>") < html.index("<h3>Range rules</h3>")
    decided = [p for p in on["plan"] if p["reason"].startswith("range:")]
    assert len(decided) >= 2 and f"{len(decided)} node(s) kept in FP32 by them" in section
    assert all(p["node"] in section and escape(p["reason"]) in section for p in decided)
    assert "data_max 512," in section
    off = amplite.convert(model, inputs, level="O3", range_rules=False).report.data
    assert off["config"]["range_rules"] is None and "Range rules" not in render_html(off)
    assert "kept by the range rules" in render_markdown(on) and "range rules" not in render_markdown(off)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Browser:
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


def test_report_is_self_contained(reports: dict[str, Path]) -> None:
    html = reports["O3"].read_text()
    assert not re.search(r"<(script|link|img)[^>]+(src|href)\s*=\s*[\"']?(https?:)?//", html)
    assert html.count("plotly-graph-div") >= 3
    assert "pow_1" in html and "FAIL" in html


@needs_chromium
def test_reports_render_without_console_errors(reports: dict[str, Path], browser: Browser) -> None:
    for name, path in reports.items():
        session, errors = browser.load(path)
        assert errors == [], (name, errors[:3])
        charts = browser.evaluate(session, "document.querySelectorAll('.plotly-graph-div .main-svg').length")
        assert charts >= 3, name  # plotly drew its SVG layers: the charts rendered
        traces = browser.evaluate(session, "document.getElementById('error-along-graph').data.length")
        assert traces >= 2, name


@needs_chromium
def test_budget_chart_renders_the_search(budgets: dict[str, dict[str, Any]], browser: Browser) -> None:
    for key, rep in budgets.items():
        session, errors = browser.load(rep["html"])
        assert errors == [], (key, errors[:3])
        chart = browser.evaluate(
            session,
            """(() => { const d = document.getElementById('budget-search');
            return {x: d.data[0].x, colors: d.data[0].marker.color, text: d.data[0].text,
                    lines: (d.layout.shapes || []).map(s => s.y0),
                    drawn: d.querySelectorAll('.main-svg .point').length}; })()""",
        )
        steps = rep["data"]["budget"]["steps"]
        assert chart["x"] == [s["trial"] for s in steps] and chart["drawn"] == len(steps), key
        assert chart["colors"] == ["#087f23" if s["passed"] else "#c62828" for s in steps], key
        assert all(
            f"{s['moved']} node(s) moved" in t and s["kind"] in t for s, t in zip(steps, chart["text"], strict=True)
        )
        threshold = float(rep["spec"].split(">=")[1])
        assert chart["lines"] == [pytest.approx(threshold)], key


@needs_chromium
def test_harness_sees_errors(browser: Browser, tmp_path: Path) -> None:
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>console.error('boom'); undefinedFunction();</script></body></html>")
    _, errors = browser.load(bad, settle=0.2)
    kinds = {m["method"] for m in errors}
    assert kinds >= {"Runtime.consoleAPICalled", "Runtime.exceptionThrown"}


def test_text_from_the_model_is_escaped() -> None:
    data = {"check": {"name": "<script>alert(1)</script>", "passed": True, "reasons": []}, "config": {}}
    html = render_html(data)
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
