"""ONNX output: ``torch.onnx.export(dynamo=True)`` of a converted program, portable to any ONNX runtime.

* Casts and FP32 islands come from the converted program unchanged; :mod:`onnx_cleanup` then removes only
  exact redundancies and stores initializers read only in low precision in that precision; on request
  :mod:`onnx_norm` runs LayerNorm islands on the low dtype (``stash_type=1``); :mod:`islands` wraps ops the
  opset lacks in the low dtype (bf16 Einsum before opset 28) in FP32.
* ``amplite::contract`` becomes ``amplite.Contract`` (or ``amplite.ContractBias`` when it has a bias; the
  translation and the bodies are :mod:`amplite.onnx.contract`), opset domain ``amplite`` version 1, each
  with a model-local function body (Cast → Einsum → scale/bias → Cast, FP32 inside) so every runtime can
  run it, while a runtime with a kernel registered for the domain claims the node instead. The exporter
  inlines model-local functions (its opset conversion and its optimizer both do), so the translation emits
  plain custom-domain nodes and the bodies are attached afterwards; the optimizer then runs with inlining off.
* Models whose weights exceed protobuf's 2 GB limit (or ``external_data=True``) are written as
  ``<name>.onnx`` plus ``<name>.onnx.data``, tensor by tensor. Weights are wrapped, not copied, by the
  exporter; casts of initializers are applied lazily while writing.
* Everything is written to a temporary location next to the destination, checked with ``onnx.checker``
  (full check, strict shape inference), then moved into place: nothing partial is left on failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import onnx
import onnx.parser
import onnx_ir as ir
import onnxscript.optimizer
import torch
from torch.export import ExportedProgram

from amplite.converter.emit import check_writable
from amplite.errors import ConfigError, EmitError, ExportError
from amplite.levels import precision_dtype
from amplite.onnx.cleanup import cleanup_casts, count_casts, set_io_dtype
from amplite.onnx.contract import DOMAIN, DOMAIN_VERSION, MIN_OPSET_CONTRACT, contract_functions, contract_translation
from amplite.onnx.errors import export_failure
from amplite.onnx.islands import first_opset_with, fp32_islands
from amplite.onnx.norm import ALIASES as LAYERNORM_ALIASES
from amplite.onnx.norm import MODES as LAYERNORM_MODES
from amplite.onnx.norm import stash_layernorms
from amplite.onnx.prepare import onnx_ready
from amplite.onnx.registry import cached_registry

# The ``amplite.Contract`` translation lives in ``contract``; its names stay importable from here.
__all__ = [
    "DEFAULT_OPSET",
    "DEFAULT_OPSET_BF16",
    "DOMAIN",
    "DOMAIN_VERSION",
    "EXTERNAL_DATA_THRESHOLD",
    "MIN_OPSET_BF16",
    "MIN_OPSET_CONTRACT",
    "OnnxInfo",
    "contract_functions",
    "contract_translation",
    "export_model",
    "prepare_model",
    "save_onnx",
]

DEFAULT_OPSET = 20
#: ONNX added bfloat16 to Conv, GRU, LSTM, pooling and more in opset 22: the default for bf16 models.
DEFAULT_OPSET_BF16 = 22
#: Cast to/from bfloat16 exists from opset 13; the function bodies use CastLike (opset 15).
MIN_OPSET_BF16 = 13
#: Above this many bytes of initializers the model cannot be one protobuf (2 GiB hard limit).
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**27
_LOW = {torch.float16: ir.DataType.FLOAT16, torch.bfloat16: ir.DataType.BFLOAT16}


@dataclass
class OnnxInfo:
    """What :func:`save_onnx` wrote.

    Attributes:
        path: The ``.onnx`` file.
        data_path: The external data file, or None when the weights are inside the model file.
        bytes: Size of the model file plus its external data.
        opset: Default-domain opset version.
        casts: Cast nodes in the main graph after clean-up.
        casts_in_functions: Cast nodes inside the ``amplite`` function bodies (per definition).
        contract_nodes: ``amplite`` domain nodes in the graph.
        cleanup: Counters of the Cast clean-up (see :func:`amplite.onnx.cleanup.cleanup_casts`),
            plus ``layernorm_stash`` (see :func:`amplite.onnx.norm.stash_layernorms`).
        inputs: ``(name, dtype)`` of each graph input; ``outputs`` likewise.
        checker: ``"passed"``: ``onnx.checker`` full check (strict shape inference) of the written file.
        timings: Seconds in ``export``, ``optimize`` and ``save_and_check``.
    """

    path: str
    data_path: str | None
    bytes: int
    opset: int
    casts: int
    casts_in_functions: int
    contract_nodes: int
    cleanup: dict[str, int]
    inputs: list[tuple[str, str]] = field(default_factory=list)
    outputs: list[tuple[str, str]] = field(default_factory=list)
    checker: str = "passed"
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict for the report."""
        return asdict(self)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter logs warnings about unrelated optional packages (torchvision); keep the CLI clean."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "onnxscript", "onnx_ir")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def export_model(program: ExportedProgram, *, opset: int = DEFAULT_OPSET) -> ir.Model:
    """Translate ``program`` to an ONNX IR model (no optimisation, functions not yet attached).

    Raises:
        ExportError: An op has no ONNX translation (all named), or the exporter failed (its step and the
            innermost cause named).
        ConfigError: The opset cannot express the model.
    """
    table = {}
    if hasattr(torch.ops, "amplite") and hasattr(torch.ops.amplite, "contract"):
        table[torch.ops.amplite.contract.default] = contract_translation
    ready, _ = onnx_ready(program)  # what blocks torch.onnx's decomposition, rewritten on a copy
    try:
        with _quiet_exporter(), contextlib.redirect_stdout(None), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            registry = cached_registry(opset, tuple(table.items()))
            if registry is None:  # the exporter's internals moved: its public entry point (slower)
                onnx_program = torch.onnx.export(
                    ready, (), dynamo=True, optimize=False, verbose=False, report=False,
                    opset_version=opset, custom_translation_table=table,
                )
            else:
                from torch.onnx._internal.exporter import _core

                onnx_program = _core.export(ready, (), {}, registry=registry, optimize=False, verbose=False,
                                            report=False, opset_version=opset)
    except Exception as exc:
        raise export_failure(exc, program, table, opset) from exc
    return onnx_program.model


def prepare_model(
    program: ExportedProgram, *, precision: str | torch.dtype = "fp16", low_precision_io: bool = False,
    opset: int | None = None, layernorm_stash: str = "off",
) -> tuple[ir.Model, dict[str, Any]]:
    """Export, attach the ``amplite`` functions, clean up casts and optimise (without inlining).

    Args:
        program: The converted ExportedProgram.
        precision: ``fp16`` or ``bf16``, or the dtype.
        low_precision_io: Make FP32 graph inputs and outputs the low dtype.
        opset: Default-domain opset (None: 20 for fp16, 22 for bf16).
        layernorm_stash: ``"off"`` (default: FP32 LayerNorm islands stay, exact under the ONNX spec), or
            run them as one low-precision LayerNormalization with FP32 statistics (``stash_type=1``),
            as ONNX Runtime computes it: ``"stash"`` where scale and bias are exact in the low dtype,
            ``"round"`` rounding them too (:mod:`amplite.onnx.norm`).

    Returns:
        The model and a dict with ``cleanup`` counters (``layernorm_stash`` among them) and ``timings``.
    """
    try:
        low = precision_dtype(precision)
    except ConfigError:
        raise ConfigError(f"precision {precision!r} is not fp16 or bf16", "pass --precision fp16 or bf16") from None
    if LAYERNORM_ALIASES.get(layernorm_stash, layernorm_stash) not in LAYERNORM_MODES:
        raise ConfigError(f"LayerNorm stash mode {layernorm_stash!r} is not one of {', '.join(LAYERNORM_MODES)}",
                          "pass off (the default), stash or round")
    if opset is not None and low is torch.bfloat16 and opset < MIN_OPSET_BF16:
        raise ConfigError(f"opset {opset} has no bfloat16 Cast (added in opset {MIN_OPSET_BF16})",
                          "use --opset 18 or newer (default 20), or --precision fp16")
    timings: dict[str, float] = {}
    start = perf_counter()
    target = opset or (DEFAULT_OPSET_BF16 if low is torch.bfloat16 else DEFAULT_OPSET)
    model = export_model(program, opset=target)
    timings["export"] = perf_counter() - start
    start = perf_counter()
    opset_version = model.opset_imports.get("", target)
    if opset_version != target:  # the version converter gives up silently on some graphs
        raise ConfigError(f"the exporter cannot write this model at opset {target} (it made {opset_version})",
                          f"use --opset {opset_version} or newer")
    used = {n.op_type for n in model.graph.all_nodes() if n.domain == DOMAIN}
    if used:
        if opset_version < MIN_OPSET_CONTRACT:
            raise ConfigError(f"opset {opset_version} cannot express amplite.Contract's body (CastLike, opset 15)",
                              "use --opset 18 or newer, or convert without --fuse-contractions")
        model.opset_imports[DOMAIN] = DOMAIN_VERSION
        for fn in contract_functions(opset_version):
            if fn.name in used:
                model.functions[fn.identifier()] = fn
    if low_precision_io:
        set_io_dtype(model, _LOW[low])
    first = cleanup_casts(model)
    onnxscript.optimizer.optimize_ir(model, inline=False)  # folding, CSE, dead code; functions kept
    stashed = stash_layernorms(model, layernorm_stash)
    second = cleanup_casts(model)  # the optimiser's folding can expose more
    islands = fp32_islands(model, DEFAULT_OPSET_BF16)["fp32_islands"]  # e.g. bf16 Einsum (none before 28)
    cleanup = {k: first[k] + second[k] for k in first} | {"casts_before": first["casts_before"],
                                                           "casts_after": count_casts(model),
                                                           "layernorm_stash": stashed, "fp32_islands": islands}
    timings["optimize"] = perf_counter() - start
    return model, {"cleanup": cleanup, "timings": timings}


def _initializer_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def _write_checked(model: ir.Model, dest: Path, external: bool) -> Path | None:
    """Write into a temporary directory beside ``dest``, check it there, then move it into place."""
    tmpdir = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    data_name = f"{dest.name}.data"
    moved: list[Path] = []
    try:
        tmp_model = tmpdir / dest.name
        if external:
            ir.save(model, tmp_model, external_data=data_name)
        else:
            ir.save(model, tmp_model)
        onnx.checker.check_model(str(tmp_model), full_check=True)
        data_dest = dest.with_name(data_name) if external else None
        if data_dest is not None:
            os.replace(tmpdir / data_name, data_dest)
            moved.append(data_dest)
        os.replace(tmp_model, dest)
        return data_dest
    except BaseException as exc:
        for p in moved:
            p.unlink(missing_ok=True)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(exc, (onnx.checker.ValidationError, onnx.shape_inference.InferenceError)):
            found = re.search(r"op_type:(\w+).*unsupported type: tensor\((b?float16)\)", str(exc))
            if found:
                opset = model.opset_imports.get("", DEFAULT_OPSET)
                newer = first_opset_with(found.group(1), found.group(2), opset)
                fix = (f"use --opset {newer} or newer" if newer else f"keep it in FP32: --keep-fp32 op:"
                       f"{found.group(1).lower()}, or save as .pt2")  # fmt: skip
                raise ConfigError(f"opset {opset} has no {found.group(2)} {found.group(1)}", fix) from exc
            raise ExportError(f"the exported ONNX model fails onnx.checker: {str(exc).splitlines()[0]}",
                              "save as .pt2 (--format pt2) and report this as an amplite bug") from exc
        raise EmitError(f"writing {str(dest)!r} failed: {type(exc).__name__}: {exc}",
                        "check disk space and permissions") from exc
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def save_onnx(
    program: ExportedProgram,
    path: str | Path,
    *,
    precision: str | torch.dtype = "fp16",
    low_precision_io: bool = False,
    external_data: bool | None = None,
    opset: int | None = None,
    layernorm_stash: str = "off",
) -> OnnxInfo:
    """Export a converted program to ONNX and write it atomically, checked.

    Args:
        program: The converted ExportedProgram (``ConversionResult.program``).
        path: Destination ``.onnx`` file; external data goes to ``<path>.data`` beside it.
        precision: ``fp16`` or ``bf16``, or the dtype (the low dtype; for the opset check and low-precision I/O).
        low_precision_io: Make FP32 graph inputs and outputs the low dtype (no-op if the program already
            has low-precision I/O).
        external_data: Force (True) or forbid (False) external data; None decides by size (> ~1.9 GiB).
        opset: Default-domain opset (None: 20 for fp16, 22 for bf16, where Conv/GRU/pooling gained bf16).
        layernorm_stash: ``"off"`` (default) keeps ``Cast → LayerNorm(FP32) → Cast`` islands; ``"stash"``
            / ``"round"`` rewrite them as one low-precision LayerNormalization with FP32 statistics
            (``stash_type=1``), which ONNX Runtime computes as the island but the ONNX spec does not.

    Returns:
        What was written, with Cast counts and clean-up counters.

    Raises:
        ConfigError: Opset too old for the model, or an unknown ``layernorm_stash``.
        ExportError: An op has no ONNX translation (named), or the exporter failed (cause named).
        EmitError: The destination cannot be written (nothing is left behind).
    """
    dest = check_writable(path)
    model, extra = prepare_model(program, precision=precision, low_precision_io=low_precision_io, opset=opset,
                                 layernorm_stash=layernorm_stash)
    size = _initializer_bytes(model)
    if external_data is False and size > EXTERNAL_DATA_THRESHOLD:
        raise ConfigError(f"the weights take {size / 2**30:.2f} GiB, over protobuf's 2 GiB limit",
                          "let amplite write external data (external_data=None or True)")
    external = bool(external_data) or size > EXTERNAL_DATA_THRESHOLD
    timings = extra["timings"]
    start = perf_counter()
    data_path = _write_checked(model, dest, external)
    timings["save_and_check"] = perf_counter() - start
    total = dest.stat().st_size + (data_path.stat().st_size if data_path else 0)
    return OnnxInfo(
        path=str(dest),
        data_path=str(data_path) if data_path else None,
        bytes=total,
        opset=model.opset_imports.get("", DEFAULT_OPSET),
        casts=count_casts(model),
        casts_in_functions=count_casts(model, functions=True),
        contract_nodes=sum(1 for n in model.graph.all_nodes() if n.domain == DOMAIN),
        cleanup=extra["cleanup"],
        inputs=[(v.name, str(v.dtype)) for v in model.graph.inputs],
        outputs=[(v.name, str(v.dtype)) for v in model.graph.outputs],
        timings={k: round(v, 4) for k, v in timings.items()},
    )
