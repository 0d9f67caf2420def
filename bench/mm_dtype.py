"""How fast this CPU multiplies in bf16 against FP32 (issue 31: the context every bf16 CPU figure needs).

    python bench/mm_dtype.py --threads 1

GPT-2-6l's shapes (1024 tokens x 512 -> 2048, and the 50257-wide LM head on 256 tokens), eager ``torch.mm``,
medians of 5 interleaved repetitions, GFLOP/s per dtype.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print("load", os.getloadavg(), "threads", a.threads, "cpu capability:", torch.backends.cpu.get_cpu_capability())
    shapes = [(1024, 512, 2048), (256, 512, 50257 // 4)]
    for m, k, n in shapes:
        mats = {dt: (torch.randn(m, k).to(dt), torch.randn(k, n).to(dt)) for dt in (torch.float32, torch.bfloat16)}
        samples: dict[torch.dtype, list[float]] = {dt: [] for dt in mats}
        for _ in range(5):
            for dt, (x, w) in mats.items():
                torch.mm(x, w)
                s = time.perf_counter()
                torch.mm(x, w)
                samples[dt].append(time.perf_counter() - s)
        flops = 2 * m * k * n
        for dt, v in samples.items():
            med = statistics.median(v)
            print(f"mm {m}x{k}x{n} {dt!s:15s} median {med * 1e3:9.2f} ms  {flops / med / 1e9:7.2f} GFLOP/s")
    print("load", os.getloadavg())


if __name__ == "__main__":
    main()
