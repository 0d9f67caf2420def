"""Conversion cost and graph facts per fixture: export vs passes time, nodes by dtype, casts.

Usage: ``python bench/bench_convert.py [--precision fp16] [--levels O1,O2] [--repeat 3] [--json OUT]``

Times are medians of ``--repeat`` runs in this process (the first, warm-up conversion is discarded), and
the ratio column is passes / export measured side by side in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amplite
from bench.cost import rebuild_seconds
from fixtures.zoo import FIXTURES, make


def measure(name: str, precision: str, level: str, repeat: int) -> dict:
    """Median timings and graph facts of converting fixture ``name``."""
    model, inputs = make(name)
    runs = [amplite.convert(model, inputs, precision=precision, level=level, verify=False) for _ in range(repeat)]
    timings = [r.report.data["timings"] for r in runs]
    med = {k: statistics.median(t[k] for t in timings) for k in ("export", "passes")}
    med["reexport"] = statistics.median(rebuild_seconds(t) or 0.0 for t in timings)  # or the direct build
    after = runs[-1].report.data["graph"]["after"]
    return {
        "model": name,
        "level": level,
        **{f"{k}_s": round(v, 4) for k, v in med.items()},
        "passes_over_export": round(med["passes"] / med["export"], 3),
        "nodes_by_dtype": after["nodes_by_dtype"],
        "casts": after["casts"],
        "weights_ratio": runs[-1].report.data["weights"]["ratio"],
    }


def main() -> None:
    """Run the benchmark and print a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--levels", default="O1,O2")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--models", default=",".join(FIXTURES))
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    amplite.convert(*make("mlp"), verify=False)  # warm-up: first export pays torch's one-time costs
    rows = [measure(m, ns.precision, lvl, ns.repeat) for m in ns.models.split(",") for lvl in ns.levels.split(",")]
    head = f"{'model':14s} {'lvl':3s} {'export s':>9s} {'passes s':>9s} {'reexp s':>8s} {'pass/exp':>8s} " \
           f"{'casts':>5s} {'w ratio':>7s}  nodes by dtype"  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['model']:14s} {r['level']:3s} {r['export_s']:9.3f} {r['passes_s']:9.3f} {r['reexport_s']:8.3f} "
            f"{r['passes_over_export']:8.3f} {r['casts']:5d} {r['weights_ratio']:7.3f}  {r['nodes_by_dtype']}"
        )
    ratios = [r["passes_over_export"] for r in rows]
    print(f"\nmedian passes/export ratio: {statistics.median(ratios):.3f} (max {max(ratios):.3f})")
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
