"""A warm fork server for batch workers: one interpreter imports torch and amplite once, then forks a fresh
process per conversion (about 3 s saved per model against starting a new interpreter).

Unlike ``multiprocessing``'s fork server it never re-imports the caller's ``__main__``, so scripts that call
``convert_many`` without an ``if __name__ == "__main__"`` guard work. Protocol: JSON lines. The client
writes ``{"id", "job", "cwd", "env", "sys_path", "threads"}``; the server answers ``{"id", "pid"}`` once
forked and ``{"id", "exit"}`` (the exit code, negative for a signal) when the child ends. Children start
their own session, so Ctrl-C in the terminal does not reach them: the supervisor kills them instead. When
the client goes away (stdin closes), the server kills its remaining children and exits.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from amplite.batch.worker import LOG

#: Modules the server imports once, so that each forked worker starts warm.
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.export",
    "amplite",
    "amplite.api",
    "amplite.batch.worker",
)
_PKG_ROOT = str(Path(__file__).resolve().parents[2])


def serve() -> None:
    """The server loop (``python -c 'from amplite.batch.zygote import serve; serve()'``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client decides when workers stop
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(Exception):  # a worker that needs it reports the import error itself
            importlib.import_module(name)
    inp, out = sys.stdin.fileno(), sys.stdout.fileno()
    children: dict[int, int] = {}
    buf = b""
    while True:
        ready, _, _ = select.select([inp], [], [], 0.05)
        if ready:
            chunk = os.read(inp, 1 << 16)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                request = json.loads(line)
                pid = _fork(request)
                children[pid] = request["id"]
                _send(out, {"id": request["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _send(out, {"id": children.pop(pid, None), "exit": os.waitstatus_to_exitcode(status)})
    for pid in children:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _send(fd: int, msg: dict[str, Any]) -> None:
    os.write(fd, json.dumps(msg).encode() + b"\n")


def _fork(request: dict[str, Any]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: detach, log to the job's staging directory, take the caller's context, convert
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        job_path = request["job"]
        log = os.open(Path(job_path).parent / LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        for src, dst in ((null, 0), (log, 1), (log, 2)):
            os.dup2(src, dst)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = request["sys_path"]
        if request.get("threads"):
            import torch

            torch.set_num_threads(int(request["threads"]))
        from amplite.batch.worker import main

        code = main([job_path])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class Child:
    """A worker forked by the server: its pid and, once it ended, its exit code."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.exit: int | None = None
        self.lost = False  # the server died: the exit code is unknown
        self.started = threading.Event()
        self.done = threading.Event()

    def wait(self, timeout: float | None) -> int | None:
        """The exit code, or None if it is still running after ``timeout`` seconds."""
        if not self.done.wait(timeout):
            return None
        return self.exit if self.exit is not None else -signal.SIGKILL

    def kill(self) -> None:
        """SIGKILL its process group (and itself, in case it had not called setsid yet)."""
        if self.pid is None or self.done.is_set():
            return
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(self.pid, signal.SIGKILL)


class Server:
    """Client side: starts the server process and forks workers through it."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_ROOT, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from amplite.batch.zygote import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.children: dict[int, Child] = {}
        self.reader = threading.Thread(target=self._read, name="amplite-zygote", daemon=True)
        self.reader.start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, job_path: str, threads: int | None) -> Child:
        """Fork a worker for ``job_path`` with this process's cwd, environment and sys.path."""
        child = Child()
        request = {"job": job_path, "cwd": os.getcwd(), "env": dict(os.environ), "sys_path": sys.path,
                   "threads": threads}  # fmt: skip
        with self.lock:
            request["id"] = next(self.ids)
            self.children[request["id"]] = child
            try:
                self.proc.stdin.write(json.dumps(request).encode() + b"\n")
                self.proc.stdin.flush()
            except OSError:
                self.children.pop(request["id"], None)
                child.lost = True
                child.started.set()
                child.done.set()
        return child

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.lock:
                child = self.children.get(msg["id"])
                if child is not None and "exit" in msg:
                    del self.children[msg["id"]]
            if child is None:
                continue
            if "exit" in msg:
                child.exit = msg["exit"]
                child.done.set()
            else:
                child.pid = msg["pid"]
                child.started.set()
        with self.lock:  # the server died: nobody will report on these children
            lost, self.children = list(self.children.values()), {}
        for child in lost:
            child.lost = True
            child.started.set()
            child.done.set()

    def close(self) -> None:
        """Stop the server (it kills any children still running)."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


_SERVER: Server | None = None
_SERVER_LOCK = threading.Lock()


def server() -> Server:
    """The process-wide server, started on first use (and again if it died)."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or not _SERVER.alive:
            _SERVER = Server()
        return _SERVER
