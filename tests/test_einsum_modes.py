"""X"""

from __future__ import annotations

import pytest
import sympy

from amplite.passes.einsum_modes import ModeTable, NotFusable, Operand, exact_div, norm_size

# --- einsum_modes: extents, the mode table and operand movement -------------------------------------------

_A, _B = sympy.symbols("a b", positive=True, integer=True)


def test_norm_size_and_exact_division() -> None:
    """Extents normalise to ints when numeric; exact_div divides only when the quotient is a positive monomial."""
    assert norm_size(6) == 6 and type(norm_size(sympy.Integer(6))) is int and norm_size(2 * _A) == 2 * _A
    assert exact_div(12, 4) == 3 and exact_div(12, 5) is None and exact_div(3, 0) is None and exact_div(0, 3) == 0
    assert exact_div(6 * _A, 3 * _A) == 2 and type(exact_div(6 * _A, 3 * _A)) is int
    assert exact_div(_A, _A) == 1 and exact_div(-2 * _A, _A) is None, "a non-positive quotient is no extent"
    assert exact_div(_A, 2 * _A) is None and exact_div(_A, _B) is None and exact_div(_A * _B + _A, _A) is None
    assert exact_div(_A * _B * 6, 2 * _B) == 3 * _A and exact_div(-_A * _B, _B) is None and exact_div(_A, 2) is None
    assert exact_div(_A**2, _A) == _A and exact_div(sympy.sqrt(_A) * _A, _A) is None


def test_not_fusable_message_and_fields() -> None:
    """NotFusable's text is 'reason: detail' (or the reason alone); the counter name is the reason."""
    err = NotFusable("bad_view", "detail here")
    assert (str(err), err.reason, err.detail) == ("bad_view: detail here", "bad_view", "detail here")
    bare = NotFusable("zero_size")
    assert (str(bare), bare.reason, bare.detail) == ("zero_size", "zero_size", "")


def test_mode_table_split_union_and_extents() -> None:
    """Splits expand row-major, unions share a representative and extents multiply (1 for an empty group)."""
    t = ModeTable()
    m, n, k = t.new(12), t.new(12), t.new(sympy.Integer(4))
    assert (m, n, k) == (0, 1, 2) and t.size(k) == 4 and type(t.size(k)) is int
    assert t.extent([]) == 1 and t.extent([m, k]) == 48
    head, tail = t.split(m, [3, 4])
    assert t.expand([m, k]) == [head, tail, k] and t.extent([m]) == 12
    t.union(tail, k)
    assert t.find(k) == t.find(tail) == tail and t.expand([m]) == [head, tail]
    t.union(k, tail)  # already one class
    assert t.find(k) == tail
    with pytest.raises(AssertionError):
        t.union(head, k)  # extents differ
    with pytest.raises(AssertionError):
        t.split(n, [5, 2])  # 10 != 12
    with pytest.raises(AssertionError):
        t.split(m, [2, 6])  # already split
    a, b, c = t.new(2), t.new(2), t.new(2)
    t.union(a, b)
    t.union(b, c)
    t.union(t.new(2), a)
    assert len({t.find(x) for x in (a, b, c)}) == 1 and t.find(c) == t.find(a)


def test_operand_shape_source_view_and_zero_size() -> None:
    """An operand's source view lists each atomic mode; zero-size sources are not fusable."""
    t = ModeTable()
    with pytest.raises(NotFusable) as info:
        Operand.from_shape(t, [2, 0, 3])
    assert (info.value.reason, info.value.detail) == ("zero_size", "")
    op = Operand.from_shape(t, [6, 4])
    assert op.scale == 1.0 and op.shape(t) == [6, 4] and op.source_view(t) == [6, 4]
    op.view(t, [2, 3, 4])
    assert op.shape(t) == [2, 3, 4] and op.source_view(t) == [2, 3, 4] and len(op.source_modes(t)) == 3
    op.permute([2, 0, 1])
    assert op.shape(t) == [4, 2, 3] and op.source_view(t) == [2, 3, 4], "the source keeps memory order"


def test_permute_transpose_and_bad_dims() -> None:
    """permute/transpose reorder dimensions (negative dims count from the end); bad ones say why."""
    t = ModeTable()
    op = Operand.from_shape(t, [2, 3, 5])
    op.permute([-1, 0, 1])
    assert op.shape(t) == [5, 2, 3]
    op.transpose(0, -1)
    assert op.shape(t) == [3, 2, 5]
    for order, detail in [([0, 0, 1], "[0, 0, 1]"), ([0, 1], "[0, 1]"), ([-1, 2, 0], "[2, 2, 0]")]:
        with pytest.raises(NotFusable) as info:
            op.permute(order)
        assert (info.value.reason, info.value.detail) == ("bad_permutation", detail)
    for d in (3, -4):
        with pytest.raises(NotFusable) as info:
            op.transpose(d, 0)
        assert (info.value.reason, info.value.detail) == ("bad_dim", f"{d} for rank 3")
    op.transpose(-3, 2)
    assert op.shape(t) == [5, 2, 3]


def test_unsqueeze_squeeze_round_trip() -> None:
    """unsqueeze adds size-1 groups (at the end for -1), squeeze drops the named or all size-1 ones only."""
    t = ModeTable()
    op = Operand.from_shape(t, [2, 1, 3])
    op.unsqueeze(-1)
    assert op.shape(t) == [2, 1, 3, 1]
    op.unsqueeze(0)
    assert op.shape(t) == [1, 2, 1, 3, 1]
    with pytest.raises(NotFusable) as info:
        op.unsqueeze(-7)
    assert (info.value.reason, info.value.detail) == ("bad_dim", "-7 for rank 5")
    op.squeeze(t, [0, 1, -1])  # dim 1 has extent 2: kept
    assert op.shape(t) == [2, 1, 3]
    op.squeeze(t, None)
    assert op.shape(t) == [2, 3]
    with pytest.raises(NotFusable):
        op.squeeze(t, [2])


def test_view_splits_merges_and_rejects_irregular_reshapes() -> None:
    """view regroups row-major modes, splitting a mode at a divisor; other boundaries are irregular."""
    t = ModeTable()
    op = Operand.from_shape(t, [4, 6])
    op.view(t, [2, 12])
    assert op.shape(t) == [2, 12] and op.source_view(t) == [2, 2, 6]
    op.view(t, [24, 1])
    assert op.shape(t) == [24, 1]
    op.view(t, [24])
    assert op.shape(t) == [24]
    with pytest.raises(NotFusable) as info:
        op.view(t, [5, 5])
    assert (info.value.reason, info.value.detail) == ("bad_view", "[5, 5] for 24 elements")
    other = Operand.from_shape(t, [4, 6])
    with pytest.raises(NotFusable) as info:
        other.view(t, [3, 8])  # 3 does not divide the 4-mode
    assert (info.value.reason, info.value.detail) == ("irregular_reshape", "[4, 6] -> [3, 8]")
    sym = Operand.from_shape(t, [_A * 8, 32])
    sym.view(t, [_A, 8, 32])
    assert sym.shape(t) == [_A, 8, 32]
    with pytest.raises(NotFusable) as info:
        Operand.from_shape(t, [_A, 6]).view(t, [2, 3 * _A])
    assert info.value.reason == "irregular_reshape"


def test_expand_broadcasts_size_one_dims_and_adds_leading_ones() -> None:
    """expand: new leading dims (size 1 stays an empty group), -1 or the same size keep, 1 -> n is a new mode."""
    t = ModeTable()
    op = Operand.from_shape(t, [1, 3])
    op.expand_to(t, [4, 1, 2, -1])
    assert op.shape(t) == [4, 1, 2, 3] and op.dims[1] == [] and op.source_view(t) == [1, 3]
    op.expand_to(t, [4, 5, 2, 3])
    assert op.shape(t) == [4, 5, 2, 3]
    for shape, detail in [([2, 3], "[2, 3]"), ([4, 5, 2, 6], "3 -> 6")]:
        with pytest.raises(NotFusable) as info:
            op.expand_to(t, shape)
        assert (info.value.reason, info.value.detail) == ("bad_expand", detail)


# --- einsum modes, graph helpers, annotate_precision bridges, verification batches ---


def test_unsqueeze_and_dims_outside_the_rank_are_not_fusable() -> None:
    from amplite.passes.einsum_modes import ModeTable, NotFusable, Operand

    op = Operand.from_shape(ModeTable(), [2, 3])
    with pytest.raises(NotFusable) as info:
        op.unsqueeze(3)  # valid: -3 <= d < 3
    assert (info.value.reason, info.value.detail) == ("bad_dim", "3 for rank 2")
    op.unsqueeze(-3)
    assert len(op.dims) == 3 and op.dims[0] == []


def test_expand_to_fewer_dimensions_is_not_fusable() -> None:
    from amplite.passes.einsum_modes import ModeTable, NotFusable, Operand

    table = ModeTable()
    op = Operand.from_shape(table, [2, 1])
    with pytest.raises(NotFusable) as info:
        op.expand_to(table, [3])
    assert (info.value.reason, info.value.detail) == ("bad_expand", "[3]")
    with pytest.raises(NotFusable) as info:
        op.expand_to(table, [3, 4])
    assert (info.value.reason, info.value.detail) == ("bad_expand", "2 -> 3")
    op.expand_to(table, [5, 2, 4])
    assert op.shape(table) == [5, 2, 4]


def test_bad_permutation_names_the_order() -> None:
    from amplite.passes.einsum_modes import ModeTable, NotFusable, Operand

    with pytest.raises(NotFusable) as info:
        Operand.from_shape(ModeTable(), [2, 3]).permute([1, 1])
    assert (info.value.reason, info.value.detail) == ("bad_permutation", "[1, 1]")


def test_mode_bookkeeping_errors_name_the_problem() -> None:
    from amplite.passes import einsum_equation as eqn
    from amplite.passes.einsum_modes import ModeTable, NotFusable, Operand

    def reason(fn) -> tuple[str, str]:
        with pytest.raises(NotFusable) as info:
            fn()
        return info.value.reason, info.value.detail

    t = ModeTable()
    assert reason(lambda: Operand.from_shape(t, [2, 3])._norm(5)) == ("bad_dim", "5 for rank 2")
    assert reason(lambda: Operand.from_shape(t, [0, 3])) == ("zero_size", "")
    assert reason(lambda: Operand.from_shape(t, [2, 3]).view(t, [3, 2])) == ("irregular_reshape", "[2, 3] -> [3, 2]")
    assert reason(lambda: Operand.from_shape(t, [2, 3]).view(t, [4, 2])) == ("bad_view", "[4, 2] for 6 elements")
    a, b = Operand.from_shape(t, [2, 3, 4]), Operand.from_shape(t, [5, 4, 6])
    assert reason(lambda: eqn.matmul_groups(t, a, b)) == ("bad_broadcast", "2 vs 5")


@pytest.mark.parametrize(("a", "b"), [((2, 3), (2,)), ((2,), (2, 3))])
def test_unify_rejects_groups_of_different_extents(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    from amplite.passes import einsum_equation as eqn
    from amplite.passes.einsum_modes import ModeTable, NotFusable

    t = ModeTable()
    with pytest.raises(NotFusable) as info:
        eqn.unify(t, [t.new(n) for n in a], [t.new(n) for n in b])
    assert (info.value.reason, info.value.detail) == ("incompatible_factorization", "extents differ")


# --- survivors of the full mutation run: exact division of a symbol with no assumptions, the exhausted view -----


def test_exact_div_divides_a_symbolic_extent_by_an_int_whatever_the_symbols_assumptions() -> None:
    """128*s / 128 is s for a plain symbol too (sympy cannot prove Mod(128*s, 128) == 0 for it)."""
    s = sympy.Symbol("s")
    assert exact_div(128 * s, 128) == s and exact_div(128 * s, s) == 128
    assert exact_div(6 * s * _A, 3) == 2 * s * _A and exact_div(s, 2) is None


def test_view_that_no_regrouping_reaches_is_an_irregular_reshape_naming_both_shapes() -> None:
    """The modes run out before a target dimension is filled ([1] -> [-1, -1]): 'irregular_reshape', no crash."""
    t = ModeTable()
    o = Operand.from_shape(t, [1])
    with pytest.raises(NotFusable) as e:
        o.view(t, [-1, -1])
    assert (e.value.reason, e.value.detail) == ("irregular_reshape", "[1] -> [-1, -1]")
