"""Run-time measurements shared by the harness: casts executed per forward, accuracy, latency.

Casts are counted with a ``TorchDispatchMode``: every ``aten._to_copy`` / ``aten.to`` /
``prims.convert_element_type`` that turns a floating tensor into another floating dtype is one cast.
The mode sits below autocast in the dispatcher, so it sees the casts ``torch.autocast`` performs (one per
weight per autocast region, thanks to its cache, plus one per activation entering or leaving a
lower-precision op) exactly as it sees the explicit cast nodes of a converted graph.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections import Counter
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_CAST_PACKETS = {torch.ops.aten._to_copy, torch.ops.aten.to, torch.ops.prims.convert_element_type}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class CastCounter(TorchDispatchMode):
    """Counts floating-point dtype conversions executed while active.

    Attributes:
        count: Number of float → other-float conversions.
        pairs: The same, by ``"float32->float16"`` pair.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.pairs: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "overloadpacket", None) in _CAST_PACKETS and args and isinstance(args[0], torch.Tensor):
            src = args[0].dtype
            dst = out.dtype if isinstance(out, torch.Tensor) else src
            if src != dst and src.is_floating_point and dst.is_floating_point:
                self.count += 1
                self.pairs[f"{_short(src)}->{_short(dst)}"] += 1
        return out


def autocast_ctx(dtype: str | None, device: str = "cpu") -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``dtype`` (``fp16``/``bf16``), or a no-op context for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=DTYPES[dtype])


def run(model: Callable, inputs: tuple[tuple, dict], autocast: str | None = None, device: str = "cpu") -> Any:
    """One forward without autograd, under ``torch.autocast`` when asked."""
    args, kwargs = inputs
    with torch.no_grad(), autocast_ctx(autocast, device):
        return model(*args, **kwargs)


def counted_run(model: Callable, inputs: tuple[tuple, dict], autocast: str | None = None) -> tuple[Any, dict]:
    """One forward pass and the casts it executed: ``(output, {"casts": n, "pairs": {...}})``."""
    counter = CastCounter()
    with counter:
        output = run(model, inputs, autocast)
    return output, {"casts": counter.count, "pairs": dict(sorted(counter.pairs.items()))}


def count_casts(model: Callable, inputs: tuple[tuple, dict], autocast: str | None = None) -> dict[str, Any]:
    """Casts executed in one forward pass: ``{"casts": n, "pairs": {...}}``."""
    return counted_run(model, inputs, autocast)[1]


def first_tensor(output: Any) -> torch.Tensor:
    """The output the harness scores: the first tensor leaf (the logits in the corpus)."""
    return next(t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor))


def nonfinite(output: Any) -> int:
    """NaN/Inf count over every floating tensor leaf."""
    return sum(
        int((~torch.isfinite(t)).sum())
        for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point
    )


def accuracy(reference: Any, output: Any, *, logits: bool) -> dict[str, Any]:
    """SQNR (dB), max abs error and, for logits, top-1 agreement of the first output; NaN/Inf of all.

    SQNR = 20·log10(‖ref‖ / ‖ref − out‖) over the finite values of both, in float64.
    """
    ref = first_tensor(reference).detach().double()
    out = first_tensor(output).detach().double()
    result: dict[str, Any] = {"nonfinite": nonfinite(output), "ref_nonfinite": nonfinite(reference)}
    if ref.shape != out.shape:
        return result | {"error": f"shape {list(out.shape)} differs from FP32's {list(ref.shape)}"}
    mask = torch.isfinite(ref) & torch.isfinite(out)
    diff = (ref[mask] - out[mask]).abs()
    rn, en = float(ref[mask].norm()), float(diff.norm()) if diff.numel() else 0.0
    result["sqnr_db"] = math.inf if en == 0 else (20 * math.log10(rn / en) if rn > 0 else -math.inf)
    result["max_abs"] = float(diff.max()) if diff.numel() else math.nan
    if logits and ref.dim() >= 1 and ref.shape[-1] >= 2:
        r2, o2 = ref.reshape(-1, ref.shape[-1]), out.reshape(-1, out.shape[-1])
        result["top1"] = float((r2.argmax(-1) == o2.argmax(-1)).double().mean())
    return result


def latency(fn: Callable[[], Any], *, budget_s: float = 3.0, max_runs: int = 20) -> dict[str, Any]:
    """Median seconds of ``fn()`` after one warm-up call; runs until ``budget_s`` is spent, at least 3 times
    (once when the budget is under 2 s: the quick run's setting for models that take seconds per call)."""
    min_runs = 3 if budget_s >= 2 else 1
    fn()
    times: list[float] = []
    start = perf_counter()
    while len(times) < max_runs and (len(times) < min_runs or perf_counter() - start < budget_s):
        t0 = perf_counter()
        fn()
        times.append(perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "runs": len(times)}


def cuda_latency(fn: Callable[[], Any], *, warmup: int = 10, runs: int = 50) -> dict[str, Any]:
    """Median milliseconds of ``fn()`` on CUDA, timed with events after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "runs": runs}
