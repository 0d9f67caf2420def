"""Parts of ``bench/RESULTS.md``: the cast/SQNR targets under the casts table, the Targets and Failures sections."""

from __future__ import annotations

from typing import Any

#: Columns of the per-target summary tables.
SUMMARY_HEAD = ["target", "limit", "met", "missed", "n/a", "met everywhere", "worst"]


def cast_targets(models: dict[str, Any]) -> list[str]:
    """Per model and dtype: O1 ≤ 1.0× and O2 ≤ 0.5× autocast's casts, O1 SQNR ≥ autocast − 0.5 dB; overall."""
    from bench.tables import table
    from bench.targets import summary_rows, verdicts

    keys = ("casts_o1", "casts_o2", "sqnr_o1")
    vs = [v for v in verdicts(models) if v.key in keys]
    if not vs:
        return []
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    for v in vs:
        c = v.cells()
        cells.setdefault((v.model, v.sub), {})[v.key] = f"{c[2]} ({c[4]})" if v.value is not None else c[2]
    def all_met(m: str, dt: str) -> str:
        mets = [v.met for v in vs if (v.model, v.sub) == (m, dt)]
        return "NO" if False in mets else ("yes" if all(mets) else "n/a")

    rows = [[m, dt, *(got.get(k, "not run") for k in keys), all_met(m, dt)] for (m, dt), got in cells.items()]

    return ["Targets (issue 17), per model: each value with whether it meets its limit (yes / NO; n/a where a "
            "tool failed).", "",
            *table(["model", "dtype", "O1 / autocast (≤ 1.0)", "O2 / autocast (≤ 0.5)",
                    "SQNR O1 − autocast dB (≥ −0.5)", "all met"], rows),
            "Overall, every model:", "",
            *table(SUMMARY_HEAD, summary_rows(vs))]


def targets_section(models: dict[str, Any]) -> list[str]:
    """The Targets section: the summary line, one row per target over every model, then every verdict."""
    from bench.tables import table
    from bench.targets import evaluate, summary_rows, verdicts

    rows, summary = evaluate(models)
    return ["## Targets (ratios, same run)", "", summary, "",
            "Per target, over every model (the worst model and its value; cost targets take each model's worst "
            "configuration):", "",
            *table(SUMMARY_HEAD, summary_rows(verdicts(models))),
            "Per model:", "",
            *table(["model", "target", "value", "limit", "met"], rows + _same_ops_rows(models))]


#: The informative row under the issue's targets (not counted in the summary).
SAME_OPS_TARGET = "ONNX Cast nodes, amplite / onnxconverter-common with the same FP32 ops (informative)"


def _same_ops_rows(models: dict[str, Any]) -> list[list[Any]]:
    """amplite's ONNX Cast nodes over onnxconverter-common's when it keeps amplite's FP32 op types."""
    from bench.tables import _ran, _same, failed, num, ratio

    rows = []
    for name, m in models.items():
        if not m["jobs"]:
            continue
        for lvl in (x for x in ("O1", "O2") if _ran(m, f"amplite:fp16:{x}")):
            rec = m["jobs"].get(f"amplite:fp16:{lvl}")
            ours, theirs = (rec or {}).get("onnx") or {}, _same(rec) or {}
            value = ratio(ours.get("casts"), theirs.get("casts"))
            why = failed(rec) or theirs.get("error") or ours.get("error") or ("not run" if not theirs else None)
            shown = num(value, ".3g") if value is not None else f"n/a ({why or 'no Casts in onnxconverter-common'})"
            rows.append([f"{name} fp16:{lvl}", SAME_OPS_TARGET, shown, "–", "informative"])
    return rows


def failures(models: dict[str, Any]) -> list[str]:
    """The Failures section: every error, by model and job."""
    from bench.tables import failed, table

    rows = []
    for name, m in models.items():
        if m.get("skip_reason"):
            rows.append([name, "all", m["skip_reason"]])
        for job, rec in m["jobs"].items():
            if (err := failed(rec)) is not None:
                rows.append([name, job, err])
            if rec.get("torch_export_error"):
                rows.append([name, f"{job} / torch.export", rec["torch_export_error"]])
            for key in ("fp32", "onnx", "occ", "occ_same", "runtime_casts", "accuracy", "latency", "cost"):
                sub = rec.get(key)
                if isinstance(sub, dict) and ("error" in sub or "ort_error" in sub):
                    rows.append([name, f"{job} / {key}", sub.get("error") or "ORT refused: " + sub["ort_error"]])
            for dt, sub in (rec.get("autocast") or {}).items():
                if "error" in sub:
                    rows.append([name, f"{job} / autocast {dt}", sub["error"]])
    if not rows:
        return ["## Failures", "", "None: every tool ran on every model.", ""]
    return ["## Failures", "", "Every error, by model and tool (amplite's own one-line message where amplite failed).",
            "", *table(["model", "job", "error"], rows)]
