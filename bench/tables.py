"""``bench/RESULTS.md`` from the harness's results: one table per section, then the targets.

A job that failed keeps its row in every table it belongs to, with its error text in place of numbers.
"""

from __future__ import annotations

import math
from typing import Any

from bench.jobs import AMPLITE_JOBS
from bench.onnx_compare import ANSI
from bench.tables_cost import cost_section
from bench.tables_onnx import loadability, loads_cell
from bench.tables_targets import cast_targets, failures, targets_section

CONFIGS = [j.split(":", 1)[1] for j in AMPLITE_JOBS]  # "fp16:O1", ...


def esc(text: Any) -> str:
    """A table cell: pipes escaped, one line."""
    return " ".join(ANSI.sub("", str(text)).replace("|", "\\|").split())


def num(v: Any, spec: str = ".3g") -> str:
    """A number for a cell; ``–`` when absent, ``inf``/``nan`` spelled out."""
    if v is None:
        return "–"
    if isinstance(v, str):
        return esc(v)
    if isinstance(v, float) and not math.isfinite(v):
        return "inf" if v > 0 else ("-inf" if v < 0 else "nan")
    return format(v, spec)


def failed(rec: dict[str, Any] | None) -> str | None:
    """The error text of a record (``skipped``/``timeout`` included), or None when it has numbers."""
    if rec is None:
        return "not run"
    if rec.get("status") not in (None, "ok"):
        kind = {"amplite": "amplite: ", "internal": "amplite internal error: "}.get(rec.get("error_kind", ""), "")
        return f"{rec.get('status')}: {kind}{rec.get('error', '')}"
    return rec.get("error")


def row(cells: list[Any]) -> str:
    return "| " + " | ".join(esc(c) for c in cells) + " |"


def table(head: list[str], rows: list[list[Any]]) -> list[str]:
    return [row(head), "|" + "---|" * len(head), *(row(r) for r in rows), ""]


def ms(rec: dict[str, Any] | None) -> str:
    if not rec or "error" in rec or "median_s" not in rec:
        return esc(rec["error"]) if rec and "error" in rec else "–"
    return num(rec["median_s"] * 1e3, ".4g")


def ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _acc_cells(acc: dict[str, Any] | None) -> list[str]:
    if not acc:
        return ["–"] * 4
    if "error" in acc and "sqnr_db" not in acc:
        return [esc(acc["error"]), "–", "–", "–"]
    return [num(acc.get("sqnr_db"), ".1f"), num(acc.get("max_abs")), num(acc.get("top1"), ".4f"),
            str(acc.get("nonfinite"))]


def _load_line(meta: dict[str, Any]) -> str:
    load = meta.get("load") or {}
    if not load.get("before"):
        return "Load average: not recorded."
    return (f"Load average (1/5/15 min) at the start {load['before']}, at the end {load['after']}: this machine is "
            "shared, and timings move with its load; ratios are taken within one process, back to back.")


#: The ``## `` headings render() writes (any other section of a previous RESULTS.md is kept verbatim).
GENERATED = {"Models and runs", "amplite conversion cost", "amplite graph facts and size",
             "Estimated GPU time (roofline estimate, not a measurement)", "Casts executed per forward pass",
             "Accuracy against FP32 (same inputs)", "ONNX: Cast nodes, size, ONNX Runtime",
             "ONNX: full outputs and loadability", "CPU latency (informative)", "CUDA latency",
             "Targets (ratios, same run)", "Failures", "Training"}


def render(results: dict[str, Any], kept: list[str] | None = None, extra: dict[str, Any] | None = None) -> str:
    """The whole RESULTS.md document.

    Args:
        results: The harness's results (``meta``, ``models``).
        kept: Sections of the previous RESULTS.md to carry over verbatim (``bench.sections.preserved``).
        extra: A separate run's results for models this one did not run (``bench.sections.supplement``):
            their ONNX loadability rows, with that run's provenance.
    """
    meta, models = results["meta"], results["models"]
    out = ["# amplite benchmark: real models side by side", "",
           f"Run {meta['date']} on {meta['machine']}; `{meta['command']}` ({meta['wall_s'] / 60:.1f} min), "
           f"source {meta.get('revision', 'unknown')}.", "",
           _load_line(meta), "", *(f"Note: {n}\n" for n in meta.get("notes", [])),
           "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".", "",
           "Random weights from the published configurations (nothing downloaded); see "
           "[docs/benchmarks.md](../docs/benchmarks.md) for what each column measures and how.", ""]
    out += ["## Models and runs", ""]
    rows = []
    for name, m in models.items():
        base = m["jobs"].get("base") or {}
        statuses = ", ".join(f"{j}: {r.get('status')}" for j, r in m["jobs"].items() if r.get("status") != "ok")
        rows.append([name, m["description"], base.get("attention", "–"), num(ratio(base.get("params"), 1e6), ".1f"),
                     base.get("torch_export_error") or num(base.get("torch_export_s"), ".2f"),
                     num(ratio(base.get("fp32_pt2_bytes"), 2**20), ".1f"),
                     m.get("skip_reason") or statuses or "all jobs ok"])
    out += table(["model", "what", "attention", "params (M)", "torch.export s", "FP32 .pt2 MiB", "runs"], rows)
    out += cost_section(models) + _graph(models) + _estimates(models) + _casts(models)
    out += _accuracy(models) + _onnx(models)
    out += loadability(models, extra) + _latency(models)
    out += _cuda(models, meta) + targets_section(models) + failures(models)
    out += _training()
    for text in kept or []:
        out += ["", text]
    return "\n".join(out)


def _training() -> list[str]:
    """The "Training" section bench/bench_train.py saved (its own run; kept when the harness rewrites)."""
    from pathlib import Path

    saved = Path(__file__).with_name("results-train.md")
    return ["", *saved.read_text().splitlines()] if saved.exists() else []


def _ran(m: dict[str, Any], job: str) -> bool:
    """Whether ``job`` was scheduled for a model (a model the run did not reach counts as scheduled)."""
    return not m["jobs"] or job in m["jobs"]


def _amp(models: dict[str, Any]):
    for name, m in models.items():
        for cfg in CONFIGS:
            if _ran(m, "amplite:" + cfg):
                yield name, cfg, m["jobs"].get("amplite:" + cfg)


def _graph(models: dict[str, Any]) -> list[str]:
    rows = []
    for name, cfg, rec in _amp(models):
        if (err := failed(rec)) is not None:
            rows.append([name, cfg, err] + ["–"] * 6)
            continue
        fp32 = models[name]["jobs"].get("base", {}).get("fp32_pt2_bytes")
        g = rec["graph"]
        rt = rec.get("runtime_casts", {})
        rows.append([name, cfg, " ".join(f"{k}:{v}" for k, v in g["nodes_by_dtype"].items()), g["casts"],
                     rt.get("casts", rt.get("error", "–")), num(ratio(rec["pt2_bytes"], 2**20), ".1f"),
                     num(ratio(rec["pt2_bytes"], fp32), ".3f"), num(g["low_precision_flop_share"], ".3f"),
                     {True: "passed", False: "FAILED", None: "–"}[rec.get("verified")]])
    head = ["model", "config", "nodes by compute dtype", "casts in graph", "casts per forward", ".pt2 MiB",
            "size / FP32 .pt2", "low-precision FLOP share", "amplite verification"]
    return ["## amplite graph facts and size", "", *table(head, rows)]


def _estimates(models: dict[str, Any]) -> list[str]:
    rows = []
    for name, cfg, rec in _amp(models):
        est = (rec or {}).get("estimate")
        if failed(rec) is not None or not est:
            continue
        sec = est["seconds"]
        rows.append([name, cfg, est["device"], num(sec["fp32"] * 1e3, ".3g"), num(sec["autocast"] * 1e3, ".3g"),
                     num(sec["amplite"] * 1e3, ".3g"), num(est["ratio_vs_fp32"], ".3f"),
                     num(est["ratio_vs_autocast"], ".3f"), num(est["cast_share"], ".2f"),
                     num(est["fp32_island_share"], ".2f")])
    if not rows:
        return []
    head = ["model", "config", "GPU profile", "FP32 ms", "autocast ms", "amplite ms", "amplite / FP32",
            "amplite / autocast", "cast share", "FP32-island share"]
    return ["## Estimated GPU time (roofline estimate, not a measurement)", "",
            "The report's per-node roofline (docs/estimates.md) on the default profile, example batch; "
            "validated against measurements only where the GPU suite ran.", "", *table(head, rows)]


def _casts(models: dict[str, Any]) -> list[str]:
    rows = []
    for name, m in models.items():
        base = m["jobs"].get("base")
        if not _ran(m, "base"):
            continue
        for dt in ("fp16", "bf16"):
            ac = (base or {}).get("autocast", {}).get(dt)
            auto = ac.get("casts") if ac and "casts" in ac else None
            cells = [name, dt, (base or {}).get("fp32", {}).get("casts", "–"),
                     auto if auto is not None else (failed(base) or (ac or {}).get("error", "–"))]
            back = auto + ac["low_outputs"] if auto is not None and "low_outputs" in (ac or {}) else None
            for lvl in ("O1", "O2"):
                rec = m["jobs"].get(f"amplite:{dt}:{lvl}")
                n = (rec or {}).get("runtime_casts", {}).get("casts") if failed(rec) is None else None
                cells += [n if n is not None else failed(rec) or "–", num(ratio(n, auto), ".2f")]
            cells.append(num(ratio(cells[4] if isinstance(cells[4], int) else None, back), ".2f"))
            rows.append(cells)
    head = ["model", "dtype", "FP32 model", "torch.autocast", "amplite O1", "O1 / autocast", "amplite O2",
            "O2 / autocast", "O1 / (autocast + FP32 outputs)"]
    return ["## Casts executed per forward pass", "",
            "Floating-point dtype conversions executed in one forward, counted with a `TorchDispatchMode` (see "
            "`bench/autocast_count.py`): `torch.autocast` on CPU, and amplite's converted module. The FP32 column "
            "is the model's own conversions. Note: autocast leaves its outputs in the low dtype (no cast back), "
            "amplite keeps the FP32 output dtype. The last column (informative, not a target) adds to autocast's count "
            "one cast per floating output it leaves low, i.e. what the same FP32-output contract would cost it.", "",
            *table(head, rows), *cast_targets(models)]


def _variants(m: dict[str, Any], dt: str) -> list[tuple[str, Any]]:
    base = m["jobs"].get("base") or {}
    ac = base.get("autocast", {}).get(dt)
    out = [("torch.autocast", ac if failed(base) is None else {"error": failed(base)})] if _ran(m, "base") else []
    for lvl in ("O1", "O2"):
        if not _ran(m, f"amplite:{dt}:{lvl}"):
            continue
        rec = m["jobs"].get(f"amplite:{dt}:{lvl}")
        out.append((f"amplite {lvl}", rec.get("accuracy") if failed(rec) is None else {"error": failed(rec)}))
    return out


def _accuracy(models: dict[str, Any]) -> list[str]:
    rows = []
    for name, m in models.items():
        for dt in ("fp16", "bf16"):
            for tool, rec in _variants(m, dt):
                acc = rec.get("accuracy", rec) if rec else None
                rows.append([name, dt, tool, *_acc_cells(acc)])
        onnx = m["jobs"].get("onnx")
        for tool, key in (("ORT FP32 export", "fp32"), ("ORT onnxconverter-common fp16", "occ"))[:2 * _ran(m, "onnx")]:
            sub = (onnx or {}).get(key) if failed(onnx) is None else {"error": failed(onnx)}
            rows.append([name, "fp32" if key == "fp32" else "fp16", tool,
                         *_acc_cells(_ort_acc(sub))])
        for cfg in (c for c in CONFIGS if _ran(m, "amplite:" + c)):
            rec = m["jobs"].get("amplite:" + cfg)
            sub = rec.get("onnx") if failed(rec) is None else {"error": failed(rec)}
            rows.append([name, cfg.split(":")[0], f"ORT amplite {cfg.split(':')[1]}", *_acc_cells(_ort_acc(sub))])
            if cfg.startswith("fp16"):
                same = (_same(rec) or {"error": "not run"}) if failed(rec) is None else sub
                rows.append([name, "fp16", f"ORT onnxconverter-common, FP32 ops of amplite {cfg.split(':')[1]}",
                             *_acc_cells(_ort_acc(same))])
    return ["## Accuracy against FP32 (same inputs)", "",
            "First output (the logits) against the FP32 model's: SQNR = 20·log10(‖ref‖/‖ref−out‖) in dB, max abs "
            "error, top-1 agreement over every position; NaN/Inf counted over all outputs. ORT rows run the ONNX "
            "file in ONNX Runtime's CPU provider, scored against the PyTorch FP32 output.", "",
            *table(["model", "dtype", "tool", "SQNR dB", "max abs", "top-1", "NaN/Inf"], rows)]


def _same(rec: dict[str, Any] | None) -> dict[str, Any] | None:
    """The onnxconverter-common run with amplite's FP32 op types, or why it did not run."""
    if rec and "occ_same" not in rec and "error" in (rec.get("onnx") or {}):
        return {"error": "not run: amplite's ONNX export failed"}
    return (rec or {}).get("occ_same")


def _ort_acc(sub: dict[str, Any] | None) -> dict[str, Any] | None:
    if sub is None:
        return None
    if "error" in sub:
        return {"error": sub["error"]}
    if "ort_error" in sub:
        return {"error": "ORT refused: " + sub["ort_error"]}
    return sub.get("accuracy")


ONNX_HEAD = ["model", "file", "Cast nodes", "MiB", "size / FP32", "onnx.checker", "ONNX Runtime (CPU)",
             "loads in ONNX Runtime", "SQNR dB"]


def _onnx(models: dict[str, Any]) -> list[str]:
    return ["## ONNX: Cast nodes, size, ONNX Runtime", "", ONNX_INTRO, "", *table(ONNX_HEAD, onnx_rows(models))]


def onnx_rows(models: dict[str, Any]) -> list[list[Any]]:
    """One row per ONNX file (or the error in its place) of every model."""
    rows = []
    for name, m in models.items():
        onnx = m["jobs"].get("onnx")
        fp32_bytes = (onnx or {}).get("fp32", {}).get("bytes")
        subs = [("FP32 dynamo export", (onnx or {}).get("fp32"), onnx),
                ("onnxconverter-common fp16", (onnx or {}).get("occ"), onnx)] if _ran(m, "onnx") else []
        for cfg in (c for c in CONFIGS if _ran(m, "amplite:" + c)):
            rec = m["jobs"].get("amplite:" + cfg)
            subs.append((f"amplite {cfg}", (rec or {}).get("onnx"), rec))
            if cfg.startswith("fp16"):
                subs.append((f"onnxconverter-common fp16, FP32 ops of amplite {cfg}", _same(rec), rec))
        for tool, sub, rec in subs:
            err = failed(rec) or (sub or {}).get("error") or (None if sub else "not run")
            if err:
                rows.append([name, tool, err, "–", "–", "–", "–", "–", "–"])
                continue
            acc = _ort_acc(sub) or {}
            rows.append([name, tool, sub["casts"], num(sub["bytes"] / 2**20, ".1f"),
                         num(ratio(sub["bytes"], fp32_bytes), ".3f"), sub.get("checker", "–"),
                         sub.get("ort_error", "loads and runs"), loads_cell(sub),
                         num(acc.get("sqnr_db"), ".1f") if "sqnr_db" in acc else "–"])
    return rows


ONNX_INTRO = (
    "Cast nodes in the main graph (same count for every file). onnxconverter-common fp16: "
    "`convert_float_to_float16(keep_io_types=True)` on the FP32 dynamo export, its defaults (norms, "
    "softmax and reductions in fp16). \"FP32 ops of amplite fp16:Ox\": the same, with `op_block_list` "
    "adding the op types that amplite's file of that configuration keeps in FP32, among those of its FP32 "
    "groups (Softmax, reductions, norms, Exp/Log/Pow/Sqrt/Reciprocal, Resize, losses; not elementwise "
    "arithmetic, which amplite keeps in FP32 node by node): the same FP32 islands by op type. amplite: "
    "`amplite.onnx.export.save_onnx` of the converted program (its pre-ONNX rewrite, "
    "`amplite/onnx/prepare.py`, exports models torch.onnx's FP32 export fails on: the FP32 rows then carry "
    "torch.onnx's error). SQNR: ONNX Runtime's first output against PyTorch FP32."
)


def _latency(models: dict[str, Any]) -> list[str]:
    rows = []
    for name, m in models.items():
        if not _ran(m, "base"):
            continue  # the full-output variants: ONNX jobs only
        base = m["jobs"].get("base") or {}
        onnx = m["jobs"].get("onnx") or {}
        cells = [name, ms(base.get("fp32", {}).get("latency")) if failed(base) is None else failed(base)]
        cells += [ms(base.get("autocast", {}).get(dt, {}).get("latency")) for dt in ("fp16", "bf16")]
        cells += [ms(rec.get("latency")) if failed(rec) is None else "error" for _, _, rec in _amp({name: m})]
        cells += [ms(onnx.get(k, {}).get("latency")) for k in ("fp32", "occ")]
        for lvl in ("O1", "O2"):
            cells.append(ms((m["jobs"].get(f"amplite:fp16:{lvl}") or {}).get("onnx", {}).get("latency")))
        rows.append(cells)
    head = ["model", "FP32", "autocast fp16", "autocast bf16", *(f"amplite {c}" for c in CONFIGS),
            "ORT FP32", "ORT occ fp16", "ORT amplite fp16:O1", "ORT amplite fp16:O2"]
    return ["## CPU latency (informative)", "",
            "Median ms per forward after one warm-up. This CPU has no native fp16/bf16 arithmetic, so low-precision "
            "runs are not expected to be faster here; the GPU section is the one that matters for speed.", "",
            *table(head, rows)]


def _cuda(models: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    rows = []
    for name, m in models.items():
        c = (m["jobs"].get("base") or {}).get("cuda")
        if not c:
            continue
        cells = [name, num(c.get("fp32_ms"), ".3f"), num(c.get("autocast_fp16_ms"), ".3f"),
                 num(c.get("autocast_bf16_ms"), ".3f")]
        cells += [num(((rec or {}).get("cuda") or {}).get("ms"), ".3f") for _, _, rec in _amp({name: m})]
        rows.append(cells)
    if not rows:
        return ["## CUDA latency", "", f"Not measured: {meta.get('cuda') or 'no CUDA device on this machine'}.", ""]
    head = ["model", "FP32 ms", "autocast fp16", "autocast bf16", *(f"amplite {c}" for c in CONFIGS)]
    return ["## CUDA latency", "", "CUDA events, 10 warm-up calls, median of 50.", "", *table(head, rows)]
