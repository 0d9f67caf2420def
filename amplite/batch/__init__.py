"""Batch conversion: many models, each in its own worker process, with summaries, resume and sharding.

Library: :func:`convert_many` (and the streaming :func:`iter_convert_many`) take jobs and any
``concurrent.futures.Executor``; :func:`run_batch` and :func:`merge_shards` are what ``amplite batch``
and ``amplite batch merge`` call. See docs/batch.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from amplite.batch import summary as summ
from amplite.batch.keys import job_key, parse_shard, select_shard, shard_of
from amplite.batch.keys_table import manifest_values
from amplite.batch.manifest import Job, ManifestError, parse_manifest
from amplite.batch.progress import Progress
from amplite.batch.runner import (
    DEFAULT_TIMEOUT,
    convert_many,
    default_workers,
    iter_convert_many,
)
from amplite.batch.signals import BatchTerminated, sigterm_stops_batch
from amplite.batch.sources import jobs_from_paths
from amplite.batch.summary import BatchResult, JobResult, MergeError
from amplite.errors import ConfigError
from amplite.options import ConvertOptions

__all__ = [
    "DEFAULT_TIMEOUT",
    "BatchResult",
    "BatchTerminated",
    "Job",
    "JobResult",
    "ManifestError",
    "MergeError",
    "convert_many",
    "default_workers",
    "defaults_from_options",
    "iter_convert_many",
    "job_key",
    "load_jobs",
    "merge_shards",
    "parse_manifest",
    "parse_shard",
    "run_batch",
    "select_shard",
    "shard_of",
]


def defaults_from_options(
    conversion: ConvertOptions | None = None,
    *,
    inputs: Sequence[str] = (),
    inputs_file: str | Path | None = None,
) -> dict[str, Any]:
    """The shared settings of ``amplite batch``'s options as manifest values, keeping only those given (so
    that a manifest's own values win).

    Every conversion option a manifest has (a field of ``ConvertOptions`` with a manifest kind) maps to the
    key of its name; ``calibration`` to ``calib`` (a directory) or ``calib_loader`` (``module:function``).
    ``inputs_file`` and ``calib`` are made absolute (manifest paths are relative to the manifest);
    ``fuse_contractions`` ``auto`` is resolved here, where the batch is launched (manifests hold bools).

    Raises:
        ConfigError: An option a batch cannot take (a tolerance object, calibration batches in memory).
    """
    from amplite.ops.fusion_default import resolve

    described = ConvertOptions.described()
    options = conversion or ConvertOptions()
    for name, value in options.given().items():
        path_like = name == "calibration" and isinstance(value, (str, Path))
        if described[name].kind in ("none", "tolerance") and not path_like:
            raise ConfigError(f"batch defaults cannot hold {name}={value!r}", "set it in the manifest instead")
    given = manifest_values(options)
    if "calib" in given:
        given["calib"] = str(Path(given["calib"]).resolve())
    if "fuse_contractions" in given:
        given["fuse_contractions"] = resolve(given["fuse_contractions"])[0]
    if inputs:
        given["inputs"] = list(inputs)
    if inputs_file:
        given["inputs_file"] = str(Path(inputs_file).resolve())
    return given


def load_jobs(
    source: str | Path,
    defaults: Mapping[str, Any] | None = None,
    shard: str | tuple[int, int] | None = None,
    *,
    trust_code: bool = False,
) -> list[Job]:
    """The jobs of a manifest (``.toml``), a directory of ``.pt2`` files or a glob, for one shard.

    ``trust_code`` allows a manifest's ``model_factory``, ``import_modules`` and ``calib_loader`` (code).

    Raises:
        ManifestError: Bad manifest, nothing matched, or a bad shard spec.
    """
    picked = parse_shard(shard) if isinstance(shard, str) else shard
    toml = str(source).endswith(".toml")
    jobs = parse_manifest(source, defaults, trust_code=trust_code) if toml else jobs_from_paths(source, defaults)
    return select_shard(jobs, picked)


def run_batch(
    source: str | Path,
    out_dir: str | Path,
    *,
    defaults: Mapping[str, Any] | None = None,
    jobs: int | None = None,
    timeout: float | None = None,
    fail_fast: bool = False,
    resume: bool = False,
    shard: str | None = None,
    progress: bool | str | Progress | None = True,
    executor: Executor | None = None,
    trust_code: bool = False,
) -> BatchResult:
    """What ``amplite batch`` runs: load the source, pick the shard, convert, write the summaries.

    Args:
        source: A ``.toml`` manifest, a directory (its ``.pt2`` files) or a glob (quote it in the shell).
        out_dir: Output directory.
        defaults: Settings for every model (CLI options: ``precision``, ``level``, ``inputs`` ...); a
            manifest's ``[defaults]`` and entries override them.
        jobs: Parallel conversions (default from CPUs and memory).
        timeout: Seconds per model unless the manifest sets one (default 3600).
        fail_fast: Stop at the first failure.
        resume: Skip models already converted with the same inputs and settings; re-run the rest.
        shard: ``"i/n"``: run only shard i of n (0-based), for CI matrices, SLURM arrays, indexed Jobs.
        progress: See :func:`iter_convert_many`.
        executor: See :func:`iter_convert_many`.
        trust_code: Allow a manifest to name code (``model_factory``, ``import_modules``, ``calib_loader``).

    Raises:
        ManifestError / ConfigError (exit 2): bad manifest, source or option. KeyboardInterrupt: Ctrl-C.
        BatchTerminated: SIGTERM (when called from the main thread), after the same clean-up as Ctrl-C.
    """
    if jobs is not None and jobs < 1:
        raise ManifestError(f"--jobs {jobs} must be at least 1", "pass --jobs 1 or more (or leave it out)")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):  # NaN compares False to 0
        raise ManifestError(f"--timeout {timeout:g} must be positive", "give seconds, e.g. --timeout 600")
    picked = parse_shard(shard) if shard else None
    selected = load_jobs(source, defaults, picked, trust_code=trust_code)
    meta = {"source": str(source), "shard": f"{picked[0]}/{picked[1]}" if picked else None}
    with sigterm_stops_batch():
        return convert_many(
            selected,
            out_dir,
            workers=jobs,
            executor=executor,
            timeout=timeout,
            fail_fast=fail_fast,
            resume=resume,
            progress=progress,
            summary_meta=meta,
        )


def merge_shards(shard_dirs: Sequence[str | Path], out_dir: str | Path) -> BatchResult:
    """What ``amplite batch merge`` runs: combine shard summaries into ``out_dir`` (nothing is copied).

    Raises:
        MergeError (exit 2): Missing, duplicated or inconsistent shards.
    """
    from amplite.errors import ConfigError
    from amplite.paths import guard_outputs

    names = ("summary.json", "summary.md")
    reads = [(f"the summary of shard {str(d)!r}", Path(d) / n) for d in shard_dirs for n in names]
    try:
        guard_outputs(reads, [("-o's summary.json (-o)", Path(out_dir) / "summary.json"),
                              ("-o's summary.md (-o)", Path(out_dir) / "summary.md")])  # fmt: skip
        summ.guard_summaries(Path(out_dir))
    except ConfigError as exc:
        raise MergeError(exc.problem, "pass a new -o directory for the merged summary") from None
    from amplite.batch.merge import merge_summaries

    doc, _, _ = merge_summaries(shard_dirs, out_dir)
    results = [JobResult.from_row(r) for r in doc["models"]]
    return BatchResult(results, Path(out_dir), float(doc.get("seconds") or 0.0), bool(doc.get("interrupted")))
