"""Higher-order ops in an exported graph: grad-mode and autocast regions inlined, control flow kept exact.

``torch.export`` turns a ``torch.no_grad()`` / ``set_grad_enabled`` block into
``higher_order.wrap_with_set_grad_enabled(enabled, submod_N, *operands)`` and an autocast block into
``higher_order.wrap_with_autocast(...)``, whose ops live in a sub-``GraphModule``. The precision passes walk
one graph, so those ops stayed FP32 while the parent fed them low-precision tensors (a dtype mismatch at
run time). In an inference program neither region changes what its ops compute (no gradient is taken, and
the traced ops already carry their dtypes), so :class:`InlineRegions` copies their nodes into the parent
graph, where every pass sees them; the outputs of a no-grad region are detached, so that a train-mode graph
still takes no gradient through it.

Control flow (``cond``, ``map``, ``scan``, ``while_loop``) cannot be inlined. Its sub-graphs run exactly as
traced: each floating operand is cast to the dtype the sub-graph's placeholder was traced with, so that a
low-precision parent never feeds them another dtype (their ops stay FP32 and are counted as such).
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from amplite.passes.base import PassBase, PassResult

_HOP = torch.ops.higher_order
#: region op -> index of its sub-graph argument (the operands follow it)
_INLINE: dict[Any, int] = {
    op: pos for name, pos in (("wrap_with_set_grad_enabled", 1), ("wrap_with_autocast", 4))
    if (op := getattr(_HOP, name, None)) is not None
}  # fmt: skip
_CONTROL = tuple(op for name in ("cond", "map_impl", "scan", "while_loop") if (op := getattr(_HOP, name, None)))


def has_regions(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph calls a higher-order op this pass handles (the pass runs, and is reported, only then)."""
    ops = (*_INLINE, *_CONTROL)
    return any(n.op == "call_function" and n.target in ops for n in gm.graph.nodes)


class InlineRegions(PassBase):
    """Inline grad-mode and autocast regions; pin the operand dtypes of control-flow sub-graphs."""

    name = "inline_regions"

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """No grad-mode or autocast region is left: their ops are in the graph the other passes walk."""
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target in _INLINE:
                raise self.broken(f"region {n.name} ({getattr(n.target, '__name__', n.target)}) is still a sub-graph")

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        while True:  # a region may hold another: inline until none is left
            region = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target in _INLINE), None)
            if region is None:
                break
            self._inline(gm, region)
            counters[f"inlined:{region.target.__name__}"] += 1
        for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _CONTROL]:
            counters["control_flow_kept_fp32"] += 1
            counters["operands_cast"] += _pin_operands(gm, node)
        if counters:
            gm.graph.eliminate_dead_code()
            gm.delete_all_unused_submodules()
            _drop_unread_subgraphs(gm)
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, bool(counters), counters)

    @staticmethod
    def _inline(gm: torch.fx.GraphModule, region: torch.fx.Node) -> None:
        pos = _INLINE[region.target]
        sub = getattr(gm, str(region.args[pos].target))
        operands = list(region.args[pos + 1 :])
        env: dict[torch.fx.Node, Any] = {}
        outputs: Any = ()
        with gm.graph.inserting_before(region):
            placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            env.update(zip(placeholders, operands, strict=True))
            for sn in sub.graph.nodes:
                if sn.op == "placeholder":
                    continue
                if sn.op == "output":
                    outputs = pytree.tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a, sn.args[0])
                    break
                if sn.op == "get_attr":  # a nested sub-graph or constant: moved onto the parent under a fresh name
                    fresh = _fresh(gm, str(sn.target).replace(".", "_"))
                    setattr(gm, fresh, getattr(sub, str(sn.target)))
                    env[sn] = gm.graph.get_attr(fresh)
                    env[sn].meta.update(sn.meta)
                    continue
                env[sn] = gm.graph.node_copy(sn, lambda n: env[n])
        outs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        if region.target is getattr(_HOP, "wrap_with_set_grad_enabled", None) and region.args[0] is False:
            outs = [_detached(gm, region, o) for o in outs]  # no gradient leaves the region (a train-mode graph)
        for user in list(region.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outs[user.args[1]])
                gm.graph.erase_node(user)
        if region.users:  # used whole (rare): a tuple of the outputs stands in
            with gm.graph.inserting_before(region):
                region.replace_all_uses_with(gm.graph.call_function(tuple, (outs,)))
        gm.graph.erase_node(region)


def _detached(gm: torch.fx.GraphModule, region: torch.fx.Node, out: Any) -> Any:
    """``detach(out)`` for a tensor output of a no-grad region: what ``torch.no_grad`` meant for gradients."""
    if not (isinstance(out, torch.fx.Node) and isinstance(out.meta.get("val"), torch.Tensor)):
        return out
    with gm.graph.inserting_before(region):
        node = gm.graph.call_function(torch.ops.aten.detach.default, (out,))
    node.meta.update({k: v for k, v in out.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
    return node


def _drop_unread_subgraphs(gm: torch.fx.GraphModule) -> None:
    """Delete the sub-graphs no node reads any more. ``delete_all_unused_submodules`` walks ``named_modules``,
    which lists a module once: a nested region's sub-graph, moved onto the parent under a fresh name, is also
    its old region's child, and deleting that region leaves it behind under the fresh name."""
    read = {str(n.target).split(".")[0] for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    for name, child in list(gm._modules.items()):  # every name, aliases included (named_children lists one)
        if isinstance(child, torch.fx.GraphModule) and name not in read:
            gm.delete_submodule(name)


def _fresh(gm: torch.fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _pin_operands(gm: torch.fx.GraphModule, node: torch.fx.Node) -> int:
    """Cast each floating operand of a control-flow op to its sub-graph's traced dtype; the number cast."""
    subs = [getattr(gm, str(a.target)) for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"
            and isinstance(getattr(gm, str(a.target), None), torch.fx.GraphModule)]  # fmt: skip
    if not subs:
        return 0
    wanted = [n.meta.get("val") for n in subs[0].graph.nodes if n.op == "placeholder"]
    flat = [a for a in pytree.tree_leaves(node.args) if isinstance(a, torch.fx.Node)
            and not isinstance(getattr(gm, str(a.target), None) if a.op == "get_attr" else None, torch.fx.GraphModule)]
    # cond(pred, true, false, operands): the predicate is not a sub-graph operand
    operands = flat[-len(wanted):] if wanted else []
    count = 0
    for arg, val in zip(operands, wanted, strict=False):
        if not (isinstance(val, torch.Tensor) and val.dtype.is_floating_point):
            continue
        with gm.graph.inserting_before(node):
            cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (arg,), {"dtype": val.dtype})
        cast.meta["val"] = val
        node.replace_input_with(arg, cast)
        count += 1
    return count
