"""Facts about a (converted) exported graph: which node computes in which dtype, casts, FLOP shares."""

from __future__ import annotations

import hashlib
import math
import operator
from collections import Counter
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch < 2.13 names it hint_int (same meaning: the size's hint, else the fallback)
    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint  # type: ignore[no-redef]

from amplite import op_tables
from amplite.passes.graph_utils import cast_dtype, fake_value

_LOW_OPS = frozenset(op_tables.LOW_PRECISION_OPS)
_MATMUL_LIKE = frozenset(
    ("mm.default", "bmm.default", "addmm.default", "baddbmm.default", "matmul.default", "linear.default")
)
_CONV_LIKE = frozenset(op for op in op_tables.LOW_PRECISION_OPS if "conv" in op)
#: Ops that move or gather data without arithmetic: they count zero FLOPs.
_NO_ARITHMETIC = frozenset(op_tables.DATA_MOVEMENT_OPS) | {
    "embedding.default", "index.Tensor", "gather.default", "index_select.default", "cat.default",
    "stack.default", "split.Tensor", "split_with_sizes.default", "chunk.default", "unbind.int",
}  # fmt: skip


def short(dtype: torch.dtype | None) -> str:
    """``float16`` for ``torch.float16``; ``other`` for None."""
    return str(dtype).removeprefix("torch.") if dtype is not None else "other"


def node_compute_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype a node computes in: its widest floating operand (dimensioned ones first), else its
    floating output's dtype, else None."""
    operands = [a for a in node.all_input_nodes if isinstance(fake_value(a), torch.Tensor)]
    floats = [a for a in operands if fake_value(a).dtype.is_floating_point]
    pool = [a for a in floats if fake_value(a).dim() > 0] or floats
    fp8 = [fake_value(a).dtype for a in pool if fake_value(a).dtype.itemsize == 1]
    if fp8:  # an e4m3 product (amplite::fp8_linear): its scales are FP32, its products e4m3
        return fp8[0]
    if pool:
        out = fake_value(pool[0]).dtype
        for a in pool[1:]:
            out = torch.promote_types(out, fake_value(a).dtype)
        return out
    val = fake_value(node)
    if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
        return val.dtype
    return None


def size_hint(value: Any) -> int:
    """A size as an int; a symbolic size (dynamic batch) evaluates at the example's value.

    ``int()`` on a ``SymInt`` would add a guard to the program's shape environment and specialise the
    dimension for good (the saved file would then reject any other batch); the optimisation hint reads the
    example's value without guarding.
    """
    return optimization_hint(value, fallback=1) if isinstance(value, torch.SymInt) else int(value)


def estimate_flops(node: torch.fx.Node) -> float:
    """Rough FLOPs of one node: 2·M·N·K for contractions and convolutions, else one per output element.

    Symbolic sizes count at the example's values (see :func:`size_hint`); nothing here guards on them.
    """
    val = fake_value(node)
    outs = [v for v in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(v, torch.Tensor)]
    try:
        out_numel = sum(size_hint(v.numel()) for v in outs)
    except (TypeError, RuntimeError):
        return 0.0
    op = op_tables.op_name(node.target)
    if op in _NO_ARITHMETIC:
        return 0.0
    try:
        if op in _MATMUL_LIKE:
            a = fake_value(node.args[1] if op in ("addmm.default", "baddbmm.default") else node.args[0])
            return 2.0 * out_numel * size_hint(a.shape[-1])
        if op in _CONV_LIKE:
            w = fake_value(node.args[1])
            return 2.0 * out_numel * size_hint(w.numel()) / size_hint(w.shape[0])
        if op == "scaled_dot_product_attention.default":
            q, k = fake_value(node.args[0]), fake_value(node.args[1])
            return 4.0 * math.prod(size_hint(s) for s in q.shape) * size_hint(k.shape[-2])
    except (TypeError, RuntimeError, AttributeError, IndexError):
        return float(out_numel)
    return float(out_numel)


def graph_stats(graph: torch.fx.Graph, low_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Counts for the report: nodes by compute dtype, float casts, low-precision FLOP share."""
    by_dtype: Counter[str] = Counter()
    casts = 0
    flops_total = flops_low = 0.0
    compute_ops: Counter[str] = Counter()
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        dt = cast_dtype(node)
        if dt is not None:
            src = fake_value(node.args[0])
            if isinstance(src, torch.Tensor) and src.dtype.is_floating_point and dt.is_floating_point:
                casts += 1
            continue
        compute = node_compute_dtype(node)
        by_dtype[short(compute)] += 1
        if compute is None:
            continue
        flops = estimate_flops(node)
        flops_total += flops
        if low_dtype is not None and compute == low_dtype:
            flops_low += flops
        if op_tables.op_name(node.target) in _LOW_OPS:
            compute_ops[short(compute)] += 1
    return {
        "nodes_by_dtype": dict(sorted(by_dtype.items())),
        "compute_bound_ops_by_dtype": dict(sorted(compute_ops.items())),
        "casts": casts,
        "low_precision_flop_share": (flops_low / flops_total) if flops_total else 0.0,
    }


def weight_bytes(program: ExportedProgram) -> int:
    """Bytes of every parameter, buffer and tensor constant the program carries."""
    total = sum(t.nbytes for t in program.state_dict.values() if isinstance(t, torch.Tensor))
    total += sum(t.nbytes for t in program.constants.values() if isinstance(t, torch.Tensor))
    return total


def graph_fingerprint(program: ExportedProgram) -> str:
    """A short hash of what identifies a model: its ops in graph order and its weights' names and shapes.

    Input sizes are left out (the same model verified on another batch size has the same fingerprint);
    two reports with different fingerprints describe different models (``check --baseline`` refuses them).
    """
    h = hashlib.sha256()
    for node in program.graph.nodes:
        if node.op == "call_function":
            h.update(str(node.target).encode() + b";")
    for name, t in sorted(program.state_dict.items()):
        if isinstance(t, torch.Tensor):
            h.update(f"{name}:{tuple(t.shape)};".encode())
    return h.hexdigest()[:16]
