"""Running a batch: ``convert_many`` and its streaming form ``iter_convert_many``.

Every job runs in its own worker process (see :mod:`amplite.batch.isolation`). Locally a thread pool of
``workers`` threads supervises those processes; any ``concurrent.futures.Executor`` (a Dask
``client.get_executor()``, Ray's, a ``ProcessPoolExecutor``) can run the supervisors instead, in which
case the output directory must be on storage those machines share.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Any

from amplite.batch import summary as summ
from amplite.batch.isolation import STAGING, cancel_run, forget_run, record_failure, run_isolated
from amplite.batch.keys import job_key
from amplite.batch.manifest import Job, ManifestError, check_unique
from amplite.batch.progress import Progress, make_progress
from amplite.batch.signals import BatchTerminated
from amplite.batch.summary import BatchResult, JobResult
from amplite.batch.worker import RESULT
from amplite.errors import ConfigError, EmitError
from amplite.paths import guard_outputs, not_a_file

#: Seconds a model may take when neither the manifest nor the caller sets a timeout.
DEFAULT_TIMEOUT = 3600.0
#: Memory one conversion needs at least, and per byte of model file (FP32 model, export copies, result).
_MIN_JOB_BYTES, _BYTES_PER_MODEL_BYTE = 2 * 2**30, 4


def cpu_count() -> int:
    """CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes of memory available for new processes (None when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_workers(jobs: Sequence[Job]) -> int:
    """Parallel conversions: no more than the CPUs, the jobs, or what memory allows (each conversion holds
    a few copies of its model: at least 2 GiB, or 4x its largest model file)."""
    sizes = [Path(j.path).stat().st_size for j in jobs if Path(j.path).is_file()]
    per_job = max(_MIN_JOB_BYTES, _BYTES_PER_MODEL_BYTE * max(sizes, default=0))
    mem = available_memory()
    by_memory = max(1, mem // per_job) if mem else cpu_count()
    return max(1, min(cpu_count(), by_memory, len(jobs) or 1))


def _as_jobs(jobs: Sequence[Job | Mapping[str, Any]]) -> list[Job]:
    out = [j if isinstance(j, Job) else Job.from_dict(j) for j in jobs]
    check_unique(out)
    return out


def _prepare(job: Job, out: Path, resume: bool) -> tuple[dict[str, Any] | None, str | None]:
    """(row, key): a row when the job needs no worker (missing file, or resumed), and its resume hash."""
    at = f" (manifest line {job.line})" if job.line else ""
    for label, path in (("model file", job.path), ("inputs file", job.inputs_file)):
        problem = not_a_file(path) if path else None
        if problem is not None:
            return record_failure(
                job.to_dict(),
                str(out),
                "error",
                f"{label} {path!r} {problem}{at} — fix: correct the path",
            ), None
    try:
        key = job_key(job)
    except OSError as exc:
        return record_failure(
            job.to_dict(),
            str(out),
            "error",
            f"cannot read {job.path!r}: {exc}{at} — fix: check its permissions",
        ), None
    if resume:
        prev = summ.read_result(out / job.name)
        files_ok = prev is not None and all((out / job.name / f).is_file() for f in prev.get("files", []))
        if prev is not None and prev.get("status") in summ.CONVERTED and prev.get("key") == key and files_ok:
            return {**prev, "resumed": True}, key
    return None, key


def _local_task(events: SimpleQueue, job: dict[str, Any], out: str, **kw: Any) -> dict[str, Any]:
    events.put(job["name"])
    return run_isolated(job, out, **kw)


def _row_of(fut: Future, job: Job, cause: str) -> dict[str, Any]:
    if fut.cancelled():
        return summ.failure_row(job.to_dict(), "cancelled", f"not run: {cause}")
    exc = fut.exception()
    if exc is not None:  # the executor itself failed (a Dask worker died, a pickling error...)
        return summ.failure_row(
            job.to_dict(),
            "crashed",
            f"the executor failed: {type(exc).__name__}: {exc} — fix: check the executor's logs",
        )
    row = fut.result()
    if row["status"] == "cancelled":
        started = not str(row.get("error", "")).startswith("not run")
        row["error"] = f"{'stopped while running' if started else 'not run'}: {cause}"
    return row


def iter_convert_many(
    jobs: Sequence[Job | Mapping[str, Any]],
    out_dir: str | Path = "amplite-batch",
    *,
    workers: int | None = None,
    executor: Executor | None = None,
    timeout: float | None = None,
    fail_fast: bool = False,
    resume: bool = False,
    progress: bool | str | Progress | None = False,
    summary_meta: Mapping[str, Any] | None = None,
) -> Iterator[JobResult]:
    """Convert many models, yielding each result as it finishes; ``summary.json``/``.md`` are written at
    the end, also when the iteration is stopped (Ctrl-C, ``break``): unfinished models become
    ``cancelled`` and their workers are killed; finished model directories stay.

    Args:
        jobs: :class:`Job` objects or mappings of manifest keys (``name``, ``path``, ``inputs`` ...).
        out_dir: Output directory: ``<name>/`` per model plus the summaries.
        workers: Parallel conversions on this machine (default: :func:`default_workers`); ignored when
            ``executor`` is given.
        executor: Any ``concurrent.futures.Executor`` to run the per-model supervisors on.
        timeout: Seconds per model for jobs that set none (default 3600); the worker is killed after.
        fail_fast: Stop at the first failure (the rest become ``cancelled``).
        resume: Skip models whose output in ``out_dir`` succeeded with the same inputs and settings.
        progress: True/"auto" (rich on a terminal, plain lines otherwise), "plain", "rich", False, or a
            :class:`~amplite.batch.progress.Progress`.
        summary_meta: Extra fields for ``summary.json`` (e.g. ``source``, ``shard``).

    Raises:
        ManifestError: Invalid or duplicate jobs. EmitError: ``out_dir`` cannot be created.
    """
    job_list = _as_jobs(jobs)
    out = Path(out_dir)
    guard_batch_outputs(job_list, out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EmitError(
            f"cannot create output directory {str(out)!r}: {exc}", "choose a writable --out"
        ) from None
    n = workers or default_workers(job_list)
    pool = executor or ThreadPoolExecutor(max_workers=n, thread_name_prefix="amplite-batch")
    kw = {
        "timeout": timeout or DEFAULT_TIMEOUT,
        "run_id": uuid.uuid4().hex,
        "threads": max(1, cpu_count() // n) if executor is None else None,
    }
    prog, events = make_progress(progress), SimpleQueue()
    rows: dict[str, dict[str, Any]] = {}
    futures: dict[Future, Job] = {}
    reason = "the batch was interrupted"
    start, interrupted = time.perf_counter(), False
    prog.start(len(job_list))
    try:
        _remove_stale_staging(out, [j.name for j in job_list])
        for job in job_list:
            row, key = _prepare(job, out, resume)
            if row is not None:
                rows[job.name] = row
                prog.finished(row)
                yield JobResult.from_row(row)
                continue
            args = {**kw, "timeout": job.timeout or kw["timeout"], "key": key}
            if executor is None:
                futures[pool.submit(_local_task, events, job.to_dict(), str(out), **args)] = job
            else:
                futures[pool.submit(run_isolated, job.to_dict(), str(out), **args)] = job
        while futures:
            done, _ = wait(futures, timeout=0.25, return_when=FIRST_COMPLETED)
            _drain(events, prog)
            for fut in done:
                job = futures.pop(fut)
                row = rows[job.name] = _row_of(fut, job, reason)
                prog.finished(row)
                yield JobResult.from_row(row)
                if fail_fast and row["status"] not in summ.CONVERTED and not reason.startswith("--fail-fast"):
                    reason = f"--fail-fast stopped the batch after {job.name!r} failed"
                    _cancel(futures, kw["run_id"])
    except BaseException as exc:  # KeyboardInterrupt, BatchTerminated, GeneratorExit (the caller stopped)
        interrupted = True
        if isinstance(exc, BatchTerminated):
            reason = str(exc)
        _cancel(futures, kw["run_id"])
        raise
    finally:
        if executor is None:
            pool.shutdown(wait=True, cancel_futures=True)
        for fut, job in futures.items():  # finished while we were stopping: keep them
            if fut.done():
                rows[job.name] = _row_of(fut, job, reason)
        forget_run(kw["run_id"])
        final = [
            rows.get(j.name) or summ.failure_row(j.to_dict(), "cancelled", f"not run: {reason}")
            for j in job_list
        ]
        prog.close()
        meta = {
            "source": None,
            "shard": None,
            **(summary_meta or {}),
            "out_dir": str(out),
            "seconds": round(time.perf_counter() - start, 3),
            "interrupted": interrupted,
        }
        summ.write_summary(out, final, meta)
        _remove_empty(out / STAGING)


def guard_batch_outputs(jobs: Sequence[Job], out: Path) -> None:
    """Before anything runs: each model's output directory ``out/<name>/`` is replaced as a whole, so it
    may not be or hold any job's input, and an existing one must be amplite's (it holds ``result.json``).

    Raises:
        ManifestError: Naming the directory and the input, or the foreign directory.
    """
    reads = [(f"{label} of {j.name!r}", p) for j in jobs
             for label, p in (("the model", j.path), ("the inputs file", j.inputs_file), ("the calib dir", j.calib_dir))
             if p]  # fmt: skip
    dirs = [(f"the output directory of {j.name!r} (--out)", out / j.name) for j in jobs]
    summaries = [("the batch summary (--out)", out / n) for n in ("summary.json", "summary.md")]
    try:
        guard_outputs(reads, summaries, [("--out", out)] if out.is_file() else dirs)
        summ.guard_summaries(out, "--out")
    except ConfigError as exc:
        raise ManifestError(exc.problem, exc.fix) from None
    for label, d in dirs:
        if (d.exists() or d.is_symlink()) and not (d.is_dir() and not d.is_symlink() and (d / RESULT).is_file()):
            raise ManifestError(f"{label} {str(d)!r} exists and was not written by amplite (no {RESULT}); "
                                "it would be replaced", "pass another --out, or move that directory away")  # fmt: skip


def _drain(events: SimpleQueue, prog: Progress) -> None:
    while True:
        try:
            prog.started(events.get_nowait())
        except Empty:
            return


def _cancel(futures: Mapping[Future, Job], run_id: str) -> None:
    for fut in futures:
        fut.cancel()
    cancel_run(run_id)


def _remove_stale_staging(out: Path, names: Sequence[str]) -> None:
    """Staging left by a killed batch (only for this batch's models: other shards may share ``out``)."""
    root, wanted = out / STAGING, set(names)
    if root.is_dir():
        for entry in root.iterdir():  # "<name>.<random>" (staging) or "<name>.old.<random>" (replaced output)
            if entry.name.rsplit(".", 1)[0].removesuffix(".old") in wanted:
                shutil.rmtree(entry, ignore_errors=True)


def _remove_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def convert_many(
    jobs: Sequence[Job | Mapping[str, Any]],
    out_dir: str | Path = "amplite-batch",
    *,
    workers: int | None = None,
    executor: Executor | None = None,
    on_result: Callable[[JobResult], Any] | None = None,
    timeout: float | None = None,
    fail_fast: bool = False,
    resume: bool = False,
    progress: bool | str | Progress | None = False,
    summary_meta: Mapping[str, Any] | None = None,
) -> BatchResult:
    """Convert many models, each in its own process; see :func:`iter_convert_many` for the arguments.

    Args:
        on_result: Called with each :class:`JobResult` as it finishes (in the calling thread).

    Returns:
        The batch result (``.exit_code``: 0 all converted and verified, 1 otherwise).

    Raises:
        KeyboardInterrupt: On Ctrl-C, after killing the workers and writing the summary.
    """
    start = time.perf_counter()
    gen = iter_convert_many(
        jobs,
        out_dir,
        workers=workers,
        executor=executor,
        timeout=timeout,
        fail_fast=fail_fast,
        resume=resume,
        progress=progress,
        summary_meta=summary_meta,
    )
    by_name: dict[str, JobResult] = {}
    try:
        for result in gen:
            by_name[result.name] = result
            if on_result is not None:
                on_result(result)
    finally:
        gen.close()
    from amplite.batch.merge import read_summary

    doc = read_summary(Path(out_dir))
    results = [by_name.get(r["name"]) or JobResult.from_row(r) for r in doc["models"]]
    return BatchResult(results, Path(out_dir), time.perf_counter() - start, bool(doc.get("interrupted")))
