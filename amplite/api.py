"""The library API: ``amplite.convert`` and its result.

``convert`` reads as the pipeline's stages, each a function below it: resolve the configuration,
load, run the FP32 reference, export and rewrite (``amplite.converter.pipeline``), verify, report,
and, when asked, the accuracy-budget search (``amplite.verify.budget``). Layer: this module may use
every package below it (converter, passes, ops, verify, report, onnx); none of them imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
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
from amplite.converter.tracing import (
    Inputs,
    private_buffers,
    static_batch_inputs,
    summarize_exception,
)
from amplite.errors import AmpliteError, ConfigError, InputSpecError, InternalError
from amplite.estimate import estimate, get_profile
from amplite.ops import backend_description
from amplite.passes.range_guard import RangeRules
from amplite.policy import Level, Override
from amplite.report.document import Report, build_report
from amplite.result import ConversionResult
from amplite.spec import ConvertSpec
from amplite.verify.budget import fallback_search as search_budget
from amplite.verify.compare import DEFAULT_TOLERANCES, Tolerance, compare, parse_tolerance, run_model
from amplite.verify.data import calibration_batches


def convert(
    model: nn.Module | ExportedProgram | str | Path,
    example_inputs: Any = None,
    *,
    precision: str = "fp16",
    level: str | Level | None = None,
    keep_fp32: Sequence[str | Override] = (),
    force_low: Sequence[str | Override] = (),
    low_precision_io: bool = False,
    dynamic_batch: bool = False,
    dynamic_dims: Sequence[str] | Mapping[str, Sequence[int]] = (),
    fuse_contractions: bool | str = "auto",
    trust_pickle: bool = False,
    model_factory: str | None = None,
    import_modules: Sequence[str] = (),
    verify: bool = True,
    tolerance: Tolerance | None = None,
    range_rules: bool | None = None,
    data_max: float = RangeRules.data_max,
    max_reduction_depth: int | None = RangeRules.max_reduction_depth,
    range_percentile: float | None = None,
    calibration: Iterable[Any] | str | Path | None = None,
    fallback_search: bool = False,
    max_trials: int | None = None,
    reference_outputs: Any = None,
    fold_batchnorm: bool = True,
    gpu_profile: str = ConvertSpec.gpu_profile,
) -> ConversionResult:
    """Convert a model to mixed precision ahead of time and verify it.

    The body is the pipeline: resolve the configuration, load the model, run the FP32 reference,
    export and rewrite (:func:`amplite.converter.pipeline.run_pipeline`), verify, build the report, and
    (when asked and needed) search the accuracy budget.

    Args:
        model: An ``nn.Module``, an ``ExportedProgram``, or a path to a model file.
        example_inputs: Tensor, tuple (positional), dict (keyword, e.g. for ``transformers`` models) or
            ``(args, kwargs)``. Optional for a ``.pt2`` that stores its example inputs.
        precision: ``fp16`` or ``bf16``.
        level: ``O0``-``O3``; None reads ``AMPLITE_LEVEL``, else O1.
        keep_fp32: Patterns to keep in FP32 (``op:``, ``module:``, ``node:`` or unprefixed), or
            ``amplite.policy.Override`` rules carrying their own source (the budget search's pins).
        force_low: Patterns to force into low precision.
        low_precision_io: Graph inputs and outputs in the low dtype too.
        dynamic_batch: Make dim 0 of every input dynamic.
        dynamic_dims: More dynamic dims, by input name: ``["ids:1"]`` (``NAME:DIM[,DIM]``) or
            ``{"ids": [1]}`` (e.g. a sequence length). A dim the model fixes is an error.
        fuse_contractions: Fuse matmul chains into ``amplite::contract`` after the precision passes: ``auto``
            (off until a GPU measurement shows it faster; see ``amplite.ops.fusion_default``), ``on``/``off``
            or a bool.
        trust_pickle: Allow unpickling (runs code from the file): a whole pickled module, pickled entries
            of a .pt2. Without it a .pt2 is loaded only if nothing in it needs unpickling beyond tensors
            (see ``docs/security.md``).
        model_factory: ``module:callable`` building the model for a state-dict file.
        import_modules: Modules to import before loading (custom-op libraries, packages registering the
            pytree types of a .pt2's inputs/outputs).
        verify: Compare the converted model with the FP32 one on the example inputs.
        tolerance: Verification thresholds (default: by precision, see ``amplite.verify.compare``).
        range_rules: Keep FP32 what calibrated ranges say would overflow or lose precision (None: on at
            O1/O2, off at O0/O3, the speed baseline). See ``amplite.passes.range_guard``.
        data_max: Largest |activation| kept in fp16 by the range rules.
        max_reduction_depth: Longest reduction the range rules allow in low precision.
        range_percentile: Judge the activation range rule on this percentile of |value| per node (e.g. 99.99)
            instead of the maximum (off by default; costs one ``kthvalue`` per node in calibration).
        calibration: Batches (each like ``example_inputs``) for the range rules, a directory of batch files
            (as ``check --data``: ``--calib DIR``) or ``"module:function"`` yielding batches
            (``--calib-loader``); default the example inputs.
        fallback_search: When verification fails the tolerance, search for the fewest nodes to move back to
            FP32 (ranked by their isolated error, then bisected); see ``amplite.verify.budget``.
        max_trials: Bound on the search's conversions (default 2·log2(candidates) + 10).
        reference_outputs: The FP32 model's outputs on ``example_inputs`` when already known (skips that run).
        fold_batchnorm: Fold inference-mode BatchNorm into the preceding convolution (removes the FP32
            island and its casts around each conv; the model must be in eval mode, as for any export).
        gpu_profile: GPU whose roofline the report's time estimate uses (``amplite.estimate.PROFILES``:
            H100, H200, A100, L4, RTX4090). The estimate is labelled as one; it measures nothing.

    Returns:
        The converted program, its report and the inputs used. The user's model is not modified. For a
        transformers checkpoint directory (``config.json`` + safetensors shards) the conversion is planned
        from metadata and returned as ``amplite.checkpoint.StreamedConversion``: ``.report``, ``.save(path)``
        (the CLI's writer and output guard), ``save_safetensors``,
        ``save_pt2`` and ``verify`` stream the weights (see docs/big-models.md).

    Raises:
        AmpliteError: For every problem with the inputs, the file or the options (one-line message).
    """
    spec = ConvertSpec.build(
        precision=precision, level=level, keep_fp32=keep_fp32, force_low=force_low,
        low_precision_io=low_precision_io, dynamic_batch=dynamic_batch, dynamic_dims=dynamic_dims,
        fuse_contractions=fuse_contractions, range_rules=range_rules, data_max=data_max,
        max_reduction_depth=max_reduction_depth, range_percentile=range_percentile,
        fold_batchnorm=fold_batchnorm, gpu_profile=gpu_profile,
    )  # fmt: skip
    if isinstance(model, (str, Path)) and is_checkpoint_dir(model):  # streamed: never materialised
        return convert_checkpoint(
            model, example_inputs, precision=spec.precision_name, level=spec.level, keep_fp32=keep_fp32,
            force_low=force_low, low_precision_io=low_precision_io, range_rules=range_rules,
        )  # fmt: skip
    check = Verification(verify, tolerance, fallback_search, max_trials)
    loading = Loading(trust_pickle, model_factory, import_modules)
    batches = calibration_batches(calibration)
    return convert_spec(model, example_inputs, spec, check, loading, batches, reference_outputs)


@dataclass(frozen=True)
class Verification:
    """What to check after converting: on/off, the tolerance, and the accuracy-budget search."""

    enabled: bool = True
    tolerance: Tolerance | None = None  # None: the precision's default
    fallback_search: bool = False
    max_trials: int | None = None

    def check(self) -> None:
        """Refuse settings that contradict each other (one-line ``ConfigError``)."""
        if self.fallback_search and not self.enabled:
            raise ConfigError("the accuracy-budget search needs verification", "drop --no-verify (verify=False)")
        if self.max_trials is not None and self.max_trials < 2:
            raise ConfigError(
                f"max_trials={self.max_trials} is too small", "allow at least 2 (the worst node alone, then all)"
            )

    def resolved(self, spec: ConvertSpec) -> Tolerance | None:
        """The tolerance verification judges by, or None when verification does not run."""
        return (self.tolerance or DEFAULT_TOLERANCES[spec.precision_name]) if self.enabled else None


@dataclass(frozen=True)
class Loading:
    """How to read a model file (a live module or program ignores these)."""

    trust_pickle: bool = False
    model_factory: str | None = None
    import_modules: Sequence[str] = ()


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
    out = run_pipeline(
        subject, inputs, spec.policy(), dynamic_batch=spec.dynamic_batch, dynamic_dims=spec.dims(),
        fuse_contractions=spec.fuse, range_rules=spec.range_rules(),
        calibration=calibration,  # read once: the budget search's trials reuse the list
        fold_batchnorm=spec.fold_batchnorm,
    )  # fmt: skip
    timings.update(out.timings)
    metrics = _verify(out, ref_out, inputs, spec, tolerance, timings) if check.enabled else None
    report = _report(loaded, out, spec, tolerance, metrics, timings)
    result = ConversionResult(out.converted, report, out.original, inputs, out, ref_out, tolerance)
    if check.fallback_search and result.passed is False:

        def again(program: ExportedProgram, inputs: Inputs, chosen: ConvertSpec, reference: Any) -> ConversionResult:
            return convert_spec(program, inputs, chosen, Verification(tolerance=tolerance), Loading(), calibration,
                                reference)  # fmt: skip

        result = search_budget(result, spec, convert=again, max_trials=check.max_trials)
        result.report.data["source"] = report.data["source"]
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
    if spec.dynamic_batch and (static := static_batch_inputs(out.converted)):
        warnings.append(f"--dynamic-batch: dim 0 of {', '.join(static)} stayed static: the model fixes it")
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
    )
    report.data["estimate"] = predicted
    report.data["build"] = dict(out.build)
    return report


def _source(loaded: LoadedModel) -> dict[str, Any]:
    """The report's ``source``: path, format, and for a module the mode it was traced in (as passed)."""
    source: dict[str, Any] = {"path": loaded.path, "format": loaded.kind}
    if loaded.module is not None:
        source["mode"] = "train" if loaded.module.training else "eval"
    return source


__all__ = ["ConversionResult", "convert", "example_inputs", "normalize_inputs", "parse_tolerance"]
