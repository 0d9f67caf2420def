"""Tests that kill surviving mutants of `make mutate` (issue 20), area: rules.

Modules: amplite/passes/contraction_rules.py (which contractions the fusion pass accepts, and why not) and
amplite/passes/einsum_equation.py (einsum equations for matched contraction chains).
Each test pins a behaviour users rely on; docs/testing.md explains the loop.
"""

from __future__ import annotations

import pytest
import sympy
import torch

from amplite.passes import einsum_equation as eqn
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
