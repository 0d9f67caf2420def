"""Pass 1: decide each node's compute dtype (analysis only).

Decision order per node: user overrides, then range rules (``meta['amplite_range']`` from
``range_guard``), then the level and op tables.

Guarantees afterwards: every ``call_function`` node that reads or produces a floating-point tensor has
``meta['amplite_precision']`` = ``{"mode", "dtype", "reason"}`` (``dtype`` the dtype its float operands
will have, or None when it has none), and every node has ``meta['amplite_out_dtype']``: the dtype (or a
tuple of dtypes for multi-output ops) its result will have once ``insert_casts`` has run. The graph itself
is not changed. ``meta['amplite_precision']['rule']`` names the policy layer that decided
(:class:`amplite.policy.RuleSource` value).
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from amplite import op_tables
from amplite.errors import ConfigError
from amplite.passes.base import PassResult
from amplite.passes.graph_utils import cast_dtype, dtypes_of, fake_value, is_float_tensor, module_path
from amplite.passes.meta import OUT_DTYPE_KEY, PRECISION_KEY, RANGE_KEY, RANGE_LOW_KEY, PrecisionAnnotation
from amplite.policy import Decision, Level, PrecisionPolicy, RuleSource

_NORMALISERS = frozenset(op_tables.NORMALISER_OPS)
_COMPUTE_BOUND = frozenset(op_tables.LOW_PRECISION_OPS)
_NORMS = frozenset(op_tables.FP32_OPS["norm"])
_VIEWS = frozenset(op_tables.DATA_MOVEMENT_OPS)
_NONE = Decision("follow", "")  # stands in for a node with no decision (not float, not call_function)


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, torch.fx.Node) and isinstance(fake_value(a), torch.Tensor)]


def _has_dtype_argument(node: torch.fx.Node) -> bool:
    return any(isinstance(a, torch.dtype) for a in pytree.tree_leaves((node.args, node.kwargs)))


def _widest(dtypes: list[torch.dtype]) -> torch.dtype:
    out = dtypes[0]
    for dt in dtypes[1:]:
        out = torch.promote_types(out, dt)
    return out


def _refuse_unmatched(policy: PrecisionPolicy, sites: list[tuple[str, str, str]]) -> None:
    """An override that matches no node is a typo the plan would silently ignore: refuse it, with names."""
    missing = policy.unmatched(sites)
    if not missing:
        return
    rule = missing[0]
    flag = "--keep-fp32" if rule.action == "keep_fp32" else "--force-low"
    names = {policy.user_module(m) for _, m, _ in sites}
    modules = sorted({m for m in names if m and not m.startswith("_")}, key=lambda m: (m.count("."), m))[:4]
    ops = sorted({o.split(".")[0] for o, _, _ in sites})[:6]
    shown = f"modules {', '.join(modules)}; " if modules else ""
    raise ConfigError(
        f"{flag} {rule.pattern!r} matches no node of this model"
        + (f" (nor do {len(missing) - 1} more patterns)" if len(missing) > 1 else ""),
        f"name what the model has ({shown}ops {', '.join(ops)}), e.g. "
        + (f"module:{modules[0]}.*" if modules else f"op:{ops[0]}" if ops else "op:linear")
        + "; `amplite inspect MODEL` lists every node",
    )


class AnnotatePrecision:
    """Write the precision plan of a policy into node metadata.

    Args:
        policy: The precision policy to apply.
    """

    name = "annotate_precision"

    def __init__(self, policy: PrecisionPolicy) -> None:
        self.policy = policy

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        out_dtype: dict[torch.fx.Node, Any] = {}
        decisions = self._decisions(gm)
        for node in gm.graph.nodes:
            val = fake_value(node)
            if node.op != "call_function":
                out_dtype[node] = dtypes_of(val)
            elif (dt := cast_dtype(node)) is not None:
                out_dtype[node] = dt
            elif node.target is operator.getitem:
                parent = out_dtype.get(node.args[0])
                idx = node.args[1]
                out_dtype[node] = (
                    parent[idx] if isinstance(parent, tuple) and isinstance(idx, int) else (dtypes_of(val))
                )
            else:
                out_dtype[node] = self._plan_node(node, decisions.get(node), out_dtype, counters)
            node.meta[OUT_DTYPE_KEY] = out_dtype[node]
        return PassResult(gm, False, counters)

    def _decisions(self, gm: torch.fx.GraphModule) -> dict[torch.fx.Node, Decision]:
        """Policy decisions for every float-touching node, before dtype propagation."""
        decisions: dict[torch.fx.Node, Decision] = {}
        sites: list[tuple[str, str, str]] = []
        for node in gm.graph.nodes:
            if node.op != "call_function" or cast_dtype(node) is not None or node.target is operator.getitem:
                continue
            op = op_tables.op_name(node.target) or getattr(node.target, "__name__", str(node.target))
            site = (op, module_path(node), node.name)
            sites.append(site)
            # range_guard's flag (meta['amplite_range']); pins still win
            decisions[node] = self.policy.for_range(self.policy.decide(*site), node.meta.get(RANGE_KEY, ""))
        if self.policy.level is not Level.O0:
            _refuse_unmatched(self.policy, sites)
        for node, dec in list(decisions.items()):  # the graph facts each rule needs; the policy decides
            fp32_reader = any(decisions.get(u, _NONE).mode == "fp32" for u in node.users)
            decisions[node] = self.policy.for_small_pow(dec, node.meta.get(RANGE_LOW_KEY, ""), fp32_reader)
        for node, dec in list(decisions.items()):
            if op_tables.op_name(node.target) in _NORMALISERS:
                decisions[node] = self.policy.for_normaliser(dec, self._feeds_fp32(node, decisions))
        self._discrete_decisions(decisions)
        for node, dec in list(decisions.items()):
            op = op_tables.op_name(node.target) or ""
            decisions[node] = self.policy.for_residual_stream(dec, op, _feeds_norm(node))
        for node, dec in list(decisions.items()):
            decisions[node] = self.policy.for_bridge(dec, self._bridges_fp32(node, decisions))
        return decisions

    def _discrete_decisions(self, decisions: dict[torch.fx.Node, Decision]) -> None:
        """Keep discrete decisions (topk, argmax, sort, ...) and the producers of their float operands FP32.

        Walks upstream from each decision through views, elementwise and FP32 ops, up to and including the
        first low-list (compute-bound) op on each path, at most ``DISCRETE_DECISION_DEPTH`` nodes deep.
        """
        for node in [n for n in decisions if self.policy.is_discrete_decision(op_tables.op_name(n.target) or "")]:
            decisions[node] = self.policy.for_discrete_decision(decisions[node])
            frontier = [a for a in _tensor_inputs(node) if is_float_tensor(a)]
            for _ in range(op_tables.DISCRETE_DECISION_DEPTH):
                nxt = []
                for prod in frontier:
                    dec = decisions.get(prod)
                    if dec is None or dec.source is RuleSource.FIDELITY:
                        continue
                    decisions[prod] = self.policy.for_discrete_decision(dec)
                    if op_tables.op_name(prod.target) not in _COMPUTE_BOUND:
                        nxt += [a for a in _tensor_inputs(prod) if is_float_tensor(a)]
                frontier = nxt

    @staticmethod
    def _bridges_fp32(node: torch.fx.Node, decisions: dict[torch.fx.Node, Decision]) -> bool:
        """Whether ``node`` only connects FP32 ops: every floating operand comes from one and every user is
        one (``mean(x²) + eps`` between mean and rsqrt). Running it low would cost two casts and a rounding
        inside an FP32 island."""
        producers = [a for a in _tensor_inputs(node) if is_float_tensor(a)]
        if not producers or not node.users:
            return False
        fp32 = "fp32"
        return all(decisions.get(a, Decision("low", "")).mode == fp32 for a in producers) and all(
            decisions.get(u, Decision("low", "")).mode == fp32 for u in node.users
        )

    @staticmethod
    def _feeds_fp32(node: torch.fx.Node, decisions: dict[torch.fx.Node, Decision]) -> bool:
        """Whether ``node`` reaches an FP32-pinned op directly or through one op (``x - x.amax()``)."""
        frontier = list(node.users)
        for user in list(frontier):
            frontier.extend(user.users)
        return any(decisions.get(u, Decision("follow", "")).mode == "fp32" for u in frontier)

    def _plan_node(
        self,
        node: torch.fx.Node,
        decision: Decision | None,
        out_dtype: dict[torch.fx.Node, Any],
        counters: Counter[str],
    ) -> Any:
        val = fake_value(node)
        inputs = [a for a in _tensor_inputs(node) if isinstance(out_dtype.get(a), torch.dtype)]
        float_in = [out_dtype[a] for a in inputs if out_dtype[a].is_floating_point]
        produces_float = any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in pytree.tree_leaves(val))
        if decision is None or (not float_in and not produces_float):
            return dtypes_of(val)
        mode, reason, source = decision.mode, decision.reason, decision.source
        if torch.float64 in float_in or any(
            isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in pytree.tree_leaves(val)
        ):
            mode, reason, source = "follow", "float64-kept", RuleSource.DTYPE
        schema = getattr(node.target, "_schema", None)
        if not float_in:
            # No floating operand to cast (creation ops, true division of integers): the op itself fixes
            # its output dtype, whatever the policy says, so the plan must not claim a low one.
            compute, mode, reason, source = None, "follow", "no-float-operands", RuleSource.DTYPE
        elif schema is not None and schema.is_mutable and inputs:
            # An in-place op cannot change its destination's dtype: compute in it.
            compute = out_dtype[inputs[0]] if out_dtype[inputs[0]].is_floating_point else None
            mode, reason, source = "follow", "in-place", RuleSource.DTYPE
        elif mode == "low":
            compute = self.policy.low_dtype
        elif mode == "fp32":
            compute = torch.float32
        else:
            dimensioned = [out_dtype[a] for a in inputs if out_dtype[a].is_floating_point and fake_value(a).dim()]
            pool = dimensioned or float_in
            compute = _widest(pool) if pool else None
        node.meta[PRECISION_KEY] = PrecisionAnnotation(mode=mode, dtype=compute, reason=reason, rule=source.value)
        counters[f"nodes:{mode}"] += 1
        if compute is not None:
            counters[f"compute:{str(compute).removeprefix('torch.')}"] += 1
        return _predict_out(node, val, compute)


def _predict_out(node: torch.fx.Node, val: Any, compute: torch.dtype | None) -> Any:
    """Output dtype(s) once the node computes in ``compute``.

    A float output that had the op's original input dtype takes the compute dtype; outputs of another
    dtype (integer results, an explicit ``dtype=`` argument) keep theirs.
    """
    if compute is None or _has_dtype_argument(node):
        return dtypes_of(val)
    originals = [fake_value(a).dtype for a in _tensor_inputs(node) if fake_value(a).dtype.is_floating_point]
    original_in = _widest(originals) if originals else None

    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if v.dtype.is_floating_point and (original_in is None or v.dtype == original_in):
                return compute
            return v.dtype
        if isinstance(v, (tuple, list)):
            return tuple(one(x) for x in v)
        return None

    return one(val)


def _feeds_norm(node: torch.fx.Node) -> bool:
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
