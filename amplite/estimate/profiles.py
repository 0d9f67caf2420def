"""GPU profiles for the time estimate, as data: dense peak throughput, memory bandwidth, launch overhead.

Peaks are the vendors' dense (no structured sparsity) figures for the SXM/PCIe part named; tensor-core
fp16/bf16 figures are with FP32 accumulation (what fp16/bf16 GEMMs and convolutions use). The launch
overhead is a typical measured per-kernel cost with CUDA graphs off (2-5 µs on recent drivers); it is
the least certain number here and the same for every part.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from amplite.errors import ConfigError


@dataclass(frozen=True)
class GpuProfile:
    """One device's roofline parameters.

    Attributes:
        name: Profile name (``--gpu-profile``).
        fp32_tflops: FP32 on CUDA cores (non-tensor-core), TFLOP/s.
        tf32_tflops: TF32 tensor cores (FP32 matmuls with TF32 allowed), TFLOP/s.
        fp16_tflops: fp16 tensor cores, FP32 accumulation, TFLOP/s.
        bf16_tflops: bf16 tensor cores, FP32 accumulation, TFLOP/s.
        bandwidth_gbs: DRAM bandwidth, GB/s.
        launch_us: Per-kernel launch overhead, µs.
        source: Where the numbers come from.
    """

    name: str
    fp32_tflops: float
    tf32_tflops: float
    fp16_tflops: float
    bf16_tflops: float
    bandwidth_gbs: float
    launch_us: float
    source: str

    def to_dict(self) -> dict[str, float | str]:
        """The profile as report data."""
        return asdict(self)


_LAUNCH_US = 4.0

PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        GpuProfile("H100", 67.0, 494.7, 989.4, 989.4, 3350.0, _LAUNCH_US,
                   "NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense figures; HBM3 3.35 TB/s)"),
        GpuProfile("H200", 67.0, 494.7, 989.4, 989.4, 4800.0, _LAUNCH_US,
                   "NVIDIA H200 Tensor Core GPU datasheet (SXM, dense figures; HBM3e 4.8 TB/s)"),
        GpuProfile("A100", 19.5, 156.0, 312.0, 312.0, 2039.0, _LAUNCH_US,
                   "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM, dense figures; HBM2e 2,039 GB/s)"),
        GpuProfile("L4", 30.3, 60.0, 121.0, 121.0, 300.0, _LAUNCH_US,
                   "NVIDIA L4 Tensor Core GPU datasheet (dense = half the sparsity figures; GDDR6 300 GB/s)"),
        GpuProfile("RTX4090", 82.6, 82.6, 165.2, 165.2, 1008.0, _LAUNCH_US,
                   "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090 (dense, FP32 accumulate; 1,008 GB/s)"),
    )
}  # fmt: skip

DEFAULT_PROFILE = "H100"

_ALIASES = {"h100-sxm": "H100", "h100sxm": "H100", "a100-80gb": "A100", "a100-80": "A100", "rtx-4090": "RTX4090",
            "4090": "RTX4090"}  # fmt: skip


def get_profile(name: str) -> GpuProfile:
    """The profile called ``name`` (case-insensitive; ``H100-SXM``, ``A100-80GB``, ``RTX-4090`` also work).

    Raises:
        ConfigError: Unknown name (the message lists the known ones).
    """
    key = name.strip()
    for known in PROFILES:
        if known.lower() == key.lower():
            return PROFILES[known]
    alias = _ALIASES.get(key.lower())
    if alias:
        return PROFILES[alias]
    raise ConfigError(f"unknown GPU profile {name!r}", f"use one of: {', '.join(PROFILES)}")
