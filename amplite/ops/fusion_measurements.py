"""The measurements ``--fuse-contractions auto`` decides from: data, one entry per measured configuration.

Each entry is one ``bench/gpu_suite.py`` run's "fusion pays" figure for one (GPU, contraction backend,
dtype): the median over the suite's transformer models of unfused latency / fused latency (> 1: fusion was
faster), with where it is recorded. The suite prints the entries of its run in this form (section "fusion
measurements"); copy them here only from a complete run whose figures are in bench/RESULTS-gpu.md.

No GPU run has measured fusion with cuTENSOR or with the GEMM fallback yet (the only GPU figure, 0.56
from the 2026 H200 smoke run, was taken with the old FP32-upcast einsum fallback, which is gone), so the
table is empty and ``auto`` means off everywhere, saying so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measurement:
    """One measured configuration.

    Attributes:
        device: A substring of ``torch.cuda.get_device_name()`` (``"H100"``, ``"H200"``).
        backend: The ``amplite::contract`` backend that ran: ``"cutensor"`` or ``"torch"``.
        dtype: ``"float16"`` or ``"bfloat16"``.
        unfused_over_fused: Median unfused / fused latency over the suite's models (> 1: fusion faster).
        source: Where the figure is recorded (file, section, date, versions).
    """

    device: str
    backend: str
    dtype: str
    unfused_over_fused: float
    source: str


MEASUREMENTS: tuple[Measurement, ...] = ()
