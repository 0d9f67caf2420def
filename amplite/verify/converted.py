"""``amplite check --converted``: load an already converted .pt2 and describe it in a report.

The report of a converted file holds the reference's facts (source, graph before, weights before) and what
the converted graph itself shows: its precision, per-node dtypes (the plan) and weight bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from amplite.converter.emit import Recorded
from amplite.converter.graph_stats import graph_stats, node_compute_dtype, weight_bytes
from amplite.errors import LoadError
from amplite.levels import split_precision
from amplite.passes.graph_utils import cast_dtype, module_path, source_line


def load_converted(converted: str | Path | ExportedProgram) -> ExportedProgram:
    """The program of ``converted`` (a .pt2 path, or a program passed through).

    Raises:
        LoadError: The file is not a .pt2 program.
    """
    if isinstance(converted, ExportedProgram):
        return converted
    from amplite.converter.loading import load_model

    loaded = load_model(converted)
    if loaded.program is None:
        raise LoadError(f"--converted {str(converted)!r} is not a .pt2 program", "pass the .pt2 `convert` wrote")
    return loaded.program


def infer_precision(program: ExportedProgram) -> str:
    """fp16, bf16 or fp8: the low dtype the converted graph computes in (fp16 when it has none); fp8 when
    any product runs in ``float8_e4m3fn`` (``--precision fp8``)."""
    stats = graph_stats(program.graph)["nodes_by_dtype"]
    if stats.get("float8_e4m3fn", 0):
        return "fp8"
    return "bf16" if stats.get("bfloat16", 0) > stats.get("float16", 0) else "fp16"


def infer_level(program: ExportedProgram, precision: str) -> str:
    """The level a converted graph shows: O0 (nothing low), O3 (FP32-list ops such as softmax or norms run
    low), O2 (weights stored low), else O1. Weights ``fold_batchnorm`` made are left out: they may be
    stored low at O1 too."""
    from amplite import op_tables

    low = split_precision(precision)[0]
    fp32_list = {"low": 0, "fp32": 0}
    any_low = False
    for node in program.graph.nodes:
        if node.op != "call_function" or cast_dtype(node) is not None:
            continue
        dt = node_compute_dtype(node)
        any_low |= dt == low
        name = op_tables.op_name(node.target)
        if name and op_tables.fp32_reason(name) and dt in (low, torch.float32):
            fp32_list["low" if dt == low else "fp32"] += 1
    if not any_low:
        return "O0"
    if fp32_list["low"] and not fp32_list["fp32"]:
        return "O3"
    sig = program.graph_signature
    user = set(sig.parameters) | set(sig.buffers)
    floats = [t for k, t in program.state_dict.items() if k in user and t.is_floating_point()
              and not k.split(".")[-1].startswith("amplite_folded_")]  # fmt: skip
    low_bytes = sum(t.numel() * t.element_size() for t in floats if t.dtype == low)
    all_bytes = sum(t.numel() * t.element_size() for t in floats)
    return "O2" if all_bytes and low_bytes * 2 >= all_bytes else "O1"


@dataclass(frozen=True)
class ConvertedFacts:
    """What a converted file shows of its conversion (the gate puts them into the reference's report).

    Attributes:
        config: Over the reference's ``config``: what the file records (``recorded``), else what its graph
            shows (inferred level), and the precision and the file.
        plan: One plan entry per floating-point node, its mode and dtype as found.
        graph_after: ``graph_stats`` of the converted graph.
        weight_bytes: Bytes of its weights.
    """

    config: dict[str, Any]
    plan: list[dict[str, Any]]
    graph_after: dict[str, Any]
    weight_bytes: int


def converted_facts(conv: ExportedProgram, path: Any, precision: str,
                    recorded: Recorded | None = None) -> ConvertedFacts:  # fmt: skip
    """What a converted file shows: its ``config`` is what the file records of its conversion (``recorded``,
    from ``emit.read_conversion``), else what the graph shows (precision, inferred level)."""
    low = split_precision(precision)[0]
    plan = []
    for node in conv.graph.nodes:
        if node.op != "call_function" or cast_dtype(node) is not None:
            continue
        dt = node_compute_dtype(node)
        if dt is None or not dt.is_floating_point:
            continue
        mode = "low" if dt == low else ("fp32" if dt == torch.float32 else "follow")
        plan.append(
            {
                "node": node.name,
                "op": str(node.target).removeprefix("aten."),
                "module": module_path(node),
                "source": source_line(node),
                "mode": mode,
                "dtype": str(dt).removeprefix("torch."),
                "reason": "as found in the converted file",
            }
        )
    found = {"level": infer_level(conv, precision), "level_source": "inferred from the converted file"}
    if recorded is not None:
        found = {**recorded.spec.to_config(), "level_source": "recorded in the converted file"}
    config = {**found, "precision": precision,
              "converted": str(path) if not isinstance(path, ExportedProgram) else "program"}  # fmt: skip
    return ConvertedFacts(config, plan, graph_stats(conv.graph, low), weight_bytes(conv))
