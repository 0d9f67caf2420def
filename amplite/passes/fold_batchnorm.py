"""Pass 0 (inference): fold eval-mode BatchNorm into the convolution that feeds it.

In eval mode BatchNorm is a per-channel affine map, so ``bn(conv(x, w, b))`` equals ``conv(x, w', b')`` with
``w' = w · γ/√(σ²+ε)`` and ``b' = (b − μ) · γ/√(σ²+ε) + β``. Folding removes the BatchNorm — and with it
the FP32 island and its two casts around every conv — before precision planning.

Guarantees afterwards: every ``batch_norm`` in inference mode whose input is a 2-D/1-D/3-D convolution
with no other user, and whose statistics and affine parameters are constant tensors, is gone; its conv
reads new weight and bias tensors (computed in FP64, stored in the conv weight's dtype) registered on the
module as ``amplite_folded_<n>_weight`` / ``_bias``. The user's tensors are never written.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch
import torch.fx

from amplite.passes.base import PassResult
from amplite.passes.graph_utils import fake_value, static_fake

#: Name prefix of the tensors this pass creates (``store_low_params`` may store them low at O1 too).
FOLDED_PREFIX = "amplite_folded_"

aten = torch.ops.aten
_CONVS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default}
_BN = aten.batch_norm.default


def _constant(gm: torch.fx.GraphModule, node: object) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    obj: object = gm
    for part in node.target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


class FoldBatchNorm:
    """Fold inference-mode BatchNorm into the preceding convolution."""

    name = "fold_batchnorm"

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        for bn in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _BN]:
            reason = self._fold(gm, bn)
            counters["folded" if reason is None else f"kept:{reason}"] += 1
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

    def _fold(self, gm: torch.fx.GraphModule, bn: torch.fx.Node) -> str | None:
        conv, gamma, beta, mean, var, training, _momentum, eps = bn.args[:8]
        if training:
            return "training-mode"
        if not isinstance(conv, torch.fx.Node) or conv.target not in _CONVS or len(conv.users) != 1:
            return "input-not-a-single-use-conv"
        w, b = _constant(gm, conv.args[1]), _constant(gm, conv.args[2]) if len(conv.args) > 2 else None
        stats = [_constant(gm, a) for a in (mean, var)]
        has_bias = len(conv.args) > 2 and conv.args[2] is not None
        if w is None or any(s is None for s in stats) or (has_bias and b is None):
            return "non-constant-parameters"
        g = _constant(gm, gamma) if gamma is not None else None
        beta_t = _constant(gm, beta) if beta is not None else None
        if (gamma is not None and g is None) or (beta is not None and beta_t is None):
            return "non-constant-parameters"
        mean_t, var_t = (s.detach().double() for s in stats)
        scale = torch.rsqrt(var_t + float(eps))
        if g is not None:
            scale = scale * g.detach().double()
        shape = (-1,) + (1,) * (w.dim() - 1)
        new_w = (w.detach().double() * scale.reshape(shape)).to(w.dtype)
        bias0 = b.detach().double() if b is not None else torch.zeros_like(mean_t)
        new_b = (bias0 - mean_t) * scale + (beta_t.detach().double() if beta_t is not None else 0.0)
        new_b = new_b.to(w.dtype)
        index = next(i for i in itertools.count() if not hasattr(gm, f"{FOLDED_PREFIX}{i}_weight"))
        names = (f"{FOLDED_PREFIX}{index}_weight", f"{FOLDED_PREFIX}{index}_bias")
        for attr, value in zip(names, (new_w, new_b), strict=True):
            gm.register_parameter(attr, torch.nn.Parameter(value, requires_grad=False))
        with gm.graph.inserting_before(conv):
            w_node, b_node = (gm.graph.get_attr(a) for a in names)
        for node, value in ((w_node, new_w), (b_node, new_b)):
            src = fake_value(conv.args[1])
            node.meta["val"] = static_fake(src.fake_mode, value) if hasattr(src, "fake_mode") else value
        args = list(conv.args)
        while len(args) < 3:
            args.append(None)
        args[1], args[2] = w_node, b_node
        conv.args = tuple(args)
        for key in ("nn_module_stack", "stack_trace"):
            if key in bn.meta and key not in conv.meta:
                conv.meta[key] = bn.meta[key]
        bn.replace_all_uses_with(conv)
        gm.graph.erase_node(bn)
        return None
