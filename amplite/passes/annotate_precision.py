"""Pass 1: decide each node's compute dtype (analysis only).

The pass reads graph facts (:class:`amplite.policy.NodeFacts`: op, module, node, range flags from
``range_guard``, FP32 readers, discrete-decision cones, island shape; the graph walks behind them are in
:mod:`amplite.passes.precision_facts`); :meth:`PrecisionPolicy.decide` takes
the first answer of its layers in priority order (:data:`amplite.policy.LAYERS`).

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
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from amplite import op_tables
from amplite.errors import ConfigError
from amplite.passes.base import PassBase, PassResult
from amplite.passes.fp8_sites import fp8_fact
from amplite.passes.graph_utils import cast_dtype, dtypes_of, fake_value, is_float_tensor, module_path
from amplite.passes.meta import (
    CAST_KEY,
    FP8_KEY,
    OUT_DTYPE_KEY,
    PRECISION_KEY,
    RANGE_KEY,
    RANGE_LOW_KEY,
    Fp8Site,
    PrecisionAnnotation,
)
from amplite.passes.precision_facts import (
    COMPUTE_BOUND,
    bridges_fp32,
    broadcast_by_mul,
    discrete_cone,
    feeds_norm,
    tensor_inputs,
    within_two,
)
from amplite.passes.range_guard import ValueRange
from amplite.policy import Decision, Level, NodeFacts, PrecisionPolicy, RuleSource

_NONE = Decision("follow", "")  # stands in for a node with no decision (not float, not call_function)
_MODES = frozenset({"low", "fp32", "follow"})
_RULES = frozenset(s.value for s in RuleSource)


def _has_dtype_argument(node: torch.fx.Node) -> bool:
    return any(isinstance(a, torch.dtype) for a in pytree.tree_leaves((node.args, node.kwargs)))


def _promoted(operands: list[tuple[torch.dtype, int]]) -> torch.dtype | None:
    """The dtype type promotion gives float operands given as ``(dtype, ndim)``: 0-dim ones count only when no
    dimensioned one does (``x_f16 * scale_f32_0dim`` is float16); None without a float operand."""
    floats = [(dt, nd) for dt, nd in operands if dt.is_floating_point]
    pool = [dt for dt, nd in floats if nd] or [dt for dt, _ in floats]
    out = pool[0] if pool else None
    for dt in pool[1:]:
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


class AnnotatePrecision(PassBase):
    """Write the precision plan of a policy into node metadata.

    Args:
        policy: The precision policy to apply.
        fp8_ranges: Calibrated ranges for FP8's static activation scales (None: dynamic per token).
        fp8_clip_check: Keep out of FP8 a product whose calibrated activation would overflow e4m3 after
            scaling (the range rules are on).
    """

    name = "annotate_precision"

    def __init__(
        self, policy: PrecisionPolicy, fp8_ranges: Mapping[str, ValueRange] | None = None, fp8_clip_check: bool = True
    ) -> None:
        self.policy = policy
        self.fp8_ranges = fp8_ranges
        self.fp8_clip_check = fp8_clip_check

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """No cast of amplite's yet: the plan is made on the graph as traced (with the facts flagged before)."""
        for node in gm.graph.nodes:
            if CAST_KEY in node.meta:
                raise self.refuse_input(f"node {node.name} is a cast amplite inserted: plan before inserting casts")

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Every node has its planned dtype, and every compute node that touches a float tensor a decision
        (a known mode and the policy layer that gave it)."""
        for node in [n for n in gm.graph.nodes if n.op != "output"]:
            if OUT_DTYPE_KEY not in node.meta:
                raise self.broken(f"node {node.name} has no planned dtype")
            if node.op != "call_function" or cast_dtype(node) is not None or node.target is operator.getitem:
                continue
            plan, leaves = node.meta.get(PRECISION_KEY), pytree.tree_leaves(fake_value(node))
            floats = any(is_float_tensor(a) for a in tensor_inputs(node)) or any(
                isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in leaves
            )
            if plan is None and floats:
                raise self.broken(f"node {node.name} ({_op(node)}) touches a float tensor but has no decision")
            if plan is not None and (plan["mode"] not in _MODES or plan["rule"] not in _RULES):
                raise self.broken(f"node {node.name} has decision {plan['mode']!r} from {plan['rule']!r}")

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        out_dtype: dict[torch.fx.Node, Any] = {}
        decisions = self._decisions(gm)
        sites = self._fp8(decisions)
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
                if node in sites and node.meta.get(PRECISION_KEY, {}).get("mode") == "low":
                    node.meta[FP8_KEY] = sites[node]  # the fp8_matmul pass rewrites it
            node.meta[OUT_DTYPE_KEY] = out_dtype[node]
        return PassResult(gm, False, counters)

    def _decisions(self, gm: torch.fx.GraphModule) -> dict[torch.fx.Node, Decision]:
        """Policy decisions for every float-touching node, before dtype propagation.

        The pass only reads graph facts; the policy decides (first answer in priority order). Facts that
        depend on other nodes' decisions (is a reader FP32? does this op only connect FP32 ops?) are read off
        the previous round's decisions: local facts, then readers and cleared powers, then normalisers, then
        FP32-island bridges, each round deciding every node again.
        """
        facts: dict[torch.fx.Node, NodeFacts] = {}
        for node in gm.graph.nodes:
            if node.op != "call_function" or cast_dtype(node) is not None or node.target is operator.getitem:
                continue
            op = op_tables.op_name(node.target) or getattr(node.target, "__name__", str(node.target))
            facts[node] = NodeFacts(
                op,
                module_path(node),
                node.name,
                range_flag=node.meta.get(RANGE_KEY, ""),
                feeds_norm=feeds_norm(node),
                broadcast_gate=op in op_tables.GATE_OPS and broadcast_by_mul(node),
            )
        if self.policy.level is not Level.O0:
            _refuse_unmatched(self.policy, [(f.op, f.module, f.node) for f in facts.values()])
        for node in discrete_cone(facts):
            facts[node] = replace(facts[node], discrete=True)
        decisions = self._decide(facts)

        def fp32(nodes: Any) -> bool:
            return any(decisions.get(u, _NONE).mode == "fp32" for u in nodes)

        facts = {
            n: replace(f, fp32_reader=fp32(n.users), range_cleared=n.meta.get(RANGE_LOW_KEY, ""))
            for n, f in facts.items()
        }
        decisions = self._decide(facts)
        facts = {n: replace(f, feeds_fp32=fp32(within_two(n))) for n, f in facts.items()}
        decisions = self._decide(facts)
        outputs_fp32 = not self.policy.low_precision_io
        facts = {n: replace(f, bridges_fp32=bridges_fp32(n, decisions, outputs_fp32)) for n, f in facts.items()}
        return self._decide(facts)

    def _decide(self, facts: dict[torch.fx.Node, NodeFacts]) -> dict[torch.fx.Node, Decision]:
        return {node: self.policy.decide(f) for node, f in facts.items()}

    def _fp8(self, decisions: dict[torch.fx.Node, Decision]) -> dict[torch.fx.Node, Fp8Site]:
        """FP8 decisions for the compute-bound ops the plan made low (``--precision fp8``), last: every rule
        that keeps an op FP32 has spoken. Returns the sites the ``fp8_matmul`` pass rewrites."""
        sites: dict[torch.fx.Node, Fp8Site] = {}
        if not self.policy.fp8:
            return sites
        for node, dec in list(decisions.items()):
            if dec.mode != "low" or dec.pinned or op_tables.op_name(node.target) not in COMPUTE_BOUND:
                continue
            no_kernel, overflow, site = fp8_fact(node, self.fp8_ranges, self.fp8_clip_check)
            decisions[node] = self.policy.for_fp8(dec, no_kernel, overflow)
            if decisions[node].fp8 and site is not None:
                sites[node] = site
        return sites

    def _plan_node(
        self,
        node: torch.fx.Node,
        decision: Decision | None,
        out_dtype: dict[torch.fx.Node, Any],
        counters: Counter[str],
    ) -> Any:
        val = fake_value(node)
        inputs = [a for a in tensor_inputs(node) if isinstance(out_dtype.get(a), torch.dtype)]
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
            compute = _promoted([(out_dtype[a], fake_value(a).dim()) for a in inputs])
        node.meta[PRECISION_KEY] = PrecisionAnnotation(mode=mode, dtype=compute, reason=reason, rule=source.value)
        counters[f"nodes:{mode}"] += 1
        if compute is not None:
            counters[f"compute:{str(compute).removeprefix('torch.')}"] += 1
        return _predict_out(node, val, compute)


def _op(node: torch.fx.Node) -> str:
    return op_tables.op_name(node.target) or str(node.target)


def _predict_out(node: torch.fx.Node, val: Any, compute: torch.dtype | None) -> Any:
    """Output dtype(s) once the node computes in ``compute``.

    A float output that had the op's original input dtype takes the compute dtype; outputs of another
    dtype (integer results, an explicit ``dtype=`` argument, a norm's FP32 statistics) keep theirs. The
    original input dtype is the promoted one (:func:`_promoted`, as the plan's own compute dtype).
    """
    if compute is None or _has_dtype_argument(node):
        return dtypes_of(val)
    original_in = _promoted([(v.dtype, v.dim()) for v in map(fake_value, tensor_inputs(node))])

    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if v.dtype.is_floating_point and (original_in is None or v.dtype == original_in):
                return compute
            return v.dtype
        if isinstance(v, (tuple, list)):
            return tuple(one(x) for x in v)
        return None

    return one(val)
