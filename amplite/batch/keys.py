"""Deterministic keys of a batch: the resume hash of a job and the shard a model belongs to."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

from amplite.batch.manifest import Job, ManifestError

#: Job fields that change how a job runs but not what it produces (left out of the resume hash).
RUN_ONLY = ("name", "timeout", "max_memory_gb", "line", "path", "inputs_file", "calib")

_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes (cached per path, size and mtime within the process)."""
    st = Path(path).stat()
    cache_key = (str(path), st.st_size, st.st_mtime_ns)
    if cache_key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _DIGESTS[cache_key] = h.hexdigest()
    return _DIGESTS[cache_key]


def calib_digest(directory: str | Path) -> dict[str, str]:
    """``{file name: SHA-256}`` of the calibration batches ``--calib DIR`` reads (its data files, name order):
    the range rules' decisions depend on their values, so new batches under the same path are a new job."""
    from amplite.verify.data import SUFFIXES

    files = sorted(f for f in Path(directory).iterdir() if f.suffix in SUFFIXES and f.is_file())
    return {f.name: file_digest(f) for f in files}


def job_key(job: Job) -> str:
    """The resume hash: settings that affect the output, file contents (model, inputs, calibration batches),
    amplite and torch versions; not the paths (a moved file is the same file).

    Raises:
        OSError: If the model or inputs file cannot be read.
    """
    import torch

    from amplite.version import __version__

    settings = {k: v for k, v in job.to_dict().items() if k not in RUN_ONLY}
    files = {"model": file_digest(job.path)}
    if job.inputs_file:
        files["inputs"] = file_digest(job.inputs_file)
    calib = job.calib_dir
    if calib is not None and calib.is_dir():  # the batches the range rules read (a missing one fails the job)
        files["calib"] = calib_digest(calib)
    doc = {"settings": settings, "files": files, "amplite": __version__, "torch": torch.__version__}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=list).encode()).hexdigest()[:32]


def parse_shard(spec: str) -> tuple[int, int]:
    """``"i/n"`` (0 <= i < n) as ``(i, n)``.

    Raises:
        ManifestError: If the spec does not parse or is out of range.
    """
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not m or not 0 <= int(m[1]) < int(m[2]):
        raise ManifestError(
            f"--shard {spec!r} is not i/n with 0 <= i < n",
            "write e.g. --shard 0/4 … --shard 3/4 (e.g. $SLURM_ARRAY_TASK_ID/4)",
        )
    return int(m[1]), int(m[2])


def shard_of(name: str, count: int) -> int:
    """The shard a model name belongs to: a hash of the name, so that editing the manifest moves no other
    model between shards (and their resume results stay where they are)."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:16], 16) % count


def select_shard(jobs: Sequence[Job], shard: tuple[int, int] | None) -> list[Job]:
    """The jobs of shard ``(i, n)``; all jobs when ``shard`` is None."""
    if shard is None:
        return list(jobs)
    index, count = shard
    return [j for j in jobs if shard_of(j.name, count) == index]
