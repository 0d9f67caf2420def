"""FP32 islands for ops the model's opset cannot compute in its low dtype (``onnx_ir`` model, in place).

ONNX added bfloat16 to operators over many opsets: ``Einsum`` has no bf16 before opset 28, while the bf16
default is 22 (where Conv, GRU and pooling gained it). A node whose low-precision inputs its schema does not
allow at the model's opset, but FP32 is allowed, and that no opset up to the bf16 default would allow,
becomes ``Cast(→ fp32) → op → Cast(→ low)`` (an op that a newer opset up to 22 fixes gets the one-line
"use --opset 22" error instead). That is the
plan's own arithmetic: widening bf16/fp16 to FP32 is exact, and torch computes a bf16 einsum with FP32
accumulation and rounds its result once, as the Cast back does. So every bf16 (or fp16) model exports at
the default opset, and ``onnx.checker`` accepts it.

Guarantees afterwards: no standard-domain node of the main graph reads or writes a float type its schema
excludes at the model's opset, unless FP32 is excluded too or opset 22 would include it (left alone:
``onnx.checker`` names it and the error names the opset that has it). Graph
input and output names and types never change.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

_STANDARD = ("", "ai.onnx")
_LOW = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16)


def _allowed(schema: onnx.defs.OpSchema) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """Type strings of the schema's formal inputs and outputs, and each type parameter's allowed types."""
    constraints = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    return [i.type_str for i in schema.inputs], [o.type_str for o in schema.outputs], constraints


def _types_of(formal: list[str], index: int, constraints: dict[str, list[str]]) -> list[str]:
    """Allowed types of actual argument ``index`` (a variadic last formal covers the rest)."""
    if not formal:
        return []
    type_str = formal[min(index, len(formal) - 1)]
    return constraints.get(type_str, [type_str])


def _needs_island(node: ir.Node, opset: int, fixable_up_to: int) -> bool:
    """Whether ``node`` has a low-precision input or output its schema rejects at ``opset`` but FP32 fits,
    and no opset up to ``fixable_up_to`` accepts it (then a newer ``--opset`` is the better fix)."""
    if node.domain not in _STANDARD:
        return False
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    ins, outs, constraints = _allowed(schema)
    bad = False
    for values, formal in ((node.inputs, ins), (node.outputs, outs)):
        for i, v in enumerate(values):
            if v is None or v.dtype not in _LOW:
                continue
            allowed = _types_of(formal, i, constraints)
            if f"tensor({_name(v.dtype)})" not in allowed:
                newer = first_opset_with(node.op_type, _name(v.dtype), opset)
                if "tensor(float)" not in allowed or (newer is not None and newer <= fixable_up_to):
                    return False
                bad = True
    return bad


def first_opset_with(op_type: str, type_name: str, after: int) -> int | None:
    """The first opset above ``after`` whose ``op_type`` accepts ``tensor(type_name)`` (None: none yet)."""
    for version in range(after + 1, onnx.defs.onnx_opset_version() + 1):
        try:
            schema = onnx.defs.get_schema(op_type, version, "")
        except onnx.defs.SchemaError:
            return None
        if any(f"tensor({type_name})" in c.allowed_type_strs for c in schema.type_constraints):
            return version
    return None


def _name(dtype: ir.DataType) -> str:
    return {ir.DataType.BFLOAT16: "bfloat16", ir.DataType.FLOAT16: "float16"}[dtype]


def _cast(value: ir.Value, to: ir.DataType) -> ir.Node:
    cast = ir.node("Cast", [value], attributes={"to": to})
    cast.outputs[0].dtype, cast.outputs[0].shape = to, value.shape
    return cast


def fp32_islands(model: ir.Model, fixable_up_to: int = 22) -> dict[str, int]:
    """Wrap every node that needs it (:func:`_needs_island`) in Casts to FP32 and back.

    Args:
        model: The exported model (edited in place).
        fixable_up_to: An op that gains the dtype by this opset is left alone: ``onnx.checker`` then asks
            for that opset (a bf16 Conv at ``--opset 20`` wants 22, the bf16 default, not an island).

    Returns:
        ``{"fp32_islands": nodes wrapped, "<OpType>": count per op type}``.
    """
    graph = model.graph
    opset = model.opset_imports.get("", 1)
    counts: dict[str, int] = {"fp32_islands": 0}
    for node in [n for n in graph if _needs_island(n, opset, max(opset, fixable_up_to))]:
        for i, v in enumerate(node.inputs):
            if v is not None and v.dtype in _LOW:
                cast = _cast(v, ir.DataType.FLOAT)
                graph.insert_before(node, cast)
                node.replace_input_with(i, cast.outputs[0])
        for out in node.outputs:
            if out.dtype not in _LOW:
                continue
            readers = list(out.uses())  # before the Cast back becomes one
            back = _cast(out, out.dtype)
            graph.insert_after(node, back)
            for reader, index in readers:
                reader.replace_input_with(index, back.outputs[0])
            if out.is_graph_output():  # the graph output keeps its name and type: the Cast writes it
                name = out.name
                graph.outputs[graph.outputs.index(out)] = back.outputs[0]
                out.name, back.outputs[0].name = f"{name}_fp32", name
            out.dtype = ir.DataType.FLOAT
        counts["fp32_islands"] += 1
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts
