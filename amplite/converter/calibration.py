"""Calibration: value ranges of every node of the FP32 graph over one or more batches.

Feeds the range rules (``amplite.passes.range_guard``): which values would overflow or lose too much
precision in the target dtype.

Fewer than ``COMPILE_FROM`` batches run through ``fx.Interpreter`` (~15 us per node per batch); from
``COMPILE_FROM`` batches on, a copy of the graph with an observer call after every node is compiled to
Python once (``recompile``, ~45 us per node) and runs per batch. Either way, what calibration adds to a
plain forward is one ``aminmax`` pass (``ValueRange.update``) per value the graph computes.
Values holding exactly the elements of another (views, relayouts), a multi-output
node's value seen again through ``getitem`` or as a graph output, and weights (whose ranges the rules do
not read; only their views' ranges, computed on first read) cost no pass of their own.
"""

from __future__ import annotations

import copy
import operator
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx
from torch.fx._pytree import tree_flatten_spec

from amplite.passes.base import PassBase, PassResult
from amplite.passes.range_guard import ValueRange

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
aten = torch.ops.aten
#: Ops whose output holds exactly the elements of their first input (views, copies, relayouts).
_SAME_ELEMENTS = frozenset((
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default, aten.flatten.using_ints,
    aten.unflatten.int, aten.expand.default,
))  # fmt: skip


def _first_float(out: Any) -> torch.Tensor | None:
    """The value a node's range describes: its first floating-point tensor output (e.g. layer norm's result)."""
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
            return t
    return None


class _WeightRange(ValueRange):
    """A weight's :class:`ValueRange`, computed when a field is first read.

    The range rules judge weights themselves (``weight_reason``) and skip get_attr ranges; they read a
    weight's range only through a view of it (which shares this object). Computing it on demand saves a
    pass over every parameter. The result is the eager one exactly: ``update`` once per calibration batch
    on the same tensor, which a graph without in-place ops cannot change during the forward (checked).
    """

    def __init__(self, tensor: torch.Tensor, percentile: float | None) -> None:
        object.__setattr__(self, "_pending", (tensor, tensor._version, percentile, 0))

    def _seen(self) -> None:
        """Count one more calibration batch that read this weight."""
        tensor, version, percentile, batches = object.__getattribute__(self, "_pending")
        object.__setattr__(self, "_pending", (tensor, version, percentile, batches + 1))

    def __getattribute__(self, name: str) -> Any:
        pending = object.__getattribute__(self, "_pending")
        if pending is not None and name in _FIELDS:
            tensor, version, percentile, batches = pending
            if tensor._version != version:
                raise RuntimeError("a weight changed in place after calibration; its range is no longer known")
            object.__setattr__(self, "_pending", None)
            ValueRange.__init__(self)
            for _ in range(batches):
                self.update(tensor, percentile)
        return object.__getattribute__(self, name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ValueRange):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in _FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass


_FIELDS = frozenset(ValueRange.__dataclass_fields__)
#: From this many batches on, the graph is compiled with observer calls: generating and compiling its code
#: costs ~45 us per node once, interpreting it ~15 us per node per batch (measured on DistilBERT's graph).
COMPILE_FROM = 4


class _Observer:
    """Folds node values into ``ranges``: called from the instrumented forward, and around it."""

    def __init__(self, nodes: list[torch.fx.Node], percentile: float | None) -> None:
        self.names = [n.name for n in nodes]
        self.sources = [
            n.args[0].name if n.target in _SAME_ELEMENTS and n.args and isinstance(n.args[0], torch.fx.Node) else None
            for n in nodes
        ]
        self.percentile = percentile
        self.ranges: dict[str, ValueRange] = {}
        #: This batch's updates, by tensor: (weak ref, version, range before, range after), so a value seen
        #: again unchanged (a multi-output node's getitem, a graph output, a tied weight) replays the result.
        self.memo: dict[int, tuple[weakref.ref, int, ValueRange, ValueRange]] = {}

    def value(self, i: int, out: Any) -> None:
        """Node ``i`` computed ``out``: the per-node logic ``fx.Interpreter`` calibration had."""
        src = self.sources[i]
        if src is not None and src in self.ranges:
            # Same elements as its input, laid out anew: the input's range is this value's range exactly
            # (shared, so later batches update both), and no second pass over the data is paid.
            self.ranges.setdefault(self.names[i], self.ranges[src])
            return
        t = _first_float(out)
        if t is not None:
            self._update(self.ranges.setdefault(self.names[i], ValueRange()), t)

    def weight(self, i: int, t: torch.Tensor) -> None:
        """get_attr node ``i`` reads float tensor ``t`` in a forward that writes nothing in place: lazily."""
        r = self.ranges.get(self.names[i])
        if r is None:
            self.ranges[self.names[i]] = r = _WeightRange(t, self.percentile)
        pending = object.__getattribute__(r, "_pending") if isinstance(r, _WeightRange) else None
        if pending is not None and pending[0] is t and pending[1] == t._version:
            r._seen()  # type: ignore[union-attr]
        else:
            self.value(i, t)

    def _update(self, r: ValueRange, t: torch.Tensor) -> None:
        seen = self.memo.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version and seen[2] == r:
            r.__dict__.update({f: getattr(seen[3], f) for f in _FIELDS})  # same update, same state: its result
            return
        before = copy.copy(r)
        r.update(t, self.percentile)
        self.memo[id(t)] = (weakref.ref(t), t._version, before, copy.copy(r))


def _is_float(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _instrument(gm: torch.fx.GraphModule, observer: _Observer, lazy_weights: bool) -> tuple[
        torch.fx.GraphModule, list[int], list[tuple[int, torch.Tensor]]]:
    """A copy of ``gm`` that calls ``observer`` with the values only its forward sees.

    The copy takes ``gm``'s tensor attributes as leading arguments (generating code for an attribute
    lookup per weight would cost more than the forward saves). Placeholders, weights read lazily and the
    output are observed around the call; a view whose source's metadata says it is a float tensor (hence
    recorded) shares that range after the call, in graph order.

    Returns:
        The copy, the indices of the nodes observed around it (in order), and the tensor attributes it
        takes first, with their node indices.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    around: list[int] = []
    weights: list[tuple[int, torch.Tensor]] = []
    nodes = list(gm.graph.nodes)
    for i, node in enumerate(nodes):
        if node.op == "get_attr" and isinstance(t := operator.attrgetter(str(node.target))(gm), torch.Tensor):
            env[node] = graph.placeholder(node.name)
            weights.append((i, t))
    for i, node in enumerate(nodes):
        if node.op == "output":
            graph.output(torch.fx.map_arg(node.args[0], env.__getitem__))
            around.append(i)
            break
        if node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
        src = node.args[0] if node.target in _SAME_ELEMENTS and node.args else None
        if node.op == "placeholder" or (node.op == "get_attr" and lazy_weights) or (
                isinstance(src, torch.fx.Node) and _is_float(src)):
            around.append(i)
        else:
            graph.call_function(observer.value, (i, env[node]))
    return torch.fx.GraphModule(gm, graph), around, weights


def _mutates(gm: torch.fx.GraphModule) -> bool:
    """Whether the forward may write into a tensor in place (then weights are read eagerly)."""
    for n in gm.graph.nodes:
        if n.op in ("call_module", "call_method") and n.target != "_guards_fn":
            return True
        if n.op != "call_function" or getattr(n.target, "__module__", None) == "_operator":  # getitem & co.
            continue
        if not isinstance(n.target, torch._ops.OpOverload) or n.target._schema.is_mutable:
            return True  # an in-place/out= op, or a higher-order op or Python function that might write
    return False


def collect_ranges(
    gm: torch.fx.GraphModule, batches: Iterable[Inputs], percentile: float | None = None
) -> dict[str, ValueRange]:
    """Run ``gm`` (an ``ep.module()`` graph) on every batch and record each node's value range.

    Args:
        gm: The FP32 GraphModule amplite's passes will rewrite (node names are the keys; not modified).
        batches: ``(args, kwargs)`` pairs as the model's forward takes them.
        percentile: Also record this percentile of |value| per node (``--range-percentile``).
    """
    nodes = list(gm.graph.nodes)
    observer = _Observer(nodes, percentile)
    lazy = not _mutates(gm)
    spec = getattr(gm, "_in_spec", None)
    batches = list(batches)
    compiled = len(batches) >= COMPILE_FROM
    if compiled:
        instrumented, around, weights = _instrument(gm, observer, lazy)
        placeholders = [i for i in around if nodes[i].op == "placeholder"]
        tensors = [t for _, t in weights]
    with torch.no_grad():
        for number, (args, kwargs) in enumerate(batches):
            flat = tree_flatten_spec((args, kwargs), spec) if spec is not None else [*args, *kwargs.values()]
            if not compiled:
                _run_batch(number, _Recorder(gm, observer, lazy).run, flat)
            else:
                if lazy:  # the forward writes nothing in place: each get_attr reads this tensor
                    for i, t in weights:
                        if t.dtype.is_floating_point:
                            observer.weight(i, t)
                for i, x in zip(placeholders, flat, strict=False):
                    observer.value(i, x)
                out = _run_batch(number, instrumented, [*tensors, *flat])
                for i in around:
                    if nodes[i].op == "output":
                        observer.value(i, out)
                    elif nodes[i].op not in ("placeholder", "get_attr"):
                        observer.value(i, None)  # a view of a recorded float value: shares its range
            observer.memo.clear()
    return {n.name: observer.ranges[n.name] for n in nodes if n.name in observer.ranges}  # in graph order


def _run_batch(index: int, run: Any, args: list[Any]) -> Any:
    """``run(*args)`` on calibration batch ``index``: a batch the model cannot take is the user's input error
    (exit 2 naming the batch), not an internal one."""
    try:
        return run(*args)
    except Exception as exc:
        from amplite.describe import summarize_exception
        from amplite.errors import InputSpecError

        raise InputSpecError(
            f"calibration batch {index} does not run through the model: {summarize_exception(exc)}",
            "give calibration batches with the example inputs' names, dtypes and shapes",
        ) from exc


class _Recorder(torch.fx.Interpreter):
    """Per-node interpretation feeding the observer: cheaper than compiling for one or two batches."""

    def __init__(self, gm: torch.fx.GraphModule, observer: _Observer, lazy_weights: bool) -> None:
        super().__init__(gm)
        self.observer, self.lazy_weights = observer, lazy_weights
        self.index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.op == "get_attr" and self.lazy_weights and isinstance(out, torch.Tensor) and out.dtype.is_floating_point:
            self.observer.weight(self.index[n], out)
        else:
            self.observer.value(self.index[n], out)
        return out




class Calibrate(PassBase):
    """Calibration as a pass: record the value ranges of the (BatchNorm-folded, not yet planned) FP32 graph.

    The ranges go into ``into``, the mapping the range rules and FP8's static scales were built with (the
    passes after it read it when they run). The graph is not changed.

    Args:
        batches: ``(args, kwargs)`` batches in the program's calling convention.
        percentile: Also record this percentile of |value| per node (``--range-percentile``).
        into: The mapping to fill.
        fp8_scales: Also choose each FP8 input's static scale by its measured error on the batches
            (:func:`amplite.converter.fp8_scales.choose_input_scales`: one more pass over them).
    """

    name = "calibrate"

    def __init__(
        self, batches: list[Inputs], percentile: float | None, into: dict[str, ValueRange], fp8_scales: bool = False
    ) -> None:
        self.batches = batches
        self.percentile = percentile
        self.ranges = into
        self.fp8_scales = fp8_scales

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """Before the plan: the ranges describe the FP32 graph the plan is made on."""
        self.require_unplanned(gm)

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        from amplite.converter.fp8_scales import choose_input_scales, scale_counters

        ranges = collect_ranges(gm, self.batches, self.percentile)
        if self.fp8_scales:
            ranges = choose_input_scales(gm, self.batches, ranges)
        self.ranges.clear()
        self.ranges.update(ranges)
        counters: Counter[str] = Counter(batches=len(self.batches), ranges=len(self.ranges))
        if self.fp8_scales:
            counters.update(scale_counters(gm, ranges))
        return PassResult(gm, False, counters)

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Every computed float tensor of the graph has a range (when there was a batch to run)."""
        if not self.batches:
            return
        for node in gm.graph.nodes:
            if node.op == "call_function" and _is_float(node) and node.name not in self.ranges:
                raise self.broken(f"node {node.name} computes a float tensor but has no calibrated range")
