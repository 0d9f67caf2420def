"""``amplite check DIR`` (and ``check DIR --converted OUT``): the accuracy gate for a checkpoint directory.

The checkpoint is converted as ``amplite convert DIR`` would, written to a temporary directory (so the
converted weights are read back from files, as a user gets them), verified block by block on the given
inputs (or seeded random ones shaped like the traced inputs) and judged by the tolerance.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amplite.checkpoint.convert import StreamedConversion, convert_checkpoint, on_meta
from amplite.checkpoint.fp8 import READ_BACK, Fp8Reader
from amplite.checkpoint.source import is_checkpoint_dir, open_checkpoint
from amplite.errors import ConfigError
from amplite.options import ConvertOptions
from amplite.report.document import Report
from amplite.report.sections import Fp8Checkpoint
from amplite.verify.compare import parse_tolerance

#: A check of the written directory (the generation check): the new report (reports are frozen) and its reasons.
CheckMore = Callable[[Report, Path], tuple[Report, list[str]]]


def check_checkpoint(
    path: str | Path, example_inputs: Any = None, *, tolerance: Any = None,
    check_more: CheckMore | None = None, options: ConvertOptions | None = None,
    converted: str | Path | None = None, **changes: Any,
) -> tuple[StreamedConversion, list[str]]:
    """Convert, write to a temporary directory, verify block by block; the conversion and failure reasons.

    The conversion options are those of ``amplite.convert(DIR)`` (any other one given is refused).
    ``converted``: a directory already written (by ``amplite convert DIR``, then perhaps copied, edited or
    uploaded) is checked against its source instead of a fresh conversion (:func:`check_converted_dir`).
    ``check_more(report, written directory)`` then runs on the written directory (the generation check)
    and returns its failure reasons.
    """
    opts = ConvertOptions.of(options, **changes)
    if converted is not None:
        return check_converted_dir(path, converted, example_inputs, tolerance=tolerance, check_more=check_more,
                                   options=opts)  # fmt: skip
    conv = convert_checkpoint(path, example_inputs, options=opts)
    tol = _tolerance(tolerance, conv)
    real = example_inputs if example_inputs is not None and not on_meta(example_inputs) else None
    conv.check_loadable()  # what is checked is the safetensors output: one from_pretrained would break is refused
    with tempfile.TemporaryDirectory(prefix=".amplite-check.") as tmp:
        out = conv.save_safetensors(Path(tmp) / "converted")
        section = conv.verify(out, real, tolerance=tol)
        more = _check_more(conv, out, check_more)
    return conv, _reasons(section) + more


def check_converted_dir(
    path: str | Path, converted: str | Path, example_inputs: Any = None, *, tolerance: Any = None,
    check_more: CheckMore | None = None, options: ConvertOptions | None = None,
) -> tuple[StreamedConversion, list[str]]:
    """``check SRC --converted OUT``: an existing converted directory (copied, edited, uploaded) against its
    source, as ``from_pretrained`` loads it: block by block (the source's plan, OUT's weights in the dtypes the
    loader gives them; an FP8 directory read back with its scales) and, with ``check_more``, on generation.
    Nothing is written.

    The precision is OUT's (``config.json``'s dtype, or FP8 for a ``quantization_config`` amplite wrote) unless
    one is given.

    Raises:
        ConfigError: OUT is not a checkpoint directory, or lacks a tensor the source's model reads.
    """
    if not isinstance(converted, (str, Path)) or not is_checkpoint_dir(Path(converted)):
        raise ConfigError(f"--converted {converted!s:.80} is not a checkpoint directory (config.json + "
                          "*.safetensors)", "pass the directory `amplite convert SRC` wrote")  # fmt: skip
    out = Path(converted)
    written = open_checkpoint(out)
    opts = ConvertOptions.of(options)
    if opts.precision is None:
        fp8 = Fp8Reader(written).precision if "quantization_config" in written.config else None
        stored = fp8 or {"bfloat16": "bf16", "float16": "fp16"}.get(str(written.config.get("dtype", "")))
        if stored is not None:
            opts = ConvertOptions.of(opts, precision=stored)
    conv = convert_checkpoint(path, example_inputs, options=opts)
    missing = [n for n in conv.keys.shard_targets() if n not in written.tensors]
    if missing:
        raise ConfigError(f"{out} has no tensor {missing[0]!r}, which {path} holds and its model reads",
                          "check OUT against the checkpoint it was converted from")  # fmt: skip
    tol = _tolerance(tolerance, conv)
    real = example_inputs if example_inputs is not None and not on_meta(example_inputs) else None
    section = conv.verify(out, real, tolerance=tol)
    if conv.fp8 is not None:  # describe the directory checked, not a fresh plan
        described = conv.report.section(Fp8Checkpoint)
        scheme = Fp8Reader(written).scheme
        conv.report = conv.report.with_sections(Fp8Checkpoint.from_json({
            **described.to_json(), "activation_scheme": scheme, "calibration": None,
            "verified_as": READ_BACK[scheme]}))  # fmt: skip
    return conv, _reasons(section) + _check_more(conv, out, check_more)


def _check_more(conv: StreamedConversion, out: Path, check_more: CheckMore | None) -> list[str]:
    """Run ``check_more`` on the written directory: ``conv.report`` becomes the report it returns; its reasons."""
    if check_more is None:
        return []
    conv.report, more = check_more(conv.report, out)
    return more


def _tolerance(tolerance: Any, conv: StreamedConversion) -> Any:
    precision = conv.spec.precision_name
    return parse_tolerance(list(tolerance or ()), precision) if not hasattr(tolerance, "criteria") else tolerance


def _reasons(section: dict[str, Any]) -> list[str]:
    reasons = []
    for o in section["outputs"]:
        if not o["passed"]:
            failed = [f"{c['criterion']} (got {c['value']})" for c in o.get("checks", []) if not c["passed"]]
            reasons.append(f"{o['name']}: " + "; ".join(failed + list(o.get("notes", []))))
    return reasons
