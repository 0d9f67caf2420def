"""The graph facts :class:`amplite.policy.NodeFacts` carries, read off the FX graph for ``annotate_precision``.

Each function answers one question about a node's neighbourhood (who reads it, what feeds it, what its
decided neighbours are); none decides a precision. :class:`~amplite.passes.annotate_precision.AnnotatePrecision`
builds a node's ``NodeFacts`` from them, the facts that depend on neighbours' decisions from the previous
round's decisions, and the policy decides.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.utils import _pytree as pytree

from amplite import op_tables
from amplite.passes.graph_utils import fake_value, is_float_tensor
from amplite.policy import Decision, NodeFacts, PrecisionPolicy

#: The low-list (compute-bound) ops: a discrete decision's cone stops at the first one; FP8 applies only to them.
COMPUTE_BOUND = frozenset(op_tables.LOW_PRECISION_OPS)
_NORMS = frozenset(op_tables.FP32_OPS["norm"])
_VIEWS = frozenset(op_tables.DATA_MOVEMENT_OPS)
_LOW_DEC = Decision("low", "")  # stands in for a node with no decision where a missing one must not count as FP32


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes among ``node``'s arguments (nested ones included) whose value is a tensor."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, torch.fx.Node) and isinstance(fake_value(a), torch.Tensor)]


def discrete_cone(facts: dict[torch.fx.Node, NodeFacts]) -> set[torch.fx.Node]:
    """Discrete decisions (topk, argmax, sort, ...) and the producers of their float operands: upstream
    through views, elementwise and FP32 ops, up to and including the first low-list (compute-bound) op on
    each path, at most ``DISCRETE_DECISION_DEPTH`` nodes deep; nodes with no decision stop the walk."""
    cone: set[torch.fx.Node] = set()
    for node in [n for n, f in facts.items() if PrecisionPolicy.is_discrete_decision(f.op)]:
        cone.add(node)
        frontier = [a for a in tensor_inputs(node) if is_float_tensor(a)]
        for _ in range(op_tables.DISCRETE_DECISION_DEPTH):
            nxt = []
            for prod in frontier:
                if prod not in facts or prod in cone:
                    continue
                cone.add(prod)
                if facts[prod].op not in COMPUTE_BOUND:
                    nxt += [a for a in tensor_inputs(prod) if is_float_tensor(a)]
            frontier = nxt
    return cone


def within_two(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node's readers and their readers."""
    frontier = list(node.users)
    for user in list(frontier):
        frontier.extend(user.users)
    return frontier


def bridges_fp32(node: torch.fx.Node, decisions: dict[torch.fx.Node, Decision], outputs_fp32: bool) -> bool:
    """Whether ``node`` only connects FP32 ops: every floating operand comes from one and every user is one
    (``mean(x²) + eps`` between mean and rsqrt). With ``outputs_fp32`` (graph outputs keep their dtype), for a
    0-dim ``node`` an FP32 graph output counts as an FP32 user and an FP32 graph input as an FP32 operand: a
    loss's last ``sum / num_items`` stays FP32 instead of a low round trip."""
    producers = [a for a in tensor_inputs(node) if is_float_tensor(a)]
    if not producers or not node.users:
        return False
    val = fake_value(node)
    # scalars only: a 0-dim op costs nothing in low precision's favour, only the rounding
    outputs_fp32 = outputs_fp32 and isinstance(val, torch.Tensor) and val.dim() == 0
    out_fp32 = outputs_fp32 and val.dtype == torch.float32

    def reads_fp32(u: torch.fx.Node) -> bool:
        return (u.op == "output" and out_fp32) or decisions.get(u, _LOW_DEC).mode == "fp32"

    def gives_fp32(a: torch.fx.Node, depth: int = 3) -> bool:
        # an FP32 graph input keeps its dtype as outputs do; an undecided FP32 node (a device move, a cast to
        # FP32) passes on what it reads
        if a in decisions:
            return decisions[a].mode == "fp32"
        if not outputs_fp32 or getattr(fake_value(a), "dtype", None) != torch.float32:
            return False
        if a.op == "placeholder":
            return True
        ins = [b for b in tensor_inputs(a) if is_float_tensor(b)] if a.op == "call_function" else []
        return depth > 0 and bool(ins) and all(gives_fp32(b, depth - 1) for b in ins)

    return all(gives_fp32(a) for a in producers) and all(reads_fp32(u) for u in node.users)


def feeds_norm(node: torch.fx.Node) -> bool:
    """Whether a normalisation reads ``node``'s result, directly or through views (a residual stream)."""
    frontier, seen = list(node.users), set()
    while frontier:
        user = frontier.pop()
        if user in seen:
            continue
        seen.add(user)
        op = op_tables.op_name(user.target)
        if op in _NORMS:
            return True
        if op in _VIEWS:
            frontier.extend(user.users)
    return False


def broadcast_by_mul(node: torch.fx.Node) -> bool:
    """Whether a ``mul`` reads ``node``'s result and broadcasts it over a larger tensor (a gate)."""
    val = fake_value(node)
    if not isinstance(val, torch.Tensor):
        return False
    return any(
        op_tables.op_name(user.target) == "mul.Tensor"
        and isinstance(fake_value(user), torch.Tensor)
        and fake_value(user).numel() > val.numel()
        for user in node.users
    )
