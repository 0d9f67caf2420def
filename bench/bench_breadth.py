"""Breadth sweep: does every architecture torch.export can trace convert, at every precision and level?

Usage: ``python bench/bench_breadth.py [--only llama,bert] [--json bench/results-breadth.json] [--docs docs/models.md]``

For each architecture of ``bench.breadth_corpus`` (tiny config, random weights, CPU): whether
``torch.export.export(strict=False)`` traces it (if not, torch's reason; the row is not counted against
amplite), then ``amplite.convert`` at fp16 O1, bf16 O1, fp16 O2 and bf16 O2: converted (or the one-line
error, marked ``RAW`` when an exception escaped that is not amplite's own), amplite's verification verdict,
NaN/Inf in the output, and the SQNR of the first output against FP32 on the example inputs — next to the
SQNR of ``torch.autocast`` (CPU, same dtype) on the same inputs. ``--only`` re-measures some
architectures and merges them into an existing JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import warnings
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import amplite
from amplite.describe import summarize_exception
from amplite.errors import AmpliteError
from bench.autocast_count import accuracy, first_tensor, run
from bench.breadth_corpus import ARCHS, BY_NAME, Arch

CONFIGS = [("fp16", "O1"), ("bf16", "O1"), ("fp16", "O2"), ("bf16", "O2")]
MARGIN_DB = 0.5  # O1 must reach torch.autocast's SQNR minus this
TIMEOUT_S = 900


@contextlib.contextmanager
def _deadline(seconds: int) -> Any:
    def stop(*_: Any) -> None:
        raise TimeoutError(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _db(v: float | None) -> float | None:
    return None if v is None else (v if math.isfinite(v) else (999.0 if v > 0 else -999.0))


def other_draws(inputs: Any, draws: int) -> list[Any]:
    """``draws - 1`` more inputs like ``inputs``: every floating tensor redrawn from N(0, 1), seeds 1, 2, ...

    Integer inputs (token ids, masks) are kept: the zoo's inputs are images.
    """
    out = []
    for seed in range(1, draws):
        gen = torch.Generator().manual_seed(seed)

        def redraw(t: Any, g: torch.Generator = gen) -> Any:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return torch.randn(t.shape, generator=g, dtype=t.dtype)
            return t

        out.append(torch.utils._pytree.tree_map(redraw, inputs))
    return out


def pooled_sqnr(pairs: list[tuple[Any, Any]]) -> float | None:
    """SQNR (dB) of the first outputs pooled over draws: 10·log10(Σ‖ref‖² / Σ‖ref − out‖²), finite values only."""
    signal_sq = noise_sq = 0.0
    for reference, output in pairs:
        ref, out = first_tensor(reference).detach().double(), first_tensor(output).detach().double()
        if ref.shape != out.shape:
            return None
        mask = torch.isfinite(ref) & torch.isfinite(out)
        signal_sq += float(ref[mask].square().sum())
        noise_sq += float((ref[mask] - out[mask]).square().sum())
    return _db(math.inf if noise_sq == 0 else 10 * math.log10(signal_sq / noise_sq) if signal_sq > 0 else -math.inf)


def convert_one(model: torch.nn.Module, inputs: Any, ref: Any, precision: str, level: str,
                extra: list[tuple[Any, Any]] | None = None) -> dict[str, Any]:
    """One conversion: converted?, verified?, finite?, SQNR against FP32, seconds, FP32-kept reasons.

    ``extra``: more ``(inputs, FP32 outputs)`` draws; the SQNR pooled over the example and these is
    ``pooled_sqnr_db``.
    """  # fmt: skip
    start = perf_counter()
    try:
        result = amplite.convert(model, inputs, precision=precision, level=level)
    except AmpliteError as exc:
        return {"converted": False, "error": f"{type(exc).__name__}: {exc.one_line()}"[:400]}
    except Exception as exc:  # an exception that is not amplite's own is a bug to fix: say so
        return {"converted": False, "error": f"RAW {summarize_exception(exc)}"[:400]}
    module = result.program.module()
    out = run(module, inputs)
    acc = accuracy(ref, out, logits=False)
    pooled = pooled_sqnr([(ref, out)] + [(r, run(module, i)) for i, r in extra]) if extra else None
    reasons: dict[str, int] = {}
    for e in result.report.data["plan"]:
        if e["dtype"] == "float32" and e["reason"].startswith("range:"):
            key = e["reason"].split(" ")[0]
            reasons[key] = reasons.get(key, 0) + 1
    saturated = sum(p["counters"].get("fills_saturated", 0) for p in result.report.data["passes"])
    return {
        "converted": True,
        "passed": bool(result.passed),
        "finite": acc["nonfinite"] == 0,
        "sqnr_db": _db(acc.get("sqnr_db")),
        "seconds": round(perf_counter() - start, 2),
        "range_fp32": reasons,
        "fills_saturated": saturated,
    } | ({"pooled_sqnr_db": pooled, "draws": 1 + len(extra)} if extra else {})


def measure(arch: Arch, draws: int = 1) -> dict[str, Any]:
    """Every column of one architecture's row.

    With ``draws > 1`` the O1 cells and autocast also get the SQNR pooled over the example input and
    ``draws - 1`` more input draws (:func:`other_draws`), and the O1 criterion is judged on those.
    """
    row: dict[str, Any] = {"name": arch.name, "family": arch.family}
    model, inputs = arch.build()
    ref = run(model, inputs)
    args, kwargs = inputs
    try:
        torch.export.export(model, args, kwargs, strict=False)
        row["exportable"] = True
    except Exception as exc:
        row.update(exportable=False, export_error=summarize_exception(exc)[:400])
        return row
    extra = [(i, run(model, i)) for i in other_draws(inputs, draws)]
    for precision in ("fp16", "bf16"):
        try:
            out = run(model, inputs, autocast=precision)
            acc = accuracy(ref, out, logits=False)
            row[f"autocast_{precision}"] = {"finite": acc["nonfinite"] == 0, "sqnr_db": _db(acc.get("sqnr_db"))}
            if extra:
                row[f"autocast_{precision}"]["pooled_sqnr_db"] = pooled_sqnr(
                    [(ref, out)] + [(r, run(model, i, autocast=precision)) for i, r in extra])
        except Exception as exc:
            row[f"autocast_{precision}"] = {"error": summarize_exception(exc)[:200]}
    for precision, level in CONFIGS:
        row[f"{precision}-{level}"] = convert_one(model, inputs, ref, precision, level,
                                                 extra if level == "O1" else None)
    return row


def verdict(row: dict[str, Any]) -> list[str]:
    """What the row misses of the done criteria (empty: all met)."""
    if not row.get("exportable"):
        return []
    missed = []
    for precision, level in CONFIGS:
        cell = row.get(f"{precision}-{level}", {})
        if not cell.get("converted"):
            missed.append(f"{precision} {level} not converted")
        elif not cell["finite"]:
            missed.append(f"{precision} {level} NaN/Inf")
        elif level == "O1":
            auto = row.get(f"autocast_{precision}", {})
            # judged over every input draw measured (pooled SQNR) where there are several, else the example
            key = "pooled_sqnr_db" if "pooled_sqnr_db" in cell and auto.get("pooled_sqnr_db") is not None else "sqnr_db"
            ac, mine = auto.get(key), cell[key]
            what = f" over {cell['draws']} input draws" if key == "pooled_sqnr_db" else ""
            if ac is not None and mine < ac - MARGIN_DB:
                missed.append(f"{precision} O1 {mine:.1f} dB < autocast {ac:.1f} dB − {MARGIN_DB}{what}")
    return missed


def _cell(cell: dict[str, Any], autocast: dict[str, Any] | None = None) -> str:
    if not cell:
        return "–"
    if not cell.get("converted"):
        return "✗ " + cell.get("error", "")[:60].replace("|", "/")
    text = f"{'✓' if cell['passed'] else '✗v'} {cell['sqnr_db']:.1f}" + ("" if cell["finite"] else " NaN/Inf")
    if autocast is not None and autocast.get("sqnr_db") is not None:
        text += f" ({autocast['sqnr_db']:.1f}{'' if autocast['finite'] else ' NaN/Inf'})"
    elif autocast is not None and autocast.get("error"):
        text += " (autocast fails¹)"
    if autocast is not None and cell.get("pooled_sqnr_db") is not None and autocast.get("pooled_sqnr_db") is not None:
        text += f"; {cell['draws']} draws {cell['pooled_sqnr_db']:.1f} ({autocast['pooled_sqnr_db']:.1f})"
    return text


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table of ``docs/models.md``."""
    exportable = [r for r in rows if r.get("exportable")]
    clean = [r for r in exportable if not verdict(r)]
    lines = [
        f"{len(rows)} architectures; {len(exportable)} exportable by torch.export; {len(clean)} of those meet every "
        f"criterion (converted at all four configurations, no NaN/Inf, O1 SQNR ≥ autocast − {MARGIN_DB} dB; "
        "where several input draws were measured, on the SQNR pooled over them).",
        "",
        "Cells: ✓ amplite's verification passed (✗v: converted, verification failed), then the SQNR (dB) of the "
        "first output against FP32; at O1 torch.autocast's SQNR (CPU, same dtype, same inputs) in brackets; "
        "then, where measured, both pooled over N input draws (the example and N − 1 more drawn from N(0, 1): "
        "10·log10 of the summed squares), which the O1 criterion is judged on. 999 = bit-identical.",
        "",
        "| architecture | family | fp16 O1 (autocast) | bf16 O1 (autocast) | fp16 O2 | bf16 O2 "
        "| kept FP32 by range rules (fp16 O1) | missed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("exportable"):
            continue
        o1 = r.get("fp16-O1", {})
        kept = ", ".join(f"{k} {v}" for k, v in (o1.get("range_fp32") or {}).items()) or "–"
        if o1.get("fills_saturated"):
            kept += f"; {o1['fills_saturated']} fills saturated"
        lines.append(
            f"| {r['name']} | {r['family']} | {_cell(o1, r.get('autocast_fp16'))} | "
            f"{_cell(r.get('bf16-O1', {}), r.get('autocast_bf16'))} | {_cell(r.get('fp16-O2', {}))} | "
            f"{_cell(r.get('bf16-O2', {}))} | {kept} | {'; '.join(verdict(r)) or '–'} |"
        )
    failing = [(r["name"], p, r[f"autocast_{p}"]["error"]) for r in exportable for p in ("fp16", "bf16")
               if r.get(f"autocast_{p}", {}).get("error")]
    if failing:
        lines += ["", "¹ torch.autocast itself fails on the same inputs:", ""]
        lines += [f"- {name} {p}: {err}" for name, p, err in failing]
    blocked = [r for r in rows if not r.get("exportable")]
    if blocked:
        lines += ["", "Not exportable by torch.export (not counted against amplite):", ""]
        lines += [f"- **{r['name']}** ({r['family']}): {r.get('export_error', '')}" for r in blocked]
    root = str(Path(__file__).resolve().parents[1]) + "/"
    return "\n".join(lines).replace(root, "").replace(sys.prefix + "/lib/", "") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated architecture names (merged into --json)")
    parser.add_argument("--json", type=Path, default=Path("bench/results-breadth.json"))
    parser.add_argument("--docs", type=Path, help="rewrite the table between the markers of this Markdown file")
    ns = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # the machine is shared: one core
    names = ns.only.split(",") if ns.only else [a.name for a in ARCHS]
    old = {r["name"]: r for r in json.loads(ns.json.read_text())} if ns.only and ns.json.exists() else {}
    for name in names:
        start = perf_counter()
        try:
            with _deadline(TIMEOUT_S):
                old[name] = measure(BY_NAME[name])
        except Exception as exc:
            old[name] = {"name": name, "family": BY_NAME[name].family, "exportable": True,
                         "error": summarize_exception(exc)[:300]}
        old[name]["sweep_seconds"] = round(perf_counter() - start, 1)
        print(name, json.dumps(old[name], default=str)[:600], flush=True)
        rows = [old[a.name] for a in ARCHS if a.name in old]
        ns.json.write_text(json.dumps(rows, indent=1) + "\n")
    if ns.docs:
        text = ns.docs.read_text()
        begin, end = "<!-- breadth:begin -->", "<!-- breadth:end -->"
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        ns.docs.write_text(head + begin + "\n" + markdown(rows) + end + tail)


if __name__ == "__main__":
    main()
