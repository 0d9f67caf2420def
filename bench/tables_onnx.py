"""The "ONNX: full outputs and loadability" section of ``bench/RESULTS.md``.

One row per ONNX file a tool wrote (or failed to write) for a model: whether ONNX Runtime's CPU provider
accepts it, measured in the run by creating an ``InferenceSession`` (``bench.onnx_compare.load_in_ort``),
with the refusal text, or the SQNR of its first output when it loads and runs.
"""

from __future__ import annotations

from typing import Any

from bench.jobs import AMPLITE_JOBS


def loads_cell(sub: dict[str, Any] | None) -> str:
    """``yes`` / ``no`` from a run's ``ort_loads``; ``–`` when no session was tried (no file, old record)."""
    if not sub or "ort_loads" not in sub:
        return "–"
    return "yes" if sub["ort_loads"] else "no"


def _files(m: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None, str | None]]:
    """(file, its record, why there is no file) for onnxconverter-common and each amplite fp16 job run."""
    onnx = m["jobs"].get("onnx")
    out: list[tuple[str, dict[str, Any] | None, str | None]] = []
    if onnx is not None:
        if onnx.get("status") not in (None, "ok") or "fp32" not in onnx:
            why = f"no file: onnxconverter-common converts torch.onnx's FP32 export, which failed ({onnx.get('error')})"
            out.append(("onnxconverter-common fp16 (keep_io_types=True)", None, why))
        else:
            occ = onnx.get("occ") or {}
            out.append(("onnxconverter-common fp16 (keep_io_types=True)", occ, occ.get("error")))
    for job in AMPLITE_JOBS:
        rec = m["jobs"].get(job)
        if rec is None:
            continue
        cfg = job.split(":", 1)[1]
        if rec.get("status") not in (None, "ok"):
            out.append((f"amplite {cfg}", None, f"no file: conversion failed ({rec.get('error')})"))
            continue
        sub = rec.get("onnx") or {}
        out.append((f"amplite {cfg}", sub, sub.get("error")))
        if "occ_same" in rec:
            same = rec["occ_same"]
            out.append((f"onnxconverter-common fp16, FP32 ops of amplite {cfg}", same, same.get("error")))
    return out


def loadability_rows(models: dict[str, Any]) -> list[list[Any]]:
    """Table rows: model, file, loads in ONNX Runtime, ONNX Runtime's refusal or the first output's SQNR."""
    rows = []
    for name, m in models.items():
        for tool, sub, why in _files(m):
            if why:
                rows.append([name, tool, "–" if sub is None or "ort_loads" not in sub else loads_cell(sub), why])
                continue
            assert sub is not None
            if "ort_error" in sub:
                detail = ("refused: " if not sub.get("ort_loads") else "loads, run failed: ") + sub["ort_error"]
            else:
                acc = sub.get("accuracy") or {}
                detail = f"runs; first output SQNR {acc.get('sqnr_db', float('nan')):.1f} dB"
            rows.append([name, tool, loads_cell(sub), detail])
    return rows


def _provenance(extra: dict[str, Any]) -> str:
    meta = extra.get("meta") or {}
    wall = meta.get("wall_s")
    return (f"From a separate run, newer or of models this run did not run (`bench/{extra.get('source', '?')}`, "
            f"{meta.get('date', 'date not recorded')}, `{meta.get('command', '?')}`"
            + (f", {wall / 60:.1f} min" if isinstance(wall, (int, float)) else "")
            + f", source {meta.get('revision', 'unknown')}):")


def loadability(models: dict[str, Any], extra: dict[str, Any] | None = None) -> list[str]:
    """The section, or nothing when no model has an ONNX record.

    ``extra``: a separate run's results (``bench.sections.supplement``) whose rows follow, with its provenance;
    they replace this run's rows of the same models.
    """
    from bench.tables import ONNX_HEAD, onnx_rows, table

    head = ["model", "file", "loads in ONNX Runtime", "ONNX Runtime"]
    newer = extra["models"] if extra else {}
    rows = loadability_rows({k: v for k, v in models.items() if k not in newer})
    more = loadability_rows(newer)
    if not rows and not more:
        return []
    out = ["## ONNX: full outputs and loadability", "",
           "Whether ONNX Runtime (CPU provider) loads each file, measured in the same run by creating an "
           "`InferenceSession`; `bert-full` and `vit-full` return every output of BertModel / ViTModel "
           "(`last_hidden_state` is also read by the pooler inside the graph). onnxconverter-common runs on "
           "torch.onnx's FP32 dynamo export; where that export fails there is no file to convert.", ""]
    if rows:
        out += table(head, rows)
    if more:
        assert extra is not None
        out += [_provenance(extra), "", *table(head, more),
                "Cast nodes, size, checker and SQNR of that run's files (its rows of the ONNX table):", "",
                *table(ONNX_HEAD, onnx_rows(newer))]
    return out
