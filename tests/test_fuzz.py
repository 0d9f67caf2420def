"""A short seeded run of amplite's own fuzzer (tests/fuzz.py): no crash, hang or payload on any target.

The long run (thousands of cases per target, documented in docs/security.md) uses the same code with more
cases and other seeds; this one keeps ``make test`` honest about the fuzzer itself and about regressions.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import fresh, fuzz
from tests.conftest import once_per_run

ROOT = Path(__file__).resolve().parents[1]
CASES = {"pt2": 120, "inputs": 60, "safetensors": 60, "checkpoint": 30, "reports": 20, "summaries": 40}
#: Targets whose mutations keep the file readable (hostile names only): every case must render, none is refused.
RENDERED = {"reports"}


_DRIVER = """
import contextlib, io, json, sys
from tests import fuzz
out = {}
for target, cases in json.loads(sys.argv[1]).items():  # `python -m tests.fuzz --target T --cases N --seed 7`
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = fuzz.main(["--target", target, "--cases", str(cases), "--seed", "7"])
    out[target] = {"rc": rc, "stdout": buf.getvalue()}
print("@@RESULTS@@" + json.dumps(out))
"""


def _fuzz_all(_folder: Path) -> dict[str, dict]:
    """Every target's short run, one after the other in ONE fresh process (each under fuzz.main's memory limit
    and its own seeded generator: the verdicts equal separate runs'), instead of one Python start-up each."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = fresh.run([sys.executable, "-c", _DRIVER, json.dumps(CASES)], cwd=ROOT, env=env, timeout=600)
    if res.returncode != 0 or "@@RESULTS@@" not in res.stdout:  # every target's test fails with the output
        return {t: {"rc": res.returncode, "stdout": res.stdout[-3000:] + res.stderr[-3000:]} for t in CASES}
    return json.loads(res.stdout.split("@@RESULTS@@", 1)[1])


@pytest.fixture(scope="session")
def fuzz_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return once_per_run(tmp_path_factory, "fuzz-runs", _fuzz_all)


@pytest.mark.parametrize("target", sorted(CASES))
def test_short_fuzz_run_finds_nothing(target: str, fuzz_runs: dict[str, dict]) -> None:
    res = fuzz_runs[target]
    summary = json.loads(res["stdout"].strip().splitlines()[-1])
    assert res["rc"] == 0 and summary["findings"] == 0, res["stdout"][-3000:]
    refused = summary["verdicts"].get(f"{target}:refused", 0)
    if target in RENDERED:  # each case went through every renderer and its medium's check
        assert summary["verdicts"] == {f"{target}:ok": CASES[target]}, summary
        return
    assert refused > CASES[target] // 2  # the mutations reach the checks (a fuzzer that mutates nothing fails)


@pytest.mark.parametrize("target", sorted(fuzz.TARGETS))
def test_every_seed_is_accepted(target: str, tmp_path: Path) -> None:
    """Mutations start from a valid file: a seed the reader refuses would make every verdict meaningless."""
    t = fuzz.TARGETS[target]
    t.read(t.seed(tmp_path))


def test_a_crash_is_a_finding(tmp_path: Path) -> None:
    """The verdict logic itself: an exception that is not an AmpliteError counts, a refusal does not."""

    class Boom(fuzz.Target):
        name = "boom"

        def read(self, path: Path) -> None:
            raise KeyError(path.name)

    class Refuse(fuzz.Target):
        name = "refuse"

        def read(self, path: Path) -> None:
            from amplite.errors import LoadError

            raise LoadError("bad", "fix")

    assert fuzz._one(Boom(), tmp_path, 5)[0] == "crash"
    assert fuzz._one(Refuse(), tmp_path, 5)[0] == "refused"


def test_the_media_check_sees_markup_and_escapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write-side verdict: with Markdown's escaper switched off, a hostile name is a finding."""
    from tests import fuzz_writes

    t = fuzz.TARGETS["reports"]
    data = json.loads(t.seed(tmp_path).read_text())
    data["check"]["name"] = "<img src=x onerror=fuzz()>\x1b[2K"
    fuzz_writes.check_media(data)  # escaped: no finding
    monkeypatch.setattr("amplite.report.markdown._code", lambda s: f"`{s}`" if "<" not in str(s) else str(s))
    with pytest.raises(AssertionError, match=r"report\.md"):
        fuzz_writes.check_media(data)
