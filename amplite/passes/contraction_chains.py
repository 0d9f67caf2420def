"""Operand and output chains around a contraction, for the rules in ``contraction_rules``.

The helpers classify and apply the nodes of an operand chain (data movement, constant scalings, casts) to
an ``Operand``'s mode bookkeeping, walk an operand's chain back to its source (``trace_operand``, noting
each ``Rejection``), and build the new graph nodes (views, and the symbolic extents they need) with
``meta['val']``. The mode algebra (``einsum_equation``) signals what it cannot express with
``NotFusable``; the rules turn that into a typed :class:`Rejection` at their boundary.

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

from amplite.passes.einsum_equation import ModeTable, NotFusable, Operand
from amplite.passes.einsum_modes import Size, norm_size
from amplite.passes.graph_utils import SymbolicExtents, cast_dtype, fake_value, value_dtype

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


def output_chain(
    node: torch.fx.Node,
    rule: str,
    scalars: tuple[float, float, torch.fx.Node | None],
    dtype: torch.dtype,
    notes: list[Rejection],
) -> tuple[torch.fx.Node | None, float, float, list[torch.fx.Node], torch.fx.Node]:
    """Absorb constant scalings and one bias add that follow the contraction.

    Args:
        node: The contraction.
        rule: The rule's name, for notes.
        scalars: The contraction's own ``(alpha, beta, bias)``.
        dtype: The contraction's dtype (a bias must have it).
        notes: Where chain stops are recorded.

    Returns:
        ``(bias, alpha, beta, tail, last)``: the bias, the scales, the absorbed nodes, the last one.
    """
    alpha, beta, bias = float(scalars[0]), float(scalars[1]), scalars[2]
    tail: list[torch.fx.Node] = []
    cur = node
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        scale = scale_of(user, cur)
        if scale is not None:
            alpha, beta = alpha * scale, beta * scale
        elif bias is None and user.target in BIAS_ADDS and not _bias_reason(user, cur, dtype):
            bias = user.args[1] if user.args[0] is cur else user.args[0]
            beta = (-1.0 if user.target is aten.sub.Tensor else 1.0) * float(user.kwargs.get("alpha", 1))
        else:
            _note_output_stop(user, cur, bias, dtype, rule, notes)
            break
        tail.append(user)
        cur = user
    real = [u for u in cur.users if u.target is not ASSERT_META]
    if len(cur.users) > 1 and len(real) == 1:  # e.g. a cast whose metadata export asserts first
        _note_output_stop(real[0], cur, bias, dtype, rule, notes)
    if len(real) > 1 and any(scale_of(u, cur) is not None or u.target in BIAS_ADDS for u in real):
        notes.append(Rejection(cur.name, rule, "shared_intermediate", "output scaling/bias not absorbed"))
    if bias is not None and value_dtype(bias) != dtype:
        raise NotFusable("bias_dtype", str(value_dtype(bias)))
    return bias, alpha, beta, tail, cur


def _bias_reason(add: torch.fx.Node, cur: torch.fx.Node, dtype: torch.dtype) -> str:
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
    user: torch.fx.Node, cur: torch.fx.Node, bias: Any, dtype: torch.dtype, rule: str, notes: list[Rejection]
) -> None:
    """Record why the output chain stops at ``user`` when it is a scaling, bias add or cast."""
    if user.op != "call_function":
        return
    if user.target in BIAS_ADDS:
        reason = "second_bias" if bias is not None else _bias_reason(user, cur, dtype)
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
