"""Op tables of the precision policy, as data.

Every entry is an ATen overload name (``namespace::op.overload`` minus the ``aten::``). The lists follow
torch.autocast's CUDA lists (aten/src/ATen/autocast_mode.cpp) and extend them where an ahead-of-time
rewrite sees more: the training IR that torch.export produces keeps high-level ops (``linear``,
``layer_norm``, ``scaled_dot_product_attention``), and decomposed norms show up as pow/mean/rsqrt, each of
which is listed here so a written-out RMSNorm stays FP32 too.

``tests/test_op_tables.py`` checks that every entry resolves in the installed torch.
"""

from __future__ import annotations

from functools import cache

import torch

#: Compute-bound ops that gain from fp16/bf16 tensor cores: run in low precision from O1 up.
LOW_PRECISION_OPS: tuple[str, ...] = (
    "mm.default",
    "bmm.default",
    "addmm.default",
    "addbmm.default",
    "baddbmm.default",
    "addmv.default",
    "addr.default",
    "mv.default",
    "matmul.default",
    "linear.default",
    "einsum.default",
    "chain_matmul.default",
    "linalg_multi_dot.default",
    "linalg_vecdot.default",
    "conv1d.default",
    "conv2d.default",
    "conv3d.default",
    "conv1d.padding",
    "conv2d.padding",
    "conv3d.padding",
    "convolution.default",
    "_convolution.default",
    "_convolution.deprecated",  # the 12-argument signature autocast lists too
    "conv_tbc.default",
    "conv_transpose1d.default",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "prelu.default",
    "scaled_dot_product_attention.default",
    "lstm.input",
    "gru.input",
    "rnn_tanh.input",
    "rnn_relu.input",
    "lstm_cell.default",
    "gru_cell.default",
    "rnn_tanh_cell.default",
    "rnn_relu_cell.default",
)

#: Ops that stay FP32 at O1 and O2, grouped by why. The group name is the reason in the report.
FP32_OPS: dict[str, tuple[str, ...]] = {
    # Long sums lose low-order bits in fp16 and overflow its range; accumulate in FP32.
    "reduction": (
        "sum.default",
        "sum.dim_IntList",
        "mean.default",
        "mean.dim",
        "var.default",
        "var.dim",
        "var.correction",
        "std.default",
        "std.dim",
        "std.correction",
        "var_mean.correction",
        "std_mean.correction",
        "norm.Scalar",
        "norm.ScalarOpt_dim",
        "linalg_vector_norm.default",
        "frobenius_norm.dim",
        "prod.default",
        "prod.dim_int",
        "cumsum.default",
        "cumprod.default",
        "logsumexp.default",
        "cosine_similarity.default",
        "dist.default",
        "cdist.default",
        "pdist.default",
        "renorm.default",
    ),
    # exp() of the logits overflows fp16 above ~11; the normaliser is a long sum.
    "softmax": (
        "softmax.int",
        "_softmax.default",
        "_safe_softmax.default",
        "log_softmax.int",
        "_log_softmax.default",
    ),
    # Mean/variance statistics and their reciprocal square root need FP32's precision.
    "norm": (
        "layer_norm.default",
        "native_layer_norm.default",
        "group_norm.default",
        "native_group_norm.default",
        "batch_norm.default",
        "native_batch_norm.default",
        "_native_batch_norm_legit_no_training.default",
        "_native_batch_norm_legit.default",
        "_native_batch_norm_legit_functional.default",
        "instance_norm.default",
        "rms_norm.default",
    ),
    # Losses are reductions over a batch, often of logs.
    "loss": (
        "cross_entropy_loss.default",
        "nll_loss.default",
        "nll_loss_nd.default",
        "nll_loss2d.default",
        "mse_loss.default",
        "l1_loss.default",
        "smooth_l1_loss.default",
        "huber_loss.default",
        "kl_div.default",
        "binary_cross_entropy.default",
        "binary_cross_entropy_with_logits.default",
        "soft_margin_loss.default",
        "margin_ranking_loss.default",
        "hinge_embedding_loss.default",
        "cosine_embedding_loss.default",
        "poisson_nll_loss.default",
        "triplet_margin_loss.default",
        "multilabel_margin_loss.default",
        "multi_margin_loss.default",
    ),
    # Large dynamic range in or out: fp16 overflows (exp, pow) or loses the small end (log, rsqrt).
    "transcendental": (
        "exp.default",
        "expm1.default",
        "log.default",
        "log10.default",
        "log2.default",
        "log1p.default",
        "pow.Tensor_Scalar",
        "pow.Tensor_Tensor",
        "pow.Scalar",
        "rsqrt.default",
        "sqrt.default",
        "reciprocal.default",
        "acos.default",
        "asin.default",
        "cosh.default",
        "sinh.default",
        "tan.default",
        "erfinv.default",
        "softplus.default",
    ),
    # Complex views (rotary embeddings as complex products): torch has no bfloat16 complex dtype.
    "complex": ("view_as_complex.default", "polar.default", "complex.default"),
    # Interpolation weights are fractions; autocast keeps upsampling in FP32 too.
    "upsample": (
        "upsample_nearest1d.vec",
        "upsample_nearest2d.vec",
        "upsample_nearest3d.vec",
        "upsample_linear1d.vec",
        "upsample_bilinear2d.vec",
        "upsample_bicubic2d.vec",
        "upsample_trilinear3d.vec",
    ),
}

#: max/min are exact in any precision; they stay FP32 only where they feed an FP32 op (the
#: ``x - x.amax()`` of a hand-written stable softmax), so that op gets FP32 operands without a cast.
NORMALISER_OPS: tuple[str, ...] = ("amax.default", "amin.default", "max.dim", "min.dim")

#: The adds of a residual stream (``x = x + block(norm(x))``): at O1 and O2 an add of these whose result a
#: normalisation reads stays FP32 (``policy.RESIDUAL_STREAM``). In low precision the stream is rounded to its
#: own magnitude at every block, and the small updates a block adds (small init, layer scale) are lost below
#: that rounding: EVA-02-tiny bf16 O2 gave 36.9 dB against O1's 51.1 dB with the stream low, 47.6 dB with it
#: FP32 (issue 47; the other adds cost nothing). At O1 the stream usually follows an FP32 input (an embedding
#: add), but where a low projection restarts it (MViT's stage transitions, ``x = proj(norm(x)) + mlp(…)``)
#: both operands are low and it stayed low until the next model's end: mvit_v2_s bf16 O1 38.2 dB against
#: autocast's 40.3, 40.4 dB with the rule at O1. The add promotes its low operand as it reads it
#: (``PROMOTING_OPS``), so the FP32 stream adds no cast.
RESIDUAL_STREAM_OPS: tuple[str, ...] = ("add.Tensor",)

#: Gates (squeeze-excitation's ``x * sigmoid(fc(pool(x)))``): at O1 a gate whose value a ``mul`` broadcasts
#: over a larger tensor computes in FP32 (``policy.BROADCAST_GATE``). Rounded low, the gate carries one
#: relative error per channel that every position of the channel shares, which the pooling and the
#: classifier downstream do not average away (the same class of error as a BatchNorm shift rounded into a
#: low bias, ``fold_batchnorm``). The gate is tiny (batch × channels), so FP32 costs one cast of its input.
#: repvit_m1 bf16 O1 (timm, random init) 35.6 -> 37.2 dB against autocast's 36.5, and above O1 without the
#: rule on each of 5 input draws (issue 47).
GATE_OPS: tuple[str, ...] = ("sigmoid.default", "hardsigmoid.default")

#: Ops that turn values into discrete decisions (indices, orders): a rounding that swaps two close values
#: changes the decision itself (an MoE router picks another expert). The ``discrete-decision`` rule keeps
#: them and the producers of the values they read in FP32 at O1/O2 (``policy.DISCRETE_DECISION``).
DISCRETE_DECISION_OPS: tuple[str, ...] = (
    "topk.default",
    "argmax.default",
    "argmin.default",
    "sort.default",
    "sort.stable",
    "argsort.default",
    "argsort.stable",
    "kthvalue.default",
    "msort.default",
)

#: How many producers upstream of a discrete decision the rule walks (through views, elementwise ops and
#: FP32 ops, up to the first compute-bound op, which it includes).
DISCRETE_DECISION_DEPTH = 8

#: Ops that only move or view data; they never change values, so casts commute with them.
DATA_MOVEMENT_OPS: tuple[str, ...] = (
    "view.default",
    "_unsafe_view.default",
    "reshape.default",
    "permute.default",
    "transpose.int",
    "t.default",
    "expand.default",
    "unsqueeze.default",
    "squeeze.default",
    "squeeze.dim",
    "squeeze.dims",
    "flatten.using_ints",
    "unflatten.int",
    "slice.Tensor",
    "select.int",
    "narrow.default",
    "contiguous.default",
    "clone.default",
    "alias.default",
    "detach.default",
)

#: Elementwise ops whose ATen kernels promote mixed floating operands themselves, converting each element
#: as it is read: a ``follow`` node of these with an fp16/bf16 operand and an FP32 one needs no separate
#: cast (which would write a whole FP32 copy of the operand first). Same result, one kernel, less memory.
PROMOTING_OPS: tuple[str, ...] = (
    "add.Tensor",
    "sub.Tensor",
    "rsub.Tensor",
    "mul.Tensor",
    "div.Tensor",
    "div.Tensor_mode",
    "maximum.default",
    "minimum.default",
    "where.self",
    "eq.Tensor",
    "ne.Tensor",
    "lt.Tensor",
    "le.Tensor",
    "gt.Tensor",
    "ge.Tensor",
)


def fp32_reason(op: str) -> str | None:
    """The FP32 group an op belongs to ('softmax', 'norm', ...), or None."""
    return _fp32_index().get(op)


@cache
def _fp32_index() -> dict[str, str]:
    return {op: group for group, ops in FP32_OPS.items() for op in ops}


def all_entries() -> list[str]:
    """Every op named in the tables (for the existence test)."""
    entries = list(LOW_PRECISION_OPS) + list(NORMALISER_OPS) + list(DATA_MOVEMENT_OPS) + list(PROMOTING_OPS)
    entries += list(DISCRETE_DECISION_OPS) + list(RESIDUAL_STREAM_OPS) + list(GATE_OPS)
    for ops in FP32_OPS.values():
        entries.extend(ops)
    return entries


def resolve(entry: str) -> torch._ops.OpOverload | None:
    """The ``torch.ops.aten`` overload for a table entry, or None if this torch lacks it."""
    name, _, overload = entry.partition(".")
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return None
    try:
        return getattr(packet, overload)
    except AttributeError:
        return None


#: Matrix products ``--precision fp8`` runs as ``amplite::fp8_linear`` when their weight operand is a stored
#: 2-D tensor: ``(activation position, weight position, weight layout)``; ``nk``: ``[out, in]`` as
#: ``nn.Linear`` stores it, ``kn``: ``[in, out]`` (``x @ W``, GPT-2's ``Conv1D`` via ``addmm``). Every other
#: compute-bound op stays in the low dtype under FP8 (no e4m3 kernel for it: convolutions, batched products).
FP8_WEIGHT_OPS: dict[str, tuple[int, int, str]] = {
    "linear.default": (0, 1, "nk"),
    "matmul.default": (0, 1, "kn"),
    "mm.default": (0, 1, "kn"),
    "addmm.default": (1, 2, "kn"),
}


def op_name(target: object) -> str | None:
    """The table key ('softmax.int') for an ATen overload, or None for other callables."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return f"{target._opname}.{target._overloadname}"
    return None
