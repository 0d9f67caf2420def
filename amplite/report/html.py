"""report.html: one self-contained page (plotly.js inlined, works offline) for a report.

Sections: verdict, per-output table, the accuracy-budget search (its trials against the tolerance and the
nodes it moved to FP32), error along the graph (accumulated and isolated SQNR per node, and the worst per
layer), the precision map (nodes by dtype, the FP32 islands with their reasons, the range-rule decisions),
the top error-introducing nodes with their source lines, range problems, baseline, gradients and golden
facts. Charts are plotly figures; every text from the model is HTML-escaped (:func:`amplite.escape.html`), in
tables and in chart labels alike (plotly reads ``<a href>`` in an axis label as a link).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from amplite.errors import ConfigError
from amplite.escape import html as escape
from amplite.report.document import Report, document
from amplite.report.format import CAP_DB, fmt
from amplite.report.format import db as _db
from amplite.report.format import html_table as _table
from amplite.report.training import training_figure, training_html
from amplite.verify.compare import parse_criterion

_MARGIN = {"l": 50, "r": 20, "t": 50, "b": 40}
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


def _figures(data: dict[str, Any]) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    figs: list[tuple[str, Any]] = []
    if data.get("estimate"):
        figs.append(("estimate", _estimate_figure(data["estimate"])))
    nodes = data.get("layerwise", {}).get("nodes", [])
    if nodes:
        hover = [
            f"{escape(n['node'])} ({escape(n['op'])})<br>{escape(n['module'] or '(root)')}<br>"
            f"{escape(n['source'])}<br>dtype {n['dtype']}"
            for n in nodes
        ]
        # fmt: off
        x, fig = [n["index"] for n in nodes], go.Figure()
        acc = [_db(n["accumulated"]["sqnr_db"]) for n in nodes]
        iso = [_db(n["isolated"]["sqnr_db"]) if n.get("isolated") else None for n in nodes]
        fig.add_trace(go.Scatter(x=x, y=acc, mode="lines+markers", name="accumulated (own activations)", text=hover,
                                 hoverinfo="text+y"))
        fig.add_trace(go.Scatter(x=x, y=iso, mode="markers", name="isolated (FP32 inputs)", text=hover,
                                 hoverinfo="text+y", marker={"symbol": "diamond"}))
        bad = [n for n in nodes if n.get("introduces_nonfinite")]
        if bad:
            fig.add_trace(go.Scatter(x=[n["index"] for n in bad], y=[-20.0] * len(bad), mode="markers",
                                     name="introduces NaN/Inf", marker={"symbol": "x", "size": 12, "color": "red"},
                                     text=[escape(n["node"]) for n in bad], hoverinfo="text"))
        fig.update_layout(title="Error along the graph (SQNR, dB; higher is better; exact drawn at 160)",
                          xaxis_title="node (graph order)", xaxis_dtick=max(1, len(nodes) // 20),
                          yaxis_title="SQNR dB", height=420, margin=_MARGIN)
        # fmt: on
        figs.append(("error-along-graph", fig))
        layers = data["layerwise"].get("layers", [])
        if len(layers) > 1:
            lf = go.Figure()
            names = [escape(row["layer"]) for row in layers]  # plotly reads <a href> and <b> in axis labels
            lf.add_trace(go.Bar(x=names, y=[_db(r["accumulated_sqnr_db"]) for r in layers], name="worst accumulated"))
            lf.add_trace(go.Bar(x=names, y=[_db(r["isolated_sqnr_db"]) for r in layers], name="worst isolated"))
            lf.update_layout(title="Worst SQNR per layer (dB)", barmode="group", height=360, margin=_MARGIN | {"b": 80})
            figs.append(("error-per-layer", lf))
    graph = data.get("graph", {})
    if graph.get("after"):
        dtypes = sorted(set(graph.get("before", {}).get("nodes_by_dtype", {})) | set(graph["after"]["nodes_by_dtype"]))
        pf = go.Figure()
        for when in ("before", "after"):
            counts = graph.get(when, {}).get("nodes_by_dtype", {})
            pf.add_trace(go.Bar(x=[escape(d) for d in dtypes], y=[counts.get(d, 0) for d in dtypes], name=when))
        pf.update_layout(title="Nodes by compute dtype", barmode="group", height=320, margin=_MARGIN)
        figs.append(("precision-map", pf))
    if data.get("budget", {}).get("steps"):
        figs.append(("budget-search", _budget_figure(data["budget"])))
    return figs


def _sqnr_lines(tolerance: dict[str, Any]) -> list[tuple[float, str]]:
    """The SQNR thresholds of a tolerance as ``(dB, label)``: its ``sqnr_db`` criteria, else the default rule."""
    criteria = tolerance.get("criteria") or []
    if not criteria:
        default = tolerance.get("min_sqnr_db")
        return [] if default is None else [(float(default), f"default sqnr_db>={default:g}")]
    lines = {}
    for text in criteria:
        try:
            c = parse_criterion(text)
        except ConfigError:  # a report edited by hand: draw what can be read
            continue
        if c.metric == "sqnr_db" and c.op in (">=", ">"):
            lines.setdefault(c.threshold, str(c))
    return sorted(lines.items())


def _budget_figure(budget: dict[str, Any]) -> Any:
    import plotly.graph_objects as go

    steps, thresholds = budget["steps"], _sqnr_lines(budget.get("tolerance", {}))
    # exact ("inf") is drawn 10 dB above everything else, so the scale stays readable near the tolerance;
    # non-finite outputs ("nan") at the floor, marked with an x
    values = [_db(s["worst_sqnr_db"]) for s in steps]
    finite = [v for v in values if v is not None and v < CAP_DB] + [t for t, _ in thresholds]
    top = min(CAP_DB, max(finite, default=0.0) + 10)
    y = [-20.0 if v is None else min(v, top) for v in values]
    hover = [
        f"trial {s['trial']}: {escape(s['kind'])}<br>{s['moved']} node(s) moved to FP32<br>"
        f"worst SQNR {fmt(s['worst_sqnr_db'])} dB: {'pass' if s['passed'] else 'fail'}<br>{s['seconds']} s"
        for s in steps
    ]
    marker = {"size": 11, "color": ["#087f23" if s["passed"] else "#c62828" for s in steps],
              "symbol": ["x" if v is None else "circle" for v in values]}  # fmt: skip
    fig = go.Figure(go.Scatter(x=[s["trial"] for s in steps], y=y, mode="lines+markers", name="worst output",
                               text=hover, hoverinfo="text", line={"color": "#bbb"}, marker=marker))  # fmt: skip
    for db, label in thresholds:
        fig.add_hline(y=db, line_dash="dash", line_color="#555", annotation_text=escape(label))
    fig.update_layout(title="Accuracy-budget search: worst-output SQNR per trial (dB; green passes, red fails; "
                      f"exact drawn at {top:.0f})", xaxis_title="trial (0 = the rule-based plan)", xaxis_dtick=1,
                      yaxis_title="SQNR dB", height=380, showlegend=False, margin=_MARGIN)  # fmt: skip
    return fig


def _budget_section(budget: dict[str, Any], chart: str) -> str:
    tol = budget.get("tolerance") or {}
    spec = ", ".join(tol.get("criteria") or []) or f"default (sqnr_db>={tol.get('min_sqnr_db')})"
    cls, word = ("pass", "met") if budget["passed"] else ("fail", "NOT met")
    moved = budget["moved_to_fp32"]
    parts = [
        f"<h2>Accuracy budget</h2><p>Tolerance <code>{escape(spec)}</code>: <span class='{cls}'>{word}</span> "
        f"with {len(moved)} of {budget['candidates']} candidate nodes moved to FP32, in {budget['trials']} trials "
        f"(bound {budget['trial_bound']}), {fmt(budget['seconds'])} s"
        + (f"; the prune phase took {budget['prune']['before']} nodes down to {budget['prune']['after']}"
           if budget.get("prune", {}).get("trials") else "") + ".</p>",
        f"<p class='fail'>{escape(budget['message'])}</p>" if budget.get("message") else "",
        chart,
    ]
    if moved:
        rows = [
            [i, m["node"], m.get("op") or "", m.get("module") or "(root)", m.get("source") or "",
             fmt(m["isolated_sqnr_db"])]
            for i, m in enumerate(moved, 1)
        ]  # fmt: skip
        parts.append("<p>Moved to FP32, worst isolated error first:</p>")
        parts.append(_table(["#", "node", "op", "module", "source", "isolated SQNR dB"], rows))
    return "\n".join(p for p in parts if p)


def _range_rules_section(data: dict[str, Any]) -> str:
    rules = data.get("config", {}).get("range_rules")
    if not rules:
        return ""
    plan = data.get("plan", [])
    chosen = [p for p in plan if p.get("rule") == "range" and p.get("mode") == "fp32"]
    depth = rules.get("max_reduction_depth")
    text = (
        f"<h3>Range rules</h3><p>data_max {fmt(rules.get('data_max'), 6)}, "
        f"weight_max {fmt(rules.get('weight_max'), 6)}, underflow share {fmt(rules.get('underflow_share'))}, "
        f"max reduction depth {'none' if depth is None else fmt(depth)}: {len(chosen)} node(s) kept in FP32 by "
        "them.</p>"
    )
    if not chosen:
        return text
    rows = [[p["node"], p["op"], p["module"] or "(root)", p["source"], p["reason"]] for p in chosen]
    return text + _table(["node", "op", "module", "source", "reason"], rows)


def _estimate_figure(est: dict[str, Any]) -> Any:
    import plotly.graph_objects as go

    names = list(est["seconds"])
    fig = go.Figure(go.Bar(x=[escape(k) for k in names], y=[est["seconds"][k] * 1e3 for k in names]))
    fig.update_layout(height=280, margin={"t": 30, "b": 30}, yaxis_title="estimated ms per forward",
                      title=f"Estimated on {escape(est['device'])} (roofline; not a measurement)")  # fmt: skip
    return fig


def _estimate_section(est: dict[str, Any], chart: str) -> str:
    rows = [[n["node"], n["op"], n["dtype"], n["kind"], fmt(n["seconds"] * 1e6, 3), fmt(n["share"] * 100, 3)]
            for n in est["top_nodes"]]  # fmt: skip
    return (
        f"<h2>Estimated GPU time</h2><p class='muted'>{escape(est['label'])}: per-node roofline on "
        f"{escape(est['device'])} (docs/estimates.md).</p><p>{fmt(est['ratio_vs_fp32'], 3)}× FP32, "
        f"{fmt(est['ratio_vs_autocast'], 3)}× autocast; casts {fmt(est['cast_share'] * 100, 3)}%, FP32 islands "
        f"{fmt(est['fp32_island_share'] * 100, 3)}% of the converted model's time.</p>"
        + chart
        + _table(["node", "op", "dtype", "kind", "µs", "share %"], rows)
    )


def render_html(report: Report | Mapping[str, Any]) -> str:
    """The report page as one HTML string (plotly.js included inline)."""
    data = document(report)
    from plotly.offline import get_plotlyjs

    figs = {
        key: fig.to_html(
            full_html=False, include_plotlyjs=False, div_id=key, config={"displaylogo": False, "responsive": True}
        )
        for key, fig in _figures(data)
    }
    cfg, check, ver = data.get("config", {}), data.get("check", {}), data.get("verification")
    passed = check.get("passed", ver.get("passed") if ver else None)
    cls, word = ("pass", "PASS") if passed else (("fail", "FAIL") if passed is False else ("", "NOT VERIFIED"))
    name = check.get("name") or data.get("source", {}).get("path") or "model"
    parts = [
        f"<h1>amplite report: {escape(str(name))}</h1>",
        f'<p><span class="verdict {cls}">{word}</span> &nbsp; {escape(str(cfg.get("precision")))} '
        f"{escape(str(cfg.get('level')))} · created {escape(str(data.get('created', '')))} · amplite "
        f"{escape(str(data.get('versions', {}).get('amplite', '')))}</p>",
    ]
    if check.get("reasons"):
        parts.append("<ul>" + "".join(f'<li class="fail">{escape(r)}</li>' for r in check["reasons"]) + "</ul>")
    if ver:
        parts.append(f"<h2>Outputs</h2><p class='muted'>on {escape(str(ver.get('inputs')))}</p>")
        rows = []
        for o in ver["outputs"]:
            failed = [c["criterion"] for c in o.get("checks", []) if not c["passed"]]
            res = (
                '<span class="pass">pass</span>'
                if o["passed"]
                else ('<span class="fail">FAIL</span> ' + escape("; ".join(failed + o.get("notes", []))))
            )
            mark = "†" if o.get("compared", 0) < o.get("elements", 0) else ""
            nonfinite = f"{o.get('out_nonfinite', 0)} ({o.get('new_nonfinite', 0)} new)"
            rows.append([o["name"], nonfinite, fmt(o["sqnr_db"]) + mark, fmt(o["cosine"], 7) + mark,
                         fmt(o["max_abs"], 3) + mark, fmt(o.get("p99_abs"), 3) + mark, fmt(o.get("max_rel"), 3) + mark,
                         fmt(o.get("top1")), fmt(o.get("top5")), fmt(o.get("kl_div"), 3),
                         f"{fmt(o.get('min_atol'), 3)} / {fmt(o.get('min_rtol'), 3)}", res])  # fmt: skip
        parts.append(_table(_OUTPUT_HEAD, rows, raw={11}))
        parts += [f"<p class='muted'>† {escape(o['name'])}: metrics on the finite part only ({o['compared']} of "
                  f"{o['elements']} elements)</p>" for o in ver["outputs"]
                  if o.get("compared", 0) < o.get("elements", 0)]  # fmt: skip
    if data.get("training"):
        chart = training_figure(data["training"]).to_html(full_html=False, include_plotlyjs=False, div_id="training")
        parts.append(training_html(data["training"], chart))
    if data.get("budget"):
        parts.append(_budget_section(data["budget"], figs.get("budget-search", "")))
    if data.get("estimate"):
        parts.append(_estimate_section(data["estimate"], figs.get("estimate", "")))
    lw = data.get("layerwise")
    if lw:
        parts.append("<h2>Error along the graph</h2>")
        parts.append(
            f"<p class='muted'>{lw['paired_nodes']} nodes paired with the reference; first batch; "
            "accumulated = each model on its own activations, isolated = the converted node fed the "
            "reference's inputs.</p>"
        )
        parts += [figs.get("error-along-graph", ""), figs.get("error-per-layer", "")]
        parts.append("<h2>Top error-introducing nodes</h2>")
        rows = [
            [i, e["node"], e["op"], e["module"] or "(root)", e["source"], e["dtype"], fmt(e["isolated"]["sqnr_db"]),
             fmt(e["accumulated"]["sqnr_db"]), "yes" if e["introduces_nonfinite"] else "",
             fmt((e.get("range") or {}).get("max_abs"), 3)]
            for i, e in enumerate(lw["top_introducers"], 1)
        ]  # fmt: skip
        parts.append(_table(_TOP_HEAD, rows) if rows else "<p>No node introduces error.</p>")
    parts.append("<h2>Precision map</h2>" + figs.get("precision-map", ""))
    islands = data.get("fp32_nodes", [])
    parts.append(f"<p>{len(islands)} FP32 islands.</p>")
    if islands:
        parts.append(
            _table(
                ["node", "op", "module", "source", "reason"],
                [[p["node"], p["op"], p["module"] or "(root)", p["source"], p["reason"]] for p in islands],
            )
        )
    parts.append(_range_rules_section(data))
    ranges = data.get("ranges")
    if ranges and lw:
        bad = [e for e in lw["nodes"] if e.get("range") and (e["range"]["overflow"] or e["range"]["flush_to_zero"])]
        parts.append(
            f"<h2>Range in {escape(ranges['dtype'])}</h2><p>largest |value| in FP32: {fmt(ranges['max_abs'], 4)}</p>"
        )
        if bad:
            rows = [
                [e["node"], e["op"], e["dtype"], fmt(e["range"]["max_abs"], 4), fmt(e["range"]["overflow"], 3),
                 fmt(e["range"]["flush_to_zero"], 3), fmt(e["range"]["subnormal"], 3)]
                for e in bad
            ]  # fmt: skip
            head = ["node", "op", "computes in", "max |x|", "overflow", "flush to zero", "subnormal"]
            parts.append(_table(head, rows))
    base = data.get("baseline")
    if base:
        parts.append(
            f"<h2>Baseline</h2><p>margin {fmt(base['margin_db'])} dB: "
            f"{'no regression' if base['passed'] else str(len(base['regressions'])) + ' regression(s)'}</p>"
        )
        if base["regressions"]:
            parts.append(
                _table(
                    ["output", "metric", "baseline", "current", "limit"],
                    [[r["output"], r["metric"], r["baseline"], r["current"], r["limit"]] for r in base["regressions"]],
                )
            )
    grads = data.get("gradients")
    if grads:
        u = grads.get("underflow", {})
        parts.append(
            f"<h2>Gradients</h2><p>loss: {escape(str(grads['loss']))}; min SQNR {fmt(grads['min_sqnr_db'])} dB; "
            f"underflow in {escape(str(u.get('dtype')))} without scaling {fmt(u.get('underflow_unscaled'), 3)}; "
            f"recommended: {escape(u.get('advice') or 'loss scale ' + str(fmt(u.get('recommended_loss_scale'))))}; "
            f"{grads['parameters']} parameters compared; missing gradients: "
            f"{escape(', '.join(grads.get('missing_gradients') or []) or 'none')}.</p>"
        )
        parts.append(
            _table(
                ["parameter", "dtype", "SQNR dB", "max abs", "new NaN/Inf"],
                [
                    [w["parameter"], w["dtype"], fmt(w["sqnr_db"]), fmt(w["max_abs"], 3), w["new_nonfinite"]]
                    for w in grads.get("worst", [])
                ],
            )
        )
    gold = data.get("golden")
    if gold:
        parts.append(
            f"<h2>Golden</h2><p><code>{escape(gold['path'])}</code>, created {escape(str(gold.get('created')))}</p>"
        )
    body = "\n".join(p for p in parts if p)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>amplite report: {escape(str(name))}'
        f"</title><style>{_CSS}</style><script>{get_plotlyjs()}</script></head><body>\n{body}\n</body></html>\n"
    )
