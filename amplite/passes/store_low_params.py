"""Pass 4: store in low precision the weights that are only ever used in low precision.

At O2 and up it covers every tensor; at O1 only the constants amplite itself created (the folded
BatchNorm weights, ``prefix="amplite_folded_"``): the user's parameters stay FP32 master copies there, but
a derived constant that is cast to fp16 on every forward gains nothing from being stored in FP32 — the
stored copy rounds exactly as the run-time cast did.

Guarantees afterwards: every floating-point parameter, buffer or constant (whose attribute path starts
with ``prefix``, when given) whose every reader was a cast to one low dtype is stored in that dtype (a
NEW tensor: the module the graph came from shares storage with the user's model and must not change),
those casts are gone, and everything else is untouched (weights read in FP32, e.g. by norms, stay FP32).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
import torch.fx
from torch import nn

from amplite.passes.base import PassBase, PassResult
from amplite.passes.graph_utils import cast_dtype, retype

_LOW = (torch.float16, torch.bfloat16)


def _aliases(gm: torch.fx.GraphModule) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) that holds each tensor, tied duplicates and unread names included."""
    found: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for _name, module in gm.named_modules(remove_duplicate=False):
        for store in ("_parameters", "_buffers"):
            for attr, t in getattr(module, store, {}).items():
                if isinstance(t, torch.Tensor) and (module, attr) not in found[id(t)]:
                    found[id(t)].append((module, attr))
        for attr, t in vars(module).items():
            if isinstance(t, torch.Tensor) and not attr.startswith("_") and (module, attr) not in found[id(t)]:
                found[id(t)].append((module, attr))  # plain tensor constants (lifted_tensor_0 …)
    return found


def _owner(gm: torch.fx.GraphModule, target: str) -> tuple[nn.Module, str]:
    path, _, attr = target.rpartition(".")
    return (gm.get_submodule(path) if path else gm), attr


class StoreLowPrecisionParams(PassBase):
    """Replace FP32 weights that are only cast to a low dtype by low-precision copies.

    Args:
        prefix: Only tensors whose attribute path starts with this (None: every tensor).
    """

    name = "store_low_params"

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Every tensor is stored in the dtype its node is planned to hold, and no FP32 tensor in scope is
        only ever cast to one low dtype (it would be stored in that dtype)."""
        wanted: dict[int, set[torch.dtype | None]] = defaultdict(set)
        names: dict[int, str] = {}
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            owner, attr = _owner(gm, node.target)
            tensor = getattr(owner, attr, None)
            val = node.meta.get("val")
            if not isinstance(tensor, torch.Tensor):
                continue
            if isinstance(val, torch.Tensor) and val.dtype != tensor.dtype:
                raise self.broken(f"{node.target} is stored in {tensor.dtype} but planned in {val.dtype}")
            if tensor.dtype == torch.float32 and (self.prefix is None or str(node.target).startswith(self.prefix)):
                names[id(tensor)] = str(node.target)
                wanted[id(tensor)] |= {cast_dtype(u) for u in node.users} or {None}
        for key, dtypes in wanted.items():
            if len(dtypes) == 1 and next(iter(dtypes)) in _LOW:
                raise self.broken(f"{names[key]} is only read as {next(iter(dtypes))} but stored in FP32")

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        # Group readers by the tensor object, not the attribute path: tied weights (an embedding shared with
        # the LM head) are one tensor under several names and must stay one tensor, stored once.
        readers: dict[int, list[torch.fx.Node]] = defaultdict(list)
        tensors: dict[int, torch.Tensor] = {}
        for node in gm.graph.nodes:
            if node.op == "get_attr" and (self.prefix is None or str(node.target).startswith(self.prefix)):
                owner, attr = _owner(gm, node.target)
                tensor = getattr(owner, attr, None)
                if isinstance(tensor, torch.Tensor):
                    readers[id(tensor)].append(node)
                    tensors[id(tensor)] = tensor
        aliases = _aliases(gm)
        for key, nodes in readers.items():
            tensor = tensors[key]
            if tensor.dtype != torch.float32:
                continue
            users = [u for n in nodes for u in n.users]
            wanted = {cast_dtype(u) for u in users}
            if not users or len(wanted) != 1 or next(iter(wanted)) not in _LOW:
                continue
            dtype = next(iter(wanted))
            low = tensor.detach().to(dtype)  # a new tensor: never write into the shared storage
            if isinstance(tensor, nn.Parameter):
                low = nn.Parameter(low, requires_grad=tensor.requires_grad)
            for owner, attr in aliases.get(key, [_owner(gm, nodes[0].target)]):
                if attr in getattr(owner, "_parameters", {}):
                    owner._parameters[attr] = low
                elif attr in getattr(owner, "_buffers", {}):
                    owner._buffers[attr] = low
                else:
                    setattr(owner, attr, low)
            counters["aliases_kept_tied"] += max(0, len(aliases.get(key, [])) - 1)
            for node in nodes:
                node.meta["val"] = retype(node.meta.get("val"), dtype)
                for user in list(node.users):
                    user.replace_all_uses_with(node)
                    gm.graph.erase_node(user)
                    counters["casts_removed"] += 1
            counters["tensors_stored_low"] += 1
            counters["bytes_saved"] += tensor.nbytes - low.nbytes
        return PassResult(gm, counters["tensors_stored_low"] > 0, counters)
