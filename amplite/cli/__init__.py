"""The ``amplite`` command line: parses options, calls the public API once per command, prints the result.

One module per command group, all registered on one typer app: ``convert`` (convert, inspect),
``gate`` (check, golden), ``batch``, ``migrate``. The conversion options are defined once, in
``options.CONVERSION_PARAMS``, and every converting command takes them through
``options.conversion_options``. Layer: the CLI imports only the public API (``amplite``, ``amplite.api``,
``amplite.save``, ``amplite.gate``, ``amplite.batch``, ``amplite.migrate``, ``amplite.errors``) and its
own modules; an import-linter contract in pyproject.toml enforces it.
"""

from __future__ import annotations

from amplite.cli import batch, convert, gate, migrate  # noqa: F401  (each registers its commands)
from amplite.cli.app import app, main

__all__ = ["app", "main"]
