"""Pass 0 (inference): fold eval-mode BatchNorm into the convolution that feeds it.

In eval mode BatchNorm is a per-channel affine map ``y · s + t`` (``s = γ/√(σ²+ε)``), so ``bn(conv(x, w, b))``
equals ``conv(x, w', b')`` with ``w' = w · s`` and ``b' = (b − μ) · s + β``. Folding removes the BatchNorm —
and with it the FP32 island and its two casts around every conv — before precision planning.

Three modes (``docs/policy.md``, "BatchNorm folding"): ``full`` puts both into the conv (``w'``, ``b'``; O2);
``affine`` keeps the user's conv (weight and bias copied) and puts ``mul(y, s)`` and ``add(·, β − μ·s)`` after
it, which O1 plans FP32 and which read the low conv output by promotion — BatchNorm's own numerics under
autocast, the output rounded once, with no cast before them (O1); ``shift`` puts ``s`` into the weight and
only the add after the conv (measured, not used: the rounded ``w'`` costs as much as the rounded ``b'``).
In ``affine`` mode, where the BatchNorm enters a ReLU'd residual sum (ResNet, RegNet), a channel whose scale
the low dtype rounds to 1 (BatchNorm at its init: 1/√(1 + ε)) is scaled in the copied weight instead, and
with every channel so there is no ``mul``: ``y · (1 − 5e-6)`` in FP32 puts each low conv output just below a
point of the low grid, so each later rounding of a sum of such values (the FP32 stream read by the next conv)
rounds its ties toward zero instead of to even, a bias of the mean of a nonnegative stream that the global
pool keeps (resnet18 bf16 O1: 1.5 dB below autocast with the mul). Elsewhere the mul stays: putting such
scales into the weight cost 0.4–2.6 dB on the signed streams of repvit_m1, efficientnet_b0,
mobilenet_v3_small and mobilevitv2_050 (measured, not explained).

Guarantees afterwards: every ``batch_norm`` in inference mode whose input is a 2-D/1-D/3-D convolution
with no other user, and whose statistics and affine parameters are constant tensors, is gone; its conv
reads new tensors (computed in FP64, stored in the conv weight's dtype) registered on the module as
``amplite_folded_<n>_weight`` / ``_bias`` / ``_scale`` / ``_shift`` (scale and shift shaped ``(C, 1, …)``);
the last op of the chain takes the BatchNorm's users and source location. The user's tensors are never written.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch
import torch.fx

from amplite.passes.base import PassBase, PassResult
from amplite.passes.graph_utils import fake_value, static_fake

#: Name prefix of the tensors this pass creates (``store_low_params`` may store them low at O1 too).
FOLDED_PREFIX = "amplite_folded_"

aten = torch.ops.aten
_CONVS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default}
_BN = aten.batch_norm.default
_ADDS = {aten.add.Tensor, aten.add_.Tensor}
_RELUS = {aten.relu.default, aten.relu_.default}
#: ``full``: scale and shift both in the conv (w', b'); ``shift``: the scale in the weight, the shift added
#: after the conv; ``affine``: the conv keeps its weight, ``y · scale + shift`` after it.
_MODES = frozenset({"full", "shift", "affine"})


def _constant(gm: torch.fx.GraphModule, node: object) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    obj: object = gm
    for part in node.target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def _blocker(gm: torch.fx.GraphModule, bn: torch.fx.Node) -> str | None:
    """Why ``bn`` cannot fold into the conv before it, or None when it can."""
    conv, gamma, beta, mean, var, training = bn.args[:6]
    if training:
        return "training-mode"
    if not isinstance(conv, torch.fx.Node) or conv.target not in _CONVS or len(conv.users) != 1:
        return "input-not-a-single-use-conv"
    has_bias = len(conv.args) > 2 and conv.args[2] is not None
    operands = [conv.args[1], mean, var, *([conv.args[2]] if has_bias else [])]
    operands += [a for a in (gamma, beta) if a is not None]
    if any(_constant(gm, a) is None for a in operands):
        return "non-constant-parameters"
    return None


def _enters_relu_sum(node: torch.fx.Node) -> bool:
    """Every user of ``node`` is an ``add`` whose every user is a ``relu``: a nonnegative residual stream."""
    return bool(node.users) and all(
        u.target in _ADDS and u.users and all(r.target in _RELUS for r in u.users) for u in node.users
    )


class FoldBatchNorm(PassBase):
    """Fold inference-mode BatchNorm into the preceding convolution.

    Args:
        mode: ``full``, ``shift`` or ``affine`` (module docstring).
        low_dtype: The dtype the conv will compute in (``affine`` only): a channel's scale that rounds to
            exactly 1 in it goes into the copied weight and bias instead of the FP32 ``mul`` (None: never).
    """

    name = "fold_batchnorm"

    def __init__(self, mode: str = "full", low_dtype: torch.dtype | None = None) -> None:
        if mode not in _MODES:
            raise ValueError(f"fold mode {mode!r}: expected one of {sorted(_MODES)}")
        self.mode = mode
        self.low_dtype = low_dtype

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """Before the plan: the ops folding creates must be planned like every other."""
        self.require_unplanned(gm)

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """No inference-mode BatchNorm that could fold into the conv before it is left."""
        for bn in gm.graph.nodes:
            if bn.op == "call_function" and bn.target is _BN and _blocker(gm, bn) is None:
                raise self.broken(f"batch_norm {bn.name} still follows a foldable convolution")

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        for bn in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _BN]:
            reason = self._fold(gm, bn, counters)
            counters["folded" if reason is None else f"kept:{reason}"] += 1
            if reason is None and self.mode != "full":
                counters[f"affine_after_conv:{self.mode}"] += 1
        if counters["folded"]:
            before = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
            gm.graph.eliminate_dead_code()
            after = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
            for target in before - after:  # the old conv/BN tensors: drop them so they are not saved
                path, _, attr = target.rpartition(".")
                owner = gm.get_submodule(path) if path else gm
                for store in (owner._parameters, owner._buffers):
                    store.pop(attr, None)
                counters["tensors_dropped"] += 1
        return PassResult(gm, counters["folded"] > 0, counters)

    def _fold(self, gm: torch.fx.GraphModule, bn: torch.fx.Node, counters: Counter[str]) -> str | None:
        reason = _blocker(gm, bn)
        if reason is not None:
            return reason
        conv, gamma, beta, mean, var, _training, _momentum, eps = bn.args[:8]
        w, b = _constant(gm, conv.args[1]), _constant(gm, conv.args[2]) if len(conv.args) > 2 else None
        stats = [_constant(gm, a) for a in (mean, var)]
        g = _constant(gm, gamma) if gamma is not None else None
        beta_t = _constant(gm, beta) if beta is not None else None
        mean_t, var_t = (s.detach().double() for s in stats)  # type: ignore[union-attr]
        scale = torch.rsqrt(var_t + float(eps))
        if g is not None:
            scale = scale * g.detach().double()
        beta64 = beta_t.detach().double() if beta_t is not None else torch.zeros_like(mean_t)
        after = (-1,) + (1,) * (w.dim() - 2)  # one value per channel, broadcast over the conv output
        w64 = w.detach().double()
        if self.mode == "affine":  # the user's conv as it was (copied); y·scale + (β − μ·scale) after it
            shift_a = (beta64 - mean_t * scale).reshape(after)
            unit = self._unit_scale(scale, bn)
            if unit.any():
                counters["scale_in_weight:channels"] += int(unit.sum())
            # a scale the low dtype cannot tell from 1, before a ReLU'd residual sum, goes into the copied
            # weight (and bias), where it costs one rounding of the weight as before; as an FP32 mul it biases
            # the stream's later roundings (module docstring)
            s_w = torch.where(unit, scale, torch.ones_like(scale))
            w_a, scale = w64 * s_w.reshape((-1, *after[1:], 1)), torch.where(unit, torch.ones_like(scale), scale)
            tensors = {"weight": w_a, **({"bias": b.detach().double() * s_w} if b is not None else {}),
                       **({} if bool(unit.all()) else {"scale": scale.reshape(after)}), "shift": shift_a}  # fmt: skip
            return self._rewrite(gm, conv, bn, tensors, w.dtype)
        bias0 = b.detach().double() if b is not None else torch.zeros_like(mean_t)
        shift = (bias0 - mean_t) * scale + beta64
        if self.mode == "shift":
            tensors = {"weight": w64 * scale.reshape((-1, *after[1:], 1)), "shift": shift.reshape(after)}
        else:
            tensors = {"weight": w64 * scale.reshape((-1, *after[1:], 1)), "bias": shift}
        return self._rewrite(gm, conv, bn, tensors, w.dtype)

    def _unit_scale(self, scale: torch.Tensor, bn: torch.fx.Node) -> torch.Tensor:
        """Channels whose scale rounds to exactly 1 in the low dtype, where ``bn`` enters a ReLU'd residual
        sum only (none without a low dtype or elsewhere)."""
        if self.low_dtype is None or not _enters_relu_sum(bn):
            return torch.zeros_like(scale, dtype=torch.bool)
        return scale.to(self.low_dtype) == 1

    def _rewrite(
        self, gm: torch.fx.GraphModule, conv: torch.fx.Node, bn: torch.fx.Node, tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
    ) -> None:
        """Register ``tensors`` (FP64, stored in ``dtype``) as new parameters, point the conv at the weight
        and bias, and put the scale/shift ops (those present) between the conv and the BatchNorm's users."""
        index = next(i for i in itertools.count() if not hasattr(gm, f"{FOLDED_PREFIX}{i}_weight"))
        nodes: dict[str, torch.fx.Node] = {}
        src = fake_value(conv.args[1])
        for key, value in tensors.items():
            value = value.to(dtype)
            attr = f"{FOLDED_PREFIX}{index}_{key}"
            gm.register_parameter(attr, torch.nn.Parameter(value, requires_grad=False))
            with gm.graph.inserting_before(conv):
                nodes[key] = gm.graph.get_attr(attr)
            nodes[key].meta["val"] = static_fake(src.fake_mode, value) if hasattr(src, "fake_mode") else value
        args = list(conv.args)
        while len(args) < 3:
            args.append(None)
        args[1], args[2] = nodes["weight"], nodes.get("bias")
        conv.args = tuple(args)
        for key in ("nn_module_stack", "stack_trace"):
            if key in bn.meta and key not in conv.meta:
                conv.meta[key] = bn.meta[key]
        out = conv
        # conv (planned low), then the BatchNorm's affine map as FP32 elementwise ops that read the low conv
        # output by promotion (no cast), as BatchNorm itself computes under autocast
        for op, key in ((aten.mul.Tensor, "scale"), (aten.add.Tensor, "shift")):
            if key in nodes:
                with gm.graph.inserting_after(out):
                    out = gm.graph.call_function(op, (out, nodes[key]))
                out.meta["val"] = bn.meta.get("val", conv.meta.get("val"))
                out.meta.update({k: bn.meta[k] for k in ("nn_module_stack", "stack_trace") if k in bn.meta})
        bn.replace_all_uses_with(out)
        gm.graph.erase_node(bn)
        return None
