"""Fuse data movement, scaling and bias around contractions into one ``amplite::contract``.

After this pass, each fused contraction (``mm``, ``bmm``, ``matmul``, ``linear``, ``addmm``, ``baddbmm``,
two-operand ``einsum``) is a single ``amplite::contract`` node whose einsum equation absorbs the
permutes, transposes, ``t``, ``contiguous``/``clone``, unsqueezes, squeezes, expands and the views/reshapes
that only split or merge adjacent dimensions on its inputs, constant scalings (``mul``/``div`` by a
Python number) on its inputs and output, and one bias ``add``/``sub`` on its output. What remains around
it are free views: one that splits a source's dimensions into the equation's modes, one on a bias, and
one that merges the (contiguous) result back to the original shape.

Guarantees:

* Values are unchanged up to rounding: every rewrite is exact in real arithmetic (see
  ``einsum_equation``); the fused result rounds once (FP32 accumulation, scaling and bias) where eager
  rounded after each op.
* A node that is a graph output or has users outside the chain is never absorbed: it stays, and the
  contraction reads it as its source (reason ``shared_intermediate`` / ``intermediate_is_graph_output``).
* Every new node has ``meta['val']`` (from the op's fake implementation under the graph's fake mode),
  the graph lints, and the module re-exports and saves with ``torch.export`` (load needs
  ``import amplite.ops`` first).

Precision: the pass runs after the precision passes and fuses only contractions whose operands and
result share a dtype in ``dtypes`` (fp16/bf16 by default), so it neither adds nor removes precision
decisions. A pure cast inside an operand's chain is kept as a cast of the source (moving data and
changing dtype commute), never dropped; a cast downstream of an absorbed scaling is not crossed, since
casting the unscaled value first could overflow.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx

import amplite.ops.contract  # noqa: F401  (registers torch.ops.amplite.contract)
from amplite.passes import einsum_equation as eqn
from amplite.passes.base import PassResult, call_function_nodes
from amplite.passes.contraction_rules import (
    ASSERT_META,
    BIAS_ADDS,
    MOVEMENT,
    RULES,
    SCALES,
    AddmmRule,
    ContractionRule,
    EinsumRule,
    Inputs,
    LinearRule,
    MatmulRule,
    Rejection,
    Traced,
    add_view,
    chain_input,
    fake_call,
    is_number,
    scale_of,
    static_shape,
    trace_operand,
)
from amplite.passes.einsum_equation import ModeTable, NotFusable, Operand
from amplite.passes.graph_utils import cast_dtype, fake_value, make_cast, value_dtype

# Rules, constants and ``Rejection`` live in ``contraction_rules`` (the mode types in ``einsum_equation``);
# they stay importable from here.
__all__ = [
    "ASSERT_META",
    "BIAS_ADDS",
    "CONTRACT",
    "MOVEMENT",
    "RULES",
    "SCALES",
    "AddmmRule",
    "ContractionRule",
    "EinsumRule",
    "FuseContractions",
    "Fusion",
    "FusionResult",
    "Inputs",
    "LinearRule",
    "MatmulRule",
    "ModeTable",
    "NotFusable",
    "Operand",
    "Rejection",
]

aten = torch.ops.aten
CONTRACT = torch.ops.amplite.contract.default


@dataclass
class Fusion:
    """One contraction the pass fused."""

    node: str
    rule: str
    equation: str
    absorbed: list[str]


@dataclass
class FusionResult(PassResult):
    """``PassResult`` plus the per-node records the report lists."""

    fused: list[Fusion] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)

    @property
    def details(self) -> dict[str, list[dict[str, object]]]:
        """Per-node records for the report: what was fused (with its equation) and what was not, and why."""
        return {"fused": [asdict(f) for f in self.fused], "rejected": [asdict(r) for r in self.rejections]}


class FuseContractions:
    """Fuse contractions with their surrounding data movement, scaling and bias (see module docstring).

    Args:
        dtypes: Operand dtypes to fuse. Default fp16/bf16: the pass runs after the precision passes and
            leaves FP32 contractions alone; add ``torch.float32`` to fuse FP32 graphs (tests, benchmarks).
        fuse_plain: Also replace contractions that absorb nothing (a bare ``linear``); off by default,
            since cuBLAS already runs those optimally.
    """

    name = "fuse_contractions"

    def __init__(
        self, dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16), fuse_plain: bool = False
    ) -> None:
        self.dtypes = tuple(dtypes)
        self.fuse_plain = fuse_plain

    def __call__(self, gm: torch.fx.GraphModule) -> FusionResult:
        """Fuse every eligible contraction in ``gm`` in place."""
        res = FusionResult(gm, False, Counter())
        erased: set[torch.fx.Node] = set()
        for node in call_function_nodes(gm):
            rule = next((r for r in RULES if node.target in r.targets), None)
            if rule is None or node in erased:
                continue
            reason = rule.check(node)
            try:
                if reason:
                    raise NotFusable(reason)
                plan = self._plan(node, rule, res)
            except NotFusable as e:
                self._reject(res, node, rule.name, e.reason, e.detail)
                continue
            if plan["gain"] <= 0 and not self.fuse_plain:
                res.counters["skipped:nothing_to_absorb"] += 1
                continue
            erased |= self._replace(gm.graph, node, rule, plan, res)
            res.modified = True
        if res.modified:
            gm.graph.lint()
            gm.recompile()
        return res

    # --- planning --------------------------------------------------------------------------------------

    def _reject(
        self, res: FusionResult, node: torch.fx.Node, rule: str, reason: str, detail: str = ""
    ) -> None:
        self._commit(res, [Rejection(node.name, rule, reason, detail)])

    def _commit(self, res: FusionResult, notes: list[Rejection]) -> None:
        for r in notes:
            res.counters[f"rejected:{r.reason}"] += 1
            res.rejections.append(r)

    def _plan(self, node: torch.fx.Node, rule: ContractionRule, res: FusionResult) -> dict[str, Any]:
        ins = rule.inputs(node)
        dts = {value_dtype(ins.a), value_dtype(ins.b), value_dtype(node)}
        if len(dts) != 1:
            raise NotFusable("dtype_mismatch", str(sorted(map(str, dts))))
        dtype = dts.pop()
        if dtype not in self.dtypes:
            raise NotFusable("dtype_not_enabled", str(dtype))
        out_shape = static_shape(node)
        for keep_expand in (False, True):
            notes: list[Rejection] = []
            try:
                table = ModeTable()
                ta = trace_operand(table, ins.a, node, rule.name, keep_expand, notes)
                tb = trace_operand(table, ins.b, node, rule.name, keep_expand, notes)
                groups = rule.groups(table, ta.operand, tb.operand, node)
                if [table.extent(g) for g in groups] != out_shape:
                    raise NotFusable("shape_mismatch", node.name)
                plan = self._plan_output(node, rule, ins, dtype, notes)
                plan["eq"] = eq = eqn.build_equation(table, ta.operand, tb.operand, groups, plan["c_shape"])
                break
            except NotFusable as e:
                # An output mode that only an absorbed expand provides cannot be written as einsum:
                # try once more with expands kept as (stride-0 view) sources.
                if keep_expand or e.reason != "broadcast_only_mode":
                    self._commit(res, notes)
                    raise
        self._commit(res, notes)
        plan["alpha"] *= ta.operand.scale * tb.operand.scale * eq.factor
        moved = [n for t in (ta, tb) for n in t.chain if cast_dtype(n) is None]
        # Split views of the sources are free but are new nodes: absorbing only a split gains nothing.
        new_views = [v for v, t in ((eq.a_view, ta), (eq.b_view, tb)) if v != static_shape(t.source)]
        plan.update(a=ta, b=tb, gain=len(moved) + len(plan["tail"]) - len(new_views))
        return plan

    def _plan_output(
        self, node: torch.fx.Node, rule: ContractionRule, ins: Inputs, dtype: torch.dtype, notes: list
    ) -> dict[str, Any]:
        """Absorb constant scalings and one bias add that follow the contraction."""
        alpha, beta, bias, tail = float(ins.alpha), float(ins.beta), ins.bias, []
        cur = node
        while len(cur.users) == 1:
            user = next(iter(cur.users))
            scale = scale_of(user, cur)
            if scale is not None:
                alpha, beta = alpha * scale, beta * scale
            elif bias is None and user.target in BIAS_ADDS and self._bias_ok(user, cur, dtype):
                bias = user.args[1] if user.args[0] is cur else user.args[0]
                beta = (-1.0 if user.target is aten.sub.Tensor else 1.0) * float(user.kwargs.get("alpha", 1))
            else:
                break
            tail.append(user)
            cur = user
        if len(cur.users) > 1 and any(scale_of(u, cur) is not None for u in cur.users):
            notes.append(Rejection(cur.name, rule.name, "shared_intermediate", "output scaling not absorbed"))
        if bias is not None and value_dtype(bias) != dtype:
            raise NotFusable("bias_dtype", str(value_dtype(bias)))
        c_shape = None if bias is None else static_shape(bias)
        return {"bias": bias, "c_shape": c_shape, "alpha": alpha, "beta": beta, "tail": tail, "last": cur}

    def _bias_ok(self, add: torch.fx.Node, cur: torch.fx.Node, dtype: torch.dtype) -> bool:
        p, q = add.args[0], add.args[1]
        other = q if p is cur else p if q is cur and add.target is aten.add.Tensor else None
        alpha = add.kwargs.get("alpha", 1)
        return (
            isinstance(other, torch.fx.Node)
            and other is not cur
            and set(add.kwargs) <= {"alpha"}
            and is_number(alpha)
            and value_dtype(other) == dtype
            and fake_value(add) is not None
            and fake_value(add).shape == fake_value(cur).shape  # the bias must not broadcast the result
        )

    # --- replacement -----------------------------------------------------------------------------------

    def _replace(
        self, graph: torch.fx.Graph, node: torch.fx.Node, rule: ContractionRule, plan: dict, res: FusionResult
    ) -> set[torch.fx.Node]:
        last: torch.fx.Node = plan["last"]
        eq: eqn.Equation = plan["eq"]
        meta = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta}
        with graph.inserting_before(last):
            a = self._operand(graph, plan["a"], eq.a_view, meta)
            b = self._operand(graph, plan["b"], eq.b_view, meta)
            c = plan["bias"]
            if c is not None and eq.c_view is not None and eq.c_view != static_shape(c):
                c = add_view(graph, c, eq.c_view, meta)
            args = (eq.equation, a, b, c, plan["alpha"], plan["beta"] if c is not None else 0.0)
            fused = graph.call_function(CONTRACT, args)
            fused.meta.update(meta)
            fused.meta["val"] = fake_call(CONTRACT, *args)
            absorbed = [n.name for t in (plan["a"], plan["b"]) for n in t.chain] + [
                n.name for n in plan["tail"]
            ]
            fused.meta["amplite_contract"] = {"rule": rule.name, "absorbed": absorbed}
            out = (
                fused
                if eq.out_shape == static_shape(last)
                else add_view(graph, fused, static_shape(last), meta)
            )
        last.replace_all_uses_with(out)
        res.counters[f"fused:{rule.name}"] += 1
        for n in [*plan["a"].chain, *plan["b"].chain]:
            kind = "cast" if cast_dtype(n) is not None else MOVEMENT.get(n.target, "scale")
            res.counters[f"absorbed:{kind}"] += 1
        for n in plan["tail"]:
            res.counters["absorbed:bias" if n.target in BIAS_ADDS else "absorbed:scale"] += 1
        res.fused.append(Fusion(fused.name, rule.name, eq.equation, absorbed))
        gone = [last, *reversed(plan["tail"]), node, *reversed(plan["a"].chain), *reversed(plan["b"].chain)]
        erased: set[torch.fx.Node] = set()
        for n in gone:  # consumers before producers, so each is dead when reached
            for u in [u for u in n.users if u.target is ASSERT_META]:
                u.replace_input_with(n, chain_input(n))
            if n not in erased and not n.users:
                graph.erase_node(n)
                erased.add(n)
        return erased

    def _operand(self, graph: torch.fx.Graph, t: Traced, view: list[int], meta: dict) -> torch.fx.Node:
        x = t.source
        if t.cast is not None:
            x = make_cast(graph, x, t.cast)
        return x if view == static_shape(x) else add_view(graph, x, view, meta)
