"""The GPU suite: one command, <= 5 minutes on one H200, writes bench/RESULTS-gpu.md and bench/results-gpu.json.

Phases (each bounded by the time budget; what does not fit is listed as skipped, never silently dropped):

1. ``pytest -m gpu``: the CUDA tests (backend probe and fallback, numerics, the op on cuTENSOR).
2. Contraction microbenchmark, fp16 and bf16, attention and MLP shapes: ``amplite::contract`` on the
   cuTENSOR backend and on the einsum backend vs permute+contiguous+bmm and ``torch.einsum``: time,
   TFLOP/s, fraction of the measured bf16 matmul peak.
3. End-to-end latency (CUDA events, medians) and peak memory on BERT-base, GPT-2 (prefill, and one decode
   step with its cache), ViT-B/16, ResNet-50, Whisper-tiny and T5-small (bench/corpus.py, config-built,
   random weights) at batch 1 and 32: FP32 with TF32 off and on, ``torch.autocast`` fp16/bf16, amplite
   O1/O2 fp16/bf16 with and without contraction fusion.
4. ONNX Runtime's CUDA provider on amplite's fp16 and bf16 ONNX files, when that provider is present.
4b. Compiled rows (issue 31): FP32, autocast bf16, amplite O2 bf16 and all-bf16 under ``torch.compile``, CUDA
   graphs off (default mode) and on (``mode="reduce-overhead"``); the CUDA-graph rows say n/a on CPU.
5. The training step: not measured (amplite has no training API yet; the row says so).

Needs a CUDA build of torch (amplite supports torch 2.11-2.13) and ``transformers`` (the bench extra);
nvmath-python/cuTENSOR are optional: without them every cuTENSOR row says why it is missing.

Usage::

    python bench/gpu_suite.py                 # on the GPU machine
    python bench/gpu_suite.py --dry-run       # CPU, tiny shapes: runs every phase's code in seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from amplite.ops import cutensor_backend  # noqa: E402
from amplite.ops.contract import ENV_BACKEND, backend_description  # noqa: E402
from bench import gpu_models  # noqa: E402
from bench.gpu_contract import matmul_peak, problems, timeit  # noqa: E402
from bench.gpu_report import render, targets  # noqa: E402

GPU_TEST_FILES = ("tests/test_contract_backend.py", "tests/test_contract_op.py", "tests/test_fuse_contractions.py",
                  "tests/test_onnx_export.py")  # fmt: skip


class Budget:
    """Seconds left of the suite's time budget."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run_pytest(dry: bool, budget: Budget) -> dict[str, Any]:
    """``pytest -m gpu`` on the files holding CUDA tests (``--collect-only`` in a dry run)."""
    files = GPU_TEST_FILES[:1] if dry else GPU_TEST_FILES  # a dry run only checks that collection works
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           *files, *(["--collect-only"] if dry else [])]  # fmt: skip
    t0 = time.monotonic()
    try:
        limit = max(10.0, min(120.0, budget.left()))
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd[1:]), "summary": "timed out", "rc": None, "seconds": time.monotonic() - t0}
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    return {"command": "python " + " ".join(cmd[1:]), "rc": proc.returncode, "summary": lines[-1] if lines else "",
            "seconds": time.monotonic() - t0, "failures": [ln for ln in lines if ln.startswith("FAILED")]}  # fmt: skip


def microbench(dry: bool, device: torch.device, warmup: int, iters: int) -> tuple[float, list[dict[str, Any]]]:
    """The measured bf16 peak and one row per (problem, dtype, method)."""
    peak = matmul_peak(device, 64 if dry else 8192, warmup, iters)
    rows: list[dict[str, Any]] = []
    saved = os.environ.get(ENV_BACKEND)
    try:
        for name, dtype in gpu_models.DTYPES.items():
            ct = cutensor_backend.probe(device, dtype) if device.type == "cuda" else None
            for title, flops, methods in problems(dry, dtype, device):
                fn = methods.pop("contract")
                runs = {"contract (einsum backend)": ("torch", fn), "contract (cuTENSOR)": ("cutensor", fn)}
                base = timeit(methods["permute+bmm"], device, warmup, iters)
                ref = methods["permute+bmm"]().float().flatten()
                for method, (backend, f) in [*runs.items(), *((m, (None, f)) for m, f in methods.items())]:
                    row = {"problem": title, "dtype": name, "method": method, "flops": flops}
                    if backend == "cutensor" and (ct is None or not ct.ok):
                        rows.append(row | {"error": f"n/a: {ct.reason if ct else 'cuTENSOR needs CUDA'}"})
                        continue
                    if backend:
                        os.environ[ENV_BACKEND] = backend
                    before = cutensor_backend.cache_stats()
                    ms = base if method == "permute+bmm" else timeit(f, device, warmup, iters)
                    tflops = flops / (ms * 1e-3) / 1e12
                    err = (f().float().flatten() - ref).abs().max().item()
                    after = cutensor_backend.cache_stats()
                    if backend == "cutensor" and any(after[k] > before[k] for k in ("errors", "fallbacks")):
                        rows.append(row | {"error": "n/a: cuTENSOR fell back to the einsum backend here (see log)"})
                        continue
                    rows.append(row | {"ms": ms, "tflops": tflops, "of_peak": tflops / peak, "speedup": base / ms,
                                       "max_abs_vs_eager": err})  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop(ENV_BACKEND, None)
        else:
            os.environ[ENV_BACKEND] = saved
    return peak, rows


def onnx_rows(dry: bool, device: torch.device, budget: Budget, tmp: Path) -> list[dict[str, Any]]:
    """ONNX Runtime (CUDA provider) on amplite's fp16/bf16 files; CPU provider in a dry run."""
    try:
        import onnxruntime as ort
    except ImportError:
        return [{"model": "-", "error": "onnxruntime is not installed"}]
    provider = "CPUExecutionProvider" if dry else "CUDAExecutionProvider"
    if provider not in ort.get_available_providers():
        return [{"model": "-", "error": f"{provider} not available ({', '.join(ort.get_available_providers())})"}]
    from torch.utils import _pytree as pytree

    import amplite

    rows = []
    for spec in gpu_models.specs(dry)[: 1 if dry else None]:
        for p in gpu_models.PRECISIONS[: 1 if dry else None]:
            row: dict[str, Any] = {"model": spec.name, "precision": p, "provider": provider, "batch": 1}
            if budget.left() < 30 and not dry:
                rows.append(row | {"error": "skipped (time budget)"})
                continue
            try:
                model, example = spec.build()
                res = amplite.convert(model, example, precision=p, level="O1", fuse_contractions="off", verify=False)
                path = res.save(tmp / f"{spec.name}.{p}.onnx")
                sess = ort.InferenceSession(str(path), providers=[provider])
                leaves = [t.numpy() for t in pytree.tree_leaves(example) if isinstance(t, torch.Tensor)]
                feed = {i.name: x for i, x in zip(sess.get_inputs(), leaves, strict=False)}
                row["ms"] = timeit(lambda s=sess, f=feed: s.run(None, f), torch.device("cpu"), 3, 5 if dry else 30)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            rows.append(row)
    return rows


def compiled_rows(dry: bool, device: torch.device, budget: Budget, warmup: int, iters: int) -> list[dict[str, Any]]:
    """Issue 31 on the device: FP32, autocast bf16, amplite O2 bf16 and all-bf16 under ``torch.compile``, with
    CUDA graphs off (default mode) and on (``mode="reduce-overhead"``); CUDA-graph rows say n/a without CUDA."""
    import copy

    import amplite

    rows: list[dict[str, Any]] = []
    for spec in gpu_models.specs(dry)[: 1 if dry else 2]:
        try:
            model, example = spec.build()
            model = model.to(device)
            inputs = gpu_models.rebatch(example, 1, device)
            res = amplite.convert(model, inputs, precision="bf16", level="O2", verify=False)

            def autocast(*a: Any, m: Any = model, **k: Any) -> Any:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    return m(*a, **k)

            low = copy.deepcopy(model).to(torch.bfloat16)
            low_in = torch.utils._pytree.tree_map(
                lambda t: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, inputs
            )
            cases = {"fp32": (model, inputs), "autocast bf16": (autocast, inputs),
                     "amplite O2 bf16": (res.module(), inputs), "all bf16": (low, low_in)}  # fmt: skip
        except Exception as e:
            rows.append({"model": spec.name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        for variant, (fn, inp) in cases.items():
            for mode, graphs in (("default", "off"), ("reduce-overhead", "on")):
                row: dict[str, Any] = {"model": spec.name, "variant": variant, "cuda_graphs": graphs, "batch": 1}
                if graphs == "on" and device.type != "cuda":
                    rows.append(row | {"error": "n/a: CUDA graphs need a CUDA device"})
                    continue
                if budget.left() < 20 and not dry:
                    rows.append(row | {"error": "skipped (time budget)"})
                    continue
                try:
                    compiled = torch.compile(fn, mode=mode)
                    row["ms"] = timeit(lambda c=compiled, i=inp: gpu_models.call(c, i), device, warmup, iters)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                rows.append(row)
    return rows


def compiled_markdown(rows: list[dict[str, Any]]) -> str:
    """The ``## Compiled (torch.compile)`` section of RESULTS-gpu.md."""
    lines = ["", "## Compiled (torch.compile, issue 31)", "", "| model | variant | CUDA graphs | ms (median) |",
             "|---|---|---|---|"]  # fmt: skip
    for r in rows:
        value = f"{r['ms']:.3f}" if "ms" in r else r.get("error", "")
        lines.append(f"| {r['model']} | {r.get('variant', '-')} | {r.get('cuda_graphs', '-')} | {value} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: checks that every phase runs")
    ap.add_argument("--out", type=Path, default=ROOT / "bench", help="directory for the .md and .json")
    ap.add_argument("--budget-s", type=float, default=285.0, help="stop starting new work after this long")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: pytest,micro,e2e,onnx,compiled")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("gpu_suite: needs CUDA (use --dry-run to check the suite on CPU)", file=sys.stderr)
        return 2
    dry, skip = args.dry_run, set(filter(None, args.skip.split(",")))
    device = torch.device("cuda" if cuda and not dry else "cpu")
    warmup, iters = (1, 2) if dry else (5, 20)
    budget, t0 = Budget(args.budget_s), time.monotonic()
    data: dict[str, Any] = {"meta": {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "nvmath": cutensor_backend.nvmath_version(), "contract_backend": backend_description(device),
        "dry_run": dry, "batches": [1, 2] if dry else [1, 32],
    }}  # fmt: skip
    phase = data["meta"]["phase_s"] = {}
    data["pytest"] = {"summary": "skipped"} if "pytest" in skip else run_pytest(dry, budget)
    phase["pytest"] = time.monotonic() - t0
    data["peak_tflops"], data["micro"] = (math.nan, []) if "micro" in skip else microbench(dry, device, warmup, iters)
    phase["micro"] = time.monotonic() - t0 - sum(phase.values())
    data["e2e"], data["notes"] = [], []
    if not dry and "e2e" not in skip:
        from bench.corpus import have_transformers

        if not have_transformers():
            data["notes"].append({"model": "all", "note": "transformers missing: pip install 'amplite[bench]'"})
    for spec in [] if "e2e" in skip else gpu_models.specs(dry):
        if budget.left() < 20:
            data["e2e"].append({"model": spec.name, "error": "skipped (time budget)"})
            continue
        try:
            rows, notes = gpu_models.run_model(spec, tuple(data["meta"]["batches"]), device, warmup, iters, dry)
        except Exception as e:  # a model that fails to build or export is a row, not the end of the suite
            rows, notes = [{"model": spec.name, "error": f"{type(e).__name__}: {str(e)[:200]}"}], []
        data["e2e"] += rows
        data["notes"] += notes
        if device.type == "cuda":
            torch.cuda.empty_cache()
    phase["e2e"] = time.monotonic() - t0 - sum(phase.values())
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        data["onnx"] = [] if "onnx" in skip else onnx_rows(dry, device, budget, Path(tmp))
    phase["onnx"] = time.monotonic() - t0 - sum(phase.values())
    data["compiled"] = [] if "compiled" in skip else compiled_rows(dry, device, budget, warmup, iters)
    phase["compiled"] = time.monotonic() - t0 - sum(phase.values())
    data["training"] = {"error": "n/a: amplite has no training-step API yet"}
    data["targets"] = targets(data)
    data["meta"]["seconds"] = time.monotonic() - t0
    stem = "RESULTS-gpu.dry-run" if dry else "RESULTS-gpu"
    (out / f"{stem}.md").write_text(render(data) + compiled_markdown(data["compiled"]))
    (out / f"{stem.replace('RESULTS', 'results')}.json").write_text(json.dumps(data, indent=1, default=str))
    times = ", ".join(f"{k} {v:.0f} s" for k, v in phase.items())
    print(f"gpu_suite: {data['meta']['seconds']:.0f} s ({times}); wrote {out / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
