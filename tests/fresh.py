"""Fresh Python processes for tests, forked from a server that has imported torch and nothing else.

Many tests check what a *new* interpreter sees: a saved ``.pt2`` that loads without amplite imported, the CLI's
one-line errors, an output class transformers registers on import. Each ``python -c``/``python -m`` paid
torch's import again (about 2 CPU s; 20-odd such processes in the suite on a 2-core machine). :func:`run` is
``subprocess.run([sys.executable, ...])`` with the same result, but the process is forked from a per-worker
server that imported torch once (``import torch`` is the first thing every one of those scripts does, so
what the child can observe is the same): amplite, transformers and the test's own modules are imported in
the child, as in a new interpreter. Each child gets the given environment, working directory, ``sys.argv``,
``sys.path`` (``''``/the script's folder first, then ``PYTHONPATH``), its own session and fresh stdio, and
exits like ``python`` does (``SystemExit`` codes, a traceback and 1 for an uncaught exception, atexit).

Runs that must start a real interpreter — ``python -m amplite`` as the entry point, signals, memory limits
set before import — keep calling ``subprocess``. ``AMPLITE_TEST_REAL_PROCESSES=1`` makes :func:`run` start
real processes too (to compare).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_SERVER = r"""
import atexit, io, json, os, runpy, signal, sys, traceback, types
import torch  # the one import every fresh process pays: done once here

proto_in, proto_out = os.dup(0), os.dup(1)
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0); os.dup2(null, 1)  # stray output of the server never reaches the protocol
base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
reader = io.open(proto_in, "rb", buffering=0)

def exit_code(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1

def child(req):
    os.setsid()
    os.close(proto_in); os.close(proto_out)
    os.close(null)
    for fd, path, flags in ((0, req["stdin"] or os.devnull, os.O_RDONLY),
                            (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)  # the child holds 0, 1 and 2 only, as a new interpreter does
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import resource
    for which, size in req["rlimits"]:
        resource.setrlimit(which, (size, size))
    os.chdir(req["cwd"])
    os.environ.clear(); os.environ.update(req["env"])
    argv = req["argv"]
    first = {"-c": "", "-m": os.getcwd()}.get(argv[0], os.path.dirname(os.path.abspath(argv[0])))
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *base_path]
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy._run_module_as_main(argv[1], alter_argv=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException as exc:  # as python prints it: from the script's frame on, not this function's
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        code = 1
    try:
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = exit_code(exc)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)

def send(msg):
    os.write(proto_out, (json.dumps(msg) + "\n").encode())

buf = b""
while True:
    while b"\n" not in buf:
        chunk = reader.read(1 << 16)
        if not chunk:
            sys.exit(0)  # the test process went away
        buf += chunk
    line, buf = buf.split(b"\n", 1)
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)
    send({"pid": pid})
    _, status = os.waitpid(pid, 0)
    send({"exit": os.waitstatus_to_exitcode(status)})
"""


class _Server:
    """One fork server per test process, started on first use; it exits when this process closes its stdin."""

    proc: subprocess.Popen[bytes] | None = None
    buf = b""

    @classmethod
    def get(cls) -> subprocess.Popen[bytes]:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        cwd=ROOT)  # fmt: skip
            cls.buf = b""
            atexit.register(cls.close, cls.proc)
        return cls.proc

    @staticmethod
    def close(proc: subprocess.Popen[bytes]) -> None:
        """At exit: end the server (EOF on its stdin) and reap it, so that no process outlives the tests."""
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    @classmethod
    def read(cls, deadline: float | None) -> dict[str, Any] | None:
        """The server's next message, or None at ``deadline``."""
        proc = cls.get()
        assert proc.stdout is not None
        while b"\n" not in cls.buf:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([proc.stdout], [], [], wait)
            if not ready:
                return None
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError("the tests' fork server exited")
            cls.buf += chunk
        line, cls.buf = cls.buf.split(b"\n", 1)
        return json.loads(line)


def run(
    args: Sequence[Any],
    *,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    input: str | None = None,
    rlimits: Mapping[int, int] | None = None,
    capture_output: bool = True,
    text: bool = True,
    stdin: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *args[1:]], capture_output=True, text=True, ...)`` in a forked child.

    Args:
        args: ``[sys.executable, "-c", code, ...]``, ``[sys.executable, "-m", module, ...]`` or
            ``[sys.executable, script, ...]``.
        cwd: Working directory (default: this process's).
        env: The child's whole environment (default: a copy of this process's).
        timeout: Seconds; the child's session is killed and :class:`subprocess.TimeoutExpired` raised after it.
        input: Text on the child's stdin (default: empty).
        rlimits: ``{resource.RLIMIT_AS: bytes, ...}``: soft and hard limits set in the child before it runs
            ``args`` (``preexec_fn`` of a real process).
        capture_output: Must be True, text: must be True (what this helper does; kept so that a
            ``subprocess.run`` call reads the same). stdin: None or ``subprocess.DEVNULL`` (the default).

    Returns:
        The completed process: ``returncode`` (negative for a signal), ``stdout`` and ``stderr`` as text.
    """
    if not (capture_output and text) or stdin not in (None, subprocess.DEVNULL):
        raise ValueError("fresh.run captures text output and reads stdin from `input` only")
    argv = [str(a) for a in args]
    if argv[0] != sys.executable:
        raise ValueError(f"fresh.run starts this interpreter only, not {argv[0]!r}")
    env = dict(os.environ if env is None else env)
    if os.environ.get("AMPLITE_TEST_REAL_PROCESSES") == "1":
        limit = _limiter(dict(rlimits or {}))
        return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout, input=input,
                              preexec_fn=limit)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="amplite-fresh-") as tmp:
        out, err, stdin = Path(tmp, "out"), Path(tmp, "err"), None
        if input is not None:
            stdin = Path(tmp, "in")
            stdin.write_text(input)
        proc = _Server.get()
        assert proc.stdin is not None
        request = {"argv": argv[1:], "env": env, "cwd": str(cwd or os.getcwd()), "stdout": str(out),
                   "stderr": str(err), "stdin": None if stdin is None else str(stdin),
                   "rlimits": sorted((rlimits or {}).items())}  # fmt: skip
        proc.stdin.write((json.dumps(request) + "\n").encode())
        proc.stdin.flush()
        started = _Server.read(None)
        assert started is not None and "pid" in started, started
        done = _Server.read(None if timeout is None else time.monotonic() + timeout)
        if done is None:
            os.killpg(started["pid"], signal.SIGKILL)
            _Server.read(None)  # the server reaped it
            raise subprocess.TimeoutExpired(argv, timeout, out.read_bytes(), err.read_bytes())
        return subprocess.CompletedProcess(argv, done["exit"], out.read_text(), err.read_text())


def _limiter(rlimits: dict[int, int]) -> Any:
    def apply() -> None:
        import resource

        for which, size in rlimits.items():
            resource.setrlimit(which, (size, size))

    return apply
