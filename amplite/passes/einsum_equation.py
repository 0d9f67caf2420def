"""Deriving one einsum equation from data movement around a contraction (no torch.fx here).

Every operand is tracked as *modes* (einsum letters to be) of its **source** tensor, the value before the
absorbed data movement. A source dimension may be split into several modes (a free view on the source:
splitting a strided dimension never copies). Each *current* dimension, what the data-movement chain
produces, is an ordered group of modes, row-major within the group, so:

* permute / transpose reorder groups;
* a view/reshape regroups the row-major sequence of modes, splitting a mode where a new boundary falls
  inside it; a boundary that does not divide a mode is an irregular reshape and is rejected;
* unsqueeze inserts an empty group (size 1); squeeze drops a size-1 group;
* expand replaces a size-1 group with a fresh *virtual* mode, one the source does not have, which is
  exactly einsum broadcasting.

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

LETTERS = string.ascii_lowercase + string.ascii_uppercase


class NotFusable(Exception):
    """A candidate cannot be expressed exactly; ``reason`` is a short, stable counter name."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class ModeTable:
    """The modes of one fusion candidate: their extents, splits and unifications (union-find)."""

    def __init__(self) -> None:
        self._size: dict[int, int] = {}
        self._parent: dict[int, int] = {}
        self._split: dict[int, list[int]] = {}

    def new(self, size: int) -> int:
        """A fresh mode of extent ``size``."""
        m = len(self._size)
        self._size[m] = size
        self._parent[m] = m
        return m

    def find(self, m: int) -> int:
        """The representative of ``m``'s unification class."""
        while self._parent[m] != m:
            self._parent[m] = self._parent[self._parent[m]]
            m = self._parent[m]
        return m

    def size(self, m: int) -> int:
        """Extent of mode ``m``."""
        return self._size[self.find(m)]

    def expand(self, modes: Sequence[int]) -> list[int]:
        """The atomic (unsplit) modes that ``modes`` stand for now, in row-major order."""
        out: list[int] = []
        for m in modes:
            r = self.find(m)
            out.extend(self.expand(self._split[r]) if r in self._split else [r])
        return out

    def extent(self, modes: Sequence[int]) -> int:
        """Product of the extents of ``modes`` (1 for an empty group)."""
        return math.prod(self.size(m) for m in self.expand(modes))

    def split(self, m: int, sizes: Sequence[int]) -> list[int]:
        """Split atomic mode ``m`` into modes of the given extents (row-major); returns them."""
        r = self.find(m)
        assert r not in self._split and math.prod(sizes) == self._size[r]
        parts = [self.new(s) for s in sizes]
        self._split[r] = parts
        return parts

    def union(self, x: int, y: int) -> None:
        """Declare atomic modes ``x`` and ``y`` the same einsum letter."""
        rx, ry = self.find(x), self.find(y)
        assert self._size[rx] == self._size[ry]
        if rx != ry:
            self._parent[ry] = rx


@dataclass
class Operand:
    """One contraction input: modes of its source and the dimensions the movement chain produced."""

    source: list[list[int]]
    dims: list[list[int]]
    scale: float = 1.0

    @classmethod
    def from_shape(cls, table: ModeTable, shape: Sequence[int]) -> Operand:
        """An operand read directly from a source of ``shape``."""
        if any(n == 0 for n in shape):
            raise NotFusable("zero_size")
        src = [[table.new(n)] for n in shape]
        return cls(source=src, dims=[list(g) for g in src])

    def shape(self, table: ModeTable) -> list[int]:
        """The current (post-movement) shape."""
        return [table.extent(g) for g in self.dims]

    def source_modes(self, table: ModeTable) -> list[int]:
        """Atomic modes of the (split) source, in memory order."""
        return table.expand([m for g in self.source for m in g])

    def source_view(self, table: ModeTable) -> list[int]:
        """Shape to view the source as so that each of its modes is one dimension."""
        return [table.size(m) for m in self.source_modes(table)]

    # --- data movement -------------------------------------------------------------------------------

    def _norm(self, d: int) -> int:
        n = len(self.dims)
        if not -n <= d < n:
            raise NotFusable("bad_dim", f"{d} for rank {n}")
        return d % n

    def permute(self, order: Sequence[int]) -> None:
        """``x.permute(order)``."""
        order = [self._norm(d) for d in order]
        if sorted(order) != list(range(len(self.dims))):
            raise NotFusable("bad_permutation", str(order))
        self.dims = [self.dims[d] for d in order]

    def transpose(self, d0: int, d1: int) -> None:
        """``x.transpose(d0, d1)``."""
        d0, d1 = self._norm(d0), self._norm(d1)
        self.dims[d0], self.dims[d1] = self.dims[d1], self.dims[d0]

    def unsqueeze(self, d: int) -> None:
        """``x.unsqueeze(d)``."""
        n = len(self.dims) + 1
        if not -n <= d < n:
            raise NotFusable("bad_dim", f"{d} for rank {n - 1}")
        self.dims.insert(d % n, [])

    def squeeze(self, table: ModeTable, dims: Sequence[int] | None) -> None:
        """``x.squeeze(dims)`` (all size-1 dimensions when ``dims`` is None)."""
        targets = range(len(self.dims)) if dims is None else {self._norm(d) for d in dims}
        drop = {d for d in targets if table.extent(self.dims[d]) == 1}
        self.dims = [g for i, g in enumerate(self.dims) if i not in drop]

    def view(self, table: ModeTable, shape: Sequence[int]) -> None:
        """``x.view(shape)`` / ``x.reshape(shape)`` when it only splits or merges adjacent dimensions."""
        flat = table.expand([m for g in self.dims for m in g])
        total = math.prod(table.size(m) for m in flat)
        if math.prod(shape) != total:
            raise NotFusable("bad_view", f"{list(shape)} for {total} elements")
        new_dims: list[list[int]] = []
        i = 0
        for n in shape:
            group: list[int] = []
            prod = 1
            while prod < n:
                if i >= len(flat):
                    raise NotFusable("irregular_reshape", f"{self.shape(table)} -> {list(shape)}")
                m = flat[i]
                s = table.size(m)
                if n % (prod * s) == 0:
                    group.append(m)
                    prod *= s
                    i += 1
                    continue
                need = n // prod
                if n % prod or s % need:
                    # The new boundary falls inside a mode at a non-divisor: elements of one new row
                    # would come from different rows of the mode in a non-affine way.
                    raise NotFusable("irregular_reshape", f"{self.shape(table)} -> {list(shape)}")
                head, tail = table.split(m, [need, s // need])
                group.append(head)
                flat[i] = tail
                prod *= need
            new_dims.append(group)
        # Whatever is left has extent 1 (checked by the element count); dropping it sums over nothing.
        self.dims = new_dims

    def expand_to(self, table: ModeTable, shape: Sequence[int]) -> None:
        """``x.expand(shape)``: broadcast size-1 dimensions and add leading ones, without copying."""
        lead = len(shape) - len(self.dims)
        if lead < 0:
            raise NotFusable("bad_expand", str(list(shape)))
        new = [[table.new(n)] if n != 1 else [] for n in shape[:lead]]
        for g, n in zip(self.dims, shape[lead:], strict=True):
            cur = table.extent(g)
            if n in (-1, cur):
                new.append(g)
            elif cur == 1:
                new.append([table.new(n)])
            else:
                raise NotFusable("bad_expand", f"{cur} -> {n}")
        self.dims = new


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
        elif sb % sa == 0:
            head, xb[j] = table.split(xb[j], [sa, sb // sa])
            table.union(xa[i], head)
            i += 1
        elif sa % sb == 0:
            head, xa[i] = table.split(xa[i], [sb, sa // sb])
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
    factor = math.prod(table.size(m) for m in current - set(modes_a) - set(modes_b) - set(out_modes))
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
        for n, g in zip(c_shape, tail, strict=True):
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
