"""``convert_to_files``: convert a model and write every requested output (the library call behind
``amplite convert``).

Destinations are checked before the conversion starts (a bad path fails in a second, not after a
minute of tracing), and every file is written atomically. Layer: like ``amplite.api``, which it calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amplite.api import ConversionResult, convert
from amplite.checkpoint import StreamedConversion, checkpoint_to_files, is_checkpoint_dir
from amplite.checkpoint.fp8 import split_fp8
from amplite.converter import emit
from amplite.errors import ConfigError, EmitError
from amplite.levels import resolve_level
from amplite.llm.checkpoint import generation_check
from amplite.options import ConvertOptions
from amplite.paths import derived_output, guard_outputs, same_path
from amplite.report.checks import VerificationAoti, VerificationOnnx


@dataclass
class SavedConversion:
    """What ``convert_to_files`` wrote.

    Attributes:
        result: The conversion (``result.report.data`` is report.json).
        written: The model files, in the order written.
        report_path: Where report.json went.
    """

    result: ConversionResult | StreamedConversion
    written: list[Path]
    report_path: Path

    @property
    def exit_code(self) -> int:
        """0 converted and verified (also in ONNX Runtime when ONNX was written), 1 verification failed."""
        report = self.result.report
        onnx, aoti = report.section(VerificationOnnx), report.section(VerificationAoti)
        onnx_ok = onnx.passed if onnx is not None else None
        aoti_ok = aoti.passed if aoti is not None else None
        return 1 if self.result.passed is False or onnx_ok is False or aoti_ok is False else 0


def default_output(model: str | Path, precision: str, level: str | None) -> Path:
    """``NAME.<precision>.<level>.pt2`` next to the model file."""
    model = Path(model)
    return model.with_name(f"{model.name.split('.')[0]}.{precision}.{resolve_level(level, precision).value}.pt2")


def written_by_amplite(model: str | Path, report_path: Path, output: Path | None = None) -> bool:
    """Whether ``report_path`` is the report amplite wrote when converting ``model`` (to ``output``): only
    then may a derived (default) name replace an existing file."""
    try:
        data = json.loads(report_path.read_text(encoding="utf-8"))
        if not same_path(data["source"]["path"], model):
            return False
        return output is None or any(same_path(o["path"], output) for o in data["outputs"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def convert_to_files(
    model: str | Path,
    example_inputs: Any = None,
    *,
    output: str | Path | None = None,
    formats: str | None = None,
    report: str | Path | None = None,
    external_data: bool = False,
    opset: int | None = None,
    onnx_layernorm: str = "off",
    verify_max_memory: float | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    inputs_file: str | Path | None = None,
    options: ConvertOptions | None = None,
    **changes: Any,
) -> SavedConversion:
    """Convert ``model`` and write the converted model(s) and report.json.

    Args:
        model: Path to the model file.
        example_inputs: As for :func:`amplite.convert`.
        output: Destination (default :func:`default_output`); its suffix picks the format.
        formats: Comma list of ``pt2,onnx`` (default: from ``output``'s suffix).
        report: report.json path (default: next to the output).
        external_data: ONNX weights in a ``.data`` file.
        opset: ONNX opset.
        onnx_layernorm: ONNX LayerNorm mode (see ``ConversionResult.save``).
        verify_max_memory: Checkpoint directories: bound (GB) on the weights block-wise verification holds.
        progress: Checkpoint directories: called as ``(step, bytes done, bytes total)`` on long steps.
        inputs_file: The file ``example_inputs`` were read from, if any (no output may overwrite it).
        options: The conversion options; a ``tolerance`` given (``sqnr>=45``...) also turns on the
            accuracy-budget search, so that a failing plan is repaired rather than written.
        **changes: Options by name, over ``options`` (as for :func:`amplite.convert`).

    Raises:
        AmpliteError: Bad options or an unwritable destination (raised before converting); an output that
            is an input or another output, or a default name that would replace a file amplite did not write.
    """
    opts = ConvertOptions.of(options, **changes)
    if is_checkpoint_dir(model):
        plain, fp8 = split_fp8(opts)  # precision fp8: a checkpoint directory only (vLLM's layout)
        precision = "bf16" if fp8 is not None else plain.precision_name
        # -o is a directory here (replaced as a whole): a directory output, not a file one as well.
        guard_outputs(_inputs(model, inputs_file, opts.calibration), [("--report", report)],
                      [("-o", output)])  # fmt: skip
        tol = plain.verification().tolerance
        # token_agreement / ppl_delta criteria: the written directory is also checked on generation
        generation = generation_check(model, tol, precision) if opts.verify else None
        conv, written, report_path = checkpoint_to_files(
            model, example_inputs, output=output, formats=formats, report=report, options=opts,
            verify_max_memory=verify_max_memory, progress=progress or (lambda *_: None), check_more=generation,
        )  # fmt: skip
        return SavedConversion(conv, written, report_path)  # type: ignore[arg-type]
    precision = opts.precision_name
    dest = Path(output) if output is not None else default_output(model, precision, opts.level)
    emit.check_writable(dest)
    targets = emit.plan_outputs(dest, formats)
    report_path = Path(report) if report is not None else dest.with_name(dest.stem + ".report.json")
    _guard(model, inputs_file, opts.calibration, targets, report_path, external_data,
           derived=output is None, derived_report=report is None)  # fmt: skip
    if (opset is not None or external_data or onnx_layernorm != "off") and "onnx" not in dict(targets):
        raise ConfigError("--opset, --external-data and --onnx-layernorm apply to ONNX output",
                          "add --format onnx (or -o X.onnx)")  # fmt: skip
    if onnx_layernorm != "off":
        from amplite.onnx.norm import ALIASES, MODES  # onnx_ir imports in ~1 s: only for an ONNX option

        if ALIASES.get(onnx_layernorm, onnx_layernorm) not in MODES:
            raise ConfigError(f"unknown --onnx-layernorm {onnx_layernorm!r}", f"use one of: {', '.join(MODES)}")
    for _fmt, path in targets:
        emit.check_writable(path)
    emit.check_writable(report_path)
    if opts.tolerance:
        opts = ConvertOptions.of(opts, tolerance=opts.verification().tolerance, fallback_search=True)
    result = convert(model, example_inputs, options=opts)
    written: list[Path] = []
    try:
        for fmt, path in targets:
            written.append(result.save(path, format=fmt, external_data=True if external_data else None,
                                       opset=opset, layernorm_stash=onnx_layernorm))  # fmt: skip
        result.report.save(report_path)
    except EmitError:  # a later write failed (disk full): leave no half set of outputs behind
        for done in written:
            done.unlink(missing_ok=True)
            if done.suffix == ".onnx":
                done.with_name(done.name + ".data").unlink(missing_ok=True)
        raise
    return SavedConversion(result, [p for _, p in targets], report_path)


def _inputs(model: Any, inputs_file: Any, calibration: Any) -> list[tuple[str, Any]]:
    calib = calibration if isinstance(calibration, (str, Path)) and Path(calibration).exists() else None
    path = model if isinstance(model, (str, Path)) else None
    return [("the model", path), ("the --inputs file", inputs_file), ("the --calib directory", calib)]


def _guard(model: Any, inputs_file: Any, calibration: Any, targets: list[tuple[str, Path]], report_path: Path,
           external_data: bool, *, derived: bool, derived_report: bool) -> None:
    """No output overwrites an input or another output; default names never replace what amplite did not
    write (``amplite.paths``)."""
    label = "the default output (-o)" if derived else "-o"
    outs: list[tuple[str, Any]] = [(f"{label} for {fmt}" if len(targets) > 1 else label, p) for fmt, p in targets]
    outs += [("the ONNX external data (-o)", p.with_name(p.name + ".data")) for fmt, p in targets
             if fmt == "onnx" and external_data]  # fmt: skip
    outs.append(("the default report (--report)" if derived_report else "--report", report_path))
    guard_outputs(_inputs(model, inputs_file, calibration), outs)
    if derived:
        for _fmt, p in targets:
            derived_output(p, lambda q: written_by_amplite(model, report_path, q))
    if derived_report:
        derived_output(report_path, lambda q: written_by_amplite(model, q))
