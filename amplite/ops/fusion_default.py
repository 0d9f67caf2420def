"""What ``--fuse-contractions auto`` (the default) means: fuse only where a measurement showed it pays.

Fusing contractions into ``amplite::contract`` is a speed decision, not an accuracy one. Whether it pays
depends on the GPU, on the backend the op runs on there (cuTENSOR, or the ``torch`` GEMM fallback) and on
the dtype, so ``auto`` looks that triple up in the measurement table
(:data:`amplite.ops.fusion_measurements.MEASUREMENTS`, filled from ``bench/gpu_suite.py`` runs) and fuses
only when the entry found says the fused models were faster. The reason, recorded in the report's
``config.fuse_contractions_reason``, names the measurement that decided, or why none could:

* no CUDA device (fusion is measured on GPUs only);
* no entry for this (GPU, backend, dtype), e.g. an empty table;
* an entry measuring fusion slower (unfused/fused ≤ 1).

When the conversion's dtype is not known (``amplite batch`` resolves ``auto`` once for every manifest
entry), fp16 and bf16 must both be measured faster. ``on`` / ``off`` (or ``True`` / ``False`` from the
Python API) force the choice.
"""

from __future__ import annotations

import torch

from amplite.errors import ConfigError
from amplite.ops.fusion_measurements import Measurement

CHOICES = ("auto", "on", "off")
LOW_DTYPES = (torch.float16, torch.bfloat16)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def lookup(device_name: str, backend: str, dtype: torch.dtype) -> Measurement | None:
    """The table's entry for (GPU, backend, dtype); the longest matching device substring wins."""
    from amplite.ops import fusion_measurements

    found = [
        m for m in fusion_measurements.MEASUREMENTS
        if m.device in device_name and m.backend == backend and m.dtype == _dtype_name(dtype)
    ]  # fmt: skip
    return max(found, key=lambda m: len(m.device)) if found else None


def _decide(name: str, dtype: torch.dtype) -> tuple[bool, str]:
    from amplite.ops.contract import active_backend

    try:
        backend = active_backend("cuda", dtype)
    except (RuntimeError, ValueError) as e:  # AMPLITE_CONTRACT_BACKEND=cutensor with cuTENSOR unusable, or bad
        return False, f"no usable contraction backend ({e})"
    m = lookup(name, backend, dtype)
    triple = f"({name}, {backend}, {_dtype_name(dtype)})"
    if m is None:
        return False, f"no measurement for {triple} in amplite/ops/fusion_measurements.py"
    verdict = "faster" if m.unfused_over_fused > 1.0 else "not faster"
    return m.unfused_over_fused > 1.0, (
        f"fusion measured {verdict} for {triple}: unfused/fused {m.unfused_over_fused:.2f} ({m.source})"
    )


def resolve(choice: bool | str | None, dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """Whether to fuse for ``choice`` (``auto``/``on``/``off`` or a bool), and why, for the report.

    Args:
        choice: The user's choice; None means ``auto``.
        dtype: The conversion's low-precision dtype; None (or a dtype the table cannot hold, FP8) asks
            for fp16 and bf16 both to be measured faster.

    Raises:
        ConfigError: For a choice other than those .
    """
    if isinstance(choice, bool):
        return choice, "on (requested)" if choice else "off (requested)"
    value = "auto" if choice is None else str(choice).strip().lower()
    if value not in CHOICES:
        raise ConfigError(
            f"unknown fuse-contractions choice {choice!r}; expected one of {', '.join(CHOICES)}",
            "use --fuse-contractions auto, on or off",
        )
    if value != "auto":
        return value == "on", f"{value} (requested)"
    if not torch.cuda.is_available():
        return False, "auto: off (no CUDA device; fusion is measured on GPUs only)"
    name = torch.cuda.get_device_name()
    reasons = []
    for dt in (dtype,) if dtype in LOW_DTYPES else LOW_DTYPES:
        on, why = _decide(name, dt)
        if not on:
            return False, f"auto: off ({why})"
        reasons.append(why)
    return True, f"auto: on ({'; '.join(reasons)})"
