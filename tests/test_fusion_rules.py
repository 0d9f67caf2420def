"""X"""

from __future__ import annotations

import operator

import pytest
import sympy
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from amplite.passes import contraction_chains as cc
from amplite.passes import contraction_rules as cr
from amplite.passes import einsum_equation as eqn
from amplite.passes.contraction_chains import Rejection
from amplite.passes.einsum_equation import LETTERS, ModeTable, NotFusable, Operand

aten = torch.ops.aten


def operands(*shapes: list[int]) -> tuple[ModeTable, list[Operand]]:
    """A fresh mode table and one plain operand per shape (no data movement)."""
    table = ModeTable()
    return table, [Operand.from_shape(table, s) for s in shapes]


def reason_of(fn, *args, **kwargs) -> tuple[str, str]:
    """The (reason, detail) of the NotFusable that ``fn(*args)`` raises."""
    with pytest.raises(NotFusable) as e:
        fn(*args, **kwargs)
    return e.value.reason, e.value.detail


# --- einsum_groups: called directly (EinsumRule.check rejects other operand counts before the pass gets here) --


def test_einsum_groups_rejects_other_than_two_operands_with_the_count() -> None:
    """einsum_groups itself says 'einsum_operands' and how many operands the equation names."""
    table, (a, b) = operands([2, 3], [3, 4])
    assert reason_of(eqn.einsum_groups, table, "ij,jk,kl->il", a, b) == ("einsum_operands", "3")
    assert reason_of(eqn.einsum_groups, table, "ij->ij", a, b) == ("einsum_operands", "1")
    assert reason_of(eqn.einsum_groups, table, "ij , jk , kl", a, b) == ("einsum_operands", "3")


def test_einsum_groups_rejects_ellipsis_before_anything_else() -> None:
    """An ellipsis is 'einsum_ellipsis' (no detail), even with three operands or spaces."""
    table, (a, b) = operands([2, 3], [3, 4])
    assert reason_of(eqn.einsum_groups, table, "...j,jk->...k", a, b) == ("einsum_ellipsis", "")
    assert reason_of(eqn.einsum_groups, table, "...j,jk,kl", a, b) == ("einsum_ellipsis", "")


def test_einsum_groups_explicit_output_with_spaces_and_transposed_output() -> None:
    """'ij, jk -> ki' gives the output groups b's k then a's i, unifying a's j with b's j."""
    table, (a, b) = operands([2, 3], [3, 4])
    groups = eqn.einsum_groups(table, " ij , jk -> ki ", a, b)
    assert groups == [b.dims[1], a.dims[0]]
    assert table.find(a.dims[1][0]) == table.find(b.dims[0][0]), "the shared letter j is one mode"
    e = eqn.build_equation(table, a, b, groups)
    assert (e.equation, e.out_shape) == ("ab,bc->ca", [4, 2])


def test_einsum_groups_implicit_output_is_the_single_letters_sorted() -> None:
    """Implicit 'kj,ji' outputs the letters seen once, alphabetically: i (b's dim 1) then k (a's dim 0)."""
    table, (a, b) = operands([2, 3], [3, 5])
    assert eqn.einsum_groups(table, "kj,ji", a, b) == [b.dims[1], a.dims[0]]
    table, (a, b) = operands([2, 3], [3, 5])
    assert eqn.einsum_groups(table, "kj, ji", a, b) == [b.dims[1], a.dims[0]], "spaces are ignored"
    table, (a, b) = operands([2, 3], [2, 3])
    assert eqn.einsum_groups(table, "ij,ij", a, b) == [], "every letter twice: a full contraction"


def test_einsum_groups_an_empty_explicit_output_is_a_full_contraction() -> None:
    """'ij,ij->' is explicit: the output is empty even though no letter appears once."""
    table, (a, b) = operands([2, 3], [2, 3])
    assert eqn.einsum_groups(table, "ij,ij->", a, b) == []
    table, (a, b) = operands([2, 3], [3, 4])
    assert eqn.einsum_groups(table, "ij,jk->", a, b) == [], "explicit empty output, not implicit 'ik'"


def test_einsum_groups_rejects_repeated_letters_and_wrong_rank_naming_the_subscript() -> None:
    """A diagonal ('ii') or a subscript longer/shorter than the operand is 'einsum_diagonal_or_rank'."""
    table, (a, b) = operands([3, 3], [3, 4])
    assert reason_of(eqn.einsum_groups, table, "ii,ij->j", a, b) == ("einsum_diagonal_or_rank", "ii")
    table, (a, b) = operands([2, 3], [3, 4])
    assert reason_of(eqn.einsum_groups, table, "ij,jkl->ikl", a, b) == ("einsum_diagonal_or_rank", "jkl")
    assert reason_of(eqn.einsum_groups, table, "ij,j->i", a, b) == ("einsum_diagonal_or_rank", "j")


# --- build_equation ---------------------------------------------------------------------------------------


def test_build_equation_letters_in_order_of_appearance_with_views() -> None:
    """Letters go a's modes, then b's new ones, then the output's; views and out_shape follow the modes."""
    table, (a, b) = operands([2, 3], [3, 4])
    e = eqn.build_equation(table, a, b, eqn.matmul_groups(table, a, b))
    assert (e.equation, e.a_view, e.b_view, e.out_shape) == ("ab,bc->ac", [2, 3], [3, 4], [2, 4])
    assert (e.c_view, e.factor) == (None, 1.0)
    assert isinstance(e.factor, float)


def test_build_equation_rejects_a_repeated_output_mode() -> None:
    """The same output group twice would be a diagonal write: 'repeated_output_mode'."""
    table, (a, b) = operands([2, 3], [3, 2])
    eqn.unify(table, a.dims[1], b.dims[0])
    assert reason_of(eqn.build_equation, table, a, b, [a.dims[0], a.dims[0]]) == ("repeated_output_mode", "")


def test_build_equation_rejects_an_output_mode_in_neither_input() -> None:
    """An output mode only an expand created (in both inputs) is 'broadcast_only_mode'."""
    table, (a, b) = operands([1, 3], [3, 4])
    a.expand_to(table, [5, 3])  # the 5 is a virtual mode, not in a's source
    assert reason_of(eqn.build_equation, table, a, b, eqn.matmul_groups(table, a, b)) == ("broadcast_only_mode", "")


def test_build_equation_a_contracted_mode_both_inputs_broadcast_becomes_the_factor() -> None:
    """(2,1)->(2,3) @ (1,4)->(3,4): k=3 is broadcast in both, so the sum is 3x each product: factor 3."""
    table, (a, b) = operands([2, 1], [1, 4])
    a.expand_to(table, [2, 3])
    b.expand_to(table, [3, 4])
    e = eqn.build_equation(table, a, b, eqn.matmul_groups(table, a, b))
    assert e.factor == 3.0 and isinstance(e.factor, float)
    assert (e.equation, e.a_view, e.b_view, e.out_shape) == ("ab,cd->ad", [2, 1], [1, 4], [2, 4])
    x, y = torch.randn(2, 1), torch.randn(1, 4)
    ref = x.expand(2, 3) @ y.expand(3, 4)
    assert torch.allclose(torch.einsum(e.equation, x, y) * e.factor, ref), "the factor restores the sum"


def test_build_equation_rejects_a_symbolic_summed_broadcast_extent() -> None:
    """A summed broadcast mode of symbolic extent s cannot be a constant factor: 'symbolic_shape' names it."""
    s = sympy.Symbol("s0", positive=True, integer=True)
    table, (a, b) = operands([2, 1], [1, 4])
    a.expand_to(table, [2, s])
    b.expand_to(table, [s, 4])
    groups = eqn.matmul_groups(table, a, b)
    assert reason_of(eqn.build_equation, table, a, b, groups) == (
        "symbolic_shape",
        "a summed broadcast mode of extent s0",
    )


def test_build_equation_uses_all_52_letters_and_rejects_a_53rd_mode() -> None:
    """Exactly len(LETTERS) = 52 distinct modes still get an equation; one more is 'too_many_modes'."""
    assert len(LETTERS) == 52
    table, (a, b) = operands([1] * 26, [1] * 26)
    e = eqn.build_equation(table, a, b, [])
    assert e.equation == f"{LETTERS[:26]},{LETTERS[26:]}->"
    table, (a, b) = operands([1] * 26, [1] * 27)
    assert reason_of(eqn.build_equation, table, a, b, []) == ("too_many_modes", "")


def test_build_equation_bias_view_per_output_mode() -> None:
    """A bias broadcast against the output gets a view with one dim per output mode: full or 1."""
    table, (a, b) = operands([2, 3], [3, 4])
    groups = eqn.matmul_groups(table, a, b)
    assert eqn.build_equation(table, a, b, groups, c_shape=[4]).c_view == [4]
    assert eqn.build_equation(table, a, b, groups, c_shape=[2, 1]).c_view == [2, 1]
    assert eqn.build_equation(table, a, b, groups, c_shape=[1, 4]).c_view == [1, 4]
    assert eqn.build_equation(table, a, b, groups, c_shape=[]).c_view == []
    assert eqn.build_equation(table, a, b, groups, c_shape=[1]).c_view == [1]


def test_build_equation_bias_view_follows_split_output_modes() -> None:
    """An output dim made of two modes (6 = 2x3 from a view) gets two bias dims: [2, 3] or [1, 1]."""
    table, (a, b) = operands([2, 3, 5], [5, 4])
    a.view(table, [6, 5])
    groups = eqn.matmul_groups(table, a, b)
    assert eqn.build_equation(table, a, b, groups, c_shape=[6, 4]).c_view == [2, 3, 4]
    assert eqn.build_equation(table, a, b, groups, c_shape=[6, 1]).c_view == [2, 3, 1]
    assert eqn.build_equation(table, a, b, groups, c_shape=[1, 4]).c_view == [1, 1, 4]


def test_build_equation_rejects_a_bias_that_does_not_broadcast() -> None:
    """A bias of more dims than the output, or a dim that is neither the output's nor 1, is rejected."""
    table, (a, b) = operands([2, 3], [3, 4])
    groups = eqn.matmul_groups(table, a, b)
    assert reason_of(eqn.build_equation, table, a, b, groups, c_shape=[1, 2, 4]) == ("bias_broadcasts_output", "")
    assert reason_of(eqn.build_equation, table, a, b, groups, c_shape=[3]) == ("bias_shape", "[3]")
    assert reason_of(eqn.build_equation, table, a, b, groups, c_shape=[2, 2]) == ("bias_shape", "[2, 2]")


# --- contraction_rules: hand-built FX graphs whose meta['val'] are real tensors ----------------------------


#: An unbacked SymInt (made once: the ShapeEnv's first use is slow).
SYMINT = ShapeEnv().create_unbacked_symint()


class G:
    """A tiny FX graph builder: each node's meta['val'] is the op run on its inputs' values."""

    def __init__(self) -> None:
        self.g = torch.fx.Graph()

    def inp(self, name: str, *shape: int, dtype: torch.dtype = torch.float32) -> torch.fx.Node:
        n = self.g.placeholder(name)
        n.meta["val"] = torch.randn(*shape).to(dtype)
        return n

    def op(self, target, *args, **kwargs) -> torch.fx.Node:
        n = self.g.call_function(target, args, kwargs)
        val = lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a  # noqa: E731
        n.meta["val"] = target(*torch.fx.node.map_aggregate(args, val), **torch.fx.node.map_aggregate(kwargs, val))
        return n

    def out(self, *nodes: torch.fx.Node) -> None:
        self.g.output(nodes[0] if len(nodes) == 1 else tuple(nodes))


def test_rule_names_targets_and_order() -> None:
    """The rules the pass tries, in order, with the names reported in rejections and the ops they match."""
    assert [r.name for r in cr.RULES] == ["matmul", "linear", "addmm", "einsum"]
    assert [r.targets for r in cr.RULES] == [
        (aten.mm.default, aten.bmm.default, aten.matmul.default),
        (aten.linear.default,),
        (aten.addmm.default, aten.baddbmm.default),
        (aten.einsum.default,),
    ]
    assert (cr.ContractionRule.name, cr.ContractionRule.targets) == ("", ())


def test_matmul_rule_reads_both_operands_and_matmul_groups() -> None:
    """mm(a, b): operands a, b, no bias, alpha = beta = 1; output groups [a's rows, b's columns]."""
    g = G()
    a, b = g.inp("a", 2, 3), g.inp("b", 3, 4)
    mm = g.op(aten.mm.default, a, b)
    rule = cr.MatmulRule()
    assert rule.check(mm) is None
    assert rule.inputs(mm) == cr.Inputs(a, b, None, 1.0, 1.0)
    table, (oa, ob) = operands([2, 3], [3, 4])
    assert rule.groups(table, oa, ob, mm) == [oa.dims[0], ob.dims[1]]


def test_linear_rule_bias_positional_keyword_or_none() -> None:
    """linear(x, w[, bias]): the bias comes from args[2] or kwargs['bias']; groups are x's rows, w's rows."""
    g = G()
    x, w, bias = g.inp("x", 2, 3), g.inp("w", 4, 3), g.inp("bias", 4)
    rule = cr.LinearRule()
    assert rule.inputs(g.op(aten.linear.default, x, w, bias)) == cr.Inputs(x, w, bias)
    assert rule.inputs(g.op(aten.linear.default, x, w, bias=bias)) == cr.Inputs(x, w, bias)
    plain = g.op(aten.linear.default, x, w)
    assert rule.inputs(plain) == cr.Inputs(x, w, None)
    table, (ox, ow) = operands([2, 3], [4, 3])
    assert rule.groups(table, ox, ow, plain) == [ox.dims[0], ow.dims[0]]
    assert table.find(ox.dims[1][0]) == table.find(ow.dims[1][0]), "x's last dim contracts with w's second"


def test_addmm_rule_scalars_and_operand_order() -> None:
    """addmm(c, a, b, beta=, alpha=): a, b are args 1, 2, the bias args 0; non-number scalars are rejected."""
    g = G()
    c, a, b = g.inp("c", 4), g.inp("a", 2, 3), g.inp("b", 3, 4)
    rule = cr.AddmmRule()
    plain = g.op(aten.addmm.default, c, a, b)
    assert rule.check(plain) is None
    assert rule.inputs(plain) == cr.Inputs(a, b, c, 1, 1)
    scaled = g.op(aten.addmm.default, c, a, b, beta=0.5, alpha=2)
    assert rule.check(scaled) is None
    assert rule.inputs(scaled) == cr.Inputs(a, b, c, 2, 0.5)
    for kwargs in ({"alpha": True}, {"beta": True}, {"alpha": 2, "beta": False}, {"beta": 0.5, "alpha": False}):
        node = g.g.call_function(aten.addmm.default, (c, a, b), kwargs)
        assert rule.check(node) == "non_constant_scalar", kwargs
    table, (oa, ob) = operands([2, 3], [3, 4])
    assert rule.groups(table, oa, ob, plain) == [oa.dims[0], ob.dims[1]]


def test_einsum_rule_two_operands_only_and_its_equation() -> None:
    """einsum(eq, [a, b]) is read from args[1]; three operands are 'einsum_operands'; groups follow eq."""
    g = G()
    a, b, c = g.inp("a", 2, 3), g.inp("b", 3, 4), g.inp("c", 4, 5)
    rule = cr.EinsumRule()
    two = g.op(aten.einsum.default, "ij,jk->ki", [a, b])
    assert rule.check(two) is None
    assert rule.inputs(two) == cr.Inputs(a, b)
    assert rule.check(g.op(aten.einsum.default, "ij,jk,kl->il", [a, b, c])) == "einsum_operands"
    assert rule.check(g.op(aten.einsum.default, "ij->ji", [a])) == "einsum_operands"
    table, (oa, ob) = operands([2, 3], [3, 4])
    assert rule.groups(table, oa, ob, two) == [ob.dims[1], oa.dims[0]]


def test_is_number_accepts_ints_and_floats_not_bools() -> None:
    """Scalars the pass can fold: Python int or float; a bool, a string or a tensor is not one."""
    assert cc.is_number(2) and cc.is_number(0.5) and cc.is_number(0)
    assert not cc.is_number(True) and not cc.is_number(False)
    assert not cc.is_number("2") and not cc.is_number(torch.tensor(2.0)) and not cc.is_number(None)


def test_size_of_and_node_shape() -> None:
    """Extents are ints, or the sympy expression of a SymInt; a node without a tensor value is 'no_meta'."""
    s = SYMINT
    assert cc.size_of(s) == s.node.expr and isinstance(cc.size_of(s), sympy.Expr)
    assert cc.size_of(torch.tensor(3)) == 3 and type(cc.size_of(torch.tensor(3))) is int
    g = G()
    x = g.inp("x", 2, 3)
    assert cc.node_shape(x) == [2, 3]
    bare = g.g.placeholder("bare")
    assert reason_of(cc.node_shape, bare) == ("no_meta", "bare")
    bare.meta["val"] = 3
    assert reason_of(cc.node_shape, bare) == ("no_meta", "bare")
    assert reason_of(cc.node_shape, 7) == ("no_meta", "7")


def test_copies_says_which_movement_materialises_a_copy() -> None:
    """clone always copies; contiguous/reshape copy only a non-contiguous input; other movement never."""
    g = G()
    x = g.inp("x", 2, 3)
    xt = g.op(aten.t.default, x)
    assert cc.copies(g.op(aten.clone.default, x))
    assert cc.copies(g.op(aten.contiguous.default, xt))
    assert not cc.copies(g.op(aten.contiguous.default, x))
    assert cc.copies(g.op(aten.reshape.default, xt, [6]))
    assert not cc.copies(g.op(aten.reshape.default, x, [6]))
    assert not cc.copies(g.op(aten.reshape.default, xt, [3, 2])), "same shape: a view"
    assert not cc.copies(xt)
    assert not cc.copies(g.op(aten.view.default, x, [6]))
    bare = g.g.placeholder("bare")
    assert cc.copies(g.g.call_function(aten.clone.default, (bare,))), "clone copies even without a value"
    assert not cc.copies(g.g.call_function(aten.contiguous.default, (bare,)))
    no_out = g.g.call_function(aten.reshape.default, (xt, [6]))
    assert not cc.copies(no_out), "no output value: cannot tell, assume no copy"


def test_unmodelled_view_names_the_op() -> None:
    """A view-like op the chains cannot absorb is named (also through getitem, or a movement with kwargs)."""
    g = G()
    x = g.inp("x", 4, 3)
    assert cc.unmodelled_view(x) is None and cc.unmodelled_view(3) is None
    assert cc.unmodelled_view(g.op(aten.slice.Tensor, x, 0, 0, 2)) == "slice.Tensor"
    parts = g.op(aten.unbind.int, x)
    assert cc.unmodelled_view(g.op(operator.getitem, parts, 0)) == "unbind.int"
    assert cc.unmodelled_view(g.op(aten.permute.default, x, [1, 0])) is None, "absorbable"
    odd = g.g.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format, "x": 1})
    assert cc.unmodelled_view(odd) == "clone.default"
    assert cc.unmodelled_view(g.op(aten.relu.default, x)) is None
    tup = g.g.call_function(operator.getitem, ((x, x), 0))
    assert cc.unmodelled_view(tup) is None, "getitem of a plain tuple is not a view"


def test_scale_of_reads_constant_scalings() -> None:
    """x*c, c*x -> c; x/c -> 1/c; x/0, c/x, x*y, kwargs, bools and other ops are not scalings."""
    g = G()
    x, y = g.inp("x", 2), g.inp("y", 2)
    assert cc.scale_of(g.op(aten.mul.Tensor, x, 3), x) == 3.0
    assert cc.scale_of(g.op(aten.mul.Scalar, x, 0.5), x) == 0.5
    assert cc.scale_of(g.op(aten.mul.Tensor, 4, x), x) == 4.0
    assert cc.scale_of(g.op(aten.div.Tensor, x, 4), x) == 0.25
    assert cc.scale_of(g.op(aten.div.Scalar, x, 2), x) == 0.5
    assert cc.scale_of(g.g.call_function(aten.div.Tensor, (x, 0)), x) is None
    assert cc.scale_of(g.op(aten.div.Tensor, 2, x), x) is None
    assert cc.scale_of(g.op(aten.mul.Tensor, x, y), x) is None
    assert cc.scale_of(g.op(aten.mul.Tensor, x, 2), y) is None
    assert cc.scale_of(g.op(aten.mul.Tensor, 2, x), y) is None
    assert cc.scale_of(g.op(aten.mul.Tensor, x, True), x) is None
    assert cc.scale_of(g.op(aten.add.Tensor, x, 2), x) is None
    assert cc.scale_of(g.g.call_function(aten.div.Tensor, (x, 2), {"rounding_mode": "floor"}), x) is None
    assert cc.scale_of(x, x) is None


def test_chain_input_of_each_kind_of_chain_node() -> None:
    """Movement (only memory_format kwargs), constant scalings (either side) and pure casts read args[0]."""
    g = G()
    x = g.inp("x", 2, 3)
    assert cc.chain_input(x) is None
    assert cc.chain_input(g.op(aten.permute.default, x, [1, 0])) is x
    assert cc.chain_input(g.op(aten.clone.default, x, memory_format=torch.contiguous_format)) is x
    assert cc.chain_input(g.g.call_function(aten.view.default, (x, [6]), {"other": 1})) is None
    assert cc.chain_input(g.op(aten.mul.Tensor, x, 2)) is x
    assert cc.chain_input(g.op(aten.mul.Tensor, 2, x)) is x
    assert cc.chain_input(g.op(aten.mul.Tensor, x, x)) is None
    assert cc.chain_input(g.op(aten.to.dtype, x, torch.float16)) is x
    assert cc.chain_input(g.op(aten.relu.default, x)) is None


def test_apply_chain_node_models_each_op() -> None:
    """Each absorbable op changes the operand's dims (or scale) as eager changes the shape."""
    g = G()
    x = g.inp("x", 2, 3, 1)
    table = ModeTable()
    base = Operand.from_shape(table, [2, 3, 1])
    m2, m3, m1 = base.dims
    cases = [
        (g.op(aten.permute.default, x, [2, 0, 1]), [m1, m2, m3]),
        (g.op(aten.transpose.int, x, 1, 2), [m2, m1, m3]),
        (g.op(aten.squeeze.dim, x, 2), [m2, m3]),
        (g.op(aten.squeeze.dims, x, [2]), [m2, m3]),
        (g.op(aten.squeeze.default, x), [m2, m3]),
        (g.op(aten.unsqueeze.default, x, 0), [[], m2, m3, m1]),
        (g.op(aten.contiguous.default, x), [m2, m3, m1]),
    ]
    for node, dims in cases:
        o = Operand(source=base.source, dims=list(base.dims))
        cc.apply_chain_node(table, o, node)
        assert o.dims == dims, node.target
    o = Operand(source=base.source, dims=list(base.dims))
    cc.apply_chain_node(table, o, g.op(aten.view.default, x, [6]))
    assert o.shape(table) == [6]
    o = Operand(source=base.source, dims=list(base.dims))
    cc.apply_chain_node(table, o, g.op(aten.expand.default, x, [2, 3, 5]))
    assert o.shape(table) == [2, 3, 5] and o.dims[:2] == [m2, m3]
    o = Operand(source=base.source, dims=list(base.dims))
    cc.apply_chain_node(table, o, g.op(aten.mul.Tensor, x, 3))
    cc.apply_chain_node(table, o, g.op(aten.div.Tensor, x, 2))
    assert o.scale == 1.5 and o.dims == [m2, m3, m1]


def test_apply_chain_node_t_and_reshape_variants() -> None:
    """t() swaps a 2-D operand and leaves a 1-D one; reshape and _unsafe_view regroup like view."""
    g = G()
    x, v = g.inp("x", 2, 3), g.inp("v", 4)
    table = ModeTable()
    o = Operand.from_shape(table, [2, 3])
    cc.apply_chain_node(table, o, g.op(aten.t.default, x))
    assert o.shape(table) == [3, 2]
    o1 = Operand.from_shape(table, [4])
    cc.apply_chain_node(table, o1, g.op(aten.t.default, v))
    assert o1.shape(table) == [4]
    for target in (aten.reshape.default, aten._unsafe_view.default):
        o = Operand.from_shape(table, [2, 3])
        cc.apply_chain_node(table, o, g.op(target, x, [6]))
        assert o.shape(table) == [6], target


def test_apply_chain_node_rejects_a_shape_it_did_not_model() -> None:
    """If the modelled shape differs from the node's recorded shape: 'shape_mismatch' naming the node."""
    g = G()
    x = g.inp("x", 2, 3)
    node = g.op(aten.relu.default, x)
    node.meta["val"] = torch.zeros(3, 2)
    table = ModeTable()
    o = Operand.from_shape(table, [2, 3])
    assert reason_of(cc.apply_chain_node, table, o, node) == ("shape_mismatch", node.name)
    cc.apply_chain_node(table, o, g.op(aten.relu.default, x))  # the same shape: no error


def test_trace_operand_absorbs_a_chain_to_its_source() -> None:
    """x -> t -> mul 2 -> mm: the chain is [t, mul] from the source x, scale 2, no cast, no notes."""
    g = G()
    x, w = g.inp("x", 3, 2), g.inp("w", 3, 4)
    xt = g.op(aten.t.default, x)
    xs = g.op(aten.mul.Tensor, xt, 2.0)
    mm = g.op(aten.mm.default, xs, w)
    g.out(mm)
    notes: list[Rejection] = []
    tr = cc.trace_operand(ModeTable(), xs, mm, "matmul", False, notes)
    assert (tr.source, tr.chain, tr.cast, tr.operand.scale, notes) == (x, [xt, xs], None, 2.0, [])
    assert reason_of(cc.trace_operand, ModeTable(), 2.0, mm, "matmul", False, notes) == ("non_tensor_operand", "")


def test_trace_operand_stops_at_shared_and_output_intermediates_with_notes() -> None:
    """A chain node another op also reads, or a graph output, ends the chain and is noted with its reason."""
    g = G()
    x, w = g.inp("x", 3, 2), g.inp("w", 3, 4)
    xt = g.op(aten.t.default, x)
    xs = g.op(aten.mul.Tensor, xt, 2.0)
    mm = g.op(aten.mm.default, xs, w)
    other = g.op(aten.relu.default, xt)
    g.out(mm, other)
    notes: list[Rejection] = []
    tr = cc.trace_operand(ModeTable(), xs, mm, "matmul", False, notes)
    assert (tr.source, tr.chain) == (xt, [xs])
    assert notes == [Rejection(xt.name, "matmul", "shared_intermediate", f"not absorbed into {mm.name}")]

    g = G()
    x, w = g.inp("x", 3, 2), g.inp("w", 3, 4)
    xt = g.op(aten.t.default, x)
    mm = g.op(aten.mm.default, xt, w)
    g.out(mm, xt)
    notes = []
    tr = cc.trace_operand(ModeTable(), xt, mm, "linear", False, notes)
    assert (tr.source, tr.chain) == (xt, [])
    assert notes == [Rejection(xt.name, "linear", "intermediate_is_graph_output", f"not absorbed into {mm.name}")]


def test_trace_operand_keep_expand_stops_at_an_expand() -> None:
    """With keep_expand (the pass's second try) an expand is kept as the source: 'broadcast_only_mode'."""
    g = G()
    x, w = g.inp("x", 1, 3), g.inp("w", 3, 4)
    xe = g.op(aten.expand.default, x, [5, 3])
    mm = g.op(aten.mm.default, xe, w)
    g.out(mm)
    notes: list[Rejection] = []
    tr = cc.trace_operand(ModeTable(), xe, mm, "matmul", True, notes)
    assert (tr.source, tr.chain) == (xe, [])
    assert notes == [Rejection(xe.name, "matmul", "broadcast_only_mode", f"not absorbed into {mm.name}")]
    notes = []
    tr = cc.trace_operand(ModeTable(), xe, mm, "matmul", False, notes)
    assert (tr.source, tr.chain, notes) == (x, [xe], [])


def test_trace_operand_metadata_asserts_do_not_share_a_movement_but_do_share_a_cast() -> None:
    """An _assert_tensor_metadata user of a movement node is not a second user; of a cast it is."""
    g = G()
    x, w = g.inp("x", 3, 2), g.inp("w", 3, 4)
    xt = g.op(aten.t.default, x)
    g.g.call_function(aten._assert_tensor_metadata.default, (xt,), {"dtype": torch.float32})
    mm = g.op(aten.mm.default, xt, w)
    g.out(mm)
    notes: list[Rejection] = []
    tr = cc.trace_operand(ModeTable(), xt, mm, "matmul", False, notes)
    assert (tr.source, tr.chain, notes) == (x, [xt], [])

    g = G()
    x, w = g.inp("x", 2, 3), g.inp("w", 3, 4, dtype=torch.float16)
    xh = g.op(aten.to.dtype, x, torch.float16)
    g.g.call_function(aten._assert_tensor_metadata.default, (xh,), {"dtype": torch.float16})
    xv = g.op(aten.view.default, xh, [2, 3])
    mm = g.op(aten.mm.default, xv, w)
    g.out(mm)
    notes = []
    tr = cc.trace_operand(ModeTable(), xv, mm, "matmul", False, notes)
    assert (tr.source, tr.chain, tr.cast, notes) == (xh, [xv], None, []), "a shared cast is not noted"


def test_trace_operand_a_cast_on_the_source_is_the_source_and_a_later_cast_is_pending() -> None:
    """x.half() right on the source becomes the source; a cast after movement is the pending cast."""
    g = G()
    x, w = g.inp("x", 3, 2), g.inp("w", 3, 4, dtype=torch.float16)
    xh = g.op(aten.to.dtype, x, torch.float16)
    xt = g.op(aten.t.default, xh)
    mm = g.op(aten.mm.default, xt, w)
    g.out(mm)
    tr = cc.trace_operand(ModeTable(), xt, mm, "matmul", False, [])
    assert (tr.source, tr.chain, tr.cast) == (xh, [xt], None)

    g = G()
    x, w = g.inp("x", 3, 2), g.inp("w", 3, 4, dtype=torch.float16)
    xt = g.op(aten.t.default, x)
    xh = g.op(aten.to.dtype, xt, torch.float16)
    mm = g.op(aten.mm.default, xh, w)
    g.out(mm)
    tr = cc.trace_operand(ModeTable(), xh, mm, "matmul", False, [])
    assert (tr.source, tr.chain, tr.cast) == (x, [xt, xh], torch.float16)


def test_trace_operand_a_cast_after_a_scale_or_a_second_cast_becomes_the_source() -> None:
    """x*2 then .half() would cast the unscaled value: 'cast_after_scale'; two casts: 'second_cast'."""
    g = G()
    x, w = g.inp("x", 3, 2), g.inp("w", 2, 4, dtype=torch.float16)
    xt = g.op(aten.t.default, x)
    xs = g.op(aten.mul.Tensor, xt, 2.0)
    xh = g.op(aten.to.dtype, xs, torch.float16)
    xv = g.op(aten.view.default, xh, [2, 3])
    mm = g.op(aten.mm.default, g.op(aten.t.default, xv), w)
    notes: list[Rejection] = []
    tr = cc.trace_operand(ModeTable(), xv, mm, "matmul", False, notes)
    assert (tr.source, tr.chain, tr.cast, tr.operand.scale) == (xh, [xv], None, 1.0)
    assert notes == [Rejection(xh.name, "matmul", "cast_after_scale", "")]

    g = G()
    x, w = g.inp("x", 3, 2), g.inp("w", 3, 4, dtype=torch.float16)
    xt = g.op(aten.t.default, x)
    xb = g.op(aten.to.dtype, xt, torch.bfloat16)
    xh = g.op(aten.to.dtype, xb, torch.float16)
    mm = g.op(aten.mm.default, xh, w)
    notes = []
    tr = cc.trace_operand(ModeTable(), xh, mm, "matmul", False, notes)
    assert (tr.source, tr.chain, tr.cast) == (xh, [], None)
    assert notes == [Rejection(xh.name, "matmul", "second_cast", "")]


def test_trace_operand_notes_an_unmodelled_view_source_and_a_failed_op() -> None:
    """A slice source is noted as 'unmodelled_view'; an op whose model fails becomes the source, noted."""
    g = G()
    x, w = g.inp("x", 4, 3), g.inp("w", 3, 4)
    xs = g.op(aten.slice.Tensor, x, 0, 0, 2)
    xt = g.op(aten.clone.default, xs)
    mm = g.op(aten.mm.default, xt, w)
    notes: list[Rejection] = []
    tr = cc.trace_operand(ModeTable(), xt, mm, "matmul", False, notes)
    assert (tr.source, tr.chain) == (xs, [xt])
    assert notes == [Rejection(xs.name, "matmul", "unmodelled_view", f"slice.Tensor not absorbed into {mm.name}")]

    g = G()
    x, w = g.inp("x", 2, 3), g.inp("w", 3, 4)
    xv = g.op(aten.view.default, x, [3, 2])  # 2x3 -> 3x2: not a regrouping
    xt = g.op(aten.t.default, xv)
    mm = g.op(aten.mm.default, xt, w)
    notes = []
    tr = cc.trace_operand(ModeTable(), xt, mm, "matmul", False, notes)
    assert (tr.source, tr.chain) == (xv, [xt])
    assert notes == [Rejection(xv.name, "matmul", "irregular_reshape", "[2, 3] -> [3, 2]")], "the detail says why"


def test_fake_call_and_add_view() -> None:
    """add_view inserts x.view(shape) with the given meta and a value of that shape; fake_call runs an op."""
    from amplite.passes.graph_utils import SymbolicExtents

    g = G()
    x = g.inp("x", 2, 3)
    assert cc.fake_call(aten.view.default, x, [3, 2]).shape == (3, 2)
    assert cc.fake_call(aten.cat.default, [x, x]).shape == (4, 3), "nested node args are read too"
    v = cc.add_view(g.g, x, [6], {"tag": 1}, SymbolicExtents(g.g))
    assert (v.target, v.args, v.meta["tag"], tuple(v.meta["val"].shape)) == (aten.view.default, (x, [6]), 1, (6,))


# --- matmul_groups / linear_groups / unify, called directly --------------------------------------------------


def test_matmul_groups_broadcasts_batch_dims_like_torch_matmul() -> None:
    """Batch dims broadcast from the right: a missing or size-1 dim takes the other side's group."""
    table, (a, b) = operands([1, 2, 3], [4, 3, 5])
    assert eqn.matmul_groups(table, a, b) == [b.dims[0], a.dims[1], b.dims[2]]
    table, (a, b) = operands([4, 2, 3], [1, 3, 5])
    assert eqn.matmul_groups(table, a, b) == [a.dims[0], a.dims[1], b.dims[2]]
    table, (a, b) = operands([2, 3], [6, 4, 3, 5])
    assert eqn.matmul_groups(table, a, b) == [b.dims[0], b.dims[1], a.dims[0], b.dims[3]]
    table, (a, b) = operands([6, 4, 2, 3], [3, 5])
    assert eqn.matmul_groups(table, a, b) == [a.dims[0], a.dims[1], a.dims[2], b.dims[1]]
    table, (a, b) = operands([4, 2, 3], [4, 3, 5])
    assert eqn.matmul_groups(table, a, b) == [a.dims[0], a.dims[1], b.dims[2]]
    assert table.find(a.dims[0][0]) == table.find(b.dims[0][0]), "equal batch dims are one mode"
    table, (a, b) = operands([1, 2, 3], [1, 3, 5])
    out = eqn.matmul_groups(table, a, b)
    assert table.extent(out[0]) == 1 and len(out) == 3


def test_matmul_groups_rejects_vectors_and_mismatched_batches() -> None:
    """A rank-1 operand is 'vector_operand'; batch dims 2 vs 3 are 'bad_broadcast' naming both."""
    table, (v, m) = operands([3], [3, 4])
    assert reason_of(eqn.matmul_groups, table, v, m) == ("vector_operand", "")
    table, (m, v) = operands([4, 3], [3])
    assert reason_of(eqn.matmul_groups, table, m, v) == ("vector_operand", "")
    table, (a, b) = operands([3, 2, 3], [2, 3, 5])
    assert reason_of(eqn.matmul_groups, table, a, b) == ("bad_broadcast", "3 vs 2")
    table, (a, b) = operands([2, 3], [3, 4])
    assert eqn.matmul_groups(table, a, b) == [a.dims[0], b.dims[1]], "rank 2 each: no batch"


def test_linear_groups_accepts_a_vector_input_and_needs_a_2d_weight() -> None:
    """linear(x[3], w[4,3]) is [4]; x[2,5,3] keeps its leading dims; a 1-D or 3-D weight is rejected."""
    table, (x, w) = operands([3], [4, 3])
    assert eqn.linear_groups(table, x, w) == [w.dims[0]]
    table, (x, w) = operands([2, 5, 3], [4, 3])
    assert eqn.linear_groups(table, x, w) == [x.dims[0], x.dims[1], w.dims[0]]
    table, (x, w) = operands([2, 3], [3])
    assert reason_of(eqn.linear_groups, table, x, w) == ("vector_operand", "")
    table, (x, w) = operands([2, 3], [1, 4, 3])
    assert reason_of(eqn.linear_groups, table, x, w) == ("vector_operand", "")
    table, (x, w) = operands([], [4, 3])
    assert reason_of(eqn.linear_groups, table, x, w) == ("vector_operand", "")


def test_unify_refines_both_sides_to_a_common_factorisation() -> None:
    """[6] vs [2,3]: the 6 is split 2x3 and unified; [2,3] vs [6] the other way; size-1 modes are ignored."""
    t = ModeTable()
    six, two, three = t.new(6), t.new(2), t.new(3)
    eqn.unify(t, [six], [two, three])
    assert [t.size(m) for m in t.expand([six])] == [2, 3]
    assert t.expand([six]) == [t.find(two), t.find(three)]
    t = ModeTable()
    two, three, six = t.new(2), t.new(3), t.new(6)
    eqn.unify(t, [two, three], [six])
    assert t.expand([six]) == [t.find(two), t.find(three)]
    t = ModeTable()
    one, four, four_b, one_b = t.new(1), t.new(4), t.new(4), t.new(1)
    eqn.unify(t, [one, four], [four_b, one_b])
    assert t.find(four) == t.find(four_b) and t.find(one) != t.find(one_b)
    t = ModeTable()
    g6, g4 = t.new(6), t.new(4)
    assert reason_of(eqn.unify, t, [g6], [g4]) == ("incompatible_factorization", "6: 6 vs 4")


class _UndecidableStrides(torch.Tensor):
    """A tensor whose contiguity cannot be decided (as with a symbolic stride): is_contiguous raises."""

    def is_contiguous(self, *args: object, **kwargs: object) -> bool:
        raise RuntimeError("undecidable stride")


def test_copies_assumes_a_copy_when_contiguity_is_undecidable() -> None:
    """contiguous() of a value whose strides cannot be decided may copy in eager: counted as a copy."""
    g = G()
    x = g.inp("x", 2, 3)
    node = g.g.call_function(aten.contiguous.default, (x,))
    node.meta["val"] = torch.zeros(2, 3)
    x.meta["val"] = torch.zeros(2, 3).as_subclass(_UndecidableStrides)
    assert cc.copies(node)


def test_fake_call_runs_under_the_inputs_fake_mode() -> None:
    """An op that makes a new tensor must make a fake one: it runs inside the fake mode of its inputs."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    g = torch.fx.Graph()
    x = g.placeholder("x")
    with FakeTensorMode() as mode:
        x.meta["val"] = torch.empty(2, 3)
    out = cc.fake_call(lambda v: v + torch.ones(3), x)
    assert isinstance(out, FakeTensor) and out.fake_mode is mode and tuple(out.shape) == (2, 3)
    assert isinstance(cc.fake_call(lambda v: v * 2, 3), int), "no tensor input: runs as is"


# --- survivors of the full mutation run: output_chain's stops, match's second try and notes, rewrite's casts ---


def _assert_meta(g: G, x: torch.fx.Node) -> torch.fx.Node:
    """The dtype check export puts before a ``.to()``: a user of ``x`` that reads nothing else."""
    return g.g.call_function(aten._assert_tensor_metadata.default, (x,), {"dtype": x.meta["val"].dtype})


def test_output_chain_a_bias_add_whose_alpha_is_not_a_constant_is_not_absorbed() -> None:
    """add(mm, c, alpha=<a graph value>): 'bias_kwargs' is noted and nothing is absorbed."""
    g = G()
    a, b, c, s = g.inp("a", 2, 3), g.inp("b", 3, 4), g.inp("c", 2, 4), g.g.placeholder("s")
    s.meta["val"] = 2
    mm = g.op(aten.mm.default, a, b)
    add = g.g.call_function(aten.add.Tensor, (mm, c), {"alpha": s})
    add.meta["val"] = mm.meta["val"] + 2 * c.meta["val"]
    g.out(add)
    notes: list[Rejection] = []
    assert cc.output_chain(mm, "matmul", (1.0, 1.0, None), torch.float32, notes) == (None, 1.0, 1.0, [], mm)
    assert notes == [Rejection(add.name, "matmul", "bias_kwargs", f"{add.name}: bias c not absorbed")]


def test_output_chain_an_intrinsic_bias_of_another_dtype_is_bias_dtype_naming_it() -> None:
    """linear's own bias in fp16 on an fp32 contraction cannot be the contract's c: 'bias_dtype', its dtype."""
    g = G()
    x, w, bias = g.inp("x", 2, 3), g.inp("w", 4, 3), g.inp("bias", 4, dtype=torch.float16)
    lin = g.op(aten.linear.default, x, w)
    g.out(lin)
    args = (lin, "linear", (1.0, 1.0, bias), torch.float32, [])
    assert reason_of(cc.output_chain, *args) == ("bias_dtype", "torch.float16")


def test_output_chain_two_users_that_are_neither_scaling_nor_bias_are_no_shared_stop() -> None:
    """A product read by relu and neg ends the chain silently; one of them a scaling is 'shared_intermediate'."""
    g = G()
    a, b = g.inp("a", 2, 3), g.inp("b", 3, 4)
    mm = g.op(aten.mm.default, a, b)
    g.out(g.op(aten.relu.default, mm), g.op(aten.neg.default, mm))
    notes: list[Rejection] = []
    assert cc.output_chain(mm, "matmul", (1.0, 1.0, None), torch.float32, notes)[3:] == ([], mm)
    assert notes == []
    g = G()
    a, b = g.inp("a", 2, 3), g.inp("b", 3, 4)
    mm = g.op(aten.mm.default, a, b)
    g.out(g.op(aten.relu.default, mm), g.op(aten.mul.Tensor, mm, 2.0))
    cc.output_chain(mm, "matmul", (1.0, 1.0, None), torch.float32, notes)
    assert [(n.node, n.reason) for n in notes] == [(mm.name, "shared_intermediate")]


def test_output_chain_notes_why_an_add_after_a_metadata_assert_is_not_absorbed() -> None:
    """mm read by an export metadata assert and one add: the add's own reason (bias dtype, a second bias)."""
    g = G()
    a, b, c = g.inp("a", 2, 3), g.inp("b", 3, 4), g.inp("c", 2, 4, dtype=torch.float16)
    mm = g.op(aten.mm.default, a, b)
    _assert_meta(g, mm)
    add = g.g.call_function(aten.add.Tensor, (mm, c))
    add.meta["val"] = mm.meta["val"] + c.meta["val"].float()
    g.out(add)
    notes: list[Rejection] = []
    cc.output_chain(mm, "matmul", (1.0, 1.0, None), torch.float32, notes)
    detail = f"{add.name}: bias c not absorbed (torch.float16 vs torch.float32)"
    assert notes == [Rejection(add.name, "matmul", "bias_dtype", detail)]

    g = G()
    x, w, bias, c = g.inp("x", 2, 3), g.inp("w", 4, 3), g.inp("bias", 4), g.inp("c", 2, 4)
    lin = g.op(aten.linear.default, x, w, bias)
    _assert_meta(g, lin)
    add = g.op(aten.add.Tensor, lin, c)
    g.out(add)
    notes = []
    got = cc.output_chain(lin, "linear", (1.0, 1.0, bias), torch.float32, notes)
    assert got == (bias, 1.0, 1.0, [], lin)
    assert notes == [Rejection(add.name, "linear", "second_bias", f"{add.name}: bias c not absorbed")]


def _ctx(g: G, *dtypes: torch.dtype) -> cr.FusionContext:
    from amplite.passes.graph_utils import SymbolicExtents

    return cr.FusionContext(dtypes or (torch.float32,), SymbolicExtents(g.g))


def test_match_retries_with_the_second_operands_expand_kept_as_its_source() -> None:
    """a[3,4] @ b[1,4,5].expand(2,4,5): the batch mode exists only through b's expand, so the second try
    keeps that expand as b's source (noted 'broadcast_only_mode') and matches."""
    g = G()
    a, b = g.inp("a", 3, 4), g.inp("b", 1, 4, 5)
    be = g.op(aten.expand.default, b, [2, 4, 5])
    mm = g.op(aten.matmul.default, a, be)
    g.out(mm)
    m = cr.MatmulRule().match(mm, _ctx(g))
    assert isinstance(m, cr.ContractionMatch), m
    assert (m.a.source, m.b.source, m.b.chain) == (a, be, [])
    assert [(n.node, n.reason) for n in m.notes] == [(be.name, "broadcast_only_mode")]


def test_a_failed_match_keeps_the_notes_taken_before_the_failure() -> None:
    """x.t() is a graph output (noted), then the vector operand fails the match: the NoMatch has both."""
    g = G()
    x, v = g.inp("x", 3, 2), g.inp("v", 3)
    xt = g.op(aten.t.default, x)
    mm = g.op(aten.matmul.default, xt, v)
    g.out(mm, xt)
    found = cr.MatmulRule().match(mm, _ctx(g))
    assert isinstance(found, cr.NoMatch)
    assert (found.rejection.node, found.rejection.reason) == (mm.name, "vector_operand")
    assert found.notes == (
        Rejection(xt.name, "matmul", "intermediate_is_graph_output", f"not absorbed into {mm.name}"),
    )


@pytest.fixture(scope="module")
def shape_env_mode():
    """A fake mode whose shape env makes unbacked sizes (one per module: the first use is slow)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    env = ShapeEnv()
    return env, FakeTensorMode(shape_env=env)


@pytest.mark.parametrize("which", ["a", "b"])
def test_match_rejects_a_view_extent_that_is_no_product_of_input_sizes_naming_the_operand(
    shape_env_mode, which: str
) -> None:
    """An operand of extent u0 + 1 (no product of input sizes) cannot be viewed: 'symbolic_view' names it."""
    env, mode = shape_env_mode
    u = env.create_unbacked_symint()
    with mode:
        shapes = {"a": ((u + 1, 3), (3, 4)), "b": ((4, 3), (3, u + 1))}[which]
        va, vb = torch.empty(shapes[0]), torch.empty(shapes[1])
        out = torch.mm(va, vb)
    g = G()
    a, b = g.g.placeholder("a"), g.g.placeholder("b")
    a.meta["val"], b.meta["val"] = va, vb
    mm = g.g.call_function(aten.mm.default, (a, b))
    mm.meta["val"] = out
    g.out(mm)
    found = cr.MatmulRule().match(mm, _ctx(g))
    assert isinstance(found, cr.NoMatch)
    r = found.rejection
    assert (r.node, r.rule, r.reason) == (mm.name, "matmul", "symbolic_view")
    assert r.detail == f"{which} view extent {u.node.expr + 1} is not a product of input sizes"


def test_rewrite_casts_the_second_operands_source_and_erases_each_node_once() -> None:
    """a @ x.t().half(): the contract reads a cast of x (the pending cast), t and the cast are erased, once."""
    g = G()
    a, x = g.inp("a", 2, 3, dtype=torch.float16), g.inp("x", 4, 3)
    xt = g.op(aten.t.default, x)
    xh = g.op(aten.to.dtype, xt, torch.float16)
    mm = g.op(aten.mm.default, a, xh)
    g.out(mm)
    ctx = _ctx(g, torch.float16)
    m = cr.MatmulRule().match(mm, ctx)
    assert isinstance(m, cr.ContractionMatch) and (m.b.source, m.b.cast) == (x, torch.float16)
    fusion, erased = cr.MatmulRule().rewrite(g.g, m, ctx)
    assert sorted(n.name for n in erased) == sorted([mm.name, xt.name, xh.name])
    (contract,) = [n for n in g.g.nodes if n.target is cr.CONTRACT]
    src_b = contract.args[2]
    assert (src_b.args[0], src_b.kwargs.get("dtype")) == (x, torch.float16)
    assert fusion.equation == contract.args[0]
    g.g.lint()
    gm = torch.fx.GraphModule(torch.nn.Module(), g.g)
    av, xv = a.meta["val"], x.meta["val"]
    torch.testing.assert_close(gm(av, xv), (av.float() @ xv.t()).half(), rtol=2e-3, atol=2e-3)
