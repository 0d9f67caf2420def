"""The ``amplite`` app and what every command shares: error handling, exit codes, logging, inputs.

Exit codes: 0 success (and verification passed), 1 converted but verification failed (or, for
``migrate --check``, files would change), 2 bad input or usage, 3 internal error.
"""

from __future__ import annotations

import logging
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from amplite.cli.output import err
from amplite.errors import AmpliteError, path_error

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Ahead-of-time mixed precision for PyTorch models, with a verification report.",
)


@contextmanager
def _logging(debug: bool) -> Iterator[None]:
    """Quiet torch's internal log (warnings and errors) unless --debug; with --debug, show amplite's debug log."""
    torch_log, amp_log = logging.getLogger("torch"), logging.getLogger("amplite")
    saved = torch_log.level, amp_log.level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    if debug:
        amp_log.setLevel(logging.DEBUG)
        amp_log.addHandler(handler)
    else:
        # Not even ERROR: torch logs a failing meta kernel or symbolic-shape check (with its traceback) before it
        # raises, and amplite turns the exception into the one line that names the problem and the fix.
        torch_log.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        torch_log.setLevel(saved[0])
        amp_log.setLevel(saved[1])
        amp_log.removeHandler(handler)


def _show(caught: list[warnings.WarningMessage]) -> None:
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _run(debug: bool, body: Callable[[], int]) -> None:
    """Run a command body; turn errors into one line and an exit code.

    Warnings raised meanwhile (torch's, a pickle protocol's, a user file's SyntaxWarning) are held back and
    shown only when the command succeeds (or with ``--debug``): a refusal is exactly one line.
    """
    caught: list[warnings.WarningMessage] = []
    try:
        with _logging(debug), warnings.catch_warnings(record=True) as caught:
            code = body()
        _show(caught)
    except AmpliteError as exc:
        if debug:
            _show(caught)
            traceback.print_exc()
        label = "internal error" if exc.exit_code == 3 else "error"
        err.print(f"[bold red]{label}:[/] {escape(exc.one_line())}", soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None
    except Exception as exc:
        if debug:
            _show(caught)
            traceback.print_exc()
        refused = path_error(exc)  # the OS refused a named path (too long, no permission, disk full)
        if refused is not None:
            err.print(f"[bold red]error:[/] {escape(refused.one_line())}", soft_wrap=True)
            raise typer.Exit(2) from None
        err.print(
            f"[bold red]internal error:[/] {escape(type(exc).__name__)}: "
            f"{escape(str(exc).splitlines()[0]) if str(exc) else ''}"
            " — fix: re-run with --debug and report it",
            soft_wrap=True,
        )
        raise typer.Exit(3) from None
    raise typer.Exit(code)


def _inputs(specs: list[str], inputs_file: Path | None) -> Any:
    """Example inputs from ``--inputs FILE`` and/or ``--input`` specs (specs add keyword inputs)."""
    from amplite.api import example_inputs

    return example_inputs(specs, inputs_file)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="amplite")
