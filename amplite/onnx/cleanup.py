"""Cast clean-up on an exported ONNX graph (``onnx_ir`` model, edited in place), with counters.

Only rewrites that are exact in every runtime are made, so FP32 islands and the roundings the converted
program performs stay exactly as they were:

* ``identity``: a Cast to the dtype its input already has.
* ``round_trip``: ``Cast(Cast(x, to=W), to=T)`` where ``x``'s dtype embeds exactly in ``W`` (fp16/bf16 →
  fp32, anything float → fp64): the outer Cast reads ``x`` directly, and disappears when ``T`` is ``x``'s
  dtype (``fp16 → fp32 → fp16``). ``fp32 → fp16 → fp32`` rounds, so it is never touched.
* ``duplicate``: two Casts of one value to one dtype.
* ``shape_only``: a Cast read only by Shape/Size (they read the Cast's input instead, same result).
* ``initializer``: an initializer whose only readers are Casts to one narrower dtype, directly or through pure data
  movement (Slice, Gather, Reshape, ...), is stored in that dtype (converted lazily, tensor by tensor, when
  the model is written, with the same round-to-nearest-even as the Cast it replaces).

A Cast whose result is a graph output is kept, so output names and types never change.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir

#: Casts that are exact (every value of the source dtype is representable in the target).
_EXACT = {
    (ir.DataType.FLOAT16, ir.DataType.FLOAT),
    (ir.DataType.BFLOAT16, ir.DataType.FLOAT),
    (ir.DataType.FLOAT16, ir.DataType.DOUBLE),
    (ir.DataType.BFLOAT16, ir.DataType.DOUBLE),
    (ir.DataType.FLOAT, ir.DataType.DOUBLE),
}
_FLOATS = {ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE}
#: Ops that read only their input's shape: a Cast in front of them changes nothing.
_SHAPE_OPS = {"Shape", "Size"}
#: Ops that only move data (input 0): a Cast commutes with them exactly.
MOVEMENT = {"Slice", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Gather", "Expand", "Flatten", "Identity"}


def is_cast(node: ir.Node) -> bool:
    """Whether ``node`` is a standard-domain Cast."""
    return node.op_type == "Cast" and node.domain in ("", "ai.onnx")


def count_casts(model: ir.Model, *, functions: bool = False) -> int:
    """Cast nodes in the main graph (and its subgraphs); with ``functions``, in local function bodies."""
    if functions:
        return sum(1 for fn in model.functions.values() for node in fn if is_cast(node))
    return sum(1 for node in ir.traversal.RecursiveGraphIterator(model.graph) if is_cast(node))


def cast_target(node: ir.Node) -> ir.DataType:
    """The ``to`` dtype of a Cast."""
    return ir.DataType(node.attributes["to"].as_int())


def removable(node: ir.Node) -> bool:
    """Whether ``node``'s first output may disappear (it is not a graph output, whose name must stay)."""
    return not node.outputs[0].is_graph_output()


def _drop(graph: ir.Graph, node: ir.Node, replacement: ir.Value) -> None:
    """Route every reader of ``node``'s output to ``replacement`` and delete ``node``."""
    ir.convenience.replace_all_uses_with(node.outputs[0], replacement)
    graph.remove(node, safe=True)


def lazy_cast(tensor: ir.TensorProtocol, dtype: ir.DataType, name: str) -> ir.LazyTensor:
    """``tensor`` converted to ``dtype`` on demand (no second copy of the weights until written)."""

    def convert() -> ir.TensorProtocol:
        return ir.tensor(np.asarray(tensor.numpy()).astype(dtype.numpy()), dtype=dtype, name=name)

    return ir.LazyTensor(convert, dtype=dtype, shape=ir.Shape(tensor.shape), name=name)


def _cast_readers(value: ir.Value) -> list[ir.Node] | None:
    """The Casts that read ``value``, looking through data movement on input 0; None if another reader."""
    casts = []
    for node, index in value.uses():
        if is_cast(node) and removable(node):
            casts.append(node)
        elif node.op_type in MOVEMENT and node.domain == "" and index == 0 and removable(node):
            inner = _cast_readers(node.outputs[0])
            if not inner:
                return None
            casts += inner
        else:
            return None
    return casts


def _retype_movement(value: ir.Value, dtype: ir.DataType) -> None:
    for node, _ in value.uses():
        if not is_cast(node):
            node.outputs[0].type = ir.TensorType(dtype)
            _retype_movement(node.outputs[0], dtype)


def fold_initializer_casts(graph: ir.Graph, counts: Counter) -> None:
    """Store an initializer in the narrower dtype every reader casts it to (directly or after pure data
    movement such as Slice or Gather, which is exact in any dtype), and drop those Casts."""
    for name, value in list(graph.initializers.items()):
        tensor = value.const_value
        if tensor is None or value.dtype not in _FLOATS or value.is_graph_input() or value.is_graph_output():
            continue
        casts = _cast_readers(value)
        targets = {cast_target(n) for n in casts or ()}
        if not casts or len(targets) != 1 or next(iter(targets)) not in _FLOATS:
            continue
        dtype = targets.pop()
        if dtype.itemsize >= value.dtype.itemsize:  # widening would save a Cast but grow the file
            continue
        new = ir.Value(name=name, type=ir.TensorType(dtype), shape=value.shape,
                       const_value=lazy_cast(tensor, dtype, name))
        graph.initializers.pop(name)
        graph.register_initializer(new)
        ir.convenience.replace_all_uses_with(value, new)
        _retype_movement(new, dtype)
        for node in casts:
            _drop(graph, node, node.inputs[0])
            counts["initializer"] += 1


def _cleanup_once(graph: ir.Graph, counts: Counter) -> bool:
    changed = False
    seen: dict[tuple[int, int], ir.Value] = {}
    for node in list(graph):
        if not is_cast(node) or node.graph is not graph:
            continue
        x, to = node.inputs[0], cast_target(node)
        if x is None:
            continue
        shape_reads = [(use.node, use.idx) for use in node.outputs[0].uses() if use.node.op_type in _SHAPE_OPS
                       and use.node.domain in ("", "ai.onnx")]
        for reader, index in shape_reads:  # a shape does not depend on the dtype
            reader.replace_input_with(index, x)
            changed = True
        if shape_reads and not node.outputs[0].uses() and removable(node):
            graph.remove(node, safe=True)
            counts["shape_only"] += 1
            continue
        if x.dtype == to and removable(node):
            _drop(graph, node, x)
            counts["identity"] += 1
            changed = True
            continue
        inner = x.producer()
        if inner is not None and is_cast(inner) and inner.inputs[0] is not None:
            source = inner.inputs[0]
            if (source.dtype, cast_target(inner)) in _EXACT:
                if source.dtype == to and removable(node):
                    _drop(graph, node, source)
                else:
                    node.replace_input_with(0, source)
                if not x.uses() and removable(inner):
                    graph.remove(inner, safe=True)
                counts["round_trip"] += 1
                changed = True
                continue
        key = (id(x), int(to))
        if key in seen and removable(node):
            _drop(graph, node, seen[key])
            counts["duplicate"] += 1
            changed = True
            continue
        seen.setdefault(key, node.outputs[0])
    return changed


def cleanup_casts(model: ir.Model) -> dict[str, int]:
    """Remove redundant Casts from ``model`` (in place) and fold casts of initializers.

    Returns:
        Counters: ``casts_before``, ``casts_after``, and one per rule (``identity``, ``round_trip``,
        ``duplicate``, ``shape_only``, ``initializer``).
    """
    counts: Counter = Counter({"identity": 0, "round_trip": 0, "duplicate": 0, "shape_only": 0, "initializer": 0})
    before = count_casts(model)
    graph = model.graph
    fold_initializer_casts(graph, counts)
    for _ in range(8):  # each sweep can expose a new round trip; real graphs settle in two
        if not _cleanup_once(graph, counts):
            break
    return {"casts_before": before, "casts_after": count_casts(model), **dict(counts)}


def set_io_dtype(model: ir.Model, low: ir.DataType) -> None:
    """Make FP32 graph inputs and outputs ``low`` with a Cast at each boundary (``cleanup_casts`` then
    removes the round trips this creates against the program's own boundary casts)."""
    graph = model.graph
    for i, value in enumerate(list(graph.inputs)):
        if value.dtype != ir.DataType.FLOAT:
            continue
        new = ir.Value(name=value.name, type=ir.TensorType(low), shape=value.shape)
        value.name = f"{new.name}_fp32"
        cast = ir.node("Cast", [new], attributes={"to": ir.DataType.FLOAT}, num_outputs=1)
        if len(graph):
            graph.insert_before(graph.node(0), cast)
        else:
            graph.append(cast)
        ir.convenience.replace_all_uses_with(value, cast.outputs[0])
        cast.outputs[0].type, cast.outputs[0].shape = ir.TensorType(ir.DataType.FLOAT), value.shape
        graph.inputs[i] = new
    for i, value in enumerate(list(graph.outputs)):
        if value.dtype != ir.DataType.FLOAT:
            continue
        name, value.name = value.name, f"{value.name}_fp32"
        cast = ir.node("Cast", [value], attributes={"to": low}, num_outputs=1)
        graph.append(cast)
        out = cast.outputs[0]
        out.name, out.type, out.shape = name, ir.TensorType(low), value.shape
        graph.outputs[i] = out
