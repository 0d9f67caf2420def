"""``amplite batch`` and ``amplite batch merge``: many models, one worker process each (``run_batch``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from amplite.cli.app import _run, app
from amplite.cli.options import DebugOpt, InputOpt, InputsFile, conversion_options
from amplite.cli.output import err, out
from amplite.options import ConvertOptions


@app.command()
@conversion_options
def batch(
    sources: Annotated[
        list[str],
        typer.Argument(help="A manifest (.toml), a directory or glob of models; or `merge SHARD_DIR...`."),
    ],
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Output directory.")],
    jobs: Annotated[int | None, typer.Option("--jobs", "-j", help="Parallel workers (default: cores/RAM).")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Seconds per model before it is killed.")] = None,
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop at the first failure.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Skip models already converted alike.")] = False,
    shard: Annotated[str | None, typer.Option("--shard", help="Run shard i/n of the models (0-based i).")] = None,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="Plain lines instead of a live display.")] = False,
    input: InputOpt = [],  # noqa: B006
    inputs: InputsFile = None,
    trust_code: Annotated[
        bool,
        typer.Option("--trust-code", help="Let the manifest name code to run: model_factory, import_modules, "
                     "calib_loader."),
    ] = False,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip numeric verification.")] = False,
    debug: DebugOpt = False,
    *,
    conversion: ConvertOptions,
) -> None:
    """Convert many models, each in its own worker process; `amplite batch merge DIR...` joins shard summaries.

    The conversion options set every model's default; a manifest's [defaults] and entries override them."""

    def body() -> int:
        from amplite.batch import BatchTerminated, defaults_from_options, merge_shards, run_batch
        from amplite.errors import ConfigError

        if sources[0] == "merge":
            if len(sources) < 2:
                raise ConfigError("batch merge needs the shard output directories", "amplite batch merge A B -o OUT")
            result = merge_shards([Path(s) for s in sources[1:]], out_dir)
        else:
            if len(sources) != 1:
                raise ConfigError(f"batch takes one manifest, directory or glob, got {len(sources)}", "quote the glob")
            options = ConvertOptions.of(conversion, verify=False) if no_verify else conversion
            defaults = defaults_from_options(options, inputs=input, inputs_file=inputs)
            try:  # SIGTERM (preemption, CI timeouts) stops the batch as Ctrl-C does, summary written
                result = run_batch(sources[0], out_dir, defaults=defaults, jobs=jobs, timeout=timeout,
                                   fail_fast=fail_fast, resume=resume, shard=shard, trust_code=trust_code,
                                   progress="plain" if no_progress else True)  # fmt: skip
            except BatchTerminated as stop:
                err.print(escape(f"stopped by {stop.signal_name} — summary: {out_dir / 'summary.md'}"))
                return stop.exit_code
        out.print(escape(result.describe()))
        return result.exit_code

    _run(debug, body)
