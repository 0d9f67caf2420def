"""Real models side by side: amplite vs torch.autocast vs onnxconverter-common, written to RESULTS.md + JSON.

Usage::

    python bench/harness.py [--quick] [--models a,b,...] [--jobs base,onnx,amplite:fp16:O1,...]
                            [--out bench/RESULTS.md] [--json bench/results.json] [--timeout S]

Every (model, job) runs in a fresh subprocess: its peak RSS is its own, a crash or a hang (killed after
``--timeout`` seconds) costs one row, not the run. Models that need ``transformers`` are listed as skipped
when it is not installed (``pip install -e '.[bench]'``). ``--quick`` runs three fixtures and DistilBERT (3 to
7 minutes on 2 CPU cores, by load); the whole corpus takes about 30 minutes (docs/benchmarks.md).

The Markdown is rendered from the JSON; the sections other scripts put into ``--out`` (Big models, the
estimates table, ...) are kept verbatim, and Training comes from ``bench/results-train.md``
(``bench/sections.py``).
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
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from time import perf_counter
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench.corpus import CASES, QUICK, have_transformers  # noqa: E402
from bench.jobs import JOBS  # noqa: E402


def _version(module: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> tuple[str, str | None]:
    """A one-line description of this machine, and of its CUDA device (None without one)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        mem = f", {pages / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        mem = ""
    import torch

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    text = f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores{mem}, torch threads " \
           f"{torch.get_num_threads()}" + (f", CUDA {cuda}" if cuda else ", no CUDA")  # fmt: skip
    return text, cuda


def revision() -> str:
    """``git`` commit of the tree the run measured, with how many files differed from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"commit {head}" + (f" plus {len(dirty)} uncommitted files" if dirty else "")


def run_in_subprocess(model: str, job: str, *, timeout: float, budget: float) -> dict[str, Any]:
    """Run one job in a fresh interpreter; a crash or timeout becomes a record with its error text."""
    with tempfile.TemporaryDirectory(prefix="amplite-harness-") as tmp:
        out = Path(tmp) / "record.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model, job, str(out), "--budget", str(budget)]
        start = perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "error": f"did not finish within {timeout:.0f} s (killed)",
                    "seconds": perf_counter() - start}
        if out.exists():
            return json.loads(out.read_text()) | {"wall_s": perf_counter() - start}
        tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return {"status": "crashed", "error": f"exit code {proc.returncode}: {tail[0][:300]}",
                "seconds": perf_counter() - start}


NOT_REACHED = "not run: the run stopped before this model"


def jobs_of(model: str, jobs: list[str]) -> list[str]:
    """The jobs asked for that ``model`` runs (its case may restrict them, e.g. the full-output variants)."""
    own = CASES[model].jobs
    return [j for j in jobs if own is None or j in own]


def collect(models: list[str], jobs: list[str], *, timeout: float, budget: float, log: Any,
            on_model: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every (model, job) record, models that cannot run listed with the reason.

    ``on_model(results)`` is called after each model, with the models not reached yet marked as such, so
    a run stopped part-way still leaves tables for what it measured.
    """
    results: dict[str, Any] = {m: {"description": CASES[m].description, "jobs": {}, "skip_reason": NOT_REACHED}
                               for m in models}
    hf = have_transformers()
    todo = [(m, j) for m in models for j in jobs_of(m, jobs) if hf or not CASES[m].needs_transformers]
    done = 0
    for name in models:
        case = CASES[name]
        entry: dict[str, Any] = {"description": case.description, "jobs": {}}
        results[name] = entry
        if case.needs_transformers and not hf:
            entry["skip_reason"] = "skipped: transformers is not installed (pip install -e '.[bench]')"
            print(f"{name:14s} skipped (transformers is not installed)", file=log, flush=True)
            continue
        for job in jobs_of(name, jobs):
            done += 1
            rec = run_in_subprocess(name, job, timeout=timeout, budget=budget)
            entry["jobs"][job] = rec
            note = "" if rec["status"] == "ok" else f"  {rec.get('error', '')[:150]}"
            print(f"[{done:3d}/{len(todo)}] {name:14s} {job:16s} {rec['status']:7s} {rec.get('wall_s', 0):6.1f} s"
                  f"{note}", file=log, flush=True)  # fmt: skip
        if on_model is not None:
            on_model(results)
    return results


def meta(command: str, wall_s: float, load_before: tuple[float, ...] = ()) -> dict[str, Any]:
    """Date, machine, load average (1/5/15 min, at the start and now), versions and command of a run."""
    text, cuda = machine()
    versions = {"python": platform.python_version()}
    for pkg in ("amplite", "torch", "transformers", "onnx", "onnxruntime-gpu", "onnxruntime", "onnxscript",
                "onnxconverter-common", "numpy"):
        v = _version(pkg)
        if v != "not installed" or pkg in ("transformers", "onnxconverter-common"):
            versions[pkg] = v
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": text, "cuda": cuda,
            "revision": revision(),
            "versions": versions, "command": command, "wall_s": wall_s,
            "load": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}}


def worker(argv: list[str]) -> None:
    """Subprocess entry: ``--worker MODEL JOB OUT.json --budget S``."""
    import warnings

    warnings.filterwarnings("ignore")
    model, job, out = argv[1:4]
    budget = float(argv[argv.index("--budget") + 1]) if "--budget" in argv else 3.0
    from bench.jobs import run_job

    rec = run_job(model, job, budget)
    Path(out).write_text(json.dumps(rec, default=_json_default))


def _json_default(v: Any) -> Any:
    return str(v)


def _finite(obj: Any) -> Any:
    """JSON-safe: non-finite floats become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _floats(obj: Any) -> Any:
    """Inverse of :func:`_finite`: "inf", "-inf" and "nan" strings back to floats."""
    if obj in ("inf", "-inf", "nan"):
        return float(obj)
    if isinstance(obj, dict):
        return {k: _floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_floats(v) for v in obj]
    return obj


#: A separate harness run of the ONNX loadability models; its rows fill in models the current run lacks.
ONNX_FULL = ROOT / "bench" / "results-onnx-full.json"


def document(results: dict[str, Any], out: Path, supplement: Path | None = ONNX_FULL) -> str:
    """RESULTS.md for ``results``, keeping the sections of the existing ``out`` the harness does not write."""
    from bench.sections import previous_sections
    from bench.sections import supplement as extra_run
    from bench.tables import GENERATED, render

    extra = extra_run(supplement, results["models"], results["meta"].get("date")) if supplement else None
    return render(results, kept=previous_sections(out, GENERATED), extra=_floats(extra) if extra else None) + "\n"


def render_only(json_path: Path, out: Path) -> None:
    """Rewrite the Markdown tables from a results JSON (no model is run)."""
    from amplite.converter.emit import write_text

    write_text(out, document(_floats(json.loads(json_path.read_text())), out))
    print(f"wrote {out} from {json_path}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 fixtures + DistilBERT (3-7 min on 2 cores)")
    ap.add_argument("--models", help=f"comma-separated, from: {', '.join(CASES)}")
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, from: {', '.join(JOBS)}")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results.json")
    ap.add_argument("--timeout", type=float, help="seconds per job (default 300 with --quick, else 1800)")
    ap.add_argument("--budget", type=float, help="seconds of timed runs per latency (default 1 quick, else 3)")
    ap.add_argument("--render", action="store_true", help="only rewrite --out from an existing --json")
    ns = ap.parse_args(argv)
    models = ns.models.split(",") if ns.models else (QUICK if ns.quick else list(CASES))
    jobs = ns.jobs.split(",")
    bad = [m for m in models if m not in CASES] + [j for j in jobs if j not in JOBS]
    if bad:
        ap.error(f"unknown model or job {bad[0]!r}: models are {', '.join(CASES)}; jobs are {', '.join(JOBS)}")
    ns.models, ns.jobs = models, jobs
    ns.timeout = ns.timeout or (300.0 if ns.quick else 1800.0)
    ns.budget = ns.budget if ns.budget is not None else (1.0 if ns.quick else 3.0)
    return ns


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; write the Markdown and JSON results; print the targets summary."""
    ns = parse(argv)
    if ns.render:
        render_only(ns.json, ns.out)
        return {}
    from amplite.converter.emit import write_text
    from bench.targets import evaluate, summary_rows, verdicts

    command = "python bench/harness.py " + " ".join(argv if argv is not None else sys.argv[1:])
    start = perf_counter()
    load_before = os.getloadavg()

    def write(models: dict[str, Any]) -> dict[str, Any]:
        results = {"meta": meta(command.strip(), perf_counter() - start, load_before), "models": models}
        write_text(ns.json, json.dumps(_finite(results), indent=1, default=_json_default) + "\n")
        write_text(ns.out, document(results, ns.out))
        return results

    models = collect(ns.models, ns.jobs, timeout=ns.timeout, budget=ns.budget, log=sys.stdout, on_model=write)
    results = write(models)
    _, summary = evaluate(models)
    print(f"\ntargets: {summary.replace('**', '')}")
    for what, limit, met, missed, na, everywhere, worst in summary_rows(verdicts(models)):
        print(f"  {everywhere:3s} {what} {limit}: {met} met, {missed} missed, {na} n/a; worst {worst}")
    print(f"wrote {ns.out} and {ns.json} ({(perf_counter() - start) / 60:.1f} min)")
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[1:])
    else:
        main()
