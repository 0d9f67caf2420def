"""Output paths never overwrite what a run reads, nor each other: one check for every command.

:func:`guard_outputs` is called by every command that writes (``convert``/``convert_to_files``, ``check``,
``golden``, ``batch``) before any work starts. Two paths are the same when they resolve to the same path
(:meth:`Path.resolve` follows symlinks) or, when both exist, are the same file (``st_dev``/``st_ino``: hard
links). A *directory* output (a golden directory, a batch's per-model directory) is replaced as a whole,
so it may not be or contain an input either.

:func:`derived_output` guards names amplite makes up itself (``m.fp16.O1.pt2`` next to ``m.pt2``): they
never replace an existing file that amplite did not write.

:func:`check_output` is the one rule for what an output path may be, applied by every writer (the atomic
writes of ``amplite.converter.emit``, batch summaries and logs, golden and checkpoint directories): a regular
file or nothing (a directory for directory outputs). A symlink is never followed nor replaced, and a device,
FIFO or socket is refused: an atomic rename over ``/dev/stdout`` would replace the device node. ``-`` means
standard output where a command documents it (:data:`STDOUT`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from amplite.errors import ConfigError

#: The path that means standard output (``--report -``, ``--junit -``) where a writer supports it.
STDOUT = "-"

_KINDS = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO (named pipe)",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFREG: "a regular file"}  # fmt: skip


def mode_kind(mode: int) -> str:
    """A file type (``st_mode``) in words: ``"a FIFO (named pipe)"``, ``"a character device"``..."""
    return "a symbolic link" if stat.S_ISLNK(mode) else _KINDS.get(stat.S_IFMT(mode), "a special file")


def file_kind(path: str | Path) -> str | None:
    """What ``path`` is, in words (``"a FIFO (named pipe)"``, ``"a symbolic link"``...), without following a
    final symlink; None when nothing is there (or it cannot be looked at)."""
    try:
        mode = os.lstat(path).st_mode
    except (OSError, ValueError):
        return None
    return mode_kind(mode)


def check_output(path: str | Path, label: str = "the output", *, directory: bool = False) -> None:
    """Refuse an output path that amplite would follow, replace or block on.

    Args:
        path: Where a file (or, with ``directory``, a directory) is about to be written.
        label: The option or file for messages (``--report``, ``the batch summary``).
        directory: The output is a directory (an existing directory is then fine, a file is not).

    Raises:
        ConfigError: ``path`` is a symlink (to anything), a device, a FIFO or a socket, or the wrong one of
            file and directory.
    """
    kind = file_kind(path)
    wanted = "a directory" if directory else "a regular file"
    if kind is None or kind == wanted:
        return
    if kind == "a directory" and not directory:
        return  # the writers say "is a directory" with their own fix (emit.check_writable)
    shown = repr(str(path))
    if kind == "a symbolic link":
        try:
            target = f" to {os.readlink(path)!r}"
        except OSError:
            target = ""
        raise ConfigError(
            f"{label} {shown} is a symbolic link{target}: amplite never writes through or replaces a link",
            "pass the path of the file itself (or - for standard output: convert --report -, check --junit -), or "
            "remove the link",
        )
    raise ConfigError(
        f"{label} {shown} is {kind}, not {wanted}: writing would replace or block on it",
        f"pass a {'directory' if directory else 'file'} path"
        + ("" if directory else " (or - for standard output: convert --report -, check --junit -)"),
    )


#: (label for messages, path) pairs, e.g. ("the model", Path("m.pt2")), ("--report", Path("r.json")).
Labelled = Iterable[tuple[str, str | Path | None]]


def _key(p: Path) -> tuple[Path, tuple[int, int] | None]:
    resolved = Path(os.path.abspath(p)).resolve()
    try:
        st = os.stat(p)
    except OSError:
        return resolved, None
    return resolved, (st.st_dev, st.st_ino)


def same_path(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` name the same file (resolved path, or same inode when both exist)."""
    (ra, ia), (rb, ib) = _key(Path(a)), _key(Path(b))
    return ra == rb or (ia is not None and ia == ib)


def _option(label: str) -> str:
    """The option a label names: ``--report``, or the part in parentheses (``the default output (-o)``)."""
    return label[label.index("(") + 1 : label.index(")")] if "(" in label else label.split()[0]


def guard_outputs(inputs: Labelled, outputs: Labelled, directories: Labelled = ()) -> None:
    """Refuse a run whose outputs would overwrite one of its inputs or another of its outputs.

    Args:
        inputs: What the run reads (model file or directory, inputs file, data and golden directories...).
        outputs: Files the run writes.
        directories: Directories the run replaces as a whole (they may not be or contain an input).

    Raises:
        ConfigError: Naming both paths and the option to change; an output that is a link, a device, a
            FIFO or a socket (:func:`check_output`).
    """
    outputs = [(label, p) for label, p in outputs if p is not None and str(p) != STDOUT]
    directories = [(label, p) for label, p in directories if p is not None]
    ins = [(label, Path(p), *_key(Path(p))) for label, p in inputs if p is not None]
    outs = [(label, Path(p), *_key(Path(p))) for label, p in outputs]
    dirs = [(label, Path(p), *_key(Path(p))) for label, p in directories]
    by_path: dict[Path, tuple[str, Path]] = {}  # every input, and every folder above one
    by_inode: dict[tuple[int, int], tuple[str, Path]] = {}
    exact: dict[Path, tuple[str, Path]] = {}
    for what, src, resolved, inode in ins:
        exact.setdefault(resolved, (what, src))
        for q in (resolved, *resolved.parents):
            by_path.setdefault(q, (what, src))
        if inode is not None:
            by_inode.setdefault(inode, (what, src))
    for label, out, resolved, inode in outs + dirs:
        hit = exact.get(resolved) or (by_inode.get(inode) if inode else None)
        if hit is not None:
            raise ConfigError(
                f"{label} {str(out)!r} is {hit[0]} {str(hit[1])!r}: writing it would overwrite what this run reads",
                f"pass another {_option(label)} path",
            )
    for label, d, resolved, _ in dirs:
        if resolved in by_path:
            what, src = by_path[resolved]
            raise ConfigError(
                f"{label} {str(d)!r} holds {what} {str(src)!r}, and it is replaced as a whole: "
                "that would delete what this run reads",
                f"pass another {_option(label)} directory, outside the inputs",
            )
    seen: dict[Any, tuple[str, Path]] = {}
    for label, path, resolved, inode in outs + dirs:
        for key in (resolved, inode):
            if key is not None and key in seen:
                other, first = seen[key]
                raise ConfigError(f"{other} and {label} are the same path {str(first)!r}: one would overwrite the "
                                  f"other", f"give {_option(other)} and {_option(label)} different paths")  # fmt: skip
            if key is not None:
                seen[key] = (label, path)
    dir_paths = {r: (label, d) for label, d, r, _ in dirs}
    for label, path, resolved, _ in outs + dirs:
        above = next((dir_paths[q] for q in resolved.parents if q in dir_paths), None)
        if above is not None:
            raise ConfigError(f"{label} {str(path)!r} is inside {above[0]} {str(above[1])!r}, which is replaced "
                              "as a whole", f"give {_option(label)} a path outside it")  # fmt: skip
    for label, p in outputs:  # after the overlaps: "-o is the model" says more than "-o is a link"
        check_output(p, label)
    for label, p in directories:
        check_output(p, label, directory=True)


def derived_output(path: Path, ours: Callable[[Path], bool], label: str = "the default output",
                   fix: str = "pass -o with the output path (an existing file is only replaced when named "
                   "explicitly)") -> Path:  # fmt: skip
    """A name amplite derived (no ``-o``, or a file it puts in an ``-o`` directory: a batch's
    ``summary.json``), unless it would replace a file amplite did not write.

    Args:
        path: The derived name.
        ours: Whether an existing ``path`` was written by amplite for this same run (then it is replaced).
            Called only on a regular file (a link or special file is never amplite's).
        label: What ``path`` is, for the message.
        fix: What to do instead.

    Raises:
        ConfigError: ``path`` exists and is not amplite's output.
    """
    kind = file_kind(path)
    if kind is not None and (kind != "a regular file" or not ours(path)):
        what = "" if kind == "a regular file" else f" (it is {kind})"
        raise ConfigError(f"{label} {str(path)!r} already exists{what} and amplite did not write it", fix)
    return path


def not_a_file(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as a file, in words, else None: ``"does not exist"``, ``"is a FIFO (named
    pipe), not a regular file"`` (a FIFO would block a reader, ``/dev/zero`` never ends), ``"is a
    directory, not a regular file"``. A symlink is followed (the caller decides whether links may be read)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is a broken symbolic link" if os.path.islink(path) else "does not exist"
    except (OSError, ValueError) as exc:
        return f"cannot be read ({getattr(exc, 'strerror', None) or exc})"
    if stat.S_ISREG(mode):
        return None
    return f"is {mode_kind(mode)}, not a regular file"


def inside(root: Path, name: object, what: str, place: str, fix: str) -> Path:
    """``root / name`` when it is a plain file name inside ``root``: no ``..``, absolute path, or symlink (a
    link could lead out of the directory the user named). The one rule for files read from a directory
    (checkpoint shards, ``--data``/``--calib`` batches, golden files).

    Args:
        root: The directory.
        name: The file name (from a listing, or from a file such as an index: checked to be a name).
        what: What the file is, for messages (``"shard"``, ``"data file"``).
        place: The directory in words (``"the checkpoint directory"``).
        fix: What to do about a link.

    Raises:
        LoadError: ``name`` leaves the directory, cannot be a file name, or is a symlink.
    """
    from amplite.errors import LoadError

    if not isinstance(name, str) or not name or name != Path(name).name or name in (".", ".."):
        raise LoadError(f"{root}: {what} {name!r} is not a file name inside {place}",
                        f"keep every file in {place} itself (no paths, no '..')")  # fmt: skip
    path = root / name
    try:
        link = path.is_symlink()
    except OSError as exc:  # a name the file system refuses (too long, invalid bytes): not a file of this directory
        raise LoadError(f"{root}: {what} {name[:80]!r} cannot be a file here ({exc.strerror})",
                        f"keep every file in {place} under its own short file name") from None  # fmt: skip
    if link:
        raise LoadError(f"{path} is a symlink; amplite reads only files inside {place}", fix)
    return path
