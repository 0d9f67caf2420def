"""report.md: a short summary of a report for a pull-request comment or a CI step summary."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from amplite.report.document import Report, document
from amplite.report.format import cell as _cell
from amplite.report.format import code as _code
from amplite.report.format import fmt as _fmt
from amplite.report.training import training_markdown


def fmt(v: Any, digits: int = 4) -> str:
    """A number for Markdown (:func:`amplite.report.format.fmt`); a string (a hand-edited report's) escaped."""
    return _cell(_fmt(v, digits))


def estimate_line(est: dict[str, Any]) -> str:
    """One line on the predicted GPU time (labelled as an estimate)."""
    sec = est["seconds"]
    ms = ", ".join(f"{_cell(k)} {fmt(v * 1e3, 3)} ms" for k, v in sec.items())
    return (
        f"**Estimated GPU time on {_cell(est['device'])}** ({_cell(est['label'])}): {ms} — "
        f"{fmt(est['ratio_vs_fp32'], 3)}× FP32, {fmt(est['ratio_vs_autocast'], 3)}× autocast; "
        f"casts {fmt(est['cast_share'] * 100, 3)}%, FP32 islands {fmt(est['fp32_island_share'] * 100, 3)}% of it."
    )


def budget_line(budget: dict[str, Any], names: int = 5) -> str:
    """One line on the accuracy-budget search: verdict, nodes moved to FP32, trials and time."""
    tol = budget.get("tolerance") or {}
    spec = ", ".join(tol.get("criteria") or []) or f"sqnr_db>={tol.get('min_sqnr_db')}"
    moved = [m["node"] for m in budget.get("moved_to_fp32", [])]
    to = {m.get("to", "float32") for m in budget.get("moved_to_fp32", [])}  # fp8: FP8 products go back to bf16
    where = "to FP32" if "bfloat16" not in to else "from FP8 to bf16" if to == {"bfloat16"} else "to bf16 (FP8) / FP32"
    shown = ", ".join(f"{_code(n)}" for n in moved[:names]) + (", …" if len(moved) > names else "")
    text = (
        f"**Accuracy budget** ({_code(spec)}): {'met' if budget['passed'] else '**NOT met**'} with "
        f"{len(moved)} of {budget['candidates']} candidate nodes moved {where}{f' ({shown})' if moved else ''}, "
        f"{budget['trials']} trials (bound {budget['trial_bound']}), {fmt(budget['seconds'], 3)} s."
    )
    prune = budget.get("prune")
    if prune and prune["trials"]:
        text += f" The prune phase took {prune['before']} nodes down to {prune['after']}."
    return text + (f" {_cell(budget['message'])}" if budget.get("message") else "")


def render_markdown(report: Report | Mapping[str, Any], top_n: int = 5) -> str:
    """The Markdown summary of a report (from ``amplite check`` or ``amplite convert``)."""
    data = document(report)
    cfg = data.get("config", {})
    check = data.get("check", {})
    ver = data.get("verification")
    passed = check.get("passed", ver.get("passed") if ver else None)
    verdict = "✅ PASS" if passed else ("❌ FAIL" if passed is False else "– not verified")
    name = check.get("name") or data.get("source", {}).get("path") or "model"
    lines = [f"### amplite check: {_code(name)} — {verdict}", ""]
    setting = f"{cfg.get('precision', '?')} {cfg.get('level', '?')}" + (f", on {ver['inputs']}" if ver else "")
    lines.append(_cell(setting))
    lines.append("")
    if ver:
        lines += [
            "| output | NaN/Inf | SQNR dB | cosine | max abs | p99 abs | top-1 | min atol | result |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for o in ver["outputs"]:
            mark = "†" if o.get("compared", 0) < o.get("elements", 0) else ""
            failed = [c["criterion"] for c in o.get("checks", []) if not c["passed"]]
            result = "pass" if o["passed"] else "**FAIL** " + _cell("; ".join(failed + o.get("notes", [])))
            lines.append(
                f"| {_code(o['name'])} | {o.get('out_nonfinite', 0)} | {fmt(o['sqnr_db'])}{mark} "
                f"| {fmt(o['cosine'], 7)}{mark} | {fmt(o['max_abs'], 3)}{mark} | {fmt(o.get('p99_abs'), 3)}{mark} "
                f"| {fmt(o.get('top1'))} | {fmt(o.get('min_atol'), 3)} | {result} |"
            )
        lines.append("")
        lines += [f"† {_code(o['name'])}: metrics on the finite part only ({o['compared']} of {o['elements']} "
                  "elements)" for o in ver["outputs"] if o.get("compared", 0) < o.get("elements", 0)]  # fmt: skip
        if lines[-1] != "":
            lines.append("")
    if check.get("reasons"):
        lines += ["**Why it failed:**", ""] + [f"- {_cell(r)}" for r in check["reasons"][:10]] + [""]
    if data.get("budget"):
        lines += [budget_line(data["budget"]), ""]
    if data.get("estimate"):
        lines += [estimate_line(data["estimate"]), ""]
    top = data.get("layerwise", {}).get("top_introducers", [])[:top_n]
    if top:
        lines += [
            "**Top error-introducing nodes** (isolated error: the node fed with FP32 inputs)",
            "",
            "| # | node | op | module | source | isolated SQNR dB | |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, e in enumerate(top, 1):
            flag = "introduces NaN/Inf" if e["introduces_nonfinite"] else ""
            lines.append(
                f"| {i} | {_code(e['node'])} | {_cell(e['op'])} | {_cell(e['module'] or '(root)')} "
                f"| {_cell(e['source'])} | {fmt(e['isolated']['sqnr_db'])} | {flag} |"
            )
        lines.append("")
    graph = data.get("graph", {}).get("after", {})
    if graph:
        by_dtype = ", ".join(f"{_cell(k)} {fmt(v)}" for k, v in graph.get("nodes_by_dtype", {}).items())
        by_range = sum(1 for p in data.get("fp32_nodes", []) if p.get("rule") == "range")
        lines.append(
            f"**Precision map:** {by_dtype}; {graph.get('casts', 0)} casts; "
            f"{len(data.get('fp32_nodes', []))} FP32 islands"
            + (f", {by_range} of them kept by the range rules." if cfg.get("range_rules") else ".")
        )
    ranges = data.get("ranges")
    if ranges and ranges.get("overflowing_nodes"):
        nodes = ", ".join(_code(n) for n in ranges["overflowing_nodes"][:5])
        lines.append(f"**Range:** values beyond {_cell(ranges['dtype'])}'s max in FP32 at {nodes}.")
    base = data.get("baseline")
    if base:
        lines.append(
            f"**Baseline** (margin {fmt(base['margin_db'])} dB): "
            + ("no regression." if base["passed"] else f"{len(base['regressions'])} regression(s).")
        )
    grads = data.get("gradients")
    if grads:
        u = grads.get("underflow", {})
        lines.append(
            f"**Gradients** ({_cell(grads['loss'])}): min SQNR {fmt(grads['min_sqnr_db'])} dB; "
            f"{fmt(100 * u.get('underflow_unscaled', 0.0), 3)} % underflow in {_cell(u.get('dtype'))} unscaled; "
            f"recommended: {_cell(u.get('advice') or 'loss scale ' + str(_fmt(u.get('recommended_loss_scale'))))}; "
            f"{fmt(grads['parameters'])} parameters compared, {len(grads.get('missing_gradients') or [])} missing."
        )
    if data.get("training"):
        lines += training_markdown(data["training"])
    gold = data.get("golden")
    if gold:
        lines.append(f"**Golden:** {_code(gold['path'])} (created {_cell(gold.get('created'))}).")
    return "\n".join(lines).rstrip() + "\n"
