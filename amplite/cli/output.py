"""What the CLI prints: summary, plan and check tables (rich), kept apart from argument parsing."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
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


#: The terminal's marks for a section's summary line (the fields of amplite.report.format.Style): one wording
#: of each section's line, shared with report.md and report.html.
TERMINAL = SimpleNamespace(text=lambda s: escape(str(s)), code=lambda s: escape(str(s)),
                           strong=lambda s: f"[bold]{s}[/]", num=lambda v, digits=4: escape(_num(v, digits)))


def _num(v: Any, digits: int = 4) -> str:
    return "–" if v is None else (v if isinstance(v, str) else f"{v:.{digits}g}")


def _section(report: Any, key: str) -> Any:
    """The typed section ``key`` of a report (None when absent); the CLI reads its fields."""
    return report.sections.get(key)


def _nonfinite(o: Any) -> str:
    """The NaN/Inf count of an output row: the converted output's, and the reference's when it has any."""
    text = str(o.out_nonfinite or 0)
    return text + (f" (ref {o.ref_nonfinite})" if o.ref_nonfinite else "")


def _metric(o: Any, key: str, spec: str) -> str:
    """A metric cell; marked † when computed on the finite part only."""
    v = getattr(o, key)
    cell = v if isinstance(v, str) else format(v, spec)
    return cell + ("†" if o.partial else "")


def _footnote(rows: Any) -> None:
    for o in rows:
        if o.partial:
            out.print(f"† {escape(str(o.name))}: metrics on the finite part only ({o.compared} of {o.elements} "
                      f"elements; {o.elements - o.compared} NaN/Inf)")  # fmt: skip


def fp8_line(fp8: Any) -> str:
    """An FP8 checkpoint's layout, scales and size against bf16 (``fp8_checkpoint`` section)."""
    calib = fp8.calibration
    scales = (f"static input scales from {calib['batches']} calibration batches ({calib['tokens']} tokens)" if calib
              else "dynamic activation scales")  # fmt: skip
    return (f"fp8: {fp8.fp8_linears} linear weights in float8_e4m3fn (per-tensor weight_scale), {scales}; bf16: "
            f"{', '.join(fp8.ignored_layers or [])}; size {fp8.bytes / 2**20:.2f} MiB = {fp8.size_vs_bf16:.3f}x "
            f"the bf16 checkpoint ({fp8.bf16_bytes / 2**20:.2f} MiB)")


def _common_lines(report: Any) -> None:
    """The lines ``convert`` and ``check`` both print: FP8 checkpoint, generation check, budget, gradients."""
    if (fp8 := _section(report, "fp8_checkpoint")) is not None:
        out.print(escape(fp8_line(fp8)))
    llm = _section(report, "llm")
    if llm is not None and llm.checks:
        for line in generation_lines(llm):
            out.print(escape(line))
    if (budget := _section(report, "budget")) is not None:
        out.print(budget.summary(TERMINAL, names=8))
    if (grads := _section(report, "gradients")) is not None:
        out.print(grads.summary(TERMINAL))


def print_check(res: Any) -> None:
    """The verdict of ``check``: per-output metrics, top error-introducing nodes, failure reasons, files."""
    report = res.report
    table = Table(title=f"amplite check: {'[green]PASS[/]' if res.exit_code == 0 else '[red]FAIL[/]'}")
    for col in ("output", "NaN/Inf", "SQNR dB", "max abs", "cosine", "result"):
        table.add_column(col)
    rows = report.verified_outputs
    for o in rows:
        table.add_row(escape(str(o.name)), _nonfinite(o), _metric(o, "sqnr_db", ".1f"), _metric(o, "max_abs", ".3g"),
                      _metric(o, "cosine", ".6f"), "pass" if o.passed else "FAIL")  # fmt: skip
    out.print(table)
    _footnote(rows)
    lw = _section(report, "layerwise")
    top = list((lw.top_introducers or ()) if lw is not None else ())
    if top:
        out.print("top error-introducing nodes (isolated error, fed FP32 inputs):")
    for i, n in enumerate(top[:5], 1):
        flag = " introduces NaN/Inf" if n.introduces_nonfinite else ""
        out.print(escape(f"  {i}. {n.node} ({n.op}) {n.source or n.module or ''}{flag}"))
    for d in (lw.decisions or ()) if lw is not None else ():
        out.print(escape(f"decision {d.node} ({d.op}): {d.agreement:.2%} of {d.elements} indices agree with FP32"))
    _common_lines(report)
    train = _section(report, "training")
    if train is not None:
        out.print(f"training: {train.steps} steps, {train.precision} {train.level}: max loss gap "
                  f"{train.max_gap:.3g} (limit {train.gap_limit:g}), "
                  f"{len(train.skipped_steps or [])} skipped steps" if train.max_gap != "inf" else
                  f"training: {train.steps} steps: the amplite loss is not finite")  # fmt: skip
    for reason in res.reasons:
        out.print(f"[red]✗[/] {escape(str(reason))}")
    for kind, path in res.files.items():
        out.print(escape(f"{kind}: {path}"))


def generation_lines(g: Any) -> list[str]:
    """The generation check (``llm`` section): agreement, first divergence, perplexities, each criterion."""
    fmt = lambda v: v if isinstance(v, str) else f"{v:.4g}"  # noqa: E731
    delta = g.ppl_delta if isinstance(g.ppl_delta, str) else f"{g.ppl_delta:.3%}"
    first = ", ".join("none" if d is None else str(d) for d in g.first_divergence or [])
    lines = [f"generation vs FP32 ({g.prompts} prompts x {g.steps} greedy steps, teacher-forced): token "
             f"agreement {g.token_agreement:.2%} ({g.agreeing_tokens}/{g.prompts * g.steps}), first "
             f"divergence per prompt [{first}]; perplexity {fmt(g.ppl_fp32)} -> {fmt(g.ppl_converted)} "
             f"(delta {delta}, {g.ppl_tokens} tokens)"]  # fmt: skip
    for c in g.checks or ():
        lines.append(f"  {c.criterion}: {'pass' if c.passed else 'FAIL'} (got {fmt(c.value)})")
    return lines


def print_plan(report: Any, only: str | None) -> None:
    """The plan table of ``inspect`` (tab-separated lines when stdout is not a terminal, for grep/cut)."""
    rows = [r for r in report.planned if not only or r.mode == only]
    after = _section(report, "graph").after
    footer = f"nodes by dtype: {dict(after.nodes_by_dtype or {})}  casts: {after.casts}"
    if not out.is_terminal:
        print("node\top\tmodule\tdtype\treason")
        for r in rows:
            print("\t".join(safe.tsv(v) for v in (r.node, r.op, r.module, r.dtype or "-", r.reason)))
        print(safe.terminal(footer))
        return
    cfg = _section(report, "config")
    table = Table(title=f"precision plan ({cfg.precision}, {cfg.level})")
    for col in ("node", "op", "module", "dtype", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(*(escape(str(v)) for v in (r.node, r.op, r.module, r.dtype or "-", r.reason)))
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


def _worst_sqnr(section: Any) -> str:
    worst = min((o.sqnr_db for o in section.outputs or () if not isinstance(o.sqnr_db, str)), default=None)
    return f", worst SQNR {worst:.1f} dB" if worst is not None else ""


def print_summary(report: Any, written: list[Path], report_path: Path) -> None:
    """The short summary ``convert`` prints."""
    cfg, graph, weights = _section(report, "config"), _section(report, "graph").after, _section(report, "weights")
    source = _section(report, "source")
    table = Table(title=escape(f"amplite {cfg.precision} {cfg.level}: {source.path or 'module'}"))
    table.add_column("what")
    table.add_column("value", overflow="fold")
    table.add_row("nodes by dtype", ", ".join(f"{k} {v}" for k, v in (graph.nodes_by_dtype or {}).items()))
    table.add_row("casts in graph", str(graph.casts))
    table.add_row("low-precision FLOP share", f"{graph.low_precision_flop_share:.1%}")
    table.add_row("FP32 islands", str(len(_section(report, "fp32_nodes") or ())))
    table.add_row("weights", f"{weights.bytes_before / 1e6:.2f} MB → {weights.bytes_after / 1e6:.2f} MB "
                             f"({weights.ratio:.2f}×)")  # fmt: skip
    table.add_row("time (s)", ", ".join(f"{k} {v:.2f}" for k, v in _section(report, "timings").values.items()))
    out.print(table)
    verification = _section(report, "verification")
    if verification is not None:
        vt = Table(title="verification against FP32 (example inputs)")
        for col in ("output", "NaN/Inf", "max abs", "max rel", "cosine", "SQNR dB", "result"):
            vt.add_column(col)
        for o in verification.outputs or ():
            verdict = "[green]pass[/]" if o.passed else "[red]FAIL[/] " + escape("; ".join(o.notes or []))
            vt.add_row(escape(str(o.name)), _nonfinite(o), _metric(o, "max_abs", ".3g"), _metric(o, "max_rel", ".3g"),
                       _metric(o, "cosine", ".6f"), _metric(o, "sqnr_db", ".1f"), verdict)  # fmt: skip
        out.print(vt)
        _footnote(verification.outputs or ())
        blocks = verification.blocks or ()
        if blocks:
            worst = min(blocks, key=lambda b: b.sqnr_db)
            peak = verification.peak_weight_bytes or 0
            out.print(escape(f"block-wise: {len(blocks)} blocks compared, worst SQNR {worst.sqnr_db:.1f} dB "
                             f"({worst.block}); at most {peak / 2**20:.1f} MiB of weights held at once"))  # fmt: skip
    _common_lines(report)
    ort = _section(report, "verification_onnx")
    if ort is not None:
        verdict = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "not runnable"}[ort.passed]
        out.print(f"ONNX Runtime ({escape(str(ort.provider))}): {verdict}{_worst_sqnr(ort)}")
        for line in [ort.not_runnable, ort.caveat]:
            if line:
                out.print(f"  {escape(line)}")
    aoti = _section(report, "verification_aoti")
    if aoti is not None:
        verdict = "[green]pass[/]" if aoti.passed else "[red]FAIL[/]"
        out.print(f"AOTInductor package ({escape(str(aoti.device))}): {verdict}{_worst_sqnr(aoti)}")
    if (est := _section(report, "estimate")) is not None:
        from amplite.estimate import summary_line

        out.print(escape(summary_line(est.to_json())))
    for w in _section(report, "warnings") or ():
        out.print(f"[yellow]warning:[/] {escape(w)}")
    for path in written:
        out.print(escape(f"wrote {path}"))
    out.print(escape(f"report {report_path}"))
