"""``amplite check``: convert (or load a converted model), verify it on data, and gate CI on the result.

Exit codes: 0 every output within tolerance and no regression against the baseline; 1 an accuracy
failure or regression; 2 bad input (raised as :class:`~amplite.errors.AmpliteError`, nothing written).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from amplite.checkpoint.source import is_checkpoint_dir
from amplite.errors import ConfigError
from amplite.gate import steps
from amplite.gate.outputs import CheckResult, finish, model_name, prepare_outputs, read_paths
from amplite.options import ConvertOptions
from amplite.paths import guard_outputs
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
    src = {"path": ref.report.data["source"]["path"], "format": ref.report.data["source"]["format"]}
    return golden_mod.save_golden(output, gm, fitted, source=src, update=update)


def check(
    model: Any,
    example_inputs: Any = None,
    *,
    converted: str | Path | ExportedProgram | None = None,
    golden: str | Path | None = None,
    update_golden: bool = False,
    baseline: str | Path | dict[str, Any] | None = None,
    baseline_margin_db: float = 1.0,
    tolerance: Tolerance | Sequence[str] | None = None,
    data: str | Path | None = None,
    data_loader: str | None = None,
    random_batches: int = 0,
    input_specs: Sequence[str] = (),
    max_batches: int = 64,
    layerwise: bool = True,
    grad: bool = False,
    loss: str | Callable[[Any], torch.Tensor] | None = None,
    report_dir: str | Path | None = None,
    junit: str | Path | None = None,
    name: str | None = None,
    train_steps: int = 0,
    lr: float = 1e-3,
    inputs_file: str | Path | None = None,
    options: ConvertOptions | None = None,
    **changes: Any,
) -> CheckResult:
    """Convert ``model`` (or load ``converted``), verify it on data and judge it.

    Args:
        model: The FP32 model: module, ExportedProgram or file (as for ``amplite.convert``).
        example_inputs: As for ``amplite.convert``; optional with ``--golden`` or a .pt2 storing them.
        converted: A converted .pt2 to check instead of converting now.
        golden: A golden directory: its inputs are the data and its outputs the reference.
        update_golden: (Re)write ``golden`` from the FP32 model first.
        baseline: An accepted earlier report.json (path or dict); worse metrics beyond the margin fail.
        baseline_margin_db: Allowed loss: SQNR may drop this many dB, errors grow by the same ratio.
        tolerance: A Tolerance or ``--tolerance`` strings (``sqnr>=45``, ``logits:top1>=0.999``).
        data: Directory of batch files. data_loader: ``module:function`` yielding batches.
        random_batches: Number of seeded random batches (from ``input_specs`` or the example's shapes).
        input_specs: ``--input`` specs, for random batches.
        max_batches: At most this many batches are used.
        layerwise: Localise the error node by node (first batch).
        grad: Also compare parameter gradients of one backward pass (``loss`` or sum of outputs).
        report_dir: Write report.json, report.md and report.html here (created if missing).
        junit: Write a JUnit XML file here.
        name: Model name for JUnit/annotations (default: the file stem or class name).
        train_steps: Instead of verifying outputs, train an FP32 and an amplite copy this many steps and gate
            on ``train_loss_gap`` (:mod:`amplite.training.gate`). lr: Their AdamW learning rate.
        inputs_file: The file ``example_inputs`` were read from, if any (no output may overwrite it).
        options: The conversion options (:class:`amplite.ConvertOptions`; its ``tolerance`` and ``verify`` are
            this function's own: ``tolerance`` above).
        **changes: Conversion options by name, over ``options`` (precision, level, keep_fp32, ...).

    Raises:
        AmpliteError: Bad model, inputs, data, golden directory, baseline or options (exit 2).
    """
    opts = ConvertOptions.of(options, **changes)
    out_dir = _guard_files(model, inputs_file, data, converted, baseline, golden, update_golden, report_dir, junit,
                           opts.calibration)  # fmt: skip
    if isinstance(model, (str, Path)) and is_checkpoint_dir(model):
        _refuse_for_checkpoint({"--converted": converted, "--golden": golden, "--baseline": baseline, "--data": data,
                                "--data-loader": data_loader, "--random-batches": random_batches, "--grad": grad,
                                "--train-steps": train_steps})  # fmt: skip
        return _check_checkpoint(model, example_inputs, tolerance, out_dir, junit, name, opts)
    if train_steps:
        if converted is not None or golden is not None or baseline is not None:
            raise ConfigError("--train-steps trains the model itself", "drop --converted, --golden and --baseline")
        return _check_training(model, example_inputs, train_steps, lr, data, data_loader, max_batches, tolerance,
                               out_dir, junit, name, opts)  # fmt: skip
    gold = golden_mod.load_golden(golden) if golden is not None and not update_golden else None
    early = None
    if gold is None and (data is not None or data_loader is not None or (random_batches and input_specs)):
        early = data_mod.select_batches(None, data, data_loader, random_batches, input_specs, max_batches)
    if example_inputs is None and (gold or early):  # the first batch serves to trace the model
        example_inputs = (gold.batches if gold else early)[0][1]
    if tolerance is not None and not isinstance(tolerance, Tolerance):
        parse_tolerance(tolerance)  # fail on a bad criterion before any work
    base_line = golden_mod.load_baseline(baseline)
    timings: dict[str, float] = {}
    pair = steps.pair(model, example_inputs, converted, opts, gold, golden, timings)
    tol = tolerance if isinstance(tolerance, Tolerance) else parse_tolerance(tolerance or (), pair.precision)
    batches = early or data_mod.select_batches(pair.example, data, data_loader, random_batches, input_specs,
                                               max_batches)  # fmt: skip
    if golden is not None and update_golden:
        gold = steps.update_golden(golden, pair, batches)
    batches = gold.batches if gold is not None else batches
    metrics, drift = steps.verify_batches(pair, batches, gold, tol, timings)
    report = pair.report
    report["verification"] = {
        "inputs": data_mod.describe(gold, data, data_loader, random_batches, len(batches)),
        "batches": len(batches), "tolerance": {**vars(tol), "criteria": list(tol.criteria)},
        "passed": all(m.passed for m in metrics), "outputs": [m.to_dict() for m in metrics],
    }  # fmt: skip
    if gold:
        report["golden"] = steps.golden_section(gold, drift, pair.precision, update_golden)
    if layerwise:
        steps.layerwise(report, pair, batches[0][1], timings)
    if grad:
        steps.gradients(report, pair, batches[0][1], loss, converted is None, opts, timings)
    reasons = steps.failures(metrics) + steps.regressions(report, base_line, baseline_margin_db)
    if grad:
        from amplite.verify.gradcheck import failure_reasons

        reasons += failure_reasons(report["gradients"])
    report["timings"].update({k: round(v, 4) for k, v in timings.items()})
    return finish(report, reasons, metrics, name or model_name(model, report), out_dir, junit)


def _guard_files(model: Any, inputs_file: Any, data: Any, converted: Any, baseline: Any, golden: Any,
                 update_golden: bool, report_dir: Any, junit: Any, calibration: Any) -> Path | None:  # fmt: skip
    """Refuse an output that would overwrite an input, and an output that cannot be written, before any work."""
    reads = read_paths(model, inputs_file, data, calibration)
    reads += [("the --converted model", converted if isinstance(converted, (str, Path)) else None),
              ("the --baseline report", baseline if isinstance(baseline, (str, Path)) else None)]  # fmt: skip
    if not update_golden:
        reads.append(("the --golden directory", golden))
    outs = [(f"--report's {n}", Path(report_dir) / n) for n in ("report.json", "report.md", "report.html")
            if report_dir is not None]  # fmt: skip
    guard_outputs(reads, [*outs, ("--junit", junit)], [("--golden (with --update-golden)", golden)]
                  if update_golden else [])  # fmt: skip
    return prepare_outputs(report_dir, junit)


def _refuse_for_checkpoint(given: dict[str, Any]) -> None:
    names = [k for k, v in given.items() if v]
    if names:
        raise ConfigError(f"{', '.join(names)} do not apply to a checkpoint directory",
                          "check it with --input/--inputs and --tolerance")  # fmt: skip


def _check_checkpoint(
    model: str | Path,
    example: Any,
    tolerance: Any,
    out_dir: Path | None,
    junit: str | Path | None,
    name: str | None,
    opts: ConvertOptions,
) -> CheckResult:
    """``check DIR`` for a transformers checkpoint directory: streamed conversion and block-wise verification."""
    from amplite.checkpoint.check import check_checkpoint
    from amplite.llm.checkpoint import generation_check

    # token_agreement / ppl_delta criteria: the written directory is also checked on generation
    generation = generation_check(model, tolerance, opts.precision_name)
    conv, reasons = check_checkpoint(model, example, tolerance=tolerance, check_more=generation, options=opts)
    return finish(copy.deepcopy(conv.data), reasons, [], name or Path(model).name, out_dir, junit)


def _check_training(
    model: Any,
    example: Any,
    steps: int,
    lr: float,
    data: Any,
    loader: str | None,
    max_batches: int,
    tolerance: Any,
    out_dir: Path | None,
    junit: str | Path | None,
    name: str | None,
    opts: ConvertOptions,
) -> CheckResult:
    """``check --train-steps``: the training gate (amplite.training.gate), reported like any check."""
    from amplite.training.gate import train_check

    batches = data_mod.select_batches(None, data, loader, 0, (), max_batches) if data or loader else []
    described = data_mod.describe(None, data, loader, 0, len(batches)) if batches else "example inputs"
    report, reasons = train_check(model, example, batches, steps=steps, lr=lr, tolerance=tolerance,
                                  inputs_description=described, options=opts)  # fmt: skip
    return finish(report, reasons, [], name or model_name(model, report), out_dir, junit)
