"""The ``training`` section of a report (``amplite check --train-steps``) in Markdown and HTML.

Markdown: the verdict line, the logged losses of both runs with their gap, skipped steps, the loss scale,
and the parameters whose gradients underflow most. HTML adds the loss-curve chart (both curves per step,
the skipped steps marked) and the loss-scale history. Both read the typed section
(:class:`~amplite.report.analysis.Training`).
"""

from __future__ import annotations

from typing import Any

from amplite.escape import html as escape
from amplite.report.analysis import Training, UnderflowShare
from amplite.report.format import cell, code, fmt, html_table

_TOP = 8


def _worst(t: Training) -> list[UnderflowShare]:
    return [u for u in t.gradient_underflow or () if (u.max_share or 0) > 0][:_TOP]


def training_markdown(t: Training) -> list[str]:
    """Markdown lines for the training section."""
    skipped, scale = list(t.skipped_steps or []), list(t.loss_scale_history or [])
    lines = [
        f"**Training** ({t.steps} steps, AdamW lr {t.lr:g}, {cell(t.loss)}, {cell(t.precision)} "
        f"{cell(t.level)}, masters {cell(t.masters)}): max loss gap {fmt(t.max_gap)} "
        f"(limit train_loss_gap<={t.gap_limit:g}) — {'pass' if t.passed else '**FAIL**'}.",
        "",
        "| step | FP32 loss | amplite loss | gap |",
        "|---|---|---|---|",
    ]
    lines += [f"| {e.step} | {fmt(e.fp32)} | {fmt(e.amplite)} | {fmt(e.gap)} |" for e in t.logged or ()]
    lines.append("")
    lines.append(
        f"Skipped steps: {len(skipped)}"
        + (f" ({', '.join(map(str, skipped[:10]))})" if skipped else "")
        + (f"; loss scale {scale[0]:g} → {scale[-1]:g}." if scale else "; no loss scaling.")
    )
    if worst := _worst(t):
        lines.append("Gradient underflow (share of elements non-zero in FP32 but zero in amplite): " + ", ".join(
            f"{code(u.parameter)} {fmt(100 * (u.mean_share or 0.0), 3)} %" for u in worst
        ))  # fmt: skip
    lines.append("")
    return lines


def training_figure(t: Training) -> Any:
    """The loss curves (and the loss scale on a second axis) as a plotly figure."""
    import plotly.graph_objects as go

    steps = list(range(1, (t.steps or 0) + 1))
    fp32, skipped, scale = list(t.fp32_losses or []), list(t.skipped_steps or []), list(t.loss_scale_history or [])
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=steps, y=fp32, mode="lines", name="FP32"))
    name = f"amplite {t.precision} {t.level}"
    fig.add_trace(go.Scatter(x=steps, y=list(t.amplite_losses or []), mode="lines", name=name))
    if skipped:
        fig.add_trace(go.Scatter(x=[s + 1 for s in skipped], y=[fp32[s] for s in skipped], mode="markers",
                                 name="skipped step", marker={"symbol": "x"}))  # fmt: skip
    if scale:
        fig.add_trace(go.Scatter(x=steps, y=scale, mode="lines", name="loss scale", yaxis="y2",
                                 line={"dash": "dot"}))  # fmt: skip
        fig.update_layout(yaxis2={"title": "loss scale", "overlaying": "y", "side": "right", "type": "log"})
    fig.update_layout(title="Training loss", xaxis_title="step", yaxis_title="loss", height=380,
                      margin={"l": 50, "r": 50, "t": 50, "b": 40})  # fmt: skip
    return fig


def training_html(t: Training, chart: str) -> str:
    """The HTML section; ``chart`` is the rendered :func:`training_figure`."""
    verdict = '<span class="pass">pass</span>' if t.passed else '<span class="fail">FAIL</span>'
    parts = [
        "<h2>Training</h2>",
        f"<p>{t.steps} steps on {escape(str(t.inputs))}, AdamW lr {t.lr:g}, loss {escape(t.loss)}; "
        f"masters: {escape(str(t.masters))}; max loss gap {fmt(t.max_gap)} "
        f"(train_loss_gap&lt;={t.gap_limit:g}): {verdict}; "
        f"{len(t.skipped_steps or [])} skipped steps.</p>",
        chart,
        html_table(["step", "FP32 loss", "amplite loss", "gap"],
                   [[e.step, fmt(e.fp32), fmt(e.amplite), fmt(e.gap)] for e in t.logged or ()]),
    ]  # fmt: skip
    if worst := _worst(t):
        parts.append("<p>Gradient elements that underflow (non-zero in FP32, zero in amplite):</p>")
        parts.append(html_table(["parameter", "mean share", "max share"],
                                [[u.parameter, fmt(u.mean_share, 3), fmt(u.max_share, 3)] for u in worst]))
    return "\n".join(parts)
