"""``amplite check``: convert (or load a converted model), verify it on data, and gate CI on the result.

Exit codes: 0 every output within tolerance and no regression against the baseline; 1 an accuracy
failure or regression; 2 bad input (raised as :class:`~amplite.errors.AmpliteError`, nothing written).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from amplite.checkpoint.source import is_checkpoint_dir
from amplite.describe import summarize_exception
from amplite.errors import ConfigError, InputSpecError
from amplite.gate import steps
from amplite.gate.outputs import CheckResult, finish, model_name, prepare_outputs, read_paths
from amplite.gate.settings import CheckSettings, check_signature
from amplite.options import ConvertOptions
from amplite.paths import guard_outputs
from amplite.report.sections import Golden, Source, Timings, Verification
from amplite.verify import baseline as baseline_mod
from amplite.verify import data as data_mod
from amplite.verify import golden as golden_mod
from amplite.verify.compare import Tolerance, parse_tolerance

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def make_golden(
    model: Any,
    example_inputs: Any = None,
    *,
    output: str | Path,
    update: bool = False,
    data: Any = None,
    data_loader: str | None = None,
    random_batches: int = 0,
    input_specs: Sequence[str] = (),
    max_batches: int = 64,
    inputs_file: str | Path | None = None,
    options: ConvertOptions | None = None,
    **changes: Any,
) -> Path:
    """``amplite golden``: save inputs and FP32 reference outputs under ``output`` (see ``golden``).

    Of the conversion options (``options``, ``**changes``) only those that read and trace the model apply.

    Raises:
        AmpliteError: Bad model, inputs or directory (the directory exists without ``update``, or it is
            or holds one of the inputs: it is replaced as a whole).
    """
    guard_outputs(read_paths(model, inputs_file, data), [], [("-o", output)])
    ref = steps.reference(model, example_inputs, ConvertOptions.of(options, **changes).only_for("reference"))
    gm = ref.original.module()
    batches = data_mod.select_batches(ref.inputs, data, data_loader, random_batches, input_specs, max_batches)
    fitted = [(label, data_mod.fit_inputs(gm, b, label)) for label, b in batches]
    source = ref.report.section(Source) or Source()
    src = {"path": source.path, "format": source.format}
    return golden_mod.save_golden(output, gm, fitted, source=src, update=update)


def check(
    model: Any,
    example_inputs: Any = None,
    *,
    settings: CheckSettings | None = None,
    options: ConvertOptions | None = None,
    **changes: Any,
) -> CheckResult:
    """Convert ``model`` (or load ``converted``), verify it on data and judge it.

    Args:
        model: The FP32 model: module, ExportedProgram or file (as for ``amplite.convert``).
        example_inputs: As for ``amplite.convert``; optional with ``golden`` or a .pt2 storing them.
        settings: The gate's settings (:class:`~amplite.gate.settings.CheckSettings`: golden, baseline,
            tolerance, data, report_dir, junit, train_steps, ...).
        options: The conversion options (``amplite.ConvertOptions``).
        **changes: Either by name, over those (``golden=``, ``tolerance=["sqnr>=45"]``, ``level="O2"``...;
            ``tolerance`` is the gate's). The shown signature lists them all.

    Raises:
        AmpliteError: Bad model, inputs, data, golden directory, baseline or options (exit 2).
    """
    s, opts = CheckSettings.split(settings, options, changes)
    # a NaN margin made every baseline comparison False (no regression, ever); a negative one failed every run
    if not (math.isfinite(s.baseline_margin_db) and s.baseline_margin_db >= 0):
        raise ConfigError(f"--baseline-margin {s.baseline_margin_db!r} is not a number of dB >= 0",
                          "pass the SQNR loss allowed against the baseline, e.g. --baseline-margin 1")  # fmt: skip
    out_dir = _guard_files(model, s, opts.calibration)
    if isinstance(model, (str, Path)) and is_checkpoint_dir(model):
        return _check_checkpoint(model, example_inputs, s, out_dir, opts)
    if s.train_steps:
        return _check_training(model, example_inputs, s, out_dir, opts)
    gold = golden_mod.load_golden(s.golden) if s.golden is not None and not s.update_golden else None
    early = s.batches(None) if gold is None and s.has_data else None
    if example_inputs is None and (gold or early):  # the first batch serves to trace the model
        example_inputs = (gold.batches if gold else early)[0][1]
    if s.tolerance is not None and not isinstance(s.tolerance, Tolerance):
        parse_tolerance(s.tolerance)  # fail on a bad criterion before any work
    base_line = baseline_mod.load_baseline(s.baseline)
    if s.tolerance and opts.tolerance is None and opts.verification().searches(opts.spec()):
        # the budget search (fp8's default) aims at the gate's criteria
        opts = ConvertOptions.of(opts, tolerance=s.tolerance)
    timings: dict[str, float] = {}
    try:
        pair = steps.pair(model, example_inputs, s.converted, opts, gold, s.golden, timings)
    except InputSpecError as exc:  # the first data batch stood in for example inputs: name it, not "the example"
        if early is None or example_inputs is not early[0][1]:
            raise
        cause = summarize_exception(exc.__cause__) if exc.__cause__ is not None else exc.problem
        raise InputSpecError(f"batch 0 ({early[0][0]}), which traces the model, does not fit it: {cause}",
                             "give batches shaped like the model's inputs, or pass --input/--inputs to trace "
                             "with (the batches are then checked against them one by one)") from exc  # fmt: skip
    tol = s.tolerance if isinstance(s.tolerance, Tolerance) else parse_tolerance(s.tolerance or (), pair.precision)
    batches = early or s.batches(pair.example)
    if s.golden is not None and s.update_golden:
        gold = steps.update_golden(s.golden, pair, batches)
    batches = gold.batches if gold is not None else batches
    metrics, drift = steps.verify_batches(pair, batches, gold, tol, timings)
    report = pair.report.builder()  # the check's report: the conversion's sections and the check's own
    described = data_mod.describe(gold, s.data, s.data_loader, s.random_batches, len(batches))
    report.add(Verification.of(metrics, tol, inputs=described, batches=len(batches)))
    if gold:
        report.add(Golden.of(steps.golden_section(gold, drift, pair.precision, s.update_golden)))
    if s.layerwise:
        steps.layerwise(report, pair, batches[0][1], timings)
    grad = steps.gradients(report, pair, batches[0][1], s.loss, s.converted is None, opts, timings) if s.grad else []
    reasons = steps.failures(metrics) + steps.regressions(report, base_line, s.baseline_margin_db) + grad
    report.add(pair.report.section(Timings).add(**timings))
    return finish(report, reasons, metrics, s.name or model_name(model, pair.report.data), out_dir, s.junit)


check.__signature__ = check_signature(check)  # type: ignore[attr-defined]


def _guard_files(model: Any, s: CheckSettings, calibration: Any) -> Path | None:
    """Refuse an output that would overwrite an input, and an output that cannot be written, before any work."""
    reads = read_paths(model, s.inputs_file, s.data, calibration)
    reads += [("the --converted model", s.converted if isinstance(s.converted, (str, Path)) else None),
              ("the --baseline report", s.baseline if isinstance(s.baseline, (str, Path)) else None)]  # fmt: skip
    if not s.update_golden:
        reads.append(("the --golden directory", s.golden))
    outs = [(f"--report's {n}", Path(s.report_dir) / n) for n in ("report.json", "report.md", "report.html")
            if s.report_dir is not None]  # fmt: skip
    guard_outputs(reads, [*outs, ("--junit", s.junit)], [("--golden (with --update-golden)", s.golden)]
                  if s.update_golden else [])  # fmt: skip
    return prepare_outputs(s.report_dir, s.junit)


def _check_checkpoint(model: str | Path, example: Any, s: CheckSettings, out_dir: Path | None,
                      opts: ConvertOptions) -> CheckResult:  # fmt: skip
    """``check DIR`` for a transformers checkpoint directory: streamed conversion and block-wise verification."""
    from amplite.checkpoint.check import check_checkpoint
    from amplite.checkpoint.fp8 import split_fp8
    from amplite.llm.checkpoint import generation_check

    s.refuse_for("a checkpoint directory", {"golden": "--golden", "baseline": "--baseline",
                 "data": "--data", "data_loader": "--data-loader", "random_batches": "--random-batches",
                 "grad": "--grad"}, "check it with --input/--inputs and --tolerance")  # fmt: skip
    # token_agreement / ppl_delta criteria: the written directory is also checked on generation
    plain, fp8 = split_fp8(opts)  # an FP8 checkpoint's generation criteria default to bf16's (its outputs are bf16)
    generation = generation_check(model, s.tolerance, "bf16" if fp8 is not None else plain.precision_name)
    # with --converted: an existing converted directory against its source, as from_pretrained loads it
    conv, reasons = check_checkpoint(model, example, tolerance=s.tolerance, check_more=generation, options=opts,
                                     converted=s.converted)  # fmt: skip
    return finish(conv.report, reasons, [], s.name or Path(model).name, out_dir, s.junit)


def _check_training(model: Any, example: Any, s: CheckSettings, out_dir: Path | None,
                    opts: ConvertOptions) -> CheckResult:  # fmt: skip
    """``check --train-steps``: the training gate (amplite.training.gate), reported like any check."""
    from amplite.training.gate import train_check

    s.refuse_for("--train-steps (it trains the model itself)", {"converted": "--converted", "golden": "--golden",
                 "baseline": "--baseline"}, "drop them")  # fmt: skip
    batches = s.batches(None) if s.data or s.data_loader else []
    described = data_mod.describe(None, s.data, s.data_loader, 0, len(batches)) if batches else "example inputs"
    report, reasons = train_check(model, example, batches, steps=s.train_steps, lr=s.lr, tolerance=s.tolerance,
                                  inputs_description=described, options=opts)  # fmt: skip
    return finish(report, reasons, [], s.name or model_name(model, report.data), out_dir, s.junit)
