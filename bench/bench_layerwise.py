"""Cost of the layer-wise analysis against a plain verification run.

Plain verification = what ``amplite check --no-layerwise`` does per batch after converting: run the FP32
and the converted program and compute the per-output metrics. Layer-wise = :func:`amplite.converter.
layerwise.analyze` on the same batch (both graphs under an interpreter, every node compared, each
low-precision node re-run on the reference's inputs, range statistics). Both reuse the same
``program.module()`` objects, as ``check`` does. Times are medians of ``--repeat`` rounds after one
warm-up; plain and layer-wise alternate within each round.

Usage: ``python bench/bench_layerwise.py [--fixture transformer12] [--level O1] [--batch 2 --seq 32]
[--device cpu|cuda] [--repeat 7] [--threads N] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from time import perf_counter

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amplite
from amplite.verify.compare import DEFAULT_TOLERANCES, compare, run_model
from amplite.verify.layerwise import analyze
from fixtures.zoo import make


def timed(fns: list[Callable[[], object]], repeat: int, device: str) -> list[list[float]]:
    """Wall-clock seconds of ``repeat`` rounds of each function, after one warm-up round. The functions
    alternate within each round, so a change of machine load hits all of them alike."""
    for fn in fns:
        fn()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for times, fn in zip(out, fns, strict=True):
            if device == "cuda":
                torch.cuda.synchronize()
            start = perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(perf_counter() - start)
    return out


def main() -> None:
    """Run the benchmark and print (and optionally save) the figures."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixture", default="transformer12")
    p.add_argument("--level", default="O1")
    p.add_argument("--precision", default="fp16")
    p.add_argument("--batch", type=int, default=None, help="override the example batch size (token models)")
    p.add_argument("--seq", type=int, default=None, help="override the example sequence length (token models)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None)
    ns = p.parse_args()

    if ns.threads:
        torch.set_num_threads(ns.threads)
    model, inputs = make(ns.fixture)
    if ns.batch or ns.seq:
        (ids,), _ = inputs
        shape = (ns.batch or ids.shape[0], ns.seq or ids.shape[1])
        inputs = ((torch.randint(0, 1000, shape, generator=torch.Generator().manual_seed(0)),), {})
    result = amplite.convert(model, inputs, precision=ns.precision, level=ns.level, verify=False)
    ref_gm, conv_gm = result.original.module(), result.program.module()
    args = tuple(a.to(ns.device) for a in inputs[0])
    if ns.device != "cpu":
        ref_gm, conv_gm = ref_gm.to(ns.device), conv_gm.to(ns.device)
    batch = (args, {})
    tol = DEFAULT_TOLERANCES[ns.precision]
    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[ns.precision]

    def plain() -> object:
        return compare(run_model(ref_gm, batch), run_model(conv_gm, batch), tol)

    def layerwise() -> object:
        return analyze(ref_gm, conv_gm, batch, batch, low)

    plain_s, lw_s = timed([plain, layerwise], ns.repeat, ns.device)
    ratios = [b / a for a, b in zip(plain_s, lw_s, strict=True)]
    res = analyze(ref_gm, conv_gm, batch, batch)
    figures = {
        "fixture": ns.fixture,
        "level": ns.level,
        "precision": ns.precision,
        "inputs": [list(a.shape) for a in args],
        "device": ns.device,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "nodes_recorded": len(res.nodes),
        "nodes_paired": res.paired,
        "plain_verify_s": statistics.median(plain_s),
        "layerwise_s": statistics.median(lw_s),
        "ratio": statistics.median(lw_s) / statistics.median(plain_s),
        "ratio_per_round_median": statistics.median(ratios),
        "plain_runs": [round(x, 5) for x in plain_s],
        "layerwise_runs": [round(x, 5) for x in lw_s],
    }
    print(json.dumps(figures, indent=2))
    if ns.json:
        ns.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
