"""The steps of ``check``: the FP32/converted pair, every batch through both, localisation, the verdicts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from torch.export import ExportedProgram

from amplite.converter.emit import Recorded, read_conversion
from amplite.errors import ConfigError, ExportError, InputSpecError
from amplite.levels import split_precision
from amplite.options import ConvertOptions
from amplite.report.document import Report, ReportBuilder
from amplite.report.sections import (
    Baseline,
    Config,
    Fp32Nodes,
    Gradients,
    Graph,
    Layerwise,
    Plan,
    Ranges,
    Source,
    Verification,
    Weights,
)  # fmt: skip
from amplite.verify import baseline as baseline_mod
from amplite.verify import data as data_mod
from amplite.verify import golden as golden_mod
from amplite.verify.compare import DEFAULT_TOLERANCES, OutputMetrics, Tolerance, compare_batches
from amplite.verify.converted import converted_facts, infer_precision, load_converted

OTHER_MODEL = "this golden directory was made from another model: pass the right --golden or regenerate it"


def reference(model: Any, example: Any, options: ConvertOptions) -> Any:
    """The FP32 program of ``model`` (an O0 "conversion" exports and loads it, and nothing more)."""
    from amplite.api import convert

    return convert(model, example, options=options.for_reference())


@dataclass
class Pair:
    """The FP32 and converted programs a check compares, and what it knows about them."""

    ref_prog: ExportedProgram
    conv_prog: ExportedProgram
    report: Report  # the conversion report the check starts from (frozen: the check builds its own from it)
    precision: str
    example: Any
    ref_gm: Any = None
    conv_gm: Any = None

    def __post_init__(self) -> None:
        self.ref_gm, self.conv_gm = self.ref_prog.module(), self.conv_prog.module()

    @property
    def low(self) -> torch.dtype:
        return split_precision(self.precision)[0]  # fp8: bf16, the dtype of everything not in FP8


def pair(model: Any, example_inputs: Any, converted: Any, options: ConvertOptions, gold: Any, golden: Any,
          timings: dict[str, float]) -> Pair:  # fmt: skip
    """Convert ``model`` now, or export it and load ``converted``; golden inputs that do not fit say so."""
    start = perf_counter()
    try:
        if converted is None:
            from amplite.api import convert

            # fp8's default contract includes the accuracy-budget search, which verification drives: the gate
            # judges the plan that search picks, as ``convert`` writes it
            search = options.verification().searches(options.spec())
            result = convert(model, example_inputs, options=options, verify=search)
        else:
            result = reference(model, example_inputs, options)
    except (InputSpecError, ExportError) as exc:
        if gold is None or example_inputs is not gold.batches[0][1]:
            raise
        raise golden_mod.GoldenError(f"the inputs in golden directory {str(golden)!r} do not fit the model: "
                                     f"{exc.problem}", OTHER_MODEL) from exc  # fmt: skip
    if converted is None:
        pair = Pair(result.original, result.program, result.report, options.precision_name, result.inputs)
    else:
        conv_prog = load_converted(converted)
        recorded = read_conversion(converted) if isinstance(converted, (str, Path)) else None
        precision = _converted_precision(options, recorded, conv_prog, converted)
        facts = converted_facts(conv_prog, converted, precision, recorded)
        pair = Pair(result.original, conv_prog, converted_report(result.report, facts), precision, result.inputs)
    timings["convert"] = perf_counter() - start
    return pair


def converted_report(reference: Report, facts: Any) -> Report:
    """The report of a converted file: the reference's sections, with what the converted file shows
    (:class:`~amplite.verify.converted.ConvertedFacts`) in ``config``, ``plan``, ``fp32_nodes``, ``graph``
    and ``weights``."""
    config, graph, weights = reference.section(Config), reference.section(Graph), reference.section(Weights)
    return reference.with_sections(
        Config.of({**(config.to_json() if config else {}), **facts.config}),
        Plan.of(facts.plan),
        Fp32Nodes.of(facts.plan),
        Graph.of(graph.before if graph and graph.before else {}, facts.graph_after),
        Weights.of(weights.bytes_before if weights else 0, facts.weight_bytes),
    )


def _converted_precision(options: ConvertOptions, recorded: Recorded | None, program: ExportedProgram,
                         path: Any) -> str:  # fmt: skip
    """The low precision of a converted file: what it records (a different ``--precision`` is an error), else
    the one given, else what its graph computes in."""
    written = recorded.spec.precision_name if recorded else None
    if written is not None and options.precision is not None and options.precision_name != written:
        raise ConfigError(f"--precision {options.precision_name} does not match {str(path)!r}, converted to {written}",
                          "drop --precision: check reads the converted file's own")  # fmt: skip
    if options.precision is not None:
        return options.precision_name
    return written or infer_precision(program)


def update_golden(golden: Any, pair: Pair, batches: list) -> Any:
    """(Re)write the golden directory from the FP32 model on ``batches``, and read it back."""
    fitted = [(label, data_mod.fit_inputs(pair.ref_gm, b, label)) for label, b in batches]
    source = pair.report.section(Source) or Source()
    src = {"path": source.path, "format": source.format}
    golden_mod.save_golden(golden, pair.ref_gm, fitted, source=src, update=True, option="--golden")
    return golden_mod.load_golden(golden)


def verify_batches(pair: Pair, batches: list, gold: Any, tol: Tolerance, timings: dict[str, float]
                    ) -> tuple[list[OutputMetrics], list]:  # fmt: skip
    """Run both models on every batch (inputs checked against each model's signature) and compare."""
    start = perf_counter()
    fix = OTHER_MODEL if gold else ""
    pairs, drift = [], []
    for i, (label, batch) in enumerate(batches):
        where = f"batch {i} ({label})"
        ref_in = data_mod.fit_inputs(pair.ref_gm, batch, where, fix)
        conv_in = data_mod.fit_inputs(pair.conv_gm, batch, where, fix)
        conv_out = data_mod.run_batch(pair.conv_gm, conv_in, where, "the converted model")
        if gold:
            golden_mod.check_outputs_match(gold, i, conv_out)
            ref_out = gold.outputs[i]
            drift.append((ref_out, data_mod.run_batch(pair.ref_gm, ref_in, where, "the FP32 model")))
        else:
            ref_out = data_mod.run_batch(pair.ref_gm, ref_in, where, "the FP32 model")
        data_mod.refuse_nan_reference(ref_out, where, bool(gold))
        pairs.append((ref_out, conv_out))
    metrics = compare_batches(pairs, tol)
    timings["verify"] = perf_counter() - start
    return metrics, drift


def golden_section(gold: Any, drift: list, precision: str, updated: bool) -> dict[str, Any]:
    """The report's ``golden``: where the reference came from and how far today's FP32 model drifted."""
    ref_drift = compare_batches(drift, DEFAULT_TOLERANCES[precision])
    return {
        "path": str(gold.path), "created": gold.meta.get("created"), "source": gold.meta.get("source", {}),
        "updated": updated,
        "reference_drift": [{"output": m.name, "sqnr_db": m.to_dict()["sqnr_db"]} for m in ref_drift],
    }  # fmt: skip


def layerwise(report: ReportBuilder, pair: Pair, first: Any, timings: dict[str, float]) -> None:
    """Localise the error node by node on the first batch (``layerwise`` and ``ranges`` sections)."""
    from amplite.verify.layerwise import analyze
    from amplite.verify.ranges import summarize

    start = perf_counter()
    lw = analyze(pair.ref_gm, pair.conv_gm, data_mod.fit_inputs(pair.ref_gm, first, "batch 0"),
                 data_mod.fit_inputs(pair.conv_gm, first, "batch 0"), pair.low)  # fmt: skip
    report.add(Layerwise.of(lw.to_dict()), Ranges.of(summarize({e.node: e.range for e in lw.nodes if e.range},
                                                                pair.low)))  # fmt: skip
    timings["layerwise"] = perf_counter() - start


def gradients(report: ReportBuilder, pair: Pair, first: Any, loss: Any, converted_now: bool,
               options: ConvertOptions, timings: dict[str, float]) -> list[str]:  # fmt: skip
    """Compare parameter gradients of one backward pass (``gradients`` section); its failure reasons."""
    from amplite.verify.gradcheck import failure_reasons, gradient_check

    grad_gm = pair.conv_gm
    if converted_now and pair.report.pass_modified("fold_batchnorm"):
        from amplite.api import convert  # folded BatchNorm has no parameters to train: check it unfolded

        unfolded = convert(pair.ref_prog, pair.example, verify=False, options=options, fold_batchnorm=False)
        grad_gm = unfolded.program.module()
    found = gradient_check(pair.ref_gm, grad_gm, data_mod.fit_inputs(pair.ref_gm, first, "batch 0"),
                           data_mod.fit_inputs(grad_gm, first, "batch 0"), loss=loss, low_dtype=pair.low)  # fmt: skip
    found["graph"] = "unfolded BatchNorm" if grad_gm is not pair.conv_gm else "as converted"
    section = Gradients.of(found)
    report.add(section)
    timings["gradients"] = section.seconds or 0.0
    return failure_reasons(found)


def failures(metrics: list[OutputMetrics]) -> list[str]:
    """One line per output that missed its tolerance: the failed criteria with their values, and notes."""
    return [
        f"{m.name}: " + "; ".join([c["criterion"] + f" (got {c['value']})" for c in m.checks if not c["passed"]]
                                  + m.notes)
        for m in metrics
        if not m.passed
    ]  # fmt: skip


def regressions(report: ReportBuilder, base_line: dict[str, Any] | None, margin_db: float) -> list[str]:
    """Compare with an accepted baseline report (``baseline`` section); one line per regression."""
    if base_line is None:
        return []
    source, ver = report.section(Source), report.section(Verification)
    baseline_mod.check_baseline_matches({s.key: s.value for s in (source, ver) if s is not None}, base_line)
    outputs = [o.to_json() for o in (ver.outputs or ())] if ver is not None else []
    regressions = baseline_mod.compare_baseline(outputs, base_line, margin_db)
    report.add(Baseline.of(margin_db, regressions, base_line.get("created")))
    return [f"{r['output']}: {r['metric']} regressed from {r['baseline']} to {r['current']} (limit {r['limit']})"
            for r in regressions]  # fmt: skip
