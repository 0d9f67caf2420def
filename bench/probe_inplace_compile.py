"""fx-mlp O2: ``torch.compile(ep.module())`` vs ``ep.module().compile()`` vs the bare graph (issue 31).

Times each (1 thread, medians of 5 rounds of 300 calls, interleaved) and shows what each does with an input
of the wrong shape and of the wrong dtype.

    python bench/probe_inplace_compile.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amplite
from bench.bench_compiled import MODELS


def _try(fn: Any, x: torch.Tensor) -> str:
    try:
        fn(x)
    except Exception as exc:
        return f"rejected: {type(exc).__name__} {str(exc).splitlines()[0][:150]}"
    return "ACCEPTED"


def main() -> None:
    """Print the timings and the wrong-input behaviour."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print("load", os.getloadavg())
    model, (args, kwargs) = MODELS["fx-mlp"]()
    res = amplite.convert(model, (args, kwargs), precision="bf16", level="O2", verify=False)
    with torch.no_grad():
        inplace = res.module()
        inplace.compile()
        bare = res.program.module(check_guards=False)
        bare.validate_inputs = False
        runs = {"torch.compile(ep.module())": torch.compile(res.module()), "ep.module().compile()": inplace,
                "torch.compile(bare graph)": torch.compile(bare)}  # fmt: skip
        for fn in runs.values():
            fn(*args)
            fn(*args)
        samples: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(5):
            for k, fn in runs.items():
                start = time.perf_counter()
                for _ in range(300):
                    fn(*args)
                samples[k].append((time.perf_counter() - start) / 300 * 1e3)
        for k, v in samples.items():
            print(f"{k:30s} median {statistics.median(v):.3f} ms  {[round(x, 3) for x in v]}")
        for k, fn in runs.items():
            print(k, "wrong shape (4, 33):", _try(fn, torch.randn(4, 33)))
            print(k, "wrong dtype float64:", _try(fn, args[0].double()))
    print("load", os.getloadavg())


if __name__ == "__main__":
    main()
