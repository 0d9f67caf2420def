"""Layer-wise error localisation: which nodes of the converted graph introduce error, and how much.

Both programs run once under a :class:`torch.fx.Interpreter` on the same batch. Each node of the converted
graph is paired with its reference node (same name and op, else same op, module path and occurrence;
amplite's casts stay unpaired) and two errors are measured:

- **accumulated**: the converted node's value against the reference's, each model on its own activations;
  this is the error that reached that point of the graph.
- **isolated** ("shadow", as in torch.ao's numeric suite): the converted node re-run on the *reference's*
  inputs, cast to the dtypes that node receives in the converted graph, against the reference's value.
  This is the error the node itself introduces. A node whose operands all arrive in their reference dtype
  computes exactly what the reference did, so it is not re-run (its isolated error is 0). Weights and
  buffers are the converted model's own (stored in low precision at O2/O3, or edited): they belong to the
  node.

NaN/Inf are attributed where they first appear: a node whose shadow output has NaN/Inf that the reference
lacks *introduces* them, unless its inputs already carried them straight from a producer's low-precision
output (then the producer is to blame and the node only *inherits* them). Overflow at one of amplite's
casts belongs to the consumer that asked for the low dtype. Nodes are ranked: introduced NaN/Inf first,
then lowest isolated SQNR. Only the first data batch is analysed; view ops (which copy no values) are
left out.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import asdict, dataclass, field
from time import perf_counter
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from amplite import op_tables
from amplite.converter.ranges import range_stats
from amplite.converter.verify import json_float
from amplite.passes.graph_utils import cast_dtype, module_path, source_line

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class NodeError:
    """Errors of one paired node.

    Attributes:
        index: Position in the converted graph (among recorded nodes).
        node: The node's name (the reference's, which the converted graph keeps).
        op: ATen op name. module: Dotted module path. source: ``file:line`` of the user's code.
        layer: The module path up to its last numbered component (``layers.3``), for per-layer charts.
        dtype: The dtype the converted node produces.
        accumulated: ``{sqnr_db, max_abs, rel_l2, new_nonfinite}`` on the converted model's own activations.
        isolated: The same, fed with the reference's inputs (None when the node could not be re-run).
        exact: The node received its operands in the reference's dtypes (isolated error 0 by construction).
        introduces_nonfinite: Its shadow output has NaN/Inf that its inputs did not bring.
        inherited_nonfinite: Its inputs already carried NaN/Inf from a producer's low-precision output.
        range: Range statistics of the reference value in the target dtype (see ``ranges``).
    """

    index: int
    node: str
    op: str
    module: str
    source: str
    layer: str
    dtype: str | None
    accumulated: dict[str, Any] | None = None
    isolated: dict[str, Any] | None = None
    exact: bool = False
    introduces_nonfinite: bool = False
    inherited_nonfinite: bool = False
    range: dict[str, Any] | None = None

    def rank_key(self) -> tuple[int, float]:
        """Sort key: introduced NaN/Inf first, then lowest isolated SQNR."""
        sqnr = self.isolated["sqnr_db"] if self.isolated else math.inf
        return (0 if self.introduces_nonfinite else 1, sqnr)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict."""
        return pytree.tree_map(json_float, asdict(self))


@dataclass
class LayerwiseResult:
    """The layer-wise analysis of one batch."""

    nodes: list[NodeError] = field(default_factory=list)
    paired: int = 0
    unpaired: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def top(self, n: int = 10) -> list[NodeError]:
        """The ``n`` nodes that introduce the most error (none that introduce nothing)."""
        cands = [e for e in self.nodes if e.isolated and (e.introduces_nonfinite or e.isolated["sqnr_db"] < math.inf)]
        return sorted(cands, key=NodeError.rank_key)[:n]

    def layers(self) -> list[dict[str, Any]]:
        """Per-layer summary: worst accumulated and isolated SQNR of each layer, in graph order."""
        out: dict[str, dict[str, Any]] = {}
        for e in self.nodes:
            row = out.setdefault(
                e.layer,
                {
                    "layer": e.layer,
                    "nodes": 0,
                    "accumulated_sqnr_db": math.inf,
                    "isolated_sqnr_db": math.inf,
                    "nonfinite": False,
                },
            )
            row["nodes"] += 1
            if e.accumulated:
                row["accumulated_sqnr_db"] = min(row["accumulated_sqnr_db"], e.accumulated["sqnr_db"])
                row["nonfinite"] |= e.accumulated["new_nonfinite"] > 0
            if e.isolated:
                row["isolated_sqnr_db"] = min(row["isolated_sqnr_db"], e.isolated["sqnr_db"])
        return list(out.values())

    def to_dict(self, top_n: int = 10) -> dict[str, Any]:
        """The report section ``layerwise``."""
        return {
            "batch": 0,
            "paired_nodes": self.paired,
            "unpaired_converted_nodes": self.unpaired,
            "seconds": round(self.seconds, 4),
            "top_introducers": [e.to_dict() for e in self.top(top_n)],
            "layers": [pytree.tree_map(json_float, row) for row in self.layers()],
            "nodes": [e.to_dict() for e in self.nodes],
        }


def node_error(ref: Any, out: Any) -> dict[str, Any] | None:
    """SQNR, max |error|, relative L2 error and new NaN/Inf of ``out`` against ``ref`` (None if not comparable).

    Computed in FP32 (no copy of an FP32 reference); a non-finite norm (NaN/Inf, or FP32 overflow) sends it
    down the slow path, in FP64 over the finite elements.
    """
    if not (isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor)) or ref.shape != out.shape:
        return None
    if not ref.dtype.is_floating_point or ref.numel() == 0:
        return None
    r, o = ref.detach().float(), out.detach().float()
    d = o - r
    new_nonfinite = 0
    rn, en, mx = torch.stack([r.norm(), d.norm(), d.abs().max()]).tolist()
    if not (math.isfinite(rn) and math.isfinite(en)):  # NaN/Inf somewhere (inf - inf is NaN), or huge values
        rf, of = torch.isfinite(r), torch.isfinite(o)
        new_nonfinite = int((rf & ~of).sum())
        r, o = r[rf & of].double(), o[rf & of].double()
        if r.numel() == 0:
            return {"sqnr_db": -math.inf, "max_abs": math.inf, "rel_l2": math.inf, "new_nonfinite": new_nonfinite}
        d = o - r
        rn, en, mx = torch.stack([r.norm(), d.norm(), d.abs().max()]).tolist()
    if new_nonfinite:
        sqnr, rel = -math.inf, math.inf
    else:
        sqnr = math.inf if en == 0 else (20 * math.log10(rn / en) if rn > 0 else -math.inf)
        rel = en / rn if rn > 0 else (0.0 if en == 0 else math.inf)
    return {"sqnr_db": sqnr, "max_abs": mx, "rel_l2": rel, "new_nonfinite": new_nonfinite}


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
    """Map converted nodes to reference nodes: by name and op first, then by (op, module path, occurrence).

    Amplite's own casts (pure dtype casts without a namesake in the reference) stay unpaired.
    """
    by_name = {n.name: n for n in ref.nodes}
    pairs: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in conv.nodes:
        r = by_name.get(n.name)
        if r is not None and r.op == n.op and (r.target == n.target or n.op in ("placeholder", "get_attr")):
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
    return pairs


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


class _Recorder(_Runner):
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


class _Shadow(_Runner):
    """Runs the converted graph, comparing each paired node with the reference as it goes."""

    def __init__(self, gm: torch.fx.GraphModule, pairs: dict, ref: _Recorder) -> None:
        super().__init__(gm, free=True)
        self.is_cast = {n for n in gm.graph.nodes if n.op == "call_function" and cast_dtype(n) is not None}
        self.pairs, self.ref = pairs, ref
        self.records: list[NodeError] = []
        self.tuples: dict[torch.fx.Node, tuple[Any, bool, bool]] = {}
        self.names: dict[torch.fx.Node, str] = {}
        self.casts: dict[tuple[torch.fx.Node, torch.dtype], torch.Tensor] = {}
        self.weights: dict[torch.fx.Node, bool] = {}
        self.weight_like: dict[torch.fx.Node, bool] = {}

    def visit(self, n: torch.fx.Node, out: Any) -> None:
        r = self.pairs.get(n)
        if r is None or n.op != "call_function" or _is_view(n):
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
        self.records.append(
            NodeError(
                index=len(self.records),
                node=r.name,
                op=self.names.get(n) or op_tables.op_name(r.target) or str(r.target),
                module=module_path(r),
                source=source_line(r),
                layer=_layer(module_path(r)),
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


def analyze(
    reference: ExportedProgram | torch.fx.GraphModule,
    converted: ExportedProgram | torch.fx.GraphModule,
    ref_inputs: Inputs,
    conv_inputs: Inputs,
    low_dtype: torch.dtype | None = torch.float16,
) -> LayerwiseResult:
    """Layer-wise analysis of ``converted`` against ``reference`` on one batch.

    Args:
        reference: The FP32 program (or its ``.module()``, to reuse one already built).
        converted: The converted program (or its ``.module()``).
        ref_inputs: The batch as the reference takes it. conv_inputs: The same batch as the converted
            program takes it (low-precision I/O casts the float inputs).
        low_dtype: The target dtype for range statistics (None: no range statistics).
    """
    start = perf_counter()
    ref_gm = reference.module() if isinstance(reference, ExportedProgram) else reference
    conv_gm = converted.module() if isinstance(converted, ExportedProgram) else converted
    pairs = pair_nodes(ref_gm.graph, conv_gm.graph)
    rec = _Recorder(ref_gm, low_dtype)
    with torch.no_grad():
        rec.run(*flat_inputs(ref_gm, ref_inputs))
        shadow = _Shadow(conv_gm, pairs, rec)
        shadow.run(*flat_inputs(conv_gm, conv_inputs))
    computed = [n for n in conv_gm.graph.nodes if n.op == "call_function" and cast_dtype(n) is None]
    unpaired = [n.name for n in computed if n not in pairs]
    result = LayerwiseResult(shadow.records, sum(1 for n in computed if n in pairs), unpaired)
    result.seconds = perf_counter() - start
    return result
