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

from amplite.checkpoint.convert import StreamedConversion, _on_meta, convert_checkpoint
from amplite.checkpoint.source import is_checkpoint_dir, open_checkpoint
from amplite.errors import ConfigError
from amplite.options import ConvertOptions
from amplite.report.document import Report
from amplite.verify.compare import parse_tolerance


def check_checkpoint(
    path: str | Path, example_inputs: Any = None, *, tolerance: Any = None,
    check_more: Callable[[Report, Path], list[str]] | None = None, options: ConvertOptions | None = None,
    **changes: Any,
) -> tuple[StreamedConversion, list[str]]:
    """Convert, write to a temporary directory, verify block by block; the conversion and failure reasons.

    The conversion options are those of ``amplite.convert(DIR)`` (any other one given is refused).
    ``check_more(report, written directory)`` then runs on the written directory (the generation check)
    and returns its failure reasons.
    """
    conv = convert_checkpoint(path, example_inputs, options=ConvertOptions.of(options, **changes))
    precision = conv.data["config"]["precision"]
    tol = parse_tolerance(list(tolerance or ()), precision) if not hasattr(tolerance, "criteria") else tolerance
    real = example_inputs if example_inputs is not None and not _on_meta(example_inputs) else None
    conv.check_loadable()  # what is checked is the safetensors output: one from_pretrained would break is refused
    with tempfile.TemporaryDirectory(prefix=".amplite-check.") as tmp:
        out = conv.save_safetensors(Path(tmp) / "converted")
        section = conv.verify(out, real, tolerance=tol)
        more = check_more(conv.report, out) if check_more is not None else []
    return conv, _reasons(section) + more


def check_converted_dir(
    path: str | Path, converted: str | Path, example_inputs: Any = None, *, tolerance: Any = None,
    check_more: Callable[[Report, Path], list[str]] | None = None, options: ConvertOptions | None = None,
) -> tuple[StreamedConversion, list[str]]:
    """``check SRC --converted OUT``: an existing converted directory (copied, edited, uploaded) against its
    source, as ``from_pretrained`` loads it: block by block (the source's plan, OUT's weights in the dtypes the
    loader gives them) and, with ``check_more``, on generation. Nothing is written.

    The precision is OUT's ``config.json`` dtype unless one is given.

    Raises:
        ConfigError: OUT is not a checkpoint directory, or lacks a tensor the source's model reads.
    """
    out = Path(converted)
    if not is_checkpoint_dir(out):
        raise ConfigError(f"--converted {out} is not a checkpoint directory (config.json + *.safetensors)",
                          "pass the directory `amplite convert SRC` wrote")  # fmt: skip
    written = open_checkpoint(out)
    opts = ConvertOptions.of(options)
    stored = {"bfloat16": "bf16", "float16": "fp16"}.get(str(written.config.get("dtype", "")))
    if opts.precision is None and stored is not None:
        opts = ConvertOptions.of(opts, precision=stored)
    conv = convert_checkpoint(path, example_inputs, options=opts)
    missing = [n for n in conv.keys.shard_targets() if n not in written.tensors]
    if missing:
        raise ConfigError(f"{out} has no tensor {missing[0]!r}, which {path} holds and its model reads",
                          "check OUT against the checkpoint it was converted from")  # fmt: skip
    precision = conv.data["config"]["precision"]
    tol = parse_tolerance(list(tolerance or ()), precision) if not hasattr(tolerance, "criteria") else tolerance
    real = example_inputs if example_inputs is not None and not _on_meta(example_inputs) else None
    section = conv.verify(out, real, tolerance=tol)
    more = check_more(conv.report, out) if check_more is not None else []
    return conv, _reasons(section) + more


def _reasons(section: dict[str, Any]) -> list[str]:
    reasons = []
    for o in section["outputs"]:
        if not o["passed"]:
            failed = [f"{c['criterion']} (got {c['value']})" for c in o.get("checks", []) if not c["passed"]]
            reasons.append(f"{o['name']}: " + "; ".join(failed + list(o.get("notes", []))))
    return reasons
