"""Output paths never overwrite what a run reads, nor each other: one check for every command.

:func:`guard_outputs` is called by every command that writes (``convert``/``convert_to_files``, ``check``,
``golden``, ``batch``) before any work starts. Two paths are the same when they resolve to the same path
(:meth:`Path.resolve` follows symlinks) or, when both exist, are the same file (``st_dev``/``st_ino``: hard
links). A *directory* output (a golden directory, a batch's per-model directory) is replaced as a whole,
so it may not be or contain an input either.

:func:`derived_output` guards names amplite makes up itself (``m.fp16.O1.pt2`` next to ``m.pt2``): they
never replace an existing file that amplite did not write.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from amplite.errors import ConfigError

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
        ConfigError: Naming both paths and the option to change.
    """
    ins = [(label, Path(p), *_key(Path(p))) for label, p in inputs if p is not None]
    outs = [(label, Path(p), *_key(Path(p))) for label, p in outputs if p is not None]
    dirs = [(label, Path(p), *_key(Path(p))) for label, p in directories if p is not None]
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


def derived_output(path: Path, ours: Callable[[Path], bool]) -> Path:
    """A name amplite derived (no ``-o``), unless it would replace a file amplite did not write.

    Args:
        path: The derived name.
        ours: Whether an existing ``path`` was written by amplite for this same run (then it is replaced).

    Raises:
        ConfigError: ``path`` exists and is not amplite's output.
    """
    if (path.exists() or path.is_symlink()) and not ours(path):
        raise ConfigError(
            f"the default output {str(path)!r} already exists and amplite did not write it from this model",
            "pass -o with the output path (an existing file is only replaced when named explicitly)",
        )
    return path
