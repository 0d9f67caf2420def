"""Parallel jobs for ``bench/gpu_suite.py``: compile on many CPU cores, time on the GPU one job at a time.

On a lent GPU machine the suite's cost is compilation (``torch.export``, amplite's passes, inductor, the
AOTInductor C++ build), which is CPU work; the timed sections are seconds. So every model runs as its own
job (a fresh Python process), several jobs at once, and each job times its variants only while it holds
the GPU lock (``fcntl.flock`` on one file): no two jobs' timed sections overlap. A job's variants are
timed interleaved, round by round, inside one hold of the lock, so what the other jobs do on the CPU at
that moment (compiling) falls on every variant alike.

The child side: :func:`gpu_lock`, :func:`past_deadline` and :func:`emit` read the environment the pool
sets (``AMPLITE_GPU_LOCK``, ``AMPLITE_JOB_DEADLINE``, ``AMPLITE_JOB_OUT``); without it (a job run by hand)
the lock is a no-op, there is no deadline and rows are printed as JSON lines.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_LOCK, ENV_DEADLINE, ENV_OUT = "AMPLITE_GPU_LOCK", "AMPLITE_JOB_DEADLINE", "AMPLITE_JOB_OUT"


# ----------------------------------------------------------------------------------------------- child side
@contextlib.contextmanager
def gpu_lock() -> Iterator[float]:
    """Hold the suite's GPU lock for the block; yields the seconds waited for it."""
    path = os.environ.get(ENV_LOCK)
    if not path:
        yield 0.0
        return
    t0 = time.monotonic()
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield time.monotonic() - t0
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def past_deadline(margin_s: float = 0.0) -> bool:
    """Whether the job should stop preparing new variants (its soft deadline, minus ``margin_s``, passed)."""
    at = os.environ.get(ENV_DEADLINE)
    return at is not None and time.time() > float(at) - margin_s


def emit(row: dict[str, Any]) -> None:
    """Record one result row (appended to the job's JSON-lines file, so a killed job keeps what it wrote)."""
    line = json.dumps(row, default=str)
    path = os.environ.get(ENV_OUT)
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")
    else:
        print(line, flush=True)


# ---------------------------------------------------------------------------------------------- pool side
@dataclass
class Job:
    """One job: a name (``phase:model``), its command line, and its share of the soft deadline."""

    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    out: Path | None = None


def run_jobs(jobs: list[Job], *, workers: int, soft_end: float, hard_end: float, tmp: Path,
             compile_threads: int, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Run ``jobs`` in order, ``workers`` at a time; ``{name: {"rows": [...], "status": ..., "seconds": ...}}``.

    ``soft_end``/``hard_end`` are ``time.time()`` values: no job starts after ``soft_end`` (it is reported
    as not run), each job is told ``soft_end`` as its deadline for starting new work, and whatever still
    runs at ``hard_end`` is killed (its rows so far are kept).
    """
    lock = tmp / "gpu.lock"
    lock.touch()
    queue, running, done = list(jobs), [], {}
    env = dict(os.environ, **{ENV_LOCK: str(lock), ENV_DEADLINE: str(soft_end), "PYTHONUNBUFFERED": "1",
                              "TORCHINDUCTOR_COMPILE_THREADS": str(compile_threads)})  # fmt: skip
    while queue or running:
        while queue and len(running) < workers and time.time() < soft_end:
            job = queue.pop(0)
            job.out = tmp / f"{job.name.replace(':', '_')}.jsonl"
            log_fh = open(tmp / f"{job.name.replace(':', '_')}.log", "w")  # noqa: SIM115 - closed with the process
            job.proc = subprocess.Popen([sys.executable, *job.argv], env=dict(env, **{ENV_OUT: str(job.out)}),
                                        stdout=log_fh, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            job.started = time.time()
            running.append(job)
            log(f"  start {job.name}")
        if not running and (not queue or time.time() >= soft_end):
            break
        time.sleep(0.5)
        for job in list(running):
            assert job.proc is not None
            rc = job.proc.poll()
            killed = rc is None and time.time() >= hard_end
            if killed:
                os.killpg(job.proc.pid, signal.SIGKILL)
                rc = job.proc.wait()
            if rc is None:
                continue
            running.remove(job)
            status = "killed at the suite's time limit" if killed else ("ok" if rc == 0 else f"exit {rc}")
            done[job.name] = {"rows": read_rows(job.out), "status": status, "seconds": time.time() - job.started,
                              "log_tail": _tail(tmp / f"{job.name.replace(':', '_')}.log")}  # fmt: skip
            log(f"  {job.name}: {status} after {done[job.name]['seconds']:.0f} s, {len(done[job.name]['rows'])} rows")
    for job in queue:
        done[job.name] = {"rows": [], "status": "not run: budget", "seconds": 0.0, "log_tail": ""}
    return done


def read_rows(path: Path | None) -> list[dict[str, Any]]:
    if path is None or not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill
            rows.append(json.loads(line))
    return rows


def _tail(path: Path, n: int = 6) -> str:
    if not path.exists():
        return ""
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return "\n".join(lines[-n:])[-1500:]
