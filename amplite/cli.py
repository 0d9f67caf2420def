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
from rich.console import Console
from rich.table import Table

from amplite.errors import AmpliteError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Ahead-of-time mixed precision for PyTorch models, with a verification report.",
)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

ModelArg = Annotated[Path, typer.Argument(help="Model file: .pt2, TorchScript, state dict or pickled module.")]
Precision = Annotated[str, typer.Option("--precision", "-p", help="fp16 or bf16.")]
LevelOpt = Annotated[str | None, typer.Option("--level", "-l", help="O0-O3 (default: $AMPLITE_LEVEL, else O1).")]
InputOpt = Annotated[
    list[str], typer.Option("--input", help="NAME:SHAPE:DTYPE[lo,hi), e.g. ids:2x128:int64[0,30522). Repeatable.")
]
InputsFile = Annotated[Path | None, typer.Option("--inputs", help="Inputs file (torch.save, .npz, .safetensors).")]
KeepOpt = Annotated[list[str], typer.Option("--keep-fp32", help="Keep FP32: op:, module:, node: or any glob.")]
LowOpt = Annotated[list[str], typer.Option("--force-low", help="Force low precision (same patterns).")]
TrustOpt = Annotated[bool, typer.Option("--trust-pickle", help="Allow unpickling (runs code from the file).")]
FactoryOpt = Annotated[str | None, typer.Option("--model-factory", help="module:callable for a state dict.")]
DynOpt = Annotated[bool, typer.Option("--dynamic-batch", help="Make dim 0 of every input dynamic.")]
IoOpt = Annotated[bool, typer.Option("--low-precision-io", help="Inputs and outputs in the low dtype too.")]
FuseOpt = Annotated[bool, typer.Option("--fuse-contractions", help="Fuse matmul chains into amplite::contract.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]
RangeOpt = Annotated[
    bool | None,
    typer.Option("--range-rules/--no-range-rules", help="Keep FP32 what calibrated ranges flag (default: O1/O2)."),
]
DataMaxOpt = Annotated[float, typer.Option("--data-max", help="Largest |activation| kept in fp16.")]
DepthOpt = Annotated[int, typer.Option("--max-reduction-depth", help="Longest reduction kept in low precision.")]


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
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output .pt2 path.")] = None,
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
    fuse_contractions: FuseOpt = False,
    range_rules: RangeOpt = None,
    data_max: DataMaxOpt = 512.0,
    max_reduction_depth: DepthOpt = 4096,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip numeric verification.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Convert MODEL to mixed precision, verify it and write the .pt2 and a JSON report."""

    def body() -> int:
        from amplite.converter import emit
        from amplite.converter.api import convert as convert_model
        from amplite.policy import resolve_level

        lvl = resolve_level(level)
        dest = output or model.with_name(f"{model.name.split('.')[0]}.{precision}.{lvl.value}.pt2")
        emit.check_writable(dest)
        emit.format_for(dest)
        report_path = report or dest.with_name(dest.name.removesuffix(dest.suffix) + ".report.json")
        emit.check_writable(report_path)
        result = convert_model(
            model, _inputs(input, inputs), precision=precision, level=lvl, keep_fp32=keep_fp32,
            force_low=force_low, trust_pickle=trust_pickle, model_factory=model_factory,
            dynamic_batch=dynamic_batch, low_precision_io=low_precision_io,
            fuse_contractions=fuse_contractions, verify=not no_verify, range_rules=range_rules,
            data_max=data_max, max_reduction_depth=max_reduction_depth,
        )  # fmt: skip
        result.save(dest)
        result.report.save(report_path)
        print_summary(result.report.data, dest, report_path)
        return 0 if result.passed is not False else 1

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
    fuse_contractions: FuseOpt = False,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip numeric verification.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Convert many models, each in its own worker process; `amplite batch merge DIR...` joins shard summaries."""

    def body() -> int:
        from amplite.batch import defaults_from_options, merge_shards, run_batch
        from amplite.errors import ConfigError

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
                fuse_contractions=fuse_contractions, verify=not no_verify,
            )  # fmt: skip
            result = run_batch(sources[0], out_dir, defaults=defaults, jobs=jobs, timeout=timeout,
                               fail_fast=fail_fast, resume=resume, shard=shard, progress=not no_progress)  # fmt: skip
        out.print(result.describe())
        return result.exit_code

    _run(debug, body)


DataOpt = Annotated[Path | None, typer.Option("--data", help="Directory of input batches (.pt/.npz/.safetensors).")]
LoaderOpt = Annotated[str | None, typer.Option("--data-loader", help="module:function yielding batches.")]
RandomOpt = Annotated[int, typer.Option("--random-batches", help="Extra seeded random batches from --input.")]
MaxBatchOpt = Annotated[int, typer.Option("--max-batches", help="Use at most this many batches.")]
UpdateOpt = Annotated[bool, typer.Option("--update-golden", help="(Re)write the golden directory.")]


@app.command()
def check(
    model: ModelArg,
    converted: Annotated[Path | None, typer.Option("--converted", help="Check this converted .pt2.")] = None,
    golden: Annotated[Path | None, typer.Option("--golden", help="Golden directory (inputs + FP32 outputs).")] = None,
    update_golden: UpdateOpt = False,
    baseline: Annotated[Path | None, typer.Option("--baseline", help="Accepted earlier report.json.")] = None,
    baseline_margin: Annotated[float, typer.Option("--baseline-margin", help="Allowed SQNR loss in dB.")] = 1.0,
    tolerance: Annotated[
        list[str], typer.Option("--tolerance", help="e.g. sqnr>=45, top1>=0.999, logits:max_abs<=1e-2. Repeatable.")
    ] = [],  # noqa: B006
    data: DataOpt = None,
    data_loader: LoaderOpt = None,
    random_batches: RandomOpt = 0,
    max_batches: MaxBatchOpt = 64,
    no_layerwise: Annotated[bool, typer.Option("--no-layerwise", help="Skip the per-node error analysis.")] = False,
    grad: Annotated[bool, typer.Option("--grad", help="Also compare parameter gradients (training check).")] = False,
    loss: Annotated[str | None, typer.Option("--loss", help="module:function(outputs) -> loss for --grad.")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="Directory for report.json/.md/.html.")] = None,
    junit: Annotated[Path | None, typer.Option("--junit", help="Write a JUnit XML file.")] = None,
    name: Annotated[str | None, typer.Option("--name", help="Model name in JUnit and reports.")] = None,
    precision: Precision = "fp16",
    level: LevelOpt = None,
    input: InputOpt = [],  # noqa: B006
    inputs: InputsFile = None,
    keep_fp32: KeepOpt = [],  # noqa: B006
    force_low: LowOpt = [],  # noqa: B006
    trust_pickle: TrustOpt = False,
    model_factory: FactoryOpt = None,
    dynamic_batch: DynOpt = False,
    low_precision_io: IoOpt = False,
    fuse_contractions: FuseOpt = False,
    range_rules: RangeOpt = None,
    data_max: DataMaxOpt = 512.0,
    max_reduction_depth: DepthOpt = 4096,
    debug: DebugOpt = False,
) -> None:
    """CI accuracy gate: convert (or load --converted), verify on data, compare with golden/baseline.

    Exit 0 pass, 1 accuracy failure or regression, 2 error.
    """

    def body() -> int:
        from amplite.converter.check import check as run_check
        from amplite.converter.junit import publish_github
        from amplite.converter.markdown_report import render_markdown

        res = run_check(
            model, _inputs(input, inputs), converted=converted, golden=golden, update_golden=update_golden,
            baseline=baseline, baseline_margin_db=baseline_margin, tolerance=tolerance or None, data=data,
            data_loader=data_loader, random_batches=random_batches, input_specs=input, max_batches=max_batches,
            layerwise=not no_layerwise, grad=grad, loss=loss, report_dir=report, junit=junit, name=name,
            precision=precision, level=level, keep_fp32=keep_fp32, force_low=force_low, trust_pickle=trust_pickle,
            model_factory=model_factory, dynamic_batch=dynamic_batch, low_precision_io=low_precision_io,
            fuse_contractions=fuse_contractions, range_rules=range_rules, data_max=data_max,
            max_reduction_depth=max_reduction_depth,
        )  # fmt: skip
        publish_github(res.report.data, render_markdown(res.report.data))
        print_check(res)
        return res.exit_code

    _run(debug, body)


@app.command()
def golden(
    model: ModelArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="Golden directory to write.")],
    update_golden: UpdateOpt = False,
    input: InputOpt = [],  # noqa: B006
    inputs: InputsFile = None,
    data: DataOpt = None,
    data_loader: LoaderOpt = None,
    random_batches: RandomOpt = 0,
    max_batches: MaxBatchOpt = 64,
    trust_pickle: TrustOpt = False,
    model_factory: FactoryOpt = None,
    dynamic_batch: DynOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Save inputs and FP32 reference outputs (safetensors + metadata) for `check --golden`."""

    def body() -> int:
        from amplite.converter.check import make_golden

        path = make_golden(
            model, _inputs(input, inputs), output=output, update=update_golden, data=data, data_loader=data_loader,
            random_batches=random_batches, input_specs=input, max_batches=max_batches, trust_pickle=trust_pickle,
            model_factory=model_factory, dynamic_batch=dynamic_batch,
        )  # fmt: skip
        out.print(f"wrote golden references to {path}")
        return 0

    _run(debug, body)


def print_check(res: Any) -> None:
    """The verdict of ``check``: per-output metrics, top error-introducing nodes, failure reasons, files."""
    data = res.report.data
    verification = data.get("verification", {})
    table = Table(title=f"amplite check: {'[green]PASS[/]' if res.exit_code == 0 else '[red]FAIL[/]'}")
    for col in ("output", "SQNR dB", "max abs", "cosine", "result"):
        table.add_column(col)
    for o in verification.get("outputs", []):
        sqnr = o["sqnr_db"] if isinstance(o["sqnr_db"], str) else f"{o['sqnr_db']:.1f}"
        table.add_row(o["name"], sqnr, f"{o['max_abs']:.3g}", f"{o['cosine']:.6f}", "pass" if o["passed"] else "FAIL")
    out.print(table)
    top = (data.get("layerwise") or {}).get("top_introducers") or []
    if top:
        out.print("top error-introducing nodes (isolated error, fed FP32 inputs):")
    for i, n in enumerate(top[:5], 1):
        flag = " introduces NaN/Inf" if n.get("introduces_nonfinite") else ""
        out.print(f"  {i}. {n['node']} ({n['op']}) {n.get('source') or n.get('module') or ''}{flag}")
    for reason in res.reasons:
        out.print(f"[red]✗[/] {reason}")
    for kind, path in res.files.items():
        out.print(f"{kind}: {path}")


def print_plan(data: dict[str, Any], only: str | None) -> None:
    """The plan table of ``inspect`` (tab-separated lines when stdout is not a terminal, for grep/cut)."""
    rows = [r for r in data["plan"] if not only or r["mode"] == only]
    after = data["graph"]["after"]
    footer = f"nodes by dtype: {after['nodes_by_dtype']}  casts: {after['casts']}"
    if not out.is_terminal:
        print("node\top\tmodule\tdtype\treason")
        for r in rows:
            print(f"{r['node']}\t{r['op']}\t{r['module']}\t{r['dtype'] or '-'}\t{r['reason']}")
        print(footer)
        return
    table = Table(title=f"precision plan ({data['config']['precision']}, {data['config']['level']})")
    for col in ("node", "op", "module", "dtype", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["node"], r["op"], r["module"], r["dtype"] or "-", r["reason"])
    out.print(table)
    out.print(footer)


def print_summary(data: dict[str, Any], dest: Path, report_path: Path) -> None:
    """The short summary ``convert`` prints."""
    cfg, graph, weights = data["config"], data["graph"]["after"], data["weights"]
    table = Table(title=f"amplite {cfg['precision']} {cfg['level']}: {data['source']['path'] or 'module'}")
    table.add_column("what")
    table.add_column("value", overflow="fold")
    table.add_row("nodes by dtype", ", ".join(f"{k} {v}" for k, v in graph["nodes_by_dtype"].items()))
    table.add_row("casts in graph", str(graph["casts"]))
    table.add_row("low-precision FLOP share", f"{graph['low_precision_flop_share']:.1%}")
    table.add_row("FP32 islands", str(len(data["fp32_nodes"])))
    table.add_row(
        "weights",
        f"{weights['bytes_before'] / 1e6:.2f} MB → {weights['bytes_after'] / 1e6:.2f} MB ({weights['ratio']:.2f}×)",
    )
    t = data["timings"]
    table.add_row("time (s)", ", ".join(f"{k} {v:.2f}" for k, v in t.items()))
    out.print(table)
    verification = data.get("verification")
    if verification:
        vt = Table(title="verification against FP32 (example inputs)")
        for col in ("output", "max abs", "max rel", "cosine", "SQNR dB", "result"):
            vt.add_column(col)
        for o in verification["outputs"]:
            sqnr = o["sqnr_db"] if isinstance(o["sqnr_db"], str) else f"{o['sqnr_db']:.1f}"
            verdict = "[green]pass[/]" if o["passed"] else "[red]FAIL[/] " + "; ".join(o["notes"])
            vt.add_row(o["name"], f"{o['max_abs']:.3g}", f"{o['max_rel']:.3g}", f"{o['cosine']:.6f}", sqnr, verdict)
        out.print(vt)
    for w in data.get("warnings", []):
        out.print(f"[yellow]warning:[/] {w}")
    out.print(f"wrote {dest}\nreport {report_path}")


def main() -> None:
    """Console-script entry point."""
    app(prog_name="amplite")


if __name__ == "__main__":
    main()
    sys.exit(0)
