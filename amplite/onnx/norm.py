"""LayerNormalization without its boundary Casts (``onnx_ir`` model, edited in place).

amplite keeps LayerNorm in FP32 for its statistics. The export writes that island as
``Cast(x16 → fp32) → LayerNormalization(x32, scale32, bias32) → Cast(→ fp16)``. ONNX's LayerNormalization
already computes its statistics in FP32 when ``stash_type=1`` (the default), whatever the input type,
so :func:`stash_layernorms` can rewrite the island as ``LayerNormalization(x16, scale16, bias16,
stash_type=1)``. That is **not** the island's arithmetic under the ONNX specification: its function body
casts the normalised value back to the input type *before* scale and bias, which then run in fp16 (two
more roundings; ``onnx.reference`` differs from the island in about half the elements). ONNX Runtime's CPU
and CUDA kernels happen to compute the whole normalisation in FP32 and round once, as the island did (the
CPU provider has fp16 and bf16 kernels: ``tests/test_onnx_norm.py`` checks both). So the rewrite is an
explicit opt-in for runtimes known to behave so; the default, ``"off"``, keeps the plan's semantics under
the spec. Scale and bias must have the input's dtype, so:

* mode ``"off"`` (the default) leaves every island alone;
* mode ``"stash"`` rewrites only islands whose scale and bias are exactly representable in the low dtype
  (constants, or values an exact Cast widened from it): no parameter is rounded (``"exact"``, its former
  name, is still accepted);
* mode ``"round"`` also rounds scale and bias to the low dtype, as onnxconverter-common does. That costs
  accuracy: one more rounding per element, correlated across tokens (the same scale error in every row).
  Measured with random LayerNorm weights (N(1, 0.3), N(0, 0.1)) in ONNX Runtime without graph
  optimisation: fixture transformer O2 68.4 → 63.8 dB SQNR, DistilBERT O2 66.4 → 60.5 dB.

An island is rewritten only when also:

* ``x`` is the output of an exact Cast from fp16/bf16 to fp32;
* every reader of ``Y`` is a Cast back to that dtype (an FP32 reader would see a rounded value where it
  saw an FP32 one: its island would change);
* ``Mean`` and ``InvStdDev`` are unused, ``Y`` is not a graph output and ``stash_type`` is 1;
* constant scale/bias convert without overflow or a non-zero flushed to zero (mode ``"round"``);
* the Cast count strictly drops (mode ``"round"`` may add a Cast for a non-constant scale or bias).

Graph input and output names and types never change.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from amplite.onnx.cleanup import cast_target, is_cast, lazy_cast, removable

#: Low dtypes with a LayerNormalization kernel in ONNX Runtime's CPU provider (checked by the tests).
LOW = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
#: What :func:`stash_layernorms` may do with scale and bias (see the module docstring).
MODES = ("off", "stash", "round")
#: Former names of modes, still accepted.
ALIASES = {"exact": "stash"}
_STANDARD = ("", "ai.onnx")


def _exact_widening(value: ir.Value) -> ir.Value | None:
    """The fp16/bf16 source of ``value`` when ``value`` is an exact ``Cast(→ fp32)`` of it, else None."""
    cast = value.producer()
    if cast is None or not is_cast(cast) or cast_target(cast) != ir.DataType.FLOAT or cast.inputs[0] is None:
        return None
    source = cast.inputs[0]
    return source if source.dtype in LOW else None


def _converts(tensor: ir.TensorProtocol, low: ir.DataType, mode: str) -> bool:
    """Whether ``tensor`` may be stored in ``low``: exactly (``exact``), or staying finite with non-zero
    values non-zero (``round``)."""
    values = np.asarray(tensor.numpy(), dtype=np.float32)
    with np.errstate(over="ignore", under="ignore"):
        converted = values.astype(low.numpy()).astype(np.float32)
    if mode == "stash":
        return bool(np.array_equal(converted, values, equal_nan=True))
    return bool(np.isfinite(converted[np.isfinite(values)]).all() and (converted[values != 0] != 0).all())


def _operand_plan(value: ir.Value | None, low: ir.DataType, mode: str) -> str | None:
    """How scale or bias becomes ``low``: keep, const, exact, cast; None when it must not."""
    if value is None or value.dtype == low:
        return "keep"
    if value.dtype != ir.DataType.FLOAT:
        return None
    if value.is_initializer() and value.const_value is not None and not value.is_graph_input():
        return "const" if _converts(value.const_value, low, mode) else None
    source = _exact_widening(value)
    if source is not None and source.dtype == low:
        return "exact"
    return "cast" if mode == "round" else None


def _unique_name(graph: ir.Graph, base: str) -> str:
    name, i = base, 1
    while name in graph.initializers:
        name, i = f"{base}_{i}", i + 1
    return name


def _lower_operand(graph: ir.Graph, node: ir.Node, index: int, plan: str, low: ir.DataType) -> None:
    value = node.inputs[index]
    if plan == "keep" or value is None:
        return
    if plan == "exact":
        node.replace_input_with(index, _exact_widening(value))
    elif plan == "cast":
        cast = ir.node("Cast", [value], attributes={"to": low})
        cast.outputs[0].dtype, cast.outputs[0].shape = low, value.shape
        graph.insert_before(node, cast)
        node.replace_input_with(index, cast.outputs[0])
    else:  # a constant: stored in the low dtype, in place when this LayerNorm is its only reader
        only_reader = all(use.node is node for use in value.uses()) and not value.is_graph_output()
        name = value.name if only_reader else _unique_name(graph, f"{value.name}_{low.name.lower()}")
        new = ir.Value(name=name, type=ir.TensorType(low), shape=value.shape,
                       const_value=lazy_cast(value.const_value, low, name))
        if only_reader:
            graph.initializers.pop(value.name)
            graph.register_initializer(new)
            ir.convenience.replace_all_uses_with(value, new)
        else:
            graph.register_initializer(new)
            node.replace_input_with(index, new)


def _try_stash(graph: ir.Graph, node: ir.Node, mode: str) -> bool:
    """Rewrite one LayerNormalization when every condition of the module docstring holds."""
    x = node.inputs[0]
    source = _exact_widening(x) if x is not None else None
    stash = node.attributes.get("stash_type")
    if source is None or (stash is not None and stash.as_int() != 1):
        return False
    low, y = source.dtype, node.outputs[0]
    if y.is_graph_output() or any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        return False
    readers = [use.node for use in y.uses()]
    if not readers or not all(is_cast(r) and cast_target(r) == low for r in readers):
        return False
    plans = [_operand_plan(node.inputs[i] if len(node.inputs) > i else None, low, mode) for i in (1, 2)]
    if None in plans:
        return False
    input_cast = x.producer()
    drops_input = all(use.node is node for use in x.uses()) and removable(input_cast)
    removed = int(drops_input) + sum(removable(r) for r in readers)
    if removed <= plans.count("cast"):
        return False
    for index, plan in zip((1, 2), plans, strict=True):
        _lower_operand(graph, node, index, plan, low)
    node.replace_input_with(0, source)
    if drops_input:
        graph.remove(input_cast, safe=True)
    node.attributes["stash_type"] = ir.AttrInt64("stash_type", 1)
    y.dtype = low
    for reader in readers:
        if removable(reader):  # a Cast at a graph output stays (its name is the output's), now fp16 → fp16
            ir.convenience.replace_all_uses_with(reader.outputs[0], y)
            graph.remove(reader, safe=True)
    return True


def stash_layernorms(model: ir.Model, mode: str = "off") -> int:
    """Run the island's LayerNorms on the low dtype with FP32 statistics (``stash_type=1``), in place.

    Args:
        model: The exported model.
        mode: ``"off"`` (the default), ``"stash"`` (only where scale and bias are exact in the low
            dtype), or ``"round"`` (round them). Both rewrites assume a runtime that computes the whole
            normalisation in FP32 (ONNX Runtime does; the ONNX spec rounds before scale and bias).

    Returns:
        How many LayerNormalization nodes were rewritten.

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`.
    """
    mode = ALIASES.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    graph = model.graph
    count = 0
    for node in list(graph) if mode != "off" else ():
        if node.op_type == "LayerNormalization" and node.domain in _STANDARD and node.graph is graph:
            count += _try_stash(graph, node, mode)
    return count
