"""Per-node roofline cost of an exported graph: FLOPs, bytes moved, and time on a GPU profile.

For each ``call_function`` node: FLOPs (``2·M·N·K`` for matmuls, ``2·out·(C_in/groups)·kernel`` for
convolutions, ``4·B·H·L·S·E`` for attention, one per output element otherwise) and bytes (every tensor
operand read plus every output written, at the dtype the graph gives them: weights at their stored
dtype). Time = max(FLOPs / peak, bytes / bandwidth) + one launch. Contractions in fp16/bf16 use the
tensor-core peak, FP32 contractions the CUDA-core FP32 peak (or TF32 when allowed), everything else the
FP32 CUDA-core peak (it is bandwidth-bound anyway; elementwise ops count one FLOP per output
element, reductions one per input element). Views cost nothing and launch nothing.

Symbolic sizes (dynamic batch) are evaluated at their example hints, never guarded on: the estimate
must not specialise the program it reads.
"""

from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx

from amplite import op_tables
from amplite.converter.graph_stats import node_compute_dtype, short, size_hint
from amplite.estimate.profiles import GpuProfile
from amplite.ops.fp8_linear import fp8_linear
from amplite.passes.graph_utils import cast_dtype, fake_value

MATMULS = frozenset(
    ("mm.default", "bmm.default", "addmm.default", "baddbmm.default", "matmul.default", "linear.default",
     "addmv.default", "mv.default", "addbmm.default")
)  # fmt: skip
CONVS = frozenset(op for op in op_tables.LOW_PRECISION_OPS if "conv" in op)
ATTENTION = frozenset(("scaled_dot_product_attention.default",))
#: Ops that only reinterpret their input (no kernel, no bytes).
VIEWS = frozenset(
    ("view.default", "_unsafe_view.default", "reshape.default", "permute.default", "transpose.int", "t.default",
     "expand.default", "unsqueeze.default", "squeeze.dim", "squeeze.dims", "squeeze.default", "slice.Tensor",
     "select.int", "alias.default", "detach.default", "split.Tensor", "split_with_sizes.default", "chunk.default",
     "unbind.int", "as_strided.default", "unflatten.int", "flatten.using_ints", "lift_fresh_copy.default",
     "dropout.default", "_assert_tensor_metadata.default", "sym_size.int", "sym_numel.default")
)  # fmt: skip
_NO_FLOPS = frozenset(op_tables.DATA_MOVEMENT_OPS) | {
    "embedding.default", "index.Tensor", "gather.default", "index_select.default", "cat.default", "stack.default",
    "clone.default", "contiguous.default", "copy.default", "_to_copy.default", "to.dtype", "zeros_like.default",
}  # fmt: skip


def hint(size: Any) -> int:
    """An int for a size, taking a symbolic size's example hint (no guard is recorded)."""
    return size_hint(size)


def numel(t: torch.Tensor) -> int:
    """Element count of a (possibly symbolic) tensor at its example sizes."""
    return math.prod(hint(s) for s in t.shape)


def nbytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes of a tensor at ``dtype`` (default: its own)."""
    return numel(t) * (dtype or t.dtype).itemsize


@dataclass
class NodeCost:
    """The estimated cost of one node.

    Attributes:
        node: Node name.
        op: ATen op (``linear.default``) or the target's name.
        dtype: The dtype it computes in (``float16``, ``float32``, ``other``).
        kind: ``contraction``, ``cast``, ``other``.
        flops: Floating-point operations.
        bytes: Bytes read and written.
        seconds: Estimated time, launch included.
    """

    node: str
    op: str
    dtype: str
    kind: str
    flops: float
    bytes: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """As report data."""
        return asdict(self)


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a node value (a tensor, or a tuple/list of them)."""
    vals = value if isinstance(value, (tuple, list)) else [value]
    return [v for v in vals if isinstance(v, torch.Tensor)]


def contraction_flops(op: str, node: torch.fx.Node, out_numel: int) -> float:
    """FLOPs of a matmul, convolution or attention node (0 when the operands are not readable)."""
    try:
        if op in MATMULS:
            a = fake_value(node.args[1] if op in ("addmm.default", "baddbmm.default", "addbmm.default",
                                                  "addmv.default") else node.args[0])  # fmt: skip
            return 2.0 * out_numel * hint(a.shape[-1])
        if op in CONVS:
            w = fake_value(node.args[1])
            return 2.0 * out_numel * numel(w) / hint(w.shape[0])
        if op in ATTENTION:
            q, k = fake_value(node.args[0]), fake_value(node.args[1])
            return 4.0 * numel(q) * hint(k.shape[-2])
        if node.target is fp8_linear._opoverload:  # x [..., K] @ w[N, K].T
            return 2.0 * out_numel * hint(fake_value(node.args[0]).shape[-1])
        if op == "einsum.default" or _is_contract(node):
            return _einsum_flops(node, out_numel)
    except (TypeError, AttributeError, IndexError, ValueError):
        return float(out_numel)
    return float(out_numel)


def _is_contract(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "amplite"


def _einsum_flops(node: torch.fx.Node, out_numel: int) -> float:
    """2 × the size of the full index space (every contracted index times every output element)."""
    equation = next((a for a in node.args if isinstance(a, str)), None)
    operands = [fake_value(a) for a in node.all_input_nodes if isinstance(fake_value(a), torch.Tensor)]
    if equation is None or "->" not in equation:
        return 2.0 * out_numel
    inputs, output = equation.replace(" ", "").split("->")
    sizes: dict[str, int] = {}
    for spec, t in zip(inputs.split(","), operands, strict=False):
        for letter, s in zip(spec.replace("...", ""), t.shape[-len(spec.replace("...", "")):], strict=False):
            sizes[letter] = hint(s)
    contracted = math.prod(sizes[c] for c in set(sizes) - set(output))
    return 2.0 * out_numel * contracted


#: Profiles with FP8 tensor cores (Hopper, Ada), which run e4m3 products at twice their dense bf16 rate;
#: elsewhere (A100) ``_scaled_mm`` has no kernel and an FP8 product is estimated at bf16's rate.
FP8_TENSOR_CORES = frozenset({"H100", "H200", "L4", "RTX4090"})


def peak_tflops(profile: GpuProfile, dtype: torch.dtype | None, contraction: bool, tf32: bool) -> float:
    """The peak a node runs against: tensor cores for low-precision contractions, else CUDA cores."""
    if contraction and dtype == torch.float8_e4m3fn:
        return profile.bf16_tflops * (2 if profile.name in FP8_TENSOR_CORES else 1)
    if contraction and dtype == torch.float16:
        return profile.fp16_tflops
    if contraction and dtype == torch.bfloat16:
        return profile.bf16_tflops
    if contraction and tf32 and dtype == torch.float32:
        return profile.tf32_tflops
    return profile.fp32_tflops


def roofline_seconds(flops: float, nbytes_: float, peak: float, profile: GpuProfile) -> float:
    """max(compute, memory) time of one kernel plus its launch."""
    return max(flops / (peak * 1e12), nbytes_ / (profile.bandwidth_gbs * 1e9)) + profile.launch_us * 1e-6


def node_cost(node: torch.fx.Node, profile: GpuProfile, *, tf32: bool = False) -> NodeCost | None:
    """The cost of one node of an exported graph as it stands (dtypes from its fake values).

    Returns None for nodes that launch nothing (placeholders, outputs, getitem, views).
    """
    if node.op != "call_function" or node.target is operator.getitem:
        return None
    op = op_tables.op_name(node.target) or getattr(node.target, "__name__", str(node.target))
    if op in VIEWS:
        return None
    outs = tensors(fake_value(node))
    if not outs:
        return None
    reads = [fake_value(a) for a in node.all_input_nodes]
    moved = float(sum(nbytes(t) for t in tensors(reads)) + sum(nbytes(t) for t in outs))
    out_numel = sum(numel(t) for t in outs)
    if cast_dtype(node) is not None:
        return NodeCost(node.name, op, short(outs[0].dtype), "cast", 0.0, moved,
                        roofline_seconds(0.0, moved, profile.fp32_tflops, profile))  # fmt: skip
    dtype = node_compute_dtype(node)
    contraction = op in MATMULS or op in CONVS or op in ATTENTION or op == "einsum.default" or _is_contract(node)
    if contraction:
        flops = contraction_flops(op, node, out_numel)
    else:  # elementwise: one per output element; reductions: one per input element
        flops = 0.0 if op in _NO_FLOPS else float(max([out_numel, *(numel(t) for t in tensors(reads))]))
    peak = peak_tflops(profile, dtype, contraction, tf32)
    kind = "contraction" if contraction else "other"
    return NodeCost(node.name, op, short(dtype), kind, flops, moved, roofline_seconds(flops, moved, peak, profile))


def graph_costs(graph: torch.fx.Graph, profile: GpuProfile, *, tf32: bool = False) -> list[NodeCost]:
    """Every launching node's cost, in graph order."""
    return [c for n in graph.nodes if (c := node_cost(n, profile, tf32=tf32)) is not None]
