"""Batch sources other than a manifest: every ``.pt2`` in a directory, or every file matching a glob."""

from __future__ import annotations

import glob as globlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from amplite.batch.manifest import MODEL_ONLY, Job, ManifestError, check_unique, make_job, safe_name

#: What a directory source picks up.
DIR_SUFFIXES = (".pt2",)


def jobs_from_paths(source: str | Path, defaults: Mapping[str, Any] | None = None) -> list[Job]:
    """Jobs for every ``.pt2`` in a directory, or every file matching a glob, with shared settings.

    Raises:
        ManifestError: Nothing matches, or the shared settings are invalid.
    """
    src = Path(source).expanduser()
    if src.is_dir():
        files = sorted(f for f in src.iterdir() if f.is_file() and f.suffix in DIR_SUFFIXES)
    else:
        files = sorted(Path(f) for f in globlib.glob(str(src), recursive=True) if Path(f).is_file())
    if not files:
        raise ManifestError(
            f"no model files match {str(source)!r}",
            "pass a .toml manifest, a directory of .pt2 files or a glob such as 'zoo/*.pt2'",
        )
    names = [safe_name(f) for f in files]
    if len(set(names)) < len(names):  # same file name in different directories: name by relative path
        root = Path(*_common_parts(files))
        names = [re.sub(r"[^A-Za-z0-9_.-]", "-", str(f.relative_to(root).with_suffix(""))) for f in files]
    shared = dict(defaults or {})
    for key in MODEL_ONLY:
        shared.pop(key, None)
    jobs = [
        make_job({**shared, "path": str(f.resolve()), "name": n}, Path.cwd(), lambda k: 0, where=str(source))
        for f, n in zip(files, names, strict=True)
    ]
    check_unique(jobs, str(source))
    return jobs


def _common_parts(files: Sequence[Path]) -> tuple[str, ...]:
    parts = [f.resolve().parent.parts for f in files]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return tuple(common)
