"""What keeps ``amplite migrate`` up on hostile sources: nothing too deep reaches libcst, and a crashed
worker costs only its own files.

libcst's native parser overflows its stack (SIGSEGV, nothing printed) on about 2,000 nested brackets or
long unary chains, hangs on long binary-operator chains, and its visitors exceed Python's recursion limit on
deep trees. CPython's parser is bounded in C (it refuses more than 200 nested brackets, and raises
``RecursionError``/``MemoryError`` on deeper expressions without crashing), so it reads every file first.

libcst is also slow and large on big flat files (100 kB of ``x = 1`` lines: 12 s and 490 MB on a loaded
2-core machine; 10 MB aborted the process). So only regular files of at most :data:`MAX_SOURCE_BYTES` are
read (opened non-blocking: a FIFO named ``*.py`` never blocks), and a file over :data:`BOUNDED_BYTES` is
migrated in a forked child process that is killed after a time limit (:func:`run_bounded`).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import multiprocessing
import os
import stat
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: Deepest syntax tree (and bracket nesting) handed to libcst; every construct was checked to parse and
#: migrate in well under a second at 190 levels.
MAX_NESTING = 200
#: Largest source file read at all (training scripts are far smaller; libcst needs ~5 kB of memory per byte).
MAX_SOURCE_BYTES = 2 << 20
#: Files larger than this are migrated in a child process with a time limit (smaller ones take < 2 s).
BOUNDED_BYTES = 64 << 10
#: Default seconds one file may take in that child (``amplite migrate --file-timeout``).
FILE_TIMEOUT = 60.0


# as amplite.paths words them (migrate imports nothing else of amplite)
_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}  # fmt: skip


def read_source(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a source file, if it is a regular file of at most :data:`MAX_SOURCE_BYTES`.

    Opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open file, so a FIFO, a device or a socket
    (named ``*.py``, or swapped in after the directory was walked) is refused without blocking.

    Raises:
        OSError: It cannot be opened or read.
        ValueError: It is not a regular file, or is too large; the message says which.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"not read: it is {_KINDS.get(stat.S_IFMT(st.st_mode), 'a special file')}, "
                             "not a regular file")  # fmt: skip
        if st.st_size > MAX_SOURCE_BYTES:
            raise ValueError(f"not parsed: {st.st_size:,} bytes, more than the {MAX_SOURCE_BYTES >> 20} MiB "
                             "amplite migrates (split the file, or migrate it by hand)")  # fmt: skip
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(MAX_SOURCE_BYTES + 1)
    finally:
        os.close(fd)


def _child(fn: Callable[[T], R], task: T, send: multiprocessing.connection.Connection) -> None:
    try:
        send.send(fn(task))
    except BaseException:  # nothing sent is the parent's "crashed"; no traceback on the user's terminal
        pass
    finally:
        send.close()


def run_bounded(fn: Callable[[T], R], task: T, seconds: float) -> tuple[str, R | None]:
    """``fn(task)`` in a forked child process: ``("ok", result)``, ``("timeout", None)`` when it took
    longer than ``seconds`` (the child is killed), or ``("crashed", None)`` when the child died."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, task, send), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(seconds):
            return "timeout", None
        try:
            return "ok", recv.recv()
        except (EOFError, OSError):
            return "crashed", None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()


def nesting_problem(source: str | bytes) -> str | None:
    """Why ``source`` must not reach libcst because it nests too deeply, else None."""
    found = precheck(source)
    return found[1] if found is not None and found[0] == "deep" else None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Compile user sources without printing their SyntaxWarnings (``"\\d"`` escapes...) to the terminal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def precheck(source: str | bytes) -> tuple[str, str] | None:
    """``("deep", why)`` when ``source`` nests too deeply for libcst, ``("syntax", "line N: msg")`` when
    CPython cannot parse it, else None: only then may libcst see it.

    CPython's own parser reads it first (``PyCF_ONLY_AST``: parse only, bounded in C, never crashes).
    """
    return checked_tree(source, need_tree=False)[0]


#: precheck's verdicts by the source's SHA-256, for one run (:func:`clear_verdicts` starts a run): the
#: re-export scan checks each file once; the migration (in this process, or a child forked after the scan)
#: reads the verdict back instead of checking the same text again.
_VERDICTS: dict[bytes, tuple[str, str] | None] = {}


def clear_verdicts() -> None:
    """Forget the verdicts of an earlier run (they stay bounded by one run's files)."""
    _VERDICTS.clear()


def checked_tree(source: str | bytes, need_tree: bool = True) -> tuple[tuple[str, str] | None, ast.Module | None]:
    """:func:`precheck`'s verdict and, when it is None, the AST CPython built (None with ``need_tree=False``
    for a source checked before in this run: the verdict is read back, nothing is parsed)."""
    raw = source.encode("utf-8", "surrogatepass") if isinstance(source, str) else source
    key = hashlib.sha256(raw).digest() + (b"s" if isinstance(source, str) else b"b")
    if key in _VERDICTS and (_VERDICTS[key] is not None or not need_tree):
        return _VERDICTS[key], None
    verdict, tree = _check(source)
    _VERDICTS[key] = verdict
    return verdict, tree


def _check(source: str | bytes) -> tuple[tuple[str, str] | None, ast.Module | None]:
    try:
        with quiet():
            tree = compile(source, "<source>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    except (RecursionError, MemoryError):
        return ("deep", f"it nests too deeply for CPython's parser (more than {MAX_NESTING} levels are refused)"), None
    except SyntaxError as exc:
        if "too many nested" in str(exc.msg) or "too complex" in str(exc.msg):
            return ("deep", f"line {exc.lineno}: {exc.msg} (more than {MAX_NESTING} levels are refused)"), None
        return ("syntax", f"line {exc.lineno}: {exc.msg}"), None
    except ValueError as exc:  # null bytes, undecodable source
        return ("syntax", str(exc)), None
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            where = f"line {node.lineno}: " if getattr(node, "lineno", None) else ""
            return ("deep", f"{where}expressions nest more than {MAX_NESTING} levels"), None
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return None, tree


def run_in_pool(fn: Callable[[T], R], tasks: list[T], workers: int) -> list[R | None]:
    """``[fn(t) for t in tasks]`` on a process pool; a worker that dies (a crash in a native parser) costs
    only the tasks it had: each is retried alone in a fresh process, and is None if that dies too."""
    results: list[R | None] = [None] * len(tasks)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(fn, task) for task in tasks]
        for i, fut in enumerate(futures):
            with contextlib.suppress(BrokenProcessPool):
                results[i] = fut.result()
    for i, task in enumerate(tasks):
        if results[i] is None:
            with contextlib.suppress(BrokenProcessPool), ProcessPoolExecutor(max_workers=1) as alone:
                results[i] = alone.submit(fn, task).result()
    return results
