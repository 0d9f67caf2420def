"""A short seeded run of amplite's own fuzzer (tests/fuzz.py): no crash, hang or payload on any target.

The long run (thousands of cases per target, documented in docs/security.md) uses the same code with more
cases and other seeds; this one keeps ``make test`` honest about the fuzzer itself and about regressions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import fuzz

ROOT = Path(__file__).resolve().parents[1]
CASES = {"pt2": 120, "inputs": 60, "safetensors": 60, "checkpoint": 30}


@pytest.mark.parametrize("target", sorted(CASES))
def test_short_fuzz_run_finds_nothing(target: str) -> None:
    cmd = [sys.executable, "-m", "tests.fuzz", "--target", target, "--cases", str(CASES[target]), "--seed", "7"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0 and summary["findings"] == 0, res.stdout[-3000:]
    refused = summary["verdicts"].get(f"{target}:refused", 0)
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
