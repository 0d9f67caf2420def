"""Contraction rules and per-op operand handling for ``fuse_contractions``.

A ``ContractionRule`` says which contraction ops it matches, when one cannot be fused, how to read its
operands, intrinsic bias and scalars, and how its output dimensions map to the operands' modes. The
helpers below classify and apply the nodes of an operand chain (data movement, constant scalings,
casts) to an ``Operand``'s mode bookkeeping, walk an operand's chain back to its source
(``trace_operand``, noting each ``Rejection``), and build the new graph nodes (views, and the symbolic
extents they need) with ``meta['val']``. ``fuse_contractions`` re-exports the rules, constants and
``Rejection``.

Shapes are read from ``meta['val']`` as mode extents (:func:`node_shape`): ints, or sympy expressions for
symbolic dimensions (dynamic batch/sequence), which :class:`SymbolicExtents` turns back into graph nodes
(``sym_size`` of a graph input, times constants) when a new view needs them.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from amplite.passes import einsum_equation as eqn
from amplite.passes.einsum_equation import ModeTable, NotFusable, Operand
from amplite.passes.einsum_modes import Size, norm_size
from amplite.passes.graph_utils import SymbolicExtents, cast_dtype, fake_value

aten = torch.ops.aten

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
#: View-like ops an operand chain cannot absorb: reaching one is recorded (``unmodelled_view``).
UNMODELLED_VIEWS = {
    aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.as_strided.default, aten.unfold.default,
    aten.diagonal.default, aten.alias.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int, aten.chunk.default, aten.movedim.int, aten.flatten.using_ints, aten.unflatten.int,
}  # fmt: skip


@dataclass
class Rejection:
    """A node the pass did not fuse (or absorb), and why."""

    node: str
    rule: str
    reason: str
    detail: str = ""


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
        return None if all(is_number(s) for s in scalars) else "non_constant_scalar"

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


def is_number(x: Any) -> bool:
    """Whether ``x`` is a Python int or float constant (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def size_of(n: int | torch.SymInt) -> Size:
    """An extent as the mode table keeps it: an int, or the sympy expression of a symbolic size."""
    return norm_size(n.node.expr) if isinstance(n, torch.SymInt) else int(n)


def node_shape(node: Any) -> list[Size]:
    """The node's shape from ``meta['val']`` as extents (symbolic ones as sympy); NotFusable when unknown."""
    val = fake_value(node)
    if not isinstance(val, torch.Tensor):
        raise NotFusable("no_meta", getattr(node, "name", str(node)))
    return [size_of(n) for n in val.shape]


def copies(node: torch.fx.Node) -> bool:
    """Whether an absorbable movement node materialises a copy in eager (so absorbing it saves one).

    ``clone`` always copies; ``contiguous`` copies a non-contiguous input; ``reshape`` copies when its input
    cannot be viewed as the output (decided by trying the view on the fake values).
    """
    src, out = fake_value(node.args[0]), fake_value(node)
    if node.target is aten.clone.default:
        return True
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if node.target is aten.contiguous.default:
        try:
            return not bool(src.is_contiguous())
        except Exception:  # an undecidable symbolic stride: eager may copy
            return True
    if node.target is aten.reshape.default:
        try:
            with getattr(src, "fake_mode", None) or contextlib.nullcontext():
                src.view(out.shape)
        except Exception:
            return True
    return False


def unmodelled_view(node: Any) -> str | None:
    """The op name when ``node`` is a view-like op the chains cannot absorb (a reason worth recording)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    target = node.target
    if target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        target = node.args[0].target  # unbind/split outputs are read through getitem
    if target in UNMODELLED_VIEWS or (target in MOVEMENT and chain_input(node) is None):
        return str(getattr(target, "__name__", target))
    return None


def scale_of(node: torch.fx.Node, x: Any) -> float | None:
    """The constant ``node`` multiplies ``x`` by, if it is ``x * c``, ``c * x`` or ``x / c``."""
    if node.op != "call_function" or node.target not in SCALES or node.kwargs:
        return None
    p, q = node.args[0], node.args[1]
    if node.target in (aten.div.Tensor, aten.div.Scalar):
        return 1.0 / q if p is x and is_number(q) and q != 0 else None
    if p is x and is_number(q):
        return float(q)
    return float(p) if q is x and is_number(p) else None


def chain_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor an absorbable operand-chain node reads, or None when it is not absorbable."""
    if node.op != "call_function":
        return None
    if node.target in MOVEMENT:
        extra = set(node.kwargs) - {"memory_format"}
        return None if extra else node.args[0]
    if node.target in SCALES:
        for x in node.args[:2]:
            if isinstance(x, torch.fx.Node) and scale_of(node, x) is not None:
                return x
        return None
    return node.args[0] if cast_dtype(node) is not None else None


def apply_chain_node(table: ModeTable, op: Operand, node: torch.fx.Node) -> None:
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
        op.expand_to(table, node_shape(node))
    elif t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        op.view(table, node_shape(node))
    elif t in SCALES:
        op.scale *= scale_of(node, chain_input(node))
    if op.shape(table) != node_shape(node):  # cheap guard against a wrong model of an op
        raise NotFusable("shape_mismatch", node.name)


@dataclass
class Traced:
    """One operand as traced: its source, mode bookkeeping, absorbed chain and pending cast."""

    source: torch.fx.Node
    operand: Operand
    chain: list[torch.fx.Node]  # absorbed nodes, source side first
    cast: torch.dtype | None


def trace_operand(
    table: ModeTable,
    arg: Any,
    consumer: torch.fx.Node,
    rule: str,
    keep_expand: bool,
    notes: list[Rejection],
) -> Traced:
    """Walk ``arg``'s absorbable chain back to its source and apply it to a fresh ``Operand``.

    Nodes the chain cannot absorb (shared, graph outputs, unmodelled) end it; each such stop is noted in
    ``notes``.
    """
    if not isinstance(arg, torch.fx.Node):
        raise NotFusable("non_tensor_operand")
    chain: list[torch.fx.Node] = []
    cur = arg
    while (nxt := chain_input(cur)) is not None:
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
    else:
        if (op_name := unmodelled_view(cur)) is not None:
            notes.append(Rejection(cur.name, rule, "unmodelled_view", f"{op_name} not absorbed into {consumer.name}"))
    chain.reverse()
    source = cur
    while chain and cast_dtype(chain[0]) is not None:  # a cast right on the source is the source
        source = chain.pop(0)
    while True:  # absorb from the source forward; an op that cannot be absorbed becomes the source
        op, cast = Operand.from_shape(table, node_shape(source)), None
        for i, n in enumerate(chain):
            try:
                dt = cast_dtype(n)
                if dt is not None and (cast is not None or op.scale != 1.0):
                    # Casting the unscaled value first could overflow where eager did not.
                    raise NotFusable("cast_after_scale" if cast is None else "second_cast")
                if dt is not None:
                    cast = dt
                else:
                    apply_chain_node(table, op, n)
            except NotFusable as e:
                notes.append(Rejection(n.name, rule, e.reason, e.detail))
                source, chain = n, chain[i + 1 :]
                break
        else:
            return Traced(source, op, chain, cast)


def fake_call(op: Any, *args: Any) -> Any:
    """Run ``op`` on the args' ``meta['val']`` (nested ones too) under their fake mode (the fake implementation)."""
    vals = torch.fx.node.map_aggregate(args, lambda a: fake_value(a) if isinstance(a, torch.fx.Node) else a)
    mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    if mode is None:
        return op(*vals)
    with mode:
        return op(*vals)


def add_view(
    graph: torch.fx.Graph, x: torch.fx.Node, shape: list[Size], meta: dict, syms: SymbolicExtents
) -> torch.fx.Node:
    """Insert ``x.view(shape)`` carrying ``meta`` and a fake ``meta['val']`` (symbolic extents via ``syms``)."""
    args = [syms.arg(n) for n in shape]
    node = graph.call_function(aten.view.default, (x, args))
    node.meta.update(meta)
    node.meta["val"] = fake_call(aten.view.default, x, args)
    return node
