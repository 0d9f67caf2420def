"""cuTENSOR contractions through nvmath-python, with a plan cache.

nvmath-python is imported lazily, only when a CUDA tensor is contracted: CPU-only installs never need it.

Each distinct problem, keyed by (equation, shapes, strides, dtype, device, pointer alignments), gets one
planned ``nvmath.tensor.BinaryContraction``; later calls rebind the operands with ``reset_operands`` (which
requires exactly those properties, hence the key) and execute. Execution is enqueued on torch's current
stream; the workspace comes from torch's caching allocator (nvmath's default allocator for torch
operands) and is handed back after every call, so cached plans never pin device memory, and the
operands are unbound after every call for the same reason.

cuTENSOR constraints handled here (see docs/contract.md):

* A, B, C and D share one dtype, with FP32 compute for fp16/bf16 (nvmath's default compute type).
* C must carry all of the output's modes. A bias that broadcasts (fewer modes, or size-1 extents) is
  added to the result in place instead of being materialised to full size.
* Size-1 modes that occur in only one input are squeezed away (a free view) because they carry nothing.
  Problems cuTENSOR cannot express (a larger mode in a single input and not in the output, empty or
  stride-0 broadcast operands) return ``None`` so the caller falls back to ``torch.einsum``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
from collections import OrderedDict
from typing import Any

import torch

#: Plans kept per process; cuTENSOR's own plan cache per handle defaults to 64 entries as well.
MAX_PLANS = 256

_lock = threading.Lock()
_plans: OrderedDict[tuple, Any] = OrderedDict()
_stats = {"plans": 0, "hits": 0, "fallbacks": 0}


@functools.cache  # asked on every CUDA call; installs do not change mid-process
def is_available() -> bool:
    """Whether nvmath-python can be imported (CUDA availability is checked by the caller)."""
    return importlib.util.find_spec("nvmath") is not None


def nvmath_version() -> str:
    """The installed nvmath-python version, or ``"?"``."""
    try:
        from importlib.metadata import version

        return version("nvmath-python")
    except Exception:  # metadata missing in editable/vendored installs
        return "?"


def cache_stats() -> dict[str, int]:
    """Counts of plans created, cache hits and fallbacks to torch (for the benchmark and tests)."""
    with _lock:
        return dict(_stats, cached=len(_plans))


def clear_cache() -> None:
    """Free every cached plan."""
    with _lock:
        while _plans:
            _free(_plans.popitem()[1])
        for k in _stats:
            _stats[k] = 0


def _free(plan: Any) -> None:
    with contextlib.suppress(Exception):  # freeing during interpreter shutdown must not raise
        plan.free()


def _alignment(t: torch.Tensor) -> int:
    # nvmath records the operand pointer alignment at planning and refuses rebinding to a different one.
    ptr = t.data_ptr()
    return 256 if ptr == 0 else min(ptr & -ptr, 256)


def canonicalize(
    equation: str, a: torch.Tensor, b: torch.Tensor
) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """Rewrite a problem into one cuTENSOR accepts, or None when it cannot be.

    Size-1 modes found in exactly one input (and not in the output) are squeezed out of that input.
    """
    lhs, out = equation.split("->")
    sa, sb = lhs.split(",")
    keep: list[str] = []
    views: list[torch.Tensor] = []
    for subs, t, other in ((sa, a, sb), (sb, b, sa)):
        kept = ""
        dims = []
        for ch, n, st in zip(subs, t.shape, t.stride(), strict=True):
            alone = ch not in other and ch not in out
            if alone and n == 1:
                continue
            if alone or n == 0 or (st == 0 and n > 1):
                return None
            kept += ch
            dims.append(n)
        keep.append(kept)
        views.append(t.reshape(dims) if kept != subs else t)
    return f"{keep[0]},{keep[1]}->{out}", views[0], views[1]


def _key(eq: str, tensors: dict[str, torch.Tensor | None]) -> tuple:
    parts: list[Any] = [eq]
    for name, t in tensors.items():
        if t is None:
            parts.append((name, None))
        else:
            parts.append((name, tuple(t.shape), tuple(t.stride()), t.dtype, t.device, _alignment(t)))
    return tuple(parts)


def contract(
    equation: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, alpha: float, beta: float
) -> torch.Tensor | None:
    """``alpha * einsum(equation, a, b) + beta * c`` on cuTENSOR, or None if the caller must fall back."""
    canon = canonicalize(equation, a, b)
    if canon is None:
        with _lock:
            _stats["fallbacks"] += 1
        return None
    eq, a, b = canon
    out_subs = eq.split("->")[1]
    sizes = dict(zip(eq.split("->")[0].replace(",", ""), (*a.shape, *b.shape), strict=True))
    out = torch.empty([sizes[ch] for ch in out_subs], dtype=a.dtype, device=a.device)
    # cuTENSOR's C must have D's modes: a full-size bias goes in as C (with its own strides); a broadcast
    # one is added afterwards rather than expanded into a full-size copy.
    fused_c = c if c is not None and beta != 0.0 and tuple(c.shape) == tuple(out.shape) else None
    stream = torch.cuda.current_stream(a.device) if a.device.type == "cuda" else None
    tensors = {"a": a, "b": b, "c": fused_c, "out": out}
    key = _key(eq, tensors)
    with _lock:
        plan = _plans.get(key)
        if plan is None:
            plan = _make_plan(eq, a, b, fused_c, out, stream)
            _plans[key] = plan
            _stats["plans"] += 1
            if len(_plans) > MAX_PLANS:
                _free(_plans.popitem(last=False)[1])
        else:
            _plans.move_to_end(key)
            _stats["hits"] += 1
            plan.reset_operands(a=a, b=b, c=fused_c, out=out, stream=stream)
        try:
            plan.execute(
                alpha=alpha, beta=beta if fused_c is not None else None, release_workspace=True, stream=stream
            )
        finally:
            # Unbind so the cache does not keep these tensors alive between calls.
            plan.reset_operands(a=None, b=None, c=None, out=None, stream=stream)
    if c is not None and beta != 0.0 and fused_c is None:
        out.add_(c, alpha=beta)
    return out


def _make_plan(
    eq: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, out: torch.Tensor, stream: Any
) -> Any:
    import nvmath  # lazy: only CUDA users with the cutensor extra reach this

    plan = nvmath.tensor.BinaryContraction(eq, a, b, c=c, out=out, stream=stream)
    plan.plan(stream=stream)
    return plan
