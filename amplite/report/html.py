"""report.html: one self-contained page (plotly.js inlined, works offline) for a report.

Sections: verdict, per-output table, the accuracy-budget search (its trials against the tolerance and the
nodes it moved to FP32), error along the graph (accumulated and isolated SQNR per node, and the worst per
layer), the precision map (nodes by dtype, the FP32 islands with their reasons, the range-rule decisions),
the top error-introducing nodes with their source lines, range problems, baseline, gradients and golden
facts. Everything is read from the typed sections; the charts are in :mod:`amplite.report.html_charts`.
Every text from the model is HTML-escaped (:func:`amplite.escape.html`), in tables and in chart labels alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from amplite.escape import html as escape
from amplite.report.analysis import Estimate, Gradients, Layerwise, Ranges, Training
from amplite.report.checks import Baseline, Budget, Check, Golden, Verification
from amplite.report.document import Report, as_report
from amplite.report.format import Style, fmt
from amplite.report.format import html_table as _table
from amplite.report.html_charts import figures
from amplite.report.sections import Config, Fp32Nodes, Plan, Source
from amplite.report.training import training_figure, training_html

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1200px;color:#222}
h1{font-size:1.5rem} h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0} td,th{border:1px solid #ddd;padding:.25rem .5rem}
th{background:#f5f5f5;text-align:left} .pass{color:#087f23;font-weight:600} .fail{color:#c62828;font-weight:600}
.verdict{font-size:1.3rem;padding:.5rem 1rem;border-radius:4px;display:inline-block}
.verdict.pass{background:#e8f5e9} .verdict.fail{background:#ffebee} code{font-size:.85em} .muted{color:#777}
"""


_OUTPUT_HEAD = ["output", "NaN/Inf", "SQNR dB", "cosine", "max abs", "p99 abs", "max rel", "top-1", "top-5", "KL",
                "min atol / rtol", "result"]  # fmt: skip
_TOP_HEAD = ["#", "node", "op", "module", "source", "dtype", "isolated SQNR", "accumulated SQNR",
             "introduces NaN/Inf", "FP32 max |x|"]  # fmt: skip


#: HTML's marks for a section's summary line (amplite.report.format.Style).
HTML = Style(text=lambda s: escape(str(s)), code=lambda s: f"<code>{escape(str(s))}</code>",
             strong=lambda s: f"<strong>{s}</strong>")


def _budget_section(budget: Budget, chart: str) -> str:
    moved = budget.moved_to_fp32 or ()
    parts = [f"<h2>Accuracy budget</h2><p class='{'pass' if budget.passed else 'fail'}'>{budget.summary(HTML)}</p>",
             chart]  # fmt: skip
    if moved:
        rows = [[i, m.node, m.op or "", m.module or "(root)", m.source or "", fmt(m.isolated_sqnr_db)]
                for i, m in enumerate(moved, 1)]  # fmt: skip
        parts.append("<p>Moved to FP32, worst isolated error first:</p>")
        parts.append(_table(["#", "node", "op", "module", "source", "isolated SQNR dB"], rows))
    return "\n".join(p for p in parts if p)


def _range_rules_section(rep: Report) -> str:
    rules = (rep.section(Config) or Config()).range_rules
    if not rules:
        return ""
    chosen = [p for p in rep.section(Plan) or () if p.rule == "range" and p.mode == "fp32"]
    depth = rules.get("max_reduction_depth")
    text = (
        f"<h3>Range rules</h3><p>data_max {fmt(rules.get('data_max'), 6)}, "
        f"weight_max {fmt(rules.get('weight_max'), 6)}, underflow share {fmt(rules.get('underflow_share'))}, "
        f"max reduction depth {'none' if depth is None else fmt(depth)}: {len(chosen)} node(s) kept in FP32 by "
        "them.</p>"
    )
    if not chosen:
        return text
    rows = [[p.node, p.op, p.module or "(root)", p.source, p.reason] for p in chosen]
    return text + _table(["node", "op", "module", "source", "reason"], rows)


def _estimate_section(est: Estimate, chart: str) -> str:
    rows = [[n["node"], n["op"], n["dtype"], n["kind"], fmt(n["seconds"] * 1e6, 3), fmt(n["share"] * 100, 3)]
            for n in est.top_nodes or ()]  # fmt: skip
    return (
        f"<h2>Estimated GPU time</h2><p class='muted'>{escape(est.label)}: per-node roofline on "
        f"{escape(est.device)} (docs/estimates.md).</p><p>{fmt(est.ratio_vs_fp32, 3)}× FP32, "
        f"{fmt(est.ratio_vs_autocast, 3)}× autocast; casts {fmt((est.cast_share or 0.0) * 100, 3)}%, FP32 islands "
        f"{fmt((est.fp32_island_share or 0.0) * 100, 3)}% of the converted model's time.</p>"
        + chart
        + _table(["node", "op", "dtype", "kind", "µs", "share %"], rows)
    )


def _outputs_section(ver: Verification) -> list[str]:
    outputs = ver.outputs or ()
    rows = []
    for o in outputs:
        res = ('<span class="pass">pass</span>' if o.passed else
               '<span class="fail">FAIL</span> ' + escape("; ".join([*o.failed_criteria, *(o.notes or [])])))
        mark = "†" if o.partial else ""
        nonfinite = f"{o.out_nonfinite or 0} ({o.new_nonfinite or 0} new)"
        rows.append([o.name, nonfinite, fmt(o.sqnr_db) + mark, fmt(o.cosine, 7) + mark, fmt(o.max_abs, 3) + mark,
                     fmt(o.p99_abs, 3) + mark, fmt(o.max_rel, 3) + mark, fmt(o.top1), fmt(o.top5),
                     fmt(o.kl_div, 3), f"{fmt(o.min_atol, 3)} / {fmt(o.min_rtol, 3)}", res])  # fmt: skip
    return [f"<h2>Outputs</h2><p class='muted'>on {escape(str(ver.inputs))}</p>", _table(_OUTPUT_HEAD, rows, raw={11}),
            *(f"<p class='muted'>† {escape(o.name)}: metrics on the finite part only ({o.compared} of "
              f"{o.elements} elements)</p>" for o in outputs if o.partial)]  # fmt: skip


def _layerwise_section(lw: Layerwise, figs: dict[str, str]) -> list[str]:
    rows = [
        [i, e.node, e.op, e.module or "(root)", e.source, e.dtype,
         fmt(e.isolated.sqnr_db if e.isolated is not None else None),
         fmt(e.accumulated.sqnr_db if e.accumulated is not None else None), "yes" if e.introduces_nonfinite else "",
         fmt((e.range or {}).get("max_abs"), 3)]
        for i, e in enumerate(lw.top_introducers or (), 1)
    ]  # fmt: skip
    return [
        "<h2>Error along the graph</h2>",
        f"<p class='muted'>{lw.paired_nodes} nodes paired with the reference; first batch; accumulated = each model "
        "on its own activations, isolated = the converted node fed the reference's inputs.</p>",
        figs.get("error-along-graph", ""), figs.get("error-per-layer", ""),
        "<h2>Top error-introducing nodes</h2>",
        _table(_TOP_HEAD, rows) if rows else "<p>No node introduces error.</p>",
    ]  # fmt: skip


def _ranges_section(ranges: Ranges, lw: Layerwise) -> list[str]:
    bad = [e for e in lw.nodes or () if e.range and (e.range["overflow"] or e.range["flush_to_zero"])]
    parts = [f"<h2>Range in {escape(ranges.dtype)}</h2><p>largest |value| in FP32: {fmt(ranges.max_abs, 4)}</p>"]
    if bad:
        rows = [[e.node, e.op, e.dtype, fmt(e.range["max_abs"], 4), fmt(e.range["overflow"], 3),
                 fmt(e.range["flush_to_zero"], 3), fmt(e.range["subnormal"], 3)] for e in bad]  # fmt: skip
        parts.append(_table(["node", "op", "computes in", "max |x|", "overflow", "flush to zero", "subnormal"], rows))
    return parts


def _baseline_section(base: Baseline) -> list[str]:
    regressions = base.regressions or ()
    parts = [f"<h2>Baseline</h2><p>margin {fmt(base.margin_db)} dB: "
             f"{'no regression' if base.passed else str(len(regressions)) + ' regression(s)'}</p>"]  # fmt: skip
    if regressions:
        parts.append(_table(["output", "metric", "baseline", "current", "limit"],
                            [[r.output, r.metric, r.baseline, r.current, r.limit] for r in regressions]))
    return parts


def _gradients_section(grads: Gradients) -> list[str]:
    missing = ", ".join(grads.missing_gradients or [])
    return [
        f"<h2>Gradients</h2><p>{grads.summary(HTML)}</p>",
        f"<p class='fail'>Missing gradients: {escape(missing)}.</p>" if missing else "",
        _table(["parameter", "dtype", "SQNR dB", "max abs", "new NaN/Inf"],
               [[w.parameter, w.dtype, fmt(w.sqnr_db), fmt(w.max_abs, 3), w.new_nonfinite] for w in grads.worst or ()]),
    ]  # fmt: skip


def render_html(report: Report | Mapping[str, Any]) -> str:
    """The report page as one HTML string (plotly.js included inline)."""
    from plotly.offline import get_plotlyjs

    rep = as_report(report)
    figs = {key: fig.to_html(full_html=False, include_plotlyjs=False, div_id=key,
                             config={"displaylogo": False, "responsive": True})
            for key, fig in figures(rep)}  # fmt: skip
    cfg, check, ver = rep.section(Config) or Config(), rep.section(Check) or Check(), rep.section(Verification)
    passed = check.passed if check.passed is not None else (ver.passed if ver else None)
    cls, word = ("pass", "PASS") if passed else (("fail", "FAIL") if passed is False else ("", "NOT VERIFIED"))
    source = rep.section(Source)
    name = check.name or (source.path if source is not None else None) or "model"
    header = rep.data
    parts = [
        f"<h1>amplite report: {escape(str(name))}</h1>",
        f'<p><span class="verdict {cls}">{word}</span> &nbsp; {escape(str(cfg.precision))} '
        f"{escape(str(cfg.level))} · created {escape(str(header.get('created', '')))} · amplite "
        f"{escape(str(header.get('versions', {}).get('amplite', '')))}</p>",
    ]
    if check.reasons:
        parts.append("<ul>" + "".join(f'<li class="fail">{escape(r)}</li>' for r in check.reasons) + "</ul>")
    if ver:
        parts += _outputs_section(ver)
    if (training := rep.section(Training)) is not None:
        chart = training_figure(training).to_html(full_html=False, include_plotlyjs=False, div_id="training")
        parts.append(training_html(training, chart))
    if (budget := rep.section(Budget)) is not None:
        parts.append(_budget_section(budget, figs.get("budget-search", "")))
    if (est := rep.section(Estimate)) is not None:
        parts.append(_estimate_section(est, figs.get("estimate", "")))
    if (lw := rep.section(Layerwise)) is not None:
        parts += _layerwise_section(lw, figs)
    parts.append("<h2>Precision map</h2>" + figs.get("precision-map", ""))
    islands = rep.section(Fp32Nodes) or Fp32Nodes()
    parts.append(f"<p>{len(islands)} FP32 islands.</p>")
    if len(islands):
        parts.append(_table(["node", "op", "module", "source", "reason"],
                            [[p.node, p.op, p.module or "(root)", p.source, p.reason] for p in islands]))
    parts.append(_range_rules_section(rep))
    if (ranges := rep.section(Ranges)) is not None and lw is not None:
        parts += _ranges_section(ranges, lw)
    if (base := rep.section(Baseline)) is not None:
        parts += _baseline_section(base)
    if (grads := rep.section(Gradients)) is not None:
        parts += _gradients_section(grads)
    if (gold := rep.section(Golden)) is not None:
        parts.append(f"<h2>Golden</h2><p><code>{escape(gold.path)}</code>, created {escape(str(gold.created))}</p>")
    body = "\n".join(p for p in parts if p)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>amplite report: {escape(str(name))}'
        f"</title><style>{_CSS}</style><script>{get_plotlyjs()}</script></head><body>\n{body}\n</body></html>\n"
    )
