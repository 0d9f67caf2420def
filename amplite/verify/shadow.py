"""The machinery of the layer-wise analysis: node pairing and the reference/shadow runs.

:func:`pair_nodes` maps the converted graph's nodes to the reference's. :class:`Recorder` runs the reference
and keeps every value (with range statistics in the target dtype); :class:`Shadow` runs the converted graph
and measures each paired node, re-running it on the reference's inputs for its isolated error (see
``layerwise`` for the method).
"""

from __future__ import annotations

import math
import operator
import re
from typing import Any

import torch
import torch.fx

from amplite import op_tables
from amplite.ops.fp8_linear import fp8_linear
from amplite.passes.graph_utils import cast_dtype, module_path, source_line
from amplite.verify.node_errors import NodeError, node_error
from amplite.verify.ranges import range_stats

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


_VIEWS: dict[Any, bool] = {}


def _is_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` returns an alias of its input (a view copies no values and adds no error)."""
    if node.target not in _VIEWS:
        schema = getattr(node.target, "_schema", None)
        _VIEWS[node.target] = bool(
            schema and schema.returns and schema.returns[0].alias_info is not None and not schema.is_mutable
        )
    return _VIEWS[node.target]


def _layer(path: str) -> str:
    m = re.match(r"^(.*?\.\d+)(?:\.|$)", path)
    return m.group(1) if m else (path.split(".")[0] if path else "(root)")


def pair_nodes(ref: torch.fx.Graph, conv: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """Map converted nodes to reference nodes: by name, op, module path and shape first, then by
    (op, module path, occurrence).

    A name alone is not enough: re-export renumbers nodes when a pass removed some (fusion replaces
    ``linear`` nodes), so ``linear_4`` may be another module's linear in the converted graph. Amplite's own
    casts (pure dtype casts without a namesake in the reference) stay unpaired.
    """
    by_name = {n.name: n for n in ref.nodes}
    pairs: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in conv.nodes:
        r = by_name.get(n.name)
        if r is None or r.op != n.op or not (r.target == n.target or n.op in ("placeholder", "get_attr")
                                             or _fp8_of(r, n)):
            continue
        if n.op == "call_function" and (module_path(r) != module_path(n) or not _same_shape(r, n)):
            continue
        pairs[n] = r
    taken = set(pairs.values())

    def key(n: torch.fx.Node) -> tuple[str, Any, str]:
        return (n.op, n.target if n.op != "placeholder" else None, module_path(n))

    pending: dict[tuple, list[torch.fx.Node]] = {}
    for n in ref.nodes:
        if n not in taken and n.op in ("call_function", "placeholder", "get_attr"):
            pending.setdefault(key(n), []).append(n)
    for n in conv.nodes:
        if n in pairs or n.op not in ("call_function", "placeholder", "get_attr") or cast_dtype(n) is not None:
            continue
        queue = pending.get(key(n))
        if queue:
            pairs[n] = queue.pop(0)
    _pair_folded_batchnorm(pairs)
    return pairs


def _fp8_of(ref: torch.fx.Node, conv: torch.fx.Node) -> bool:
    """Whether ``conv`` is the ``amplite::fp8_linear`` that ``--precision fp8`` made of the product ``ref``
    (it keeps the node's name)."""
    return conv.target is fp8_linear._opoverload and op_tables.op_name(ref.target) in op_tables.FP8_WEIGHT_OPS


aten = torch.ops.aten
_CONVS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default}
#: The folded scale/shift as the converted program names them (``p_`` once lifted to a placeholder).
_FOLDED_ARG = re.compile(r"^(p_)?amplite_folded_\d+_(scale|shift)$")
_BNS = {aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default}


def _bn_output(conv: torch.fx.Node) -> torch.fx.Node | None:
    """The node holding the output of the inference BatchNorm that is ``conv``'s only user (or None)."""
    if conv.op != "call_function" or conv.target not in _CONVS or len(conv.users) != 1:
        return None
    bn = next(iter(conv.users))
    if bn.op != "call_function" or bn.target not in _BNS or bn.args[0] is not conv:
        return None
    if bn.target is aten.batch_norm.default:
        return bn
    first = [u for u in bn.users if u.target is operator.getitem and u.args[1] == 0]
    return first[0] if len(first) == 1 else None


def _pair_folded_batchnorm(pairs: dict[torch.fx.Node, torch.fx.Node]) -> None:
    """Pair a folded conv with its reference's conv+BatchNorm output, not the conv's pre-BN value.

    ``fold_batchnorm`` removed the BatchNorm: the converted conv computes what the reference's BN returns.
    A reference BN whose output no converted node pairs with was folded (with ``--no-fold-batchnorm`` the
    converted graph keeps its own BN, paired with the reference's, and nothing changes).
    """
    taken = set(pairs.values())
    for n, r in list(pairs.items()):
        if n.op == "call_function" and n.target in _CONVS:
            out = _bn_output(r)
            if out is not None and out not in taken and next(iter(r.users)) not in taken:
                end = _affine_end(n)  # O1 keeps the conv and adds the BN's affine after it: pair that with BN
                pairs[end if end is not None else n] = out


def _affine_end(conv: torch.fx.Node) -> torch.fx.Node | None:
    """The last of the ``mul``/``add`` by a folded scale/shift that ``fold_batchnorm`` put after ``conv``."""
    end, node = None, conv
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.target not in (aten.mul.Tensor, aten.add.Tensor) or user.args[0] is not node:
            break
        arg = user.args[1]
        if not (isinstance(arg, torch.fx.Node) and _FOLDED_ARG.match(arg.name)):
            break
        end = node = user
    return end


def _decision_op(n: torch.fx.Node) -> str | None:
    """The op name when ``n`` is a discrete decision or an output of one (``topk(...)[1]``), else None."""
    src = n.args[0] if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) else n
    name = op_tables.op_name(src.target)
    return name if name in op_tables.DISCRETE_DECISION_OPS else None


def _folded_conv(n: torch.fx.Node, r: torch.fx.Node) -> torch.fx.Node | None:
    """The reference conv of a folded pair (``n`` a converted conv paired with a BN output), else None."""
    if n.target not in _CONVS or r.target in _CONVS:
        return None
    bn = r.args[0] if r.target is operator.getitem else r
    return bn.args[0] if isinstance(bn, torch.fx.Node) and isinstance(bn.args[0], torch.fx.Node) else None


def _same_shape(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
        try:
            return tuple(va.shape) == tuple(vb.shape)
        except (TypeError, RuntimeError):  # symbolic sizes: no verdict
            return True
    return True


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
        if self.low is not None and n.op == "call_function" and isinstance(out, torch.Tensor) and not _is_view(n):
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
        if r is None or n.op != "call_function" or _is_view(n):
            return
        if isinstance(out, torch.Tensor) and not out.dtype.is_floating_point and _decision_op(n):
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
        op = _decision_op(n)
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
                and (_is_view(n) or n in self.is_cast)
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
        conv = _folded_conv(n, r)  # a folded conv: named as the conv the plan knows, measured as conv+BN
        site = conv if conv is not None else r
        op = self.names.get(n) or op_tables.op_name(site.target) or str(site.target)
        self.records.append(
            NodeError(
                index=len(self.records),
                node=site.name,
                op=f"{op}+batch_norm" if conv is not None else op,
                module=module_path(site),
                source=source_line(site),
                layer=_layer(module_path(site)),
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
