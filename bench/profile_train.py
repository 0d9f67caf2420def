"""Where a training step's time goes: torch.autocast vs amplite bf16 O1 / O2 on the 23 M-parameter GPT-2.

Usage::

    flock /tmp/amplite-bench.lock python bench/profile_train.py [--model gpt2] [--steps 4] [--write]

The model and batches are bench/bench_train_big.py's. Each variant runs in a fresh process: two warm-up
steps, then ``--steps`` steps timed region by region with ``perf_counter`` (forward incl. the loss,
backward, optimizer step, of which amplite's master→low refresh, zero_grad; medians), then two steps under
``torch.profiler`` (CPU) for the ops: the top ops by self CPU time and the casts (``aten::_to_copy`` /
``aten::copy_`` calls per step and their self time) and, with ``profile_memory``, the allocator-level
peak of the profiled steps: the running sum of every op's allocations minus frees, in time order, above what
was allocated when they began (weights, gradients-free optimizer state), and the op at that peak. Unlike
the resident set it does not move with the C allocator's caching. bf16 needs no loss scaling, so there is
none to time.
``--write`` puts the tables into bench/RESULTS.md's "Training" section.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.bench_train_big import build, write_part  # noqa: E402

VARIANTS = ["autocast", "amplite-O1", "amplite-O2"]
MARK = "### Where the time goes (bench/profile_train.py)"
CASTS = ("aten::_to_copy", "aten::copy_")
REGIONS = ("forward", "backward", "optimizer", "refresh", "zero_grad")
#: Matrix products and attention: the kernels whose speed is the CPU's, not amplite's (on a CPU without bf16
#: dot-product instructions they dominate a bf16 step); everything else is where the variants differ.
GEMMS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul",
         "aten::_scaled_dot_product_flash_attention_for_cpu",
         "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
         "aten::mkldnn_convolution", "aten::convolution_backward", "aten::baddbmm")  # fmt: skip


def run_one(model_name: str, variant: str, steps: int, profiled: int, warmup: int) -> dict[str, Any]:
    """Region times and op statistics of one variant."""
    warnings.filterwarnings("ignore")
    model, batches, loss_fn = build(model_name, warmup + steps + profiled)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fwd, refresh_s = model, [0.0]
    if variant.startswith("amplite"):
        import amplite

        fwd, opt = amplite.prepare_training(model, opt, (batches[0][0],), precision="bf16", level=variant[-2:],
                                            dynamic_batch=False)  # fmt: skip
        real_refresh = opt.copies.refresh

        def timed_refresh(**kw: Any) -> None:
            t = perf_counter()
            real_refresh(**kw)
            refresh_s[0] += perf_counter() - t

        opt.copies.refresh = timed_refresh  # type: ignore[method-assign]

    saved: dict[int, int] = {}  # storage -> bytes of the tensors autograd saves for backward (last step)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided and t.device.type != "meta":
            st = t.untyped_storage()
            saved[st.data_ptr()] = st.nbytes()
        return t

    def step(x: torch.Tensor, target: torch.Tensor, clock: Callable[[str], None]) -> None:
        saved.clear()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "autocast")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            loss = loss_fn(fwd(x), target)
        loss.item()
        clock("forward")
        loss.backward()
        clock("backward")
        refresh_s[0] = 0.0
        opt.step()
        clock("optimizer")
        opt.zero_grad()
        clock("zero_grad")

    times: dict[str, list[float]] = {r: [] for r in REGIONS}
    last = [0.0]

    def clock(region: str) -> None:
        now = perf_counter()
        times[region].append(now - last[0])
        last[0] = now

    for i, (x, target) in enumerate(batches[: warmup + steps]):
        torch.manual_seed(i)
        last[0] = perf_counter()
        step(x, target, clock)
        times["refresh"].append(refresh_s[0])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for x, target in batches[warmup + steps :]:
            step(x, target, lambda _: None)
    peak, at = allocator_peak(prof)
    timed = range(warmup, warmup + steps)
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
    casts = [e for e in events if e.key in CASTS]
    return {
        "variant": variant,
        "ms": {r: 1000 * statistics.median(v[warmup:]) for r, v in times.items()},
        "step_ms": 1000 * statistics.median(sum(times[r][i] for r in REGIONS if r != "refresh") for i in timed),
        "top": [(e.key, e.self_cpu_time_total / 1000 / profiled, e.count // profiled) for e in top],
        "casts": {e.key: (e.count // profiled, e.self_cpu_time_total / 1000 / profiled) for e in casts},
        "self_total_ms": total_us / 1000 / profiled,
        "saved_mib": sum(saved.values()) / 2**20,
        "alloc_peak_mib": peak / 2**20,
        "alloc_peak_at": at,
        "gemm_ms": sum(e.self_cpu_time_total for e in events if e.key in GEMMS) / 1000 / profiled,
    }


def allocator_peak(prof: Any) -> tuple[int, str]:
    """The highest running sum of allocated-minus-freed bytes over the profiled ops, in time order, and the
    op where it was reached."""
    cur = peak = 0
    at = ""
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        if cur > peak:
            peak, at = cur, e.name
    return peak, at


def render(rows: list[dict[str, Any]], meta: str) -> str:
    """The markdown part for bench/RESULTS.md."""
    names = [r["variant"] for r in rows]
    lines = [MARK, "", meta, "", "| region (ms, median) | " + " | ".join(names) + " |",
             "|---|" + "---:|" * len(rows)]  # fmt: skip
    for region in ("step", *REGIONS):
        label = {"refresh": "  of which master→low refresh", "step": "whole step"}.get(region, region)
        vals = [r["step_ms"] if region == "step" else r["ms"][region] for r in rows]
        lines.append(f"| {label} | " + " | ".join(f"{v:.0f}" if v >= 1 or v == 0 else f"{v:.1f}" for v in vals) + " |")
    for key in CASTS:
        cells = [f"{r['casts'].get(key, (0, 0.0))[0]} calls, {r['casts'].get(key, (0, 0.0))[1]:.0f} ms" for r in rows]
        lines.append(f"| `{key}` per step (profiled) | " + " | ".join(cells) + " |")
    lines.append("| profiled self CPU per step | " + " | ".join(f"{r['self_total_ms']:.0f} ms" for r in rows) + " |")
    lines.append("| saved for backward (MiB, unique storages) | " + " | ".join(f"{r['saved_mib']:.1f}" for r in rows)
                 + " |")  # fmt: skip
    lines.append("| allocator peak above the step's start (MiB, profiled) | "
                 + " | ".join(f"{r['alloc_peak_mib']:.1f} at `{r['alloc_peak_at'].removeprefix('aten::')}`"
                              for r in rows) + " |")  # fmt: skip
    lines.append("| of which matmuls/attention | " + " | ".join(f"{r['gemm_ms']:.0f} ms" for r in rows) + " |")
    lines.append("| everything else (casts, elementwise, norms, optimizer) | "
                 + " | ".join(f"{r['self_total_ms'] - r['gemm_ms']:.0f} ms" for r in rows) + " |")  # fmt: skip
    lines += ["", "Top ops by self CPU time per step (profiled; ms, calls):", ""]
    lines += ["| # | " + " | ".join(names) + " |", "|---|" + "---|" * len(rows)]
    for i in range(max(len(r["top"]) for r in rows)):
        cells = []
        for r in rows:
            key, ms, n = r["top"][i] if i < len(r["top"]) else ("", 0.0, 0)
            cells.append(f"`{key.removeprefix('aten::')}` {ms:.0f} ({n})" if key else "")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profiled", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256, help="sequence length (GPT-2/BERT)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import bench.bench_train_big as big

    big.SEQ, big.BATCH = args.seq, args.batch
    if args.one:
        print(json.dumps(run_one(args.model, args.one, args.steps, args.profiled, args.warmup)))
        return
    import os
    from datetime import datetime, timezone

    load_before = [round(x, 2) for x in os.getloadavg()]
    rows = []
    for v in args.variants.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--one",
            v,
            "--model",
            args.model,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--profiled",
            str(args.profiled),
            "--seq",
            str(args.seq),
            "--batch",
            str(args.batch),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = (  # fmt: skip
        f"`python bench/profile_train.py {' '.join(sys.argv[1:])}` on {when} (seq {args.seq}, batch "
        f"{args.batch}), torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; load average {load_before} at the start, "
        f"{[round(x, 2) for x in os.getloadavg()]} at the end. One process per variant; region times are "
        f"medians of {args.steps} steps after {args.warmup} warm-up steps (perf_counter), the op tables come from "
        f"{args.profiled} "
        "further steps under torch.profiler (its overhead inflates them: compare columns, not absolutes)."
    )
    text = render(rows, meta)
    print(text)
    if args.write:
        write_part(text, MARK)


if __name__ == "__main__":
    main()
