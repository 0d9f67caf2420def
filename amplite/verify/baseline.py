"""Baselines: an accepted earlier report.json whose metrics the new ones may not be worse than.

``amplite check --baseline`` reads one (:func:`load_baseline`), refuses a report of another model
(:func:`check_baseline_matches`) and lists the metrics that regressed beyond the margin (:func:`compare_baseline`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amplite.errors import ConfigError
from amplite.paths import not_a_file
from amplite.verify.numbers import decode_float

_CAP_DB = 150.0  # SQNR above this is "exact" for baseline comparisons


def load_baseline(baseline: str | Path | dict[str, Any] | None) -> dict[str, Any] | None:
    """An accepted earlier report (path or dict) for ``compare_baseline``.

    Raises:
        ConfigError: Missing file, invalid JSON, or not an amplite report with verification.
    """
    fix = "pass a report.json written by `amplite check` (or `convert`) with verification"
    if baseline is None:
        return None
    if isinstance(baseline, dict):
        problem = _baseline_shape(baseline)
        if problem:
            raise ConfigError(f"the baseline report is not an amplite report: {problem}", fix)
        return baseline
    problem = not_a_file(baseline)
    if problem is not None:
        raise ConfigError(f"--baseline {str(baseline)!r} {problem}", fix)
    try:
        data = json.loads(Path(baseline).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--baseline {str(baseline)!r} does not exist", fix) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--baseline {str(baseline)!r} is not valid JSON ({exc})", fix) from None
    if not isinstance(data, dict) or data.get("schema") != "amplite.report" or "verification" not in data:
        raise ConfigError(f"--baseline {str(baseline)!r} is not an amplite report with verification", fix)
    problem = _baseline_shape(data)
    if problem:
        raise ConfigError(f"--baseline {str(baseline)!r} is not an amplite report: {problem}", fix)
    return data


def _baseline_shape(data: dict[str, Any]) -> str | None:
    """What is wrong with the parts of a baseline report :func:`compare_baseline` reads, else None."""
    source, verification = data.get("source", {}), data.get("verification", {})
    if not isinstance(source, dict) or not isinstance(source.get("graph_fingerprint", ""), (str, type(None))):
        return "'source' is not an object with a string 'graph_fingerprint'"
    if not isinstance(verification, dict) or not isinstance(verification.get("outputs", []), list):
        return "'verification' is not an object with an 'outputs' list"
    for i, o in enumerate(verification.get("outputs", [])):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            return f"verification output #{i} is not an object with a string 'name'"
    return None


def check_baseline_matches(report: dict[str, Any], baseline: dict[str, Any], where: str = "--baseline") -> None:
    """Refuse a baseline report of another model: other output names or another graph fingerprint.

    Raises:
        ConfigError: Naming what differs.
    """
    fix = "pass a report.json of this model (or drop --baseline and accept a new one)"
    mine = report.get("source", {}).get("graph_fingerprint")
    theirs = baseline.get("source", {}).get("graph_fingerprint")
    if mine and theirs and mine != theirs:
        raise ConfigError(f"{where} is a report of another model (graph fingerprint {theirs}, this model {mine})", fix)
    names = [o["name"] for o in report.get("verification", {}).get("outputs", [])]
    old = [o["name"] for o in baseline.get("verification", {}).get("outputs", [])]
    if names and old and sorted(names) != sorted(old):
        raise ConfigError(f"{where} is a report of another model: its outputs are {', '.join(old)}, "
                          f"this model's {', '.join(names)}", fix)  # fmt: skip


_num = decode_float  # report numbers are read in one way (amplite.verify.numbers)


def compare_baseline(
    current: list[dict[str, Any]], baseline: dict[str, Any], margin_db: float = 1.0
) -> list[dict[str, Any]]:
    """Metrics worse than the baseline's beyond the margin, one dict per regression.

    SQNR may drop ``margin_db`` (values above 150 dB count as 150); error magnitudes (max/mean/p99
    abs) may grow by the matching amplitude ratio, 1 - cosine and KL by the power ratio; top-1/top-5
    agreement may drop by 0.002; new NaN/Inf may not increase, and a pass may not become a failure.
    """
    amp, power = 10 ** (margin_db / 20), 10 ** (margin_db / 10)
    base = {o["name"]: o for o in baseline.get("verification", {}).get("outputs", [])}
    found = []
    for cur in current:
        old = base.get(cur["name"])
        if old is None:
            continue

        def worse(
            metric: str, bad: Callable[[float, float], tuple[bool, float]], cur: dict = cur, old: dict = old
        ) -> None:
            c, b = _num(cur.get(metric)), _num(old.get(metric))
            if c is None or b is None:
                return
            regressed, limit = bad(c, b)
            if regressed or (math.isnan(c) and not math.isnan(b)):
                found.append(
                    {
                        "output": cur["name"],
                        "metric": metric,
                        "baseline": old.get(metric),
                        "current": cur.get(metric),
                        "limit": round(limit, 6),
                    }
                )

        worse("sqnr_db", lambda c, b: (min(c, _CAP_DB) < min(b, _CAP_DB) - margin_db, min(b, _CAP_DB) - margin_db))
        worse("cosine", lambda c, b: (1 - c > (1 - b) * power + 1e-12, 1 - (1 - b) * power - 1e-12))
        for metric in ("max_abs", "mean_abs", "p99_abs"):
            worse(metric, lambda c, b: (c > b * amp + 1e-12, b * amp + 1e-12))
        worse("kl_div", lambda c, b: (c > b * power + 1e-12, b * power + 1e-12))
        for metric in ("top1", "top5"):
            worse(metric, lambda c, b: (c < b - 0.002, b - 0.002))
        worse("new_nonfinite", lambda c, b: (c > b, b))
        if old.get("passed") and not cur.get("passed"):
            found.append({"output": cur["name"], "metric": "passed", "baseline": True, "current": False, "limit": True})
    return found
