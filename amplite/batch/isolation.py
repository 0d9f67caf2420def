"""Supervising one conversion in its own process: start it, enforce the timeout, read its result, install
its output.

:func:`run_isolated` (which any ``concurrent.futures`` executor can call) writes the job into a private
staging directory under ``OUT/.staging``, starts a worker process in its own session and waits with a hard
timeout. A crash, a hang or an out-of-memory kill ends only that process. The staging directory becomes
``OUT/<name>/`` by a rename, so a model directory is never half-written; a cancelled job leaves nothing
behind and keeps any previous result.

Workers are forked from a warm fork server (:mod:`amplite.batch.zygote`) that has torch imported, which
saves about 3 s per model; without ``fork`` (Windows), or with ``AMPLITE_BATCH_START=subprocess``, each
starts as a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from amplite.batch import zygote
from amplite.batch.summary import UMASK, failure_row, write_json
from amplite.batch.worker import JOB, LOG, RESULT

STAGING = ".staging"
#: Statuses whose model files are kept (a model that converted but failed verification can be inspected).
KEEP_FILES = ("ok", "unverified", "verify_failed")
#: Set to ``subprocess`` to start every worker as a fresh interpreter.
START_ENV = "AMPLITE_BATCH_START"
_PKG_ROOT = str(Path(__file__).resolve().parents[2])
_WORKER_CMD = "import sys; from amplite.batch.worker import main; sys.exit(main(sys.argv[1:]))"

_STDLIB = sysconfig.get_paths()["stdlib"]
_LOCK = threading.Lock()
_LIVE: dict[str, set[Any]] = {}
_CANCELLED: set[str] = set()


def cancel_run(run_id: str) -> None:
    """Kill every worker process of batch ``run_id`` in this process and start no more of them."""
    with _LOCK:
        _CANCELLED.add(run_id)
        procs = list(_LIVE.get(run_id, ()))
    for proc in procs:
        proc.kill()


def forget_run(run_id: str) -> None:
    """Drop the bookkeeping of a finished batch."""
    with _LOCK:
        _CANCELLED.discard(run_id)
        _LIVE.pop(run_id, None)


def _cancelled(run_id: str) -> bool:
    with _LOCK:
        return run_id in _CANCELLED


def run_isolated(
    job: dict[str, Any],
    out_dir: str,
    *,
    timeout: float | None,
    run_id: str,
    threads: int | None = None,
    key: str | None = None,
) -> dict[str, Any]:
    """Convert one job in its own worker process and install its output as ``out_dir/<name>/``.

    Args:
        job: ``Job.to_dict()``.
        out_dir: The batch output directory (on storage this process can write).
        timeout: Seconds before the worker is killed (None: no limit).
        run_id: The batch's id, for :func:`cancel_run`.
        threads: CPU threads for the worker's torch (None: torch's default).
        key: The resume hash, stored in the result.

    Returns:
        The summary row (a JSON-able dict); a failed conversion is a row, not an exception.
    """
    name, start = job["name"], time.perf_counter()
    if _cancelled(run_id):
        return failure_row(job, "cancelled", "not run: the batch was stopped before this model started")
    staging = _new_staging(Path(out_dir), name)
    try:
        write_json(staging / JOB, job)
        rc, timed_out = _run(staging, run_id, threads, timeout)
        log = (staging / LOG).read_text(errors="replace") if (staging / LOG).exists() else ""
        row = None if timed_out else _read_row(staging / RESULT)
        if row is None and _cancelled(run_id):
            return failure_row(job, "cancelled", "stopped: the batch was interrupted while this model ran")
        if timed_out:
            where = _frame(log)
            row = failure_row(
                job,
                "timeout",
                f"timed out after {timeout:g} s and was killed{f' (it was at {where})' if where else ''}"
                " — fix: raise its timeout (manifest 'timeout' or --timeout) if it is only slow",
            )
        elif row is None:
            row = failure_row(job, "crashed", _crash_message(rc, log))
        row.update(seconds=round(time.perf_counter() - start, 3), key=key, output_dir=name)
        if row["status"] not in KEEP_FILES:  # no partial model files next to a failure
            for f in staging.iterdir():
                if f.name not in (JOB, LOG):
                    shutil.rmtree(f) if f.is_dir() else f.unlink()
            row["files"] = []
        write_json(staging / RESULT, row)
        install(staging, Path(out_dir) / name)
        return row
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def record_failure(
    job: dict[str, Any], out_dir: str, status: str, error: str, key: str | None = None
) -> dict[str, Any]:
    """Write a failure found before any worker started (e.g. a missing file) as ``out_dir/<name>/``."""
    row = failure_row(job, status, error)
    row.update(key=key, output_dir=job["name"])
    staging = _new_staging(Path(out_dir), job["name"])
    try:
        write_json(staging / JOB, job)
        write_json(staging / RESULT, row)
        install(staging, Path(out_dir) / job["name"])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return row


def _new_staging(out: Path, name: str) -> Path:
    root = out / STAGING
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=root))
    staging.chmod(0o777 & ~UMASK)  # mkdtemp makes it private; outputs should be as readable as any file
    return staging


def install(staging: Path, dest: Path) -> None:
    """Replace ``dest`` with ``staging`` by renames (same file system), removing the old one after."""
    trash = None
    if dest.exists() or dest.is_symlink():
        trash = staging.parent / f"{dest.name}.old.{uuid.uuid4().hex[:8]}"
        os.replace(dest, trash)
    os.replace(staging, dest)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True) if trash.is_dir() else trash.unlink()


class _Fresh:
    """A worker started as a fresh interpreter (same interface as :class:`zygote.Child`)."""

    def __init__(self, staging: Path, threads: int | None) -> None:
        env = dict(os.environ)
        # It must import amplite and the job's model factory as `amplite convert` run here would.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PKG_ROOT, os.getcwd(), env.get("PYTHONPATH", "")) if p
        )
        if threads:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        with open(staging / LOG, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_CMD, str(staging / JOB)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.pid: int | None = self.proc.pid

    def wait(self, timeout: float | None) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL) if hasattr(os, "killpg") else self.proc.kill()


#: Seconds the fork server may take to import torch before the first worker forks.
_SERVER_START_LIMIT = 600.0


def _start(staging: Path, threads: int | None) -> Any:
    if os.environ.get(START_ENV) == "subprocess" or not hasattr(os, "fork"):
        return _Fresh(staging, threads)
    child = zygote.server().fork(str(staging / JOB), threads)
    child.started.wait(_SERVER_START_LIMIT)  # the timeout counts from the fork, not the server's start
    return child


def _run(staging: Path, run_id: str, threads: int | None, timeout: float | None) -> tuple[int, bool]:
    """Run the worker to its end: (exit code, whether it was killed for the timeout)."""
    proc = _start(staging, threads)
    with _LOCK:
        _LIVE.setdefault(run_id, set()).add(proc)
        cancelled = run_id in _CANCELLED
    try:
        if cancelled:
            proc.kill()
        rc = proc.wait(timeout)
        if rc is not None:
            return rc, False
        if hasattr(signal, "SIGUSR1") and proc.pid:  # ask faulthandler where it hangs, then kill
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGUSR1)
                proc.wait(0.5)
        proc.kill()
        rc = proc.wait(30)
        return (rc if rc is not None else -signal.SIGKILL), True
    finally:
        with _LOCK:
            _LIVE.get(run_id, set()).discard(proc)


def _read_row(path: Path) -> dict[str, Any] | None:
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return row if isinstance(row, dict) and "status" in row else None


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)
_DUMP_HEADS = ("Stack (most recent call first)", "Current thread", "Fatal Python error", "Thread 0x")


def _frame(log: str) -> str:
    """The innermost user frame of the last faulthandler dump in ``log`` ('' when there is none)."""
    cut = max(log.rfind(head) for head in _DUMP_HEADS)
    if cut < 0:
        return ""
    frames = list(_FRAME.finditer(log[cut:]))
    skip = ("/torch/", "site-packages", "/amplite/", "<frozen")
    user = [f for f in frames if not any(s in f["file"] for s in skip) and not f["file"].startswith(_STDLIB)]
    user = user or frames
    return f"{user[0]['file']}:{user[0]['line']} in {user[0]['func']}" if user else ""


def _crash_message(rc: int, log: str) -> str:
    where = _frame(log)
    at = f" at {where}" if where else ""
    if rc < 0:
        sig = signal.Signals(-rc)
        if sig == signal.SIGKILL:
            return (
                f"the worker was killed by SIGKILL{at}, usually by the kernel's out-of-memory killer"
                " — fix: set max_memory_gb, lower --jobs, or convert it on a machine with more memory"
            )
        return (
            f"the worker crashed with {sig.name} ({signal.strsignal(sig) or 'signal'}){at}"
            " — fix: see worker.log in its output directory; reproduce with `amplite convert --debug`"
        )
    tail = [ln.strip() for ln in log.strip().splitlines() if ln.strip()][-1:] or ["no output"]
    return (
        f"the worker exited with code {rc}{at}: {tail[0][:300]} — fix: see worker.log in its output directory"
    )
