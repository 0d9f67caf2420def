"""The plotly figures of report.html, from the typed sections: the estimate, error along the graph and per
layer, the precision map and the accuracy-budget search.

Every text from the model is HTML-escaped (:func:`amplite.escape.html`) in chart labels too: plotly reads
``<a href>`` in an axis label as a link.
"""

from __future__ import annotations

from typing import Any

from amplite.errors import ConfigError
from amplite.escape import html as escape
from amplite.report.analysis import Estimate, Layerwise
from amplite.report.checks import Budget
from amplite.report.document import Report
from amplite.report.entries import ToleranceEntry
from amplite.report.format import CAP_DB, fmt
from amplite.report.format import db as _db
from amplite.report.sections import Graph
from amplite.verify.compare import parse_criterion

__all__ = ["MARGIN", "figures"]

MARGIN = {"l": 50, "r": 20, "t": 50, "b": 40}


def figures(rep: Report) -> list[tuple[str, Any]]:
    """``(div id, figure)`` for each chart the report has data for."""
    figs: list[tuple[str, Any]] = []
    if (est := rep.section(Estimate)) is not None:
        figs.append(("estimate", _estimate_figure(est)))
    lw = rep.section(Layerwise)
    if lw is not None and lw.nodes:
        figs += _layerwise_figures(lw)
    graph = rep.section(Graph)
    if graph is not None and graph.after is not None:
        figs.append(("precision-map", _precision_figure(graph)))
    budget = rep.section(Budget)
    if budget is not None and budget.steps:
        figs.append(("budget-search", _budget_figure(budget)))
    return figs


def _layerwise_figures(lw: Layerwise) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    nodes = lw.nodes or ()
    hover = [f"{escape(n.node)} ({escape(n.op)})<br>{escape(n.module or '(root)')}<br>{escape(n.source)}<br>"
             f"dtype {n.dtype}" for n in nodes]  # fmt: skip
    # fmt: off
    x, fig = [n.index for n in nodes], go.Figure()
    acc = [_db(n.accumulated.sqnr_db if n.accumulated is not None else None) for n in nodes]
    iso = [_db(n.isolated.sqnr_db) if n.isolated is not None else None for n in nodes]
    fig.add_trace(go.Scatter(x=x, y=acc, mode="lines+markers", name="accumulated (own activations)", text=hover,
                             hoverinfo="text+y"))
    fig.add_trace(go.Scatter(x=x, y=iso, mode="markers", name="isolated (FP32 inputs)", text=hover,
                             hoverinfo="text+y", marker={"symbol": "diamond"}))
    bad = [n for n in nodes if n.introduces_nonfinite]
    if bad:
        fig.add_trace(go.Scatter(x=[n.index for n in bad], y=[-20.0] * len(bad), mode="markers",
                                 name="introduces NaN/Inf", marker={"symbol": "x", "size": 12, "color": "red"},
                                 text=[escape(n.node) for n in bad], hoverinfo="text"))
    fig.update_layout(title="Error along the graph (SQNR, dB; higher is better; exact drawn at 160)",
                      xaxis_title="node (graph order)", xaxis_dtick=max(1, len(nodes) // 20),
                      yaxis_title="SQNR dB", height=420, margin=MARGIN)
    # fmt: on
    figs = [("error-along-graph", fig)]
    layers = lw.layers or ()
    if len(layers) > 1:
        lf = go.Figure()
        names = [escape(row.layer) for row in layers]  # plotly reads <a href> and <b> in axis labels
        lf.add_trace(go.Bar(x=names, y=[_db(r.accumulated_sqnr_db) for r in layers], name="worst accumulated"))
        lf.add_trace(go.Bar(x=names, y=[_db(r.isolated_sqnr_db) for r in layers], name="worst isolated"))
        lf.update_layout(title="Worst SQNR per layer (dB)", barmode="group", height=360, margin=MARGIN | {"b": 80})
        figs.append(("error-per-layer", lf))
    return figs


def _precision_figure(graph: Graph) -> Any:
    import plotly.graph_objects as go

    before = (graph.before.nodes_by_dtype if graph.before is not None else None) or {}
    after = (graph.after.nodes_by_dtype if graph.after is not None else None) or {}
    dtypes = sorted(set(before) | set(after))
    pf = go.Figure()
    for when, counts in (("before", before), ("after", after)):
        pf.add_trace(go.Bar(x=[escape(d) for d in dtypes], y=[counts.get(d, 0) for d in dtypes], name=when))
    pf.update_layout(title="Nodes by compute dtype", barmode="group", height=320, margin=MARGIN)
    return pf


def sqnr_lines(tolerance: ToleranceEntry | None) -> list[tuple[float, str]]:
    """The SQNR thresholds of a tolerance as ``(dB, label)``: its ``sqnr_db`` criteria, else the default rule."""
    tolerance = tolerance or ToleranceEntry()
    if not tolerance.criteria:
        default = tolerance.min_sqnr_db
        return [] if default is None else [(float(default), f"default sqnr_db>={default:g}")]
    lines = {}
    for text in tolerance.criteria:
        try:
            c = parse_criterion(text)
        except ConfigError:  # a report edited by hand: draw what can be read
            continue
        if c.metric == "sqnr_db" and c.op in (">=", ">"):
            lines.setdefault(c.threshold, str(c))
    return sorted(lines.items())


def _budget_figure(budget: Budget) -> Any:
    import plotly.graph_objects as go

    steps, thresholds = budget.steps or (), sqnr_lines(budget.tolerance)
    # exact ("inf") is drawn 10 dB above everything else, so the scale stays readable near the tolerance;
    # non-finite outputs ("nan") at the floor, marked with an x
    values = [_db(s.worst_sqnr_db) for s in steps]
    finite = [v for v in values if v is not None and v < CAP_DB] + [t for t, _ in thresholds]
    top = min(CAP_DB, max(finite, default=0.0) + 10)
    y = [-20.0 if v is None else min(v, top) for v in values]
    hover = [
        f"trial {s.trial}: {escape(s.kind)}<br>{s.moved} node(s) moved to FP32<br>"
        f"worst SQNR {fmt(s.worst_sqnr_db)} dB: {'pass' if s.passed else 'fail'}<br>{s.seconds} s"
        for s in steps
    ]
    marker = {"size": 11, "color": ["#087f23" if s.passed else "#c62828" for s in steps],
              "symbol": ["x" if v is None else "circle" for v in values]}  # fmt: skip
    fig = go.Figure(go.Scatter(x=[s.trial for s in steps], y=y, mode="lines+markers", name="worst output",
                               text=hover, hoverinfo="text", line={"color": "#bbb"}, marker=marker))  # fmt: skip
    for db, label in thresholds:
        fig.add_hline(y=db, line_dash="dash", line_color="#555", annotation_text=escape(label))
    fig.update_layout(title="Accuracy-budget search: worst-output SQNR per trial (dB; green passes, red fails; "
                      f"exact drawn at {top:.0f})", xaxis_title="trial (0 = the rule-based plan)", xaxis_dtick=1,
                      yaxis_title="SQNR dB", height=380, showlegend=False, margin=MARGIN)  # fmt: skip
    return fig


def _estimate_figure(est: Estimate) -> Any:
    import plotly.graph_objects as go

    seconds = est.seconds or {}
    names = list(seconds)
    fig = go.Figure(go.Bar(x=[escape(k) for k in names], y=[seconds[k] * 1e3 for k in names]))
    fig.update_layout(height=280, margin={"t": 30, "b": 30}, yaxis_title="estimated ms per forward",
                      title=f"Estimated on {escape(est.device)} (roofline; not a measurement)")  # fmt: skip
    return fig
