"""The ``amplite`` command line: parses options, calls the library once, prints the result.

Exit codes: 0 success (and verification passed), 1 converted but verification failed (or, for
``migrate --check``, files would change), 2 bad input or usage, 3 internal error.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from amplite.cli_options import (
    DataMaxOpt,
    DebugOpt,
    DepthOpt,
    DynOpt,
    FactoryOpt,
    FuseOpt,
    InputOpt,
    InputsFile,
    IoOpt,
    KeepOpt,
    LevelOpt,
    LowOpt,
    ModelArg,
    Precision,
    RangeOpt,
    ToleranceOpt,
    TrustOpt,
)
from amplite.cli_output import err, out, print_plan, print_summary
from amplite.errors import AmpliteError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Ahead-of-time mixed precision for PyTorch models, with a verification report.",
)


@contextmanager
def _logging(debug: bool) -> Iterator[None]:
    """Quiet torch's internal warnings unless --debug; with --debug, show amplite's debug log."""
    torch_log, amp_log = logging.getLogger("torch"), logging.getLogger("amplite")
    saved = torch_log.level, amp_log.level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    if debug:
        amp_log.setLevel(logging.DEBUG)
        amp_log.addHandler(handler)
    else:
        torch_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        torch_log.setLevel(saved[0])
        amp_log.setLevel(saved[1])
        amp_log.removeHandler(handler)


def _run(debug: bool, body: Callable[[], int]) -> None:
    """Run a command body; turn errors into one line and an exit code."""
    try:
        with _logging(debug):
            code = body()
    except AmpliteError as exc:
        if debug:
            traceback.print_exc()
        err.print(f"[bold red]error:[/] {exc.one_line()}", soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None
    except Exception as exc:
        if debug:
            traceback.print_exc()
        err.print(
            f"[bold red]internal error:[/] {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            " — fix: re-run with --debug and report it",
            soft_wrap=True,
        )
        raise typer.Exit(3) from None
    raise typer.Exit(code)


def _inputs(specs: list[str], inputs_file: Path | None) -> Any:
    """Example inputs from ``--inputs FILE`` and/or ``--input`` specs (specs add keyword inputs)."""
    from amplite.converter.inputs import inputs_from_specs, load_inputs_file

    inputs = load_inputs_file(inputs_file) if inputs_file is not None else None
    if specs:
        _, named = inputs_from_specs(specs)
        inputs = ((), named) if inputs is None else (inputs[0], {**inputs[1], **named})
    return inputs


@app.command()
def convert(
    model: ModelArg,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output .pt2 or .onnx path.")] = None,
    format: Annotated[
        str | None, typer.Option("--format", help="Comma list of pt2,onnx (default: from -o's suffix).")
    ] = None,
    external_data: Annotated[bool, typer.Option("--external-data", help="ONNX weights in a .data file.")] = False,
    opset: Annotated[int | None, typer.Option("--opset", help="ONNX opset (default 20 fp16, 22 bf16).")] = None,
    onnx_layernorm: Annotated[
        str,
        typer.Option(
            "--onnx-layernorm",
            help="ONNX: FP32 LayerNorm islands become one low-precision LayerNormalization (FP32 statistics) "
            "when scale/bias are exact in the low dtype (exact), always, rounding them (round), or never (off).",
        ),
    ] = "exact",
    precision: Precision = "fp16",
    level: LevelOpt = None,
    input: InputOpt = [],  # noqa: B006
    inputs: InputsFile = None,
    keep_fp32: KeepOpt = [],  # noqa: B006
    force_low: LowOpt = [],  # noqa: B006
    report: Annotated[Path | None, typer.Option("--report", help="Report JSON path.")] = None,
    trust_pickle: TrustOpt = False,
    model_factory: FactoryOpt = None,
    dynamic_batch: DynOpt = False,
    low_precision_io: IoOpt = False,
    fuse_contractions: FuseOpt = "auto",
    range_rules: RangeOpt = None,
    data_max: DataMaxOpt = 512.0,
    max_reduction_depth: DepthOpt = 4096,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip numeric verification.")] = False,
    no_fold_batchnorm: Annotated[
        bool, typer.Option("--no-fold-batchnorm", help="Keep BatchNorm (FP32) instead of folding it into convs.")
    ] = False,
    tolerance: ToleranceOpt = [],  # noqa: B006
    max_trials: Annotated[int | None, typer.Option("--max-trials", help="Bound on the FP32 fallback search.")] = None,
    debug: DebugOpt = False,
) -> None:
    """Convert MODEL to mixed precision, verify it and write the model (.pt2 and/or .onnx) and a JSON report."""

    def body() -> int:
        from amplite.converter import emit
        from amplite.converter.api import convert as convert_model
        from amplite.converter.verify import parse_tolerance
        from amplite.errors import ConfigError
        from amplite.policy import resolve_level

        lvl = resolve_level(level)
        dest = output or model.with_name(f"{model.name.split('.')[0]}.{precision}.{lvl.value}.pt2")
        emit.check_writable(dest)
        targets = emit.plan_outputs(dest, format)
        if (opset is not None or external_data or onnx_layernorm != "exact") and "onnx" not in dict(targets):
            raise ConfigError("--opset, --external-data and --onnx-layernorm apply to ONNX output",
                              "add --format onnx (or -o X.onnx)")  # fmt: skip
        if onnx_layernorm != "exact":
            from amplite.converter.onnx_norm import MODES

            if onnx_layernorm not in MODES:
                raise ConfigError(f"unknown --onnx-layernorm {onnx_layernorm!r}", f"use one of: {', '.join(MODES)}")
        for _fmt, path in targets:
            emit.check_writable(path)
        report_path = report or dest.with_name(dest.name.removesuffix(dest.suffix) + ".report.json")
        emit.check_writable(report_path)
        result = convert_model(
            model, _inputs(input, inputs), precision=precision, level=lvl, keep_fp32=keep_fp32,
            force_low=force_low, trust_pickle=trust_pickle, model_factory=model_factory,
            dynamic_batch=dynamic_batch, low_precision_io=low_precision_io,
            fuse_contractions=fuse_contractions, verify=not no_verify, range_rules=range_rules,
            data_max=data_max, max_reduction_depth=max_reduction_depth,
            tolerance=parse_tolerance(tolerance, precision) if tolerance else None,
            fallback_search=bool(tolerance), max_trials=max_trials, fold_batchnorm=not no_fold_batchnorm,
        )  # fmt: skip
        for fmt, path in targets:
            result.save(path, format=fmt, external_data=True if external_data else None, opset=opset,
                        layernorm_stash=onnx_layernorm)  # fmt: skip
        result.report.save(report_path)
        print_summary(result.report.data, [p for _, p in targets], report_path)
        onnx_ok = (result.report.data.get("verification_onnx") or {}).get("passed")
        return 1 if result.passed is False or onnx_ok is False else 0

    _run(debug, body)


@app.command()
def inspect(
    model: ModelArg,
    precision: Precision = "fp16",
    level: LevelOpt = None,
    input: InputOpt = [],  # noqa: B006
    inputs: InputsFile = None,
    keep_fp32: KeepOpt = [],  # noqa: B006
    force_low: LowOpt = [],  # noqa: B006
    trust_pickle: TrustOpt = False,
    model_factory: FactoryOpt = None,
    range_rules: RangeOpt = None,
    data_max: DataMaxOpt = 512.0,
    max_reduction_depth: DepthOpt = 4096,
    only: Annotated[str | None, typer.Option("--only", help="Show only low, fp32 or follow nodes.")] = None,
    debug: DebugOpt = False,
) -> None:
    """Print the precision plan (node, op, dtype, reason) without writing any file."""

    def body() -> int:
        from amplite.converter.api import convert as convert_model

        result = convert_model(
            model, _inputs(input, inputs), precision=precision, level=level, keep_fp32=keep_fp32,
            force_low=force_low, trust_pickle=trust_pickle, model_factory=model_factory, verify=False,
            range_rules=range_rules, data_max=data_max, max_reduction_depth=max_reduction_depth,
        )  # fmt: skip
        print_plan(result.report.data, only)
        return 0

    _run(debug, body)


@app.command()
def migrate(
    paths: Annotated[list[Path], typer.Argument(help="Python files or directories (walked for *.py).")],
    diff: Annotated[bool, typer.Option("--diff", help="Print a unified diff; change nothing.")] = False,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 if any file would change; change nothing.")] = False,
    add_autocast: Annotated[
        bool, typer.Option("--add-autocast", help="Add autocast (and a GradScaler for fp16) to plain FP32 loops.")
    ] = False,
    dtype: Annotated[str, typer.Option("--dtype", help="bf16 or fp16, for --add-autocast.")] = "bf16",
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Worker processes (0: one per CPU).")] = 1,
    debug: DebugOpt = False,
) -> None:
    """Rewrite training scripts from torch.cuda.amp / apex amp onto native torch.amp (in place, atomically)."""

    def body() -> int:
        from amplite.errors import ConfigError
        from amplite.migrate import format_report, migrate_paths

        if diff and check:
            raise ConfigError("--diff and --check are exclusive", "use --diff to see changes, --check in CI")
        if dtype not in ("bf16", "fp16"):
            raise ConfigError(f"unknown --dtype {dtype!r}", "use bf16 or fp16")
        report = migrate_paths(paths, mode="diff" if diff else "check" if check else "write",
                               add_autocast=add_autocast, dtype=dtype, jobs=jobs)  # fmt: skip
        print(format_report(report).rstrip("\n"))
        return report.exit_code

    _run(debug, body)


@app.command()
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
    precision: Annotated[str | None, typer.Option("--precision", "-p", help="Default precision.")] = None,
    level: Annotated[str | None, typer.Option("--level", "-l", help="Default level.")] = None,
    input: InputOpt = [],  # noqa: B006
    inputs: InputsFile = None,
    keep_fp32: KeepOpt = [],  # noqa: B006
    force_low: LowOpt = [],  # noqa: B006
    model_factory: FactoryOpt = None,
    trust_pickle: TrustOpt = False,
    dynamic_batch: DynOpt = False,
    low_precision_io: IoOpt = False,
    fuse_contractions: FuseOpt = "auto",
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip numeric verification.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Convert many models, each in its own worker process; `amplite batch merge DIR...` joins shard summaries."""

    def body() -> int:
        from amplite.batch import defaults_from_options, merge_shards, run_batch
        from amplite.errors import ConfigError
        from amplite.ops.fusion_default import resolve as resolve_fuse

        if sources[0] == "merge":
            if len(sources) < 2:
                raise ConfigError("batch merge needs the shard output directories", "amplite batch merge A B -o OUT")
            result = merge_shards([Path(s) for s in sources[1:]], out_dir)
        else:
            if len(sources) != 1:
                raise ConfigError(f"batch takes one manifest, directory or glob, got {len(sources)}", "quote the glob")
            defaults = defaults_from_options(
                precision=precision, level=level, inputs=input, inputs_file=inputs, keep_fp32=keep_fp32,
                force_low=force_low, model_factory=model_factory, trust_pickle=trust_pickle,
                dynamic_batch=dynamic_batch, low_precision_io=low_precision_io,
                fuse_contractions=resolve_fuse(fuse_contractions)[0], verify=not no_verify,
            )  # fmt: skip
            result = run_batch(sources[0], out_dir, defaults=defaults, jobs=jobs, timeout=timeout,
                               fail_fast=fail_fast, resume=resume, shard=shard, progress=not no_progress)  # fmt: skip
        out.print(result.describe())
        return result.exit_code

    _run(debug, body)


# check and golden live in their own module; importing it registers them on ``app``.
from amplite import cli_gate  # noqa: E402, F401


def main() -> None:
    """Console-script entry point."""
    app(prog_name="amplite")


if __name__ == "__main__":
    main()
    sys.exit(0)
