"""The "amplite conversion cost" section of ``bench/RESULTS.md``: phases, the same-process baselines, targets.

Each ratio cell carries its verdict against the issue 17 target (``bench.cost.COST_TARGETS``). Records
written before the cost rounds existed (no ``cost`` key) still render: their ratios that need the FP32
forward or the FP32 save are "n/a".
"""

from __future__ import annotations

from typing import Any

from bench.cost import COST_TARGETS, build_path, rebuild_seconds
from bench.targets import cost_ratios, save_seconds, whole_seconds


def _verdict(value: float | None, key: str) -> str:
    from bench.tables import num

    if value is None:
        return "n/a"
    limit = COST_TARGETS[key][1]
    return f"{num(value, '.3f')} ({'met' if value <= limit else 'NOT met'})"


def cost_rows(models: dict[str, Any]) -> list[list[Any]]:
    """One row per (model, amplite configuration) run."""
    from bench.tables import CONFIGS, failed, num

    rows = []
    for name, m in models.items():
        for cfg in CONFIGS:
            job = "amplite:" + cfg
            if job not in m["jobs"]:
                continue
            rec = m["jobs"][job]
            if (err := failed(rec)) is not None:
                rows.append([name, cfg, err] + ["–"] * 16)
                continue
            cost = rec.get("cost") if isinstance(rec.get("cost"), dict) else {}
            t = cost.get("timings") or rec["timings"]
            r = cost_ratios(rec)
            whole = cost.get("whole_s", whole_seconds(t) if not cost else None)
            path = rec.get("build_path") or cost.get("build_path") or build_path(None, t)
            rows.append([
                name, cfg, path, cost.get("repeats", cost.get("error", "1 (no cost rounds)")),
                num(t.get("export"), ".2f"), num(t.get("passes"), ".2f"), num(t.get("calibration"), ".3f"),
                num(rebuild_seconds(t), ".2f"), num(save_seconds(t), ".2f"), num(whole, ".2f"),
                num(rec["timings"].get("verify"), ".2f"), num(cost.get("forward_s"), ".3f"),
                num(cost.get("export_s", rec.get("torch_export_s")), ".2f"), num(cost.get("fp32_save_s"), ".2f"),
                _verdict(r["passes"], "passes"), _verdict(r["calibration"], "calibration"),
                _verdict(r["whole"], "whole"), num(rec.get("peak_rss_mb"), ".0f"),
                num(rec.get("baseline_rss_mb"), ".0f"),
            ])  # fmt: skip
    return rows


HEAD = ["model", "config", "build path", "rounds", "export s", "passes s", "of which calibration s", "rebuild s",
        "save s", "whole w/o verify s", "verify s", "FP32 forward s", "plain torch.export s", "FP32 .pt2 save s",
        "passes / export (≤ 0.25)", "calibration / forward (≤ 1.5)", "whole / (export + FP32 save) (≤ 1.5)",
        "peak RSS MiB", "RSS before MiB"]


INTRO = (
    "Medians over the cost rounds of each job (3 for models up to 50 M parameters, 2 above), timed after warm-ups "
    "(the job's verified conversion, and one untimed export + save of the FP32 model). Each round is one plain "
    "`torch.export.export` + `torch.export.save` of the FP32 model and one `amplite.convert(verify=False)` + "
    "`result.save()`, interleaved, in the same process. Phases (export, passes, calibration, rebuild, save) are "
    "the report's timings; \"passes\" includes the range calibration; \"rebuild\" is the step that builds the "
    "converted ExportedProgram (\"build path\": a direct build, or the re-export); \"whole\" is the wall clock "
    "of convert + save. \"verify s\" is from the verified conversion. FP32 forward: median of 5 eager "
    "`torch.no_grad` forwards after one untimed. Targets (issue 17): passes ≤ 0.25 × export, calibration ≤ 1.5 × "
    "one forward, whole ≤ 1.5 × (export + FP32 save). Peak RSS is the subprocess's high-water mark through the "
    "verified conversion and save (before the cost rounds); \"before\" is after building the model and one FP32 "
    "forward."
)


def cost_section(models: dict[str, Any]) -> list[str]:
    """The section: what each column is, then the table."""
    from bench.tables import table

    return ["## amplite conversion cost", "", INTRO, "",
            *table(HEAD, cost_rows(models))]
