"""``amplite convert DIR``: plan, write by streaming, verify block by block, write report.json.

Outputs (``formats``): ``safetensors`` (a directory in the checkpoint's layout, the default) and/or
``pt2``. Nothing partial is left behind: each output is written to a temporary path and renamed.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amplite.checkpoint.convert import (
    Progress,
    StreamedConversion,
    _no_progress,
    _on_meta,
    checkpoint_level,
    convert_checkpoint,
    peak_rss_bytes,
)
from amplite.converter import emit
from amplite.errors import ConfigError
from amplite.report.schema import write_report

FORMATS = ("safetensors", "pt2")
#: amplite.convert keywords that mean nothing for a streamed checkpoint (with their defaults).
_NOT_APPLICABLE = {"dynamic_batch": False, "dynamic_dims": [], "fuse_contractions": "auto", "trust_pickle": False,
                   "model_factory": None, "fold_batchnorm": True, "calibration": None,
                   "fallback_search": False}  # fmt: skip
_PASSED = ("precision", "level", "keep_fp32", "force_low", "low_precision_io", "range_rules")


def plan_checkpoint_outputs(source: Path, output: str | Path | None, formats: str | None, precision: str,
                            level: Any) -> list[tuple[str, Path]]:  # fmt: skip
    """The outputs to write: ``-o X.pt2`` is a .pt2, any other ``-o`` a safetensors directory."""
    base = Path(output) if output is not None else source.with_name(f"{source.name}.{precision}.{level}")
    if formats:
        chosen = [f.strip().lower() for f in formats.split(",") if f.strip()]
        if not chosen or any(f not in FORMATS for f in chosen) or len(set(chosen)) != len(chosen):
            raise ConfigError(f"bad --format {formats!r} for a checkpoint directory",
                              f"give a comma list of {', '.join(FORMATS)}, each once")  # fmt: skip
    else:
        chosen = ["pt2" if base.suffix == ".pt2" else "safetensors"]
    stem = base.with_suffix("") if base.suffix == ".pt2" else base
    return [(f, stem.with_name(stem.name + ".pt2") if f == "pt2" else stem) for f in chosen]


def checkpoint_to_files(
    source: str | Path,
    example_inputs: Any = None,
    *,
    output: str | Path | None = None,
    formats: str | None = None,
    report: str | Path | None = None,
    verify: bool = True,
    verify_max_memory: float | None = None,
    tolerance: Any = None,
    progress: Progress = _no_progress,
    check_more: Callable[[dict[str, Any], Path], Any] | None = None,
    **conversion: Any,
) -> tuple[StreamedConversion, list[Path], Path]:
    """Convert a checkpoint directory and write its outputs and report.json.

    ``check_more(report data, safetensors directory)`` runs after block-wise verification (with ``verify``)
    and may add to the report (``amplite.llm.checkpoint.GenerationCheck``: the generation check); it needs
    a safetensors output, which is checked before anything is converted.

    Returns:
        The conversion, the outputs written and the report path.

    Raises:
        AmpliteError: A bad directory, option or destination (before anything is written).
    """
    for key, default in _NOT_APPLICABLE.items():
        if key in conversion and conversion[key] not in (default, None) and not (default == [] and not conversion[key]):
            raise ConfigError(f"{key} does not apply to a checkpoint directory",
                              "drop it (checkpoints are streamed from their shards)")  # fmt: skip
    src = Path(source)
    precision = conversion.get("precision", "fp16")
    level = checkpoint_level(conversion.get("level")).value
    targets = plan_checkpoint_outputs(src, output, formats, precision, level)
    check_outputs(targets)
    first = targets[0][1]
    name = first.stem if first.suffix == ".pt2" else first.name
    report_path = Path(report) if report is not None else first.with_name(name + ".report.json")
    emit.check_writable(report_path)
    if verify and check_more is not None and not any(f == "safetensors" for f, _ in targets):
        raise ConfigError("token_agreement/ppl_delta are measured on the safetensors output, and none is written",
                          "add it: --format safetensors,pt2 (or -o DIR)")  # fmt: skip
    conv = convert_checkpoint(src, example_inputs, progress=progress, **{k: conversion[k] for k in _PASSED
                                                                        if k in conversion})  # fmt: skip
    if verify and verify_max_memory is not None:  # refused before anything is written
        check_verify_memory(conv, verify_max_memory)
    written: list[Path] = []
    previous = _sigterm_raises()
    try:
        write_outputs(conv, targets, progress, written)
        if verify:  # from what was written: the safetensors directory when there is one, else the .pt2
            weights = next((p for f, p in targets if f == "safetensors"), targets[0][1])
            real = example_inputs if example_inputs is not None and not _on_meta(example_inputs) else None
            conv.verify(weights, real, tolerance=tolerance, max_memory_gb=verify_max_memory, progress=progress)
        streamed_peak = peak_rss_bytes()  # before check_more, which may load whole models
        if verify and check_more is not None:
            check_more(conv.data, weights)
    except BaseException:
        for path in written:
            _remove(path)
        raise
    finally:
        _restore_sigterm(previous)
    conv.data["outputs"] = [{"format": f, "path": str(p), "bytes": _size(p)} for f, p in targets]
    conv.data["streaming"] = {"peak_rss_bytes": streamed_peak, "largest_shard_bytes":
                                conv.checkpoint.largest_shard_bytes, "shards": len(conv.checkpoint.shards)}  # fmt: skip
    write_report(report_path, conv.data)
    return conv, written, report_path


def _size(path: Path) -> int:
    """Bytes of a written output: the file, or every file of a directory."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size if path.exists() else 0


def check_outputs(targets: list[tuple[str, Path]]) -> None:
    """The output guard: a ``.pt2`` must be writable, a safetensors directory new or empty."""
    for fmt, path in targets:
        if fmt == "pt2":
            emit.check_writable(path)
        elif path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ConfigError(f"{path} exists", "choose a new output directory or remove it")


def write_outputs(conv: StreamedConversion, targets: list[tuple[str, Path]], progress: Progress = _no_progress,
                  written: list[Path] | None = None) -> list[Path]:  # fmt: skip
    """Write each planned output (``written`` collects them as they finish, for cleanup by the caller)."""
    out = [] if written is None else written
    for fmt, path in targets:
        out.append(conv.save_pt2(path, progress) if fmt == "pt2" else conv.save_safetensors(path, progress))
    return out


def check_verify_memory(conv: StreamedConversion, max_memory_gb: float) -> None:
    """Refuse ``--verify-max-memory`` that block-wise verification cannot meet (before writing anything)."""
    from amplite.checkpoint.blockwise import _sizes, peak_weight_bytes, runnable_module

    peak = max(peak_weight_bytes(runnable_module(p), _sizes(p)) for p in (conv.pipeline.original, conv.program))
    if peak > max_memory_gb * 2**30:
        raise ConfigError(f"block-wise verification needs {peak / 2**30:.2f} GiB of weights at once, over "
                          f"--verify-max-memory {max_memory_gb:g} GiB",
                          "raise --verify-max-memory, or skip verification with --no-verify")  # fmt: skip


def _sigterm_raises() -> Any:
    """SIGTERM raises (like SIGINT), so the staging files are removed; returns the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


def _restore_sigterm(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
