"""Options shared by several ``amplite`` commands (typer ``Annotated`` aliases)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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
FuseOpt = Annotated[
    str,
    typer.Option(
        "--fuse-contractions",
        help="Fuse matmul chains into amplite::contract: auto (default: off until a GPU run shows a gain), on, off.",
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
