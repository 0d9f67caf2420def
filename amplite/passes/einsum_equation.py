"""Deriving one einsum equation from data movement around a contraction (no torch.fx here).

The mode bookkeeping (``ModeTable``, ``Operand`` and how each data-movement op changes an operand's modes)
lives in ``einsum_modes``; it is re-exported here. In short: every operand is tracked as *modes* (einsum
letters to be) of its **source** tensor, the value before the absorbed data movement, and each current
dimension is an ordered group of those modes (permute/transpose reorder groups, views regroup or split
modes, unsqueeze/squeeze add/drop empty groups, expand adds a *virtual* mode, i.e. einsum broadcasting).

At the contraction, matched dimensions of the two operands are unified mode by mode after refining
both to a common factorisation. Size-1 modes left out of the output occur in one input only and are
summed over, which for extent 1 changes nothing. The result is exact: the equation reads every element
the eager chain would have read.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass

from amplite.passes.einsum_modes import ModeTable, NotFusable, Operand, exact_div, norm_size

__all__ = [
    "LETTERS",
    "Equation",
    "ModeTable",
    "NotFusable",
    "Operand",
    "build_equation",
    "einsum_groups",
    "linear_groups",
    "matmul_groups",
    "unify",
]

LETTERS = string.ascii_lowercase + string.ascii_uppercase


def unify(table: ModeTable, ga: Sequence[int], gb: Sequence[int]) -> None:
    """Make two equal-extent dimensions the same letters, splitting modes to a common factorisation.

    Raises:
        NotFusable: ``incompatible_factorization`` when no common refinement exists (say 2×3 vs 3×2).
    """
    xa = [m for m in table.expand(ga) if table.size(m) != 1]
    xb = [m for m in table.expand(gb) if table.size(m) != 1]
    i = j = 0
    while i < len(xa) and j < len(xb):
        sa, sb = table.size(xa[i]), table.size(xb[j])
        if sa == sb:
            table.union(xa[i], xb[j])
            i, j = i + 1, j + 1
        elif (qb := exact_div(sb, sa)) is not None:
            head, xb[j] = table.split(xb[j], [sa, qb])
            table.union(xa[i], head)
            i += 1
        elif (qa := exact_div(sa, sb)) is not None:
            head, xa[i] = table.split(xa[i], [sb, qa])
            table.union(head, xb[j])
            j += 1
        else:
            raise NotFusable("incompatible_factorization", f"{table.extent(ga)}: {sa} vs {sb}")
    if i != len(xa) or j != len(xb):
        raise NotFusable("incompatible_factorization", "extents differ")


def matmul_groups(table: ModeTable, a: Operand, b: Operand) -> list[list[int]]:
    """``torch.matmul`` semantics on operands of rank >= 2 (batch dimensions broadcast)."""
    if len(a.dims) < 2 or len(b.dims) < 2:
        raise NotFusable("vector_operand")
    unify(table, a.dims[-1], b.dims[-2])
    ba, bb = a.dims[:-2], b.dims[:-2]
    batch: list[list[int]] = []
    for k in range(max(len(ba), len(bb)), 0, -1):
        ga = ba[-k] if k <= len(ba) else None
        gb = bb[-k] if k <= len(bb) else None
        na = 1 if ga is None else table.extent(ga)
        nb = 1 if gb is None else table.extent(gb)
        if ga is not None and gb is not None and na == nb:
            unify(table, ga, gb)
            batch.append(ga)
        elif gb is not None and (ga is None or na == 1):
            batch.append(gb)  # a's size-1 modes there are summed over alone: a no-op
        elif ga is not None and (gb is None or nb == 1):
            batch.append(ga)
        else:
            raise NotFusable("bad_broadcast", f"{na} vs {nb}")
    return [*batch, a.dims[-2], b.dims[-1]]


def linear_groups(table: ModeTable, x: Operand, w: Operand) -> list[list[int]]:
    """``F.linear(x, w)`` = ``x @ w.T``: contracts x's last dimension with w's second."""
    if len(x.dims) < 1 or len(w.dims) != 2:
        raise NotFusable("vector_operand")
    unify(table, x.dims[-1], w.dims[1])
    return [*x.dims[:-1], w.dims[0]]


def einsum_groups(table: ModeTable, equation: str, a: Operand, b: Operand) -> list[list[int]]:
    """``torch.einsum(equation, a, b)`` for explicit or implicit equations without ellipsis."""
    eq = equation.replace(" ", "")
    if "." in eq:
        raise NotFusable("einsum_ellipsis")
    lhs, _, out = eq.partition("->")
    subs = lhs.split(",")
    if len(subs) != 2:
        raise NotFusable("einsum_operands", str(len(subs)))
    if "->" not in eq:  # implicit output: letters seen once, alphabetically
        counts = {ch: lhs.count(ch) for ch in lhs if ch.isalpha()}
        out = "".join(sorted(ch for ch, n in counts.items() if n == 1))
    first: dict[str, list[int]] = {}
    for s, op in zip(subs, (a, b), strict=True):
        if len(s) != len(op.dims) or len(set(s)) != len(s):
            raise NotFusable("einsum_diagonal_or_rank", s)
        for ch, g in zip(s, op.dims, strict=True):
            if ch in first:
                unify(table, first[ch], g)
            else:
                first[ch] = g
    return [first[ch] for ch in out]


@dataclass
class Equation:
    """A derived contraction: equation, the views its operands need, and its output shape."""

    equation: str
    a_view: list[int]
    b_view: list[int]
    out_shape: list[int]
    c_view: list[int] | None = None
    factor: float = 1.0


def build_equation(
    table: ModeTable,
    a: Operand,
    b: Operand,
    out_groups: Sequence[Sequence[int]],
    c_shape: Sequence[int] | None = None,
) -> Equation:
    """Letter the modes of ``a``, ``b`` and the output and emit the einsum equation.

    Args:
        table: The candidate's modes.
        a: First input.
        b: Second input.
        out_groups: The contraction's output dimensions as mode groups.
        c_shape: Shape of a bias broadcast against the output dimensions, if any.
    """
    modes_a, modes_b = a.source_modes(table), b.source_modes(table)
    out_modes = table.expand([m for g in out_groups for m in g])
    if len(set(out_modes)) != len(out_modes):
        raise NotFusable("repeated_output_mode")
    missing = set(out_modes) - set(modes_a) - set(modes_b)
    if missing:
        # Broadcast in both inputs: the output would need an expand, which einsum cannot express.
        raise NotFusable("broadcast_only_mode")
    # A contracted mode that both inputs only broadcast along sums a constant: einsum would drop it,
    # so its extent becomes a factor of alpha.
    current = set(table.expand([m for op in (a, b) for g in op.dims for m in g]))
    factor = norm_size(math.prod(table.size(m) for m in current - set(modes_a) - set(modes_b) - set(out_modes)))
    if not isinstance(factor, int):
        raise NotFusable("symbolic_shape", f"a summed broadcast mode of extent {factor}")
    letters: dict[int, str] = {}
    for m in [*modes_a, *modes_b, *out_modes]:
        if m not in letters:
            if len(letters) == len(LETTERS):
                raise NotFusable("too_many_modes")
            letters[m] = LETTERS[len(letters)]
    word = lambda ms: "".join(letters[m] for m in ms)  # noqa: E731
    c_view = None
    if c_shape is not None:
        if len(c_shape) > len(out_groups):
            raise NotFusable("bias_broadcasts_output")
        c_view = []
        tail = list(out_groups)[len(out_groups) - len(c_shape) :] if c_shape else []
        for n, g in zip(map(norm_size, c_shape), tail, strict=True):
            atoms = table.expand(g)
            if n == table.extent(g):
                c_view.extend(table.size(m) for m in atoms)
            elif n == 1:
                c_view.extend(1 for _ in atoms)
            else:
                raise NotFusable("bias_shape", f"{list(c_shape)}")
    return Equation(
        equation=f"{word(modes_a)},{word(modes_b)}->{word(out_modes)}",
        a_view=a.source_view(table),
        b_view=b.source_view(table),
        out_shape=[table.size(m) for m in out_modes],
        c_view=c_view,
        factor=float(factor),
    )
