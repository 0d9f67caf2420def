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
from pathlib import Path
from typing import Any

import pytest

from amplite.converter.check import check
from amplite.converter.html_report import render_html
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
