"""The issue's targets, evaluated per model on one run's results (ratios of numbers from the same run)."""

from __future__ import annotations

from typing import Any

#: (key, description, limit text) of each target, in report order.
TARGETS = {
    "casts_o2": "casts per forward, amplite O2 / torch.autocast",
    "casts_o1": "casts per forward, amplite O1 / torch.autocast",
    "onnx_casts": "ONNX Cast nodes, amplite fp16 / onnxconverter-common",
    "size_o2": "O2 .pt2 size / FP32 .pt2",
    "sqnr_o1": "SQNR amplite O1 − torch.autocast (dB)",
    "nonfinite": "NaN/Inf in amplite outputs",
    "passes": "amplite passes / torch.export (worst config)",
    "whole": "conversion w/o verification / torch.export (worst config)",
}


#: Phases of the conversion without verification (``passes`` includes ``calibration`` when that ran).
WHOLE = ("load", "export", "passes", "reexport")


def save_seconds(timings: dict[str, float]) -> float | None:
    """Seconds ``result.save()`` took to write the ``.pt2`` (report key ``save``, later ``save_pt2``)."""
    return timings.get("save", timings.get("save_pt2"))


def whole_seconds(timings: dict[str, float]) -> float:
    """Conversion wall time without verification, from a report's timings."""
    return sum(timings.get(k, 0.0) for k in WHOLE) + (save_seconds(timings) or 0.0)


def _ok(rec: dict[str, Any] | None) -> bool:
    return bool(rec) and rec.get("status") == "ok" and "error" not in rec


def _why(rec: dict[str, Any] | None, what: str) -> str:
    if rec is None:
        return f"{what} not run"
    return f"{what}: {rec.get('status')}"


def _check(rows: list[list[Any]], name: str, key: str, value: float | None, limit: float, op: str,
           why: str = "") -> bool | None:
    if value is None:
        rows.append([name, TARGETS[key], f"n/a ({why})", f"{op} {limit:g}", "n/a"])
        return None
    met = value <= limit if op == "≤" else value >= limit
    shown = f"{value:.3g}" if isinstance(value, float) else str(value)
    rows.append([name, TARGETS[key], shown, f"{op} {limit:g}", "yes" if met else "NO"])
    return met


def evaluate(models: dict[str, Any]) -> tuple[list[list[Any]], str]:
    """One row per (model, target) and a one-line summary."""
    rows: list[list[Any]] = []
    verdicts: list[bool | None] = []
    for name, m in models.items():
        jobs = m["jobs"]
        if not jobs:
            continue
        base, onnx = jobs.get("base"), jobs.get("onnx")
        amp = {k.split(":", 1)[1]: v for k, v in jobs.items() if k.startswith("amplite:")}
        for dt in ("fp16", "bf16"):
            ac = (base or {}).get("autocast", {}).get(dt, {}) if _ok(base) else {}
            for lvl, key, limit in (("O2", "casts_o2", 0.5), ("O1", "casts_o1", 1.0)):
                rec = amp.get(f"{dt}:{lvl}")
                n = (rec or {}).get("runtime_casts", {}).get("casts") if _ok(rec) else None
                a = ac.get("casts")
                value = n / a if n is not None and a else None
                why = _why(rec, f"amplite {dt}:{lvl}") if n is None else ("autocast casts nothing" if a == 0 else
                                                                           "torch.autocast failed")
                verdicts.append(_check(rows, f"{name} {dt}", key, value, limit, "≤", why))
        occ = (onnx or {}).get("occ", {}) if _ok(onnx) else {}
        for lvl in ("O1", "O2"):
            sub = (amp.get(f"fp16:{lvl}") or {}).get("onnx", {})
            have = "casts" in sub and "casts" in occ
            value = (sub["casts"] / occ["casts"] if occ["casts"] else float(sub["casts"] > 0) * 1e9) if have else None
            why = sub.get("error") or occ.get("error") or "amplite or onnxconverter-common failed"
            verdicts.append(_check(rows, f"{name} fp16:{lvl}", "onnx_casts", value, 1.0, "≤", why))
        fp32 = (base or {}).get("fp32_pt2_bytes")
        for dt in ("fp16", "bf16"):
            rec = amp.get(f"{dt}:O2")
            value = rec["pt2_bytes"] / fp32 if _ok(rec) and fp32 else None
            verdicts.append(_check(rows, f"{name} {dt}", "size_o2", value, 0.55, "≤", _why(rec, f"amplite {dt}:O2")))
        for dt in ("fp16", "bf16"):
            rec = amp.get(f"{dt}:O1")
            ours = (rec or {}).get("accuracy", {}).get("sqnr_db") if _ok(rec) else None
            theirs = ((base or {}).get("autocast", {}).get(dt, {}).get("accuracy") or {}).get("sqnr_db")
            value = ours - theirs if ours is not None and theirs is not None else None
            if value is not None and value != value:  # inf − inf: both exact
                value = 0.0
            why = _why(rec, f"amplite {dt}:O1") if ours is None else "torch.autocast failed"
            verdicts.append(_check(rows, f"{name} {dt}", "sqnr_o1", value, -0.5, "≥", why))
        done = [r for r in amp.values() if _ok(r) and "nonfinite" in r.get("accuracy", {})]
        value = sum(r["accuracy"]["nonfinite"] - r["accuracy"]["ref_nonfinite"] for r in done) if done else None
        verdicts.append(_check(rows, name, "nonfinite", value, 0, "≤", "no amplite run finished"))
        for key, limit in (("passes", 0.25), ("whole", 2.5)):
            vals = []
            for rec in amp.values():
                if _ok(rec) and rec.get("torch_export_s"):
                    t = rec["timings"]
                    top = t["passes"] if key == "passes" else whole_seconds(t)
                    vals.append(top / rec["torch_export_s"])
            verdicts.append(_check(rows, name, key, max(vals) if vals else None, limit, "≤", "no amplite run finished"))
    met = sum(v is True for v in verdicts)
    missed = sum(v is False for v in verdicts)
    na = sum(v is None for v in verdicts)
    summary = f"**{met} met, {missed} missed, {na} not applicable** (a tool failed or did not run)"
    return rows, f"{summary}, of {len(verdicts)}."
