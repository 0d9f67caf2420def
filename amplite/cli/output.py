"""What the CLI prints: summary, plan and check tables (rich), kept apart from argument parsing."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from amplite import escape as safe

# Every user-, model- or file-derived string printed through rich goes through escape(): rich reads
# `[[model]]` or `[defaults]` as markup and would drop it.
# soft_wrap: never break a line (paths, node lists) at the console width; CI logs and
# pipes are 80 columns wide and users copy paths from them. Tables still fit the width.
# Both show control characters from names as text (amplite.escape.console): no hidden links or erased lines.
out = safe.console(highlight=False, soft_wrap=True)
err = safe.console(stderr=True, highlight=False, soft_wrap=True)


@contextmanager
def summary_to_stderr(on: bool) -> Iterator[None]:
    """Print the human summary to stderr meanwhile, when a file is written to stdout (``--report -``)."""
    if not on:
        yield
        return
    out.file = sys.stderr
    try:
        yield
    finally:
        out.file = None  # type: ignore[assignment]  # rich: None is sys.stdout, looked up when printing


def _nonfinite(o: dict[str, Any]) -> str:
    """The NaN/Inf count of an output row: the converted output's, and the reference's when it has any."""
    text = str(o.get("out_nonfinite", 0))
    return text + (f" (ref {o['ref_nonfinite']})" if o.get("ref_nonfinite") else "")


def _partial(o: dict[str, Any]) -> bool:
    """Whether the float metrics were computed on the finite part only."""
    return o.get("compared", 0) < o.get("elements", 0)


def _metric(o: dict[str, Any], key: str, spec: str) -> str:
    """A metric cell; marked † when computed on the finite part only."""
    v = o[key]
    cell = v if isinstance(v, str) else format(v, spec)
    return cell + ("†" if _partial(o) else "")


def _footnote(rows: list[dict[str, Any]]) -> None:
    for o in rows:
        if _partial(o):
            out.print(f"† {o['name']}: metrics on the finite part only ({o['compared']} of {o['elements']} "
                      f"elements; {o['elements'] - o['compared']} NaN/Inf)")  # fmt: skip


def fp8_line(fp8: dict[str, Any]) -> str:
    """An FP8 checkpoint's layout, scales and size against bf16 (``fp8_checkpoint`` section)."""
    calib = fp8.get("calibration")
    scales = (f"static input scales from {calib['batches']} calibration batches ({calib['tokens']} tokens)" if calib
              else "dynamic activation scales")  # fmt: skip
    return (f"fp8: {fp8['fp8_linears']} linear weights in float8_e4m3fn (per-tensor weight_scale), {scales}; bf16: "
            f"{', '.join(fp8['ignored_layers'])}; size {fp8['bytes'] / 2**20:.2f} MiB = {fp8['size_vs_bf16']:.3f}x "
            f"the bf16 checkpoint ({fp8['bf16_bytes'] / 2**20:.2f} MiB)")


def print_check(res: Any) -> None:
    """The verdict of ``check``: per-output metrics, top error-introducing nodes, failure reasons, files."""
    data = res.report.data
    verification = data.get("verification", {})
    table = Table(title=f"amplite check: {'[green]PASS[/]' if res.exit_code == 0 else '[red]FAIL[/]'}")
    for col in ("output", "NaN/Inf", "SQNR dB", "max abs", "cosine", "result"):
        table.add_column(col)
    rows = verification.get("outputs", [])
    for o in rows:
        table.add_row(escape(o["name"]), _nonfinite(o), _metric(o, "sqnr_db", ".1f"), _metric(o, "max_abs", ".3g"),
                      _metric(o, "cosine", ".6f"), "pass" if o["passed"] else "FAIL")  # fmt: skip
    out.print(table)
    _footnote(rows)
    top = (data.get("layerwise") or {}).get("top_introducers") or []
    if top:
        out.print("top error-introducing nodes (isolated error, fed FP32 inputs):")
    for i, n in enumerate(top[:5], 1):
        flag = " introduces NaN/Inf" if n.get("introduces_nonfinite") else ""
        out.print(escape(f"  {i}. {n['node']} ({n['op']}) {n.get('source') or n.get('module') or ''}{flag}"))
    if data.get("fp8_checkpoint"):
        out.print(escape(fp8_line(data["fp8_checkpoint"])))
    for d in (data.get("layerwise") or {}).get("decisions") or []:
        out.print(escape(f"decision {d['node']} ({d['op']}): {d['agreement']:.2%} of {d['elements']} indices "
                         "agree with FP32"))
    if data.get("llm", {}).get("checks"):
        for line in generation_lines(data["llm"]):
            out.print(escape(line))
    grads = data.get("gradients")
    if grads:
        out.print(escape(gradient_line(grads)))
    train = data.get("training")
    if train:
        out.print(f"training: {train['steps']} steps, {train['precision']} {train['level']}: max loss gap "
                  f"{train['max_gap']:.3g} (limit {train['tolerance']['train_loss_gap']:g}), "
                  f"{len(train['skipped_steps'])} skipped steps" if train["max_gap"] != "inf" else
                  f"training: {train['steps']} steps: the amplite loss is not finite")  # fmt: skip
    for reason in res.reasons:
        out.print(f"[red]✗[/] {escape(str(reason))}")
    for kind, path in res.files.items():
        out.print(escape(f"{kind}: {path}"))


def generation_lines(g: dict[str, Any]) -> list[str]:
    """The generation check (``llm`` section): agreement, first divergence, perplexities, each criterion."""
    fmt = lambda v: v if isinstance(v, str) else f"{v:.4g}"  # noqa: E731
    delta = g["ppl_delta"] if isinstance(g["ppl_delta"], str) else f"{g['ppl_delta']:.3%}"
    first = ", ".join("none" if d is None else str(d) for d in g["first_divergence"])
    lines = [f"generation vs FP32 ({g['prompts']} prompts x {g['steps']} greedy steps, teacher-forced): token "
             f"agreement {g['token_agreement']:.2%} ({g['agreeing_tokens']}/{g['prompts'] * g['steps']}), first "
             f"divergence per prompt [{first}]; perplexity {fmt(g['ppl_fp32'])} -> {fmt(g['ppl_converted'])} "
             f"(delta {delta}, {g['ppl_tokens']} tokens)"]  # fmt: skip
    for c in g["checks"]:
        lines.append(f"  {c['criterion']}: {'pass' if c['passed'] else 'FAIL'} (got {fmt(c['value'])})")
    return lines


def gradient_line(g: dict[str, Any]) -> str:
    """One line on the gradient check: what was compared, how well, and the loss-scale advice."""
    fmt = lambda v: v if isinstance(v, str) else f"{v:.1f}"  # noqa: E731
    u = g.get("underflow", {})
    advice = f"; recommended: {u['advice']}" if u.get("advice") else ""
    missing = len(g.get("missing_gradients") or [])
    return (f"gradients ({g['loss']}, {g.get('graph', 'as converted')}): {g['parameters']} parameters compared"
            f"{f', {missing} MISSING' if missing else ''}; min SQNR {fmt(g['min_sqnr_db'])} dB, median "
            f"{fmt(g['median_sqnr_db']) if g.get('median_sqnr_db') is not None else '-'} dB; "
            f"underflow {u.get('underflow_unscaled', 0):.2%} unscaled{advice}")  # fmt: skip


def print_plan(data: dict[str, Any], only: str | None) -> None:
    """The plan table of ``inspect`` (tab-separated lines when stdout is not a terminal, for grep/cut)."""
    rows = [r for r in data["plan"] if not only or r["mode"] == only]
    after = data["graph"]["after"]
    footer = f"nodes by dtype: {after['nodes_by_dtype']}  casts: {after['casts']}"
    if not out.is_terminal:
        print("node\top\tmodule\tdtype\treason")
        for r in rows:
            print("\t".join(safe.tsv(v) for v in (r["node"], r["op"], r["module"], r["dtype"] or "-", r["reason"])))
        print(safe.terminal(footer))
        return
    table = Table(title=f"precision plan ({data['config']['precision']}, {data['config']['level']})")
    for col in ("node", "op", "module", "dtype", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(*(escape(str(v)) for v in (r["node"], r["op"], r["module"], r["dtype"] or "-", r["reason"])))
    out.print(table)
    out.print(escape(footer))


@contextmanager
def byte_progress() -> Iterator[Callable[[str, int, int], None]]:
    """A ``(step, bytes done, bytes total)`` callback drawing one progress bar per step (bytes and ETA)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                    console=err, transient=True)  # fmt: skip
    tasks: dict[str, Any] = {}

    def update(step: str, done: int, total: int) -> None:
        if not tasks:
            bars.start()  # only when there is something to show: no stray output otherwise
        if step not in tasks:
            tasks[step] = bars.add_task(step, total=total)
        bars.update(tasks[step], completed=done)

    try:
        yield update
    finally:
        if tasks:
            bars.stop()


def print_summary(data: dict[str, Any], written: list[Path], report_path: Path) -> None:
    """The short summary ``convert`` prints."""
    cfg, graph, weights = data["config"], data["graph"]["after"], data["weights"]
    table = Table(title=escape(f"amplite {cfg['precision']} {cfg['level']}: {data['source']['path'] or 'module'}"))
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
        for col in ("output", "NaN/Inf", "max abs", "max rel", "cosine", "SQNR dB", "result"):
            vt.add_column(col)
        for o in verification["outputs"]:
            verdict = "[green]pass[/]" if o["passed"] else "[red]FAIL[/] " + escape("; ".join(o["notes"]))
            vt.add_row(escape(o["name"]), _nonfinite(o), _metric(o, "max_abs", ".3g"), _metric(o, "max_rel", ".3g"),
                       _metric(o, "cosine", ".6f"), _metric(o, "sqnr_db", ".1f"), verdict)  # fmt: skip
        out.print(vt)
        _footnote(verification["outputs"])
        blocks = verification.get("blocks") or []
        if blocks:
            worst = min(blocks, key=lambda b: b["sqnr_db"])
            out.print(escape(f"block-wise: {len(blocks)} blocks compared, worst SQNR {worst['sqnr_db']:.1f} dB "
                             f"({worst['block']}); at most {verification['peak_weight_bytes'] / 2**20:.1f} MiB "
                             "of weights held at once"))  # fmt: skip
    if data.get("fp8_checkpoint"):
        out.print(escape(fp8_line(data["fp8_checkpoint"])))
    if data.get("llm", {}).get("checks"):
        for line in generation_lines(data["llm"]):
            out.print(escape(line))
    budget = data.get("budget")
    if budget:
        verdict = "[green]met[/]" if budget["passed"] else "[red]NOT met[/]"
        moved = escape(", ".join(n["node"] for n in budget["moved_to_fp32"][:8]))
        more = f" (+{len(budget['moved_to_fp32']) - 8} more)" if len(budget["moved_to_fp32"]) > 8 else ""
        out.print(
            f"accuracy budget {verdict}: {len(budget['moved_to_fp32'])} of {budget['candidates']} candidate nodes "
            f"moved {_moved_to(budget)} in {budget['trials']} trials (bound {budget['trial_bound']}): {moved}{more}"
        )
        if budget["message"]:
            out.print(f"  {escape(budget['message'])}")
    ort = data.get("verification_onnx")
    if ort:
        verdict = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "not runnable"}[ort["passed"]]
        worst = min((o["sqnr_db"] for o in ort["outputs"] if not isinstance(o["sqnr_db"], str)), default=None)
        detail = f", worst SQNR {worst:.1f} dB" if worst is not None else ""
        out.print(f"ONNX Runtime ({ort['provider']}): {verdict}{detail}")
        for line in [ort.get("not_runnable"), ort.get("caveat")]:
            if line:
                out.print(f"  {escape(line)}")
    aoti = data.get("verification_aoti")
    if aoti:
        verdict = "[green]pass[/]" if aoti["passed"] else "[red]FAIL[/]"
        worst = min((o["sqnr_db"] for o in aoti["outputs"] if not isinstance(o["sqnr_db"], str)), default=None)
        detail = f", worst SQNR {worst:.1f} dB" if worst is not None else ""
        out.print(f"AOTInductor package ({escape(aoti['device'])}): {verdict}{detail}")
    if data.get("estimate"):
        from amplite.estimate import summary_line

        out.print(escape(summary_line(data["estimate"])))
    for w in data.get("warnings", []):
        out.print(f"[yellow]warning:[/] {escape(w)}")
    for path in written:
        out.print(escape(f"wrote {path}"))
    out.print(escape(f"report {report_path}"))


def _moved_to(budget: dict[str, Any]) -> str:
    """Where the search moved nodes: FP8 products go back to bf16, other low nodes to FP32."""
    to = {m.get("to", "float32") for m in budget["moved_to_fp32"]}
    if "bfloat16" not in to:
        return "to FP32"
    return "from FP8 to bf16" if to == {"bfloat16"} else "to bf16 (FP8) / FP32"
