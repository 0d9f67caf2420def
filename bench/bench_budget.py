"""Accuracy-budget search, amplite vs onnxconverter-common, on the same models, inputs and tolerance.

Usage: ``python bench/bench_budget.py [--quick] [--models transformer,cnn,mlp] [--margin 3] [--repeat 1]
[--threads N] [--no-occ-ref] [--json OUT]``

Per fixture (fp16, FP32 graph inputs and outputs for both tools):

* **tolerance**: ``sqnr >= T`` on every output, ``T`` = ``margin`` dB (default 3) above the SQNR of amplite's
  rule-based O2 plan, so amplite has to search; the same ``T`` for occ.
* **amplite**: ``amplite.convert(model, inputs, level="O2", tolerance=sqnr>=T, fallback_search=True)``,
  timed from the ``nn.Module`` (its own export included). Judged in torch (its verification).
* **occ**: ``auto_convert_mixed_precision(fp32_onnx, feed, validate_fn=sqnr>=T, keep_io_types=True)`` on the
  ``torch.onnx.export(model, args, dynamo=True)`` FP32 export (export time reported apart, not in the wall
  time). Judged in ONNX Runtime's CPU provider (its hard-coded runtime); trials are ``validate_fn`` calls
  (one of them compares the FP32 model with itself, one re-validates the final model).
* **FP32 nodes**: nodes of each tool's final ONNX model computing in FP32 (``bench_onnx.fp32_nodes``; amplite's
  result is saved with ``save_onnx``), so both are counted on the same kind of graph. **moved**: nodes the
  search itself put in FP32 (amplite's ``budget.moved_to_fp32``; occ's final ``node_block_list``).
* **Judges**: each tool's own verdict (``met``, ``SQNR own``), then both final ONNX models against the torch
  FP32 output in two common runtimes: ONNX Runtime's CPU provider (``SQNR ORT CPU``), which computes most
  fp16 ops in FP32 (docs/onnx.md) and so hides fp16 arithmetic error, and ``onnx.reference``
  (``SQNR onnx-ref``), which computes every op in its tensor's dtype, as the ONNX specification defines it
  (within ~3 dB of torch on these models). ``met (onnx-ref)`` is the like-for-like verdict.
* **occ+ref** (``--no-occ-ref`` skips it): occ's search with its candidates run in ``onnx.reference`` instead
  of ORT CPU: not occ as shipped, but its search judged in fp16 arithmetic like amplite's. The FP32-node
  target ("amplite keeps no more") is judged against the first of occ / occ+ref that meets the tolerance in
  ``onnx-ref``; the wall-time target (amplite at most a fifth of occ's time) against occ as shipped.
* **occ ceiling**: occ's model with *every* node blocked, in ORT: ``node_block_list`` keeps nodes in FP32
  but still stores their weights in fp16 (and rounds ``keep_io_types`` inputs), so no search can go above it.

A warm-up conversion runs first, so no tool pays torch's one-time start-up costs in its wall time. Wall times
are the fastest of ``--repeat`` runs: on a loaded machine torch's OpenMP threads oversubscribe the cores and
amplite's times swing several-fold (occ's per-trial work is ONNX Runtime's and barely moves); ``--threads 1``
steadies them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import sys
import tempfile
import types
import warnings
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import onnx
import torch

import amplite
from amplite.onnx.export import save_onnx
from amplite.verify.compare import parse_tolerance
from bench.bench_onnx import fp32_nodes
from fixtures.zoo import make

MODELS = ("transformer", "cnn", "mlp")
QUICK = ("mlp",)
#: (row key, column header) of the printed table, in order
TABLE = (("model", "model"), ("tol_db", "tol dB"), ("tool", "tool"), ("fp32_nodes", "FP32 nodes"), ("moved", "moved"),
         ("trials", "trials"), ("wall_s", "wall s"), ("met", "met (own judge)"), ("sqnr_own", "SQNR own"),
         ("sqnr_ort", "SQNR ORT CPU"), ("sqnr_ref", "SQNR onnx-ref"), ("met_ref", "met (onnx-ref)"))  # fmt: skip
COLUMNS = tuple(header for _, header in TABLE)


def sqnr_db(ref: Any, out: Any) -> float:
    """``20·log10(‖ref‖ / ‖ref − out‖)`` in float64; inf when equal, nan when ``out`` is not finite."""
    r, o = np.asarray(ref, dtype=np.float64), np.asarray(out, dtype=np.float64)
    if not np.isfinite(o).all():
        return math.nan
    err = float(np.linalg.norm(r - o))
    return math.inf if err == 0 else 20 * math.log10(float(np.linalg.norm(r)) / err)


def worst_sqnr(refs: list[Any], outs: list[Any]) -> float:
    """The lowest SQNR over the outputs (nan, which fails every ``>=``, when any output is not finite)."""
    values = [sqnr_db(r, o) for r, o in zip(refs, outs, strict=True)]
    return math.nan if any(math.isnan(v) for v in values) else min(values)


def ort_outputs(model: onnx.ModelProto | Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of an ONNX model in ONNX Runtime's CPU provider."""
    import onnxruntime as ort

    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, feed)


def judge(path: Path, feed: dict[str, np.ndarray], ref: list[np.ndarray], tol_db: float) -> dict[str, Any]:
    """A final ONNX model in both common runtimes: FP32 nodes, worst SQNR in ORT CPU and in onnx.reference."""
    from onnx.reference import ReferenceEvaluator

    model = onnx.load(str(path))
    with _quiet():
        exact = worst_sqnr(ref, ReferenceEvaluator(model).run(None, feed))
    return {"fp32_nodes": len(fp32_nodes(path)), "sqnr_ort": worst_sqnr(ref, ort_outputs(path, feed)),
            "sqnr_ref": exact, "met_ref": exact >= tol_db}  # fmt: skip


@contextlib.contextmanager
def _quiet() -> Any:
    """occ prints every trial and the exporter logs notices about optional packages: keep the table readable."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def export_fp32(model: torch.nn.Module, args: tuple[Any, ...]) -> onnx.ModelProto:
    """The FP32 ONNX model occ starts from: ``torch.onnx.export(model, args, dynamo=True)``."""
    with _quiet():
        return torch.onnx.export(model, args, dynamo=True, verbose=False).model_proto


def run_amplite(model: torch.nn.Module, inputs: Any, tol_db: float, feed: dict, ref: list, tmp: Path,
                repeat: int = 1) -> dict:  # fmt: skip
    """amplite's search (timed: the fastest of ``repeat`` runs), its final model saved as ONNX and judged."""
    tol = parse_tolerance([f"sqnr>={tol_db:.2f}"], "fp16")
    wall = math.inf
    for _ in range(repeat):  # the search is deterministic: every run gives the same plan
        start = perf_counter()
        result = amplite.convert(model, inputs, level="O2", tolerance=tol, fallback_search=True)
        wall = min(wall, perf_counter() - start)
    budget = result.report.data.get("budget", {})
    path = tmp / "amplite.onnx"
    with _quiet():
        save_onnx(result.program, path)
    own = min(float(o["sqnr_db"]) for o in result.report.outputs)
    return {"tool": "amplite", "moved": len(budget.get("moved_to_fp32", [])), "trials": budget.get("trials", 0),
            "wall_s": wall, "search_s": budget.get("seconds"), "met": bool(result.passed), "sqnr_own": own,
            "message": budget.get("message", "")} | judge(path, feed, ref, tol_db)  # fmt: skip


def run_occ(fp32: onnx.ModelProto, feed: dict, tol_db: float, ref: list, tmp: Path, repeat: int = 1,
            runtime: str = "ort") -> dict:  # fmt: skip
    """onnxconverter-common's search (timed: the fastest of ``repeat`` runs), ``validate_fn`` counting its calls.

    ``runtime="ref"`` swaps the runtime occ runs its candidates in (ORT CPU, hard-coded) for ``onnx.reference``:
    not occ as shipped, but its search judged in fp16 arithmetic, the like-for-like counterpart of amplite's.
    """
    from onnx.reference import ReferenceEvaluator
    from onnxconverter_common import auto_mixed_precision as amp
    from onnxconverter_common import float16

    calls: list[float] = []
    blocked: list[list[str]] = []

    def validate(res0: list[np.ndarray], res1: list[np.ndarray]) -> bool:
        calls.append(worst_sqnr(res0, res1))
        return calls[-1] >= tol_db

    def recording(model: Any, **kwargs: Any) -> Any:  # measurement only: the conversion itself is unchanged
        blocked.append(list(kwargs.get("node_block_list") or []))
        return float16.convert_float_to_float16(model, **kwargs)

    ort_values = amp.get_tensor_values_using_ort

    def values(model: onnx.ModelProto, feed: dict, output_names: Any = None, sess_options: Any = None) -> Any:
        if output_names is not None:  # occ's dtype discovery on the FP32 model: keep it as it is
            return ort_values(model, feed, output_names, sess_options)
        return ReferenceEvaluator(model).run(None, feed)

    row: dict[str, Any] = {"tool": "occ" if runtime == "ort" else "occ+ref", "wall_s": math.inf}
    original, amp.float16 = amp.float16, types.SimpleNamespace(convert_float_to_float16=recording)
    if runtime == "ref":
        amp.get_tensor_values_using_ort = values
    try:
        for _ in range(repeat):  # deterministic too: keep the last run's counts
            calls.clear()
            blocked.clear()
            start = perf_counter()
            try:
                with _quiet():
                    low = amp.auto_convert_mixed_precision(fp32, feed, validate_fn=validate, keep_io_types=True)
                row["met"] = True  # it raises unless the final model passes validate_fn
            except Exception as exc:
                low, row["met"] = None, False
                row["message"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            row["wall_s"] = min(row["wall_s"], perf_counter() - start)
    finally:
        amp.float16, amp.get_tensor_values_using_ort = original, ort_values
    row |= {"trials": len(calls), "moved": len(blocked[-1]) if blocked else None}
    if low is not None:
        path = tmp / f"{row['tool']}.onnx"
        onnx.save(low, path)
        row |= {"sqnr_own": calls[-1]} | judge(path, feed, ref, tol_db)
    return row


def measure(name: str, margin: float, tmp: Path, repeat: int = 1, with_ref: bool = True) -> list[dict[str, Any]]:
    """Both tools on fixture ``name`` with one tolerance; one row per tool (and occ+ref with ``with_ref``)."""
    from onnxconverter_common import float16

    model, inputs = make(name)
    args, kwargs = inputs
    if kwargs:
        raise ValueError(f"fixture {name} takes keyword inputs; this bench feeds positional ones only")
    with torch.no_grad():
        out = model(*args)
    ref = [t.numpy() for t in (out if isinstance(out, (tuple, list)) else (out,))]
    start = perf_counter()
    fp32 = export_fp32(model, args)
    export_s = perf_counter() - start
    feed = {i.name: a.numpy() for i, a in zip(fp32.graph.input, args, strict=True)}
    sub = tmp / name
    sub.mkdir()
    plan = amplite.convert(model, inputs, level="O2")
    plan_db = min(float(o["sqnr_db"]) for o in plan.report.outputs)
    with _quiet():
        save_onnx(plan.program, sub / "plan.onnx")
    tol_db = round(plan_db + margin, 2)
    with _quiet():
        all_low = float16.convert_float_to_float16(fp32, keep_io_types=True)
        blocked = [n.name for n in fp32.graph.node]
        all_blocked = float16.convert_float_to_float16(fp32, keep_io_types=True, node_block_list=blocked)
    common = {"model": name, "tol_db": tol_db, "plan_sqnr": plan_db, "export_s": export_s,
              "plan_fp32_nodes": len(fp32_nodes(sub / "plan.onnx")),
              "occ_fp16_sqnr": worst_sqnr(ref, ort_outputs(all_low, feed)),
              "occ_ceiling_sqnr": worst_sqnr(ref, ort_outputs(all_blocked, feed))}  # fmt: skip
    rows = [run_amplite(model, inputs, tol_db, feed, ref, sub, repeat), run_occ(fp32, feed, tol_db, ref, sub, repeat)]
    if with_ref:
        rows.append(run_occ(fp32, feed, tol_db, ref, sub, repeat, runtime="ref"))
    return [common | r for r in rows]


def _cell(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return format(v, spec) if math.isfinite(v) else str(v)
    return str(v)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The Markdown table, then one line per model: the reference points, the targets and any failure."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k, _ in TABLE) + " |" for r in rows]
    lines.append("")
    for name in dict.fromkeys(r["model"] for r in rows):
        by_tool = {r["tool"]: r for r in rows if r["model"] == name}
        ours, occ = by_tool["amplite"], by_tool["occ"]
        ratio = ours["wall_s"] / occ["wall_s"] if occ["wall_s"] else math.inf
        # fewer FP32 nodes only counts against an occ model that meets the tolerance in fp16 arithmetic
        rival = next((by_tool[t] for t in ("occ", "occ+ref") if by_tool.get(t, {}).get("met_ref")), None)
        if rival is None:
            nodes = "n/a, no occ model meets the tolerance in onnx-ref"
        else:
            verdict = "met" if ours.get("fp32_nodes", math.inf) <= rival["fp32_nodes"] else "NOT met"
            nodes = f"{verdict} against {rival['tool']}'s {rival['fp32_nodes']}"
        lines.append(
            f"- {name}: amplite plan {ours['plan_sqnr']:.2f} dB (torch), {ours['plan_fp32_nodes']} FP32 nodes; "
            f"occ all-fp16 {ours['occ_fp16_sqnr']:.2f} dB, "
            f"occ ceiling {ours['occ_ceiling_sqnr']:.2f} dB (ORT CPU); "
            f"wall amplite/occ = {ratio:.2f} (target <= 0.2: {'met' if ratio <= 0.2 else 'NOT met'}); "
            f"FP32 nodes amplite {_cell(ours.get('fp32_nodes'))} (target <=: {nodes}); "
            f"FP32 ONNX export for occ {ours['export_s']:.2f} s"
            + "".join(f"; {r['tool']}: {r['message']}" for r in by_tool.values() if r.get("message"))
        )
    return lines


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the comparison, print the table, return the rows."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"one fixture ({', '.join(QUICK)})")
    ap.add_argument("--models", default=",".join(MODELS), help="fixtures from fixtures/zoo.py")
    ap.add_argument("--margin", type=float, default=3.0, help="dB above amplite's rule-based plan")
    ap.add_argument("--repeat", type=int, default=1, help="time each search N times, report the fastest")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's); 1 steadies a busy machine")
    ap.add_argument("--no-occ-ref", action="store_true", help="skip occ's search judged by onnx.reference")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    ns = ap.parse_args(argv)
    for name in ("torch.onnx", "onnxscript", "onnx_ir"):
        logging.getLogger(name).setLevel(logging.ERROR)
    models = QUICK if ns.quick else tuple(ns.models.split(","))
    if ns.threads:
        torch.set_num_threads(ns.threads)
    warm_model, warm_inputs = make("mlp")
    amplite.convert(warm_model, warm_inputs, level="O2")  # torch's one-time costs, outside every timing
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for name in models for r in measure(name, ns.margin, Path(tmp), ns.repeat, not ns.no_occ_ref)]
    print("\n".join(table(rows)))
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=2, default=str) + "\n")
    return rows


if __name__ == "__main__":
    main()
