"""``amplite check`` and ``amplite golden``: the CI accuracy gate's commands (registered on the main app)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from amplite.cli.app import _inputs, _run, app
from amplite.cli.options import (
    DataOpt,
    DebugOpt,
    InputOpt,
    InputsFile,
    LoaderOpt,
    MaxBatchOpt,
    ModelArg,
    RandomOpt,
    ToleranceOpt,
    UpdateOpt,
    conversion_options,
    loading_options,
)
from amplite.cli.output import out, print_check, summary_to_stderr
from amplite.options import ConvertOptions


@app.command()
@conversion_options
def check(
    model: ModelArg,
    converted: Annotated[Path | None, typer.Option(
        "--converted", help="Check this converted .pt2 (for a checkpoint directory: its converted directory).")] = None,
    golden: Annotated[Path | None, typer.Option("--golden", help="Golden directory (inputs + FP32 outputs).")] = None,
    update_golden: UpdateOpt = False,
    baseline: Annotated[Path | None, typer.Option("--baseline", help="Accepted earlier report.json.")] = None,
    baseline_margin: Annotated[float, typer.Option("--baseline-margin", help="Allowed SQNR loss in dB.")] = 1.0,
    tolerance: ToleranceOpt = [],  # noqa: B006
    data: DataOpt = None,
    data_loader: LoaderOpt = None,
    random_batches: RandomOpt = 0,
    max_batches: MaxBatchOpt = 64,
    no_layerwise: Annotated[bool, typer.Option("--no-layerwise", help="Skip the per-node error analysis.")] = False,
    grad: Annotated[bool, typer.Option("--grad", help="Also compare parameter gradients (training check).")] = False,
    loss: Annotated[str | None, typer.Option("--loss", help="module:function(outputs) -> loss for --grad.")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="Directory for report.json/.md/.html.")] = None,
    junit: Annotated[Path | None, typer.Option("--junit", help="JUnit XML file ('-': standard output).")] = None,
    name: Annotated[str | None, typer.Option("--name", help="Model name in JUnit and reports.")] = None,
    train_steps: Annotated[
        int, typer.Option("--train-steps", help="Train FP32 and amplite copies N steps; gate on train_loss_gap.")
    ] = 0,
    lr: Annotated[float, typer.Option("--lr", help="Learning rate (AdamW) for --train-steps.")] = 1e-3,
    input: InputOpt = [],  # noqa: B006
    inputs: InputsFile = None,
    debug: DebugOpt = False,
    *,
    conversion: ConvertOptions,
) -> None:
    """CI accuracy gate: convert (or load --converted), verify on data, compare with golden/baseline.

    Exit 0 pass, 1 accuracy failure or regression, 2 error.
    """

    def body() -> int:
        from amplite.gate import check as run_check
        from amplite.gate import publish_github_summary

        res = run_check(
            model, _inputs(input, inputs), converted=converted, golden=golden, update_golden=update_golden,
            baseline=baseline, baseline_margin_db=baseline_margin, tolerance=tolerance or None, data=data,
            data_loader=data_loader, random_batches=random_batches, input_specs=input, max_batches=max_batches,
            layerwise=not no_layerwise, grad=grad, loss=loss, report_dir=report, junit=junit, name=name,
            train_steps=train_steps, lr=lr, inputs_file=inputs, options=conversion,
        )  # fmt: skip
        with summary_to_stderr(junit is not None and str(junit) == "-"):
            publish_github_summary(res.report.data)
            print_check(res)
        return res.exit_code

    _run(debug, body)


@app.command()
@loading_options
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
    debug: DebugOpt = False,
    *,
    conversion: ConvertOptions,
) -> None:
    """Save inputs and FP32 reference outputs (safetensors + metadata) for `check --golden`."""

    def body() -> int:
        from amplite.gate import make_golden

        path = make_golden(
            model, _inputs(input, inputs), output=output, update=update_golden, data=data, data_loader=data_loader,
            random_batches=random_batches, input_specs=input, max_batches=max_batches, inputs_file=inputs,
            options=conversion,
        )  # fmt: skip
        out.print(escape(f"wrote golden references to {path}"))
        return 0

    _run(debug, body)
