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
from amplite.passes.einsum_equation import ModeTable, NotFusable, Operand
from amplite.passes.graph_utils import cast_dtype, fake_value, make_cast, value_dtype

aten = torch.ops.aten
CONTRACT = torch.ops.amplite.contract.default

#: Data-movement ops an operand chain may absorb, with the counter name each bumps.
MOVEMENT = {
    aten.permute.default: "permute", aten.transpose.int: "transpose", aten.t.default: "transpose",
    aten.view.default: "view", aten.reshape.default: "view", aten._unsafe_view.default: "view",
    aten.unsqueeze.default: "unsqueeze", aten.expand.default: "expand",
    aten.squeeze.dim: "squeeze", aten.squeeze.dims: "squeeze", aten.squeeze.default: "squeeze",
    aten.contiguous.default: "contiguous", aten.clone.default: "contiguous",
}  # fmt: skip
#: Export checks a value's dtype/device/layout before ``.to()`` with these; they read nothing else.
ASSERT_META = aten._assert_tensor_metadata.default
SCALES = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
BIAS_ADDS = {aten.add.Tensor, aten.sub.Tensor}


@dataclass
class Rejection:
    """A node the pass did not fuse (or absorb), and why."""

    node: str
    rule: str
    reason: str
    detail: str = ""


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


@dataclass
class Inputs:
    """What a contraction rule reads from its node."""

    a: torch.fx.Node
    b: torch.fx.Node
    bias: torch.fx.Node | None = None
    alpha: float = 1.0
    beta: float = 1.0


class ContractionRule:
    """Pattern (``targets``) + ``check`` + how to read operands and output modes."""

    name = ""
    targets: tuple = ()

    def check(self, node: torch.fx.Node) -> str | None:
        """A reason the node cannot be fused by this rule, or None."""
        return None

    def inputs(self, node: torch.fx.Node) -> Inputs:
        """Operands, intrinsic bias and scalars."""
        return Inputs(node.args[0], node.args[1])

    def groups(self, table: ModeTable, a: Operand, b: Operand, node: torch.fx.Node) -> list[list[int]]:
        """Output dimensions as mode groups (unifying the contracted and batch modes)."""
        return eqn.matmul_groups(table, a, b)


class MatmulRule(ContractionRule):
    name, targets = "matmul", (aten.mm.default, aten.bmm.default, aten.matmul.default)


class LinearRule(ContractionRule):
    name, targets = "linear", (aten.linear.default,)

    def inputs(self, node: torch.fx.Node) -> Inputs:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return Inputs(node.args[0], node.args[1], bias)

    def groups(self, table: ModeTable, a: Operand, b: Operand, node: torch.fx.Node) -> list[list[int]]:
        return eqn.linear_groups(table, a, b)


class AddmmRule(ContractionRule):
    name, targets = "addmm", (aten.addmm.default, aten.baddbmm.default)

    def check(self, node: torch.fx.Node) -> str | None:
        scalars = [node.kwargs.get(k, 1) for k in ("beta", "alpha")]
        return None if all(_is_number(s) for s in scalars) else "non_constant_scalar"

    def inputs(self, node: torch.fx.Node) -> Inputs:
        return Inputs(
            node.args[1], node.args[2], node.args[0], node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
        )


class EinsumRule(ContractionRule):
    name, targets = "einsum", (aten.einsum.default,)

    def check(self, node: torch.fx.Node) -> str | None:
        return None if len(node.args[1]) == 2 else "einsum_operands"

    def inputs(self, node: torch.fx.Node) -> Inputs:
        return Inputs(node.args[1][0], node.args[1][1])

    def groups(self, table: ModeTable, a: Operand, b: Operand, node: torch.fx.Node) -> list[list[int]]:
        return eqn.einsum_groups(table, node.args[0], a, b)


RULES: tuple[ContractionRule, ...] = (MatmulRule(), LinearRule(), AddmmRule(), EinsumRule())


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _static_shape(node: Any) -> list[int]:
    val = fake_value(node)
    if not isinstance(val, torch.Tensor):
        raise NotFusable("no_meta", getattr(node, "name", str(node)))
    if not all(isinstance(n, int) for n in val.shape):
        raise NotFusable("symbolic_shape", node.name)
    return list(val.shape)


def _scale_of(node: torch.fx.Node, x: Any) -> float | None:
    """The constant ``node`` multiplies ``x`` by, if it is ``x * c``, ``c * x`` or ``x / c``."""
    if node.op != "call_function" or node.target not in SCALES or node.kwargs:
        return None
    p, q = node.args[0], node.args[1]
    if node.target in (aten.div.Tensor, aten.div.Scalar):
        return 1.0 / q if p is x and _is_number(q) and q != 0 else None
    if p is x and _is_number(q):
        return float(q)
    return float(p) if q is x and _is_number(p) else None


def _chain_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor an absorbable operand-chain node reads, or None when it is not absorbable."""
    if node.op != "call_function":
        return None
    if node.target in MOVEMENT:
        extra = set(node.kwargs) - {"memory_format"}
        return None if extra else node.args[0]
    if node.target in SCALES:
        for x in node.args[:2]:
            if isinstance(x, torch.fx.Node) and _scale_of(node, x) is not None:
                return x
        return None
    return node.args[0] if cast_dtype(node) is not None else None


def _apply(table: ModeTable, op: Operand, node: torch.fx.Node) -> None:
    """Apply one chain node to the operand's mode bookkeeping."""
    t, args = node.target, node.args
    if t is aten.permute.default:
        op.permute(args[1])
    elif t is aten.transpose.int:
        op.transpose(args[1], args[2])
    elif t is aten.t.default:
        if len(op.dims) == 2:
            op.transpose(0, 1)
    elif t is aten.unsqueeze.default:
        op.unsqueeze(args[1])
    elif t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        op.squeeze(table, None if len(args) < 2 else [args[1]] if isinstance(args[1], int) else args[1])
    elif t is aten.expand.default:
        op.expand_to(table, _static_shape(node))
    elif t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        op.view(table, _static_shape(node))
    elif t in SCALES:
        op.scale *= _scale_of(node, _chain_input(node))
    if op.shape(table) != _static_shape(node):  # cheap guard against a wrong model of an op
        raise NotFusable("shape_mismatch", node.name)


@dataclass
class _Traced:
    source: torch.fx.Node
    operand: Operand
    chain: list[torch.fx.Node]  # absorbed nodes, source side first
    cast: torch.dtype | None


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
        out_shape = _static_shape(node)
        for keep_expand in (False, True):
            notes: list[Rejection] = []
            try:
                table = ModeTable()
                ta = self._trace(table, ins.a, node, rule.name, keep_expand, notes)
                tb = self._trace(table, ins.b, node, rule.name, keep_expand, notes)
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
        new_views = [v for v, t in ((eq.a_view, ta), (eq.b_view, tb)) if v != _static_shape(t.source)]
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
            scale = _scale_of(user, cur)
            if scale is not None:
                alpha, beta = alpha * scale, beta * scale
            elif bias is None and user.target in BIAS_ADDS and self._bias_ok(user, cur, dtype):
                bias = user.args[1] if user.args[0] is cur else user.args[0]
                beta = (-1.0 if user.target is aten.sub.Tensor else 1.0) * float(user.kwargs.get("alpha", 1))
            else:
                break
            tail.append(user)
            cur = user
        if len(cur.users) > 1 and any(_scale_of(u, cur) is not None for u in cur.users):
            notes.append(Rejection(cur.name, rule.name, "shared_intermediate", "output scaling not absorbed"))
        if bias is not None and value_dtype(bias) != dtype:
            raise NotFusable("bias_dtype", str(value_dtype(bias)))
        c_shape = None if bias is None else _static_shape(bias)
        return {"bias": bias, "c_shape": c_shape, "alpha": alpha, "beta": beta, "tail": tail, "last": cur}

    def _bias_ok(self, add: torch.fx.Node, cur: torch.fx.Node, dtype: torch.dtype) -> bool:
        p, q = add.args[0], add.args[1]
        other = q if p is cur else p if q is cur and add.target is aten.add.Tensor else None
        alpha = add.kwargs.get("alpha", 1)
        return (
            isinstance(other, torch.fx.Node)
            and other is not cur
            and set(add.kwargs) <= {"alpha"}
            and _is_number(alpha)
            and value_dtype(other) == dtype
            and fake_value(add) is not None
            and fake_value(add).shape == fake_value(cur).shape  # the bias must not broadcast the result
        )

    def _trace(
        self,
        table: ModeTable,
        arg: Any,
        consumer: torch.fx.Node,
        rule: str,
        keep_expand: bool,
        notes: list[Rejection],
    ) -> _Traced:
        if not isinstance(arg, torch.fx.Node):
            raise NotFusable("non_tensor_operand")
        chain: list[torch.fx.Node] = []
        cur = arg
        while (nxt := _chain_input(cur)) is not None:
            # Movement and scaling keep dtype, device and layout, so a metadata assert can move to the
            # input; after a cast it could not.
            users = [u for u in cur.users if u.target is not ASSERT_META or cast_dtype(cur) is not None]
            reason = (
                "intermediate_is_graph_output" if any(u.op == "output" for u in users)
                else "shared_intermediate" if len(users) != 1
                else "broadcast_only_mode" if keep_expand and cur.target is aten.expand.default
                else None
            )  # fmt: skip
            if reason:
                if cast_dtype(cur) is None:  # a shared cast is the precision passes' choice, not news
                    notes.append(Rejection(cur.name, rule, reason, f"not absorbed into {consumer.name}"))
                break
            chain.append(cur)
            cur = nxt
        chain.reverse()
        source = cur
        while chain and cast_dtype(chain[0]) is not None:  # a cast right on the source is the source
            source = chain.pop(0)
        while True:  # absorb from the source forward; an op that cannot be absorbed becomes the source
            op, cast = Operand.from_shape(table, _static_shape(source)), None
            for i, n in enumerate(chain):
                try:
                    dt = cast_dtype(n)
                    if dt is not None and (cast is not None or op.scale != 1.0):
                        # Casting the unscaled value first could overflow where eager did not.
                        raise NotFusable("cast_after_scale" if cast is None else "second_cast")
                    if dt is not None:
                        cast = dt
                    else:
                        _apply(table, op, n)
                except NotFusable as e:
                    notes.append(Rejection(n.name, rule, e.reason, e.detail))
                    source, chain = n, chain[i + 1 :]
                    break
            else:
                return _Traced(source, op, chain, cast)

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
            if c is not None and eq.c_view is not None and eq.c_view != _static_shape(c):
                c = _view(graph, c, eq.c_view, meta)
            args = (eq.equation, a, b, c, plan["alpha"], plan["beta"] if c is not None else 0.0)
            fused = graph.call_function(CONTRACT, args)
            fused.meta.update(meta)
            fused.meta["val"] = _fake(CONTRACT, *args)
            absorbed = [n.name for t in (plan["a"], plan["b"]) for n in t.chain] + [
                n.name for n in plan["tail"]
            ]
            fused.meta["amplite_contract"] = {"rule": rule.name, "absorbed": absorbed}
            out = (
                fused
                if eq.out_shape == _static_shape(last)
                else _view(graph, fused, _static_shape(last), meta)
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
                u.replace_input_with(n, _chain_input(n))
            if n not in erased and not n.users:
                graph.erase_node(n)
                erased.add(n)
        return erased

    def _operand(self, graph: torch.fx.Graph, t: _Traced, view: list[int], meta: dict) -> torch.fx.Node:
        x = t.source
        if t.cast is not None:
            x = make_cast(graph, x, t.cast)
        return x if view == _static_shape(x) else _view(graph, x, view, meta)


def _fake(op: Any, *args: Any) -> Any:
    """Run ``op`` on the args' ``meta['val']`` under their fake mode (the fake implementation)."""
    vals = [fake_value(a) if isinstance(a, torch.fx.Node) else a for a in args]
    mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    if mode is None:
        return op(*vals)
    with mode:
        return op(*vals)


def _view(graph: torch.fx.Graph, x: torch.fx.Node, shape: list[int], meta: dict) -> torch.fx.Node:
    node = graph.call_function(aten.view.default, (x, list(shape)))
    node.meta.update(meta)
    node.meta["val"] = _fake(aten.view.default, x, list(shape))
    return node
