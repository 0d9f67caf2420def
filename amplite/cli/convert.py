"""``amplite convert`` and ``amplite inspect``: one library call each (``convert_to_files``, ``convert``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from amplite.cli.app import _inputs, _run, app
from amplite.cli.options import DebugOpt, InputOpt, InputsFile, ModelArg, ToleranceOpt, conversion_options
from amplite.cli.output import byte_progress, print_plan, print_summary, summary_to_stderr
from amplite.options import ConvertOptions


@app.command()
@conversion_options
def convert(
    model: ModelArg,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output .pt2 or .onnx path.")] = None,
    format: Annotated[
        str | None, typer.Option(
            "--format", help="Comma list of pt2,onnx,aoti (default: from -o's suffix; aoti: an AOTInductor package)."
        )
    ] = None,
    external_data: Annotated[bool, typer.Option("--external-data", help="ONNX weights in a .data file.")] = False,
    opset: Annotated[int | None, typer.Option("--opset", help="ONNX opset (default 20 fp16, 22 bf16).")] = None,
    onnx_layernorm: Annotated[
        str,
        typer.Option(
            "--onnx-layernorm",
            help="ONNX: keep FP32 LayerNorm islands (off, exact under the ONNX spec), or write them as one "
            "low-precision LayerNormalization as ONNX Runtime computes it: when scale/bias are exact in the low "
            "dtype (stash) or rounding them (round). The spec rounds before scale/bias: docs/onnx.md.",
        ),
    ] = "off",
    input: InputOpt = [],  # noqa: B006
    inputs: InputsFile = None,
    report: Annotated[Path | None, typer.Option("--report", help="Report JSON path ('-': standard output).")] = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip numeric verification.")] = False,
    tolerance: ToleranceOpt = [],  # noqa: B006
    max_trials: Annotated[int | None, typer.Option("--max-trials", help="Bound on the FP32 fallback search.")] = None,
    verify_max_memory: Annotated[
        float | None,
        typer.Option("--verify-max-memory", help="Checkpoint directories: GB of weights verification may hold."),
    ] = None,
    debug: DebugOpt = False,
    *,
    conversion: ConvertOptions,
) -> None:
    """Convert MODEL (a model file or a transformers checkpoint directory) to mixed precision, verify it and
    write the model (.pt2, .onnx, or a safetensors directory) and a JSON report."""

    def body() -> int:
        from amplite.save import convert_to_files

        with summary_to_stderr(report is not None and str(report) == "-"):  # stdout holds the report
            with byte_progress() as progress:
                saved = convert_to_files(
                    model, _inputs(input, inputs), output=output, formats=format, report=report,
                    external_data=external_data, opset=opset, onnx_layernorm=onnx_layernorm,
                    tolerance=tolerance or None, verify=not no_verify, max_trials=max_trials,
                    verify_max_memory=verify_max_memory, progress=progress, inputs_file=inputs, options=conversion,
                )  # fmt: skip
            print_summary(saved.result.report, saved.written, saved.report_path)
        return saved.exit_code

    _run(debug, body)


@app.command()
@conversion_options
def inspect(
    model: ModelArg,
    input: InputOpt = [],  # noqa: B006
    inputs: InputsFile = None,
    only: Annotated[str | None, typer.Option("--only", help="Show only low, fp32 or follow nodes.")] = None,
    debug: DebugOpt = False,
    *,
    conversion: ConvertOptions,
) -> None:
    """Print the precision plan (node, op, dtype, reason) without writing any file."""

    def body() -> int:
        from amplite.api import convert as convert_model

        result = convert_model(model, _inputs(input, inputs), verify=False, options=conversion)
        print_plan(result.report, only)
        return 0

    _run(debug, body)
