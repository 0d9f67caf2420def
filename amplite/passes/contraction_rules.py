"""Contraction fusion rules, after onnxscript's rewriter: pattern, check, match, rewrite.

A :class:`ContractionRule` names the ops it matches (``targets``, the pattern), says why one of them cannot be
fused (``check``), how to read its operands, intrinsic bias and scalars (``inputs``) and how its output
dimensions map to the operands' modes (``groups``). :meth:`ContractionRule.match` returns a typed
:class:`ContractionMatch` (the traced operand chains, the einsum equation, the absorbed output scalings and
bias, what fusing saves) or a :class:`NoMatch` carrying the :class:`Rejection` that says why;
:meth:`ContractionRule.rewrite` turns a match into one ``amplite::contract`` node. The mode algebra signals
what it cannot express with ``NotFusable``; no exception leaves a rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

import amplite.ops.contract  # noqa: F401  (registers torch.ops.amplite.contract)
from amplite.passes import einsum_equation as eqn
from amplite.passes.contraction_chains import (
    ASSERT_META,
    BIAS_ADDS,
    MOVEMENT,
    SCALES,
    Rejection,
    SymbolicExtents,
    Traced,
    add_view,
    chain_input,
    copies,
    fake_call,
    is_number,
    node_shape,
    output_chain,
    trace_operand,
)
from amplite.passes.einsum_equation import ModeTable, NotFusable, Operand
from amplite.passes.graph_utils import cast_dtype, make_cast, value_dtype
from amplite.passes.meta import CONTRACT_KEY

aten = torch.ops.aten
CONTRACT = torch.ops.amplite.contract.default


@dataclass
class Inputs:
    """What a contraction rule reads from its node."""

    a: torch.fx.Node
    b: torch.fx.Node
    bias: torch.fx.Node | None = None
    alpha: float = 1.0
    beta: float = 1.0


@dataclass
class Fusion:
    """One contraction the pass fused."""

    node: str
    rule: str
    equation: str
    absorbed: list[str]


@dataclass(frozen=True)
class FusionContext:
    """What every rule's match and rewrite need from the pass: its settings and the graph's symbolic sizes.

    Attributes:
        dtypes: Operand dtypes the pass fuses.
        syms: Symbolic extents of the graph being rewritten.
    """

    dtypes: tuple[torch.dtype, ...]
    syms: SymbolicExtents


@dataclass(frozen=True)
class ContractionMatch:
    """A contraction a rule can fuse, with everything its rewrite needs.

    Attributes:
        node: The contraction node.
        a: The first operand's traced chain (source, absorbed nodes, cast).
        b: The second operand's traced chain.
        equation: The einsum equation and the views of the sources, bias and result.
        bias: The bias tensor (intrinsic or an absorbed ``add``), or None.
        alpha: Scale of the product (absorbed scalings and the equation's factor included).
        beta: Scale of the bias.
        tail: Absorbed output scalings and bias add, in order.
        last: The node whose value the fused contraction replaces.
        kernels_saved: Kernels eager runs that fusing removes (scalings, bias adds, copies).
        views_saved: Free views removed, net of the new ones fusing needs.
        notes: Chain stops recorded while matching (``shared_intermediate``, ``output_cast``, ...).
    """

    node: torch.fx.Node
    a: Traced
    b: Traced
    equation: eqn.Equation
    bias: torch.fx.Node | None
    alpha: float
    beta: float
    tail: tuple[torch.fx.Node, ...]
    last: torch.fx.Node
    kernels_saved: int
    views_saved: int
    notes: tuple[Rejection, ...]

    @property
    def pays(self) -> bool:
        """Whether fusing removes a kernel or, net, a view."""
        return self.kernels_saved > 0 or self.views_saved > 0

    @property
    def gain_detail(self) -> str:
        """What fusing would absorb, for a rejection when it does not pay."""
        moved = sum(cast_dtype(n) is None for t in (self.a, self.b) for n in t.chain)
        new = moved + len(self.tail) - self.kernels_saved - self.views_saved
        return f"{moved} free view(s) absorbed, {max(new, 0)} new view(s) needed"


@dataclass(frozen=True)
class NoMatch:
    """Why a rule did not fuse a node: the rejection, after the chain stops noted on the way."""

    rejection: Rejection
    notes: tuple[Rejection, ...] = ()


class ContractionRule:
    """Pattern (``targets``) + ``check`` + how to read operands and output modes; ``match`` and ``rewrite``."""

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

    def match(self, node: torch.fx.Node, ctx: FusionContext) -> ContractionMatch | NoMatch:
        """The fusion of ``node`` with its operand and output chains, or why there is none."""
        reason = self.check(node)
        if reason:
            return NoMatch(Rejection(node.name, self.name, reason))
        ins = self.inputs(node)
        dts = {value_dtype(ins.a), value_dtype(ins.b), value_dtype(node)}
        if len(dts) != 1:
            return NoMatch(Rejection(node.name, self.name, "dtype_mismatch", str(sorted(map(str, dts)))))
        dtype = dts.pop()
        if dtype not in ctx.dtypes:
            return NoMatch(Rejection(node.name, self.name, "dtype_not_enabled", str(dtype)))
        found: ContractionMatch | NoMatch = NoMatch(Rejection(node.name, self.name, "broadcast_only_mode"))
        for keep_expand in (False, True):
            notes: list[Rejection] = []
            try:
                return self._match(node, ins, dtype, keep_expand, notes, ctx)
            except NotFusable as e:
                found = NoMatch(Rejection(node.name, self.name, e.reason, e.detail), tuple(notes))
                # An output mode that only an absorbed expand provides cannot be written as einsum:
                # try once more with expands kept as (stride-0 view) sources.
                if e.reason != "broadcast_only_mode":
                    break
        return found

    def _match(
        self,
        node: torch.fx.Node,
        ins: Inputs,
        dtype: torch.dtype,
        keep_expand: bool,
        notes: list[Rejection],
        ctx: FusionContext,
    ) -> ContractionMatch:
        table = ModeTable()
        ta = trace_operand(table, ins.a, node, self.name, keep_expand, notes)
        tb = trace_operand(table, ins.b, node, self.name, keep_expand, notes)
        groups = self.groups(table, ta.operand, tb.operand, node)
        if [table.extent(g) for g in groups] != node_shape(node):
            raise NotFusable("shape_mismatch", node.name)
        bias, alpha, beta, tail, last = output_chain(node, self.name, (ins.alpha, ins.beta, ins.bias), dtype, notes)
        c_shape = None if bias is None else node_shape(bias)
        eq = eqn.build_equation(table, ta.operand, tb.operand, groups, c_shape)
        for what, shape in (("a view", eq.a_view), ("b view", eq.b_view), ("bias view", eq.c_view)):
            ctx.syms.check(shape or [], what)
        ctx.syms.check(node_shape(last), "output view")
        moved = [n for t in (ta, tb) for n in t.chain if cast_dtype(n) is None]
        # Gain = (kernels saved, free views saved net of new ones). A scaling, a bias add, a clone, a
        # contiguous or reshape that copies (of a non-contiguous value) is a kernel eager runs: absorbing
        # one always pays. Views are free; split views of the sources are new nodes, so absorbing only
        # views pays only when it removes more of them than it adds.
        kernels = [n for n in moved if n.target in SCALES or copies(n)] + tail
        new_views = [v for v, t in ((eq.a_view, ta), (eq.b_view, tb)) if v != node_shape(t.source)]
        return ContractionMatch(
            node=node,
            a=ta,
            b=tb,
            equation=eq,
            bias=bias,
            alpha=alpha * ta.operand.scale * tb.operand.scale * eq.factor,
            beta=beta,
            tail=tuple(tail),
            last=last,
            kernels_saved=len(kernels),
            views_saved=len(moved) - len(kernels) + len(tail) - len(new_views),
            notes=tuple(notes),
        )

    def rewrite(self, graph: torch.fx.Graph, m: ContractionMatch, ctx: FusionContext) -> tuple[Fusion, list]:
        """Replace the match by one ``amplite::contract`` node (plus free views).

        Returns:
            The fusion record and the nodes it erased.
        """
        eq, last = m.equation, m.last
        meta = {k: m.node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in m.node.meta}

        def view(x: torch.fx.Node, shape: list) -> torch.fx.Node:
            return x if shape == node_shape(x) else add_view(graph, x, shape, meta, ctx.syms)

        with graph.inserting_before(last):
            a = view(_source(graph, m.a), eq.a_view)
            b = view(_source(graph, m.b), eq.b_view)
            c = m.bias if m.bias is None or eq.c_view is None else view(m.bias, eq.c_view)
            args = (eq.equation, a, b, c, m.alpha, m.beta if c is not None else 0.0)
            fused = graph.call_function(CONTRACT, args)
            fused.meta.update(meta)
            fused.meta["val"] = fake_call(CONTRACT, *args)
            absorbed = [n.name for t in (m.a, m.b) for n in t.chain] + [n.name for n in m.tail]
            fused.meta[CONTRACT_KEY] = {"rule": self.name, "absorbed": absorbed}
            out = view(fused, node_shape(last)) if eq.out_shape != node_shape(last) else fused
        last.replace_all_uses_with(out)
        gone = [last, *reversed(m.tail), m.node, *reversed(m.a.chain), *reversed(m.b.chain)]
        erased: list[torch.fx.Node] = []
        for n in gone:  # consumers before producers, so each is dead when reached
            for u in [u for u in n.users if u.target is ASSERT_META]:
                u.replace_input_with(n, chain_input(n))
            if n not in erased and not n.users:
                graph.erase_node(n)
                erased.append(n)
        return Fusion(fused.name, self.name, eq.equation, absorbed), erased


def absorbed_kinds(m: ContractionMatch) -> list[str]:
    """The counter name of every node a match absorbs (``cast``, ``permute``, ``scale``, ``bias``...)."""
    kinds = [
        "cast" if cast_dtype(n) is not None else MOVEMENT.get(n.target, "scale") for t in (m.a, m.b) for n in t.chain
    ]
    return kinds + ["bias" if n.target in BIAS_ADDS else "scale" for n in m.tail]


def _source(graph: torch.fx.Graph, t: Traced) -> torch.fx.Node:
    return t.source if t.cast is None else make_cast(graph, t.source, t.cast)


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
        return None if all(is_number(s) for s in scalars) else "non_constant_scalar"

    def inputs(self, node: torch.fx.Node) -> Inputs:
        return Inputs(node.args[1], node.args[2], node.args[0], node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1))


class EinsumRule(ContractionRule):
    name, targets = "einsum", (aten.einsum.default,)

    def check(self, node: torch.fx.Node) -> str | None:
        return None if len(node.args[1]) == 2 else "einsum_operands"

    def inputs(self, node: torch.fx.Node) -> Inputs:
        return Inputs(node.args[1][0], node.args[1][1])

    def groups(self, table: ModeTable, a: Operand, b: Operand, node: torch.fx.Node) -> list[list[int]]:
        return eqn.einsum_groups(table, node.args[0], a, b)


RULES: tuple[ContractionRule, ...] = (MatmulRule(), LinearRule(), AddmmRule(), EinsumRule())
