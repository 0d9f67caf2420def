"""Compiled deployment on the GPU, one model per process (a job of ``bench/gpu_suite.py``, issue 31).

Variants (bench/bench_compiled.py's, on the device): FP32, ``torch.autocast`` bf16, amplite bf16 O1 and O2
(``amplite.convert``), the whole model in bf16. Modes: eager, ``torch.compile`` (default mode, CUDA graphs
off), ``torch.compile(mode="reduce-overhead")`` (CUDA graphs on) and an AOTInductor package loaded back
(``aoti_compile_and_package`` of the exported program; autocast has none: a package has no autocast context).

Everything is prepared first (conversion, compilation, packaging), most telling first (see :data:`ORDER`),
so a job stopped by the suite's deadline has the rows the targets need; then every prepared (variant, mode)
is timed interleaved, round by round, holding the GPU lock. Each figure: the median over rounds of the
median of ``--reps`` calls (CUDA events; each call synchronised, so launch overhead counts).

    python bench/gpu_deploy.py --model gpt2-6l [--rounds 3 --reps 20] [--modes eager,compile,cudagraphs,aoti]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

from bench.bench_compiled import MODELS, _cast_inputs  # noqa: E402
from bench.gpu_contract import timeit  # noqa: E402
from bench.gpu_jobs import emit, gpu_lock, past_deadline  # noqa: E402

LOW = torch.bfloat16
MODES = ("eager", "compile", "cudagraphs", "aoti")
#: A diagnostic variant: amplite O2's module without torch.export's input-check pre-hook, to measure what
#: that check costs per call (amplite ships the module with it: the check is what refuses wrong inputs).
UNCHECKED = "amplite O2, input check off"
#: Preparation order: what the issue's targets compare first (O2 against autocast and the all-bf16 limit).
ORDER = [(v, "eager") for v in ("fp32", "autocast", "amplite O1", "amplite O2", "all bf16")] + [
    ("autocast", "compile"), ("amplite O2", "compile"), ("all bf16", "compile"), ("amplite O2", "aoti"),
    ("all bf16", "aoti"), ("autocast", "cudagraphs"), ("amplite O2", "cudagraphs"), ("all bf16", "cudagraphs"),
    (UNCHECKED, "cudagraphs"), (UNCHECKED, "compile"),
    ("amplite O1", "compile"), ("amplite O1", "cudagraphs"), ("amplite O1", "aoti"), ("fp32", "compile"),
    ("fp32", "cudagraphs"), ("fp32", "aoti"),
]  # fmt: skip
#: Seconds a step needs before the deadline to be started at all.
MARGIN = {"eager": 20.0, "compile": 25.0, "cudagraphs": 25.0, "aoti": 60.0}


def _sources(name: str, device: torch.device) -> tuple[dict[str, tuple[Callable[..., Any], Any]], Any]:
    """``({variant: (callable, inputs)}, exporter)``: the eager variants, and ``exporter(variant)`` giving the
    ExportedProgram an AOTInductor package is built from (amplite's own program for O1/O2)."""
    import amplite

    model, inputs = MODELS[name]()
    model = model.to(device).eval()
    inputs = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)

    def autocast(*a: Any, **k: Any) -> Any:
        with torch.autocast(device.type, dtype=LOW):
            return model(*a, **k)

    low = copy.deepcopy(model).to(LOW)
    low_inputs = _cast_inputs(inputs, LOW)
    out: dict[str, tuple[Callable[..., Any], Any]] = {"fp32": (model, inputs), "autocast": (autocast, inputs),
                                                      "all bf16": (low, low_inputs)}  # fmt: skip
    programs: dict[str, Any] = {}
    for level in ("O1", "O2"):
        res = amplite.convert(model, inputs, precision="bf16", level=level, verify=False)
        out[f"amplite {level}"] = (res.module(), inputs)
        programs[f"amplite {level}"] = res.program
    unchecked = programs["amplite O2"].module()
    hooks = unchecked._forward_pre_hooks
    found = [k for k, h in hooks.items() if getattr(h, "__name__", "") == "_check_input_constraints_pre_hook"]
    for key in found:
        del hooks[key]
    if found:  # else this torch names the check otherwise: no row rather than a copy of O2 labelled "off"
        out[UNCHECKED] = (unchecked, inputs)

    def exporter(variant: str) -> Any:
        if variant in programs:
            return programs[variant]
        fn, (args, kwargs) = out[variant]
        return torch.export.export(fn, args, kwargs)

    return out, exporter


def _call(fn: Callable[..., Any], inputs: Any, mark_step: bool = False) -> Callable[[], Any]:
    args, kwargs = inputs

    def run() -> Any:
        if mark_step:  # CUDA-graph trees: each call starts a new step, so earlier outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        return fn(*args, **kwargs)

    return run


def prepare(variant: str, mode: str, sources: dict[str, Any], exporter: Any, tmp: str) -> Callable[[], Any]:
    """A no-argument runner for (``variant``, ``mode``), already called once (compiled, warmed)."""
    fn, inputs = sources[variant]
    if mode == "eager":
        runner = _call(fn, inputs)
    elif mode in ("compile", "cudagraphs"):
        cg = mode == "cudagraphs"
        runner = _call(torch.compile(fn, mode="reduce-overhead" if cg else "default"), inputs, mark_step=cg)
    else:
        path = torch._inductor.aoti_compile_and_package(
            exporter(variant), package_path=f"{tmp}/{variant.replace(' ', '_')}.pt2"
        )
        runner = _call(torch._inductor.aoti_load_package(path), inputs)
    with torch.no_grad():
        runner()
        runner()
    return runner


def run(name: str, modes: list[str], device: torch.device, rounds: int, reps: int) -> None:
    """Prepare in :data:`ORDER` (within the deadline), then time interleaved; one row per (variant, mode)."""
    steps = [(v, m) for v, m in ORDER if m in modes and (m != "cudagraphs" or device.type == "cuda")]
    t0 = time.perf_counter()
    sources, exporter = _sources(name, device)
    emit({"phase": "deploy", "model": name, "note": "converted", "seconds": time.perf_counter() - t0})
    if UNCHECKED not in sources:
        emit({"phase": "deploy", "model": name, "variant": UNCHECKED, "mode": "compile",
              "error": "n/a: no torch.export input-check hook found on this torch's module"})  # fmt: skip
    steps = [(v, m) for v, m in steps if v in sources]
    ready: dict[tuple[str, str], tuple[Callable[[], Any], float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant, mode in steps:
            row = {"phase": "deploy", "model": name, "variant": variant, "mode": mode}
            if past_deadline(margin_s=MARGIN[mode]):
                emit(row | {"error": "not prepared (the suite's time budget)"})
                continue
            t0 = time.perf_counter()
            try:
                ready[(variant, mode)] = (prepare(variant, mode, sources, exporter, tmp), time.perf_counter() - t0)
            except Exception as exc:
                traceback.print_exc()
                emit(row | {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"})
        samples: dict[tuple[str, str], list[float]] = {k: [] for k in ready}
        with gpu_lock() as waited, torch.no_grad():
            for rnd in range(rounds):
                for key in list(ready) if rnd % 2 == 0 else list(ready)[::-1]:
                    samples[key].append(timeit(ready[key][0], device, 3, reps))
        for (variant, mode), times in samples.items():
            emit({"phase": "deploy", "model": name, "variant": variant, "mode": mode, "ms": statistics.median(times),
                  "ms_rounds": times, "prepare_s": ready[(variant, mode)][1], "lock_wait_s": waited,
                  "rounds": rounds, "reps": reps})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=sorted(MODELS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    run(args.model, args.modes.split(","), torch.device(args.device), args.rounds, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
