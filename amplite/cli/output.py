"""What the CLI prints: summary, plan and check tables (rich), kept apart from argument parsing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

# soft_wrap: never break a line (paths, node lists) at the console width; CI logs and
# pipes are 80 columns wide and users copy paths from them. Tables still fit the width.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def print_check(res: Any) -> None:
    """The verdict of ``check``: per-output metrics, top error-introducing nodes, failure reasons, files."""
    data = res.report.data
    verification = data.get("verification", {})
    table = Table(title=f"amplite check: {'[green]PASS[/]' if res.exit_code == 0 else '[red]FAIL[/]'}")
    for col in ("output", "SQNR dB", "max abs", "cosine", "result"):
        table.add_column(col)
    for o in verification.get("outputs", []):
        sqnr = o["sqnr_db"] if isinstance(o["sqnr_db"], str) else f"{o['sqnr_db']:.1f}"
        table.add_row(o["name"], sqnr, f"{o['max_abs']:.3g}", f"{o['cosine']:.6f}", "pass" if o["passed"] else "FAIL")
    out.print(table)
    top = (data.get("layerwise") or {}).get("top_introducers") or []
    if top:
        out.print("top error-introducing nodes (isolated error, fed FP32 inputs):")
    for i, n in enumerate(top[:5], 1):
        flag = " introduces NaN/Inf" if n.get("introduces_nonfinite") else ""
        out.print(f"  {i}. {n['node']} ({n['op']}) {n.get('source') or n.get('module') or ''}{flag}")
    train = data.get("training")
    if train:
        out.print(f"training: {train['steps']} steps, {train['precision']} {train['level']}: max loss gap "
                  f"{train['max_gap']:.3g} (limit {train['tolerance']['train_loss_gap']:g}), "
                  f"{len(train['skipped_steps'])} skipped steps" if train["max_gap"] != "inf" else
                  f"training: {train['steps']} steps: the amplite loss is not finite")  # fmt: skip
    for reason in res.reasons:
        out.print(f"[red]✗[/] {reason}")
    for kind, path in res.files.items():
        out.print(f"{kind}: {path}")


def print_plan(data: dict[str, Any], only: str | None) -> None:
    """The plan table of ``inspect`` (tab-separated lines when stdout is not a terminal, for grep/cut)."""
    rows = [r for r in data["plan"] if not only or r["mode"] == only]
    after = data["graph"]["after"]
    footer = f"nodes by dtype: {after['nodes_by_dtype']}  casts: {after['casts']}"
    if not out.is_terminal:
        print("node\top\tmodule\tdtype\treason")
        for r in rows:
            print(f"{r['node']}\t{r['op']}\t{r['module']}\t{r['dtype'] or '-'}\t{r['reason']}")
        print(footer)
        return
    table = Table(title=f"precision plan ({data['config']['precision']}, {data['config']['level']})")
    for col in ("node", "op", "module", "dtype", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["node"], r["op"], r["module"], r["dtype"] or "-", r["reason"])
    out.print(table)
    out.print(footer)


def print_summary(data: dict[str, Any], written: list[Path], report_path: Path) -> None:
    """The short summary ``convert`` prints."""
    cfg, graph, weights = data["config"], data["graph"]["after"], data["weights"]
    table = Table(title=f"amplite {cfg['precision']} {cfg['level']}: {data['source']['path'] or 'module'}")
    table.add_column("what")
    table.add_column("value", overflow="fold")
    table.add_row("nodes by dtype", ", ".join(f"{k} {v}" for k, v in graph["nodes_by_dtype"].items()))
    table.add_row("casts in graph", str(graph["casts"]))
    table.add_row("low-precision FLOP share", f"{graph['low_precision_flop_share']:.1%}")
    table.add_row("FP32 islands", str(len(data["fp32_nodes"])))
    table.add_row(
        "weights",
        f"{weights['bytes_before'] / 1e6:.2f} MB → {weights['bytes_after'] / 1e6:.2f} MB ({weights['ratio']:.2f}×)",
    )
    t = data["timings"]
    table.add_row("time (s)", ", ".join(f"{k} {v:.2f}" for k, v in t.items()))
    out.print(table)
    verification = data.get("verification")
    if verification:
        vt = Table(title="verification against FP32 (example inputs)")
        for col in ("output", "max abs", "max rel", "cosine", "SQNR dB", "result"):
            vt.add_column(col)
        for o in verification["outputs"]:
            sqnr = o["sqnr_db"] if isinstance(o["sqnr_db"], str) else f"{o['sqnr_db']:.1f}"
            verdict = "[green]pass[/]" if o["passed"] else "[red]FAIL[/] " + "; ".join(o["notes"])
            vt.add_row(o["name"], f"{o['max_abs']:.3g}", f"{o['max_rel']:.3g}", f"{o['cosine']:.6f}", sqnr, verdict)
        out.print(vt)
    budget = data.get("budget")
    if budget:
        verdict = "[green]met[/]" if budget["passed"] else "[red]NOT met[/]"
        moved = ", ".join(n["node"] for n in budget["moved_to_fp32"][:8])
        more = f" (+{len(budget['moved_to_fp32']) - 8} more)" if len(budget["moved_to_fp32"]) > 8 else ""
        out.print(
            f"accuracy budget {verdict}: {len(budget['moved_to_fp32'])} of {budget['candidates']} candidate nodes "
            f"moved to FP32 in {budget['trials']} trials (bound {budget['trial_bound']}): {moved}{more}"
        )
        if budget["message"]:
            out.print(f"  {budget['message']}")
    ort = data.get("verification_onnx")
    if ort:
        verdict = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "not runnable"}[ort["passed"]]
        worst = min((o["sqnr_db"] for o in ort["outputs"] if not isinstance(o["sqnr_db"], str)), default=None)
        detail = f", worst SQNR {worst:.1f} dB" if worst is not None else ""
        out.print(f"ONNX Runtime ({ort['provider']}): {verdict}{detail}")
        for line in [ort.get("not_runnable"), ort.get("caveat")]:
            if line:
                out.print(f"  {line}")
    for w in data.get("warnings", []):
        out.print(f"[yellow]warning:[/] {w}")
    for path in written:
        out.print(f"wrote {path}")
    out.print(f"report {report_path}")
