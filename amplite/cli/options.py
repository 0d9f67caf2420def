"""Options shared by several ``amplite`` commands: typer ``Annotated`` aliases and the conversion options."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from amplite.errors import AmpliteError, ConfigError
from amplite.spec import ConvertSpec, RangeSpec

ModelArg = Annotated[Path, typer.Argument(help="Model file: .pt2, TorchScript, state dict or pickled module.")]
Precision = Annotated[
    str | None,
    typer.Option("--precision", "-p", help="fp16 or bf16 (default fp16; check --converted: the file's own)."),
]
LevelOpt = Annotated[str | None, typer.Option("--level", "-l", help="O0-O3 (default: $AMPLITE_LEVEL, else O1).")]
InputOpt = Annotated[
    list[str], typer.Option("--input", help="NAME:SHAPE:DTYPE[lo,hi), e.g. ids:2x128:int64[0,30522). Repeatable.")
]
InputsFile = Annotated[Path | None, typer.Option("--inputs", help="Inputs file (torch.save, .npz, .safetensors).")]
KeepOpt = Annotated[list[str], typer.Option("--keep-fp32", help="Keep FP32: op:, module:, node: or any glob.")]
LowOpt = Annotated[list[str], typer.Option("--force-low", help="Force low precision (same patterns).")]
TrustOpt = Annotated[bool, typer.Option("--trust-pickle", help="Allow unpickling (runs code from the file).")]
FactoryOpt = Annotated[str | None, typer.Option("--model-factory", help="module:callable for a state dict.")]
ImportOpt = Annotated[
    list[str],
    typer.Option("--import", help="Import MODULE first (custom-op library, pytree types of a .pt2). Repeatable."),
]
DynOpt = Annotated[bool, typer.Option("--dynamic-batch", help="Make dim 0 of every input dynamic.")]
DynDimOpt = Annotated[
    list[str],
    typer.Option("--dynamic-dim", help="NAME:DIM[,DIM]: make these dims of input NAME dynamic (ids:1). Repeatable."),
]
CalibOpt = Annotated[
    Path | None, typer.Option("--calib", help="Directory of calibration batches for the range rules (as --data).")
]
CalibLoaderOpt = Annotated[
    str | None, typer.Option("--calib-loader", help="module:function yielding calibration batches.")
]
IoOpt = Annotated[bool, typer.Option("--low-precision-io", help="Inputs and outputs in the low dtype too.")]
FuseOpt = Annotated[
    bool | None,
    typer.Option(
        "--fuse-contractions/--no-fuse-contractions",
        help="Fuse matmul chains into amplite::contract (default auto: off until a GPU run shows a gain).",
    ),
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]
RangeOpt = Annotated[
    bool | None,
    typer.Option("--range-rules/--no-range-rules", help="Keep FP32 what calibrated ranges flag (default: O1/O2)."),
]
DataMaxOpt = Annotated[float, typer.Option("--data-max", help="Largest |activation| kept in fp16.")]
DepthOpt = Annotated[int, typer.Option("--max-reduction-depth", help="Longest reduction kept in low precision.")]
DataOpt = Annotated[Path | None, typer.Option("--data", help="Directory of input batches (.pt/.npz/.safetensors).")]
LoaderOpt = Annotated[str | None, typer.Option("--data-loader", help="module:function yielding batches.")]
RandomOpt = Annotated[int, typer.Option("--random-batches", help="Extra seeded random batches from --input.")]
MaxBatchOpt = Annotated[int, typer.Option("--max-batches", help="Use at most this many batches.")]
UpdateOpt = Annotated[bool, typer.Option("--update-golden", help="(Re)write the golden directory.")]
ToleranceOpt = Annotated[
    list[str],
    typer.Option("--tolerance", help="Accuracy contract: sqnr>=45, top1>=0.999, logits:max_abs<=1e-2 (repeatable)."),
]
GpuProfileOpt = Annotated[
    str, typer.Option("--gpu-profile", help="GPU for the report's time estimate: H100, H200, A100, L4, RTX4090.")
]
PercentileOpt = Annotated[
    float | None,
    typer.Option("--range-percentile", help="Judge the activation range rule on this percentile of |x| (99.99)."),
]
NoFoldOpt = Annotated[
    bool, typer.Option("--no-fold-batchnorm", help="Keep BatchNorm (FP32) instead of folding it into convs.")
]

#: The conversion options, defined once: every command that converts (convert, inspect, check) takes them
#: through :func:`conversion_options`. Each maps to the ``amplite.convert`` keyword of the same name, except
#: ``no_fold_batchnorm`` (``fold_batchnorm=not ...``). Defaults with a value are read from the spec's own
#: (``amplite.spec``); an option left at None is not passed (``--precision`` unset lets ``check --converted``
#: infer it from the file).
CONVERSION_PARAMS: tuple[inspect.Parameter, ...] = tuple(
    inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)
    for name, annotation, default in (
        ("precision", Precision, None),
        ("level", LevelOpt, None),
        ("keep_fp32", KeepOpt, []),
        ("force_low", LowOpt, []),
        ("trust_pickle", TrustOpt, False),
        ("model_factory", FactoryOpt, None),
        ("import_modules", ImportOpt, []),
        ("dynamic_batch", DynOpt, False),
        ("dynamic_dims", DynDimOpt, []),
        ("low_precision_io", IoOpt, False),
        ("fuse_contractions", FuseOpt, None),
        ("range_rules", RangeOpt, None),
        ("data_max", DataMaxOpt, RangeSpec.data_max),
        ("max_reduction_depth", DepthOpt, RangeSpec.max_reduction_depth),
        ("range_percentile", PercentileOpt, None),
        ("no_fold_batchnorm", NoFoldOpt, False),
        ("calib", CalibOpt, None),
        ("calib_loader", CalibLoaderOpt, None),
        ("gpu_profile", GpuProfileOpt, ConvertSpec.gpu_profile),
    )
)
#: CLI options whose ``amplite.convert`` keyword has another name (``calib``/``calib_loader`` both feed
#: ``calibration``: a directory, or a ``module:function`` string).
API_NAMES = {"no_fold_batchnorm": "fold_batchnorm", "calib": "calibration", "calib_loader": "calibration"}
#: The conversion options that only load and trace the model: what ``amplite golden`` takes.
LOADING_NAMES = ("trust_pickle", "model_factory", "import_modules", "dynamic_batch", "dynamic_dims")
LOADING_PARAMS = tuple(p for p in CONVERSION_PARAMS if p.name in LOADING_NAMES)


def to_api(values: dict[str, Any]) -> dict[str, Any]:
    """CLI conversion option values -> ``amplite.convert`` keyword arguments."""
    kwargs = dict(values)
    if kwargs.get("precision") is None:  # the API's default, or what check --converted reads from the file
        kwargs.pop("precision", None)
    if "fuse_contractions" in kwargs and kwargs["fuse_contractions"] is None:
        kwargs["fuse_contractions"] = "auto"
    if "no_fold_batchnorm" in kwargs:
        kwargs["fold_batchnorm"] = not kwargs.pop("no_fold_batchnorm")
    for key in ("keep_fp32", "force_low", "dynamic_dims", "import_modules"):
        if key in kwargs:
            kwargs[key] = list(kwargs[key])
    calib, loader = kwargs.pop("calib", None), kwargs.pop("calib_loader", None)
    if calib is not None and loader is not None:
        raise ConfigError("--calib and --calib-loader are both given", "pass one source of calibration batches")
    if calib is not None or loader is not None:
        kwargs["calibration"] = Path(calib) if calib is not None else loader
    return kwargs


def conversion_options(
    command: Callable[..., Any], params: tuple[inspect.Parameter, ...] = CONVERSION_PARAMS
) -> Callable[..., Any]:
    """Give a command every conversion option; they reach it as one ``conversion`` dict of API keywords.

    The command declares ``conversion: dict`` as its last keyword instead of the options themselves, so a
    new conversion option added to :data:`CONVERSION_PARAMS` appears on every converting command at once.
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
