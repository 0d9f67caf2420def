"""Mode bookkeeping for ``einsum_equation``: the modes of a fusion candidate and one operand's movement chain.

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

Extents are ints, or for symbolic shapes (a dynamic batch or sequence) sympy expressions in the shape
symbols, products of them in practice (``s0``, ``128*s0``). Splitting and unifying need exact division
(:func:`exact_div`): a symbolic extent divides another only when the quotient is a monomial with an
integer coefficient, so ``s0*128`` splits into ``s0`` and ``128`` but ``s0`` never splits into ``2``
and ``s0/2``.

No torch.fx here; ``einsum_equation`` re-exports every public name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy

#: An extent: an int, or a sympy expression in the shape symbols.
Size = Any


def norm_size(n: Size) -> Size:
    """``n`` as an int when it is a number, else as a sympy expression."""
    if isinstance(n, int):
        return n
    n = sympy.sympify(n)
    return int(n) if n.is_Integer else n


def exact_div(n: Size, d: Size) -> Size | None:
    """``n / d`` when ``d`` divides ``n`` for every value of the symbols, else None."""
    if isinstance(n, int) and isinstance(d, int):
        return n // d if d and n % d == 0 else None
    q = sympy.cancel(sympy.sympify(n) / sympy.sympify(d))
    if q.is_Integer:
        return int(q) if q > 0 else None
    syms = sorted(q.free_symbols, key=str)
    if not syms or not q.is_polynomial(*syms):
        return None
    poly = sympy.Poly(q, *syms)
    return q if len(poly.terms()) == 1 and all(c.is_Integer and c > 0 for c in poly.coeffs()) else None


def is_static(n: Size) -> bool:
    """Whether an extent is a plain int."""
    return isinstance(n, int)


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

    def new(self, size: Size) -> int:
        """A fresh mode of extent ``size``."""
        m = len(self._size)
        self._size[m] = norm_size(size)
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
        return norm_size(math.prod(self.size(m) for m in self.expand(modes)))

    def split(self, m: int, sizes: Sequence[int]) -> list[int]:
        """Split atomic mode ``m`` into modes of the given extents (row-major); returns them."""
        r = self.find(m)
        assert r not in self._split and norm_size(math.prod(sizes)) == self._size[r]
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
        total = table.extent(flat)
        shape = [norm_size(n) for n in shape]
        if norm_size(math.prod(shape)) != total:
            raise NotFusable("bad_view", f"{list(shape)} for {total} elements")
        new_dims: list[list[int]] = []
        i = 0
        for n in shape:
            group: list[int] = []
            prod: Size = 1
            while prod != n:
                if i >= len(flat):
                    raise NotFusable("irregular_reshape", f"{self.shape(table)} -> {list(shape)}")
                m = flat[i]
                s = table.size(m)
                if exact_div(n, norm_size(prod * s)) is not None:
                    group.append(m)
                    prod = norm_size(prod * s)
                    i += 1
                    continue
                need = exact_div(n, prod)
                rest = None if need is None else exact_div(s, need)
                if rest is None:
                    # The new boundary falls inside a mode at a non-divisor: elements of one new row
                    # would come from different rows of the mode in a non-affine way.
                    raise NotFusable("irregular_reshape", f"{self.shape(table)} -> {list(shape)}")
                head, tail = table.split(m, [need, rest])
                group.append(head)
                flat[i] = tail
                prod = norm_size(prod * need)
            new_dims.append(group)
        # Whatever is left has extent 1 (checked by the element count); dropping it sums over nothing.
        self.dims = new_dims

    def expand_to(self, table: ModeTable, shape: Sequence[int]) -> None:
        """``x.expand(shape)``: broadcast size-1 dimensions and add leading ones, without copying."""
        lead = len(shape) - len(self.dims)
        if lead < 0:
            raise NotFusable("bad_expand", str(list(shape)))
        shape = [norm_size(n) for n in shape]
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
