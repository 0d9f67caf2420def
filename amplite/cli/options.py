"""Options shared by several ``amplite`` commands: typer ``Annotated`` aliases and the conversion options."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from amplite.errors import AmpliteError
from amplite.options import ConvertOptions, calibration_source

ModelArg = Annotated[Path, typer.Argument(help="Model file: .pt2, TorchScript, state dict or pickled module.")]
Precision = Annotated[
    str | None,
    typer.Option("--precision", "-p",
                 help="fp16, bf16 or fp8 (default fp16; --train-steps: bf16; check --converted: the file's own)."),
]
LevelOpt = Annotated[str | None, typer.Option("--level", "-l", help="O0-O3 (default: $AMPLITE_LEVEL, else O1).")]
InputOpt = Annotated[
    list[str], typer.Option("--input", help="NAME:SHAPE:DTYPE[lo,hi), e.g. ids:2x128:int64[0,30522). Repeatable.")
]
InputsFile = Annotated[Path | None, typer.Option("--inputs", help="Inputs file (torch.save, .npz, .safetensors).")]
CalibOpt = Annotated[
    Path | None, typer.Option("--calib", help="Directory of calibration batches for the range rules (as --data).")
]
CalibLoaderOpt = Annotated[
    str | None, typer.Option("--calib-loader", help="module:function yielding calibration batches.")
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]
DataOpt = Annotated[Path | None, typer.Option("--data", help="Directory of input batches (.pt/.npz/.safetensors).")]
LoaderOpt = Annotated[str | None, typer.Option("--data-loader", help="module:function yielding batches.")]
RandomOpt = Annotated[int, typer.Option("--random-batches", help="Extra seeded random batches from --input.")]
MaxBatchOpt = Annotated[int, typer.Option("--max-batches", help="Use at most this many batches.")]
UpdateOpt = Annotated[bool, typer.Option("--update-golden", help="(Re)write the golden directory.")]
ToleranceOpt = Annotated[
    list[str],
    typer.Option("--tolerance", help="Accuracy contract: sqnr>=45, top1>=0.999, logits:max_abs<=1e-2 (repeatable)."),
]


def _param(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)


#: The conversion options every converting command (convert, inspect, check) takes: the fields of
#: ``amplite.ConvertOptions`` that have CLI flags, spelled as their metadata says, plus calibration's two
#: spellings (``--calib DIR``, ``--calib-loader module:function``). Nothing here lists an option by name.
CONVERSION_PARAMS: tuple[inspect.Parameter, ...] = (
    *(
        _param(name, Annotated[o.cli_type, typer.Option(*o.flags, help=o.help)], o.cli_default)
        for name, o in ConvertOptions.described().items()
        if o.flags
    ),
    _param("calib", CalibOpt, None),
    _param("calib_loader", CalibLoaderOpt, None),
)
#: What ``amplite golden`` takes: the options that read and trace the model (the FP32 reference's).
LOADING_PARAMS = tuple(
    p for p in CONVERSION_PARAMS if "reference" in getattr(ConvertOptions.described().get(p.name), "paths", ())
)


def to_api(values: dict[str, Any]) -> ConvertOptions:
    """CLI conversion option values -> :class:`amplite.ConvertOptions` (an option left at None is not given:
    the API's default applies, and ``check --converted`` reads the precision from the file)."""
    calibration = calibration_source(values.get("calib"), values.get("calib_loader"))
    given = {k: v for k, v in values.items() if k not in ("calib", "calib_loader") and v is not None}
    if calibration is not None:
        given["calibration"] = calibration
    return ConvertOptions.of(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})


def conversion_options(
    command: Callable[..., Any], params: tuple[inspect.Parameter, ...] = CONVERSION_PARAMS
) -> Callable[..., Any]:
    """Give a command every conversion option; they reach it as one ``conversion: ConvertOptions`` value.

    The command declares ``conversion`` as its last keyword instead of the options themselves, so a new
    field of ``amplite.ConvertOptions`` with CLI flags appears on every converting command at once.
    """
    names = {p.name for p in params}
    own = [
        p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for p in inspect.signature(command, eval_str=True).parameters.values()
        if p.name != "conversion"
    ]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        try:
            conversion = to_api({k: kwargs.pop(k) for k in names})
        except AmpliteError as exc:  # before the command's own error handling: report it the same way
            from amplite.cli.output import err

            err.print(f"[bold red]error:[/] {exc.one_line()}", soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        return command(conversion=conversion, **kwargs)

    debug = [p for p in own if p.name == "debug"]
    rest = [p for p in own if p.name != "debug"]
    wrapper.__signature__ = inspect.Signature([*rest, *params, *debug])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in wrapper.__signature__.parameters.values()}
    del wrapper.__wrapped__  # typer must read the new signature, not the command's
    return wrapper


def loading_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Like :func:`conversion_options`, with only the options that load and trace (``amplite golden``)."""
    return conversion_options(command, LOADING_PARAMS)
