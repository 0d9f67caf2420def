"""Estimated GPU time for every corpus model: the report's roofline (amplite/estimate), side by side.

For each corpus model and fp16/bf16 × O1/O2 this converts once (no verification) and prints the estimate of
the FP32 program, torch.autocast's run of it, and the converted program on one GPU profile, plus the ratios,
the cast share and the FP32-island share. These are estimates, not measurements (docs/estimates.md).

    python bench/bench_estimates.py                         # every model, H100
    python bench/bench_estimates.py --gpu-profile A100 --models distilbert,gpt2
    python bench/bench_estimates.py --markdown out.md       # also write the table
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = [("fp16", "O1"), ("bf16", "O1"), ("fp16", "O2"), ("bf16", "O2")]


def rows_for(name: str, profile: str) -> list[list[str]]:
    """One row per configuration of one corpus model (an error row when it does not convert)."""
    import amplite
    from bench.corpus import CASES

    model, inputs = CASES[name].build()
    rows = []
    for precision, level in CONFIGS:
        try:
            with contextlib.redirect_stderr(None):
                result = amplite.convert(model, inputs, precision=precision, level=level, verify=False,
                                         gpu_profile=profile)  # fmt: skip
        except Exception as exc:  # a model that does not convert is a row, not the end of the table
            rows.append([name, f"{precision} {level}", f"failed: {type(exc).__name__}"] + ["–"] * 7)
            continue
        est = result.report.data["estimate"]
        sec = est["seconds"]
        rows.append([name, f"{precision} {level}", est["device"], f"{sec['fp32'] * 1e3:.3g}",
                     f"{sec['autocast'] * 1e3:.3g}", f"{sec['amplite'] * 1e3:.3g}", f"{est['ratio_vs_fp32']:.3f}",
                     f"{est['ratio_vs_autocast']:.3f}", f"{est['cast_share']:.2f}",
                     f"{est['fp32_island_share']:.2f}"])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    from bench.corpus import CASES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu-profile", default="H100")
    ap.add_argument("--models", default=",".join(CASES), help="comma list (default: the whole corpus)")
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    head = ["model", "config", "GPU profile", "FP32 ms", "autocast ms", "amplite ms", "amplite / FP32",
            "amplite / autocast", "cast share", "FP32-island share"]
    rows = [r for name in args.models.split(",") if name for r in rows_for(name.strip(), args.gpu_profile)]
    lines = ["## Estimated GPU time, every corpus model (bench/bench_estimates.py)", "",
             f"Roofline estimates on the {args.gpu_profile} profile (docs/estimates.md), example batch of each "
             "model, one eager kernel per graph node; not measurements and not yet validated on a GPU. "
             f"{len(rows)} rows in {time.perf_counter() - start:.0f} s.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
