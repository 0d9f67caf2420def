"""FP8 fidelity and size on the transformers corpus: amplite's ``--precision fp8`` against the baselines.

Usage: ``python bench/bench_fp8.py [--models distilbert,gpt2,...] [--json OUT] [--threads N] [--quick | --no-search]``
(``--quick``: one conversion per model, :func:`run_quick`; the full row below converts seven times;
``--no-search``: the all-FP8 columns only, without the two default conversions and their budget search
nor the ``.pt2`` sizes; ``--static-only``: fewer still, the two static columns against the baseline).

Per model (``bench/corpus.py``: published configurations, seeded random weights, nothing downloaded), the
SQNR of the first output (logits) against the FP32 model, pooled over the example inputs and
``EVAL_BATCHES`` held-out batches (none of them a calibration batch), for:

* **fp8 static**: every eligible product in FP8 (``fallback_search=False``), calibrated on two *other*
  batches (token ids rolled along the sequence, images mirrored or darkened, features jittered):
  per-tensor activation scales chosen by measured error (``amplite/converter/fp8_scales.py``),
  per-output-channel weight scales chosen by the measured error of each product's output on the same
  batches; **act-only static**: the same with each weight channel's scale its own amax/448 (activation
  scales still measured: the choice before measured weight scales, patched in for this column);
  **amax/448 static**: plain amax/448 activation and weight scales (the choice before measured scales);
* **fp8 dynamic**: all-FP8 without calibration: per-token activation scales at run time;
* **per-tensor dynamic**: the vLLM on-the-fly baseline (``--quantization fp8`` without a checkpoint): every
  ``nn.Linear`` / GPT-2 ``Conv1D`` with one scale for the activation (from the current batch) and one for the
  weight, computed here in FP32 around each layer (:func:`per_tensor_dynamic`), the rest of the model FP32;
* **bf16**: ``precision="bf16", level="O2"``;
* **default**: ``precision="fp8"`` with the calibration batches and nothing else: fp8's default contract
  (SQNR >= 25 dB, cosine >= 0.99 on the example inputs, the accuracy-budget search on): the SQNR the report
  gives, the SQNR pooled over the held-out batches, how many FP8 products the search moved back to bf16,
  its trials against their bound and the conversion's seconds; **default dynamic** the same without
  calibration.

``size fp8/bf16`` is the ratio of the saved ``.pt2`` files (default fp8 vs bf16 O2). The machine line says
where it ran; every number is measured in this run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn
from torch.utils import _pytree as pytree

from amplite.ops.fp8_numerics import dequantize, quantize, scale_from_amax

DEFAULT_MODELS = ("distilbert", "gpt2", "vit-b16", "t5-small")
COLUMNS = ("model", "fp8 static dB", "act-only static dB", "amax/448 static dB", "fp8 dynamic dB",
           "per-tensor dynamic dB", "bf16 dB", "fp8 nodes", "kept low", "default dB", "default held-out dB",
           "moved", "trials", "default s", "default dynamic dB", "dynamic moved", "size fp8/bf16",
           "seconds")  # fmt: skip
#: The columns of a ``--no-search`` row.
NO_SEARCH_COLUMNS = ("model", "fp8 static dB", "act-only static dB", "amax/448 static dB", "fp8 dynamic dB",
                     "per-tensor dynamic dB", "bf16 dB", "fp8 nodes", "kept low", "seconds")  # fmt: skip
#: The columns of a ``--static-only`` row.
STATIC_COLUMNS = ("model", "fp8 static dB", "act-only static dB", "per-tensor dynamic dB", "fp8 nodes", "kept low",
                  "seconds")  # fmt: skip
#: Held-out batches (beyond the example inputs) the SQNR columns pool over: none is a calibration batch.
EVAL_BATCHES = 2


def _per_tensor(x: torch.Tensor, w_nk: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + bias`` with ``x`` and ``w`` each rounded to e4m3 with one scale (amax/448), in FP32."""
    sx, sw = scale_from_amax(x.detach().abs().amax()), scale_from_amax(w_nk.detach().abs().amax())
    y = dequantize(quantize(x, sx), sx) @ dequantize(quantize(w_nk, sw), sw).t()
    return (y + bias.float() if bias is not None else y).to(x.dtype)


@contextlib.contextmanager
def per_tensor_dynamic(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s ``nn.Linear`` and GPT-2 ``Conv1D`` layers with per-tensor dynamic FP8 scaling (the vLLM
    on-the-fly baseline) while inside the block; the model's tensors are not changed."""

    def linear(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return _per_tensor(args[0], m.weight, m.bias)

    def conv1d(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:  # weight [in, out]
        x = args[0]
        y = _per_tensor(x.reshape(-1, x.shape[-1]), m.weight.t(), m.bias)
        return y.reshape(*x.shape[:-1], m.weight.shape[1])

    hooks = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            hooks.append(m.register_forward_hook(linear))
        elif type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None:
            hooks.append(m.register_forward_hook(conv1d))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def calibration_batches(inputs: Any, n: int = 2) -> list[Any]:
    """``n`` batches like ``inputs`` but not equal to them nor to each other: token ids rolled along the
    sequence (masks, which hold only 0/1, kept), images mirrored, darkened, flipped upside down, brightened,
    other floats jittered by 10 % (seeded by the batch's index)."""
    out = []
    for i in range(1, n + 1):
        gen = torch.Generator().manual_seed(i)

        def vary(t: Any, i: int = i, gen: torch.Generator = gen) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            if not t.dtype.is_floating_point:
                return t.roll(3 * i, dims=-1) if t.numel() and int(t.max()) > 1 else t
            if t.dim() == 4:  # 1: mirrored, 2: darker, then (held out) upside down and brighter
                return (t.flip(-1), t * 0.9, t.flip(-2), t * 1.2)[(i - 1) % 4]
            return t * (1 + 0.1 * torch.randn(t.shape, generator=gen))

        out.append(pytree.tree_map(vary, inputs))
    return out


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """``20·log10(‖ref‖/‖ref − out‖)`` in float64."""
    ref, out = ref.double(), out.double()
    err = (ref - out).norm().item()
    return math.inf if err == 0 else 20 * math.log10(ref.norm().item() / err)


def _first(out: Any) -> torch.Tensor:
    return next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.dtype.is_floating_point)


@contextlib.contextmanager
def plain_amax_scales() -> Iterator[None]:
    """Inside the block, static scales are amax/448 of the calibration data (the choice before measured scales)."""
    import amplite.converter.fp8_scales as fp8_scales  # the calibration pass looks it up when it runs

    chosen = fp8_scales.choose_input_scales
    fp8_scales.choose_input_scales = lambda gm, batches, ranges: dict(ranges)
    try:
        yield
    finally:
        fp8_scales.choose_input_scales = chosen


@contextlib.contextmanager
def plain_weight_scales() -> Iterator[None]:
    """Inside the block, each FP8 weight channel's scale is its own amax/448 (activation scales still measured)."""
    import amplite.converter.fp8_scales as fp8_scales

    chosen = fp8_scales.weight_amaxes
    fp8_scales.weight_amaxes = lambda w, x: w.detach().float().abs().amax(dim=1)
    try:
        yield
    finally:
        fp8_scales.weight_amaxes = chosen


def pooled_sqnr(refs: list[torch.Tensor], outs: list[torch.Tensor]) -> float:
    """SQNR over several batches together: total signal energy over total error energy."""
    sig = sum(float(r.double().pow(2).sum()) for r in refs)
    err = sum(float((r.double() - o.double()).pow(2).sum()) for r, o in zip(refs, outs, strict=True))
    return math.inf if err == 0 else 10 * math.log10(sig / err)


def run_quick(name: str) -> dict[str, Any]:
    """The short row (``--quick``) for corpus model ``name``: one conversion, fp8's default with calibration.

    ``all-FP8 static dB`` is the SQNR of the plan before the search (the budget's first step, every eligible
    product in FP8, measured scales); ``default dB`` the plan the search chose; the baseline as in the full row,
    all on the example inputs (worst float output). No ``.pt2`` is written (the full row measures the size).
    """
    import amplite
    from bench.corpus import CASES

    start = perf_counter()
    model, (args, kwargs) = CASES[name].build()
    calib = calibration_batches((args, kwargs))
    with torch.no_grad():
        ref = _first(model(*args, **kwargs))
        with per_tensor_dynamic(model):
            baseline = sqnr_db(ref, _first(model(*args, **kwargs)))
    t0 = perf_counter()
    default = amplite.convert(model, (args, kwargs), precision="fp8", calibration=calib)
    seconds = perf_counter() - t0
    outputs = default.report.data["verification"]["outputs"]
    final = min(float(o["sqnr_db"]) for o in outputs if o.get("sqnr_db") is not None)
    budget = default.report.data.get("budget", {})
    fp8_nodes = sum(e["dtype"] == "float8_e4m3fn" for e in default.report.data["plan"])
    return {"model": name, "outputs": len(outputs), "all-FP8 static dB": budget["steps"][0]["worst_sqnr_db"]
            if budget else final, "per-tensor dynamic dB": baseline, "default dB": final,
            "passed": bool(default.passed), "FP8 nodes left": fp8_nodes,
            "moved": len(budget.get("moved_to_fp32", [])), "candidates": budget.get("candidates", 0),
            "trials": f"{budget.get('trials', 0)}/{budget.get('trial_bound', 0)}",
            "search s": budget.get("seconds", 0.0), "convert s": seconds,
            "seconds": perf_counter() - start}  # fmt: skip


QUICK_COLUMNS = ("model", "outputs", "all-FP8 static dB", "per-tensor dynamic dB", "default dB", "passed",
                 "FP8 nodes left", "moved", "candidates", "trials", "search s", "convert s", "seconds")  # fmt: skip


def run_model(name: str, search: bool = True, static_only: bool = False) -> dict[str, Any]:
    """One row for corpus model ``name``: the SQNRs, the default conversion's budget, the size ratio
    (``search=False``: the all-FP8 columns only, :data:`NO_SEARCH_COLUMNS`; ``static_only``:
    :data:`STATIC_COLUMNS`)."""
    import amplite
    from bench.corpus import CASES

    start = perf_counter()
    model, (args, kwargs) = CASES[name].build()
    calib = calibration_batches((args, kwargs))
    held_out = [(args, kwargs), *calibration_batches((args, kwargs), n=EVAL_BATCHES + 2)[2:]]
    with torch.no_grad():
        refs = [_first(model(*a, **k)) for a, k in held_out]
        with per_tensor_dynamic(model):
            baseline = pooled_sqnr(refs, [_first(model(*a, **k)) for a, k in held_out])

    def pooled(r: Any) -> float:
        program = r.program.module()
        with torch.no_grad():
            return pooled_sqnr(refs, [_first(program(*a, **k)).float() for a, k in held_out])

    def db(r: Any) -> float:
        return float(r.report.data["verification"]["outputs"][0]["sqnr_db"])

    static = amplite.convert(model, (args, kwargs), precision="fp8", calibration=calib, fallback_search=False)
    with plain_weight_scales():
        act_only = amplite.convert(model, (args, kwargs), precision="fp8", calibration=calib,
                                   fallback_search=False)  # fmt: skip
    counters = next(p["counters"] for p in static.report.data["passes"] if p["name"] == "fp8_matmul")
    kept = sum(v for k, v in counters.items() if k.startswith("kept_low:"))
    row = {"model": name, "fp8 static dB": pooled(static), "act-only static dB": pooled(act_only),
           "per-tensor dynamic dB": baseline, "fp8 nodes": counters.get("fp8_nodes", 0), "kept low": kept}
    if static_only:
        return {**row, "seconds": perf_counter() - start}
    with plain_amax_scales():
        amax = amplite.convert(model, (args, kwargs), precision="fp8", calibration=calib, fallback_search=False)
    dynamic = amplite.convert(model, (args, kwargs), precision="fp8", fallback_search=False)
    bf16 = amplite.convert(model, (args, kwargs), precision="bf16", level="O2")
    row = {**row, "amax/448 static dB": pooled(amax), "fp8 dynamic dB": pooled(dynamic), "bf16 dB": pooled(bf16)}
    if not search:
        return {**row, "seconds": perf_counter() - start}
    t0 = perf_counter()
    default = amplite.convert(model, (args, kwargs), precision="fp8", calibration=calib)  # fp8's defaults
    default_s = perf_counter() - t0
    default_dyn = amplite.convert(model, (args, kwargs), precision="fp8")
    with tempfile.TemporaryDirectory() as tmp:
        default.save(Path(tmp) / "fp8.pt2")
        bf16.save(Path(tmp) / "bf16.pt2")
        size = (Path(tmp) / "fp8.pt2").stat().st_size / (Path(tmp) / "bf16.pt2").stat().st_size
    budget = default.report.data.get("budget", {})
    return {**row, "default dB": db(default), "default held-out dB": pooled(default),
            "moved": f"{len(budget.get('moved_to_fp32', []))}",
            "trials": f"{budget.get('trials', 0)}/{budget.get('trial_bound', 0)}", "default s": default_s,
            "default dynamic dB": db(default_dyn),
            "dynamic moved": f"{len(default_dyn.report.data.get('budget', {}).get('moved_to_fp32', []))}",
            "size fp8/bf16": size, "seconds": perf_counter() - start}  # fmt: skip


def table(rows: list[dict[str, Any]], columns: tuple[str, ...] = COLUMNS) -> str:
    """The rows as a Markdown table."""

    def cell(v: Any) -> str:
        return f"{v:.1f}" if isinstance(v, float) and abs(v) >= 10 else f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--quick", action="store_true",
                        help="one conversion per model (fp8's default with calibration): the short row")
    parser.add_argument("--no-search", action="store_true",
                        help="the all-FP8 columns only: no default conversion (budget search), no sizes")
    parser.add_argument("--static-only", action="store_true",
                        help="the two static columns and the per-tensor dynamic baseline only")
    ns = parser.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    from bench.harness import machine

    cpu, gpu = machine()
    print(f"machine: {cpu}; {torch.get_num_threads()} torch threads; torch {torch.__version__}; GPU: {gpu or 'none'}")
    rows = []
    for name in ns.models.split(","):
        rows.append(run_quick(name) if ns.quick else run_model(name, not ns.no_search, ns.static_only))
        print(f"{name}: {json.dumps(rows[-1])}", flush=True)
    columns = QUICK_COLUMNS if ns.quick else STATIC_COLUMNS if ns.static_only else \
        NO_SEARCH_COLUMNS if ns.no_search else COLUMNS
    print(table(rows, columns))
    if ns.json:
        ns.json.write_text(json.dumps({"machine": cpu, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
