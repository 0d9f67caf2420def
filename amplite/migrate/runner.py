"""Run the AMP migration codemods over sources and files (the library behind ``amplite migrate``).

Entry points, all CLI-agnostic:

* :func:`migrate_source` rewrites one source string and returns the new code and its warnings.
* :func:`migrate_paths` rewrites files and directories (in place, as a diff, or as a check).
* :func:`format_report` renders a :class:`MigrateReport` as the lines the CLI prints.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import stat
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import libcst as cst

from amplite.migrate._pipeline import DType, mentions_deprecated, migrate_module
from amplite.migrate._reexports import reexported_names
from amplite.migrate._safety import (
    BOUNDED_BYTES,
    FILE_TIMEOUT,
    nesting_problem,
    precheck,
    quiet,
    read_source,
    run_bounded,
    run_in_pool,
)
from amplite.migrate._scan import find_deprecated

Mode = Literal["write", "diff", "check"]

#: Directory names never walked into (besides hidden ones and virtual environments).
_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages"})
_PARSER_PREFIX = re.compile(r"^(?:parser error: )?(?:error at \d+:\d+: )?")


def migrate_source(code: str, *, add_autocast: bool = False, dtype: DType = "bf16") -> tuple[str, list[str]]:
    """Migrate one Python source string to ``torch.amp``.

    Args:
        code: Python source.
        add_autocast: Also add autocast to plain FP32 training loops.
        dtype: ``"bf16"`` or ``"fp16"`` (fp16 also adds a GradScaler).

    Returns:
        The new source (identical to ``code`` when nothing applies) and the warnings.

    Raises:
        libcst.ParserSyntaxError: If ``code`` does not parse.
        ValueError: If it nests too deeply to parse safely (more than ``_safety.MAX_NESTING`` levels).
    """
    problem = nesting_problem(code)
    if problem is not None:
        raise ValueError(f"not migrated: {problem}")
    module, warnings = migrate_module(cst.parse_module(code), add_autocast=add_autocast, dtype=dtype)
    return module.code, warnings


@dataclass
class FileResult:
    """Outcome for one file.

    Attributes:
        path: The file as given (or as found when walking a directory).
        changed: Whether the migration changes (or, in write mode, changed) the file.
        diff: Unified diff of the change ("" if unchanged).
        error: Why the file was skipped (unreadable, unparseable, ...), else None.
        warnings: What the codemods left for a human, as ``"line N: ..."``.
        deprecated: With ``check``: every use of a deprecated AMP API in the file as it is, as
            ``(line, code, api)``, found by a scan independent of what the codemods can rewrite.
        refused: The file was not touched because reading or writing it is unsafe (nesting too deep for
            the parser, a symlink out of the tree, the parser crashed); ``error`` says why.
    """

    path: Path
    changed: bool = False
    diff: str = ""
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    deprecated: list[tuple[int, str, str]] = field(default_factory=list)
    refused: bool = False


@dataclass
class MigrateReport:
    """Results of :func:`migrate_paths`, in the order the files were found."""

    mode: Mode
    files: list[FileResult] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """1 if any file was skipped for an error (all modes) or, with ``check``, would change or still uses
        a deprecated AMP API (whether or not the codemods can rewrite it); else 0."""
        if any(f.error for f in self.files):
            return 1
        return int(self.mode == "check" and any(f.changed or f.deprecated for f in self.files))


def _compiles(text: str) -> bool:
    try:
        with quiet():
            compile(text, "<migrated>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def _atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path``'s content via a temporary file in the same directory, keeping its mode."""
    target = path.resolve()  # write through symlinks rather than replacing them
    mode = stat.S_IMODE(target.stat().st_mode)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".amplite-tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _syntax_error(source: bytes, exc: cst.ParserSyntaxError) -> str:
    """Where and why ``source`` does not parse, preferring CPython's (more precise) message."""
    try:
        with quiet():
            compile(source, "<source>", "exec", dont_inherit=True)
    except SyntaxError as err:
        return f"line {err.lineno}: {err.msg}"
    except (ValueError, RecursionError, MemoryError):
        pass
    return f"line {exc.editor_line}: {_PARSER_PREFIX.sub('', exc.message)}"


def _migrate_file(task: tuple[str, Mode, bool, DType, dict[str, str]]) -> FileResult:
    """Migrate one file; top-level so a process pool can run it."""
    name, mode, add_autocast, dtype, keep = task
    path = Path(name)
    result = FileResult(path)
    try:
        source = read_source(path)
    except OSError as exc:
        result.error = f"cannot read: {exc.strerror or exc}"
        return result
    except ValueError as exc:  # a FIFO, a device, a file too large to parse safely
        result.error, result.refused = str(exc), True
        return result
    found = precheck(source)  # CPython's bounded parser first: libcst crashes on deep nesting
    if found is not None:
        kind, why = found
        result.refused = kind == "deep"
        result.error = f"not parsed: {why}" if result.refused else f"cannot parse: {why}"
        return result
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        result.error = f"cannot parse: {_syntax_error(source, exc)}"
        return result
    except Exception as exc:  # libcst raises a few other types on odd input (encodings, null bytes)
        result.error = f"cannot parse: {exc}"
        return result
    try:
        if mode == "check" and mentions_deprecated(module):
            result.deprecated = [(f.line, f.code, f.api) for f in find_deprecated(module)]
        new_module, result.warnings = migrate_module(module, add_autocast=add_autocast, dtype=dtype, keep=keep)
    except Exception as exc:  # a codemod bug must not abort a run over many files
        result.error = f"internal error, file left unchanged: {type(exc).__name__}: {exc}"
        return result
    new = new_module.bytes
    if new == source:
        return result
    old_text, new_text = source.decode(module.encoding), new.decode(module.encoding)
    if _compiles(old_text) and not _compiles(new_text):
        result.error = "internal error, file left unchanged: the migrated code does not compile"
        return result
    result.changed = True
    result.diff = "".join(
        difflib.unified_diff(
            old_text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            f"a/{name.lstrip('/')}",
            f"b/{name.lstrip('/')}",
        )
    )
    if mode == "write":
        try:
            _atomic_write(path, new)
        except OSError as exc:
            result.error = f"cannot write: {exc.strerror or exc}"
    return result


def _walk(directory: Path) -> Iterator[Path]:
    for root, dirs, files in os.walk(directory):
        base = Path(root)
        dirs[:] = sorted(
            d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS and not (base / d / "pyvenv.cfg").exists()
        )
        yield from (base / f for f in sorted(files) if f.endswith(".py"))


def collect_files(paths: Sequence[str | Path]) -> tuple[list[Path], list[FileResult]]:
    """Expand ``paths`` (files and directories, walked for ``*.py``) into unique files.

    Hidden directories, ``__pycache__``, ``node_modules``, ``site-packages`` and virtual environments are
    not walked. A file given explicitly is taken whatever its suffix.

    A file found by walking a directory that is a symlink to a file outside that directory is refused
    (writing would go through the link to a file outside the tree); a file given explicitly is yours.

    Returns:
        The files, in order, and an error result for each path that does not exist or is refused.
    """
    found: list[Path] = []
    missing: list[FileResult] = []
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            candidates, root = [], path.resolve()
            for candidate in _walk(path):
                target = candidate.resolve()
                if candidate.is_symlink() and root not in target.parents:
                    missing.append(FileResult(candidate, error=f"not touched: a symlink to {str(target)!r}, "
                                              "outside the directory given", refused=True))  # fmt: skip
                else:
                    candidates.append(candidate)
        elif path.is_file() or os.path.lexists(path):  # a FIFO or device: read_source says what it is
            candidates = [path]
        else:
            missing.append(FileResult(path, error="no such file or directory"))
            continue
        for candidate in candidates:
            key = candidate.resolve()
            if key not in seen:
                seen.add(key)
                found.append(candidate)
    return found, missing


def migrate_paths(
    paths: Sequence[str | Path],
    *,
    mode: Mode = "write",
    add_autocast: bool = False,
    dtype: DType = "bf16",
    jobs: int = 1,
    file_timeout: float = FILE_TIMEOUT,
) -> MigrateReport:
    """Migrate Python files to ``torch.amp``.

    Args:
        paths: Files and directories (walked for ``*.py``).
        mode: ``"write"`` rewrites files in place (atomically); ``"diff"`` and ``"check"`` change nothing
            and only fill in each result's ``changed``/``diff``.
        add_autocast: Also add autocast to plain FP32 training loops.
        dtype: ``"bf16"`` or ``"fp16"`` for ``add_autocast``.
        jobs: Worker processes (``<= 0``: one per CPU).
        file_timeout: Seconds a file larger than ``_safety.BOUNDED_BYTES`` may take; it is migrated in a
            child process, killed after that, and the file is skipped.

    Returns:
        The report; files that cannot be read or parsed, are not regular files, are too large or take too
        long are listed with an error (and why) and skipped; the rest are migrated.
    """
    if mode not in ("write", "diff", "check"):
        raise ValueError(f"mode must be 'write', 'diff' or 'check', not {mode!r}")
    if dtype not in ("bf16", "fp16"):
        raise ValueError(f"dtype must be 'bf16' or 'fp16', not {dtype!r}")
    files, missing = collect_files(paths)
    keep = reexported_names(files)
    tasks = [(str(f), mode, add_autocast, dtype, keep[f]) for f in files]
    large = {i for i, f in enumerate(files) if _size(f) > BOUNDED_BYTES}
    small = [t for i, t in enumerate(tasks) if i not in large]
    workers = (os.cpu_count() or 1) if jobs <= 0 else jobs
    crashed = "not touched: the parser crashed on it"
    if workers > 1 and len(small) > 1:
        done = [r if r is not None else FileResult(Path(t[0]), error=crashed, refused=True)
                for t, r in zip(small, run_in_pool(_migrate_file, small, min(workers, len(small))), strict=True)]
    else:
        done = [_migrate_file(task) for task in small]
    by_task = iter(done)
    results = [_bounded(task, file_timeout) if i in large else next(by_task) for i, task in enumerate(tasks)]
    return MigrateReport(mode=mode, files=missing + results)


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _bounded(task: tuple[str, Mode, bool, DType, dict[str, str]], seconds: float) -> FileResult:
    """Migrate a large file in a child process killed after ``seconds`` (libcst can take minutes)."""
    outcome, result = run_bounded(_migrate_file, task, seconds)
    if result is not None:
        return result
    why = (f"not migrated: parsing and rewriting it took longer than {seconds:g} s (--file-timeout)"
           if outcome == "timeout" else "not touched: the parser crashed on it")  # fmt: skip
    return FileResult(Path(task[0]), error=why, refused=True)


def _count(n: int) -> str:
    return f"{n} file{'s' if n != 1 else ''}"


def format_report(report: MigrateReport) -> str:
    """Render ``report`` as the text ``amplite migrate`` prints.

    Diff mode starts with the diffs; then come per-file status lines (``rewrote``/``would rewrite``/
    ``skipped``), warnings as ``path: warning: line N: ...``, and a final count line.
    """
    lines: list[str] = []
    if report.mode == "diff":
        lines.extend(f.diff.rstrip("\n") for f in report.files if f.changed and not f.error)
    for result in report.files:
        if result.error:
            lines.append(f"skipped {result.path}: {result.error}")
        elif result.changed and report.mode != "diff":
            lines.append(f"{'rewrote' if report.mode == 'write' else 'would rewrite'} {result.path}")
        lines.extend(f"{result.path}: warning: {w}" for w in result.warnings)
        lines.extend(
            f"{result.path}:{line}: deprecated AMP API {api}: `{code}`" for line, code, api in result.deprecated
        )
    changed = sum(1 for f in report.files if f.changed and not f.error)
    skipped = sum(1 for f in report.files if f.error)
    unchanged = len(report.files) - changed - skipped
    verb = "rewritten" if report.mode == "write" else "would be rewritten"
    summary = f"{_count(changed)} {verb}, {unchanged} unchanged"
    if skipped:
        summary += f", {skipped} skipped"
    deprecated = sum(1 for f in report.files if f.deprecated)
    if deprecated:
        summary += f"; {_count(deprecated)} still use deprecated AMP APIs"
    lines.append(summary if report.files else "no Python files found")
    return "\n".join(lines)
