"""Issue 41's parts of the GPU suite's report: its targets, what the budget left out, the fusion measurements.

Targets (ratios from one run, FP32 with TF32 off), beside those of issues 16, 28 and 31 (bench/gpu_report.py):

* training: amplite O1 and O2 ≤ 0.5× FP32 on GPT-2 124 M (the seed's factor of two); ≤ 1.0× autocast,
  ≤ 1.05× all-bf16 and peak memory ≤ 1.0× autocast on every training row (issue 28's, every model);
* inference: amplite O2 eager ≤ 1.0× autocast eager at batch 1 and 32, per model and dtype; compiled, CUDA
  graphs and AOTInductor (issue 31's rows); decode at batch 32 ≤ 0.5× FP32 (issue 16's rows);
* ``amplite::contract``: cuTENSOR ≥ 1.2× permute+bmm on the attention problems (issue 16's rows), and the
  ``torch`` GEMM fallback ≥ 1.0×.
"""

from __future__ import annotations

import statistics
from typing import Any

TRAIN_VS_FP32 = 0.5
EAGER_VS_AUTOCAST = 1.0
FALLBACK_SPEEDUP = 1.0
BIG_GPT2 = "gpt2-124m"
FALLBACK_METHOD = "contract (torch GEMM fallback)"


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if not a or not b or key not in a or key not in b or not b[key]:
        return None
    return a[key] / b[key]


def _target(name: str, value: float | None, bound: float, detail: str, at_least: bool = False) -> dict[str, Any]:
    met = None if value is None else (value >= bound if at_least else value <= bound)
    return {"target": name, "value": value, "met": met, "detail": detail}


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 41's targets that the other issues' lists do not already hold (None where not measured)."""
    out = []
    train = {(r["model"], r["variant"]): r for r in data.get("train", []) if "error" not in r}
    for model in dict.fromkeys(r["model"] for r in data.get("train", [])):
        if model != BIG_GPT2 and not model.startswith("tiny"):
            continue
        for lvl in ("O1", "O2"):
            value = _ratio(train.get((model, f"amplite-{lvl}")), train.get((model, "fp32")), "step_ms")
            out.append(_target(f"{model}: amplite-{lvl} / fp32 (TF32 off) step time ≤ {TRAIN_VS_FP32}", value,
                               TRAIN_VS_FP32, "issue 41 (the seed's factor of two)"))  # fmt: skip
    e2e = [r for r in data.get("e2e", []) if r.get("variant") and "ms" in r]
    for model in dict.fromkeys(r["model"] for r in e2e):
        for batch in data["meta"]["batches"]:
            ms = {r["variant"]: r for r in e2e if r["model"] == model and r["batch"] == batch}
            for p in ("fp16", "bf16"):
                value = _ratio(ms.get(f"amplite O2 {p}"), ms.get(f"autocast {p}"), "ms")
                out.append(_target(f"{model} b{batch}: amplite O2 {p} / autocast {p} eager ≤ {EAGER_VS_AUTOCAST}",
                                   value, EAGER_VS_AUTOCAST, "issue 41"))  # fmt: skip
    decode = [r for r in data.get("decode", []) if r.get("step") == "decode" and "ms" in r]
    for model in dict.fromkeys(r["model"] for r in decode):
        for batch in data["meta"]["batches"]:
            ms = {r["variant"]: r for r in decode if r["model"] == model and r["batch"] == batch}
            o2 = ms.get("amplite O2 bf16")
            out.append(
                _target(
                    f"{model} decode b{batch} (LLM step): amplite O2 bf16 / autocast bf16 ≤ 1.0",
                    _ratio(o2, ms.get("autocast bf16"), "ms"),
                    EAGER_VS_AUTOCAST,
                    "issue 41",
                )
            )
            if batch != 1:
                out.append(
                    _target(
                        f"{model} decode b{batch} (LLM step): amplite O2 bf16 / fp32 (TF32 off) ≤ 0.5",
                        _ratio(o2, ms.get("fp32 (TF32 off)"), "ms"),
                        0.5,
                        "issue 41",
                    )
                )
    for problem in sorted({r["problem"] for r in data.get("micro", []) if r["problem"].startswith("attn")}):
        for dtype in ("fp16", "bf16"):
            hit = [r for r in data["micro"] if r["problem"] == problem and r["dtype"] == dtype
                   and r["method"] == FALLBACK_METHOD and "speedup" in r]  # fmt: skip
            out.append(
                _target(
                    f"{problem} {dtype}: {FALLBACK_METHOD} ≥ {FALLBACK_SPEEDUP}× permute+bmm",
                    hit[0]["speedup"] if hit else None,
                    FALLBACK_SPEEDUP,
                    "issue 41",
                    at_least=True,
                )
            )
    return out


def fusion_measurements(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per dtype: the median unfused/fused latency over the transformer rows, as fusion_measurements entries."""
    out = []
    rows = [r for r in data.get("e2e", []) if r.get("variant") and "ms" in r]
    for p, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        gains = []
        for r in rows:
            if r["variant"].endswith(f" {p}"):
                fused = [x for x in rows if x["model"] == r["model"] and x["batch"] == r["batch"]
                         and x["variant"] == f"{r['variant']} + fusion"]  # fmt: skip
                gains += [r["ms"] / fused[0]["ms"]] if fused else []
        if gains:
            m = data["meta"]
            out.append({"device": m["device"], "backend": m.get("contract_backends", {}).get(p, "?"), "dtype": dtype,
                        "unfused_over_fused": statistics.median(gains), "models_x_batches": len(gains),
                        "source": f"bench/RESULTS-gpu.md, {m.get('started', '?')}, torch {m['torch']}"})  # fmt: skip
    return out


def header_lines(data: dict[str, Any]) -> list[str]:
    """The report's first rows: the contraction backend and why, the carried wheels, what was not run."""
    m = data["meta"]
    wheels = m.get("wheels", {})
    lines = [f"**Contraction backend that ran:** {m['contract_backend']}", "",
             f"Carried wheels: {wheels.get('status', '-')}" + (f" ({wheels['seconds']:.0f} s, counted in the budget)"
                                                               if "seconds" in wheels else ""), ""]  # fmt: skip
    missing = [f"job {j['job']}: {j['status']}" for j in data.get("jobs", [])
               if j["status"].startswith("not run") or j["status"].startswith("killed")]  # fmt: skip
    for phase in ("train", "deploy", "e2e", "onnx", "decode"):
        for r in data.get(phase, []):
            if "budget" in str(r.get("error", "")):
                what = " ".join(str(r[k]) for k in ("model", "variant", "mode", "precision", "batch") if k in r)
                missing.append(f"{phase} {what}: not run: budget")
    lines += ["## Not run: budget", ""]
    lines += [f"- {x}" for x in missing] if missing else ["Nothing: every planned job ran."]
    return [*lines, ""]


def fusion_lines(data: dict[str, Any]) -> list[str]:
    """``## Fusion measurements``: the entries for amplite/ops/fusion_measurements.py this run supports."""
    lines = ["", "## Fusion measurements (for amplite/ops/fusion_measurements.py)", ""]
    entries = fusion_measurements(data)
    if not entries:
        return [*lines, "No fused and unfused pair was measured."]
    lines += ["Copy these into `MEASUREMENTS` only from a complete run (`--fuse-contractions auto` fuses where "
              "unfused/fused > 1):", "", "```python"]  # fmt: skip
    for e in entries:
        lines.append(
            f"Measurement({e['device']!r}, {e['backend']!r}, {e['dtype']!r}, "
            f"{e['unfused_over_fused']:.3f}, {e['source']!r}),  # {e['models_x_batches']} model x batch rows"
        )
    return [*lines, "```"]


def decode_lines(data: dict[str, Any]) -> list[str]:
    """``## Decode and prefill with the LLM step program`` (bench/gpu_decode.py)."""
    lines = ["", "## Decode and prefill with the LLM step program (bench/gpu_decode.py)", "",
             "Median ms per call (CUDA events) after a prompt of `past` tokens, variants interleaved; kernels and "
             "casts: what one decode step launches (profiler on CUDA; aten compute ops on CPU).", "",
             "| model | batch | step | variant | ms | vs FP32 (TF32 off) | kernels | casts |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in data.get("decode", []):
        if "error" in r:
            lines.append(f"| {r['model']} |  |  | {r['variant']} | {r['error']} |  |  |  |")
            continue
        vs = f"{r['vs_fp32']:.2f}" if "vs_fp32" in r else "—"
        lines.append(f"| {r['model']} | {r['batch']} | {r['step']} | {r['variant']} | {r['ms']:.3f} | {vs} | "
                     f"{r.get('kernels', '')} | {r.get('casts', '')} |")  # fmt: skip
    return lines
