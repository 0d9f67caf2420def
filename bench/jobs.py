"""The measurements of one (model, job), run in a fresh subprocess by ``bench/harness.py``.

Jobs: ``base`` (FP32 facts, ``torch.export`` time, ``torch.autocast`` casts/accuracy/latency), ``onnx``
(FP32 dynamo export, ONNX Runtime, onnxconverter-common fp16) and ``amplite:<fp16|bf16>:<O1|O2>``
(conversion cost, graph facts, casts per forward, accuracy, latency, amplite's ONNX output).
Every sub-measurement that fails records its error text instead of the numbers; the job goes on.
"""

from __future__ import annotations

import contextlib
import resource
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from torch.utils import _pytree as pytree

from bench import onnx_compare as oc
from bench.autocast_count import accuracy, count_casts, counted_run, cuda_latency, first_tensor, latency, run
from bench.corpus import CASES, Case, attention_of
from bench.cost import build_path, repeats_for
from bench.cost import measure as measure_cost

AMPLITE_JOBS = [f"amplite:{p}:{lvl}" for p in ("fp16", "bf16") for lvl in ("O1", "O2")]
JOBS = ["base", "onnx", *AMPLITE_JOBS]


def rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def attempt(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``, or ``{"error": "Type: message"}`` when it raises."""
    try:
        return fn()
    except Exception as exc:
        return {"error": oc.one_line(exc)}


def to_device(inputs: Any, device: str) -> Any:
    """Inputs (any pytree, caches included) moved to ``device``."""
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)


def _timed_export(model: torch.nn.Module, inputs: tuple[tuple, dict]) -> float:
    start = perf_counter()
    with oc.quiet():
        torch.export.export(model, inputs[0], inputs[1], strict=False)
    return perf_counter() - start


def _warm_up_export() -> None:
    """One export of a tiny model: the first export in a process pays torch's one-time costs."""
    _timed_export(torch.nn.Sequential(torch.nn.Linear(4, 4)).eval(), ((torch.randn(2, 4),), {}))


def base_job(case: Case, work: Path, budget: float) -> dict[str, Any]:
    """FP32 facts, the plain ``torch.export`` time, and ``torch.autocast`` (fp16, bf16) side by side."""
    model, inputs = case.build()
    ref = run(model, inputs)
    out: dict[str, Any] = {"baseline_rss_mb": rss_mb()}
    out["attention"] = attention_of(model) if case.attention != "-" else "-"
    out["params"] = sum(p.numel() for p in model.parameters())
    out["inputs"] = {k: list(v.shape) for k, v in zip(*_named_leaves(inputs), strict=True)}
    _warm_up_export()
    try:
        out["torch_export_s"] = _timed_export(model, inputs)
        with oc.quiet():
            torch.export.save(torch.export.export(model, inputs[0], inputs[1], strict=False), work / "fp32.pt2")
        out["fp32_pt2_bytes"] = (work / "fp32.pt2").stat().st_size
    except Exception as exc:  # the autocast columns do not need an export: they still run
        out["torch_export_error"] = oc.one_line(exc)
    out["fp32"] = {**count_casts(model, inputs), "latency": attempt(lambda: latency(lambda: run(model, inputs),
                                                                                   budget_s=budget))}
    out["autocast"] = {}
    for dt in ("fp16", "bf16"):
        def measure(dt: str = dt) -> dict[str, Any]:
            res, casts = counted_run(model, inputs, dt)
            dtype = str(first_tensor(res).dtype).removeprefix("torch.")
            # Floating outputs autocast leaves low: what amplite's FP32-output contract casts back.
            low_out = sum(1 for t in pytree.tree_leaves(res) if isinstance(t, torch.Tensor)
                          and t.dtype.is_floating_point and t.dtype != torch.float32)
            return {**casts, "output_dtype": dtype, "low_outputs": low_out,
                    "accuracy": accuracy(ref, res, logits=case.logits),
                    "latency": latency(lambda: run(model, inputs, dt), budget_s=budget)}

        out["autocast"][dt] = attempt(measure)
    if torch.cuda.is_available():
        out["cuda"] = attempt(lambda: _cuda_base(model, inputs))
    return out


def _named_leaves(inputs: tuple[tuple, dict]) -> tuple[list[str], list[torch.Tensor]]:
    flat, _ = pytree.tree_flatten_with_path(inputs)
    names = ["".join(str(k) for k in path[1:]).strip("[]'") for path, leaf in flat if isinstance(leaf, torch.Tensor)]
    return names, [leaf for _, leaf in flat if isinstance(leaf, torch.Tensor)]


def _cuda_base(model: torch.nn.Module, inputs: tuple[tuple, dict]) -> dict[str, Any]:
    gpu_model, gpu_inputs = model.to("cuda"), to_device(inputs, "cuda")
    res = {"fp32_ms": cuda_latency(lambda: run(gpu_model, gpu_inputs))["median_ms"]}
    for dt in ("fp16", "bf16"):
        res[f"autocast_{dt}_ms"] = cuda_latency(lambda dt=dt: run(gpu_model, gpu_inputs, dt, "cuda"))["median_ms"]
    model.to("cpu")
    return res


def amplite_job(case: Case, precision: str, level: str, work: Path, budget: float) -> dict[str, Any]:
    """One amplite conversion: cost, graph facts, casts per forward, accuracy, latency, ONNX output."""
    import amplite
    from amplite.errors import AmpliteError

    model, inputs = case.build()
    ref = run(model, inputs)
    out: dict[str, Any] = {"baseline_rss_mb": rss_mb()}
    _warm_up_export()
    plain = []
    with contextlib.suppress(Exception):  # a model torch.export refuses gets amplite's own message below
        plain.append(_timed_export(model, inputs))
    start = perf_counter()
    try:
        with oc.quiet():
            result = amplite.convert(model, inputs, precision=precision, level=level)
            result.save(work / "converted.pt2")
    except AmpliteError as exc:
        return out | {"error": str(exc), "error_kind": "amplite", "peak_rss_mb": rss_mb()}
    except Exception as exc:
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        return out | {"error": f"{oc.one_line(exc)} (at {Path(tb.filename).name}:{tb.lineno})",
                      "error_kind": "internal", "peak_rss_mb": rss_mb()}
    out["convert_wall_s"] = perf_counter() - start
    out["peak_rss_mb"] = rss_mb()
    data = result.report.data
    out["timings"] = data["timings"]
    out["build_path"] = build_path(data, data["timings"])
    # the verified conversion above was the warm-up: now the cost rounds (medians, same process)
    params = sum(p.numel() for p in model.parameters())
    out["cost"] = attempt(lambda: measure_cost(model, inputs, precision, level, work, repeats_for(params)))
    if "export_s" in out["cost"]:
        plain.append(out["cost"]["export_s"])
    out["torch_export_s"] = min(plain) if plain else None
    out["graph"] = {k: data["graph"]["after"][k] for k in ("nodes_by_dtype", "casts", "low_precision_flop_share")}
    out["weights_ratio"] = data["weights"]["ratio"]
    if data.get("estimate"):  # the report's roofline estimate (default profile H100): an estimate only
        est = data["estimate"]
        out["estimate"] = {k: est[k] for k in ("device", "seconds", "ratio_vs_fp32", "ratio_vs_autocast",
                                               "cast_share", "fp32_island_share")}  # fmt: skip
    out["pt2_bytes"] = (work / "converted.pt2").stat().st_size
    out["verified"] = result.passed
    module = result.module()
    try:
        converted, out["runtime_casts"] = counted_run(module, inputs)
        out["accuracy"] = accuracy(ref, converted, logits=case.logits)
    except Exception as exc:
        out["runtime_casts"] = out["accuracy"] = {"error": oc.one_line(exc)}
    out["latency"] = attempt(lambda: latency(lambda: run(module, inputs), budget_s=budget))

    def onnx_side() -> dict[str, Any]:
        res = oc.amplite_onnx(result.program, work / "amplite.onnx", precision)
        return res | oc.run_ort(work / "amplite.onnx", inputs, ref, logits=case.logits, time_it=True)

    out["onnx"] = attempt(onnx_side)
    if precision == "fp16" and "fp32_ops" in out["onnx"]:  # onnxconverter-common with amplite's FP32 op types
        out["occ_same"] = attempt(lambda: oc.occ_same_fp32_ops(model, inputs, work, out["onnx"]["fp32_ops"], ref,
                                                               logits=case.logits))
    if torch.cuda.is_available():
        def cuda() -> dict[str, Any]:
            gpu, gpu_inputs = module.to("cuda"), to_device(inputs, "cuda")
            return {"ms": cuda_latency(lambda: run(gpu, gpu_inputs))["median_ms"]}

        out["cuda"] = attempt(cuda)
    return out


def onnx_job(case: Case, work: Path, budget: float) -> dict[str, Any]:
    """FP32 ONNX export and ONNX Runtime, then onnxconverter-common's fp16 conversion of that file."""
    model, inputs = case.build()
    ref = run(model, inputs)
    out: dict[str, Any] = {"baseline_rss_mb": rss_mb()}
    fp32 = work / "fp32.onnx"
    try:
        out["fp32"] = oc.export_fp32(model, inputs, fp32)
    except Exception as exc:
        return out | {"error": f"torch.onnx.export(dynamo=True) failed: {oc.one_line(exc)}"}
    out["fp32"] |= oc.run_ort(fp32, inputs, ref, logits=case.logits, time_it=True)

    def occ() -> dict[str, Any]:
        res = oc.onnxconverter_common_fp16(fp32, work / "occ_fp16.onnx")
        return res | oc.run_ort(work / "occ_fp16.onnx", inputs, ref, logits=case.logits, time_it=True)

    out["occ"] = attempt(occ)
    return out


def run_job(model: str, job: str, budget: float) -> dict[str, Any]:
    """Run one job and return its record (``status`` ok or error, ``seconds``, ``peak_rss_mb``)."""
    case = CASES[model]
    start = perf_counter()
    with tempfile.TemporaryDirectory(prefix="amplite-bench-") as tmp:
        work = Path(tmp)
        try:
            if job == "base":
                rec = base_job(case, work, budget)
            elif job == "onnx":
                rec = onnx_job(case, work, budget)
            else:
                _, precision, level = job.split(":")
                rec = amplite_job(case, precision, level, work, budget)
        except Exception as exc:
            rec = {"error": oc.one_line(exc), "error_kind": "harness"}
    rec["status"] = "error" if "error" in rec else "ok"
    rec["seconds"] = perf_counter() - start
    rec.setdefault("peak_rss_mb", rss_mb())
    return rec
