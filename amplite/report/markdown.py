"""report.md: a short summary of a report for a pull-request comment or a CI step summary (read from the
typed sections)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from amplite.report.analysis import Estimate, Gradients, Layerwise, Ranges, Training
from amplite.report.checks import Baseline, Budget, Check, Golden, Verification
from amplite.report.document import Report, as_report
from amplite.report.format import Style
from amplite.report.format import cell as _cell
from amplite.report.format import code as _code
from amplite.report.format import fmt as _fmt
from amplite.report.sections import Config, Fp32Nodes, Graph, Source
from amplite.report.training import training_markdown


def fmt(v: Any, digits: int = 4) -> str:
    """A number for Markdown (:func:`amplite.report.format.fmt`); a string (a hand-edited report's) escaped."""
    return _cell(_fmt(v, digits))


def estimate_line(est: Estimate) -> str:
    """One line on the predicted GPU time (labelled as an estimate)."""
    ms = ", ".join(f"{_cell(k)} {fmt(v * 1e3, 3)} ms" for k, v in (est.seconds or {}).items())
    return (
        f"**Estimated GPU time on {_cell(est.device)}** ({_cell(est.label)}): {ms} — "
        f"{fmt(est.ratio_vs_fp32, 3)}× FP32, {fmt(est.ratio_vs_autocast, 3)}× autocast; "
        f"casts {fmt((est.cast_share or 0.0) * 100, 3)}%, FP32 islands "
        f"{fmt((est.fp32_island_share or 0.0) * 100, 3)}% of it."
    )


#: Markdown's marks for a section's summary line (amplite.report.format.Style).
MARKDOWN = Style(text=_cell, code=_code, strong=lambda s: f"**{s}**")


def _outputs_table(ver: Verification) -> list[str]:
    outputs = ver.outputs or ()
    lines = [
        "| output | NaN/Inf | SQNR dB | cosine | max abs | p99 abs | top-1 | min atol | result |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outputs:
        mark = "†" if o.partial else ""
        result = "pass" if o.passed else "**FAIL** " + _cell("; ".join([*o.failed_criteria, *(o.notes or [])]))
        lines.append(
            f"| {_code(o.name)} | {o.out_nonfinite or 0} | {fmt(o.sqnr_db)}{mark} "
            f"| {fmt(o.cosine, 7)}{mark} | {fmt(o.max_abs, 3)}{mark} | {fmt(o.p99_abs, 3)}{mark} "
            f"| {fmt(o.top1)} | {fmt(o.min_atol, 3)} | {result} |"
        )
    lines.append("")
    lines += [f"† {_code(o.name)}: metrics on the finite part only ({o.compared} of {o.elements} "
              "elements)" for o in outputs if o.partial]  # fmt: skip
    if lines[-1] != "":
        lines.append("")
    return lines


def _top_table(lw: Layerwise | None, top_n: int) -> list[str]:
    top = list((lw.top_introducers or ()) if lw is not None else ())[:top_n]
    if not top:
        return []
    lines = [
        "**Top error-introducing nodes** (isolated error: the node fed with FP32 inputs)",
        "",
        "| # | node | op | module | source | isolated SQNR dB | |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, e in enumerate(top, 1):
        flag = "introduces NaN/Inf" if e.introduces_nonfinite else ""
        iso = e.isolated.sqnr_db if e.isolated is not None else None
        lines.append(f"| {i} | {_code(e.node)} | {_cell(e.op)} | {_cell(e.module or '(root)')} "
                     f"| {_cell(e.source)} | {fmt(iso)} | {flag} |")  # fmt: skip
    return [*lines, ""]


def render_markdown(report: Report | Mapping[str, Any], top_n: int = 5) -> str:
    """The Markdown summary of a report (from ``amplite check`` or ``amplite convert``)."""
    rep = as_report(report)
    cfg, check, ver = rep.section(Config) or Config(), rep.section(Check) or Check(), rep.section(Verification)
    passed = check.passed if check.passed is not None else (ver.passed if ver else None)
    verdict = "✅ PASS" if passed else ("❌ FAIL" if passed is False else "– not verified")
    source = rep.section(Source)
    name = check.name or (source.path if source is not None else None) or "model"
    lines = [f"### amplite check: {_code(name)} — {verdict}", ""]
    setting = f"{cfg.precision or '?'} {cfg.level or '?'}" + (f", on {ver.inputs}" if ver else "")
    lines += [_cell(setting), ""]
    if ver:
        lines += _outputs_table(ver)
    if check.reasons:
        lines += ["**Why it failed:**", ""] + [f"- {_cell(r)}" for r in check.reasons[:10]] + [""]
    if (budget := rep.section(Budget)) is not None:
        lines += [budget.summary(MARKDOWN), ""]
    if (est := rep.section(Estimate)) is not None:
        lines += [estimate_line(est), ""]
    lines += _top_table(rep.section(Layerwise), top_n)
    graph = rep.section(Graph)
    if graph is not None and graph.after is not None:
        fp32 = rep.section(Fp32Nodes) or Fp32Nodes()
        by_dtype = ", ".join(f"{_cell(k)} {fmt(v)}" for k, v in (graph.after.nodes_by_dtype or {}).items())
        by_range = sum(1 for p in fp32 if p.rule == "range")
        lines.append(
            f"**Precision map:** {by_dtype}; {graph.after.casts or 0} casts; {len(fp32)} FP32 islands"
            + (f", {by_range} of them kept by the range rules." if cfg.range_rules else ".")
        )
    ranges = rep.section(Ranges)
    if ranges is not None and ranges.overflowing_nodes:
        nodes = ", ".join(_code(n) for n in ranges.overflowing_nodes[:5])
        lines.append(f"**Range:** values beyond {_cell(ranges.dtype)}'s max in FP32 at {nodes}.")
    if (base := rep.section(Baseline)) is not None:
        lines.append(f"**Baseline** (margin {fmt(base.margin_db)} dB): "
                     + ("no regression." if base.passed else f"{len(base.regressions or ())} regression(s)."))
    if (grads := rep.section(Gradients)) is not None:
        lines.append(grads.summary(MARKDOWN))
    if (training := rep.section(Training)) is not None:
        lines += training_markdown(training)
    if (gold := rep.section(Golden)) is not None:
        lines.append(f"**Golden:** {_code(gold.path)} (created {_cell(gold.created)}).")
    return "\n".join(lines).rstrip() + "\n"
