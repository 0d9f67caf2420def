"""``amplite check``: convert (or load a converted model), verify it on data, and gate CI on the result.

Exit codes: 0 every output within tolerance and no regression against the baseline; 1 an accuracy
failure or regression; 2 bad input (raised as :class:`~amplite.errors.AmpliteError`, nothing written).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from torch.export import ExportedProgram

from amplite.checkpoint.source import is_checkpoint_dir
from amplite.converter import emit
from amplite.errors import ConfigError, EmitError, ExportError, InputSpecError
from amplite.paths import guard_outputs
from amplite.report.document import Report
from amplite.report.schema import write_report
from amplite.verify import data as data_mod
from amplite.verify import golden as golden_mod
from amplite.verify.compare import DEFAULT_TOLERANCES, OutputMetrics, Tolerance, compare_batches, parse_tolerance
from amplite.verify.converted import infer_precision, load_converted, report_for_converted

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
_NOT_CONVERT_OPTIONS = {"model", "example_inputs", "verify", "tolerance"}
_OTHER_MODEL = "this golden directory was made from another model: pass the right --golden or regenerate it"
_LOAD_KEYS = ("trust_pickle", "model_factory", "import_modules", "dynamic_batch", "dynamic_dims")


@dataclass
class CheckResult:
    """What ``check`` found.

    Attributes:
        exit_code: 0 pass, 1 accuracy failure or regression.
        report: The report (``report.data`` is report.json).
        reasons: One line per failure.
        outputs: Per-output metrics over all batches.
        files: Paths written, by kind (``json``, ``md``, ``html``, ``junit``).
    """

    exit_code: int
    report: Report
    reasons: list[str] = field(default_factory=list)
    outputs: list[OutputMetrics] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Whether the check passed."""
        return self.exit_code == 0


def _reference(model: Any, example: Any, opts: dict[str, Any]) -> Any:
    """The FP32 program of ``model`` (an O0 "conversion" exports and loads it, and nothing more)."""
    from amplite.api import convert

    return convert(model, example, level="O0", verify=False, **{k: opts[k] for k in _LOAD_KEYS if k in opts})


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
    **load_opts: Any,
) -> Path:
    """``amplite golden``: save inputs and FP32 reference outputs under ``output`` (see ``golden``).

    Raises:
        AmpliteError: Bad model, inputs or directory (the directory exists without ``update``, or it is
            or holds one of the inputs: it is replaced as a whole).
    """
    guard_outputs(_read_paths(model, inputs_file, data), [], [("-o", output)])
    ref = _reference(model, example_inputs, load_opts)
    gm = ref.original.module()
    batches = data_mod.select_batches(ref.inputs, data, data_loader, random_batches, input_specs, max_batches)
    fitted = [(label, data_mod.fit_inputs(gm, b, label)) for label, b in batches]
    src = {"path": ref.report.data["source"]["path"], "format": ref.report.data["source"]["format"]}
    return golden_mod.save_golden(output, gm, fitted, source=src, update=update)


def _check_options(opts: dict[str, Any]) -> None:
    """Every ``amplite.convert`` option is a ``check`` option too; anything else is a mistake."""
    import inspect

    from amplite.api import convert

    known = set(inspect.signature(convert).parameters) - _NOT_CONVERT_OPTIONS
    if set(opts) - known:
        raise ConfigError(f"unknown option(s) {sorted(set(opts) - known)}", f"use {', '.join(sorted(known))}")


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
    **convert_opts: Any,
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
        **convert_opts: ``amplite.convert`` options (precision, level, keep_fp32, ...).

    Raises:
        AmpliteError: Bad model, inputs, data, golden directory, baseline or options (exit 2).
    """
    _check_options(convert_opts)
    reads = _read_paths(model, inputs_file, data, convert_opts.get("calibration"))
    reads += [("the --converted model", converted if isinstance(converted, (str, Path)) else None),
              ("the --baseline report", baseline if isinstance(baseline, (str, Path)) else None)]  # fmt: skip
    if not update_golden:
        reads.append(("the --golden directory", golden))
    outs = [(f"--report's {n}", Path(report_dir) / n) for n in ("report.json", "report.md", "report.html")
            if report_dir is not None]  # fmt: skip
    guard_outputs(reads, [*outs, ("--junit", junit)], [("--golden (with --update-golden)", golden)]
                  if update_golden else [])  # fmt: skip
    out_dir = _prepare_outputs(report_dir, junit)
    if isinstance(model, (str, Path)) and is_checkpoint_dir(model):
        unsupported = {"--converted": converted, "--golden": golden, "--baseline": baseline, "--data": data,
                       "--data-loader": data_loader, "--random-batches": random_batches, "--grad": grad,
                       "--train-steps": train_steps}  # fmt: skip
        given = [k for k, v in unsupported.items() if v]
        if given:
            raise ConfigError(f"{', '.join(given)} do not apply to a checkpoint directory",
                              "check it with --input/--inputs and --tolerance")  # fmt: skip
        return _check_checkpoint(model, example_inputs, tolerance, out_dir, junit, name, convert_opts)
    if train_steps:
        if converted is not None or golden is not None or baseline is not None:
            raise ConfigError("--train-steps trains the model itself", "drop --converted, --golden and --baseline")
        return _check_training(model, example_inputs, train_steps, lr, data, data_loader, max_batches, tolerance,
                               out_dir, junit, name, convert_opts)  # fmt: skip
    timings: dict[str, float] = {}
    gold = early = None
    if golden is not None and not update_golden:
        gold = golden_mod.load_golden(golden)
    elif data is not None or data_loader is not None or (random_batches and input_specs):
        early = data_mod.select_batches(None, data, data_loader, random_batches, input_specs, max_batches)
    if example_inputs is None and (gold or early):  # the first batch serves to trace the model
        example_inputs = (gold.batches if gold else early)[0][1]
    if tolerance is not None and not isinstance(tolerance, Tolerance):
        parse_tolerance(tolerance)  # fail on a bad criterion before any work
    base_line = golden_mod.load_baseline(baseline)

    start = perf_counter()
    try:
        if converted is None:
            from amplite.api import convert

            result = convert(model, example_inputs, verify=False, **convert_opts)
        else:
            result = _reference(model, example_inputs, convert_opts)
    except (InputSpecError, ExportError) as exc:
        if gold is None or example_inputs is not gold.batches[0][1]:
            raise
        raise golden_mod.GoldenError(f"the inputs in golden directory {str(golden)!r} do not fit the model: "
                                     f"{exc.problem}", _OTHER_MODEL) from exc  # fmt: skip
    if converted is None:
        report = copy.deepcopy(result.report.data)
        ref_prog, conv_prog = result.original, result.program
        precision = convert_opts.get("precision", "fp16")
    else:
        ref_prog, conv_prog = result.original, load_converted(converted)
        precision = convert_opts.get("precision") or infer_precision(conv_prog)
        report = report_for_converted(result.report.data, conv_prog, converted, precision)
    example = result.inputs
    timings["convert"] = perf_counter() - start
    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    tol = tolerance if isinstance(tolerance, Tolerance) else parse_tolerance(tolerance or (), precision)
    ref_gm, conv_gm = ref_prog.module(), conv_prog.module()

    start = perf_counter()
    batches = early or data_mod.select_batches(example, data, data_loader, random_batches, input_specs, max_batches)
    if golden is not None and update_golden:
        fitted = [(label, data_mod.fit_inputs(ref_gm, b, label)) for label, b in batches]
        src = {k: report["source"][k] for k in ("path", "format")}
        golden_mod.save_golden(golden, ref_gm, fitted, source=src, update=True)
        gold = golden_mod.load_golden(golden)
    if gold is not None:
        batches = gold.batches
    fix = _OTHER_MODEL if gold else ""
    pairs, drift = [], []
    for i, (label, batch) in enumerate(batches):
        where = f"batch {i} ({label})"
        ref_in = data_mod.fit_inputs(ref_gm, batch, where, fix)
        conv_out = data_mod.run_batch(
            conv_gm, data_mod.fit_inputs(conv_gm, batch, where, fix), where, "the converted model"
        )
        if gold:
            golden_mod.check_outputs_match(gold, i, conv_out)
            ref_out = gold.outputs[i]
            drift.append((ref_out, data_mod.run_batch(ref_gm, ref_in, where, "the FP32 model")))
        else:
            ref_out = data_mod.run_batch(ref_gm, ref_in, where, "the FP32 model")
        data_mod.refuse_nan_reference(ref_out, where, bool(gold))
        pairs.append((ref_out, conv_out))
    metrics = compare_batches(pairs, tol)
    timings["verify"] = perf_counter() - start

    report["verification"] = {
        "inputs": data_mod.describe(gold, data, data_loader, random_batches, len(batches)),
        "batches": len(batches),
        "tolerance": {**vars(tol), "criteria": list(tol.criteria)},
        "passed": all(m.passed for m in metrics),
        "outputs": [m.to_dict() for m in metrics],
    }
    if gold:
        ref_drift = compare_batches(drift, DEFAULT_TOLERANCES[precision])
        report["golden"] = {
            "path": str(gold.path),
            "created": gold.meta.get("created"),
            "source": gold.meta.get("source", {}),
            "updated": update_golden,
            "reference_drift": [{"output": m.name, "sqnr_db": m.to_dict()["sqnr_db"]} for m in ref_drift],
        }
    first = batches[0][1]
    if layerwise:
        from amplite.verify.layerwise import analyze
        from amplite.verify.ranges import summarize

        start = perf_counter()
        lw = analyze(
            ref_gm,
            conv_gm,
            data_mod.fit_inputs(ref_gm, first, "batch 0"),
            data_mod.fit_inputs(conv_gm, first, "batch 0"),
            low,
        )
        report["layerwise"] = lw.to_dict()
        report["ranges"] = summarize({e.node: e.range for e in lw.nodes if e.range}, low)
        timings["layerwise"] = perf_counter() - start
    if grad:
        from amplite.verify.gradcheck import failure_reasons as grad_failures
        from amplite.verify.gradcheck import gradient_check

        grad_gm = conv_gm
        if converted is None and any(p["name"] == "fold_batchnorm" and p["modified"] for p in report["passes"]):
            from amplite.api import convert  # folded BatchNorm has no parameters to train: check it unfolded

            unfolded = convert(ref_prog, example, verify=False, **{**convert_opts, "fold_batchnorm": False})
            grad_gm = unfolded.program.module()
        report["gradients"] = gradient_check(
            ref_gm,
            grad_gm,
            data_mod.fit_inputs(ref_gm, first, "batch 0"),
            data_mod.fit_inputs(grad_gm, first, "batch 0"),
            loss=loss,
            low_dtype=low,
        )
        report["gradients"]["graph"] = "unfolded BatchNorm" if grad_gm is not conv_gm else "as converted"
        timings["gradients"] = report["gradients"]["seconds"]

    reasons = [
        f"{m.name}: "
        + "; ".join([c["criterion"] + f" (got {c['value']})" for c in m.checks if not c["passed"]] + m.notes)
        for m in metrics
        if not m.passed
    ]
    if base_line is not None:
        golden_mod.check_baseline_matches(report, base_line)
        regressions = golden_mod.compare_baseline(report["verification"]["outputs"], base_line, baseline_margin_db)
        report["baseline"] = {
            "margin_db": baseline_margin_db,
            "regressions": regressions,
            "passed": not regressions,
            "created": base_line.get("created"),
        }
        reasons += [
            f"{r['output']}: {r['metric']} regressed from {r['baseline']} to {r['current']} (limit {r['limit']})"
            for r in regressions
        ]
    if grad:
        reasons += grad_failures(report["gradients"])
    code = 1 if reasons else 0
    report["timings"].update({k: round(v, 4) for k, v in timings.items()})
    report["check"] = {
        "name": name or _model_name(model, report),
        "passed": code == 0,
        "exit_code": code,
        "reasons": reasons,
    }
    res = CheckResult(code, Report(report), reasons, metrics)
    if out_dir is not None:
        res.files = write_reports(res.report.data, out_dir)
    if junit is not None:
        from amplite.report.junit import junit_xml

        res.files["junit"] = emit.write_text(junit, junit_xml(res.report.data))
    return res


def _check_checkpoint(
    model: str | Path, example: Any, tolerance: Any, out_dir: Path | None, junit: str | Path | None,
    name: str | None, opts: dict[str, Any],
) -> CheckResult:
    """``check DIR`` for a transformers checkpoint directory: streamed conversion and block-wise verification."""
    from amplite.checkpoint.check import check_checkpoint
    from amplite.llm.checkpoint import generation_check

    # token_agreement / ppl_delta criteria: the written directory is also checked on generation
    generation = generation_check(model, tolerance, opts.get("precision", "fp16"))
    conv, reasons = check_checkpoint(model, example, tolerance=tolerance, check_more=generation, **opts)
    report = copy.deepcopy(conv.data)
    code = 1 if reasons else 0
    report["check"] = {"name": name or Path(model).name, "passed": code == 0, "exit_code": code, "reasons": reasons}
    res = CheckResult(code, Report(report), reasons, [])
    if out_dir is not None:
        res.files = write_reports(res.report.data, out_dir)
    if junit is not None:
        from amplite.report.junit import junit_xml

        res.files["junit"] = emit.write_text(junit, junit_xml(res.report.data))
    return res


def _check_training(
    model: Any, example: Any, steps: int, lr: float, data: Any, loader: str | None, max_batches: int,
    tolerance: Any, out_dir: Path | None, junit: str | Path | None, name: str | None, opts: dict[str, Any],
) -> CheckResult:
    """``check --train-steps``: the training gate (amplite.training.gate), reported like any check."""
    from amplite.training.gate import train_check

    batches = data_mod.select_batches(None, data, loader, 0, (), max_batches) if data or loader else []
    described = data_mod.describe(None, data, loader, 0, len(batches)) if batches else "example inputs"
    keys = ("precision", "level", "keep_fp32", "force_low", "trust_pickle", "model_factory")
    report, reasons = train_check(model, example, batches, steps=steps, lr=lr, tolerance=tolerance,
                                  inputs_description=described, **{k: opts[k] for k in keys if k in opts})  # fmt: skip
    code = 1 if reasons else 0
    report["check"] = {"name": name or _model_name(model, report), "passed": not reasons, "exit_code": code,
                       "reasons": reasons}  # fmt: skip
    res = CheckResult(code, Report(report), reasons)
    if out_dir is not None:
        res.files = write_reports(report, out_dir)
    if junit is not None:
        from amplite.report.junit import junit_xml

        res.files["junit"] = emit.write_text(junit, junit_xml(report))
    return res


def write_reports(data: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md and report.html into ``out_dir`` (each atomically)."""
    from amplite.report.html import render_html
    from amplite.report.markdown import render_markdown

    d = Path(out_dir)
    try:
        d.mkdir(exist_ok=True)
    except OSError as exc:
        raise EmitError(f"cannot create report directory {str(d)!r}: {exc.strerror or type(exc).__name__}",
                        "choose a writable --report directory") from None  # fmt: skip
    return {
        "json": write_report(d / "report.json", data),
        "md": emit.write_text(d / "report.md", render_markdown(data)),
        "html": emit.write_text(d / "report.html", render_html(data)),
    }


def _prepare_outputs(report_dir: str | Path | None, junit: str | Path | None) -> Path | None:
    """Fail before any work when an output cannot be written (the report directory is made only when the
    reports are written, so a failed run leaves nothing behind)."""
    d = Path(report_dir) if report_dir is not None else None
    if d is not None:
        if d.exists() and not d.is_dir():
            raise ConfigError(f"--report {str(d)!r} is a file", "give a directory for the reports")
        emit.check_writable(d / "report.json" if d.is_dir() else d)
    if junit is not None:
        j = Path(junit)
        if d is None or j.parent.resolve() != d.resolve() or d.is_dir():
            emit.check_writable(j)
    return d


def _read_paths(model: Any, inputs_file: Any, data: Any, calibration: Any = None) -> list[tuple[str, Any]]:
    """What a gate command reads from disk, labelled for :func:`amplite.paths.guard_outputs`."""
    path = lambda v: v if isinstance(v, (str, Path)) else None  # noqa: E731
    calib = path(calibration) if calibration is not None and Path(str(calibration)).exists() else None
    return [("the model", path(model)), ("the --inputs file", inputs_file), ("the --data directory", path(data)),
            ("the --calib directory", calib)]  # fmt: skip


def _model_name(model: Any, report: dict[str, Any]) -> str:
    path = report.get("source", {}).get("path")
    if path:
        return Path(path).name.split(".")[0]
    return type(model).__name__


def publish_github_summary(report: dict[str, Any]) -> bool:
    """On GitHub Actions, write the Markdown report to the job summary and annotations (else do nothing)."""
    from amplite.report.junit import publish_github
    from amplite.report.markdown import render_markdown

    return publish_github(report, render_markdown(report))
