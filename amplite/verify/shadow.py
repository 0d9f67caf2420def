"""The machinery of the layer-wise analysis: the reference/shadow runs over paired nodes.

:func:`pair_nodes` (in ``pairing``, importable from here) maps the converted graph's nodes to the
reference's. :class:`Recorder` runs the reference and keeps every value (with range statistics in the
target dtype); :class:`Shadow` runs the converted graph and measures each paired node, re-running it on the
reference's inputs for its isolated error (see ``layerwise`` for the method).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx

from amplite import op_tables
from amplite.passes.graph_utils import cast_dtype, module_path, source_line
from amplite.verify.node_errors import NodeError, node_error
from amplite.verify.pairing import decision_op, folded_conv, is_view, layer_of, pair_nodes
from amplite.verify.ranges import range_stats

Inputs = tuple[tuple[Any, ...], dict[str, Any]]

__all__ = ["Inputs", "Recorder", "Shadow", "flat_inputs", "pair_nodes"]


class _Runner:
    """A lean ``torch.fx.Interpreter``: runs a GraphModule node by node, calls :meth:`visit` after each
    node and frees values after their last use. (Interpreter does the same with more per-node overhead,
    which shows on graphs of small ops.)"""

    def __init__(self, gm: torch.fx.GraphModule, free: bool) -> None:
        self.gm = gm
        self.env: dict[torch.fx.Node, Any] = {}
        self.free: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        if free:
            seen: set[torch.fx.Node] = set()
            for node in reversed(gm.graph.nodes):
                for inp in node.all_input_nodes:
                    if inp not in seen:
                        seen.add(inp)
                        self.free.setdefault(node, []).append(inp)

    def visit(self, n: torch.fx.Node, value: Any) -> None:
        """Called with each node's value (override)."""

    def run(self, *args: Any) -> Any:
        """Run the graph on its placeholder values; returns the output node's value."""
        env, gm, inputs = self.env, self.gm, iter(args)
        lookup = env.__getitem__
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                value = next(inputs)
            elif n.op == "get_attr":
                value = gm
                for atom in n.target.split("."):
                    value = getattr(value, atom)
            elif n.op == "output":
                return torch.fx.node.map_arg(n.args[0], lookup)
            else:
                a, kw = torch.fx.node.map_arg(n.args, lookup), torch.fx.node.map_arg(n.kwargs, lookup)
                if n.op == "call_function":
                    value = n.target(*a, **kw)
                elif n.op == "call_module":
                    value = gm.get_submodule(n.target)(*a, **kw)
                else:  # call_method
                    value = getattr(a[0], n.target)(*a[1:], **kw)
            env[n] = value
            self.visit(n, value)
            for dead in self.free.get(n, ()):
                del env[dead]
        return None


class Recorder(_Runner):
    """Runs the reference and keeps every value (and its range statistics in the target dtype)."""

    def __init__(self, gm: torch.fx.GraphModule, low: torch.dtype | None) -> None:
        super().__init__(gm, free=False)
        self.values = self.env
        self.ranges: dict[str, dict[str, Any]] = {}
        self.low = low

    def visit(self, n: torch.fx.Node, out: Any) -> None:
        if self.low is not None and n.op == "call_function" and isinstance(out, torch.Tensor) and not is_view(n):
            stats = range_stats(out, self.low)
            if stats is not None:
                self.ranges[n.name] = stats


class Shadow(_Runner):
    """Runs the converted graph, comparing each paired node with the reference as it goes."""

    def __init__(self, gm: torch.fx.GraphModule, pairs: dict, ref: Recorder) -> None:
        super().__init__(gm, free=True)
        self.is_cast = {n for n in gm.graph.nodes if n.op == "call_function" and cast_dtype(n) is not None}
        self.pairs, self.ref = pairs, ref
        self.records: list[NodeError] = []
        self.tuples: dict[torch.fx.Node, tuple[Any, bool, bool]] = {}
        self.names: dict[torch.fx.Node, str] = {}
        self.casts: dict[tuple[torch.fx.Node, torch.dtype], torch.Tensor] = {}
        self.weights: dict[torch.fx.Node, bool] = {}
        self.weight_like: dict[torch.fx.Node, bool] = {}
        self.decisions: list[dict[str, Any]] = []

    def visit(self, n: torch.fx.Node, out: Any) -> None:
        r = self.pairs.get(n)
        if r is None or n.op != "call_function" or is_view(n):
            return
        if isinstance(out, torch.Tensor) and not out.dtype.is_floating_point and decision_op(n):
            self._record_decision(n, r, out)
            return
        if n.target is operator.getitem and n.args[0] in self.tuples:
            self.names[n] = f"{self.names.get(n.args[0], 'op')}[{n.args[1]}]"
            shadow, exact, inherited = self.tuples[n.args[0]]
            self._record(n, r, out, shadow[n.args[1]] if shadow is not None else None, exact, inherited)
            return
        if isinstance(out, (tuple, list)):
            self.tuples[n] = self._shadow(n)
            self.names[n] = op_tables.op_name(n.target) or str(n.target)
        elif isinstance(out, torch.Tensor) and out.dtype.is_floating_point:
            self._record(n, r, out, *self._shadow(n))

    def _record_decision(self, n: torch.fx.Node, r: torch.fx.Node, out: torch.Tensor) -> None:
        """Index agreement of a discrete decision (topk/argmax/sort indices) with the reference's."""
        refv = self.ref.values.get(r)
        if not isinstance(refv, torch.Tensor) or refv.shape != out.shape:
            return
        op = decision_op(n)
        site = r.args[0] if r.target is operator.getitem and isinstance(r.args[0], torch.fx.Node) else r
        agree = float((refv == out).double().mean()) if out.numel() else 1.0
        self.decisions.append({"node": site.name, "op": op, "module": module_path(site), "source": source_line(site),
                               "elements": out.numel(), "agreement": agree})  # fmt: skip

    def _shadow(self, n: torch.fx.Node) -> tuple[Any, bool, bool]:
        """Re-run ``n`` on the reference's values; returns (output or None, exact, inherited NaN/Inf)."""
        exact, inherited, partial = True, False, False

        def sub(a: torch.fx.Node) -> Any:
            nonlocal exact, inherited, partial
            src, via_cast = a, False
            while src not in self.pairs and src in self.is_cast:
                src, via_cast = src.args[0], True
            actual = self.env[a]
            if src not in self.pairs or not isinstance(actual, torch.Tensor):
                partial |= src not in self.pairs
                return actual
            refv = self.ref.values.get(self.pairs[src])
            if not isinstance(refv, torch.Tensor):
                partial = True
                return actual
            if self._weight_like(a):  # weights are part of the converted node: use its own
                exact &= self._same_weight(a, refv, actual)
                return actual
            if refv.dtype == actual.dtype:
                return refv
            exact = False
            key = (self.pairs[src], actual.dtype)
            if key not in self.casts:  # one cast per (value, dtype), shared by all consumers
                self.casts[key] = refv.to(actual.dtype)
            v = self.casts[key]
            if not via_cast and v.dtype.is_floating_point and self._overflows(self.pairs[src], v):
                inherited |= bool((torch.isfinite(refv) & ~torch.isfinite(v)).any())
            return v

        args = torch.fx.node.map_arg(n.args, sub)
        kwargs = torch.fx.node.map_arg(n.kwargs, sub)
        exact &= not partial
        schema = getattr(n.target, "_schema", None)
        if exact or (schema is not None and schema.is_mutable):
            return None, exact, inherited
        with torch.no_grad():
            return n.target(*args, **kwargs), False, inherited

    def _weight_like(self, n: torch.fx.Node) -> bool:
        """Whether ``n`` is a weight or buffer, or a view or cast of only weights (cached)."""
        if n not in self.weight_like:
            self.weight_like[n] = n.op == "get_attr" or (
                n.op == "call_function"
                and (is_view(n) or n in self.is_cast)
                and bool(n.all_input_nodes)
                and all(self._weight_like(a) for a in n.all_input_nodes)
            )
        return self.weight_like[n]

    def _same_weight(self, src: torch.fx.Node, refv: torch.Tensor, actual: torch.Tensor) -> bool:
        """Whether a converted weight is bit-identical to the reference's (cached per weight)."""
        if src not in self.weights:
            self.weights[src] = (
                refv.dtype == actual.dtype and refv.shape == actual.shape and bool(torch.equal(refv, actual))
            )
        return self.weights[src]

    def _overflows(self, r: torch.fx.Node, v: torch.Tensor) -> bool:
        """Whether the reference value of ``r`` cast to ``v``'s dtype has NaN/Inf (range stats answer it
        for the target dtype without another pass over the tensor)."""
        stats = self.ref.ranges.get(r.name)
        if stats is not None and v.dtype == self.ref.low:
            return stats["overflow"] > 0 or not math.isfinite(stats["max_abs"])
        return not bool(torch.isfinite(v).all())

    def _record(self, n: torch.fx.Node, r: torch.fx.Node, out: Any, shadow: Any, exact: bool, inh: bool) -> None:
        refv = self.ref.values.get(r)
        acc = node_error(refv, out)
        if acc is None:
            return
        iso = {"sqnr_db": math.inf, "max_abs": 0.0, "rel_l2": 0.0, "new_nonfinite": 0} if exact else None
        if shadow is not None:
            iso = node_error(refv, shadow)
        conv = folded_conv(n, r)  # a folded conv: named as the conv the plan knows, measured as conv+BN
        site = conv if conv is not None else r
        op = self.names.get(n) or op_tables.op_name(site.target) or str(site.target)
        self.records.append(
            NodeError(
                index=len(self.records),
                node=site.name,
                op=f"{op}+batch_norm" if conv is not None else op,
                module=module_path(site),
                source=source_line(site),
                layer=layer_of(module_path(site)),
                dtype=str(out.dtype).removeprefix("torch."),
                accumulated=acc,
                isolated=iso,
                exact=exact,
                introduces_nonfinite=bool(iso and iso["new_nonfinite"] and not inh),
                inherited_nonfinite=inh,
                range=self.ref.ranges.get(r.name),
            )
        )


def flat_inputs(gm: torch.fx.GraphModule, inputs: Inputs) -> list[Any]:
    """The placeholder values of an exported module's graph for ``(args, kwargs)``."""
    import torch.fx._pytree as fx_pytree

    spec = gm.graph._codegen.pytree_info.in_spec  # type: ignore[attr-defined]
    return list(fx_pytree.tree_flatten_spec(inputs, spec))
