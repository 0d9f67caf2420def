"""Tables and targets of ``bench/gpu_suite.py`` (RESULTS-gpu.md), from the suite's JSON data."""

from __future__ import annotations

import math
from typing import Any

#: Issue 16's targets: converted latency vs FP32 (TF32 off) and vs autocast on the transformer models;
#: amplite::contract vs permute+contiguous+bmm on the attention problems.
VS_FP32, VS_AUTOCAST, CONTRACT_SPEEDUP = 0.5, 0.9, 1.2


def _f(x: Any, fmt: str = ".3f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _best(rows: list[dict], prefix: str) -> dict | None:
    ok = [r for r in rows if r["variant"].startswith(prefix) and "ms" in r]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with its measured value and whether it is met (None where nothing was measured)."""
    out: list[dict[str, Any]] = []
    transformer = {r["model"] for r in data["e2e"] if r.get("variant")} - {"resnet50", "tiny-cnn"}
    for model in sorted(transformer):
        for batch in data["meta"]["batches"]:
            rows = [r for r in data["e2e"] if r["model"] == model and r.get("batch") == batch]
            amp, fp32, ac = _best(rows, "amplite"), _best(rows, "fp32 (TF32 off)"), _best(rows, "autocast")
            for name, base, bound in ((f"≤ {VS_FP32}× FP32 (TF32 off)", fp32, VS_FP32),
                                      (f"≤ {VS_AUTOCAST}× autocast", ac, VS_AUTOCAST)):  # fmt: skip
                ratio = amp["ms"] / base["ms"] if amp and base else None
                out.append({"target": f"{model} b{batch}: best amplite {name}", "value": ratio,
                            "met": None if ratio is None else ratio <= bound,
                            "detail": amp["variant"] if amp else "not measured"})  # fmt: skip
    gains = []
    for model in sorted(transformer):
        for batch in data["meta"]["batches"]:
            rows = [r for r in data["e2e"] if r["model"] == model and r.get("batch") == batch and "ms" in r]
            by = {r["variant"]: r["ms"] for r in rows}
            gains += [by[k] / by[f"{k} + fusion"] for k in by if f"{k} + fusion" in by]
    gain = sorted(gains)[len(gains) // 2] if gains else None
    out.append({"target": "fusion pays (median unfused/fused latency > 1; decides --fuse-contractions auto)",
                "value": gain, "met": None if gain is None else gain > 1.0,
                "detail": "if met with cuTENSOR: add the GPU to fusion_default.MEASURED_FASTER"})  # fmt: skip
    for problem in sorted({r["problem"] for r in data["micro"] if r["problem"].startswith("attn")}):
        for dtype in ("fp16", "bf16"):
            rows = [r for r in data["micro"] if r["problem"] == problem and r["dtype"] == dtype and "ms" in r]
            ct = [r for r in rows if r["method"] == "contract (cuTENSOR)"]
            detail = f"{ct[0]['of_peak']:.1%} of bf16 peak" if ct else "cuTENSOR not measured"
            out.append({"target": f"{problem} {dtype}: contract (cuTENSOR) ≥ {CONTRACT_SPEEDUP}× permute+bmm",
                        "value": ct[0]["speedup"] if ct else None,
                        "met": ct[0]["speedup"] >= CONTRACT_SPEEDUP if ct else None, "detail": detail})  # fmt: skip
    return out


def render(data: dict[str, Any]) -> str:
    """RESULTS-gpu.md."""
    m = data["meta"]
    lines = [
        "# GPU suite results" + (" (DRY RUN: CPU, tiny shapes; numbers mean nothing)" if m["dry_run"] else ""),
        "",
        f"Device: {m['device']} · torch {m['torch']} (CUDA {m['cuda']}) · Python {m['python']} · "
        f"nvmath-python {m['nvmath']} · {m.get('seconds', 0):.0f} s",
        "",
        f"`amplite::contract` backend: {m['contract_backend']}",
        "",
        "## Targets",
        "",
        "| target | value | met | detail |",
        "|---|---|---|---|",
    ]
    for t in data["targets"]:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {t['target']} | {_f(t['value'], '.2f')} | {met} | {t['detail']} |")
    p = data["pytest"]
    lines += ["", "## pytest -m gpu", "", f"`{p.get('command', '-')}`: {p.get('summary')}", ""]
    lines += [f"- {f}" for f in p.get("failures", [])]
    lines += ["", f"## Contraction microbenchmark (bf16 matmul peak measured: {_f(data['peak_tflops'], '.1f')} "
              "TFLOP/s)", "", "| problem | dtype | method | ms | TFLOP/s | of peak | vs permute+bmm | max abs Δ |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in data["micro"]:
        if "error" in r:
            lines.append(f"| {r['problem']} | {r['dtype']} | {r['method']} | {r['error']} |  |  |  |  |")
        else:
            lines.append(f"| {r['problem']} | {r['dtype']} | {r['method']} | {_f(r['ms'])} | {_f(r['tflops'], '.1f')} "
                         f"| {r['of_peak']:.1%} | {r['speedup']:.2f}× | {r['max_abs_vs_eager']:.2e} |")  # fmt: skip
    lines += ["", "## End-to-end latency (median ms, CUDA events) and peak memory", "",
              "| model | batch | variant | ms | vs FP32 (TF32 off) | peak MiB | SQNR dB vs FP32 |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in data["e2e"]:
        if "variant" not in r:
            lines.append(f"| {r['model']} |  | {r.get('error', '')} |  |  |  |  |")
            continue
        base = _best([x for x in data["e2e"] if x.get("model") == r["model"] and x.get("batch") == r["batch"]
                      and x.get("variant")], "fp32 (TF32 off)")  # fmt: skip
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | {r['error']} |  |  |  |")
            continue
        rel = r["ms"] / base["ms"] if base else None
        lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | {_f(r['ms'])} | {_f(rel, '.2f')} "
                     f"| {_f(r.get('peak_mib'), '.0f')} | {_f(r.get('sqnr_db'), '.1f')} |")  # fmt: skip
    lines += ["", "Conversions (passes' time; `amplite::contract` nodes in the graph):", ""]
    for n in data["notes"]:
        what = n["note"] if "note" in n else f"{n['convert_s']:.1f} s, {n['contract_nodes']} contract nodes"
        lines.append(f"- {n['model']} {n.get('variant', '')}: {what}")
    lines += ["", "## ONNX Runtime", "", "| model | precision | provider | ms (host I/O incl.) |", "|---|---|---|---|"]
    for r in data["onnx"]:
        lines.append(f"| {r['model']} | {r.get('precision', '')} | {r.get('provider', '')} | "
                     f"{_f(r['ms']) if 'ms' in r else r.get('error', '')} |")  # fmt: skip
    lines += ["", "## Training step", "", data["training"].get("error", ""), ""]
    return "\n".join(lines)
