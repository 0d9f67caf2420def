"""The ``training`` section of a report (``amplite check --train-steps``) in Markdown and HTML.

Markdown: the verdict line, the logged losses of both runs with their gap, skipped steps, the loss scale,
and the parameters whose gradients underflow most. HTML adds the loss-curve chart (both curves per step,
the skipped steps marked) and the loss-scale history.
"""

from __future__ import annotations

from typing import Any

from amplite.escape import html as escape
from amplite.report.format import cell, code, fmt, html_table

_TOP = 8


def training_markdown(t: dict[str, Any]) -> list[str]:
    """Markdown lines for the training section."""
    lines = [
        f"**Training** ({t['steps']} steps, AdamW lr {t['lr']:g}, {cell(t['loss'])}, {cell(t['precision'])} "
        f"{cell(t['level'])}, masters {cell(t['masters'])}): max loss gap {fmt(t['max_gap'])} "
        f"(limit train_loss_gap<={t['tolerance']['train_loss_gap']:g}) — {'pass' if t['passed'] else '**FAIL**'}.",
        "",
        "| step | FP32 loss | amplite loss | gap |",
        "|---|---|---|---|",
    ]
    lines += [f"| {e['step']} | {fmt(e['fp32'])} | {fmt(e['amplite'])} | {fmt(e['gap'])} |" for e in t["logged"]]
    lines.append("")
    scale = t["loss_scale_history"]
    lines.append(
        f"Skipped steps: {len(t['skipped_steps'])}"
        + (f" ({', '.join(map(str, t['skipped_steps'][:10]))})" if t["skipped_steps"] else "")
        + (f"; loss scale {scale[0]:g} → {scale[-1]:g}." if scale else "; no loss scaling.")
    )
    worst = [u for u in t["gradient_underflow"] if u["max_share"] > 0][:_TOP]
    if worst:
        lines.append("Gradient underflow (share of elements non-zero in FP32 but zero in amplite): " + ", ".join(
            f"{code(u['parameter'])} {fmt(100 * u['mean_share'], 3)} %" for u in worst
        ))  # fmt: skip
    lines.append("")
    return lines


def training_figure(t: dict[str, Any]) -> Any:
    """The loss curves (and the loss scale on a second axis) as a plotly figure."""
    import plotly.graph_objects as go

    steps = list(range(1, t["steps"] + 1))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=steps, y=t["fp32_losses"], mode="lines", name="FP32"))
    name = f"amplite {t['precision']} {t['level']}"
    fig.add_trace(go.Scatter(x=steps, y=t["amplite_losses"], mode="lines", name=name))
    if t["skipped_steps"]:
        skipped = [s + 1 for s in t["skipped_steps"]]
        y = [t["fp32_losses"][s] for s in t["skipped_steps"]]
        fig.add_trace(go.Scatter(x=skipped, y=y, mode="markers", name="skipped step", marker={"symbol": "x"}))
    if t["loss_scale_history"]:
        fig.add_trace(go.Scatter(x=steps, y=t["loss_scale_history"], mode="lines", name="loss scale", yaxis="y2",
                                 line={"dash": "dot"}))  # fmt: skip
        fig.update_layout(yaxis2={"title": "loss scale", "overlaying": "y", "side": "right", "type": "log"})
    fig.update_layout(title="Training loss", xaxis_title="step", yaxis_title="loss", height=380,
                      margin={"l": 50, "r": 50, "t": 50, "b": 40})  # fmt: skip
    return fig


def training_html(t: dict[str, Any], chart: str) -> str:
    """The HTML section; ``chart`` is the rendered :func:`training_figure`."""

    verdict = '<span class="pass">pass</span>' if t["passed"] else '<span class="fail">FAIL</span>'
    parts = [
        "<h2>Training</h2>",
        f"<p>{t['steps']} steps on {escape(str(t['inputs']))}, AdamW lr {t['lr']:g}, loss {escape(t['loss'])}; "
        f"masters: {escape(str(t['masters']))}; max loss gap {fmt(t['max_gap'])} "
        f"(train_loss_gap&lt;={t['tolerance']['train_loss_gap']:g}): {verdict}; "
        f"{len(t['skipped_steps'])} skipped steps.</p>",
        chart,
        html_table(["step", "FP32 loss", "amplite loss", "gap"],
               [[e["step"], fmt(e["fp32"]), fmt(e["amplite"]), fmt(e["gap"])] for e in t["logged"]]),
    ]  # fmt: skip
    worst = [u for u in t["gradient_underflow"] if u["max_share"] > 0][:_TOP]
    if worst:
        parts.append("<p>Gradient elements that underflow (non-zero in FP32, zero in amplite):</p>")
        parts.append(html_table(["parameter", "mean share", "max share"],
                            [[u["parameter"], fmt(u["mean_share"], 3), fmt(u["max_share"], 3)] for u in worst]))
    return "\n".join(parts)
