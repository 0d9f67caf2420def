"""``amplite convert DIR``: plan, write by streaming, verify block by block, write report.json.

Outputs (``formats``): ``safetensors`` (a directory in the checkpoint's layout, the default) and/or
``pt2``. Nothing partial is left behind: each output is written to a temporary path and renamed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from amplite.checkpoint.convert import (
    Progress,
    StreamedConversion,
    _no_progress,
    convert_checkpoint,
    on_meta,
    peak_rss_bytes,
)
from amplite.checkpoint.fp8 import split_fp8
from amplite.checkpoint.outputs import (
    _remove,
    _restore_sigterm,
    _sigterm_raises,
    _size,
    check_outputs,
    check_verify_memory,
    plan_checkpoint_outputs,
    write_outputs,
)
from amplite.converter import emit
from amplite.errors import ConfigError
from amplite.options import ConvertOptions
from amplite.report.document import Report
from amplite.report.sections import Outputs, Streaming


def checkpoint_to_files(
    source: str | Path,
    example_inputs: Any = None,
    *,
    output: str | Path | None = None,
    formats: str | None = None,
    report: str | Path | None = None,
    verify_max_memory: float | None = None,
    progress: Progress = _no_progress,
    check_more: Callable[[Report, Path], tuple[Report, list[str]]] | None = None,
    options: ConvertOptions | None = None,
    **changes: Any,
) -> tuple[StreamedConversion, list[Path], Path]:
    """Convert a checkpoint directory and write its outputs and report.json.

    ``check_more(report, safetensors directory)`` runs after block-wise verification (with ``verify``)
    and may add to the report (``amplite.llm.checkpoint.GenerationCheck``: the generation check); it needs
    a safetensors output, which is checked before anything is converted.

    Returns:
        The conversion, the outputs written and the report path.

    Raises:
        AmpliteError: A bad directory, option or destination (before anything is written).
    """
    opts = ConvertOptions.of(options, **changes)
    plain = split_fp8(opts)[0]
    plain.only_for("checkpoint")  # before any work
    verify, tolerance = opts.verify, plain.verification().tolerance
    src = Path(source)
    targets = plan_checkpoint_outputs(src, output, formats, opts.spec("checkpoint"))
    check_outputs(targets)
    first = targets[0][1]
    name = first.stem if first.suffix == ".pt2" else first.name
    report_path = Path(report) if report is not None else first.with_name(name + ".report.json")
    emit.check_writable(report_path)
    if verify and check_more is not None and not any(f == "safetensors" for f, _ in targets):
        raise ConfigError("token_agreement/ppl_delta are measured on the safetensors output, and none is written",
                          "add it: --format safetensors,pt2 (or -o DIR)")  # fmt: skip
    conv = convert_checkpoint(src, example_inputs, options=opts, progress=progress)
    targets = conv.writable(targets)  # no program (untraced): no .pt2, said in the report
    if any(f == "safetensors" for f, _ in targets):
        conv.check_loadable()
    if verify and verify_max_memory is not None and conv.untraced is None:  # refused before anything is written
        check_verify_memory(conv, verify_max_memory)
    written: list[Path] = []
    previous = _sigterm_raises()
    try:
        write_outputs(conv, targets, progress, written)
        if verify:  # from what was written: the safetensors directory when there is one, else the .pt2
            weights = next((p for f, p in targets if f == "safetensors"), targets[0][1])
            real = example_inputs if example_inputs is not None and not on_meta(example_inputs) else None
            conv.verify(weights, real, tolerance=tolerance, max_memory_gb=verify_max_memory, progress=progress)
        streamed_peak = peak_rss_bytes()  # before check_more, which may load whole models
        if verify and check_more is not None:
            conv.report, _ = check_more(conv.report, weights)
    except BaseException:
        for path in written:
            _remove(path)
        raise
    finally:
        _restore_sigterm(previous)
    conv.report = conv.report.with_sections(
        Outputs.of([{"format": f, "path": str(p), "bytes": _size(p)} for f, p in targets]),
        Streaming.of(streamed_peak, conv.checkpoint.largest_shard_bytes, len(conv.checkpoint.shards)),
    )
    conv.report.save(report_path)
    return conv, written, report_path
