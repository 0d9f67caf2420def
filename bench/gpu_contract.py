"""Benchmark ``amplite::contract`` (cuTENSOR) against the ops it replaces.

Micro-benchmarks, fp16 and bf16, attention- and MLP-shaped:

* ``contract``: the fused op on the layout the graph already has (no copies);
* ``permute+bmm``: what eager does: permute, ``contiguous()``, ``bmm`` (or ``linear``), then scale;
* ``einsum``: ``torch.einsum`` on the same operands, then scale.

Each row gives the time, TFLOP/s and the ratio to the bf16 matmul peak measured on the same device. Then
end-to-end latency of a small transformer block: amplite-style fp16 + ``FuseContractions`` vs
``torch.autocast`` vs FP32.

Usage::

    python bench/gpu_contract.py                # needs CUDA; full-size problems
    python bench/gpu_contract.py --dry-run      # tiny problems, CPU allowed: checks the script runs
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amplite.ops import cutensor_backend
from amplite.ops.contract import backend_description
from amplite.passes.fuse_contractions import FuseContractions
from bench.autocast_count import cuda_latency

CONTRACT = torch.ops.amplite.contract.default


def timeit(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds per call (CUDA events on CUDA, wall clock otherwise)."""
    if device.type == "cuda":
        return cuda_latency(fn, warmup=warmup, runs=iters)["median_ms"]
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def matmul_peak(device: torch.device, n: int, warmup: int, iters: int) -> float:
    """Measured bf16 GEMM TFLOP/s on an n×n×n problem: the denominator of the ratio column."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = timeit(lambda: a @ b, device, warmup, iters)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def problems(dry: bool, dtype: torch.dtype, device: torch.device) -> list[tuple[str, float, dict]]:
    """(name, flops, {method: callable}) for each benchmark problem."""
    bsz, t, h, d, dm = (2, 16, 2, 8, 32) if dry else (8, 2048, 16, 128, 4096)
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=device, generator=g).to(dtype)  # noqa: E731
    scale = 1.0 / math.sqrt(d)
    q, k, v = rnd(bsz, t, h, d), rnd(bsz, t, h, d), rnd(bsz, t, h, d)  # as linear + view leave them
    p = rnd(bsz, h, t, t)
    x, w, bias = rnd(bsz * t, dm), rnd(4 * dm, dm), rnd(4 * dm)

    def qk_eager():
        qq = q.permute(0, 2, 1, 3).contiguous().view(bsz * h, t, d)
        kk = k.permute(0, 2, 3, 1).contiguous().view(bsz * h, d, t)
        return torch.bmm(qq, kk).mul_(scale)

    def pv_eager():
        vv = v.permute(0, 2, 1, 3).contiguous().view(bsz * h, t, d)
        out = torch.bmm(p.view(bsz * h, t, t), vv).view(bsz, h, t, d)
        return out.transpose(1, 2).reshape(bsz, t, h * d)  # head merge copies

    return [
        ("attn q·kᵀ (head split, scale)", 2.0 * bsz * h * t * t * d, {
            "contract": lambda: CONTRACT("bqhd,bkhd->bhqk", q, k, None, scale, 0.0),
            "permute+bmm": qk_eager,
            "einsum": lambda: torch.einsum("bqhd,bkhd->bhqk", q, k).mul_(scale),
        }),
        ("attn p·v (head merge)", 2.0 * bsz * h * t * t * d, {
            "contract": lambda: CONTRACT("bhqk,bkhd->bqhd", p, v, None, 1.0, 0.0),
            "permute+bmm": pv_eager,
            "einsum": lambda: torch.einsum("bhqk,bkhd->bqhd", p, v).contiguous(),
        }),
        ("mlp up (linear + bias)", 2.0 * bsz * t * dm * 4 * dm, {
            "contract": lambda: CONTRACT("md,nd->mn", x, w, bias, 1.0, 1.0),
            "permute+bmm": lambda: nn.functional.linear(x, w, bias),
            "einsum": lambda: torch.einsum("md,nd->mn", x, w).add_(bias),
        }),
    ]  # fmt: skip


class Block(nn.Module):
    """A pre-norm transformer block (attention + MLP) with separate q/k/v projections (BERT/LLaMA style)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.h = heads
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, t, d = x.shape
        dh = d // self.h
        y = self.n1(x)
        q, k, v = (p(y).view(bsz, t, self.h, dh).transpose(1, 2) for p in (self.q, self.k, self.v))
        attn = (q @ k.transpose(-2, -1) / math.sqrt(dh)).softmax(-1)
        x = x + self.o((attn @ v).transpose(1, 2).reshape(bsz, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.n2(x))))


def end_to_end(dry: bool, dtype: torch.dtype, device: torch.device, warmup: int, iters: int) -> list[tuple]:
    """Latency of the block: fp16/bf16 + fusion vs autocast vs FP32."""
    d, heads, bsz, t = (32, 2, 2, 8) if dry else (1024, 16, 8, 1024)
    torch.manual_seed(0)
    model = Block(d, heads).to(device).eval()
    x = torch.randn(bsz, t, d, device=device)
    rows = []
    with torch.no_grad():
        rows.append(("fp32", timeit(lambda: model(x), device, warmup, iters), ""))
        try:
            with torch.autocast(device.type, dtype=dtype):
                ms = timeit(lambda: model(x), device, warmup, iters)
            rows.append((f"autocast {dtype_name(dtype)}", ms, ""))
        except RuntimeError as e:  # autocast dtype unsupported on this device
            rows.append((f"autocast {dtype_name(dtype)}", float("nan"), str(e).splitlines()[0]))
        low = Block(d, heads).to(device).eval()
        low.load_state_dict(model.state_dict())
        low = low.to(dtype)
        xl = x.to(dtype)
        gm = torch.export.export(low, (xl,), strict=False).module()
        rows.append((f"{dtype_name(dtype)} unfused", timeit(lambda: gm(xl), device, warmup, iters), ""))
        res = FuseContractions()(gm)
        fused = {k: v for k, v in res.counters.items() if k.startswith("fused:")}
        ms = timeit(lambda: gm(xl), device, warmup, iters)
        rows.append((f"{dtype_name(dtype)} + FuseContractions", ms, str(fused)))
    return rows


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny problems; runs on CPU (checks the script)")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("gpu_contract: needs CUDA (use --dry-run to check the script on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    iters = args.iters or (3 if args.dry_run else 50)
    warmup = 3 if args.dry_run else 10  # the first calls of a custom op pay one-off setup
    peak = matmul_peak(device, 64 if args.dry_run else 8192, warmup, iters)
    print(
        f"device: {torch.cuda.get_device_name() if cuda else 'cpu'} | backend: {backend_description(device)}"
    )
    print(f"bf16 matmul peak (measured): {peak:.2f} TFLOP/s\n")
    head = f"{'problem':34} {'dtype':5} {'method':12} {'ms':>9} {'TFLOP/s':>8} {'of peak':>8} {'vs eager':>8}"
    print(f"{head} {'max|Δ| vs eager':>15}")
    for name in args.dtypes.split(","):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
        for title, flops, methods in problems(args.dry_run, dtype, device):
            results = {m: timeit(fn, device, warmup, iters) for m, fn in methods.items()}
            base = results["permute+bmm"]
            # Every method returns the same elements in the same row-major order: compare flattened.
            ref = methods["permute+bmm"]().float().flatten()
            for method, ms in results.items():
                tflops = flops / (ms * 1e-3) / 1e12
                err = (methods[method]().float().flatten() - ref).abs().max().item()
                print(
                    f"{title:34} {name:5} {method:12} {ms:9.3f} {tflops:8.2f} {tflops / peak:8.1%} "
                    f"{base / ms:7.2f}x {err:15.2e}"
                )
    print(f"\nplan cache: {cutensor_backend.cache_stats()}\n")
    print(f"{'end-to-end block':34} {'ms':>9}  notes")
    for name in args.dtypes.split(","):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
        for label, ms, note in end_to_end(args.dry_run, dtype, device, warmup, iters):
            print(f"{label:34} {ms:9.3f}  {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
