"""``amplite migrate``: the libcst codemods onto native ``torch.amp`` (one call: ``migrate_paths``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from amplite.cli.app import _run, app
from amplite.cli.options import DebugOpt


@app.command()
def migrate(
    paths: Annotated[list[Path], typer.Argument(help="Python files or directories (walked for *.py).")],
    diff: Annotated[bool, typer.Option("--diff", help="Print a unified diff; change nothing.")] = False,
    check: Annotated[
        bool, typer.Option("--check", help="Exit 1 if a file would change or uses deprecated AMP; change nothing.")
    ] = False,
    add_autocast: Annotated[
        bool, typer.Option("--add-autocast", help="Add autocast (and a GradScaler for fp16) to plain FP32 loops.")
    ] = False,
    dtype: Annotated[str, typer.Option("--dtype", help="bf16 or fp16, for --add-autocast.")] = "bf16",
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Worker processes (0: one per CPU).")] = 1,
    file_timeout: Annotated[
        float, typer.Option("--file-timeout", help="Seconds a file over 64 kB may take before it is skipped.")
    ] = 60.0,
    debug: DebugOpt = False,
) -> None:
    """Rewrite training scripts from torch.cuda.amp / apex amp onto native torch.amp (in place, atomically)."""

    def body() -> int:
        from amplite.errors import ConfigError
        from amplite.escape import terminal
        from amplite.migrate import format_report, migrate_paths

        if diff and check:
            raise ConfigError("--diff and --check are exclusive", "use --diff to see changes, --check in CI")
        if dtype not in ("bf16", "fp16"):
            raise ConfigError(f"unknown --dtype {dtype!r}", "use bf16 or fp16")
        if not file_timeout > 0:
            raise ConfigError(f"--file-timeout {file_timeout:g} is not positive", "give seconds, e.g. 60")
        mode = "diff" if diff else "check" if check else "write"
        report = migrate_paths(paths, mode=mode, add_autocast=add_autocast, dtype=dtype, jobs=jobs,
                               file_timeout=file_timeout)  # fmt: skip
        if len(report.files) == 1 and report.files[0].refused:  # one hostile file: a one-line refusal
            only = report.files[0]
            raise ConfigError(f"{str(only.path)!r}: {only.error}", "nothing was changed; simplify the file, or "
                              "migrate the file it links to by its own path")  # fmt: skip
        print(terminal(format_report(report).rstrip("\n"), newlines=True))  # diffs of the user's files too
        return report.exit_code

    _run(debug, body)
