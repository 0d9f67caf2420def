"""The same roofline applied to ``torch.autocast``'s execution of the FP32 graph.

autocast decides per op at run time: ops on its lower-precision list run in the low dtype (each FP32
float operand is cast first; casts of parameters are cached for the forward, casts of activations are
not), ops on its FP32 list run in FP32 (low operands cast up), and every other op runs in the dtype its
operands promote to (mixed operands promote inside the kernel, no cast). amplite's op tables follow
autocast's CUDA lists (``amplite.op_tables``), so they stand in for them here; CPU autocast differs and
is not what a GPU estimate models.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from amplite import op_tables
from amplite.converter.graph_stats import short
from amplite.estimate.cost import (
    ATTENTION,
    CONVS,
    MATMULS,
    VIEWS,
    NodeCost,
    contraction_flops,
    hint,
    numel,
    peak_tflops,
    roofline_seconds,
    tensors,
)
from amplite.estimate.profiles import GpuProfile
from amplite.passes.graph_utils import fake_value

_LOW = frozenset(op_tables.LOW_PRECISION_OPS)
_FP32 = frozenset(op for ops in op_tables.FP32_OPS.values() for op in ops)


def autocast_costs(
    graph: torch.fx.Graph, low_dtype: torch.dtype, profile: GpuProfile, parameters: set[str], *, tf32: bool = False
) -> list[NodeCost]:
    """The cost of running the FP32 ``graph`` under autocast to ``low_dtype``, casts included.

    Args:
        graph: The FP32 program's graph (lifted parameters are placeholders).
        low_dtype: autocast's dtype.
        profile: The GPU profile.
        parameters: Placeholder names that are parameters or buffers (their casts are cached).
        tf32: FP32 contractions may use TF32.
    """
    dtype: dict[torch.fx.Node, torch.dtype] = {}
    cached: set[tuple[str, torch.dtype]] = set()
    costs: list[NodeCost] = []
    for node in graph.nodes:
        val = fake_value(node)
        if node.op == "placeholder":
            if isinstance(val, torch.Tensor):
                dtype[node] = val.dtype
            continue
        if node.op != "call_function":
            continue
        floats = [a for a in node.all_input_nodes if a in dtype and dtype[a].is_floating_point]
        op = op_tables.op_name(node.target) or ""
        if node.target is operator.getitem:
            if node.args[0] in dtype and isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
                dtype[node] = dtype[node.args[0]]
            elif isinstance(val, torch.Tensor):
                dtype[node] = val.dtype
            continue
        if op in _LOW or op in _FP32:
            target = low_dtype if op in _LOW else torch.float32
            for a in floats:
                if dtype[a] != target and not (a.name in parameters and (a.name, target) in cached):
                    if a.name in parameters:
                        cached.add((a.name, target))
                    costs.append(_cast(a, dtype[a], target, profile))
            compute = target
        elif floats:
            compute = dtype[floats[0]]
            for a in floats[1:]:
                compute = torch.promote_types(compute, dtype[a])
        else:
            compute = val.dtype if isinstance(val, torch.Tensor) else None
        outs = tensors(val)
        for t in outs[:1]:
            dtype[node] = compute if (compute is not None and t.dtype.is_floating_point) else t.dtype
        if op in VIEWS or not outs:
            continue
        reads = sum(numel(fake_value(a)) * (compute if a in floats and compute else fake_value(a).dtype).itemsize
                    for a in node.all_input_nodes if isinstance(fake_value(a), torch.Tensor))  # fmt: skip
        out_dtype = dtype.get(node, outs[0].dtype)
        writes = sum(numel(t) * (out_dtype if t.dtype.is_floating_point else t.dtype).itemsize for t in outs)
        contraction = op in MATMULS or op in CONVS or op in ATTENTION or op == "einsum.default"
        out_numel = sum(numel(t) for t in outs)
        flops = contraction_flops(op, node, out_numel) if contraction else float(out_numel)
        seconds = roofline_seconds(flops, reads + writes, peak_tflops(profile, compute, contraction, tf32), profile)
        kind = "contraction" if contraction else "other"
        costs.append(NodeCost(node.name, op, short(compute), kind, flops, float(reads + writes), seconds))
    return costs


def _cast(node: torch.fx.Node, src: torch.dtype, dst: torch.dtype, profile: GpuProfile) -> NodeCost:
    n = numel(fake_value(node))
    moved = float(n * (src.itemsize + dst.itemsize))
    return NodeCost(f"autocast_cast({node.name})", "_to_copy.default", short(dst), "cast", 0.0, moved,
                    roofline_seconds(0.0, moved, profile.fp32_tflops, profile))  # fmt: skip


__all__ = ["autocast_costs", "hint"]
