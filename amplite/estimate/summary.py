"""The report's ``estimate`` section: FP32, torch.autocast and amplite on one GPU profile."""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram

from amplite.estimate.autocast import autocast_costs
from amplite.estimate.cost import NodeCost, graph_costs
from amplite.estimate.profiles import DEFAULT_PROFILE, get_profile

LABEL = "an estimate, not a measurement"


def _parameters(program: ExportedProgram) -> set[str]:
    sig = program.graph_signature
    return {*sig.inputs_to_parameters, *sig.inputs_to_buffers, *sig.inputs_to_lifted_tensor_constants}


def _total(costs: list[NodeCost]) -> float:
    return sum(c.seconds for c in costs)


def estimate(
    original: ExportedProgram,
    converted: ExportedProgram,
    low_dtype: torch.dtype,
    *,
    profile: str = DEFAULT_PROFILE,
    tf32: bool = False,
    top: int = 10,
) -> dict[str, Any]:
    """Estimated GPU time of the FP32 program, autocast's run of it, and the converted program.

    Args:
        original: The FP32 program.
        converted: amplite's converted program.
        low_dtype: fp16 or bf16 (autocast's dtype too).
        profile: GPU profile name (``amplite.estimate.profiles.PROFILES``).
        tf32: Let FP32 contractions use TF32 (FP32 and the FP32 islands alike).
        top: How many of the converted program's most expensive nodes to list.

    Returns:
        The report section: device, seconds per variant, ratios, top nodes, cast and FP32-island shares.
    """
    gpu = get_profile(profile)
    fp32 = graph_costs(original.graph, gpu, tf32=tf32)
    amp = autocast_costs(original.graph, low_dtype, gpu, _parameters(original), tf32=tf32)
    ours = graph_costs(converted.graph, gpu, tf32=tf32)
    seconds = {"fp32": _total(fp32), "autocast": _total(amp), "amplite": _total(ours)}
    total = seconds["amplite"] or 1.0
    ranked = sorted(ours, key=lambda c: c.seconds, reverse=True)[:top]
    return {
        "label": LABEL,
        "device": gpu.name,
        "profile": gpu.to_dict(),
        "tf32": tf32,
        "seconds": {k: round(v, 9) for k, v in seconds.items()},
        "kernels": {"fp32": len(fp32), "autocast": len(amp), "amplite": len(ours)},
        "ratio_vs_fp32": round(seconds["amplite"] / seconds["fp32"], 4) if seconds["fp32"] else None,
        "ratio_vs_autocast": round(seconds["amplite"] / seconds["autocast"], 4) if seconds["autocast"] else None,
        "cast_share": round(sum(c.seconds for c in ours if c.kind == "cast") / total, 4),
        "fp32_island_share": round(
            sum(c.seconds for c in ours if c.kind != "cast" and c.dtype == "float32") / total, 4
        ),
        "autocast_casts": sum(1 for c in amp if c.kind == "cast"),
        "top_nodes": [
            {**c.to_dict(), "share": round(c.seconds / total, 4)} for c in ranked
        ],
    }


def summary_line(section: dict[str, Any]) -> str:
    """``estimated on H100: 0.42× FP32, 0.88× autocast — an estimate, not a measurement``."""
    parts = []
    if section.get("ratio_vs_fp32") is not None:
        parts.append(f"{section['ratio_vs_fp32']:.2f}× FP32")
    if section.get("ratio_vs_autocast") is not None:
        parts.append(f"{section['ratio_vs_autocast']:.2f}× autocast")
    return f"estimated on {section['device']}: {', '.join(parts)} — {section['label']}"
