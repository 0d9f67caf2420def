"""The issues' targets, evaluated per model on one run's results (ratios of numbers from the same run).

``verdicts`` gives one structured verdict per (model, sub-case, target); ``evaluate`` turns them into the
per-model rows and a one-line summary, ``summary_rows`` into one row per target (met / missed / n/a and the
worst model). A target whose job was not scheduled for a model (``--jobs``, or a case restricted to some
jobs) has no verdict; one whose job ran but failed is "n/a" with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.cost import COST_TARGETS, REBUILD_KEYS, ratios

#: key -> description of each target, in report order.
TARGETS = {
    "casts_o2": "casts per forward, amplite O2 / torch.autocast",
    "casts_o1": "casts per forward, amplite O1 / torch.autocast",
    "sqnr_o1": "SQNR amplite O1 − torch.autocast (dB)",
    "onnx_casts": "ONNX Cast nodes, amplite fp16 / onnxconverter-common",
    "onnx_runs": "amplite fp16 ONNX passes onnx.checker, loads and runs in ONNX Runtime",
    "size_o2": "O2 .pt2 size / FP32 .pt2",
    "nonfinite": "NaN/Inf in amplite outputs",
    **{k: f"{what} (worst config)" for k, (what, _) in COST_TARGETS.items()},
}

#: Phases of the conversion without verification (``passes`` includes ``calibration`` when that ran).
WHOLE = ("load", "export", "passes", *REBUILD_KEYS)


@dataclass(frozen=True)
class Verdict:
    """One target on one model (``sub``: dtype or config, or the worst config for the cost targets)."""

    model: str
    sub: str
    key: str
    value: float | None
    limit: float
    op: str  # "≤" or "≥"
    why: str = ""  # the reason when value is None
    shown: str | None = None  # the value as text, when not a number (yes/no)

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.limit if self.op == "≤" else self.value >= self.limit

    def cells(self) -> list[Any]:
        """``[model, target, value, limit, met]`` for the targets table."""
        name = f"{self.model} {self.sub}".strip()
        if self.value is None:
            return [name, TARGETS[self.key], f"n/a ({self.why})", f"{self.op} {self.limit:g}", "n/a"]
        shown = self.shown or (f"{self.value:.3g}" if isinstance(self.value, float) else str(self.value))
        return [name, TARGETS[self.key], shown, f"{self.op} {self.limit:g}", "yes" if self.met else "NO"]


def save_seconds(timings: dict[str, float]) -> float | None:
    """Seconds ``result.save()`` took to write the ``.pt2`` (report key ``save``, later ``save_pt2``)."""
    return timings.get("save", timings.get("save_pt2"))


def whole_seconds(timings: dict[str, float]) -> float:
    """Conversion time without verification as the sum of a report's phases (records without ``cost``)."""
    return sum(timings.get(k, 0.0) for k in WHOLE) + (save_seconds(timings) or 0.0)


def _ok(rec: dict[str, Any] | None) -> bool:
    return bool(rec) and rec.get("status") == "ok" and "error" not in rec


def _why(rec: dict[str, Any] | None, what: str) -> str:
    if rec is None:
        return f"{what} not run"
    return f"{what}: {rec.get('status')}"


def cost_ratios(rec: dict[str, Any]) -> dict[str, float | None]:
    """The cost ratios of one amplite record; records from before ``cost`` existed give passes only."""
    cost = rec.get("cost")
    if isinstance(cost, dict) and "timings" in cost:
        return ratios(cost)
    t, exp = rec.get("timings") or {}, rec.get("torch_export_s")
    return {"passes": t["passes"] / exp if exp and "passes" in t else None, "calibration": None, "whole": None}


def _model_verdicts(name: str, jobs: dict[str, Any]) -> list[Verdict]:
    out: list[Verdict] = []
    base, onnx = jobs.get("base"), jobs.get("onnx")
    amp = {k.split(":", 1)[1]: v for k, v in jobs.items() if k.startswith("amplite:")}
    for dt in ("fp16", "bf16"):
        ac = (base or {}).get("autocast", {}).get(dt, {}) if _ok(base) else {}
        for lvl, key, limit in (("O2", "casts_o2", 0.5), ("O1", "casts_o1", 1.0)):
            if f"{dt}:{lvl}" not in amp or base is None:
                continue
            rec = amp[f"{dt}:{lvl}"]
            n = (rec or {}).get("runtime_casts", {}).get("casts") if _ok(rec) else None
            a = ac.get("casts")
            value = n / a if n is not None and a else None
            why = _why(rec, f"amplite {dt}:{lvl}") if n is None else ("autocast casts nothing" if a == 0 else
                                                                       "torch.autocast failed")
            out.append(Verdict(name, dt, key, value, limit, "≤", why))
        if f"{dt}:O1" in amp and base is not None:
            rec = amp[f"{dt}:O1"]
            ours = (rec or {}).get("accuracy", {}).get("sqnr_db") if _ok(rec) else None
            theirs = ((base or {}).get("autocast", {}).get(dt, {}).get("accuracy") or {}).get("sqnr_db")
            value = ours - theirs if ours is not None and theirs is not None else None
            if value is not None and value != value:  # inf − inf: both exact
                value = 0.0
            why = _why(rec, f"amplite {dt}:O1") if ours is None else "torch.autocast failed"
            out.append(Verdict(name, dt, "sqnr_o1", value, -0.5, "≥", why))
    occ = (onnx or {}).get("occ", {}) if _ok(onnx) else {}
    for lvl in ("O1", "O2"):
        if f"fp16:{lvl}" not in amp:
            continue
        rec = amp[f"fp16:{lvl}"]
        sub = (rec or {}).get("onnx", {}) if _ok(rec) else {}
        if onnx is not None:
            have = "casts" in sub and "casts" in occ
            value = (sub["casts"] / occ["casts"] if occ["casts"] else float(sub["casts"] > 0) * 1e9) if have else None
            why = sub.get("error") or occ.get("error") or (onnx or {}).get("error") or \
                "amplite or onnxconverter-common failed"  # fmt: skip
            out.append(Verdict(name, f"fp16:{lvl}", "onnx_casts", value, 1.0, "≤", why[:160]))
        loads = sub.get("ort_loads", "ort_error" not in sub)  # records before ort_loads: it ran, or not
        runs = sub.get("checker") == "passed" and loads is True and "ort_error" not in sub and "accuracy" in sub
        if not _ok(rec) or "error" in sub:
            out.append(Verdict(name, f"fp16:{lvl}", "onnx_runs", None, 1, "≥",
                               (sub.get("error") or _why(rec, f"amplite fp16:{lvl}"))[:160]))
        else:
            detail = "yes" if runs else f"no ({sub.get('ort_error') or sub.get('checker')})"[:160]
            out.append(Verdict(name, f"fp16:{lvl}", "onnx_runs", float(runs), 1, "≥", shown=detail))
    fp32 = (base or {}).get("fp32_pt2_bytes")
    for dt in ("fp16", "bf16"):
        if f"{dt}:O2" in amp and base is not None:
            rec = amp[f"{dt}:O2"]
            value = rec["pt2_bytes"] / fp32 if _ok(rec) and fp32 else None
            out.append(Verdict(name, dt, "size_o2", value, 0.55, "≤", _why(rec, f"amplite {dt}:O2")))
    if amp:
        done = [r for r in amp.values() if _ok(r) and "nonfinite" in r.get("accuracy", {})]
        value = sum(r["accuracy"]["nonfinite"] - r["accuracy"]["ref_nonfinite"] for r in done) if done else None
        out.append(Verdict(name, "", "nonfinite", value, 0, "≤", "no amplite run finished"))
        for key, (_, limit) in COST_TARGETS.items():
            vals = [(v, cfg) for cfg, r in amp.items() if _ok(r) and (v := cost_ratios(r)[key]) is not None]
            if vals:
                value, cfg = max(vals)
                out.append(Verdict(name, f"(worst: {cfg})", key, value, limit, "≤"))
            else:
                why = "no calibration ran" if key == "calibration" and any(_ok(r) for r in amp.values()) else \
                    "not measured in this run" if any(_ok(r) for r in amp.values()) else "no amplite run finished"
                out.append(Verdict(name, "", key, None, limit, "≤", why))
    return out


def verdicts(models: dict[str, Any]) -> list[Verdict]:
    """Every verdict of a run, model by model."""
    return [v for name, m in models.items() if m["jobs"] for v in _model_verdicts(name, m["jobs"])]


def summary_line(vs: list[Verdict]) -> str:
    met = sum(v.met is True for v in vs)
    missed = sum(v.met is False for v in vs)
    na = sum(v.met is None for v in vs)
    return f"**{met} met, {missed} missed, {na} not applicable** (a tool failed or did not run), of {len(vs)}."


def evaluate(models: dict[str, Any]) -> tuple[list[list[Any]], str]:
    """One row per (model, target) and a one-line summary."""
    vs = verdicts(models)
    return [v.cells() for v in vs], summary_line(vs)


def summary_rows(vs: list[Verdict]) -> list[list[Any]]:
    """Per target: limit, met / missed / n/a counts, overall verdict and the worst model with its value."""
    rows = []
    for key, what in TARGETS.items():
        mine = [v for v in vs if v.key == key]
        if not mine:
            continue
        measured = [v for v in mine if v.value is not None]
        worst = (max if mine[0].op == "≤" else min)(measured, key=lambda v: v.value) if measured else None
        missed = sum(v.met is False for v in mine)
        overall = "NO" if missed else ("yes" if measured else "n/a")
        shown = "–" if worst is None else f"{f'{worst.model} {worst.sub}'.strip()}: {worst.cells()[2]}"
        rows.append([what, f"{mine[0].op} {mine[0].limit:g}", sum(v.met is True for v in mine), missed,
                     sum(v.met is None for v in mine), overall, shown])
    return rows
