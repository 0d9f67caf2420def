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


#: Issue 31's targets on (variant, mode) medians: (numerator, denominator, bound).
DEPLOY_TARGETS = [
    (("amplite O2", "compile"), ("autocast", "compile"), 1.0),
    (("amplite O2", "compile"), ("all bf16", "compile"), 1.05),
    (("amplite O2", "cudagraphs"), ("autocast", "cudagraphs"), 1.0),
    (("amplite O2", "cudagraphs"), ("all bf16", "cudagraphs"), 1.05),
    (("amplite O2", "aoti"), ("all bf16", "aoti"), 1.05), (("amplite O2", "aoti"), ("autocast", "compile"), 1.0),
    (("amplite O1", "eager"), ("autocast", "eager"), 1.0), (("amplite O1", "compile"), ("autocast", "compile"), 1.0),
    (("amplite O1", "cudagraphs"), ("autocast", "cudagraphs"), 1.0),
    (("amplite O2", "eager"), ("autocast", "eager"), 1.0),
]  # fmt: skip


def deploy_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 31's ratios per model, from the deploy rows (None where a side was not measured)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows if "ms" in r):
        ms = {(r["variant"], r["mode"]): r["ms"] for r in rows if r["model"] == model and "ms" in r}
        for a, b, bound in DEPLOY_TARGETS:
            value = ms[a] / ms[b] if a in ms and b in ms else None
            out.append({"target": f"{model}: {a[0]} {a[1]} / {b[0]} {b[1]} ≤ {bound}", "value": value,
                        "met": None if value is None else value <= bound, "detail": "issue 31"})  # fmt: skip
    return out


def train_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 28's ratios (bench_train_big's targets) from the train rows."""
    from bench.bench_train_big import targets as big_targets

    keyed = {(r["model"], r["variant"]): r for r in rows}
    return [{"target": f"{m}: {what} ≤ {limit}", "value": value, "met": None if value is None else met,
             "detail": "issue 28"} for m, what, value, limit, met in big_targets(keyed)]  # fmt: skip


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with its measured value and whether it is met (None where nothing was measured)."""
    from bench import gpu_issue41

    out: list[dict[str, Any]] = train_targets(data.get("train", [])) + deploy_targets(data.get("deploy", []))
    out += gpu_issue41.targets(data)
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
                "detail": "per dtype: see Fusion measurements (amplite/ops/fusion_measurements.py)"})  # fmt: skip
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
    from bench import gpu_issue41

    m = data["meta"]
    lines = [
        "# GPU suite results" + (" (DRY RUN: CPU, tiny shapes; numbers mean nothing)" if m["dry_run"] else ""),
        "",
        *gpu_issue41.header_lines(data),
        f"Device: {m['device']} · torch {m['torch']} (CUDA {m['cuda']}) · Python {m['python']} · "
        f"nvmath-python {m['nvmath']} · {m.get('seconds', 0):.0f} s",
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
    extra = gpu_issue41.decode_lines(data) + gpu_issue41.fusion_lines(data)
    return "\n".join(lines + train_lines(data) + deploy_lines(data) + extra + job_lines(data)) + "\n"


def train_lines(data: dict[str, Any]) -> list[str]:
    """``## Training step`` (issue 28): one row per (model, variant)."""
    lines = ["", "## Training step (bench/gpu_train.py)", "",
             "Median over interleaved rounds of the median step (forward, loss, backward, AdamW, zero_grad). "
             "Memory: weights, their copies and optimizer state kept between steps, plus the peak above that "
             "during a step; the batches not counted.", "",
             "| model | params M | variant | step ms | memory MiB | kept MiB | prepare s | first step s | loss |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in data.get("train", []):
        if "error" in r:
            lines.append(f"| {r['model']} |  | {r['variant']} | {r['error']} |  |  |  |  |  |")
            continue
        lines.append(f"| {r['model']} | {r['params_m']:.1f} | {r['variant']} | {_f(r['step_ms'], '.2f')} | "
                     f"{_f(r['peak_mb'], '.0f')} | {_f(r['kept_mb'], '.0f')} | {_f(r['prepare_s'], '.1f')} | "
                     f"{_f(r['first_step_s'], '.1f')} | {_f(r['loss_last'], '.3f')} |")  # fmt: skip
    return lines


def deploy_lines(data: dict[str, Any]) -> list[str]:
    """``## Compiled deployment`` (issue 31): eager / torch.compile / CUDA graphs / AOTInductor per variant."""
    modes = ("eager", "compile", "cudagraphs", "aoti")
    lines = ["", "## Compiled deployment (bench/gpu_deploy.py)", "",
             "Median ms per call (CUDA events, each call synchronised) over interleaved rounds. `compile`: "
             "torch.compile default mode (CUDA graphs off); `cudagraphs`: mode=\"reduce-overhead\"; `aoti`: an "
             "AOTInductor package loaded back.", "",
             "| model | variant | eager | compile | cudagraphs | aoti |", "|---|---|---|---|---|---|"]  # fmt: skip
    rows = data.get("deploy", [])
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and "variant" in r]
        for variant in dict.fromkeys(r["variant"] for r in mine):
            cells = []
            for mode in modes:
                hit = [r for r in mine if r["variant"] == variant and r["mode"] == mode]
                cells.append("" if not hit else _f(hit[0]["ms"]) if "ms" in hit[0] else hit[0]["error"][:80])
            lines.append(f"| {model} | {variant} | " + " | ".join(cells) + " |")
    return lines


def job_lines(data: dict[str, Any]) -> list[str]:
    """``## Jobs``: each job's status and time (a job that did not finish says why)."""
    lines = ["", "## Jobs", "", "| job | status | s | rows |", "|---|---|---|---|"]
    for j in data.get("jobs", []):
        lines.append(f"| {j['job']} | {j['status']} | {j['seconds']:.0f} | {j['rows']} |")
    return lines
