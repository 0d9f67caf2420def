"""Pass 3: remove the casts that do not need to exist.

Guarantees afterwards (for pure dtype casts; casts that move devices are never touched):

* no cast converts a value to the dtype it already has;
* no value is cast twice to the same dtype (duplicates are merged into the earliest);
* a cast of a cast whose first step was exact (fp16→fp32, bf16→fp32) reads the original value directly,
  and an exact round trip (fp16→fp32→fp16) is gone. Lossy round trips (fp32→fp16→fp32) are kept: they
  are the rounding the plan asked for;
* a cast after an expanding data-movement op (expand) is moved before it, a cast before a shrinking one
  (slice, select, narrow) is moved after it, and a cast after any data-movement op is moved before it
  when that lets it merge with an existing cast of the same value. Values never change: data movement
  commutes exactly with an elementwise dtype conversion.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx

from amplite import op_tables
from amplite.passes.base import PassBase, PassResult
from amplite.passes.graph_utils import cast_dtype, is_exact_conversion, make_cast, numel, retype, value_dtype

_DATA_MOVEMENT = frozenset(filter(None, (op_tables.resolve(e) for e in op_tables.DATA_MOVEMENT_OPS)))
_SHRINKING = frozenset(filter(None, (op_tables.resolve(e) for e in ("slice.Tensor", "select.int", "narrow.default"))))
_MAX_ROUNDS = 20


def _is_float(dt: torch.dtype | None) -> bool:
    return dt is not None and dt.is_floating_point


class CleanupCasts(PassBase):
    """Remove identity casts, fold exact round trips, merge and move casts across data movement."""

    name = "cleanup_casts"

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """No identity cast, no value cast twice to one dtype, no cast of a cast whose first step was exact."""
        seen: set[tuple[torch.fx.Node, torch.dtype]] = set()
        for node, dt in self._casts(gm.graph):
            src = node.args[0]
            if value_dtype(src) == dt:
                raise self.broken(f"cast {node.name} converts {src.name} to the dtype it already has")
            if (src, dt) in seen:
                raise self.broken(f"{src.name} is cast to {str(dt).removeprefix('torch.')} more than once")
            seen.add((src, dt))
            inner_dt = cast_dtype(src)
            first = src.args[0] if inner_dt is not None else None
            first_dt = value_dtype(first) if isinstance(first, torch.fx.Node) else None
            if first_dt is not None and _is_float(first_dt) and is_exact_conversion(first_dt, inner_dt):  # type: ignore[arg-type]
                raise self.broken(f"cast {node.name} reads cast {src.name}, an exact conversion it could skip")

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        for _ in range(_MAX_ROUNDS):
            changed = False
            for rule in (self._identity, self._chains, self._duplicates, self._move_up, self._move_down):
                changed |= rule(gm.graph, counters)
            if not changed:
                break
        gm.graph.eliminate_dead_code()
        return PassResult(gm, sum(counters.values()) > 0, counters)

    @staticmethod
    def _casts(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.dtype]]:
        out = []
        for n in graph.nodes:
            dt = cast_dtype(n)
            if dt is not None and isinstance(n.args[0], torch.fx.Node) and _is_float(value_dtype(n.args[0])):
                out.append((n, dt))
        return out

    def _identity(self, graph: torch.fx.Graph, counters: Counter[str]) -> bool:
        changed = False
        for node, dt in self._casts(graph):
            if value_dtype(node.args[0]) == dt:
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                counters["identity_removed"] += 1
                changed = True
        return changed

    def _chains(self, graph: torch.fx.Graph, counters: Counter[str]) -> bool:
        changed = False
        for node, dt in self._casts(graph):
            inner = node.args[0]
            inner_dt = cast_dtype(inner)
            if inner_dt is None or not isinstance(inner.args[0], torch.fx.Node):
                continue
            src = inner.args[0]
            src_dt = value_dtype(src)
            if not _is_float(src_dt) or not is_exact_conversion(src_dt, inner_dt):
                continue  # the first step rounds: the chain is the plan's rounding, keep it
            if dt == src_dt:
                node.replace_all_uses_with(src)
                graph.erase_node(node)
                counters["round_trips_folded"] += 1
            else:
                node.args = (src, *node.args[1:])
                counters["chains_shortened"] += 1
            if not inner.users:
                graph.erase_node(inner)
            changed = True
        return changed

    def _duplicates(self, graph: torch.fx.Graph, counters: Counter[str]) -> bool:
        seen: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
        changed = False
        for node, dt in self._casts(graph):
            key = (node.args[0], dt)
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
                counters["duplicates_merged"] += 1
                changed = True
            else:
                seen[key] = node
        return changed

    def _move_up(self, graph: torch.fx.Graph, counters: Counter[str]) -> bool:
        """cast(m(x)) -> m(cast(x)) where that casts fewer elements or merges with a cast of x."""
        changed = False
        existing = {(n.args[0], dt): n for n, dt in self._casts(graph)}
        for node, dt in self._casts(graph):
            if node.graph is not graph or not node.users:
                continue
            m = node.args[0]
            if m.op != "call_function" or m.target not in _DATA_MOVEMENT or not isinstance(m.args[0], torch.fx.Node):
                continue
            x = m.args[0]
            if not _is_float(value_dtype(x)) or any(cast_dtype(u) != dt for u in m.users):
                continue
            partner = existing.get((x, dt))
            n_x, n_m = numel(x), numel(m)
            fewer = n_x is not None and n_m is not None and n_x < n_m
            if partner is None and not fewer:
                continue
            if partner is None:
                with graph.inserting_before(m):
                    partner = make_cast(graph, x, dt)
            elif _position(graph, partner) > _position(graph, m):
                m.prepend(partner)
            m.args = (partner, *m.args[1:])
            m.meta["val"] = retype(m.meta.get("val"), dt)
            for user in list(m.users):
                if user is not m and cast_dtype(user) == dt:
                    user.replace_all_uses_with(m)
                    graph.erase_node(user)
            counters["moved_above_data_movement"] += 1
            changed = True
            existing = {(n.args[0], d): n for n, d in self._casts(graph)}
        return changed

    def _move_down(self, graph: torch.fx.Graph, counters: Counter[str]) -> bool:
        """m(cast(x)) -> cast(m(x)) when m shrinks the value (slice, select, narrow)."""
        changed = False
        for node, dt in self._casts(graph):
            if len(node.users) != 1:
                continue
            (m,) = node.users
            if m.op != "call_function" or m.target not in _SHRINKING or m.args[0] is not node:
                continue
            n_in, n_out = numel(node), numel(m)
            if n_in is None or n_out is None or n_out >= n_in:
                continue
            x = node.args[0]
            m.args = (x, *m.args[1:])
            m.meta["val"] = retype(m.meta.get("val"), value_dtype(x))
            with graph.inserting_after(m):
                new = make_cast(graph, m, dt)
            m.replace_all_uses_with(new, delete_user_cb=lambda u, new=new: u is not new)
            graph.erase_node(node)
            counters["moved_below_data_movement"] += 1
            changed = True
        return changed


def _position(graph: torch.fx.Graph, node: torch.fx.Node) -> int:
    for i, n in enumerate(graph.nodes):
        if n is node:
            return i
    raise ValueError(f"{node} is not in the graph")
