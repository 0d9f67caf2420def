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
    SymbolicExtents,
    Traced,
    add_view,
    chain_input,
    copies,
    fake_call,
    is_number,
    node_shape,
    scale_of,
    trace_operand,
)
from amplite.passes.einsum_equation import ModeTable, NotFusable, Operand
from amplite.passes.graph_utils import cast_dtype, fake_value, make_cast, value_dtype
from amplite.passes.meta import CONTRACT_KEY

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
        self._syms = SymbolicExtents(gm.graph)
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
            kernels, views = plan["gain"]
            if kernels <= 0 and views <= 0 and not self.fuse_plain:
                res.counters["skipped:nothing_to_absorb"] += 1
                res.rejections.append(Rejection(node.name, rule.name, "nothing_to_absorb", plan["gain_detail"]))
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
        out_shape = node_shape(node)
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
                for what, shape in (("a view", eq.a_view), ("b view", eq.b_view), ("bias view", eq.c_view)):
                    self._syms.check(shape or [], what)
                self._syms.check(node_shape(plan["last"]), "output view")
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
        # Gain = (kernels saved, free views saved net of new ones). A scaling, a bias add, a clone, a
        # contiguous or reshape that copies (of a non-contiguous value) is a kernel eager runs: absorbing
        # one always pays. Views are free; split views of the sources are new nodes, so absorbing only
        # views pays only when it removes more of them than it adds.
        kernels = [n for n in moved if n.target in SCALES or copies(n)] + plan["tail"]
        new_views = [v for v, t in ((eq.a_view, ta), (eq.b_view, tb)) if v != node_shape(t.source)]
        views = len(moved) - len(kernels) + len(plan["tail"]) - len(new_views)
        plan.update(a=ta, b=tb, gain=(len(kernels), views))
        plan["gain_detail"] = f"{len(moved)} free view(s) absorbed, {len(new_views)} new view(s) needed"
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
            elif bias is None and user.target in BIAS_ADDS and not self._bias_reason(user, cur, dtype):
                bias = user.args[1] if user.args[0] is cur else user.args[0]
                beta = (-1.0 if user.target is aten.sub.Tensor else 1.0) * float(user.kwargs.get("alpha", 1))
            else:
                self._note_output_stop(user, cur, bias, dtype, rule.name, notes)
                break
            tail.append(user)
            cur = user
        real = [u for u in cur.users if u.target is not ASSERT_META]
        if len(cur.users) > 1 and len(real) == 1:  # e.g. a cast whose metadata export asserts first
            self._note_output_stop(real[0], cur, bias, dtype, rule.name, notes)
        if len(real) > 1 and any(scale_of(u, cur) is not None or u.target in BIAS_ADDS for u in real):
            notes.append(Rejection(cur.name, rule.name, "shared_intermediate", "output scaling/bias not absorbed"))
        if bias is not None and value_dtype(bias) != dtype:
            raise NotFusable("bias_dtype", str(value_dtype(bias)))
        c_shape = None if bias is None else node_shape(bias)
        return {"bias": bias, "c_shape": c_shape, "alpha": alpha, "beta": beta, "tail": tail, "last": cur}

    def _bias_reason(self, add: torch.fx.Node, cur: torch.fx.Node, dtype: torch.dtype) -> str:
        """Why ``add`` cannot become the contraction's bias (empty when it can)."""
        p, q = add.args[0], add.args[1]
        other = q if p is cur else p if q is cur and add.target is aten.add.Tensor else None
        alpha = add.kwargs.get("alpha", 1)
        if not isinstance(other, torch.fx.Node) or other is cur:
            return "bias_not_tensor"
        if set(add.kwargs) - {"alpha"} or not is_number(alpha):
            return "bias_kwargs"
        if value_dtype(other) != dtype:
            return "bias_dtype"
        out, val = fake_value(add), fake_value(cur)
        if out is None or val is None or tuple(map(str, out.shape)) != tuple(map(str, val.shape)):
            return "bias_broadcasts_output"  # the bias must not broadcast the result
        return ""

    def _note_output_stop(
        self, user: torch.fx.Node, cur: torch.fx.Node, bias: Any, dtype: torch.dtype, rule: str, notes: list
    ) -> None:
        """Record why the output chain stops at ``user`` when it is a scaling, bias add or cast."""
        if user.op != "call_function":
            return
        if user.target in BIAS_ADDS:
            reason = "second_bias" if bias is not None else self._bias_reason(user, cur, dtype)
            other = [a for a in user.args[:2] if a is not cur]
            detail = f"{user.name}: bias {getattr(other[0], 'name', other[0]) if other else '?'} not absorbed"
            if reason == "bias_dtype":
                detail += f" ({value_dtype(other[0])} vs {dtype})"
            notes.append(Rejection(user.name, rule, reason, detail))
        elif cast_dtype(user) is not None:
            after = [u for u in user.users if u.op == "call_function" and u.target in BIAS_ADDS]
            what = f"; the {cast_dtype(user)} bias add {after[0].name} after it is not absorbed" if after else ""
            notes.append(Rejection(user.name, rule, "output_cast", f"contract returns {dtype}{what}"))
        elif user.target in SCALES:
            notes.append(Rejection(user.name, rule, "tensor_scale", "scaling by a tensor is not absorbed"))

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
            if c is not None and eq.c_view is not None and eq.c_view != node_shape(c):
                c = add_view(graph, c, eq.c_view, meta, self._syms)
            args = (eq.equation, a, b, c, plan["alpha"], plan["beta"] if c is not None else 0.0)
            fused = graph.call_function(CONTRACT, args)
            fused.meta.update(meta)
            fused.meta["val"] = fake_call(CONTRACT, *args)
            absorbed = [n.name for t in (plan["a"], plan["b"]) for n in t.chain] + [
                n.name for n in plan["tail"]
            ]
            fused.meta[CONTRACT_KEY] = {"rule": rule.name, "absorbed": absorbed}
            out = (
                fused
                if eq.out_shape == node_shape(last)
                else add_view(graph, fused, node_shape(last), meta, self._syms)
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
        return x if view == node_shape(x) else add_view(graph, x, view, meta, self._syms)
