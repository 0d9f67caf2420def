"""The outputs of a streamed checkpoint conversion: plan them, guard them, write them, clean up.

``StreamedConversion.save`` and ``amplite convert DIR`` (``checkpoint.files``) share these. This module
imports no other part of ``amplite.checkpoint`` (the conversion object is duck-typed), so that the result
object can use it without an import cycle.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amplite.converter import emit
from amplite.errors import ConfigError
from amplite.paths import check_output
from amplite.spec import ConvertSpec

FORMATS = ("safetensors", "pt2")


def _no_progress(step: str, done: int, total: int) -> None:
    return None


def plan_checkpoint_outputs(source: Path, output: str | Path | None, formats: str | None,
                            spec: ConvertSpec) -> list[tuple[str, Path]]:  # fmt: skip
    """The outputs to write: ``-o X.pt2`` is a .pt2, any other ``-o`` a safetensors directory (default name:
    the source's, with the spec's precision and level)."""
    name = f"{source.name}.{spec.precision_name}.{spec.level.value}"
    base = Path(output) if output is not None else source.with_name(name)
    if formats:
        chosen = [f.strip().lower() for f in formats.split(",") if f.strip()]
        if not chosen or any(f not in FORMATS for f in chosen) or len(set(chosen)) != len(chosen):
            raise ConfigError(f"bad --format {formats!r} for a checkpoint directory",
                              f"give a comma list of {', '.join(FORMATS)}, each once")  # fmt: skip
    else:
        chosen = ["pt2" if base.suffix == ".pt2" else "safetensors"]
    if spec.fp8 is not None and "pt2" in chosen:
        raise ConfigError("--precision fp8 writes a safetensors directory in vLLM's layout, not a .pt2",
                          "drop --format pt2 / -o X.pt2 (write -o DIR), or convert to bf16 for a .pt2")  # fmt: skip
    stem = base.with_suffix("") if base.suffix == ".pt2" else base
    return [(f, stem.with_name(stem.name + ".pt2") if f == "pt2" else stem) for f in chosen]


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
            continue
        check_output(path, "-o", directory=True)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ConfigError(f"{path} exists", "choose a new output directory or remove it")


def write_outputs(conv: Any, targets: list[tuple[str, Path]], progress: Callable[[str, int, int], None] = _no_progress,
                  written: list[Path] | None = None) -> list[Path]:  # fmt: skip
    """Write each planned output (``written`` collects them as they finish, for cleanup by the caller)."""
    out = [] if written is None else written
    for fmt, path in targets:
        out.append(conv.save_pt2(path, progress) if fmt == "pt2" else conv.save_safetensors(path, progress))
    return out


def check_verify_memory(conv: Any, max_memory_gb: float) -> None:
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
