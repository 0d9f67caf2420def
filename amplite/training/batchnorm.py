"""BatchNorm that reads low-precision activations and keeps FP32 statistics, as CPU autocast and cuDNN do.

Training plans ``batch_norm`` low (:data:`BATCHNORM_LOW`) so the conv → BN → ReLU → add chain of a ResNet
stays in the low dtype instead of running FP32 between two casts. The plan alone would also cast BN's
weight, bias and running statistics to the low dtype (at O2 store them low): the running-statistics update
would then land in a temporary and the affine parameters would train through a cast. :func:`fp32_statistics`
undoes exactly that on the rewritten graph: every ``batch_norm`` reads the user's own FP32 weight, bias,
``running_mean`` and ``running_var`` (ATen's CPU and CUDA kernels take a low input with FP32 parameters,
compute the statistics in FP32 and return the input's dtype), so the in-place update reaches the user's
buffers and the affine gradients are FP32 without a cast.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx
from torch import nn

from amplite.passes.graph_utils import retype
from amplite.policy import Override

_aten = torch.ops.aten
_BATCH_NORM = _aten.batch_norm.default  # args: input, weight, bias, running_mean, running_var, training, ...
_PARAM_SLOTS = (1, 2, 3, 4)
_CASTS = (_aten._to_copy.default, _aten.to.dtype, _aten._to_copy.out)
_LOW = (torch.bfloat16, torch.float16)

#: Training runs BatchNorm on the low-precision activation (statistics FP32, see :func:`fp32_statistics`).
#: A user's ``keep_fp32`` rule that matches the BatchNorm (module or node pattern) still wins.
BATCHNORM_LOW = Override("force_low", "op:batch_norm*", source="training")


def _owner(gm: torch.fx.GraphModule, target: str) -> tuple[nn.Module, str]:
    path, _, attr = target.rpartition(".")
    return (gm.get_submodule(path) if path else gm), attr


def fp32_statistics(gm: torch.fx.GraphModule, model: nn.Module) -> Counter[str]:
    """Make every ``batch_norm`` of ``gm`` read the user's FP32 weight, bias and running statistics.

    Run on the rewritten graph before :func:`~amplite.training.lowcast.read_user_tensors`. A parameter
    slot that reads a cast of an FP32 attribute reads the attribute itself; one that reads an attribute
    ``store_low_params`` stored low reads the user's FP32 tensor of that name again (the low copy stays
    only for other readers, if any).

    Returns:
        Counters: ``batchnorm_low_input`` (BatchNorms whose input is low), ``batchnorm_param_casts_removed``,
        ``batchnorm_params_restored_fp32``.
    """
    user = dict(model.named_parameters(remove_duplicate=False))
    user.update(model.named_buffers(remove_duplicate=False))
    counters: Counter[str] = Counter()
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _BATCH_NORM:
            continue
        for slot in _PARAM_SLOTS:
            arg = node.args[slot] if len(node.args) > slot else None
            if not isinstance(arg, torch.fx.Node):
                continue
            fixed = _fp32_source(gm, graph, arg, user, counters)
            if fixed is not arg:
                node.update_arg(slot, fixed)
                if arg.op == "call_function" and not arg.users:
                    graph.erase_node(arg)
        val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dtype in _LOW:
            counters["batchnorm_low_input"] += 1
    for node in list(graph.nodes):  # attribute reads left without a reader (their low copy unused)
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return counters


def _fp32_source(gm: torch.fx.GraphModule, graph: torch.fx.Graph, arg: torch.fx.Node, user: dict,
                 counters: Counter[str]) -> torch.fx.Node:  # fmt: skip
    """The node that reads ``arg``'s FP32 origin (``arg`` itself when it is FP32 already)."""
    if arg.op == "call_function" and arg.target in _CASTS and isinstance(arg.args[0], torch.fx.Node):
        src = arg.args[0]
        if src.op == "get_attr" and _dtype(src) == torch.float32:
            counters["batchnorm_param_casts_removed"] += 1
            return src
        if src.op == "get_attr":  # stored low (O2) and then cast: restore the attribute below
            arg = src
    if arg.op != "get_attr" or _dtype(arg) not in _LOW:
        return arg
    mine = user.get(str(arg.target))
    if mine is None or mine.dtype != torch.float32:
        return arg
    owner, attr = _owner(gm, str(arg.target))
    low = getattr(owner, attr)
    if all(r.target is _BATCH_NORM for n in graph.nodes if n.op == "get_attr" and _reads(gm, n, low) for r in n.users):
        store = owner._parameters if attr in owner._parameters else owner._buffers
        store[attr] = mine  # the only readers are BatchNorm slots: the attribute is the user's tensor again
        for n in graph.nodes:
            if n.op == "get_attr" and n.target == arg.target:
                n.meta["val"] = retype(n.meta.get("val"), torch.float32)
        counters["batchnorm_params_restored_fp32"] += 1
        return arg
    # another op reads the low copy too: BatchNorm reads the user's tensor under a name of its own
    if isinstance(mine, nn.Parameter):
        owner.register_parameter(f"{attr}_fp32", mine)
    else:
        owner.register_buffer(f"{attr}_fp32", mine, persistent=False)
    with graph.inserting_before(arg):
        fresh = graph.get_attr(f"{arg.target}_fp32")
    fresh.meta["val"] = retype(arg.meta.get("val"), torch.float32)
    counters["batchnorm_params_restored_fp32"] += 1
    return fresh


def _reads(gm: torch.fx.GraphModule, node: torch.fx.Node, tensor: torch.Tensor) -> bool:
    owner, attr = _owner(gm, str(node.target))
    return getattr(owner, attr, None) is tensor


def _dtype(node: torch.fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None
