"""Pass 4 (O2 and up): store in low precision the weights that are only ever used in low precision.

Guarantees afterwards: every floating-point parameter, buffer or constant whose every reader was a cast
to one low dtype is stored in that dtype (a NEW tensor: the module the graph came from shares storage
with the user's model and must not change), those casts are gone, and everything else is untouched
(weights read in FP32, e.g. by norms, stay FP32).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
import torch.fx
from torch import nn

from amplite.passes.base import PassResult
from amplite.passes.graph_utils import cast_dtype, retype

_LOW = (torch.float16, torch.bfloat16)


def _owner(gm: torch.fx.GraphModule, target: str) -> tuple[nn.Module, str]:
    path, _, attr = target.rpartition(".")
    return (gm.get_submodule(path) if path else gm), attr


class StoreLowPrecisionParams:
    """Replace FP32 weights that are only cast to a low dtype by low-precision copies."""

    name = "store_low_params"

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        readers: dict[str, list[torch.fx.Node]] = defaultdict(list)
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                readers[node.target].append(node)
        for target, nodes in readers.items():
            owner, attr = _owner(gm, target)
            tensor = getattr(owner, attr, None)
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
                continue
            users = [u for n in nodes for u in n.users]
            wanted = {cast_dtype(u) for u in users}
            if not users or len(wanted) != 1 or next(iter(wanted)) not in _LOW:
                continue
            dtype = next(iter(wanted))
            low = tensor.detach().to(dtype)  # a new tensor: never write into the shared storage
            if isinstance(tensor, nn.Parameter):
                setattr(owner, attr, nn.Parameter(low, requires_grad=tensor.requires_grad))
            elif attr in getattr(owner, "_buffers", {}):
                owner._buffers[attr] = low
            else:
                setattr(owner, attr, low)
            for node in nodes:
                node.meta["val"] = retype(node.meta.get("val"), dtype)
                for user in list(node.users):
                    user.replace_all_uses_with(node)
                    gm.graph.erase_node(user)
                    counters["casts_removed"] += 1
            counters["tensors_stored_low"] += 1
            counters["bytes_saved"] += tensor.nbytes - low.nbytes
        return PassResult(gm, counters["tensors_stored_low"] > 0, counters)
