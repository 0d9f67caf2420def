"""The GPU suite: one command, at most 9 minutes on one H100/H200, writes bench/RESULTS-gpu.md and results-gpu.json.

``--wheels DIR`` first installs the wheels carried there by bench/carry_wheels.py (nvmath-python, cuTENSOR; its
time is counted in the budget), then the first line printed and the report's first row say which
``amplite::contract`` backend runs and why.

Every part runs as a job (bench/gpu_jobs.py): a fresh process per model, up to ``--workers`` at once, so the
compilation that dominates the suite's time uses the machine's CPU cores in parallel, while the timed
sections take turns on the GPU (a lock: no two jobs time at once). Jobs, most needed first; what the time
budget leaves out is reported as not run, never silently dropped:

1. ``pytest -m gpu``: the CUDA tests (backend probe and fallback, numerics, the op on cuTENSOR).
2. Contraction microbenchmark (below), decode and prefill with amplite's LLM step program (GPT-2 124 M,
   bench/gpu_decode.py: latency, kernels and casts per decode step), then training (issues 28 and 41,
   bench/gpu_train.py): GPT-2 124 M (12 layers, d 768, seq 1024, batch 8) and ResNet-50 (channels_last,
   224², batch 64) first, then GPT-2 23 M, BERT-MLM 23 M, ResNet-34: FP32 (TF32 off), autocast bf16,
   amplite O1/O2 bf16, all-bf16, and ``torch.compile`` of autocast and of amplite's net: step time, memory.
3. Compiled deployment (issue 31, bench/gpu_deploy.py): every corpus model and GPT-2-6l: FP32, autocast bf16,
   amplite O1/O2 bf16, all-bf16, each eager, ``torch.compile`` with CUDA graphs off and on, AOTInductor.
4. Contraction microbenchmark, fp16 and bf16, attention and MLP shapes: ``amplite::contract`` on the
   cuTENSOR backend and on its ``torch`` GEMM fallback vs permute+contiguous+bmm and ``torch.einsum``.
5. End-to-end latency (CUDA events, medians) and peak memory on BERT-base, GPT-2 (prefill, and one decode
   step with its cache), ViT-B/16, ResNet-50, Whisper-tiny and T5-small (bench/corpus.py, config-built,
   random weights) at batch 1 and 32: FP32 with TF32 off and on, ``torch.autocast`` fp16/bf16, amplite
   O1/O2 fp16/bf16 with and without contraction fusion.
6. ONNX Runtime's CUDA provider on amplite's fp16 and bf16 ONNX files, when that provider is present.

Needs a CUDA build of torch (amplite supports torch 2.11-2.13) and ``transformers`` (the bench extra);
nvmath-python/cuTENSOR are optional: without them every cuTENSOR row says why it is missing.

Usage::

    python bench/gpu_suite.py --wheels /tmp/amplite-wheels --out $OUT   # on the GPU machine (docs/gpu.md)
    python bench/gpu_suite.py --only train:gpt2,deploy:gpt2-6l --budget-s 60   # a smoke run of two jobs
    python bench/gpu_suite.py --dry-run       # CPU, tiny models, jobs in this process: every job's code
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
from amplite.ops.contract import ENV_BACKEND, active_backend, backend_description  # noqa: E402
from bench import gpu_decode, gpu_deploy, gpu_models, gpu_train  # noqa: E402
from bench.bench_compiled import MODELS as DEPLOY_MODELS  # noqa: E402
from bench.gpu_contract import matmul_peak, problems, timeit  # noqa: E402
from bench.gpu_issue41 import FALLBACK_METHOD  # noqa: E402
from bench.gpu_jobs import ENV_DEADLINE, ENV_OUT, Job, emit, gpu_lock, past_deadline, read_rows, run_jobs  # noqa: E402
from bench.gpu_report import render, targets  # noqa: E402

GPU_TEST_FILES = ("tests/test_contract_backend.py", "tests/test_contract_fallback.py", "tests/test_contract_op.py",
                  "tests/test_fuse_contractions.py", "tests/test_onnx_export.py")  # fmt: skip


def run_pytest(dry: bool) -> dict[str, Any]:
    """``pytest -m gpu`` on the files holding CUDA tests (``--collect-only`` in a dry run)."""
    files = GPU_TEST_FILES[:1] if dry else GPU_TEST_FILES  # a dry run only checks that collection works
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           *files, *(["--collect-only"] if dry else [])]  # fmt: skip
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
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
                runs = {FALLBACK_METHOD: ("torch", fn), "contract (cuTENSOR)": ("cutensor", fn)}
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
                        rows.append(row | {"error": "n/a: cuTENSOR fell back to the torch GEMM here (see log)"})
                        continue
                    rows.append(row | {"ms": ms, "tflops": tflops, "of_peak": tflops / peak, "speedup": base / ms,
                                       "max_abs_vs_eager": err})  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop(ENV_BACKEND, None)
        else:
            os.environ[ENV_BACKEND] = saved
    return peak, rows


def onnx_rows(dry: bool, tmp: Path) -> list[dict[str, Any]]:
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
            if past_deadline(margin_s=30):
                rows.append(row | {"error": "skipped (the suite's time budget)"})
                continue
            try:
                model, example = spec.build()
                res = amplite.convert(model, example, precision=p, level="O1", fuse_contractions="off", verify=False)
                path = res.save(tmp / f"{spec.name}.{p}.onnx")
                sess = ort.InferenceSession(str(path), providers=[provider])
                leaves = [t.numpy() for t in pytree.tree_leaves(example) if isinstance(t, torch.Tensor)]
                feed = {i.name: x for i, x in zip(sess.get_inputs(), leaves, strict=False)}
                with gpu_lock():
                    row["ms"] = timeit(lambda s=sess, f=feed: s.run(None, f), torch.device("cpu"), 3, 5 if dry else 30)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            rows.append(row)
    return rows


#: The corpus (bench/corpus.py) and issue 31's GPT-2-6l, largest first: the queue is ordered by what the
#: targets need, and a GPT-2-sized graph is where a per-call overhead no longer hides the kernels.
DEPLOY = ["gpt2-6l", "gpt2-kv", "bert-base", "gpt2", "resnet50", "vit-b16", "distilbert", "t5-small",
          "whisper-tiny", "convnext-tiny"]  # fmt: skip
#: Training jobs, most needed first (issue 41's two models lead).
TRAIN = ["gpt2-124m", "resnet50", "gpt2", "bert", "resnet34"]
#: End-to-end models, most needed first (decode and prefill lead).
E2E_FIRST = ["gpt2-decode", "gpt2-prefill"]


def child(kind: str, model: str, dry: bool) -> int:
    """One job of this file (``--job``): its rows through :func:`emit`."""
    device = torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu")
    warmup, iters = (1, 2) if dry else (5, 20)
    if kind == "pytest":
        emit({"phase": "pytest", **run_pytest(dry)})
    elif kind == "micro":
        with gpu_lock():
            peak, rows = microbench(dry, device, warmup, iters)
        emit({"phase": "micro", "peak_tflops": peak})
        for r in rows:
            emit({"phase": "micro", **r})
    elif kind == "e2e" and past_deadline(margin_s=60):
        emit({"phase": "e2e", "model": model, "error": "not run (the suite's time budget)"})
    elif kind == "e2e":
        spec = next(s for s in gpu_models.specs(dry) if s.name == model)
        rows, notes = gpu_models.run_model(spec, (1, 2) if dry else (1, 32), device, warmup, iters, dry, lock=gpu_lock)
        for r in rows:
            emit({"phase": "e2e", **r})
        for n in notes:
            emit({"phase": "note", **n})
    elif kind == "onnx":
        with tempfile.TemporaryDirectory() as tmp:
            for r in onnx_rows(dry, Path(tmp)):
                emit({"phase": "onnx", **r})
    return 0


def install_wheels(store: Path) -> dict[str, Any]:
    """Install what bench/carry_wheels.py received into ``store``; a failure is recorded, loudly, not fatal
    (the fallback's rows still matter), and the probe then says why cuTENSOR is unusable."""
    import importlib

    from bench import carry_wheels

    t = time.monotonic()
    try:
        names = carry_wheels.install(store)
        status = f"installed {', '.join(names)}"
    except (carry_wheels.CarryError, subprocess.CalledProcessError, OSError) as e:
        status = f"FAILED: {e}"
        print(f"gpu_suite: installing the carried wheels failed: {e}", file=sys.stderr, flush=True)
    importlib.invalidate_caches()  # the probe's find_spec must see a package installed after startup
    cutensor_backend.reset_probes()
    return {"status": status, "seconds": time.monotonic() - t, "store": str(store)}


def plan(dry: bool, only: set[str]) -> list[Job]:
    """Every job, in the order the pool starts them (what the open issues need first)."""
    me = str(Path(__file__).resolve())
    train_argv = ["--steps", "2", "--warmup", "1", "--rounds", "2", "--device", "cpu",
                  "--variants", "fp32,autocast,amplite-O2"] if dry else []  # fmt: skip
    deploy_argv = ["--modes", "eager,compile", "--rounds", "2", "--reps", "2", "--device", "cpu"] if dry else []
    jobs = [Job("pytest", [me, "--job", "pytest", *(["--dry-run"] if dry else [])])]
    jobs.append(Job("micro", [me, "--job", "micro", *(["--dry-run"] if dry else [])]))
    jobs.append(Job("decode:llm-step", [gpu_decode.__file__, *(["--dry-run"] if dry else [])]))
    train = ["tiny", "tiny-cnn"] if dry else TRAIN
    jobs += [Job(f"train:{m}", [gpu_train.__file__, "--model", m, *train_argv]) for m in train[:2]]
    e2e = [s.name for s in gpu_models.specs(dry)]
    e2e = [m for m in E2E_FIRST if m in e2e] + [m for m in e2e if m not in E2E_FIRST]
    jobs += [Job(f"e2e:{m}", [me, "--job", "e2e", "--model", m, *(["--dry-run"] if dry else [])]) for m in e2e[:2]]
    deploy = ["fx-mlp"] if dry else [m for m in DEPLOY if m in DEPLOY_MODELS]
    jobs += [Job(f"deploy:{m}", [gpu_deploy.__file__, "--model", m, *deploy_argv]) for m in deploy[:4]]
    jobs += [Job(f"train:{m}", [gpu_train.__file__, "--model", m, *train_argv]) for m in train[2:]]
    jobs += [Job(f"e2e:{m}", [me, "--job", "e2e", "--model", m, *(["--dry-run"] if dry else [])]) for m in e2e[2:3]]
    jobs += [Job(f"deploy:{m}", [gpu_deploy.__file__, "--model", m, *deploy_argv]) for m in deploy[4:]]
    jobs += [Job(f"e2e:{m}", [me, "--job", "e2e", "--model", m, *(["--dry-run"] if dry else [])]) for m in e2e[3:]]
    jobs.append(Job("onnx", [me, "--job", "onnx", *(["--dry-run"] if dry else [])]))
    return [j for j in jobs if not only or j.name in only or j.name.split(":")[0] in only]


def run_inline(jobs: list[Job], tmp: Path, soft_end: float) -> dict[str, dict[str, Any]]:
    """The dry run: each job's ``main`` in this process, one after another (the same argv as the pool's)."""
    mains = {gpu_train.__file__: gpu_train.main, gpu_deploy.__file__: gpu_deploy.main,
             gpu_decode.__file__: gpu_decode.main, str(Path(__file__).resolve()): main}  # fmt: skip
    done = {}
    for job in jobs:
        out = tmp / f"{job.name.replace(':', '_')}.jsonl"
        os.environ.update({ENV_OUT: str(out), ENV_DEADLINE: str(soft_end)})
        t0 = time.time()
        try:
            status = "ok" if mains[job.argv[0]](job.argv[1:]) == 0 else "failed"
        except Exception as e:  # a dry run reports a broken job like the pool does
            status = f"{type(e).__name__}: {e}"[:300]
        finally:
            os.environ.pop(ENV_OUT)
            os.environ.pop(ENV_DEADLINE)
        done[job.name] = {"rows": read_rows(out), "status": status, "seconds": time.time() - t0, "log_tail": ""}
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny models on CPU, jobs in this process")
    ap.add_argument("--out", type=Path, default=ROOT / "bench", help="directory for the .md and .json")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="from the start (installing the wheels included): no job starts or prepares after this long",
    )
    ap.add_argument("--grace-s", type=float, default=60.0, help="then this long to finish timing before kills")
    ap.add_argument(
        "--wheels",
        type=Path,
        default=None,
        help="install the wheels bench/carry_wheels.py carried into this folder first",
    )
    ap.add_argument("--workers", type=int, default=max(1, min(10, (os.cpu_count() or 2) * 5 // 8)))
    ap.add_argument("--only", default="", help="comma-separated jobs or phases (train, deploy:gpt2-6l, e2e, ...)")
    ap.add_argument("--job", choices=["pytest", "micro", "e2e", "onnx"], help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        return child(args.job, args.model, args.dry_run)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("gpu_suite: needs CUDA (use --dry-run to check the suite on CPU)", file=sys.stderr)
        return 2
    dry, t0, started = args.dry_run, time.monotonic(), time.time()
    device = torch.device("cuda" if cuda and not dry else "cpu")
    wheels = install_wheels(args.wheels) if args.wheels else {"status": "not asked (no --wheels)"}
    backend = backend_description(device)
    print(f"gpu_suite: contraction backend: {backend}; carried wheels: {wheels['status']}", flush=True)
    backends = {p: active_backend(device, dt) for p, dt in gpu_models.DTYPES.items()}  # what fusion is measured on
    meta = {"wheels": wheels, "contract_backends": backends,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "nvmath": cutensor_backend.nvmath_version(), "contract_backend": backend,
            "dry_run": dry, "batches": [1, 2] if dry else [1, 32], "workers": 1 if dry else args.workers,
            "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    jobs = plan(dry, set(filter(None, args.only.split(","))))
    soft_end = started + args.budget_s  # the install's time counts
    with tempfile.TemporaryDirectory() as tmp:
        if dry:
            done = run_inline(jobs, Path(tmp), soft_end)
        else:
            threads = max(1, (os.cpu_count() or 2) // args.workers)
            done = run_jobs(jobs, workers=args.workers, soft_end=soft_end, hard_end=soft_end + args.grace_s,
                            tmp=Path(tmp), compile_threads=threads, log=lambda s: print(s, flush=True))  # fmt: skip
            args.out.mkdir(parents=True, exist_ok=True)
            with open(args.out / "gpu-jobs.log", "w") as fh:  # every job's output, its last 300 lines
                for log in sorted(Path(tmp).glob("*.log")):
                    fh.write(f"===== {log.stem}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-300:]))
                    fh.write("\n")
    data = assemble(meta, done)
    data["meta"]["seconds"] = time.monotonic() - t0
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    stem = "RESULTS-gpu.dry-run" if dry else "RESULTS-gpu"
    (out / f"{stem}.md").write_text(render(data))
    (out / f"{stem.replace('RESULTS', 'results')}.json").write_text(json.dumps(data, indent=1, default=str))
    bad = [k for k, v in done.items() if v["status"] != "ok"]
    print(f"gpu_suite: {data['meta']['seconds']:.0f} s, {len(done) - len(bad)}/{len(done)} jobs ok"
          + (f" (not ok: {', '.join(bad)})" if bad else "") + f"; wrote {out / (stem + '.md')}")  # fmt: skip
    return 0


def assemble(meta: dict[str, Any], done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The suite's JSON: rows by phase, the jobs' statuses, the targets."""
    rows = [r for job in done.values() for r in job["rows"]]
    by = {p: [{k: v for k, v in r.items() if k != "phase"} for r in rows if r.get("phase") == p]
          for p in ("pytest", "micro", "e2e", "note", "onnx", "deploy", "train", "decode")}  # fmt: skip
    peak = [r["peak_tflops"] for r in by["micro"] if "peak_tflops" in r]
    data: dict[str, Any] = {
        "meta": meta, "pytest": by["pytest"][0] if by["pytest"] else {"summary": done.get("pytest", {}).get(
            "status", "not planned")},
        "peak_tflops": peak[0] if peak else math.nan, "micro": [r for r in by["micro"] if "peak_tflops" not in r],
        "e2e": by["e2e"], "notes": by["note"], "onnx": by["onnx"], "deploy": by["deploy"], "train": by["train"],
        "decode": by["decode"],
        "jobs": [{"job": k, **{x: v[x] for x in ("status", "seconds", "log_tail")}, "rows": len(v["rows"])}
                 for k, v in done.items()],
    }  # fmt: skip
    data["targets"] = targets(data)
    return data


if __name__ == "__main__":
    raise SystemExit(main())
