"""Writing outputs atomically: a temp file in the destination directory, then ``os.replace``.

Nothing partial is ever left at the destination: on any error the temp file is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from amplite.errors import ConfigError, EmitError
from amplite.paths import STDOUT, check_output
from amplite.spec import ConvertSpec

FORMATS = ("pt2", "onnx", "aoti")


def format_for(path: str | Path, fmt: str | None = None) -> str:
    """The output format: ``fmt`` if given, else from the suffix.

    Raises:
        ConfigError: For unknown suffixes or formats.
    """
    chosen = (fmt or Path(path).suffix.lstrip(".")).lower()
    if chosen not in FORMATS or (fmt is None and chosen == "aoti"):
        raise ConfigError(f"cannot tell the output format of {str(path)!r}", "use a .pt2 or .onnx suffix")
    return chosen


def plan_outputs(dest: str | Path, formats: str | None = None) -> list[tuple[str, Path]]:
    """The files to write: one per format in ``formats`` (comma list), ``dest`` with each format's suffix.

    Without ``formats`` the format comes from ``dest``'s suffix.

    Raises:
        ConfigError: Unknown or repeated formats.
    """
    p = Path(dest)
    if not formats:
        return [(format_for(p), p)]
    chosen = [f.strip().lower() for f in formats.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FORMATS]
    if unknown or not chosen or len(set(chosen)) != len(chosen):
        raise ConfigError(f"bad --format {formats!r}", f"give a comma list of {', '.join(FORMATS)}, each once")
    return [(f, _output_path(p, f, chosen)) for f in chosen]


def _output_path(dest: Path, fmt: str, chosen: list[str]) -> Path:
    """``dest`` with the format's suffix; an AOTInductor package is a ``.pt2`` too (``.aoti.pt2`` beside one)."""
    if fmt != "aoti":
        return dest.with_suffix("." + fmt)
    if "pt2" in chosen:
        return dest.with_suffix(".aoti.pt2")
    return dest if dest.suffix == ".pt2" else dest.with_suffix(".pt2")


def check_writable(path: str | Path) -> Path:
    """Fail early, before any conversion work, if ``path`` cannot be written.

    Raises:
        EmitError: If the directory is missing, the path is a directory, or it is not writable.
        ConfigError: The path is a symlink, a device, a FIFO or a socket (:func:`amplite.paths.check_output`).
    """
    p = Path(path)
    if str(p) == STDOUT:
        return p
    check_output(p)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise EmitError(f"output path {str(p)!r} is a directory", f"give a file path, e.g. {str(p / 'NAME')!r}")
    if not parent.is_dir():
        raise EmitError(f"output directory {str(parent)!r} does not exist", "create it or choose another -o")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise EmitError(f"output directory {str(parent)!r} is not writable", "choose a writable -o path")
    try:  # access() says yes to root on /proc or a read-only mount: creating a file there is the real test
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{p.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise EmitError(
            f"cannot write to output directory {str(parent)!r}: {exc.strerror or type(exc).__name__}",
            "choose a writable -o path",
        ) from None
    return p


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` and move the result to ``path`` only if it succeeded.

    The temporary file has the destination's name inside a hidden temporary directory next to it, so
    formats that embed the file name (a .pt2 archive's root folder) see the final name.

    Raises:
        EmitError: If writing fails (disk full, permissions); no file is left behind.
    """
    p = check_writable(path)
    tmp_dir: Path | None = None
    try:
        tmp_dir = Path(tempfile.mkdtemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp"))
        tmp = tmp_dir / p.name
        write(str(tmp))
        os.replace(tmp, p)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise EmitError(
            f"writing {str(p)!r} failed: {type(exc).__name__}: {exc}", "check disk space and permissions"
        ) from exc
    finally:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return p


#: The archive entry (``<root>/extra/amplite.json``) recording how a converted .pt2 was made: ``{"amplite":
#: version, "spec": ConvertSpec.to_json(), "config": the report's config, "passed": the verdict}``. JSON only;
#: read back by :func:`read_conversion`.
CONVERSION_ENTRY = "amplite.json"
_MAX_CONVERSION_BYTES = 1 << 20


def conversion_record(spec: ConvertSpec, config: Mapping[str, Any] | None = None,
                      passed: bool | None = None) -> dict[str, Any]:  # fmt: skip
    """What a .pt2 amplite writes records of its conversion: the spec whole (read back by
    :func:`read_conversion`), and for people reading the archive the report's ``config`` and verdict."""
    from amplite.version import __version__

    return {"amplite": __version__, "spec": spec.to_json(), "config": dict(config or spec.to_config()),
            "passed": passed}  # fmt: skip


def save_program(program: ExportedProgram, path: str | Path, conversion: Mapping[str, Any] | None = None) -> Path:
    """Write an ExportedProgram as a .pt2 archive, atomically; ``conversion`` (JSON-able, see
    :func:`conversion_record`) is recorded in it.

    Re-export records each node's provenance (``from_node``) from the graph amplite rewrote; it serves
    the in-memory analysis, but in the file it would grow the graph JSON by about a quarter, so it is
    left out of the saved copy (the program in memory keeps it).
    """
    saved = {}
    for node in program.graph.nodes:
        if "from_node" in node.meta:
            saved[node] = node.meta.pop("from_node")
    try:
        extra = {CONVERSION_ENTRY: json.dumps(conversion, allow_nan=False)} if conversion is not None else None
        return atomic_write(path, lambda tmp: torch.export.save(program, tmp, extra_files=extra))
    finally:
        for node, value in saved.items():
            node.meta["from_node"] = value


@dataclass(frozen=True)
class Recorded:
    """What a converted .pt2 records of its conversion.

    Attributes:
        amplite: The version of amplite that wrote it.
        spec: The conversion's spec, read back (:meth:`ConvertSpec.from_json`).
    """

    amplite: str
    spec: ConvertSpec


def read_conversion(path: str | Path) -> Recorded | None:
    """What :func:`save_program` recorded in a .pt2 (None for a file amplite did not convert, or one an amplite
    before the spec record wrote: its conversion is then inferred from the graph).

    Reads one JSON entry of at most 1 MiB with ``json.loads``; nothing in it is evaluated, and the spec is
    checked field by field (:meth:`ConvertSpec.from_json`): nothing else of it reaches a report.

    Raises:
        LoadError: The entry is there but is not the record amplite writes.
    """
    import zipfile

    from amplite.errors import LoadError

    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.count("/") == 2 and n.endswith(f"/extra/{CONVERSION_ENTRY}")]
            if len(names) != 1 or zf.getinfo(names[0]).file_size > _MAX_CONVERSION_BYTES:
                return None
            value = json.loads(zf.read(names[0]).decode("utf-8"))
    except (OSError, zipfile.BadZipFile, ValueError, UnicodeDecodeError, RecursionError):
        value = None
    if isinstance(value, dict) and "spec" not in value and isinstance(value.get("config"), dict):
        return None  # an amplite before the spec record: inferred from the graph, as for any other file
    try:
        spec = ConvertSpec.from_json(value.get("spec") if isinstance(value, dict) else value)
    except ConfigError as exc:
        raise LoadError(f"{str(path)!r}: its extra/{CONVERSION_ENTRY} is not the record amplite writes ({exc.problem})",
                        "re-convert the model with amplite convert") from None  # fmt: skip
    return Recorded(str(value.get("amplite", "")), spec)


def write_text(path: str | Path, text: str) -> Path:
    """Write a text file atomically; ``-`` writes it to standard output (for ``--report -``/``--junit -``)."""
    if str(path) == STDOUT:
        import sys

        sys.stdout.write(text)
        sys.stdout.flush()
        return Path(STDOUT)
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
