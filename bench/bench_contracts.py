"""What the passes' executable contracts cost: ``requires``/``ensures`` time against the passes' own (issue 46).

Usage: ``python bench/bench_contracts.py [fixture ...]`` (default: transformer12 cnn causal)

For each fixture of ``fixtures/zoo.py``: one ``rewrite()`` at fp16 O2 with range rules and contraction fusion
(the longest sequence), run twice and the second measured, with every pass call and every contract call
timed where the pass manager makes it (``passes.base._guarded``), side by side in one run: the milliseconds
of the whole rewrite, of the passes (the ``check_dtypes`` postcondition included) and of all ``requires``/
``ensures`` together, and the contracts' share of the rewrite.
"""

from __future__ import annotations

import os
import platform
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from amplite.converter.pipeline import rewrite
from amplite.passes import base
from amplite.passes.range_guard import RangeRules
from amplite.policy import Level, PrecisionPolicy
from fixtures.zoo import make

SPENT: dict[str, float] = defaultdict(float)
_REAL = base._guarded


def _timed(p: Any, method: str, gm: torch.fx.GraphModule) -> Any:
    start = time.perf_counter()
    try:
        return _REAL(p, method, gm)
    finally:
        SPENT["pass" if method == "__call__" else "contract"] += time.perf_counter() - start


def main() -> None:
    names = sys.argv[1:] or ["transformer12", "cnn", "causal"]
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    base._guarded = _timed  # the manager calls every pass and contract through it
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, 1 thread\n")
    print("| fixture | graph nodes | rewrite ms | passes ms | requires/ensures ms | contracts / rewrite |")
    print("|---|---|---|---|---|---|")
    policy = PrecisionPolicy("fp16", Level.O2)
    for name in names:
        model, inputs = make(name)
        program = torch.export.export(model, inputs[0], inputs[1], strict=False)
        for _ in range(2):  # the first run warms caches (fake kernels, dispatch); the second is measured
            SPENT.clear()
            start = time.perf_counter()
            rewrite(program, inputs, policy, range_rules=RangeRules(), fuse_contractions=True)
            total = time.perf_counter() - start
        print(f"| {name} | {len(program.graph.nodes)} | {total * 1e3:.1f} | {SPENT['pass'] * 1e3:.1f} | "
              f"{SPENT['contract'] * 1e3:.1f} | {SPENT['contract'] / total:.1%} |")  # fmt: skip


if __name__ == "__main__":
    main()
