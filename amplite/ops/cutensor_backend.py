"""cuTENSOR contractions through nvmath-python 1.x, probed before use and never fatal.

nvmath-python is imported lazily, only when a CUDA tensor is contracted: CPU-only installs never need it.

**Probe.** The first call on a (device, dtype) plans and runs a tiny contraction (with a full-size and a
broadcast bias) and compares it with ``torch.einsum``; the verdict is cached for the process. Any
failure (nvmath-python missing or older than 1.0, ``nvmath.tensor`` absent, cuTENSOR too old for nvmath,
a planning or execution error, a wrong result) makes :func:`probe` report the reason, which is logged
once and shown in the report's ``contract_backend``; the op then uses the ``torch`` GEMM backend.

**Per-call fallback.** A problem cuTENSOR cannot express (:func:`~amplite.ops.cutensor_problem.canonicalize`),
or any exception while planning or executing one (unsupported shape, stride or alignment), makes
:func:`contract` return None so the caller falls back to the ``torch`` GEMM backend; the failure is logged
once per reason and the problem's key is remembered, so it is not planned again.

**Plans.** Each distinct problem, keyed by (equation, shapes, strides, dtype, device, pointer alignments),
gets one planned ``nvmath.tensor.BinaryContraction``; later calls rebind the operands with
``reset_operands`` (which requires exactly those properties, hence the key) and execute. Execution is
enqueued on torch's current stream; the workspace comes from torch's caching allocator and is released
after every call, and the operands are unbound after every call, so cached plans pin no memory.

**Numerics** (see docs/contract.md): A, B, C and D share one dtype with FP32 compute (nvmath's default
for fp16/bf16), so alpha and beta·C are applied in FP32 and D is rounded once. C must carry all of D's
modes: a broadcast bias is passed as a stride-0 expanded view, or, where cuTENSOR refuses stride 0,
materialised to full size; it is never added after the rounding.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from amplite.ops.cutensor_problem import canonicalize

log = logging.getLogger("amplite.contract")

#: Plans kept per process; cuTENSOR's own plan cache per handle defaults to 64 entries as well.
MAX_PLANS = 256
#: The nvmath-python API this module is written against (``nvmath.tensor.BinaryContraction``, 1.x).
NVMATH_MIN = (1, 0)
NVMATH_MAX = (2, 0)  # exclusive
PROBE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Device types the probe accepts (cuTENSOR is CUDA-only; the CPU tests add "cpu" to simulate failures).
DEVICE_TYPES = ("cuda",)

_lock = threading.RLock()
_plans: OrderedDict[tuple, Any] = OrderedDict()
_FAILED = object()  # cached in _plans for a problem cuTENSOR refused: do not plan it again
_stats = {"plans": 0, "hits": 0, "fallbacks": 0, "errors": 0}
_probes: dict[tuple[str, torch.dtype], Probe] = {}
_stride0_c: dict[str, bool] = {}  # per device: does cuTENSOR take a stride-0 (broadcast) C?
_logged: set[str] = set()


@dataclass(frozen=True)
class Probe:
    """The verdict of probing cuTENSOR on one (device, dtype): usable, or why not."""

    ok: bool
    reason: str = ""


class Unavailable(RuntimeError):
    """nvmath-python / cuTENSOR cannot be used; the message is the reason for the report."""


def warn_once(reason: str) -> None:
    """Log ``reason`` (a fallback to the ``torch`` GEMM backend) once per process."""
    with _lock:
        if reason in _logged:
            return
        _logged.add(reason)
    log.warning("amplite::contract falls back to the torch GEMM: %s", reason)


def nvmath_version() -> str:
    """The installed nvmath-python version, or ``"?"``."""
    try:
        from importlib.metadata import version

        return version("nvmath-python")
    except Exception:  # metadata missing in editable/vendored installs
        return "?"


def _version_tuple(v: str) -> tuple[int, ...] | None:
    parts = []
    for p in v.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts)


def load_nvmath() -> Any:
    """Import nvmath-python and check it is the 1.x API this module uses.

    Raises:
        Unavailable: With the reason (not installed, wrong version, ``nvmath.tensor`` missing, import error).
    """
    if "nvmath" not in sys.modules and importlib.util.find_spec("nvmath") is None:
        raise Unavailable("nvmath-python is not installed (pip install 'amplite[cutensor]')")
    v = nvmath_version()
    vt = _version_tuple(v)
    if vt is not None and not NVMATH_MIN <= vt < NVMATH_MAX:
        raise Unavailable(f"nvmath-python {v} is installed; amplite needs 1.x (pip install 'amplite[cutensor]')")
    try:
        import nvmath

        nvmath.tensor.BinaryContraction  # noqa: B018  (absent before 0.7)
    except Exception as e:
        raise Unavailable(f"nvmath.tensor is unusable: {_one_line(e)}") from e
    return nvmath


def cutensor_version() -> str:
    """cuTENSOR's version as nvmath sees it (``"2.3.1"``), or ``"?"``."""
    try:
        n = int(load_nvmath().bindings.cutensor.get_version())
        return f"{n // 10000}.{n // 100 % 100}.{n % 100}"
    except Exception:
        return "?"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


def probe(device: torch.device | str, dtype: torch.dtype = torch.float16) -> Probe:
    """Whether cuTENSOR works for ``dtype`` on CUDA ``device``: plans and runs a tiny contraction once.

    The verdict is cached per (device, dtype); a failure's reason is logged once.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    key = (str(device), dtype)
    with _lock:
        verdict = _probes.get(key)
        if verdict is None:
            verdict = _probes[key] = _run_probe(device, dtype)
    if not verdict.ok:
        warn_once(f"cuTENSOR unusable for {dtype} on {device}: {verdict.reason}")
    return verdict


def reset_probes() -> None:
    """Forget cached probe verdicts (tests; a process whose environment changed)."""
    with _lock:
        _probes.clear()
        _stride0_c.clear()
        _logged.clear()


def _run_probe(device: torch.device, dtype: torch.dtype) -> Probe:
    if device.type not in DEVICE_TYPES:
        return Probe(False, "cuTENSOR runs on CUDA devices only")
    try:
        load_nvmath()
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(2, 3, 8, device=device, generator=g).to(dtype)
        b = torch.randn(8, 4, device=device, generator=g).to(dtype)
        full, broadcast = torch.randn(2, 3, 4, device=device, generator=g).to(dtype), torch.ones(4, device=device)
        for c in (full, broadcast.to(dtype)):  # C as its own tensor, and as a stride-0 expanded bias
            stats = dict(_stats)
            out = _execute("bmk,kn->bmn", a, b, c, 0.5, 2.0)
            _stats.update(stats)  # the probe's plans are not the user's
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # surface asynchronous launch errors here, not later
            ref = 0.5 * torch.einsum("bmk,kn->bmn", a.float(), b.float()) + 2.0 * c.float()
            if out is None or not torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2):
                return Probe(False, "the probe contraction returned wrong values")
    except Exception as e:  # whatever nvmath/cuTENSOR raise: the backend is unusable, not the model
        return Probe(False, _one_line(e))
    return Probe(True)


def cache_stats() -> dict[str, int]:
    """Counts of plans created, cache hits, fallbacks to torch and caught errors (benchmark, tests)."""
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
        if plan is not _FAILED:
            plan.free()


def _alignment(t: torch.Tensor) -> int:
    # nvmath records the operand pointer alignment at planning and refuses rebinding to a different one.
    ptr = t.data_ptr()
    return 256 if ptr == 0 else min(ptr & -ptr, 256)


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
    """``alpha * einsum(equation, a, b) + beta * c`` on cuTENSOR, or None if the caller must fall back.

    Never raises for a cuTENSOR problem: an unsupported problem or a planning/execution error is logged
    (once per reason), counted in ``cache_stats()["errors"]`` and answered with None.
    """
    try:
        return _execute(equation, a, b, c, alpha, beta)
    except Exception as e:
        with _lock:
            _stats["errors"] += 1
        shapes = f"{tuple(a.shape)}, {tuple(b.shape)}"
        warn_once(f"cuTENSOR failed on {equation!r} ({a.dtype}, shapes {shapes}): {_one_line(e)}")
        return None


def _execute(
    equation: str,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    alpha: float,
    beta: float,
) -> torch.Tensor | None:
    canon = canonicalize(equation, a, b)
    if canon is None:
        with _lock:
            _stats["fallbacks"] += 1
        return None
    eq, a, b = canon
    out_subs = eq.split("->")[1]
    sizes = dict(zip(eq.split("->")[0].replace(",", ""), (*a.shape, *b.shape), strict=True))
    out = torch.empty([sizes[ch] for ch in out_subs], dtype=a.dtype, device=a.device)
    if c is None or beta == 0.0:
        c = None
    elif tuple(c.shape) != tuple(out.shape):
        # C must carry every output mode. Expanding keeps one rounding (bias added in FP32 before the
        # cast) without a copy; where cuTENSOR refuses stride 0, a full-size copy does the same.
        c = c.expand(out.shape)
        if not _stride0_c.get(str(a.device), True):
            c = c.contiguous()
    stream = torch.cuda.current_stream(a.device) if a.device.type == "cuda" else None
    try:
        return _run(eq, a, b, c, out, alpha, beta, stream)
    except Exception:
        if c is None or c.is_contiguous() or 0 not in c.stride():
            raise
        with _lock:
            _stride0_c[str(a.device)] = False
        return _run(eq, a, b, c.contiguous(), out, alpha, beta, stream)


def _run(
    eq: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, out: torch.Tensor,
    alpha: float, beta: float, stream: Any,
) -> torch.Tensor | None:  # fmt: skip
    tensors = {"a": a, "b": b, "c": c, "out": out}
    key = _key(eq, tensors)
    with _lock:
        plan = _plans.get(key)
        if plan is _FAILED:
            _stats["fallbacks"] += 1
            return None
        try:
            if plan is None:
                plan = _make_plan(eq, a, b, c, out, stream)
                _plans[key] = plan
                _stats["plans"] += 1
                if len(_plans) > MAX_PLANS:
                    _free(_plans.popitem(last=False)[1])
            else:
                _plans.move_to_end(key)
                _stats["hits"] += 1
                plan.reset_operands(a=a, b=b, c=c, out=out, stream=stream)
        except Exception:
            _plans[key] = _FAILED
            raise
        try:
            plan.execute(alpha=alpha, beta=beta if c is not None else None, release_workspace=True, stream=stream)
        except Exception:
            _free(_plans.pop(key))
            _plans[key] = _FAILED
            raise
        finally:
            # Unbind so the cache does not keep these tensors alive between calls.
            with contextlib.suppress(Exception):
                plan.reset_operands(a=None, b=None, c=None, out=None, stream=stream)
    return out


def _make_plan(
    eq: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, out: torch.Tensor, stream: Any
) -> Any:
    nvmath = load_nvmath()  # lazy: only CUDA users with the cutensor extra reach this
    plan = nvmath.tensor.BinaryContraction(eq, a, b, c=c, out=out, stream=stream)
    try:
        plan.plan(stream=stream)
    except Exception:
        _free(plan)
        raise
    return plan
