"""What runs inside a worker process: one ``amplite.convert`` call, its outputs saved into the job's
staging directory, and a small JSON summary row written to ``result.json`` there.

Started by :mod:`amplite.batch.isolation`: forked from :mod:`amplite.batch.zygote`, which has torch
already imported, or as a fresh interpreter; both call :func:`main`.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from amplite.batch.summary import failure_row, write_json

RESULT, LOG, JOB = "result.json", "worker.log", "job.json"


def main(argv: list[str] | None = None) -> int:
    """Worker entry point: ``argv[0]`` is ``STAGING/job.json``; writes ``STAGING/result.json``."""
    job_path = Path((argv if argv is not None else sys.argv[1:])[0])
    job = json.loads(job_path.read_text())
    if job.get("max_memory_gb"):
        import resource

        limit = int(job["max_memory_gb"] * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    faulthandler.enable()  # a segfault prints where it happened into worker.log
    if hasattr(signal, "SIGUSR1"):  # the supervisor sends SIGUSR1 before killing a hung worker
        faulthandler.register(signal.SIGUSR1, all_threads=False)
    write_json(job_path.parent / RESULT, convert_job(job, job_path.parent))
    return 0


def convert_job(job: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run ``amplite.convert`` for one job, save its outputs into ``out`` and return the summary row."""
    start = time.perf_counter()
    try:
        from amplite.api import convert
        from amplite.batch.manifest import Job

        result = convert(job["path"], _inputs(job), options=Job.from_dict(job).options)
        files = [result.save(out / f"model.{fmt}", format=fmt).name for fmt in job["formats"]]
        result.report.save(out / "report.json")
        row = _success_row(job, result)
        row["files"] = [*files, "report.json"]
    except Exception as exc:
        row = failure_row(job, *_classify(exc))
    row["convert_seconds"] = round(time.perf_counter() - start, 3)
    return row


def _inputs(job: dict[str, Any]) -> Any:
    """Example inputs as the CLI builds them: an inputs file, plus specs as keyword inputs."""
    from amplite.converter.inputs import inputs_from_specs, load_inputs_file

    inputs = load_inputs_file(job["inputs_file"]) if job.get("inputs_file") else None
    if job.get("inputs"):
        _, named = inputs_from_specs(list(job["inputs"]), seed=job.get("seed", 0))
        inputs = ((), named) if inputs is None else (inputs[0], {**inputs[1], **named})
    return inputs


def _success_row(job: dict[str, Any], result: Any) -> dict[str, Any]:
    from amplite.report.checks import Verification
    from amplite.report.sections import Graph, Weights
    from amplite.verify.numbers import decode_float, encode_float

    report = result.report
    original = result.original
    params = sum(
        int(original.state_dict[n].numel())
        for n in original.graph_signature.parameters
        if n in original.state_dict
    )
    outputs = report.verified_outputs
    floats = [decode_float(o.sqnr_db) for o in outputs if (o.dtype or "").startswith(("float", "bfloat"))]
    sqnrs = [v for v in floats if v is not None]
    worst = min(sqnrs) if sqnrs else None
    status = {True: "ok", False: "verify_failed"}.get(result.passed, "unverified")  # None: verify off
    graph, weights = report.section(Graph), report.section(Weights)
    after = graph.after if graph is not None else None
    row = failure_row(job, status, None)
    row.update(
        params=params,
        low_precision_share=round(float(after.low_precision_flop_share or 0.0), 4) if after is not None else None,
        casts=int(after.casts or 0) if after is not None else None,
        size_ratio=float(weights.ratio) if weights is not None and weights.ratio is not None else None,
        worst_sqnr_db=encode_float(round(worst, 2)) if worst is not None else None,
        verified=result.passed,
    )
    if result.passed is False:
        detail = "; ".join(
            f"{o.name}: SQNR {_db(o.sqnr_db)} dB, cosine {_cos(o.cosine)}"
            + (f" ({', '.join(o.notes)})" if o.notes else "")
            for o in outputs
            if o.passed is False
        )
        ver = report.section(Verification)
        tol = ver.tolerance if ver is not None else None
        row["error"] = (
            f"verification failed: {detail} (needs SQNR >= {tol.min_sqnr_db if tol else None} dB, cosine >= "
            f"{tol.min_cosine if tol else None}) — fix: keep the offending ops in FP32 (keep_fp32) or loosen "
            "'tolerance'; the converted model and report.json are kept for inspection"
        )
    return row


def _db(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else str(value)


def _cos(value: Any) -> str:
    return f"{value:.5f}" if isinstance(value, (int, float)) else str(value)


def _classify(exc: BaseException) -> tuple[str, str]:
    """(status, one-line error) for an exception raised by a conversion."""
    from amplite.describe import summarize_exception
    from amplite.errors import AmpliteError, path_error

    chain, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in reversed(chain):  # the innermost allocation failure says the most
        text = str(e)
        if isinstance(e, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower():
            return "oom", (
                f"out of memory: {summarize_exception(e)} — fix: give it more memory (max_memory_gb, "
                "fewer --jobs) or convert it on a larger machine"
            )
    if isinstance(exc, AmpliteError):
        return "error", exc.one_line()
    refused = path_error(exc)
    if refused is not None:
        return "error", refused.one_line()
    return "error", (
        f"internal error: {summarize_exception(exc)} — fix: reproduce with `amplite convert --debug`"
        " and report it"
    )
