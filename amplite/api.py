"""The library API: ``amplite.convert`` and its result.

``convert`` reads as the pipeline's stages, each a function below it: resolve the configuration,
load, run the FP32 reference, export and rewrite (``amplite.converter.pipeline``), verify, report,
and, when asked, the accuracy-budget search (``amplite.verify.budget``). Layer: this module may use
every package below it (converter, passes, ops, verify, report, onnx); none of them imports it.
"""

from __future__ import annotations

from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram

from amplite.checkpoint import convert_checkpoint, is_checkpoint_dir
from amplite.converter.graph_stats import graph_fingerprint, graph_stats, weight_bytes
from amplite.converter.inputs import bind_inputs, bind_to_program, example_inputs, normalize_inputs
from amplite.converter.loading import LoadedModel, load_any, torchscript_to_program
from amplite.converter.pipeline import PipelineOutput, lower_inputs, run_pipeline
from amplite.converter.tracing import Inputs, private_buffers, static_batch_warning
from amplite.describe import summarize_exception
from amplite.errors import AmpliteError, InputSpecError, InternalError
from amplite.estimate import estimate, get_profile
from amplite.ops import backend_description
from amplite.options import ConvertOptions, Loading, Verification, keyword_signature
from amplite.policy import Level
from amplite.report.document import Report, build_report
from amplite.report.sections import Budget, Build, Estimate, Source
from amplite.result import ConversionResult
from amplite.spec import ConvertSpec
from amplite.verify.budget import fallback_search as search_budget
from amplite.verify.compare import Tolerance, compare, parse_tolerance, run_model
from amplite.verify.data import calibration_batches


def convert(
    model: nn.Module | ExportedProgram | str | Path,
    example_inputs: Any = None,
    *,
    options: ConvertOptions | None = None,
    reference_outputs: Any = None,
    **changes: Any,
) -> ConversionResult:
    """Convert a model to mixed precision ahead of time and verify it.

    The body is the pipeline: resolve the options, load the model, run the FP32 reference, export and
    rewrite (:func:`amplite.converter.pipeline.run_pipeline`), verify, build the report, and (when asked and
    needed) search the accuracy budget.

    Args:
        model: An ``nn.Module``, an ``ExportedProgram``, or a path to a model file.
        example_inputs: Tensor, tuple (positional), dict (keyword, e.g. for ``transformers`` models) or
            ``(args, kwargs)``. Optional for a ``.pt2`` that stores its example inputs.
        options: The conversion options as one value (default: the defaults).
        reference_outputs: The FP32 model's outputs on ``example_inputs`` when already known (skips that run).
        **changes: Options by name, over ``options``: every field of :class:`amplite.ConvertOptions`
            (``precision="bf16"``, ``level="O2"``, ``keep_fp32=["op:softmax"]``, ``tolerance=...``; the
            signature ``help(amplite.convert)`` shows lists them all, with their defaults).

    Returns:
        The converted program, its report and the inputs used. The user's model is not modified. For a
        transformers checkpoint directory (``config.json`` + safetensors shards) the conversion is planned
        from metadata and returned as ``amplite.checkpoint.StreamedConversion``: ``.report``, ``.save(path)``,
        ``save_safetensors``, ``save_pt2`` and ``verify`` stream the weights (see docs/big-models.md).

    Raises:
        AmpliteError: For every problem with the inputs, the file or the options (one-line message).
    """
    opts = ConvertOptions.of(options, **changes)
    if isinstance(model, (str, Path)) and is_checkpoint_dir(model):  # streamed: never materialised
        return convert_checkpoint(model, example_inputs, options=opts)  # validates its options (and fp8) itself
    spec = opts.spec()
    batches = calibration_batches(opts.calibration)
    return convert_spec(model, example_inputs, spec, opts.verification(), opts.loading(), batches, reference_outputs)


convert.__signature__ = keyword_signature(convert, after="options")  # type: ignore[attr-defined]


def convert_spec(
    model: nn.Module | ExportedProgram | str | Path,
    example_inputs: Any,
    spec: ConvertSpec,
    check: Verification = Verification(),
    loading: Loading = Loading(),
    calibration: list[Any] | None = None,
    reference_outputs: Any = None,
) -> ConversionResult:
    """:func:`convert` on a resolved spec: load, FP32 reference, export and rewrite, verify, report, budget.

    Args:
        model: As for :func:`convert` (not a checkpoint directory).
        example_inputs: As for :func:`convert`.
        spec: The conversion.
        check: Verification settings.
        loading: How to read a model file.
        calibration: Calibration batches (None: the example inputs).
        reference_outputs: The FP32 outputs on ``example_inputs`` when already known.
    """
    check.check()
    get_profile(spec.gpu_profile)  # an unknown profile fails before any work
    tolerance = check.resolved(spec)
    timings: dict[str, float] = {}
    start = perf_counter()
    loaded = load_any(model, trust_pickle=loading.trust_pickle, model_factory=loading.model_factory,
                      import_modules=loading.import_modules)  # fmt: skip
    subject, reference, inputs = _subject(loaded, example_inputs, reference_outputs)
    timings["load"] = perf_counter() - start
    ref_out = reference_outputs if reference_outputs is not None else _reference_outputs(reference, inputs)
    # calibration is read once: the budget search's trials reuse the list
    out = run_pipeline(subject, inputs, spec, calibration=calibration)
    timings.update(out.timings)
    metrics = _verify(out, ref_out, inputs, spec, tolerance, timings) if check.enabled else None
    report = _report(loaded, out, spec, tolerance, metrics, timings)
    result = ConversionResult(out.converted, report, out.original, inputs, out, ref_out, tolerance, spec)
    if check.searches(spec) and result.passed is False:

        def again(program: ExportedProgram, inputs: Inputs, chosen: ConvertSpec, reference: Any) -> ConversionResult:
            return convert_spec(program, inputs, chosen, Verification(tolerance=tolerance, fallback_search=False),
                                Loading(), calibration, reference)  # fmt: skip

        result, budget = search_budget(result, spec, convert=again, max_trials=check.max_trials)
        result.report = result.report.with_sections(Budget.of(budget), report.section(Source))
    return result


def _subject(
    loaded: LoadedModel, example_inputs: Any, reference_outputs: Any
) -> tuple[nn.Module | ExportedProgram, Any, Inputs]:
    """What to export, what computes the FP32 reference, and the example inputs to use."""
    inputs = normalize_inputs(example_inputs) or loaded.example_inputs
    if inputs is None:
        raise InputSpecError(
            "no example inputs: the model needs them to be traced",
            "pass --input NAME:SHAPE:DTYPE (repeatable) or --inputs FILE",
        )
    if loaded.scripted is not None:
        program = torchscript_to_program(loaded.scripted, inputs)
        return program, loaded.scripted, (inputs[0] + tuple(inputs[1].values()), {})
    if loaded.program is not None:
        inputs = bind_to_program(loaded.program, inputs)  # named inputs onto the program's own convention
        # Unlifting costs a fraction of an export: skip it when the caller already has the FP32 outputs
        # (the budget search converts the same program once per trial).
        return loaded.program, loaded.program.module() if reference_outputs is None else None, inputs
    bind_inputs(loaded.module, inputs)
    module = private_buffers(loaded.module)
    return module, module, inputs


def _reference_outputs(reference: Any, inputs: Inputs) -> Any:
    """The FP32 model's outputs on the example inputs (a mismatch is the user's input error)."""
    try:
        return run_model(reference, inputs)
    except Exception as exc:
        raise InputSpecError(
            f"the example inputs do not fit the model: {summarize_exception(exc)}",
            "give inputs with the shapes and dtypes forward() expects (--input NAME:SHAPE:DTYPE)",
        ) from exc


def _verify(
    out: PipelineOutput, ref_out: Any, inputs: Inputs, spec: ConvertSpec, tolerance: Tolerance | None,
    timings: dict[str, float],
) -> list:
    """Run the converted program on the example inputs and compare it with the FP32 outputs."""
    start = perf_counter()
    run_inputs = lower_inputs(inputs, spec.precision) if spec.low_precision_io else inputs
    try:
        converted = run_model(out.converted.module(), run_inputs)
    except AmpliteError:
        raise
    except Exception as exc:  # the FP32 model ran on these inputs: a failure now is amplite's rewrite's
        problem = f"amplite bug: the converted program fails on the example inputs: {summarize_exception(exc)}"
        raise InternalError(problem) from exc
    metrics = compare(ref_out, converted, tolerance)
    timings["verify"] = perf_counter() - start
    return metrics


def _report(
    loaded: LoadedModel,
    out: PipelineOutput,
    spec: ConvertSpec,
    tolerance: Tolerance | None,
    metrics: list | None,
    timings: dict[str, float],
) -> Report:
    """The conversion report: configuration, plan, pass records, graph and weight statistics, metrics."""
    warnings = []
    if spec.level is Level.O3:
        warnings.append(
            "O3 runs everything in low precision, norms and softmax included: a speed baseline, "
            "not an accuracy-preserving setting"
        )
    if loaded.module is not None and loaded.module.training:
        warnings.append(
            "the model was passed in train mode and converted in train mode (BatchNorm uses batch statistics "
            "and updates its running statistics, dropout is random): call model.eval() first for inference"
        )
    if spec.dynamic_batch and (static := static_batch_warning(out.converted)):
        warnings.append(static)
    config = spec.to_config()
    if spec.fuse:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        config["contract_backend"] = backend_description(device)
    low = spec.precision
    start = perf_counter()
    predicted = estimate(out.original, out.converted, low, profile=spec.gpu_profile)
    timings["estimate"] = perf_counter() - start
    report = build_report(
        source={**_source(loaded), "graph_fingerprint": graph_fingerprint(out.original)},
        config=config,
        records=out.records,
        plan=out.plan,
        stats_before=graph_stats(out.original.graph, low),
        stats_after=graph_stats(out.converted.graph, low),
        weights=(weight_bytes(out.original), weight_bytes(out.converted)),
        metrics=metrics,
        tolerance=tolerance,
        timings=timings,
        warnings=warnings,
        extra=(Estimate.of(predicted), Build.of(dict(out.build))),
    )
    return report


def _source(loaded: LoadedModel) -> dict[str, Any]:
    """The report's ``source``: path, format, and for a module the mode it was traced in (as passed)."""
    source: dict[str, Any] = {"path": loaded.path, "format": loaded.kind}
    if loaded.module is not None:
        source["mode"] = "train" if loaded.module.training else "eval"
    return source


__all__ = ["ConversionResult", "convert", "example_inputs", "normalize_inputs", "parse_tolerance"]
