"""``amplite check DIR``: the accuracy gate for a checkpoint directory.

The checkpoint is converted as ``amplite convert DIR`` would, written to a temporary directory (so the
converted weights are read back from files, as a user gets them), verified block by block on the given
inputs (or seeded random ones shaped like the traced inputs) and judged by the tolerance.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amplite.checkpoint.convert import StreamedConversion, _on_meta, convert_checkpoint
from amplite.checkpoint.fp8 import READ_BACK, Fp8Reader, tolerance_precision
from amplite.checkpoint.source import open_checkpoint
from amplite.errors import ConfigError
from amplite.options import ConvertOptions
from amplite.report.document import Report
from amplite.report.sections import Fp8Checkpoint
from amplite.verify.compare import parse_tolerance


def check_checkpoint(
    path: str | Path, example_inputs: Any = None, *, tolerance: Any = None,
    check_more: Callable[[Report, Path], list[str]] | None = None, options: ConvertOptions | None = None,
    converted: str | Path | None = None, **changes: Any,
) -> tuple[StreamedConversion, list[str]]:
    """Convert, write to a temporary directory, verify block by block; the conversion and failure reasons.

    The conversion options are those of ``amplite.convert(DIR)`` (any other one given is refused).
    ``converted``: a directory already written by ``amplite convert DIR`` (e.g. an FP8 one, read back with its
    scales) is verified instead of a fresh conversion; its precision is the one it records unless given.
    ``check_more(report, written directory)`` then runs on the written directory (the generation check)
    and returns its failure reasons.
    """
    opts = ConvertOptions.of(options, **changes)
    if converted is not None:
        if not isinstance(converted, (str, Path)) or not Path(converted).is_dir():
            raise ConfigError(f"--converted {converted!s:.80} is not a directory: for a checkpoint directory it is the "
                              "directory `amplite convert DIR` wrote", "pass that directory, or drop --converted")
        written = open_checkpoint(converted)  # refuses what is not a checkpoint directory
        if opts.precision is None and "quantization_config" in written.config:
            opts = ConvertOptions.of(opts, precision=Fp8Reader(written).precision)
    conv = convert_checkpoint(path, example_inputs, options=opts)
    precision = tolerance_precision(conv.data["config"]["precision"])
    tol = parse_tolerance(list(tolerance or ()), precision) if not hasattr(tolerance, "criteria") else tolerance
    real = example_inputs if example_inputs is not None and not _on_meta(example_inputs) else None
    with tempfile.TemporaryDirectory(prefix=".amplite-check.") as tmp:
        out = conv.save_safetensors(Path(tmp) / "converted") if converted is None else Path(converted)
        section = conv.verify(out, real, tolerance=tol)
        if converted is not None and conv.fp8 is not None:  # describe the directory checked, not a fresh plan
            described = conv.report.section(Fp8Checkpoint)
            scheme = Fp8Reader(open_checkpoint(out)).scheme
            conv.report.attach(Fp8Checkpoint({**described.to_json(), "activation_scheme": scheme,
                                              "calibration": None, "verified_as": READ_BACK[scheme]}))  # fmt: skip
        more = check_more(conv.report, out) if check_more is not None else []
    reasons = []
    for o in section["outputs"]:
        if not o["passed"]:
            failed = [f"{c['criterion']} (got {c['value']})" for c in o.get("checks", []) if not c["passed"]]
            reasons.append(f"{o['name']}: " + "; ".join(failed + list(o.get("notes", []))))
    return conv, reasons + more
