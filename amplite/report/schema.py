"""report.json against its published schema (amplite/schemas/report.schema.json), and the one writer.

Every report.json amplite writes — ``convert`` of a module or a ``.pt2`` (:func:`amplite.save.convert_to_file`),
of a checkpoint directory, ``check`` (also ``--train-steps`` and checkpoint directories), ``batch`` — goes
through :func:`write_report`: non-finite floats are encoded in the one documented way
(:mod:`amplite.verify.numbers`), and the document is validated against the schema on every write (a few
milliseconds against the seconds a conversion takes; jsonschema is a runtime dependency).

A report that fails validation is an amplite bug: :class:`~amplite.errors.InternalError` (exit 3) naming
the key path of the first problem, and nothing is written.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

from amplite.converter.emit import write_text
from amplite.errors import InternalError
from amplite.verify.numbers import encode_numbers

__all__ = ["load_schema", "report_json", "validate_report", "write_report"]


@functools.cache
def load_schema() -> dict[str, Any]:
    """The published report schema (draft 2020-12)."""
    return json.loads(resources.files("amplite").joinpath("schemas/report.schema.json").read_text("utf-8"))


@functools.cache
def _validator() -> Any:
    import jsonschema

    schema = load_schema()
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def _key_path(path: Any) -> str:
    """``verification.outputs[0].sqnr_db`` from a jsonschema error path."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(the document)"


def _data(report: Any) -> dict[str, Any]:
    data = getattr(report, "data", report)
    if not isinstance(data, dict):
        raise InternalError(f"a report is a dict, not {type(data).__name__}")
    return data


def report_json(report: Any) -> str:
    """The report (a :class:`~amplite.report.document.Report` or its dict) as indented JSON, non-finite
    floats encoded as ``"inf"``/``"-inf"``/``"nan"``."""
    return json.dumps(encode_numbers(_data(report)), indent=2, sort_keys=False, default=str, allow_nan=False) + "\n"


def validate_report(report: Any) -> None:
    """Validate a report against the schema.

    Args:
        report: A :class:`~amplite.report.document.Report` or its dict (as written: non-finite floats are
            encoded first, exactly as :func:`write_report` would).

    Raises:
        InternalError: The first schema violation, naming its key path and what the schema wanted.
    """
    _check(json.loads(report_json(report)))


def _check(doc: dict[str, Any]) -> None:
    errors = sorted(_validator().iter_errors(doc), key=lambda e: [len(e.absolute_path), *map(str, e.absolute_path)])
    if errors:
        e = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise InternalError(f"report.json does not match its schema at {_key_path(e.absolute_path)}: "
                            f"{e.message[:200]}{more}")  # fmt: skip


def write_report(path: str | Path, report: Any) -> Path:
    """Write report.json atomically, validated against the schema first (always).

    Args:
        path: The destination.
        report: A :class:`~amplite.report.document.Report` or its dict.

    Returns:
        The path written.

    Raises:
        InternalError: The report does not match the schema (nothing is written).
    """
    text = report_json(report)
    _check(json.loads(text))
    return write_text(path, text)
