"""Conversion cost against what a user pays anyway: medians of repeated runs in one process, after a warm-up.

Measured by the ``amplite:*`` jobs (``bench/jobs.py``) after their verified conversion, which is amplite's
warm-up, and one untimed export + save of the FP32 model, the plain side's: ``repeats`` rounds, each one
plain ``torch.export`` + ``torch.export.save`` of the FP32 model and one ``amplite.convert(verify=False)`` +
``result.save()``, interleaved so a change of machine load hits both sides. The issue 17 targets (``cost_targets``):

* passes (calibration included) ≤ 0.25 × the plain export;
* calibration ≤ 1.5 × one plain FP32 forward (eager, ``torch.no_grad``);
* the whole conversion without verification (wall clock of convert + save) ≤ 1.5 × (plain export + FP32 save).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

#: Repeats per configuration: 3 for models up to this many parameters, 2 above (the full run's budget).
SMALL_PARAMS = 50_000_000

#: Report timing keys of the step that turns the rewritten graph into the converted ExportedProgram: a
#: direct build (any of the first keys; the name is whatever the pipeline records) or the re-export.
REBUILD_KEYS = ("rebuild", "direct", "direct_build", "build_program", "reexport")

#: (key, what, limit) of each cost target, in report order.
COST_TARGETS = {
    "passes": ("amplite passes (calibration included) / plain torch.export", 0.25),
    "calibration": ("calibration / one plain FP32 forward", 1.5),
    "whole": ("conversion w/o verification / (plain torch.export + FP32 .pt2 save)", 1.5),
}


def repeats_for(params: int) -> int:
    """How many timed rounds a model of ``params`` parameters gets (after the warm-up)."""
    return 3 if params <= SMALL_PARAMS else 2


def rebuild_seconds(timings: dict[str, float]) -> float | None:
    """Seconds spent building the converted program (direct build and/or re-export), None when not recorded."""
    found = [timings[k] for k in REBUILD_KEYS if k in timings]
    return sum(found) if found else None


def build_path(report: dict[str, Any] | None, timings: dict[str, float]) -> str:
    """Which path built the converted program: the report's ``build_path`` when it has one, else its timing keys.

    ``re-export`` when only ``reexport`` was timed (the pipeline before the direct build existed); a direct
    key followed by ``reexport`` is a direct attempt that fell back.
    """
    if report and report.get("build_path"):
        return str(report["build_path"])
    if report and isinstance(report.get("build"), dict):  # amplite's report: {"path", "reason"}
        b = report["build"]
        if b.get("path") in ("direct", "original"):
            return str(b["path"])
        return f"re-export ({b.get('reason') or 'fallback'})"
    direct = [k for k in REBUILD_KEYS[:-1] if k in timings]
    if direct and "reexport" in timings:
        return f"{direct[0]}, fell back to re-export"
    return direct[0] if direct else "re-export"


def forward_seconds(model: torch.nn.Module, inputs: tuple[tuple, dict], n: int = 5) -> float:
    """Median wall time of ``n`` plain FP32 forwards (eager, no autograd), after one untimed forward."""
    args, kwargs = inputs
    times = []
    with torch.no_grad():
        model(*args, **kwargs)
        for _ in range(n):
            start = perf_counter()
            model(*args, **kwargs)
            times.append(perf_counter() - start)
    return statistics.median(times)


def _median_timings(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for t in runs for k in t if isinstance(t[k], (int, float))}
    return {k: statistics.median(t[k] for t in runs if k in t) for k in sorted(keys)}


def measure(model: torch.nn.Module, inputs: tuple[tuple, dict], precision: str, level: str, work: Path,
            repeats: int) -> dict[str, Any]:
    """``repeats`` interleaved rounds of (plain export + FP32 save) and (convert w/o verification + save).

    Returns medians (``export_s``, ``fp32_save_s``, ``whole_s``, ``timings``: the report's phases), every
    round's values, ``forward_s`` and the ``build_path`` of the last conversion.
    """
    import amplite
    from bench.onnx_compare import quiet

    args, kwargs = inputs
    exports, saves, wholes, timings = [], [], [], []
    report: dict[str, Any] = {}
    forward = forward_seconds(model, inputs)
    with quiet():  # the FP32 side's warm-up (the verified conversion before was amplite's): the first save
        torch.export.save(torch.export.export(model, args, kwargs, strict=False), work / "cost-fp32.pt2")
    for _ in range(repeats):
        gc.collect()
        start = perf_counter()
        with quiet():
            program = torch.export.export(model, args, kwargs, strict=False)
        exports.append(perf_counter() - start)
        start = perf_counter()
        torch.export.save(program, work / "cost-fp32.pt2")
        saves.append(perf_counter() - start)
        del program
        gc.collect()
        start = perf_counter()
        with quiet():
            result = amplite.convert(model, inputs, precision=precision, level=level, verify=False)
            result.save(work / "cost-converted.pt2")
        wholes.append(perf_counter() - start)
        timings.append(dict(result.report.data["timings"]))
        report = {k: v for k, v in result.report.data.items() if k == "build_path"}
        del result
    for name in ("cost-fp32.pt2", "cost-converted.pt2"):
        with contextlib.suppress(OSError):
            (work / name).unlink()
    med = _median_timings(timings)
    return {"repeats": repeats, "forward_s": forward, "export_s": statistics.median(exports),
            "fp32_save_s": statistics.median(saves), "whole_s": statistics.median(wholes), "timings": med,
            "build_path": build_path(report, timings[-1]),
            "runs": {"export_s": exports, "fp32_save_s": saves, "whole_s": wholes}}


def ratios(cost: dict[str, Any]) -> dict[str, float | None]:
    """The three target ratios of one ``measure`` record (None where a term is missing or zero)."""
    t = cost.get("timings") or {}

    def div(a: Any, b: Any) -> float | None:
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None

    return {"passes": div(t.get("passes"), cost.get("export_s")),
            "calibration": div(t.get("calibration"), cost.get("forward_s")),
            "whole": div(cost.get("whole_s"), (cost.get("export_s") or 0) + (cost.get("fp32_save_s") or 0))}
