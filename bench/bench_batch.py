"""Batch wall time: ``--jobs 2`` against ``--jobs 1`` on the fixture models (and any other --jobs values).

Usage: ``python bench/bench_batch.py [--jobs 1,2] [--levels O1,O2] [--repeat 3] [--start zygote|subprocess]
[--json OUT]``

Every fixture is written as a state dict and converted at each level, so one batch is
``len(fixtures) x len(levels)`` models. Each run is a fresh ``convert_many`` into an empty directory; the
``--jobs`` settings alternate within each repeat and the table shows medians. The fork server is warmed
before timing so that neither setting pays its start. ``--start subprocess`` starts every worker as a
fresh interpreter instead (the fallback used without ``fork``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amplite.batch import convert_many
from amplite.batch.isolation import START_ENV
from amplite.batch.runner import cpu_count
from fixtures.write_fixtures import write
from fixtures.zoo import TEST_FIXTURES


def jobs_for(root: Path, models: list[str], levels: list[str]) -> list[dict]:
    """One job per (fixture, level), from state dicts written under ``root``."""
    jobs = []
    for name in models:
        paths = write(name, root, ("state_dict", "inputs"))
        for level in levels:
            jobs.append({"name": f"{name}-{level}", "path": str(paths["state_dict"]), "level": level,
                         "model_factory": f"fixtures.zoo:{name}", "inputs_file": str(paths["inputs"])})  # fmt: skip
    return jobs


def run_once(jobs: list[dict], workers: int, scratch: Path) -> dict:
    """Wall time of one batch with ``workers`` parallel conversions."""
    out = Path(tempfile.mkdtemp(dir=scratch))
    start = time.perf_counter()
    result = convert_many(jobs, out, workers=workers)
    wall = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return {"wall_s": wall, "ok": len(result.succeeded), "failed": [r.name for r in result.failed]}


def main() -> None:
    """Run the benchmark and print a table with the jobs-2 / jobs-1 speed-up."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default="1,2", help="comma-separated --jobs values (the first is the baseline)")
    ap.add_argument("--levels", default="O1,O2")
    ap.add_argument("--models", default=",".join(TEST_FIXTURES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--start", choices=("zygote", "subprocess"), default="zygote")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    if ns.start == "subprocess":
        os.environ[START_ENV] = "subprocess"
    settings = [int(j) for j in ns.jobs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        jobs = jobs_for(scratch / "models", ns.models.split(","), ns.levels.split(","))
        run_once(jobs[:1], 1, scratch)  # warm-up: starts the fork server
        runs: dict[int, list[dict]] = {j: [] for j in settings}
        for _ in range(ns.repeat):
            for j in settings:
                runs[j].append(run_once(jobs, j, scratch))
    base = statistics.median(r["wall_s"] for r in runs[settings[0]])
    rows = []
    for j in settings:
        wall = statistics.median(r["wall_s"] for r in runs[j])
        failed = sorted({n for r in runs[j] for n in r["failed"]})
        rows.append({"jobs": j, "wall_s": round(wall, 2), "per_model_s": round(wall / len(jobs), 3),
                     "models_per_min": round(60 * len(jobs) / wall, 1), "speedup": round(base / wall, 2),
                     "failed": failed})  # fmt: skip
    print(f"{len(jobs)} models ({ns.models}; levels {ns.levels}), {cpu_count()} CPUs, start={ns.start}, "
          f"median of {ns.repeat}")  # fmt: skip
    head = f"{'--jobs':>6s} {'wall s':>8s} {'s/model':>8s} {'models/min':>10s} {'speed-up':>8s}  failed"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['jobs']:6d} {r['wall_s']:8.2f} {r['per_model_s']:8.3f} {r['models_per_min']:10.1f} "
              f"{r['speedup']:7.2f}x  {', '.join(r['failed']) or '-'}")  # fmt: skip
    by_jobs = {r["jobs"]: r for r in rows}
    if 1 in by_jobs and 2 in by_jobs:
        print(f"ratio wall(--jobs 1) / wall(--jobs 2) = {by_jobs[1]['wall_s'] / by_jobs[2]['wall_s']:.2f}")
    if ns.json:
        ns.json.write_text(
            json.dumps({"models": len(jobs), "start": ns.start, "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
